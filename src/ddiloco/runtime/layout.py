"""The model a synchronizer serves: its fragments, initial values and parameter shapes.

A learner checks its own model against this layout when it joins (``plan_from_layout`` in
the learner runtime), and a checkpoint carries the layout's hash, so a synchronizer never
resumes, and a learner never trains, on a mixed model.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.fragments import Fragment, FragmentPlan, flatten, plan_fragments
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime import script_env
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.settings.config import Config
from ddiloco.workload.trainer import build_model


class LayoutMismatch(ConfigError):
    """A learner's model does not have the parameters the synchronizer serves."""


SERVE_YOUR_MODEL = ("to train your own model, serve it: save_initial_state(model, 'init.safetensors') once, then "
                    "ddiloco sync --init init.safetensors; with ddiloco learner, start both with the same model options")
"""The way out of a :class:`LayoutMismatch`: a ``LearnerRuntime`` against ``ddiloco sync --preset tiny``
raised one whose hint never said that the synchronizer serves the reference model unless given ``--init``."""
SERVE_UNDER_LAUNCH = ("to train your own model, serve it: save_initial_state(model, 'init.safetensors') once, then "
                      "ddiloco launch --init init.safetensors --learners M ... -- python SCRIPT ...")
"""The same, for a copy of a script that ``ddiloco launch`` started (issue 57: the hint named ``ddiloco
sync``, a command its user never typed)."""


def serve_your_model() -> str:
    """The way out of a :class:`LayoutMismatch`, in the terms of the command that started this learner."""
    return SERVE_UNDER_LAUNCH if os.environ.get(script_env.CONNECT) else SERVE_YOUR_MODEL


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Fragments of the served model, their initial values and the parameters' shapes."""

    plan: FragmentPlan
    shapes: dict[str, tuple[int, ...]]
    initial_values: Sequence[torch.Tensor]
    """Each fragment's initial value, read and flattened only when asked for (:class:`FragmentValues`)."""

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


class FragmentValues(Sequence[torch.Tensor]):
    """The fragments' initial values, each read and flattened when it is asked for.

    A synchronizer shard asks only for the fragments it owns, so a shard of a model served
    from ``--init`` reads its own parameters from the file and never materializes the rest."""

    def __init__(self, plan: FragmentPlan, read: Callable[[Sequence[str]], list[torch.Tensor]]) -> None:
        self._plan = plan
        self._read = read

    def __len__(self) -> int:
        return len(self._plan.fragments)

    def __getitem__(self, p: int) -> torch.Tensor:  # type: ignore[override]
        return flatten(self._read(self._plan.fragments[p].param_names))


def model_layout(
    protocol: ProtocolConfig,
    named_params: Iterable[tuple[str, torch.Tensor]],
    embedding_names: Iterable[str],
) -> ModelLayout:
    """Plan fragments exactly as the virtual cluster does, from named parameters."""
    params = dict(named_params)
    return _layout(protocol, {n: tuple(p.shape) for n, p in params.items()}, embedding_names,
                   lambda names: [params[n] for n in names])


def _layout(protocol: ProtocolConfig, shapes: dict[str, tuple[int, ...]], embedding_names: Iterable[str],
            read: Callable[[Sequence[str]], list[torch.Tensor]]) -> ModelLayout:
    plan = plan_fragments(
        list(shapes.items()),
        num_fragments=protocol.fragments,
        period=protocol.period,
        strategy=protocol.fragmentation,
        embedding_names=tuple(embedding_names),
    )
    return ModelLayout(plan=plan, shapes=shapes, initial_values=FragmentValues(plan, read))


def reference_layout(config: Config, protocol: ProtocolConfig) -> ModelLayout:
    """The reference workload's model, initialized as every learner of the virtual run is."""
    model = build_model(config.model, config.run.seed)
    return model_layout(protocol, model.named_parameters(), model.embedding_param_names())


def layout_from_file(path: str | Path, protocol: ProtocolConfig) -> ModelLayout:
    """Serve your own model: initial weights written by ``save_initial_state`` (:mod:`ddiloco.runtime.learner`).

    Only the file's header is read here; a fragment's parameters are read when the
    synchronizer asks for its initial value (a shard, only for its own fragments)."""
    from safetensors import SafetensorError, safe_open

    where = f"--init {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"{where}: cannot read initial weights ({err})") from None
    try:
        embedding_names = json.loads(metadata.get("embedding_names", "[]"))
        order = json.loads(metadata.get("param_order", "[]")) or sorted(shapes)
    except json.JSONDecodeError:
        raise ConfigError(f"{where}: bad metadata (embedding_names, param_order)") from None
    if sorted(order) != sorted(shapes):
        raise ConfigError(f"{where}: param_order metadata does not list the file's tensors")

    def read(names: Sequence[str]) -> list[torch.Tensor]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return [f.get_tensor(name) for name in names]
        except (OSError, SafetensorError) as err:
            raise ConfigError(f"{where}: cannot read parameters {list(names)[:3]} ({err})") from None

    return _layout(protocol, {name: shapes[name] for name in order}, embedding_names, read)


def plan_from_layout(header: pb.JoinHeader, params: dict[str, torch.Tensor]) -> FragmentPlan:
    """The synchronizer's fragment plan, checked against the model's parameters."""
    served: set[str] = set()
    fragments = []
    for f in header.fragments:
        names = []
        for p in f.params:
            if p.name not in params:
                raise LayoutMismatch(f"the synchronizer serves parameter {p.name!r}, which this model lacks: "
                                     f"{serve_your_model()}")
            shape = tuple(params[p.name].shape)
            if shape != tuple(p.shape):
                raise LayoutMismatch(f"parameter {p.name!r} has shape {shape} here, {tuple(p.shape)} at the "
                                     f"synchronizer: {serve_your_model()}")
            names.append(p.name)
            served.add(p.name)
        fragments.append(Fragment(index=f.index, param_names=tuple(names), numel=f.numel, offset=f.offset,
                                  is_embedding=f.is_embedding))
    extra = sorted(set(params) - served)
    if extra:
        raise LayoutMismatch(f"parameters {extra[:3]} are not served by the synchronizer (another model?): "
                             f"{serve_your_model()}")
    return FragmentPlan(fragments=tuple(fragments), period=header.period)
