"""``ddiloco export`` and the model files runs end with: the global model Θ as the model's own
``state_dict``, equal to what the synchronizer serves bit for bit (from its state directory —
checkpoint plus round log — or from the running synchronizer), the eval loss the run reported,
and every bad input refused in one line with nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import reference_layout
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.sync.round_log import RoundLog
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.runtime.sync.state_dir import load_latest
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual
from ddiloco.testing import InProcessSync, train_steps, versions, wait_for
from ddiloco.workload.model_file import parameters
from ddiloco.workload.workload import Workload

CONFIG = build_config(preset="tiny", overrides=("run.learners=1", "run.tokens=1000000000"))
"""A budget the run never spends: spent, the run would finish and write a checkpoint of its own (a
learner that waits for a merge trains on meanwhile, more steps the busier the machine)."""


class Run:
    """A synchronizer that wrote a checkpoint and then merged rounds only its round log holds."""

    def __init__(self, root: Path) -> None:
        self.state = root / "state"
        # Checkpoints only when asked: the rounds after the one below are in the round log alone.
        self.sync = InProcessSync(CONFIG, ServiceOptions(state_dir=self.state, checkpoint_every_rounds=10**6,
                                                         checkpoint_every_s=10**6))
        self.address = f"127.0.0.1:{self.sync.port}"
        self.workload = Workload.build(CONFIG)
        self.model = self.workload.new_model()
        self.runtime = LearnerRuntime(self.model, self.address, "learner-0")
        period = CONFIG.protocol.period
        with SyncClient(self.address) as client:
            train_steps(self.runtime, self.workload, self.model, 0, 2 * period)
            wait_for(lambda: min(versions(client)) >= 1, "a round of every fragment merged")
            self.sync.call(self.sync.service.checkpoint)
            checkpointed = max(f["version"] for f in load_latest(self.state)["core"]["fragments"].entries)
            train_steps(self.runtime, self.workload, self.model, 0, period,  # merged after the checkpoint
                        until=lambda: min(versions(client)) > checkpointed)
            self.runtime.close()  # its last contributions sent: nothing merges after the state below
            wait_for(lambda: client.status_dict()["pending_tokens"] == 0, "every contribution merged")
            self.theta = client.fetch_state()
            self.checkpointed = checkpointed
        self.plan = reference_layout(CONFIG, CONFIG.protocol.for_mode(CONFIG.run.mode, 1))

    def expected(self) -> dict[str, torch.Tensor]:
        """Θ by parameter name, as the synchronizer serves it."""
        return parameters(self.plan.plan, self.plan.shapes, {f.fragment: f.values for f in self.theta.fragments})

    def close(self) -> None:
        self.sync.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    r = Run(tmp_path_factory.mktemp("export"))
    try:
        yield r
    finally:
        r.close()


def test_the_exported_model_is_the_synchronizers_theta_bit_for_bit_from_its_state_dir_and_over_the_wire(
        run: Run, tmp_path: Path) -> None:
    assert run.sync.service.writer.checkpoints == 1 and run.checkpointed < min(run.theta.versions())
    expected = run.expected()
    for args in ([str(run.state), str(tmp_path / "dir.safetensors")],
                 ["--from", run.address, str(tmp_path / "wire.safetensors")]):
        assert main(["export", *args]) == 0
        exported = load_file(args[-1])
        for name, value in expected.items():
            assert torch.equal(exported[name], value), name
        model = run.workload.new_model()
        model.load_state_dict(exported)  # strict: the tied head's name is in the file too
        assert torch.equal(model.head.weight, expected["tok_emb.weight"])
    with SyncClient(run.address) as client:  # --from registered no learner
        assert [lr["id"] for lr in client.status_dict()["learners"]] == ["learner-0"]


def test_bf16_is_theta_rounded_to_bf16(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "bf16.safetensors"
    assert main(["export", str(run.state), str(out), "--dtype", "bf16"]) == 0
    exported = load_file(out)
    for name, value in run.expected().items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], value.to(torch.bfloat16))


def test_the_learners_export_is_its_copy_of_the_global_model(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "learner.safetensors"
    run.runtime.export(out)
    exported = load_file(out)
    model = run.workload.new_model()
    model.load_state_dict(exported)
    anchors = {f.index: run.runtime.core.anchor(f.index) for f in run.plan.plan.fragments}
    for name, value in parameters(run.plan.plan, run.plan.shapes, anchors).items():
        assert torch.equal(exported[name], value), name


def test_a_virtual_run_ends_with_its_model_file_which_gives_the_eval_loss_it_reported(tmp_path: Path) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2",))
    summary, _ = run_virtual(config, out=tmp_path)
    workload = Workload.build(config)
    model = workload.new_model()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert workload.evaluate(model) == pytest.approx(summary["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_a_run_of_real_processes_ends_with_its_model_file_which_gives_the_eval_loss_it_reported(tmp_path: Path) -> None:
    import json

    assert main(["run", "--runtime", "processes", "--preset", "tiny", "--learners", "2", "--tokens", "12288",
                 "--out", str(tmp_path)]) == 0  # a few rounds are enough to check the model file
    summary = json.loads((tmp_path / "summary.json").read_text())
    workload = Workload.build(build_config(preset="tiny", overrides=("run.learners=2",)))
    model = workload.new_model()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert workload.evaluate(model) == pytest.approx(summary["eval_loss"], rel=1e-4)


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ddiloco: error: "), err
    return err


def test_a_directory_that_holds_no_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path), str(out)]) == 2
    assert "holds no run" in one_line_error(capsys) and not out.exists()


def test_a_damaged_fragment_file_is_one_line_and_nothing_is_written(
        run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    shutil.copytree(run.state, state, ignore=shutil.ignore_patterns("lock"))
    fragment = next(state.glob("checkpoint-*/fragment-00001.safetensors"))
    data = bytearray(fragment.read_bytes())
    data[-3] ^= 0xFF
    fragment.write_bytes(bytes(data))
    out = tmp_path / "model.safetensors"
    assert main(["export", str(state), str(out)]) == 2
    assert "fragment-00001.safetensors is damaged" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_round_log_of_another_run_is_one_line(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    shutil.copytree(run.state, state, ignore=shutil.ignore_patterns("lock"))
    foreign = RoundLog(state, {"layout_sha256": "ab" * 32, "shard": 0})
    foreign.append(0, 99, False, b"x").result(timeout=30)
    foreign.close()
    out = tmp_path / "model.safetensors"
    assert main(["export", str(state), str(out)]) == 2
    assert "belongs to another run" in one_line_error(capsys) and not out.exists()


def test_an_out_that_exists_is_kept_unless_forced(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"mine")
    assert main(["export", str(run.state), str(out)]) == 2
    assert "--force" in one_line_error(capsys) and out.read_bytes() == b"mine"
    assert main(["export", str(run.state), str(out), "--force"]) == 0
    assert set(load_file(out)) >= set(run.expected())


def test_a_sharded_synchronizers_directories_export_together(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=1", "protocol.shards=2"))
    shards = [InProcessSync(config, ServiceOptions(state_dir=tmp_path / f"shard-{s}", shard=s)) for s in range(2)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in shards]
        clients = [SyncClient(a) for a in addresses]
        workload = Workload.build(config)
        model = workload.new_model()
        runtime = LearnerRuntime(model, addresses, "learner-0")
        train_steps(runtime, workload, model, 0, config.protocol.period,
                    until=lambda: all(min(versions(c)) >= 1 for c in clients))
        runtime.close()
        for c in clients:
            wait_for(lambda c=c: c.status_dict()["pending_tokens"] == 0, "every contribution merged")
        theta = {f.fragment: f.values for c in clients for f in c.fetch_state().fragments}
        for c in clients:
            c.close()
    finally:
        for s in shards:
            s.close()  # each writes its final checkpoint
    out = tmp_path / "model.safetensors"
    assert main(["export", f"{tmp_path / 'shard-0'},{tmp_path / 'shard-1'}", str(out)]) == 0
    layout = reference_layout(config, config.protocol.for_mode(config.run.mode, 1))
    exported = load_file(out)
    for name, value in parameters(layout.plan, layout.shapes, theta).items():
        assert torch.equal(exported[name], value), name
    out.unlink()
    assert main(["export", str(tmp_path / "shard-0"), str(out)]) == 2
    assert "give them all, comma-separated" in one_line_error(capsys) and not out.exists()


def test_a_run_of_another_model_than_the_one_named_is_one_line(run: Run, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from ddiloco.runtime.learner.runtime import save_initial_state

    toy = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    save_initial_state(toy, tmp_path / "toy.safetensors")
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run.state), str(out), "--init", str(tmp_path / "toy.safetensors")]) == 2
    assert "holds a run of another model than the --init file given" in one_line_error(capsys) and not out.exists()
