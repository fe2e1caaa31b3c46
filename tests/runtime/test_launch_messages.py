"""Issue 57, items 5 and 6: ``ddiloco launch``'s messages named ``ddiloco sync``'s options (its
``--state-dir``, ``ddiloco sync --init``, ``ddiloco sync ... --resume``), a command its user never
typed; and a refused launch left its logs and ``sync.port`` behind. Each message now names the
command the user typed and its options, and a refused launch leaves nothing it made."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.commands.launch import _say_changes
from ddiloco.runtime import script_env
from ddiloco.runtime.layout import SERVE_UNDER_LAUNCH, LayoutMismatch
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.testing import InProcessSync
from own_models import TiedLM, tiny_config

COMMAND = ["--learners", "2", "--", "python", "train.py"]


def a_run_kept_in(state_dir: Path) -> None:
    """A real synchronizer's state directory, as a stopped launch leaves it (a checkpoint)."""
    sync = InProcessSync(tiny_config(), ServiceOptions(state_dir=state_dir))
    try:
        sync.call(sync.service.checkpoint)
    finally:
        sync.close()


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_new_launch_into_a_kept_run_names_launchs_out_and_resume(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    a_run_kept_in(out / "sync-state")
    assert main(["launch", "--out", str(out), *COMMAND]) == 2
    err = one_line(capsys)
    assert f"--out {str(out)!r} already holds a run" in err and "pass --resume" in err
    assert "--state-dir" not in err and "ddiloco sync" not in err
    assert not (out / "logs").exists()  # refused before anything started


def test_resume_where_no_run_is_kept_names_launchs_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["launch", "--out", str(out), "--resume", *COMMAND]) == 2
    err = one_line(capsys)
    assert f"--resume: --out {str(out)!r} holds no run to continue" in err and "--state-dir" not in err
    assert not out.exists()


def test_a_launched_copy_whose_model_is_not_served_is_told_about_launchs_init(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = InProcessSync(tiny_config(), ServiceOptions())  # the reference model: a launch without --init
    monkeypatch.setenv(script_env.CONNECT, f"127.0.0.1:{sync.port}")
    monkeypatch.setenv(script_env.LEARNER_ID, "learner-0")
    try:
        with pytest.raises(LayoutMismatch) as refused:
            LearnerRuntime.from_env(TiedLM(), join_timeout_s=30)
    finally:
        sync.close()
    assert str(refused.value).endswith(SERVE_UNDER_LAUNCH) and "ddiloco launch --init" in SERVE_UNDER_LAUNCH
    assert "ddiloco sync" not in str(refused.value)


def test_resume_with_another_number_of_learners_says_what_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Issue 57, item 9: ``--resume --learners 3`` on a run of 2 learners was accepted silently."""
    state = tmp_path / "out" / "sync-state"
    a_run_kept_in(state)  # a run of tiny_config()'s learners
    learners = tiny_config().run.learners
    _say_changes(state, learners + 1, None, None)  # ddiloco launch says it on its own output (not the sync's log)
    assert f"launch: resuming the run in {state} with --learners {learners + 1} (the run had {learners})" in \
        capsys.readouterr().err
    with caplog.at_level("WARNING", logger="ddiloco.sync"):
        resumed = InProcessSync(replace(tiny_config(), run=replace(tiny_config().run, learners=learners + 1)),
                                ServiceOptions(state_dir=state, resume=Resume.REQUIRED))
        resumed.close()
    assert f"resuming the run with --learners {learners + 1} (the run had {learners})" in caplog.text
