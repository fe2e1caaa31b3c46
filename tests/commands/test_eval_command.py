"""Issue 57, item 8: loading a run's exported model needed the source (the reference model is
built from the run's configuration by code a user had to find). ``ddiloco eval MODEL.safetensors``
prints the eval loss the run reported, from the run's config.toml beside the file or --preset;
every bad input is one line, exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual

pytestmark = pytest.mark.slow  # a whole (tiny) virtual run: 19 s at a load of 14

@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("run")
    summary, _ = run_virtual(build_config(preset="tiny", overrides=("run.learners=2",)), out=out)
    return out, summary["eval_loss"]


def test_eval_of_a_runs_model_file_prints_the_loss_the_run_reported(run, capsys: pytest.CaptureFixture[str]) -> None:
    out, reported = run
    assert main(["eval", str(out / "model.safetensors")]) == 0  # the run's config.toml is beside it
    assert f"eval loss {reported:.4f} nats/byte" in capsys.readouterr().out


def test_a_model_file_away_from_its_run_takes_the_preset(run, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out, reported = run
    shutil.copy(out / "model.safetensors", tmp_path / "m.safetensors")
    assert main(["eval", str(tmp_path / "m.safetensors"), "--preset", "tiny", "--set", "run.learners=2"]) == 0
    assert f"eval loss {reported:.4f} nats/byte" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["nope.safetensors"], "'nope.safetensors': no such file"),
    (["{copy}"], "No config.toml beside it: pass --config"),
    (["{model}", "--preset", "small"], "holds another model than this configuration's reference model"),
    (["{config}", "--preset", "tiny"], "is not a model file"),
])
def test_bad_input_is_one_line(run, tmp_path: Path, args: list[str], says: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run
    shutil.copy(out / "model.safetensors", tmp_path / "copy.safetensors")
    paths = {"{model}": str(out / "model.safetensors"), "{copy}": str(tmp_path / "copy.safetensors"),
             "{config}": str(out / "config.toml")}
    assert main(["eval", *(paths.get(a, a) for a in args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
