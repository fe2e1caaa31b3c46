"""Issue 54: every result README cites was measured under this tree's protocol decisions (its
behaviour fingerprint, ``ddiloco fingerprint``); docs may cite older results as history."""

from __future__ import annotations

import pytest
import results_age as age

from ddiloco.sim.behaviour_fingerprint import fingerprint


def test_a_file_names_its_fingerprint_and_is_current_only_under_the_trees():
    assert age.fingerprints({"fingerprint": "abc", "runs": [{"fingerprint": "abc"}]}) == ["abc"]
    assert age.fingerprints({"commit": "abc1234"}) == []
    marked = age.Age(age.ROOT / "x.json", ["abc1234"], core_changes=5, cited_by=[], history=None, fingerprint="f1",
                     tree="f1")
    moved = age.Age(age.ROOT / "y.json", ["abc1234"], core_changes=0, cited_by=[], history=None, fingerprint="f0",
                    tree="f1")
    unmarked = age.Age(age.ROOT / "z.json", ["abc1234"], core_changes=0, cited_by=[], history=None, tree="f1")
    assert (marked.stale, moved.stale, unmarked.stale) == (False, True, False)


@pytest.mark.slow
def test_every_result_readme_cites_carries_the_trees_fingerprint():
    tree = fingerprint()[0]
    rows = age.ages(tree)
    off = [a for a in rows if "README.md" in a.cited_by and a.history is None and a.fingerprint != tree]
    assert not off, "README cites results measured under other protocol decisions than this tree's " \
                    f"(fingerprint {tree}):\n" + "\n".join(
                        f"  {a.path.name}: fingerprint {a.fingerprint or 'none'}; measure it again: "
                        f"python benchmarks/refresh.py --only {a.path.name}" for a in off)
