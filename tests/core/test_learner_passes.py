"""The learner's protocol work on the training thread is a constant number of passes over a
fragment, whatever its size (issue 27): counted, not timed.

Two learners, one with every parameter 4x larger, run the same steps against a synchronizer.
On the training thread's side only (``record_step``, ``on_update``) the test records every
torch op with the bytes it writes (a ``TorchDispatchMode``) and every call of the fused int4
kernels with the elements it covers. With int4 on the CPU there is no torch op at all — no
flatten, no Δ tensor, no decoded copy — and one kernel call per due fragment and per update,
each covering its fragment once. The torch path (another codec) shows the counter sees
copies: the same ops on both sizes, writing 4x the bytes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddiloco.core.learner_side import flat
from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import Broadcast, SendJoin
from ddiloco.core.shared.fragments import flatten, plan_fragments
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.synchronizer import Synchronizer

CONFIG = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)  # int4 both ways


class Writes(TorchDispatchMode):
    """Every torch op run inside, with the bytes of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket)] += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def shapes(scale: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("embed", (32 * scale, 16)), ("w1", (16 * scale, 16)), ("w2", (16 * scale, 16)), ("b1", (16 * scale,)),
            ("w3", (8 * scale, 16))]


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The elements each call of a fused kernel runs over, in order."""
    calls: list[int] = []

    def spy(kernel, anchor_at: int):
        def call(*args):
            calls.append(args[anchor_at].shape[0])
            return kernel(*args)
        return call

    monkeypatch.setattr(flat, "delta_int4", spy(flat.delta_int4, 0))
    monkeypatch.setattr(flat, "apply_int4", spy(flat.apply_int4, 3))
    return calls


def training_thread_work(scale: int, config: ProtocolConfig, kernel_calls: list[int]) -> tuple[Writes, list[int], list[int]]:
    """(torch ops and bytes, elements per kernel call, elements of each fragment sent or updated)."""
    g = torch.Generator().manual_seed(0)
    named = shapes(scale)
    params = {n: torch.randn(s, generator=g) for n, s in named}
    plan = plan_fragments(named, num_fragments=config.fragments, period=config.period, embedding_names=["embed"])
    sync = Synchronizer(config, [flatten([params[n] for n in f.param_names]) for f in plan.fragments],
                        embedding_fragments=[0])
    core = Learner("l0", config, plan, params, boot="b0")
    (join,) = [a for a in core.start(0.0) if isinstance(a, SendJoin)]
    core.on_admitted(sync.state_for(sync.handle(join.message, 0.0)[0].state), 0.0)
    kernel_calls.clear()
    writes, touched = Writes(), []
    for s in range(1, 2 * config.period + 1):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=g), alpha=0.01)  # the inner step: not the protocol's
        with writes:
            sends = core.record_step(10, 0.5, float(s))
        touched += [plan.fragments[send.fragment].numel for send in sends]
        for send in sends:  # the sender thread and the synchronizer: not the training thread
            broadcasts = [a for a in sync.handle(send.encode(), float(s)) if isinstance(a, Broadcast)]
            for b in broadcasts:
                with writes:
                    core.on_update(b.update, float(s))
                touched.append(plan.fragments[b.update.fragment].numel)
    return writes, list(kernel_calls), touched


def test_with_int4_on_the_cpu_the_training_thread_makes_one_pass_per_fragment_and_no_copy(kernel_calls):
    small_writes, small_kernels, small_touched = training_thread_work(1, CONFIG, kernel_calls)
    large_writes, large_kernels, large_touched = training_thread_work(4, CONFIG, kernel_calls)
    assert len(small_touched) == len(large_touched) >= 2 * CONFIG.fragments  # sends and updates, both sizes
    assert small_writes.ops == large_writes.ops == Counter() and small_writes.bytes == large_writes.bytes == 0
    assert small_kernels == small_touched and large_kernels == large_touched  # one call per fragment, covering it once
    assert [4 * n for n in small_touched] == large_touched


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_on_the_torch_path_the_passes_are_as_many_whatever_the_size(codec, kernel_calls):
    config = dataclasses.replace(CONFIG, codec=codec, downlink_codec=codec)
    small, calls, small_touched = training_thread_work(1, config, kernel_calls)
    large, _, large_touched = training_thread_work(4, config, kernel_calls)
    assert calls == []
    assert small.ops == large.ops and not {"cat", "_to_copy"} & set(small.ops)  # no flatten copies
    passes = [w.bytes / (4 * sum(touched)) for w, touched in ((small, small_touched), (large, large_touched))]
    assert abs(passes[1] - passes[0]) <= 0.05 * passes[0] and passes[0] <= 6  # fp32-sized writes per element
