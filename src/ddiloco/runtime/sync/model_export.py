"""Taking the trained model out: the global model Θ as a plain ``state_dict`` file.

The synchronizer keeps Θ as flat fp32 vectors, one per fragment, in its own layout
(:mod:`ddiloco.core.shared.fragments`); a checkpoint holds them as of its copies and the round log
the rounds merged since (:mod:`ddiloco.runtime.sync.round_log`). An export rebuilds Θ the way
a resumed synchronizer does — a core restored from the latest checkpoint, then the log
replayed into it (:func:`~ddiloco.runtime.sync.checkpoint_writer.restore_state`) — so nothing
merged is missing and every value is the one the synchronizer served, bit for bit. A running
synchronizer is read over the wire instead, as an evaluator reads it: a probe (the layout,
without registering) and a state fetch (no learner is added, none counts toward a quorum).

What names the parameters is the model the run served: the reference workload's (built from
the run's own configuration, which the checkpoint and the join header carry) or the user's,
from the ``--init`` file written by ``save_initial_state``. From the reference model the file
is that model's whole ``state_dict()`` (tied names and buffers included), so
``model.load_state_dict(load_file(path))`` takes it as it is; from an ``--init`` file it is
the parameters plus the tied names the file records.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.messages import FragmentUpdate
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime.layout import ModelLayout, layout_from_file, plan_from_layout, reference_layout
from ddiloco.runtime.sync.checkpoint_writer import restore_state
from ddiloco.runtime.sync.resume import holds_no_run
from ddiloco.runtime.sync.round_log import LoggedRound
from ddiloco.runtime.sync.state_dir import has_checkpoint, load_latest
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import config_of_sync
from ddiloco.workload.checkpoint import CheckpointError
from ddiloco.workload.model_file import DTYPES, full_state_dict, parameters, save_state_dict


@dataclass(frozen=True)
class ServedModel:
    """The model a run served: its layout, and how Θ becomes that model's ``state_dict``."""

    layout: ModelLayout
    build: Callable[[], nn.Module] | None = None
    """The reference model (its ``state_dict`` names tied weights and buffers too); None for an ``--init`` file."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied names the ``--init`` file records: name in the model's ``state_dict`` -> the parameter it is."""
    hf_config: str | None = None
    """The Hugging Face configuration (JSON) the ``--init`` file records, if it was written from such a model."""

    def state_dict(self, values: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Θ (flat fp32 per fragment) as the model's own tensors, each in memory of its own."""
        params = parameters(self.layout.plan, self.layout.shapes, values)
        if self.build is None:
            return {**params, **{alias: params[name].clone() for alias, name in self.aliases.items()}}
        return full_state_dict(self.build(), params)


def served_model(config: Config, init: Path | None) -> ServedModel:
    """The reference workload's model under ``config``, or the user's from its ``--init`` file."""
    protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
    if init is None:
        from ddiloco.workload.trainer import build_model

        return ServedModel(reference_layout(config, protocol), lambda: build_model(config.model, config.run.seed))
    from safetensors import safe_open

    layout = layout_from_file(init, protocol)  # one line for a file that is missing or not initial weights
    with safe_open(str(init), framework="pt") as f:
        metadata = f.metadata() or {}
    return ServedModel(layout, aliases=json.loads(metadata.get("aliases", "{}")), hf_config=metadata.get("hf_config"))


# ---- Θ from a state directory ------------------------------------------------------------------


def from_state_dirs(paths: Sequence[Path], init: Path | None) -> tuple[ServedModel, dict[int, torch.Tensor]]:
    """Θ as the synchronizer (every shard of it, one state directory each) would resume it."""
    model: ServedModel | None = None
    values: dict[int, torch.Tensor] = {}
    for path in paths:
        saved = _latest(path)
        config = _config_of(path, saved)
        if model is None:
            model = served_model(config, init)
        values.update(_replayed(path, saved, config, model))
    assert model is not None
    missing = sorted(set(range(len(model.layout.plan.fragments))) - set(values))
    if missing:
        raise ConfigError(f"the state directories given hold no fragment {missing[:5]}: a sharded synchronizer keeps "
                          "one directory per shard; give them all, comma-separated")
    return model, values


def _latest(path: Path) -> dict[str, Any]:
    """The latest checkpoint in ``path`` (its fragments not read yet): what every export starts from."""
    if not path.is_dir() or not has_checkpoint(path):
        raise ConfigError(holds_no_run(path))
    saved = load_latest(path)
    if saved is None:
        raise ConfigError(f"{str(path)!r} holds a round log but no checkpoint (the synchronizer died before its "
                          "first one): resume it with `ddiloco sync --resume` and the run's options, stop it (its "
                          "final checkpoint), then export")
    return saved


def _config_of(path: Path, saved: dict[str, Any]) -> Config:
    """The run's configuration, which its checkpoints carry."""

    try:
        return config_of_sync(saved["service"]["config"])
    except (KeyError, TypeError):
        raise CheckpointError(f"the checkpoint in {str(path)!r} does not carry its run's configuration") from None


def _replayed(path: Path, saved: dict[str, Any], config: Config, model: ServedModel) -> dict[int, torch.Tensor]:
    """Each fragment this state directory's shard owns: the checkpoint's value with the log after it replayed,
    by a synchronizer core restored as ``--resume`` restores one."""
    protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
    layout = model.layout
    layout_sha256 = layout.sha256(protocol)
    if saved["service"].get("layout_sha256") != layout_sha256:
        raise ConfigError(f"{str(path)!r} holds a run of another model than " + (
            "the reference workload: it served your own; pass the --init FILE given to `ddiloco sync`"
            if model.build else "the --init file given: pass the one given to `ddiloco sync`"))
    shard = protocol.shard_of(int((saved["core"].get("owned") or [0])[0]))
    core = Synchronizer(protocol, layout.initial_values,
                        embedding_fragments=[f.index for f in layout.plan.fragments if f.is_embedding],
                        limits=config.run_limits(checkpoint_every_rounds=0, checkpoint_every_s=0.0), shard=shard)

    def replay(r: LoggedRound) -> bool:
        return core.replay_round(FragmentUpdate(r.fragment, r.version, protocol.downlink_codec, r.payload, 0),
                                 plain=r.plain)

    restore_state(path, layout_sha256, {"layout_sha256": layout_sha256, "shard": shard},
                  lambda checkpoint: core.load_state_dict(checkpoint["core"]), replay)
    return {p: core.value(p).clone() for p in core.owned}


def export_run(paths: Sequence[Path], out: Path, init: Path | None = None) -> None:
    """The model file a run of real processes ends with: Θ from its synchronizers' final checkpoints."""
    model, values = from_state_dirs(paths, init)
    save_state_dict(out, model.state_dict(values))


# ---- Θ from a running synchronizer -------------------------------------------------------------


def from_synchronizer(addresses: Sequence[str], init: Path | None, *, token: str | None = None,
                      tls_ca: str | None = None) -> tuple[ServedModel, dict[int, torch.Tensor]]:
    """Θ as the running synchronizer (every shard of it) holds it now, without registering a learner."""
    from ddiloco.runtime.client import SyncClient
    from ddiloco.runtime.sharded import ShardedClient

    clients = [SyncClient(a, token=token, tls_ca=tls_ca) for a in addresses]
    with ShardedClient(list(addresses), clients=clients) as sharded:
        probe = clients[0].probe("ddiloco-export")
        config = config_of_sync(probe.run_config)
        model = served_model(config, init)
        if model.layout.sha256(config.protocol.for_mode(config.run.mode, config.run.learners)) != \
                probe.header.layout_sha256:
            if init is not None:
                raise ConfigError(f"--init {str(init)!r} is not the model the synchronizer at {addresses[0]} serves")
            model = ServedModel(_layout_of_header(probe.header))
        state = sharded.fetch_state()
    return model, {f.fragment: f.values for f in state.fragments}


def _layout_of_header(header: Any) -> ModelLayout:
    """The served layout as a join header gives it (an own model exported without its ``--init`` file)."""
    shapes = {p.name: tuple(p.shape) for f in header.fragments for p in f.params}
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}  # shapes, no memory
    return ModelLayout(plan=plan_from_layout(header, meta), shapes=shapes, initial_values=[])


