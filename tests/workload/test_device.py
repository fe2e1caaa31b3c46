"""`--device`: learners train where they are told, an absent device is one line, the CPU run is unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from ddiloco.cli import main
from ddiloco.core.shared.errors import ConfigError
from ddiloco.workload.device import process_group_backend, resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the absent-device error cannot show")


def test_names_resolve_to_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"


@pytest.mark.parametrize(("name", "needle"), [("tpu", "'tpu'"), ("cuda:x", "cuda:N"), ("", "expected one of")])
def test_unknown_devices_are_refused_by_name(name, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("command", [["run", "--preset", "tiny"], ["compare", "--preset", "tiny"],
                                     ["learner", "--connect", "127.0.0.1:1", "--id", "learner-0"]])
def test_an_absent_gpu_is_one_line_and_a_non_zero_exit(capsys, command):
    assert main([*command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda" in err and "CUDA is not available" in err, err


def test_a_cpu_run_is_the_default_run_on_a_cpu_machine(tmp_path):
    """``--device cpu`` trains the same weights as before the option existed (the CPU path is unchanged)."""
    runs = {}
    for name, extra in (("cpu", ["--device", "cpu"]), ("plain", [] if not torch.cuda.is_available() else ["--device", "cpu"])):
        out = tmp_path / name
        assert main(["run", "--preset", "tiny", "--tokens", "6144", "--out", str(out), *extra]) == 0
        runs[name] = json.loads((out / "summary.json").read_text())
    assert runs["cpu"]["eval_loss"] == runs["plain"]["eval_loss"]
    assert runs["cpu"]["tokens"] >= 6144
