"""docs/quickstart.md's sample output is what its command prints (issue 29).

The sample had drifted (eval loss 3.1032 and goodput 72.6% in the doc, other figures from the
same seed) although the docs stress bit-identical runs. ``scripts/quickstart_sample.py``
regenerates it from a run and keeps the run in ``docs/results/quickstart_tiny.json``: the doc
must be that file's rendering (fast), and the file what the command gives today (slow).

The run is bit-for-bit reproducible on one machine and torch build, not across CPUs: torch's
CPU kernels round differently by instruction set, so the trained weights (and so the eval loss,
the merge coherence and the weights hash) differ in their last digits on another x86-64 CPU
(eval loss 3.1029 there for 3.1030 here once failed this test on a fresh machine, issue 44).
What the seed fixes on any CPU — the failure trace, the virtual clock, every merge, version,
byte and event — is compared exactly; the figures of float arithmetic are compared to
:data:`ACROSS_CPUS` and then rendered from the recorded run, so the rest of the table must
still match to the character.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "quickstart_sample.py"
REGENERATE = "run `python scripts/quickstart_sample.py` to regenerate the sample from a run"


def load_script():
    spec = importlib.util.spec_from_file_location("quickstart_sample", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sample = load_script()


def test_the_docs_sample_is_the_recorded_run():
    results = json.loads(sample.RESULTS.read_text())
    report, metrics_line = sample.doc_samples(sample.DOC.read_text())
    assert "\n".join(line.rstrip() for line in report.splitlines()) == sample.render_report(results["summary"]), \
        REGENERATE
    assert metrics_line == results["metrics_line"], REGENERATE
    assert results["command"] == "ddiloco run --preset tiny" and "ddiloco run --preset tiny" in sample.DOC.read_text()


ACROSS_CPUS = {"eval_loss": {"rel": 2e-3}, "merge_coherence": {"abs": 0.01}}
"""The figures of the trained weights, and how far another x86-64 CPU may move them (the main job's
eval loss moved by 0.13% between two machines' CPUs, issue 44); docs/quickstart.md states it."""
NOT_COMPARED = ("wall_time_s", "weights_sha256")
"""How long the run took, and the hash of weights that differ in their last bits across CPUs."""


def with_recorded_floats(today: dict, recorded: dict) -> dict:
    """``today`` with the figures of float arithmetic checked against ``recorded`` to their
    tolerance, then taken from it (so a render compares everything else to the character)."""
    for key, tolerance in ACROSS_CPUS.items():
        if key in recorded:
            assert today[key] == pytest.approx(recorded[key], **tolerance), f"{key}: {REGENERATE}"
    return {**today, **{key: recorded[key] for key in (*ACROSS_CPUS, *NOT_COMPARED) if key in recorded}}


def test_only_the_figures_of_float_arithmetic_are_compared_with_a_tolerance():
    recorded = {"eval_loss": 3.1030, "merge_coherence": 0.8194, "tokens": 50944, "wall_time_s": 2.4}
    other_cpu = {**recorded, "eval_loss": 3.1029, "merge_coherence": 0.8190, "wall_time_s": 4.1}
    assert with_recorded_floats(other_cpu, recorded) == recorded
    with pytest.raises(AssertionError, match="eval_loss"):
        with_recorded_floats({**other_cpu, "eval_loss": 3.2}, recorded)  # a change of the code, not the CPU
    assert with_recorded_floats({**other_cpu, "tokens": 50000}, recorded)["tokens"] == 50000  # compared exactly later


@pytest.mark.slow
def test_the_recorded_run_is_what_the_command_gives_today(tmp_path):
    recorded = json.loads(sample.RESULTS.read_text())
    today = sample.run_quickstart(tmp_path)
    summary = with_recorded_floats(today["summary"], recorded["summary"])
    assert summary == recorded["summary"], REGENERATE
    assert sample.render_report(summary) == sample.render_report(recorded["summary"]), REGENERATE
    metrics = with_recorded_floats(json.loads(today["metrics_line"]), json.loads(recorded["metrics_line"]))
    expected = json.loads(recorded["metrics_line"])
    assert metrics.keys() == expected.keys(), REGENERATE
    for key, value in expected.items():  # approx per float: pytest >= 9.2 refuses an approx of nested values
        assert metrics[key] == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value), (key, REGENERATE)