# ---- writing ----------------------------------------------------------------------------------


def check_out(out: Path, *, force: bool) -> None:
    """Refuse, before any work, an output that exists (without ``force``) or cannot be written."""
    if out.exists() and not force:
        raise ConfigError(f"{str(out)!r} exists: pass --force to replace it")
    if out.exists() and out.is_dir():
        raise ConfigError(f"{str(out)!r} is a directory")
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{str(out)!r}: cannot write in {parent}")


def save_hf(folder: Path, tensors: Mapping[str, torch.Tensor], hf_config: str | None, dtype: str = "fp32") -> None:
    """A Hugging Face folder (``config.json``, ``model.safetensors``) that ``from_pretrained`` loads."""
    if hf_config is None:
        raise ConfigError("--hf: the run did not start from a Hugging Face model (its --init file records no "
                          "Hugging Face configuration; write it with save_initial_state from such a model)")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line says what was written

    fields = json.loads(hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
    held = model.state_dict()
    loaded = {held[name].data_ptr() for name in tensors if name in held}
    untied = [name for name in missing if held[name].data_ptr() not in loaded]
    if unexpected or untied:
        raise ConfigError(f"--hf: the exported parameters do not fit {type(model).__name__} "
                          f"(missing {sorted(untied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.to(DTYPES[dtype]).save_pretrained(str(folder))
