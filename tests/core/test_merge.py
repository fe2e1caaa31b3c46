import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.sync_side.merge import MergeRuleName, merge_rule, token_weights

merge_mean = merge_rule(MergeRuleName.MEAN).reference
merge_rda = merge_rule(MergeRuleName.RDA).reference


def _deltas(m: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + i) for i in range(m)]


def _rda_reference(deltas: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    d64 = [d.double() for d in deltas]
    norms = torch.stack([d.norm() for d in d64])
    direction = sum(wi * d / d.norm() for wi, d in zip(w, d64))
    return (w @ norms) * direction / direction.norm()


def test_token_weights_are_quantity_times_efficiency() -> None:
    w = token_weights([100, 100], [1, 2])
    assert w.dtype == torch.float64
    assert torch.allclose(w, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64), atol=0, rtol=1e-15)
    assert token_weights([0, 50], [3, 1]).tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("tokens", "steps", "match"),
    [([1, 2], [1, 0], "steps must be positive"), ([1, -2], [1, 1], "non-negative"),
     ([0, 0], [1, 1], "positive weight"), ([1], [1, 1], "as many"), ([], [], "at least one")],
)
def test_token_weights_reject_bad_counts(tokens: list[int], steps: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        token_weights(tokens, steps)


def test_mean_matches_float64_reference() -> None:
    deltas = _deltas(4, 1000)
    w = token_weights([10, 20, 30, 40], [1, 2, 2, 5])
    expected = sum(wi * d.double() for wi, d in zip(w, deltas))
    got = merge_mean(deltas, w)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-7)


def test_mean_with_one_hot_weights_returns_that_delta() -> None:
    deltas = _deltas(3, 257)
    one_hot = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    assert torch.equal(merge_mean(deltas, one_hot), deltas[1])


def test_rda_matches_float64_reference() -> None:
    deltas = _deltas(5, 2000, seed=1)
    w = token_weights([5, 9, 1, 7, 3], [1, 2, 1, 3, 1])
    got = merge_rda(deltas, w)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), _rda_reference(deltas, w), rtol=1e-6, atol=1e-7)


def test_rda_of_identical_deltas_is_that_delta() -> None:
    (delta,) = _deltas(1, 500)
    got = merge_rda([delta] * 3, token_weights([1, 2, 3], [1, 1, 1]))
    assert torch.allclose(got, delta, rtol=1e-6, atol=1e-7)


def test_rda_keeps_the_norm_of_orthogonal_deltas_that_the_mean_shrinks() -> None:
    # Why RDA exists: learners' outer gradients are nearly orthogonal, so the plain mean
    # shrinks the step by about 1/sqrt(M) and the outer lr would have to grow with M.
    m, n = 16, 8192
    deltas = _deltas(m, n, seed=2)
    deltas = [d / d.norm() * 3.0 for d in deltas]  # equal norms, near-orthogonal directions
    w = token_weights([1] * m, [1] * m)
    assert float(merge_rda(deltas, w).norm()) == pytest.approx(3.0, rel=1e-5)
    assert float(merge_mean(deltas, w).norm()) == pytest.approx(3.0 / math.sqrt(m), rel=0.05)


def test_rda_skips_zero_deltas_and_returns_zeros_when_directions_cancel() -> None:
    (delta,) = _deltas(1, 100)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    got = merge_rda([delta, torch.zeros(100)], w)
    assert not got.isnan().any()
    assert torch.allclose(got, delta / 2, rtol=1e-6)  # direction of delta, half its norm
    assert torch.equal(merge_rda([delta, -delta], w), torch.zeros(100))
    assert torch.equal(merge_rda([torch.zeros(7)] * 2, w), torch.zeros(7))


@settings(max_examples=50, deadline=None)
@given(
    m=st.integers(1, 6),
    n=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    tokens=st.lists(st.integers(1, 1000), min_size=6, max_size=6),
)
def test_rda_norm_never_exceeds_the_largest_input_norm(
    m: int, n: int, seed: int, tokens: list[int]
) -> None:
    deltas = _deltas(m, n, seed)
    w = token_weights(tokens[:m], [1] * m)
    norm = float(merge_rda(deltas, w).norm())
    assert norm <= max(float(d.norm()) for d in deltas) * (1 + 1e-6)


@pytest.mark.parametrize("merge", [merge_mean, merge_rda])
def test_merges_reject_mismatched_inputs(merge) -> None:  # type: ignore[no-untyped-def]
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match="shapes"):
        merge([torch.zeros(3), torch.zeros(4)], w)
    with pytest.raises(ValueError, match="weights"):
        merge([torch.zeros(3)], w)
    with pytest.raises(ValueError, match="no deltas"):
        merge([], w[:0])


def test_rda_median_takes_the_median_norm_so_one_stretched_outer_gradient_cannot_stretch_the_step() -> None:
    """The rule added by the recipe in docs/design.md ("How to add a merge rule")."""
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(50, generator=g) for _ in range(4)]
    deltas[3] = deltas[3] * 100.0  # one learner's outer gradient 100x the others'
    w = token_weights([1, 1, 1, 1], [1, 1, 1, 1])
    norms = sorted(float(d.norm()) for d in deltas)
    median = merge_rule("rda-median").reference(deltas, w)
    mean = merge_rda(deltas, w)
    assert float(median.norm()) == pytest.approx(norms[1], rel=1e-5)  # the lower of the two middle norms
    assert float(mean.norm()) > 20 * float(median.norm())  # RDA's weighted mean follows the outlier
    direction = lambda x: x / x.norm()  # noqa: E731
    assert torch.allclose(direction(median), direction(mean), atol=1e-6)  # the same direction
