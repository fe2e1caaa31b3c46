"""The model a synchronizer serves: its fragments, initial values and parameter shapes.

A learner checks its own model against this layout when it joins (``plan_from_layout`` in
the learner runtime), and a checkpoint carries the layout's hash, so a synchronizer never
resumes, and a learner never trains, on a mixed model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ddiloco.config import Config
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.fragments import Fragment, FragmentPlan, flatten, plan_fragments
from ddiloco.errors import ConfigError
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.workload.trainer import build_model


class LayoutMismatch(ConfigError):
    """A learner's model does not have the parameters the synchronizer serves."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Fragments of the served model, their initial values and the parameters' shapes."""

    plan: FragmentPlan
    shapes: dict[str, tuple[int, ...]]
    initial_values: list[torch.Tensor]

    def to_proto(self) -> list[pb.FragmentLayout]:
        return [
            pb.FragmentLayout(
                index=f.index,
                params=[pb.Param(name=n, shape=list(self.shapes[n])) for n in f.param_names],
                numel=f.numel,
                offset=f.offset,
                is_embedding=f.is_embedding,
            )
            for f in self.plan.fragments
        ]

    def sha256(self, protocol: ProtocolConfig) -> str:
        doc = {
            "fragments": [
                [f.index, [[n, list(self.shapes[n])] for n in f.param_names], f.offset, f.is_embedding]
                for f in self.plan.fragments
            ],
            "period": self.plan.period,
            "codec": protocol.codec,
            "downlink_codec": protocol.downlink_codec,
            "block_size": protocol.block_size,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def model_layout(
    protocol: ProtocolConfig,
    named_params: Iterable[tuple[str, torch.Tensor]],
    embedding_names: Iterable[str],
) -> ModelLayout:
    """Plan fragments exactly as the virtual cluster does, from named parameters."""
    params = dict(named_params)
    plan = plan_fragments(
        [(n, tuple(p.shape)) for n, p in params.items()],
        num_fragments=protocol.fragments,
        period=protocol.period,
        strategy=protocol.fragmentation,
        embedding_names=tuple(embedding_names),
    )
    return ModelLayout(
        plan=plan,
        shapes={n: tuple(p.shape) for n, p in params.items()},
        initial_values=[flatten([params[n] for n in f.param_names]) for f in plan.fragments],
    )


def reference_layout(config: Config, protocol: ProtocolConfig) -> ModelLayout:
    """The reference workload's model, initialized as every learner of the virtual run is."""
    model = build_model(config.model, config.run.seed)
    return model_layout(protocol, model.named_parameters(), model.embedding_param_names())


def layout_from_file(path: str | Path, protocol: ProtocolConfig) -> ModelLayout:
    """Serve your own model: initial weights written by ``save_initial_state`` (:mod:`ddiloco.runtime.learner`)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            params = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"--init {str(path)!r}: cannot read initial weights ({err})") from None
    try:
        embedding_names = json.loads(metadata.get("embedding_names", "[]"))
        order = json.loads(metadata.get("param_order", "[]")) or sorted(params)
    except json.JSONDecodeError:
        raise ConfigError(f"--init {str(path)!r}: bad metadata (embedding_names, param_order)") from None
    if sorted(order) != sorted(params):
        raise ConfigError(f"--init {str(path)!r}: param_order metadata does not list the file's tensors")
    return model_layout(protocol, [(name, params[name]) for name in order], embedding_names)


def plan_from_layout(header: pb.JoinHeader, params: dict[str, torch.Tensor]) -> FragmentPlan:
    """The synchronizer's fragment plan, checked against the model's parameters."""
    served: set[str] = set()
    fragments = []
    for f in header.fragments:
        names = []
        for p in f.params:
            if p.name not in params:
                raise LayoutMismatch(f"the synchronizer serves parameter {p.name!r}, which this model lacks "
                                     "(start learner and synchronizer with the same model options)")
            shape = tuple(params[p.name].shape)
            if shape != tuple(p.shape):
                raise LayoutMismatch(f"parameter {p.name!r} has shape {shape} here, {tuple(p.shape)} at the "
                                     "synchronizer (start both with the same model options)")
            names.append(p.name)
            served.add(p.name)
        fragments.append(Fragment(index=f.index, param_names=tuple(names), numel=f.numel, offset=f.offset,
                                  is_embedding=f.is_embedding))
    extra = sorted(set(params) - served)
    if extra:
        raise LayoutMismatch(f"parameters {extra[:3]} are not served by the synchronizer (another model?)")
    return FragmentPlan(fragments=tuple(fragments), period=header.period)
