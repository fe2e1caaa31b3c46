import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.fragments import (
    STRATEGIES,
    Fragment,
    FragmentPlan,
    flatten,
    plan_fragments,
    unflatten_into,
)

# A small transformer-like parameter list, in model order.
MODEL = [
    ("tok_emb.weight", (256, 32)),
    ("blocks.0.attn.qkv.weight", (96, 32)),
    ("blocks.0.attn.proj.weight", (32, 32)),
    ("blocks.0.mlp.fc.weight", (128, 32)),
    ("blocks.0.mlp.proj.weight", (32, 128)),
    ("blocks.0.ln.weight", (32,)),
    ("blocks.1.attn.qkv.weight", (96, 32)),
    ("blocks.1.attn.proj.weight", (32, 32)),
    ("blocks.1.mlp.fc.weight", (128, 32)),
    ("blocks.1.mlp.proj.weight", (32, 128)),
    ("blocks.1.ln.weight", (32,)),
    ("ln_f.weight", (32,)),
]
NAMES = [n for n, _ in MODEL]
EMB = {"tok_emb.weight"}


def _all_names(plan: FragmentPlan) -> list[str]:
    return [n for f in plan.fragments for n in f.param_names]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_covers_every_parameter_once_in_model_order(strategy: str) -> None:
    plan = plan_fragments(MODEL, num_fragments=4, period=4, strategy=strategy, embedding_names=EMB)
    assert sorted(_all_names(plan)) == sorted(NAMES)
    order = {n: i for i, n in enumerate(NAMES)}
    for frag in plan.fragments:
        assert frag.param_names, "no fragment may be empty"
        assert [order[n] for n in frag.param_names] == sorted(order[n] for n in frag.param_names)
        assert frag.numel == sum(torch.Size(dict(MODEL)[n]).numel() for n in frag.param_names)
    assert plan.fragments[0].param_names == ("tok_emb.weight",)
    assert [f.is_embedding for f in plan.fragments] == [True, False, False, False]


def test_balanced_is_greedy_largest_first_into_lightest() -> None:
    shapes = [("a", (10,)), ("b", (7,)), ("c", (6,)), ("d", (5,)), ("e", (4,))]
    plan = plan_fragments(shapes, num_fragments=2, period=2)
    # 10 -> f0; 7 -> f1; 6 -> f1 (13); 5 -> f0 (15); 4 -> f1 (17)
    assert [f.param_names for f in plan.fragments] == [("a", "d"), ("b", "c", "e")]
    assert [f.numel for f in plan.fragments] == [15, 17]
    assert not any(f.is_embedding for f in plan.fragments)


def test_balanced_ties_are_broken_by_model_order() -> None:
    shapes = [("x", (3,)), ("y", (3,)), ("z", (3,)), ("w", (3,))]
    plan = plan_fragments(shapes, num_fragments=2, period=2)
    assert [f.param_names for f in plan.fragments] == [("x", "z"), ("y", "w")]


def test_balanced_fragments_are_near_equal_on_a_transformer() -> None:
    plan = plan_fragments(MODEL, num_fragments=3, period=3, embedding_names=EMB)
    rest = [f.numel for f in plan.fragments[1:]]
    assert max(rest) - min(rest) <= max(torch.Size(s).numel() for _, s in MODEL[1:])


def test_layerwise_groups_are_contiguous_and_roughly_equal() -> None:
    plan = plan_fragments(
        MODEL, num_fragments=3, period=6, strategy="layerwise", embedding_names=EMB
    )
    groups = [list(f.param_names) for f in plan.fragments[1:]]
    assert groups[0] + groups[1] == NAMES[1:]
    assert groups[0][-1] == "blocks.0.ln.weight"  # the cut falls at the block boundary


def test_strided_is_round_robin_in_model_order() -> None:
    plan = plan_fragments(MODEL, num_fragments=4, period=4, strategy="strided", embedding_names=EMB)
    rest = NAMES[1:]
    for i, name in enumerate(rest):
        assert plan.fragment_of(name) == 1 + i % 3


