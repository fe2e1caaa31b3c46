"""TensorBoard event files: written beside metrics.jsonl, complete when the run ends, same values."""

from __future__ import annotations

import json

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddiloco.cli import main
from ddiloco.outputs.tb_log import EventLog, write_run_events


def read_events(logdir) -> EventAccumulator:
    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_run_writes_event_file_matching_metrics_jsonl(tmp_path):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("It was the best of times, it was the worst of times. " * 400)
    out = tmp_path / "out"
    assert main(["run", "--preset", "tiny", "--corpus", str(corpus), "--seed", "5", "--tokens", "8000",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 3
    assert len(list(out.glob("events.out.tfevents.*"))) == 1

    events = read_events(out)
    tags = set(events.Tags()["scalars"])
    assert {"eval_loss", "goodput", "uptime", "bytes_up", "bytes_down", "virtual_time_s", "alive"} <= tags
    versions = len(rows[-1]["fragment_versions"])
    assert {f"fragment_versions/{i}" for i in range(versions)} <= tags

    loss = events.Scalars("eval_loss")
    assert len(loss) == len(rows)
    assert [e.step for e in loss] == [r["tokens"] for r in rows]
    assert [e.value for e in loss] == [float(np.float32(r["eval_loss"])) for r in rows]
    assert [e.wall_time for e in loss] == [r["virtual_time_s"] for r in rows]
    last = [e.value for e in events.Scalars(f"fragment_versions/{versions - 1}")]
    assert last == [float(r["fragment_versions"][-1]) for r in rows]


def test_rewriting_a_run_replaces_its_event_file(tmp_path):
    rows = [{"virtual_time_s": 0.0, "tokens": 0, "eval_loss": 5.0, "fragment_versions": [0, 0]},
            {"virtual_time_s": 1.5, "tokens": 64, "eval_loss": 4.0, "fragment_versions": [1, 0]}]
    write_run_events(tmp_path, rows)
    write_run_events(tmp_path, rows[:1])
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert [e.value for e in read_events(tmp_path).Scalars("eval_loss")] == [5.0]


def test_event_log_writes_numbers_and_lists_of_numbers(tmp_path):
    with EventLog(tmp_path / "learner-0") as log:
        log.add(50, {"train_loss": 2.5, "fragment_versions": [3, 4], "backlog": 1, "note": "skipped"})
        log.add(100, {"train_loss": 2.25, "fragment_versions": [4, 4], "backlog": 0, "note": "skipped"})
    events = read_events(tmp_path / "learner-0")
    assert sorted(events.Tags()["scalars"]) == ["backlog", "fragment_versions/0", "fragment_versions/1",
                                                "train_loss"]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(50, 2.5), (100, 2.25)]
    assert [e.value for e in events.Scalars("fragment_versions/0")] == [3.0, 4.0]
