"""Issue 45: ``ddiloco --version``, ``--help``, ``status`` and their bad-input errors import no
torch (it alone costs 2-3 s of CPU; ``ddiloco --version`` took 3.3 s). Each command runs in a
fresh interpreter, which then says which heavy modules it imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddiloco.testing import DEADLINE_S, free_port, status_of, sync_args, wait_for

HEAVY = ("torch", "numba", "numpy")
PROBE = """
import json, sys
from ddiloco.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def probe(*argv: str) -> tuple[int, list[str], str, str]:
    """(exit code, heavy modules imported, stdout, stderr without the probe's line) of ``ddiloco ARGV``."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=DEADLINE_S)
    *lines, last = done.stderr.splitlines()
    report = json.loads(last)
    return report["code"] or 0, report["heavy"], done.stdout, "\n".join(lines)


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"], ["bandwidth", "--help"],
                                  ["launch", "--help"], ["export", "--help"]])
def test_version_and_help_import_no_torch(argv: list[str]) -> None:
    code, heavy, out, _ = probe(*argv)
    assert code == 0 and heavy == [], (argv, heavy)
    assert "ddiloco" in out


def test_the_help_still_lists_every_command() -> None:
    from ddiloco.cli import NAMES

    _, _, out, _ = probe("--help")
    assert all(name in out for name in NAMES)


@pytest.mark.parametrize("argv, error", [
    (["status", "nohost"], "address 'nohost': expected HOST:PORT"),
    (["status", "127.0.0.1:7000", "--page", "-1"], "--page -1: must be >= 0"),
    (["status", "127.0.0.1:7000", "--timeout", "0"], "must be a positive number of seconds"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    # The run's configuration is checked before what trains it is imported (the protocol's choices,
    # the model's sizes and --resume's choices in torch-free modules: core/shared/choices.py,
    # settings/workload_settings.py, runtime/sync/resume.py).
    (["run", "--set", "protocol.quorum=abc"], "protocol.quorum must be int, got 'abc'"),
    (["run", "--learners", "0"], "run.learners must be >= 1, got 0"),
    (["compare", "--seed", "-1"], "run.seed must be an integer from 0 to 2**63 - 1, got -1"),
    (["chaos", "--set", "nope.x=1"], "unknown section 'nope'"),
    (["sync", "--preset", "nope"], "unknown preset 'nope'"),
    (["sync", "--resume"], "--resume needs --state-dir"),
])
def test_bad_input_before_a_model_is_built_is_one_line_without_torch(argv: list[str], error: str) -> None:
    code, heavy, _, err = probe(*argv)
    assert code == 2 and heavy == []
    assert len(err.splitlines()) == 1 and err.startswith("ddiloco: error: ") and error in err, err


def test_export_of_an_empty_directory_is_one_line_without_torch(tmp_path) -> None:
    """Issue 57: the error cost 1.4 s of CPU, the import of torch before the directory was looked at."""
    (tmp_path / "empty").mkdir()
    for argv in (["export", str(tmp_path / "empty"), str(tmp_path / "m.safetensors")], ["eval", "nope.safetensors"]):
        code, heavy, _, err = probe(*argv)
        assert code == 2 and heavy == [], (argv, heavy)
        assert len(err.splitlines()) == 1 and ("holds no run" in err or "no such file" in err), err


def test_status_of_an_unreachable_synchronizer_is_one_line_without_torch() -> None:
    port = free_port()
    code, heavy, _, err = probe("status", f"127.0.0.1:{port}", "--timeout", "1")
    assert code == 2 and heavy == []
    assert err.startswith(f"ddiloco: error: cannot reach the synchronizer at 127.0.0.1:{port}") and "\n" not in err


@pytest.mark.slow
def test_status_of_a_running_synchronizer_imports_no_torch_and_says_refused_once(procs, tmp_path) -> None:
    port = free_port()
    token = tmp_path / "token"
    token.write_text("right")
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong")
    procs.start("sync", *sync_args(port, "--tokens", str(10**9), "--token-file", str(token)))
    wait_for(lambda: status_of(port, token="right"), "the synchronizer to answer")
    code, heavy, out, _ = probe("status", f"127.0.0.1:{port}", "--token-file", str(token), "--json")
    assert code == 0 and heavy == []
    assert json.loads(out)["phase"] and json.loads(out)["learners"] == []
    code, heavy, _, err = probe("status", f"127.0.0.1:{port}", "--token-file", str(wrong))
    assert code == 2 and heavy == []
    # was "the synchronizer at X refused: the synchronizer at X refused our credentials (...)"
    assert err.count("refused") == 1 and err.startswith(f"ddiloco: error: the synchronizer at 127.0.0.1:{port} "
                                                        "refused our credentials"), err
