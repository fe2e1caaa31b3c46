"""The synchronizer's memory: transients bounded by a fragment, a shard that reads only its own
fragments, status while a merge runs, and files that are not what they should be.

Memory is measured as peaks (VmHWM) in a fresh process: ``clear_refs`` resets the peak, then
the operation runs, and its peak above the resident size before it must stay within about a
fragment's worth — where the code before fragment-by-fragment transfers and checkpoints
copied the whole state (twice for a checkpoint).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ddiloco.core.shared import kernels
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.messages import Contribution
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import layout_from_file
from ddiloco.runtime.sync.memory import check_memory, memory_plan
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.service import ServiceOptions, SyncService
from ddiloco.runtime.sync.state_dir import StateDir
from ddiloco.settings.config_sources import build_config
from ddiloco.settings.units import human_bytes, human_count
from ddiloco.testing import Honest, versions, wait_for
from ddiloco.workload.checkpoint import CheckpointError

FRAGMENTS = 12
NUMEL = 2_000_000
MEASURE = f"""
import json, sys, torch
from pathlib import Path
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime import wire
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.state_dir import StateDir

P, N = {FRAGMENTS}, {NUMEL}

def field(name):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024

def peak_above(run):
    before = field("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the resident size
    run()
    return field("VmHWM") - before

def lean(sync):
    for f in sync._fragments.values():  # as after the first rounds: the whole outer state exists
        f.momentum = torch.randn(N).bfloat16()
        f.residual = torch.randint(-127, 128, (N,), dtype=torch.int8)
        f.residual_scales = torch.rand(N // 128)
    return sync

config = ProtocolConfig(fragments=P, period=P, quorum=1, lease_s=1e9)
sync = lean(Synchronizer(config, [torch.randn(N) for _ in range(P)]))
state = StateDir(Path(sys.argv[1]), resume=Resume.IF_PRESENT)

def checkpoint():
    draft = state.begin(1)
    for p in sync.owned:
        draft.add_fragment(p, sync.fragment_state(p))
    draft.commit({{"core": sync.checkpoint_meta(), "service": {{}}}})

def transfer():
    for p in sync.owned:
        value = sync.fragment_value(p)
        for chunk in wire.fragment_chunks(value):
            chunk.SerializeToString()
        del value

out = {{"checkpoint": peak_above(checkpoint), "transfer": peak_above(transfer)}}
restored = lean(Synchronizer(config, [torch.zeros(N) for _ in range(P)]))
out["restore"] = peak_above(lambda: restored.load_state_dict(state.load()["core"]))
assert [torch.equal(a.value, b.value) and torch.equal(a.momentum, b.momentum) and torch.equal(a.residual, b.residual)
        for a, b in zip(sync._fragments.values(), restored._fragments.values())] == [True] * P
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_checkpoint_a_restore_and_a_state_transfer_each_hold_about_one_fragment(tmp_path):
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout)
    fragment_state = 7 * NUMEL  # fp32 value, bf16 momentum, int8 residual
    whole = FRAGMENTS * fragment_state
    slack = 16 << 20  # allocator and interpreter noise
    # a checkpoint: one fragment's copy (written from its own memory); a restore: one fragment's
    # tensors as read and what replaces the state they restore; a transfer: one fp32 value
    assert peaks["checkpoint"] <= fragment_state + slack, (peaks, whole)
    assert peaks["restore"] <= 2 * fragment_state + slack, (peaks, whole)
    assert peaks["transfer"] <= 4 * NUMEL + slack, (peaks, whole)


def write_model(path: Path, fragments: int, numel: int) -> None:
    tensors = {f"w{i:02d}": torch.randn(numel) for i in range(fragments)}
    save_file(tensors, str(path), metadata={"embedding_names": "[]", "param_order": json.dumps(list(tensors))})


def sharded(shards: int) -> tuple:
    config = build_config(preset="tiny", overrides=("protocol.fragments=8", "protocol.period=8",
                                                    f"protocol.shards={shards}"))
    return config, config.protocol.for_mode(config.run.mode, config.run.learners)


def test_a_shard_reads_only_its_own_fragments_from_the_init_file(tmp_path):
    config, protocol = sharded(4)
    write_model(tmp_path / "init.safetensors", 8, 1000)
    layout = layout_from_file(tmp_path / "init.safetensors", protocol)
    asked: list[int] = []

    class Spy(list):
        def __len__(self) -> int:
            return len(layout.initial_values)

        def __getitem__(self, p):
            asked.append(p)
            return layout.initial_values[p]

    service = SyncService(config, ServiceOptions(shard=1), layout=replace(layout, initial_values=Spy()))
    assert asked == [1, 5] == list(service.core.owned)


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "other model"])
def test_a_bad_init_file_is_one_line_naming_it(tmp_path, damage):
    _, protocol = sharded(1)
    path = tmp_path / "init.safetensors"
    write_model(path, 8, 1000)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "not safetensors":
        path.write_text("these are not weights")
    else:
        save_file({"w": torch.zeros(3)}, str(path), metadata={"param_order": '["x"]'})
    with pytest.raises(ConfigError, match=r"--init '.*init\.safetensors'"):
        layout_from_file(path, protocol)


