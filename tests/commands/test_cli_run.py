"""`ddiloco run` / `compare` from the command line: outputs, overrides and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ddiloco
from ddiloco.cli import main


def error_line(capsys, argv) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--set", "protocol.quorum=9"], "K=9"),
        (["--set", "protocol.period=0"], "protocol.period"),
        (["--set", "protocol.codec=int3"], "'int3'"),
        (["--mode", "ring"], "'ring'"),
        (["--corpus", "/nonexistent/dir"], "/nonexistent/dir"),
        (["--mtbf", "-1"], "mtbf_s"),
        (["--downtime", "-5"], "downtime_s"),
        (["--set", "protocol.bogus=1"], "protocol.bogus"),
        (["--set", "nosection"], "nosection"),
        (["--set", "run.learners=two"], "run.learners"),
        (["--preset", "huge"], "'huge'"),
        (["--learners", "x"], "'x'"),
        (["--config", "/nonexistent.toml"], "/nonexistent.toml"),
        (["--tokens", "5", "--time", "5"], "--time"),
        (["--seed", "-1"], "-1"),
        (["--seed", "99999999999999999999999"], "99999999999999999999999"),
        (["--device", "cuda:99"], "cuda:99"),
        (["--set", "cluster.late_learners=4"], "cluster.late_learners=4"),
        (["--set", "cluster.late_learners=1", "--mode", "diloco"], "run.mode=decoupled"),
        (["--set", "cluster.late_learners=3", "--set", "protocol.quorum=2"], "protocol.quorum=2"),
        (["--set", "cluster.late_join_s=-1"], "cluster.late_join_s"),
        # Issue 45: a typo listed every key and suggested none.
        (["--set", "protocol.fragmnets=4"], "unknown key protocol.fragmnets: did you mean protocol.fragments?"),
        (["--set", "train.fragments=4"], "unknown key train.fragments: did you mean protocol.fragments?"),
        (["--set", "protocl.period=4"], "unknown section 'protocl': did you mean protocol?"),
        # Issue 45: accepted and silently ignored by real processes; now refused, pointing at chaos.
        (["--runtime", "processes", "--mtbf", "30", "--downtime", "5"], "--mtbf 30: --runtime processes takes no"),
        (["--runtime", "processes", "--downtime", "5"], "--downtime 5: --runtime processes takes no"),
        (["--runtime", "processes", "--set", "faults.mtbf_s=30"], "faults.mtbf_s=30: real processes take no"),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_creates_nothing(capsys, tmp_path, argv, needle):
    out = tmp_path / "out" / "run"
    assert needle in error_line(capsys, ["run", "--preset", "tiny", "--out", str(out), *argv])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--seed", "-2"], ["--seed", str(2**63)], ["--corpus", "/nonexistent/dir"]])
def test_compare_refuses_bad_input_before_creating_its_directory(capsys, tmp_path, argv):
    out = tmp_path / "cmp"
    assert argv[1] in error_line(capsys, ["compare", "--preset", "tiny", "--out", str(out), *argv])
    assert not out.exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["simtest", "--seeds", "1", "--first-seed", "-1"], "--first-seed"),
    (["goodput", "--seed", "-1"], "--seed"),
    (["learner", "--connect", "127.0.0.1:1", "--id", "learner-0", "--seed", "-1"], "--seed"),
    (["status", "127.0.0.1:1", "--timeout", "-1"], "--timeout"),
    (["status", "127.0.0.1:1", "--timeout", "inf"], "--timeout"),
])
def test_other_commands_refuse_bad_values_in_one_line(capsys, argv, needle):
    assert needle in error_line(capsys, argv)


def test_out_that_cannot_be_created_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    assert "is not a directory" in error_line(capsys, ["run", "--preset", "tiny", "--out", str(tmp_path / "file" / "x")])


def test_version_and_help_texts(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"ddiloco {ddiloco.__version__}"
    helps = {}
    for command in ("run", "compare", "learner", "status", "sync"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert "(default: tiny 15, small 120, default 90; real processes: 0)" in helps["run"]
    assert "(default: tiny 4, small 20, default 15)" in helps["run"]
    assert "0 = none (default: 0)" in helps["compare"] and "stays down (default: 60)" in helps["compare"]
    assert "size preset: tiny, small, default" in helps["learner"]
    assert "(default 5)" in helps["status"]
    for command in ("learner", "sync"):
        assert "log messages of this level and above" in helps[command]


def test_empty_corpus_dir_is_refused(capsys, tmp_path):
    assert str(tmp_path) in error_line(capsys, ["run", "--preset", "tiny", "--corpus", str(tmp_path)])


def test_unknown_toml_key_is_refused(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[protocol]\nquorum = 1\nwibble = 3\n")
    assert "protocol.wibble" in error_line(capsys, ["run", "--preset", "tiny", "--config", str(bad)])


@pytest.mark.slow
def test_run_writes_config_metrics_plot_and_summary(tmp_path, capsys):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("It was the best of times, it was the worst of times. " * 400)
    out = tmp_path / "out"
    assert main(["run", "--preset", "tiny", "--corpus", str(corpus), "--set", "protocol.quorum=2",
                 "--seed", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("mode", "learners", "tokens", "eval_loss", "goodput", "uptime", "bytes_up", "bytes_down",
                "virtual_time_s", "fragment_versions", "weights_sha256"):
        assert key in summary
    assert summary["mode"] == "decoupled" and summary["seed"] == 3
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 3
    config_text = (out / "config.toml").read_text()
    assert "quorum = 2" in config_text and str(corpus) in config_text
    # the resolved config loads again and reproduces the run
    again = tmp_path / "again"
    assert main(["run", "--config", str(out / "config.toml"), "--preset", "tiny", "--out", str(again)]) == 0
    assert json.loads((again / "summary.json").read_text())["weights_sha256"] == summary["weights_sha256"]


@pytest.mark.slow
def test_compare_runs_all_modes_on_one_trace(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "compare", "--preset", "tiny", "--mtbf", "40", "--downtime", "10",
         "--time", "80", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "compare.json").read_text())
    assert [r["mode"] for r in rows] == ["decoupled", "diloco", "dp", "dp-elastic"]
    assert (out / "compare.png").exists()
    assert "decoupled" in proc.stdout and "dp-elastic" in proc.stdout
