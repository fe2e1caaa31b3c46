"""Host staging of a learner's Δ and updates: unchanged on the CPU, asynchronous on a GPU.

The CPU tests run everywhere: the contract the sender thread relies on (``Send.ready``
before compression), updates decoded ahead give the same merge as updates decoded by the
core, and staging hands CPU sends on untouched. The CUDA tests skip without a GPU; they
check that the training thread's side (taking Δ, staging it, applying an update) makes no
synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")`` raises on one), that
what the sender compresses is Δ, that Δ is copied straight into its slot where the slots are
pinned (and updates out of theirs), and that a learner runtime on the GPU trains and merges.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import Admitted, Broadcast, Send, SendJoin
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.fragments import flatten, plan_fragments
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime.learner.out_slots import OutSlots
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.learner.slots import Slot, SlotArea, SlotLayout
from ddiloco.runtime.learner.staging import HostStaging, checked_after
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import train_steps
from ddiloco.workload.workload import Workload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the staging path for accelerators)")
SHAPES = [("embed", (16, 4)), ("w1", (8, 8)), ("w2", (8, 8)), ("w3", (4, 8))]
CONFIG = ProtocolConfig(fragments=3, period=3, codec="fp32", downlink_codec="int4", lease_s=1e6)


def joined_learner(device: str = "cpu") -> tuple[Learner, dict[str, torch.Tensor], Synchronizer]:
    g = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=g) for name, shape in SHAPES}
    plan = plan_fragments(SHAPES, num_fragments=CONFIG.fragments, period=CONFIG.period, embedding_names=["embed"])
    sync = Synchronizer(CONFIG, [flatten([params[n] for n in f.param_names]) for f in plan.fragments],
                        embedding_fragments=[f.index for f in plan.fragments if f.is_embedding])
    params = {name: t.to(device) for name, t in params.items()}
    core = Learner("l0", CONFIG, plan, params, boot="b0")
    (join,) = [a for a in core.start(0.0) if isinstance(a, SendJoin)]
    reply = sync.handle(join.message, 0.0)[0]
    assert isinstance(reply, Admitted)
    core.on_admitted(sync.state_for(reply.state), 0.0)
    return core, params, sync


def staging_for(core: Learner, device: str, *, ahead: bool = False) -> HostStaging:
    """The runtime's staging (``ahead``: decoding every update, also those the core would apply from the payload)."""
    fragments = core.plan.fragments
    return HostStaging(torch.device(device), get_codec(CONFIG.downlink_codec), [f.numel for f in fragments],
                       [not ahead and core.decodes_updates(f.index) for f in fragments])


def train_until_sends(core: Learner, params: dict[str, torch.Tensor]) -> list[Send]:
    with torch.no_grad():
        for p in params.values():
            p.add_(0.01)
    sends: list[Send] = []
    while not sends:
        sends = core.record_step(10, 0.1, 1.0)
    return sends


def first_update(sync: Synchronizer, send: Send) -> FragmentUpdate:
    (update,) = [a.update for a in sync.handle(send.encode(), 1.0) if isinstance(a, Broadcast)]
    return update


def test_the_sender_waits_for_ready_before_it_compresses():
    delta = torch.zeros(8)
    core, params, _ = joined_learner()
    (send, *_) = train_until_sends(core, params)
    late = dataclasses.replace(send, delta=delta, ready=lambda: delta.fill_(2.5))  # the copy lands in ready()
    assert torch.equal(get_codec("fp32").decode(late.encode().payload, 8), torch.full((8,), 2.5))


def test_on_the_cpu_staging_hands_sends_on_untouched():
    core, params, _ = joined_learner()
    sends = train_until_sends(core, params)
    staging = staging_for(core, "cpu")
    assert not staging.asynchronous
    assert all(a is b for a, b in zip(staging.stage(list(sends)), sends))


def test_an_update_decoded_ahead_merges_exactly_like_one_decoded_by_the_core():
    results = []
    for ahead in (False, True):
        core, params, sync = joined_learner()
        sends = train_until_sends(core, params)
        update = first_update(sync, sends[0])
        values = staging_for(core, "cpu", ahead=True).decode(update) if ahead else None
        core.on_update(update, 2.0, values=values)
        results.append((core.versions, [t.clone() for t in params.values()]))
    assert results[0][0] == results[1][0] and results[0][0][sends[0].fragment] == 1
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_an_update_that_does_not_fit_is_left_to_the_core_to_refuse():
    core, params, sync = joined_learner()
    update = first_update(sync, train_until_sends(core, params)[0])
    staging = staging_for(core, "cpu", ahead=True)
    assert staging.decode(update) is not None and staging_for(core, "cpu").decode(update) is None  # the core's own
    assert staging.decode(dataclasses.replace(update, codec="fp32")) is None
    assert staging.decode(dataclasses.replace(update, payload=update.payload[:-1])) is None
    assert staging.decode(dataclasses.replace(update, fragment=99)) is None
    with pytest.raises(ValueError, match="decoded values"):
        core.on_update(update, 2.0, values=torch.zeros(3))


