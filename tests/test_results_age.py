"""``benchmarks/results_age.py`` reads which commits a results file names and how far the
protocol core moved since: what says which figures need measuring again."""

from __future__ import annotations

import subprocess

import results_age as age


def test_a_file_names_its_stamps_commit_and_its_rows_commits_once_each():
    data = {"commit": "abc1234", "runs": [{"commit": "abc1234"}, {"commit": "def5678+uncommitted changes in src/"},
                                          {"commit": "before 0123abc (the runs' own were not recorded)"}]}
    assert age.named_commits(data) == ["abc1234", "def5678", "0123abc"]
    assert age.named_commits({"rows": []}) == []


def test_nothing_changed_the_core_after_the_checkouts_own_commit_and_an_unknown_commit_is_unknown():
    head = subprocess.run(["git", "-C", str(age.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert head, "the tests run from a git checkout (the README's clone)"
    assert age.core_changes_since([head]) == 0
    assert age.core_changes_since(["fffffff"]) is None
    assert age.core_changes_since([]) is None


def test_a_file_that_keeps_earlier_figures_on_purpose_is_history_not_stale():
    kept = age.Age(age.ROOT / "x.json", ["abc1234"], core_changes=3, cited_by=[], history="the bug, before its fix")
    old = age.Age(age.ROOT / "y.json", ["abc1234"], core_changes=3, cited_by=[], history=None)
    current = age.Age(age.ROOT / "z.json", ["abc1234"], core_changes=0, cited_by=[], history=None)
    assert (kept.stale, old.stale, current.stale) == (False, True, False)