def checkpointed(tmp_path: Path, inproc_sync) -> tuple:
    config = build_config(preset="tiny", overrides=("run.learners=1", "run.tokens=1000000000"))
    state = tmp_path / "state"
    s = inproc_sync(config, ServiceOptions(state_dir=state))
    s.close()
    return config, state


@pytest.mark.parametrize("damage", ["fragment bytes", "manifest", "pointer", "legacy"])
def test_a_damaged_checkpoint_is_refused_with_one_line_and_nothing_is_overwritten(tmp_path, inproc_sync, damage):
    config, state = checkpointed(tmp_path, inproc_sync)
    held = StateDir(state, resume=Resume.REQUIRED)
    folder = held.current
    held.close()
    if damage == "fragment bytes":
        target = sorted(folder.glob("fragment-*.safetensors"))[0]
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
        expected = r"fragment-00000\.safetensors is damaged"
    elif damage == "manifest":
        target = folder / "manifest.json"
        target.write_text(target.read_text()[:-20])
        expected = r"manifest\.json is damaged"
    elif damage == "pointer":
        target = state / "CURRENT"
        target.write_text("elsewhere")
        expected = "not a checkpoint folder"
    else:
        target = state / "synchronizer.safetensors"
        (state / "CURRENT").unlink()
        target.write_bytes(b"old")
        expected = "older ddiloco"
    before = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=expected):
        SyncService(config, ServiceOptions(state_dir=state, resume=Resume.REQUIRED))
    assert {p: p.read_bytes() for p in state.rglob("*") if p.is_file()} == before


def test_a_checkpoint_of_other_shards_is_refused(tmp_path, inproc_sync):
    config, protocol = sharded(2)
    state = tmp_path / "state"
    inproc_sync(config, ServiceOptions(state_dir=state, shard=0)).close()
    with pytest.raises(CheckpointError, match=r"holds fragments \[0, 2, 4, 6\], this synchronizer owns \[1, 3, 5, 7\]"):
        SyncService(config, ServiceOptions(state_dir=state, shard=1, resume=Resume.REQUIRED))


def test_a_host_with_less_memory_than_the_model_needs_is_refused_at_start():
    plan = memory_plan([41_666_667] * 24, learners=8, lean=True, block_size=128, transfers=8)
    # 1B parameters at M = 8: 7 B/param of state; the bound has every round open with 8 payloads
    assert 7.0e9 < plan.state < 7.1e9 and plan.peak < 20e9
    check_memory(plan, available=int(20e9))  # fits this 24 GB host
    with pytest.raises(ConfigError, match=r"needs up to 1\d\.\d GB for 1B parameters .* 8 GB available"):
        check_memory(plan, available=int(8e9))


def test_the_merge_kernels_release_the_gil():
    for kernel in (kernels._outer_step_block, kernels._axpy_block, kernels._stats_block, kernels.norm_squared):
        assert kernel.targetoptions.get("nogil") is True, kernel


def test_status_answers_while_the_core_is_busy_merging(inproc_sync):
    config = build_config(preset="tiny", overrides=("run.learners=1", "run.tokens=1000000000", "protocol.quorum=1"))
    s = inproc_sync(config)
    core = s.service.core
    hold, merging, release = threading.Event(), threading.Event(), threading.Event()
    handle = core.handle

    def slow_handle(event, now):
        if hold.is_set() and isinstance(event, Contribution):
            merging.set()
            release.wait(60)  # the merge goes on until the test has had its status
        return handle(event, now)

    core.handle = slow_handle
    learner = Honest(config, s.port, "learner-0", 0)
    try:
        with SyncClient(f"127.0.0.1:{s.port}") as client:
            wait_for(lambda: [lr["id"] for lr in client.status_dict()["learners"]] == ["learner-0"], "the join")
            hold.set()
            assert merging.wait(120), "no contribution reached the core"
            status = client.status_dict()  # answered while the core's thread is held
            assert [lr["id"] for lr in status["learners"]] == ["learner-0"]
            release.set()
            wait_for(lambda: max(versions(client)) >= 1, "a merge after the release")
    finally:
        release.set()
        learner.close()


def test_fragment_files_are_safetensors_any_reader_opens(tmp_path):
    from safetensors.torch import load_file

    from ddiloco.runtime.sync.state_dir import read_tensors, write_tensors

    tensors = {"value": torch.randn(300), "momentum": torch.randn(300).bfloat16(),
               "residual": torch.randint(-127, 128, (300,), dtype=torch.int8), "residual_scales": torch.rand(3)}
    size, sha = write_tensors(tmp_path / "f.safetensors", tensors)
    assert size == (tmp_path / "f.safetensors").stat().st_size
    for read in (load_file(str(tmp_path / "f.safetensors")), read_tensors(tmp_path / "f.safetensors", sha)):
        assert set(read) == set(tensors) and all(torch.equal(read[k], tensors[k]) for k in tensors)


def test_a_small_model_is_described_in_units_a_person_reads():
    """Issue 45: the tiny preset's start line said 'synchronizer memory for 3.4e-05B parameters'."""
    plan = memory_plan([20_000, 13_952], learners=2, lean=True, block_size=64, transfers=2)
    line = plan.describe()
    assert line.startswith("33,952 parameters: state ") and "e-0" not in line and " MB" in line, line
    assert human_count(7e9) == "7B" and human_count(1_234_567) == "1.23M" and human_bytes(512_000) == "512 kB"