def test_single_fragment_holds_everything() -> None:
    plan = plan_fragments(MODEL, num_fragments=1, period=5, embedding_names=EMB)
    (frag,) = plan.fragments
    assert frag.param_names == tuple(NAMES) and frag.is_embedding and frag.offset == 0
    assert plan.due(5) == [0] and plan.due(3) == []


def test_offsets_with_p_equal_h_send_one_fragment_per_step() -> None:
    plan = plan_fragments(MODEL, num_fragments=4, period=4, embedding_names=EMB)
    assert [f.offset for f in plan.fragments] == [0, 1, 2, 3]
    assert [plan.due(s) for s in range(1, 9)] == [[1], [2], [3], [0]] * 2


def test_offsets_are_spread_evenly_over_the_period() -> None:
    plan = plan_fragments(MODEL, num_fragments=3, period=10, embedding_names=EMB)
    assert [f.offset for f in plan.fragments] == [0, 3, 6]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 11), h=st.integers(1, 30))
def test_each_fragment_is_due_exactly_once_per_period(p: int, h: int) -> None:
    plan = plan_fragments(MODEL, num_fragments=p, period=h, embedding_names=EMB)
    for start in (1, 7 * h + 3):
        due = [i for s in range(start, start + h) for i in plan.due(s)]
        assert sorted(due) == list(range(p))


def test_fragment_of_maps_names_and_rejects_unknown() -> None:
    plan = plan_fragments(MODEL, num_fragments=2, period=2, embedding_names=EMB)
    assert plan.fragment_of("tok_emb.weight") == 0
    assert plan.fragment_of("ln_f.weight") == 1
    with pytest.raises(KeyError, match="nope"):
        plan.fragment_of("nope")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_fragments": 2, "period": 0}, "period must be >= 1, got 0"),
        ({"num_fragments": 0, "period": 2}, "protocol.fragments must be >= 1, got 0"),
        (
            {"num_fragments": 2, "period": 2, "strategy": "zigzag"},
            "'zigzag'.*balanced, layerwise, strided",
        ),
        # Issue 45: the key as the user writes it (was "num_fragments=13"), and what would do.
        ({"num_fragments": 13, "period": 2}, r"^protocol\.fragments=13 needs at least 13 non-embedding tensors, "
                                             r"the model has 12 .*: set protocol\.fragments to at most 12$"),
        ({"num_fragments": 13, "period": 2, "embedding_names": EMB}, "at least 12 .* has 11"),
        ({"num_fragments": 2, "period": 2, "embedding_names": {"wte"}}, "wte"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_fragments(MODEL, **kwargs)


def test_plan_rejects_inconsistent_fragments() -> None:
    frag = Fragment(index=0, param_names=("a",), numel=1, offset=3, is_embedding=False)
    with pytest.raises(ConfigError, match="offset 3"):
        FragmentPlan(fragments=(frag,), period=2)
    with pytest.raises(ValueError, match="step"):
        plan_fragments(MODEL, num_fragments=2, period=2).due(0)


def test_flatten_and_unflatten_round_trip_across_dtypes() -> None:
    params = [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.randn(2, 2, 2, dtype=torch.float64)),
    ]
    flat = flatten(params)
    assert flat.dtype == torch.float32 and flat.shape == (12 + 5 + 8,) and not flat.requires_grad
    assert flat.data_ptr() != params[0].data_ptr()
    unflatten_into(flat * 2, params)
    assert torch.allclose(params[0], flat[:12].view(3, 4) * 2)
    assert torch.equal(params[1].float(), (flat[12:17] * 2).to(torch.bfloat16).float())
    assert params[2].dtype == torch.float64
    with pytest.raises(ValueError, match="expected"):
        unflatten_into(flat[:-1], params)
    assert flatten([]).shape == (0,)
