"""The workload's settings — the model's sizes, the inner steps' arithmetic and learning-rate
schedule — apart from the model and the trainer (torch), so that a configuration is checked, and a
bad one refused in one line, without importing torch."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from ddiloco.core.shared.errors import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps"
"""What ``--device`` takes (:func:`ddiloco.workload.device.resolve_device`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Sizes of the reference model, a byte-level :class:`ByteTransformer` (dense or mixture of experts).

    Call :meth:`validate` (the model does).
    """

    seq_len: int = 128
    """Context length in bytes (size of the positional embedding)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    mlp_ratio: int = 4
    """Hidden width of each MLP (or expert) = mlp_ratio · d_model."""
    n_experts: int = 0
    """0 = dense MLP; >= 2 = mixture of experts in every block."""
    top_k: int = 2
    """Experts per token when n_experts >= 2 (ignored when dense)."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field and its value."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "moe_aux_loss_coef":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"model.{f.name} must be a number, got {value!r}")
                if not math.isfinite(value) or value < 0:
                    raise ConfigError(f"model.{f.name} must be finite and >= 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"model.{f.name} must be an integer, got {value!r}")
        for name in ("seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        if self.n_experts < 0 or self.n_experts == 1:
            raise ConfigError(
                f"model.n_experts must be 0 (dense) or >= 2 (mixture of experts), "
                f"got {self.n_experts}"
            )
        if self.n_experts >= 2 and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(
                f"model.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Precision(enum.StrEnum):
    """Arithmetic of the inner steps (``train.precision``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    """Autocast: matrix products and attention in bfloat16; weights, gradients and AdamW state
    stay fp32, so Δ, anchors and merges are unchanged."""


class LrSchedule(enum.StrEnum):
    """Inner learning rate after warm-up (``train.schedule``)."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"
