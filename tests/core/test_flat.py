"""A fragment's parameters bound to one flat buffer: the fused int4 passes against the codec and
torch's ops (bit for bit), what binding keeps (Parameter objects, optimizers), and the bad
input it refuses with one line naming the parameter (issue 27)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ddiloco.core.learner_side.flat import FlatFragment, ModelHold
from ddiloco.core.learner_side.learner_kernels import apply_int4, delta_int4
from ddiloco.core.shared.codecs import AbsmaxCodec, get_codec, int4_parts
from ddiloco.core.shared.errors import ParameterError

INT4 = get_codec("int4")


def fragment(*shapes: tuple[int, ...], codec=INT4, seed: int = 0) -> tuple[FlatFragment, list[nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    return FlatFragment(0, [f"p{i}" for i in range(len(params))], params, codec, codec), params


@pytest.mark.parametrize("numel,block", [(1, 128), (255, 128), (256, 128), (1001, 128), (37, 4), (30, 6)])
def test_the_fused_delta_is_the_int4_codecs_payload_bit_for_bit(numel, block):
    g = torch.Generator().manual_seed(numel)
    anchor, local = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    local[: min(numel, block)] = anchor[: min(numel, block)]  # a zero block: scale 0, exact zero codes
    codec = AbsmaxCodec(bits=4, block_size=block)
    blocks = -(-numel // block)
    payload = np.empty(codec.encoded_size(numel), dtype=np.uint8)
    assert delta_int4(anchor.numpy(), local.numpy(), block, payload[: 4 * blocks].view("<f4"), payload[4 * blocks:]) == 0
    assert payload.tobytes() == codec.encode(anchor - local)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("numel,block", [(1001, 128), (37, 4)])
def test_the_fused_update_is_the_torch_merge_bit_for_bit(numel, block, alpha):
    g = torch.Generator().manual_seed(numel)
    codec = AbsmaxCodec(bits=4, block_size=block)
    payload = codec.encode(torch.randn(numel, generator=g))
    anchor, local = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    want_anchor = anchor + codec.decode(payload, numel)
    want = local.clone().mul_(alpha).add_(want_anchor, alpha=1.0 - alpha) if alpha else want_anchor.clone()
    apply_int4(*int4_parts(payload, numel, block), block, anchor.numpy(), local.numpy(), alpha)
    assert torch.equal(anchor, want_anchor) and torch.equal(local, want)


def test_a_fused_update_with_any_other_alpha_is_within_a_rounding_of_torch():
    g = torch.Generator().manual_seed(1)
    payload = INT4.encode(torch.randn(4096, generator=g))
    anchor, local = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    merged = anchor + INT4.decode(payload, 4096)
    want = local.clone().mul_(0.3).add_(merged, alpha=0.7)
    terms = 0.3 * local.abs() + 0.7 * merged.abs()  # torch may fuse anchor·0.7 into the addition: one rounding less
    apply_int4(*int4_parts(payload, 4096, 128), 128, anchor.numpy(), local.numpy(), 0.3)
    assert torch.equal(anchor, merged) and bool(((local - want).abs() <= 2**-23 * terms).all())


def test_binding_keeps_the_parameter_objects_and_an_optimizer_trains_the_buffer():
    frag, params = fragment((3, 4), (5,), (2, 2, 2))
    values = [p.detach().clone() for p in params]
    frag.check()
    assert [p.data_ptr() for p in params] == [frag.buffer.data_ptr() + 4 * o for o in (0, 12, 17)]
    assert torch.equal(frag.buffer, torch.cat([v.reshape(-1) for v in values])) and torch.equal(frag.anchor, frag.buffer)
    optimizer = torch.optim.SGD(params, lr=1.0)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    assert torch.equal(frag.buffer, torch.cat([v.reshape(-1) for v in values]) - 1)
    payload = frag.take_delta().tobytes()
    assert payload == INT4.encode(frag.anchor - frag.buffer)
    assert torch.allclose(INT4.decode(payload, frag.numel), torch.ones(frag.numel))


def test_a_non_finite_delta_is_refused_naming_the_fragment():
    frag, params = fragment((300,))
    with torch.no_grad():
        params[0][5] = float("nan")
    with pytest.raises(ValueError, match=r"fragment 0: Δ is not finite in 1 of its 3 blocks.*'p0'"):
        frag.take_delta()


def test_the_torch_path_serves_other_codecs_and_dtypes_the_same_way():
    frag, params = fragment((4, 4), codec=get_codec("fp32"))
    assert not frag.fused_up and not frag.fused_down
    with torch.no_grad():
        params[0].add_(1.0)
    assert torch.equal(frag.take_delta(), frag.anchor - params[0].detach().reshape(-1))
    anchor, local = frag.anchor.clone(), frag.buffer.clone()
    frag.apply(torch.ones(16).numpy().tobytes(), None, 0.5)
    assert torch.equal(frag.anchor, anchor + 1) and torch.equal(frag.buffer, local * 0.5 + (anchor + 1) * 0.5)
    assert torch.equal(params[0].detach().reshape(-1), frag.buffer)
    half, (p,) = fragment((8,), codec=get_codec("fp32"))
    p.data = p.data.to(torch.bfloat16)
    with pytest.raises(ParameterError, match=r"parameter 'p0' changed dtype from torch.float32 to torch.bfloat16"):
        half.take_delta()


@pytest.mark.parametrize("change,problem", [
    (lambda p: setattr(p, "data", p.data.reshape(2, 8)), r"changed shape from \(4, 4\) to \(2, 8\)"),
    (lambda p: setattr(p, "data", p.data.double()), r"changed dtype from torch.float32 to torch.float64"),
    (lambda p: setattr(p, "data", p.data.clone()), r"was replaced by other memory"),
    (lambda p: setattr(p, "data", p.data.t()), r"is no longer contiguous \(strides \(1, 4\)\)"),
])
def test_a_parameter_changed_after_the_learner_started_is_named_not_measured(change, problem):
    frag, params = fragment((3,), (4, 4))
    change(params[1])
    for use in (frag.take_delta, lambda: frag.apply(INT4.encode(torch.zeros(19)), None, 0.5),
                lambda: frag.adopt(torch.zeros(19))):
        with pytest.raises(ParameterError, match=rf"^parameter 'p1' {problem}.* after the learner started"):
            use()


def test_a_fragment_of_mixed_dtypes_stays_apart_and_is_gathered_at_each_use():
    params = [nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(2))]  # fp32 norm, bf16 weights
    frag = FlatFragment(0, ["w", "norm"], params, INT4, INT4)
    assert frag.buffer is None and not frag.fused_up and not frag.fused_down
    with torch.no_grad():
        params[0].add_(1.0)
    assert torch.equal(frag.take_delta(), torch.tensor([-1.0] * 4 + [0.0] * 2))
    frag.apply(INT4.encode(torch.full((6,), 2.0)), None, 0.0)
    assert torch.equal(params[0], torch.full((4,), 3.0, dtype=torch.bfloat16)) and torch.equal(params[1], torch.full((2,), 3.0))
    params[1].data = params[1].data.double()
    with pytest.raises(ParameterError, match=r"^parameter 'norm' changed dtype from torch.float32 to torch.float64"):
        frag.take_delta()


def test_parameters_the_buffer_cannot_hold_are_refused_when_binding():
    with pytest.raises(ParameterError, match=r"parameter 'p1' is not contiguous \(shape \(4, 3\), strides \(1, 4\)\)"):
        FlatFragment(0, ["p0", "p1"], [torch.zeros(2), torch.zeros(3, 4).t()], INT4, INT4)
    with pytest.raises(ParameterError, match=r"parameter 'p0' is torch.int64"):
        FlatFragment(0, ["p0"], [torch.zeros(2, dtype=torch.int64)], INT4, INT4)


@pytest.mark.parametrize("change,problem", [
    (lambda m: m.to("meta"), r"'0.weight' moved from cpu to meta"),
    (lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True),
     r"'0.weight' was replaced by a new Parameter"),
    (lambda m: setattr(m[1], "weight", nn.Parameter(torch.zeros(2, 3))), r"'1.weight' changed shape from \(3, 3\) to \(2, 3\)"),
])
def test_a_model_that_swaps_its_parameter_objects_is_named(change, problem):
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    hold = ModelHold(model)
    hold.check()
    change(model)
    with pytest.raises(ParameterError, match=rf"^parameter {problem}.* after the learner started"):
        hold.check()


@pytest.mark.parametrize("gather", [8, 128, 1 << 20])
def test_an_unbound_fragment_s_fused_delta_in_passes_is_the_codecs_payload_bit_for_bit(monkeypatch, gather):
    """An FSDP2 shard's fragment (unbound: FSDP keeps its memory) gathers a run of blocks at a time;
    runs that end inside a parameter, or inside a block boundary's neighbour, change nothing."""
    monkeypatch.setattr("ddiloco.core.learner_side.flat.GATHER_VALUES", gather)
    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in [(37, 5), (1000,), (3, 3, 7), (2049,)]]
    frag = FlatFragment(0, [f"p{i}" for i in range(4)], params, INT4, INT4, bind=False)
    assert frag.buffer is None and frag.fused_up
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g))
    payload = frag.take_delta()
    assert payload.tobytes() == INT4.encode(frag.anchor - torch.cat([p.detach().reshape(-1) for p in params]))
    with torch.no_grad():
        params[3][2000] = float("inf")
    with pytest.raises(ValueError, match=r"fragment 0: Δ is not finite in 1 of its"):
        frag.take_delta()
