import pytest
import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.sync_side.outer import NesterovSGD


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.0), (0.1, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_torch_sgd_nesterov_over_several_steps(
    lr: float, momentum: float, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(1000, generator=g, dtype=dtype)
    deltas = [torch.randn(1000, generator=g, dtype=dtype) for _ in range(6)]

    param = torch.nn.Parameter(theta0.clone())
    reference = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=momentum > 0)
    outer = NesterovSGD(lr=lr, momentum=momentum)
    theta, buffer = theta0.clone(), None
    for delta in deltas:
        param.grad = delta.clone()
        reference.step()
        u, buffer = outer.update(delta, buffer)
        theta = theta + u
        if dtype == torch.float64:
            assert torch.allclose(theta, param.detach(), rtol=0, atol=1e-12)
        else:
            assert torch.allclose(theta, param.detach(), rtol=1e-6, atol=1e-6)
    if momentum > 0:
        assert torch.equal(buffer, reference.state[param]["momentum_buffer"])


def test_update_moves_from_the_anchor_toward_the_learners_and_keeps_inputs() -> None:
    anchor, local = torch.zeros(3), torch.tensor([1.0, -2.0, 0.5])
    delta = anchor - local  # the outer gradient
    buffer = torch.ones(3)
    u, new_buffer = NesterovSGD(lr=0.7, momentum=0.9).update(delta, None)
    assert torch.allclose(u, 0.7 * 1.9 * local) and torch.equal(new_buffer, delta)
    assert new_buffer.data_ptr() != delta.data_ptr()
    NesterovSGD(lr=0.7, momentum=0.9).update(delta, buffer)
    assert torch.equal(buffer, torch.ones(3)) and torch.equal(delta, -local)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0, "momentum": 0.9}, "lr .* got 0.0"),
        ({"lr": float("nan"), "momentum": 0.9}, "nan"),
        ({"lr": 0.7, "momentum": 1.0}, r"\[0, 1\), got 1.0"),
        ({"lr": 0.7, "momentum": -0.1}, "-0.1"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NesterovSGD(**kwargs)


def test_rejects_a_buffer_of_another_shape() -> None:
    with pytest.raises(ValueError, match="buffer shape"):
        NesterovSGD(lr=0.7, momentum=0.9).update(torch.zeros(3), torch.zeros(4))
