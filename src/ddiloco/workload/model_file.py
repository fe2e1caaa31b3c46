"""A model's weights as a plain safetensors file: the tensors of its ``state_dict``, each in memory
of its own (a safetensors file holds no shared tensors), written atomically.

Shared by ``ddiloco export`` (:mod:`ddiloco.runtime.sync.model_export`), ``LearnerRuntime.export`` and the
end of a virtual run; it imports nothing of the runtime, so each of them may import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ddiloco.core.shared.fragments import FragmentPlan
from ddiloco.workload.checkpoint import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parameters(plan: FragmentPlan, shapes: Mapping[str, Sequence[int]],
               values: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each fragment's flat vector cut back into its parameters (model order, the given shapes)."""
    out: dict[str, torch.Tensor] = {}
    for f in plan.fragments:
        flat, offset = values[f.index], 0
        if flat.numel() != f.numel:
            raise CheckpointError(f"fragment {f.index} holds {flat.numel()} values, its layout {f.numel}")
        for name in f.param_names:
            n = math.prod(shapes[name])
            out[name] = flat[offset:offset + n].reshape(tuple(shapes[name])).clone()
            offset += n
    return out


def full_state_dict(model: nn.Module, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with its parameters, under every name a tied one has, taken from
    ``params`` (by ``named_parameters`` name); buffers as the model holds them. Every tensor in
    memory of its own, on the CPU (a safetensors file holds no shared tensors)."""
    names = {p.data_ptr(): name for name, p in model.named_parameters()}
    out = {}
    for key, t in model.state_dict().items():
        src = params.get(key)
        if src is None and t.numel():
            src = params.get(names.get(t.data_ptr(), ""))
        out[key] = (t if src is None else src).detach().to("cpu", copy=True)
    return out


def tied_names(model: nn.Module) -> dict[str, str]:
    """The ``state_dict`` names that are a parameter under another name (a tied output layer) -> that name."""
    params = dict(model.named_parameters())
    names = {p.data_ptr(): name for name, p in params.items() if p.numel()}
    return {key: names[t.data_ptr()] for key, t in model.state_dict().items()
            if key not in params and t.numel() and t.data_ptr() in names}


def save_state_dict(out: Path, tensors: Mapping[str, torch.Tensor], dtype: str = "fp32") -> None:
    """Write ``tensors`` (floating point ones cast to ``dtype``) atomically: a temporary file renamed
    over ``out``, so a failure leaves nothing and a reader never sees half a file."""
    from safetensors.torch import save_file

    cast = DTYPES[dtype]
    tensors = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def save_model(out: Path, model: nn.Module) -> None:
    """A model's whole ``state_dict`` as a plain safetensors file (tied names each in memory of its own)."""
    save_state_dict(out, full_state_dict(model, {}))