def test_a_payload_compressed_on_a_device_is_refused_after_the_wait_if_delta_was_not_finite():
    codec, waited = get_codec("int4"), []
    for x, refused in ((torch.ones(300), False), (torch.tensor([1.0, float("nan"), 2.0] * 100), True)):
        payload = codec.encode_tensor(x).numpy()
        ready = checked_after(lambda: waited.append(True), codec, payload, x.numel())
        if refused:
            with pytest.raises(ValueError, match="non-finite"):
                ready()
        else:
            ready()
    assert waited == [True, True]  # the copy is waited for before the payload is read


@cuda
def test_int4_on_a_gpu_sends_the_bytes_the_host_codec_would():
    codec, delta = get_codec("int4"), torch.randn(1000, device="cuda")
    staging = HostStaging(torch.device("cuda"), codec, [1000], [False])
    (staged,) = staging.stage([Send(header=None, delta=delta, codec=codec)])  # type: ignore[arg-type]
    staged.ready()
    assert staged.delta is None and staged.encoded.tobytes() == codec.encode(delta.cpu())
    update = FragmentUpdate(fragment=0, version=1, codec="int4", payload=codec.encode(delta.cpu()))
    assert torch.equal(staging.decode(update).cpu(), codec.decode(update.payload, 1000))


@cuda
def test_on_a_gpu_delta_lands_straight_in_its_pinned_slot_and_updates_leave_from_theirs():
    codec, delta, numel = get_codec("int4"), torch.randn(1000, device="cuda"), 1000
    size = codec.encoded_size(numel)
    staging = HostStaging(torch.device("cuda"), codec, [numel], [False])
    slots = SlotArea(SlotLayout((size,), (size,)))
    outs = OutSlots(slots, staging)
    assert outs.pinned and staging.registered == slots.address()
    header = Contribution("l0", Session(1, 1), 0, 0, 1, 16, 1, 0.1, 0.1, "int4", b"")
    send = Send(header=header, delta=delta, codec=codec)
    (first,) = staging.stage([send])
    (second,) = staging.stage([send])  # the first is still on its way into the slot: a pinned buffer
    assert np.may_share_memory(first.encoded, slots.payload(Slot.OUT, 0))
    assert not np.may_share_memory(second.encoded, slots.payload(Slot.OUT, 0))
    expected = codec.encode(delta.cpu())
    first.ready()
    seq = outs.finish(first)
    assert slots.read(Slot.OUT, 0, seq) == expected
    second.ready()
    later = outs.finish(second)
    assert later > seq and slots.read(Slot.OUT, 0, later) == expected
    (third,) = staging.stage([send])  # the slot is free again: straight into it
    assert np.may_share_memory(third.encoded, slots.payload(Slot.OUT, 0))
    third.ready()
    assert slots.read(Slot.OUT, 0, outs.finish(third)) == expected
    at = slots.write(Slot.IN, 0, np.frombuffer(expected, dtype=np.uint8))
    update = FragmentUpdate(fragment=0, version=1, codec="int4", payload=slots.view(Slot.IN, 0, at))
    assert torch.equal(staging.decode(update, pinned=True).cpu(), codec.decode(expected, numel))
    outs.close()
    assert staging.registered is None


@cuda
def test_on_a_gpu_the_training_thread_never_synchronizes():
    core, params, sync = joined_learner("cuda")
    staging = staging_for(core, "cuda")
    assert staging.asynchronous
    cpu_core, cpu_params, _ = joined_learner("cpu")
    expected = train_until_sends(cpu_core, cpu_params)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call on this thread raises
    try:
        sends = staging.stage(list(train_until_sends(core, params)))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for send, reference in zip(sends, expected, strict=True):
        assert send.delta is None and send.encoded is not None and send.ready is not None  # compressed on the GPU
        assert torch.allclose(get_codec("fp32").decode(send.encode().payload, reference.delta.numel()),
                              reference.delta)
    update = first_update(sync, sends[0])
    values = staging.decode(update)
    assert values is not None and values.device.type == "cuda"  # decoded on the GPU
    torch.cuda.set_sync_debug_mode("error")
    try:
        core.on_update(update, 2.0, values=values)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert core.versions[update.fragment] == 1
    assert all(t.device.type == "cuda" for t in params.values())


@cuda
def test_a_learner_runtime_on_a_gpu_trains_sends_and_merges(inproc_sync):
    config = build_config(preset="tiny", overrides=("run.learners=1",))
    s = inproc_sync(config)
    workload = Workload.build(config, torch.device("cuda"))
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "gpu-0")
    # The first update comes back while training goes on (one learner: its own round closes at
    # its quorum); on a fast GPU the steps can outrun it, so train until it has landed.
    trainer = train_steps(runtime, workload, model, 0, 4 * config.protocol.period,
                          until=lambda: runtime.stats.updates_applied >= 1)
    assert runtime.link.outs.pinned  # Δ and updates through the slots, registered as pinned memory
    runtime.close()
    stats = runtime.stats
    assert stats.contributions_sent >= 4 and stats.updates_applied >= 1
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(v.device.type == "cuda" for state in trainer.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
