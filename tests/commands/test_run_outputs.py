"""What a virtual run writes as it goes and shows at the end: files that survive Ctrl-C and
SIGTERM, live figures that are the summary's, a report that fits 80 columns, and the story
of data parallel's rollbacks."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddiloco.commands import display
from ddiloco.commands.display import COLUMNS, compare_story, print_report, what_happened
from ddiloco.commands.live_view import live_view
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import Interrupted, run_virtual
from ddiloco.testing import wait_for

MAIN_JOB = build_config(preset="tiny", main_job=True)


def read_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def scalars(out, tag: str) -> list[float]:
    events = EventAccumulator(str(out))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def test_rows_reach_the_disk_as_they_are_recorded_and_ctrl_c_keeps_them(tmp_path):
    on_disk = []

    def progress(fraction: float, row: dict) -> None:
        on_disk.append(len(read_rows(tmp_path)))
        if len(on_disk) == 3:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted) as stop:
        run_virtual(MAIN_JOB, progress=progress, out=tmp_path)
    assert on_disk == [1, 2, 3]  # each row was in metrics.jsonl before the run went on
    rows = read_rows(tmp_path)
    assert rows == stop.value.rows and len(rows) == 3
    assert len(scalars(tmp_path, "eval_loss")) == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == stop.value.summary
    assert summary["interrupted"] is True and 0 < summary["done"] < 1 and "weights_sha256" not in summary
    assert (summary["eval_loss"], summary["eval_at_s"]) == (rows[-1]["eval_loss"], rows[-1]["virtual_time_s"])
    assert summary["tokens"] >= rows[-1]["tokens"] and summary["events"]["merges"] >= rows[-1]["merges"]
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "config.toml").exists()
    assert what_happened(summary, slow_factor=1.18)[0].startswith(f"Interrupted at {summary['done']:.0%} of the budget")


@pytest.mark.slow
def test_sigterm_stops_ddiloco_run_keeping_its_files(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "run", "--preset", "tiny", "--tokens", "10000000",
         "--set", "train.evals=5000", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists() and len(read_rows(out)) >= 3, "three metrics rows", 120)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "ddiloco: interrupted at" in stderr
    rows = read_rows(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["eval_loss"] == rows[-1]["eval_loss"]
    assert len(scalars(out, "eval_loss")) == len(rows) >= 3


def test_the_live_views_last_figures_are_the_summarys(tmp_path):
    screen = io.StringIO()
    with live_view("decoupled M=4", Console(file=screen, force_terminal=False, width=200)) as (progress, observer):
        summary, rows = run_virtual(MAIN_JOB, progress=progress, observer=observer, out=tmp_path)
    lines = screen.getvalue().splitlines()
    assert [line for line in lines if "100%" in line] == [lines[-1]]  # the final line, once
    events = summary["events"]
    assert events["failures"] > 0
    assert lines[-1].endswith(f"goodput so far {summary['goodput']:.0%} · failures {events['failures']} · "
                              f"rejoins {events['rejoins']} · merges {events['merges']}")
    assert read_rows(tmp_path) == rows
    assert rows[-1]["goodput"] == summary["goodput"] and rows[-1]["merges"] == events["merges"]
    assert scalars(tmp_path, "goodput")[-1] == pytest.approx(summary["goodput"], rel=1e-6)


def test_the_terminal_views_last_frame_is_the_summarys():
    config = build_config(preset="tiny", main_job=True, run__tokens=1)  # ends in the drain's merges
    screen = io.StringIO()
    with live_view("decoupled M=4", Console(file=screen, force_terminal=True, width=120)) as (progress, observer):
        summary, _ = run_virtual(config, progress=progress, observer=observer)
    events = summary["events"]
    assert events["merges"] > 0
    last_frame = screen.getvalue().rsplit("decoupled M=4", 1)[1]
    assert f"merges {events['merges']} · failures {events['failures']} · rejoins {events['rejoins']}" in last_frame
    assert f"goodput so far {summary['goodput']:.0%}" in last_frame


def rendered(monkeypatch, width: int, summaries: list[dict], story: list[str], **kwargs) -> str:
    screen = io.StringIO()
    monkeypatch.setattr(display, "report_console", lambda: Console(file=screen, width=width))
    print_report(summaries, "ddiloco compare", story, **kwargs)
    return screen.getvalue()


@pytest.fixture(scope="module")
def failures_dp() -> list[dict]:
    """Both data-parallel baselines through a tiny, failure-heavy trace."""
    return [run_virtual(build_config(preset="tiny", run__mode=mode, faults__mtbf_s=30.0, faults__downtime_s=10.0,
                                     run__time_s=150.0))[0] for mode in ("dp", "dp-elastic")]


@pytest.mark.parametrize("count", [1, 2])
def test_the_report_at_80_columns_cuts_no_value(monkeypatch, failures_dp, count):
    summaries = failures_dp[:count]
    story = compare_story(summaries, slow_factor=1.18, mtbf_s=30.0, downtime_s=10.0)
    text = rendered(monkeypatch, 80, summaries, story)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for summary in summaries:
        for _, cell in COLUMNS:
            assert cell(summary) in text
    assert {word for line in story for word in line.split()} <= set(text.split())  # the whole panel, beside or below
    wide = rendered(monkeypatch, 200, summaries, story)
    assert "what happened" in wide.splitlines()[0]  # side by side where both fit
    assert "what happened" not in rendered(monkeypatch, 200, summaries, story, beside=False).splitlines()[0]


def test_data_parallel_says_why_its_loss_jumps(failures_dp):
    dp, elastic = failures_dp
    rollbacks = dp["events"]["rollbacks"]
    worst = max(rollbacks, key=lambda r: r["lost_steps"])
    assert worst["lost_steps"] > 0 and worst["checkpoint_s"] < worst["failed_at_s"] < worst["resumed_at_s"]
    words = " ".join(what_happened(dp, slow_factor=1.18))
    assert f"{len(rollbacks)} times the whole job stopped" in words
    assert (f"The failure at t={worst['failed_at_s']:.0f} s cost {worst['lost_steps']} steps: at "
            f"t={worst['resumed_at_s']:.0f} s it went back to its checkpoint of t={worst['checkpoint_s']:.0f} s") in words
    assert f"reconfigure {elastic['events']['reconfigurations']} times" in " ".join(what_happened(elastic, slow_factor=1.18))
    story = compare_story(failures_dp, slow_factor=1.18, mtbf_s=30.0, downtime_s=10.0)
    assert story[0].startswith("One failure trace for every mode") and story[1].startswith("dp: ")
    assert story[2].startswith("dp-elastic: ")


def test_a_live_views_last_line_ends_before_the_next_line_in_a_log():
    """Issue 45: in a log, ddiloco chaos's live view and its baseline's first line ran on one line
    ("status page http://...sync: status page at http://..."): rich ends a live view's last line
    only on a terminal."""
    import io

    from rich.console import Console
    from rich.table import Table

    from ddiloco.commands.display import live_lines

    out = io.StringIO()
    log = Console(file=out, width=100)
    grid = Table.grid()
    grid.add_row("status page http://127.0.0.1:1/")
    with live_lines(grid, log) as live:
        live.console.print("an event")
    print("sync: status page at http://127.0.0.1:2/", file=out)
    assert out.getvalue().splitlines()[-2:] == ["status page http://127.0.0.1:1/",
                                                "sync: status page at http://127.0.0.1:2/"]


def test_a_sigterm_while_a_row_is_written_leaves_metrics_and_events_the_same_rows(tmp_path, monkeypatch):
    """The signal arrives between the row's two files (sent from inside the TensorBoard write): the
    interrupt waits until both hold the row, so the files never disagree about how far the run got."""
    from ddiloco.commands.interrupt import sigterm_as_interrupt
    from ddiloco.outputs import reporting

    real_add_row = reporting.add_row

    def add_row_signalled(events, row):
        os.kill(os.getpid(), signal.SIGTERM)
        real_add_row(events, row)

    monkeypatch.setattr(reporting, "add_row", add_row_signalled)
    writer = reporting.RunWriter(tmp_path, build_config(preset="tiny"))
    row = {"tokens": 0, "virtual_time_s": 0.0, "eval_loss": 5.5}
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        writer.add_row(row)
    assert len(read_rows(tmp_path)) == len(scalars(tmp_path, "eval_loss")) == 1
