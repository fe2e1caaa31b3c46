"""An FSDP2 model's parameters as this rank holds them, checked before a sharded learner starts.

A sharded learner measures Δ on each rank's local shard and sends it as that rank's slice of the
fragment (``core/shared/slices.py``). That is right only if every parameter is placed the way the slice
arithmetic assumes — ``Shard(0)`` on a 1-D mesh over all the job's ranks, with the rows
``torch.chunk`` gives this rank — and if all ranks see the same parameters. Anything else would
send a Δ measured on values the synchronizer files under other indices: a silent wrong model. So
each is checked here, and refused in one line naming the parameter or the rank (``ConfigError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.fragments import Fragment, FragmentPlan
from ddiloco.core.shared.slices import SliceSpec, fragment_slice, shard_rows


@dataclass(frozen=True, slots=True)
class RankParams:
    """The model's parameters on this rank: global shapes, and the local shards the learner trains on."""

    rank: int
    world: int
    shapes: dict[str, tuple[int, ...]]
    """Global shapes, by name (what the synchronizer serves)."""
    local: dict[str, torch.Tensor]
    """This rank's rows of each parameter (FSDP2's own memory: written in place, never replaced)."""

    def slices(self, plan: FragmentPlan, rank: int | None = None) -> list[SliceSpec]:
        """Per fragment, the slice of ``rank`` (this rank by default)."""
        r = self.rank if rank is None else rank
        return [fragment_slice([self.shapes[n] for n in f.param_names], r, self.world) for f in plan.fragments]

    def local_plan(self, plan: FragmentPlan) -> FragmentPlan:
        """``plan`` with each fragment's length this rank's slice's: what its learner core holds."""
        specs = self.slices(plan)
        return FragmentPlan(fragments=tuple(Fragment(index=f.index, param_names=f.param_names, numel=s.numel,
                                                     offset=f.offset, is_embedding=f.is_embedding)
                                            for f, s in zip(plan.fragments, specs)), period=plan.period)

    def check_fragments(self, plan: FragmentPlan, sharded: set[str]) -> None:
        """ConfigError naming a fragment that holds an unsharded parameter (every parameter must be a shard)."""
        for f in plan.fragments:
            plain = [n for n in f.param_names if n not in sharded]
            if plain:
                raise ConfigError(f"parameter {plain[0]!r} (fragment {f.index}) is not an FSDP2 shard, unlike "
                                  f"{sorted(sharded)[0]!r}: a sharded learner needs fully_shard over every "
                                  "parameter (wrap the root module too)")


def rank_params(model: nn.Module, group: Any = None) -> tuple[RankParams, set[str]]:
    """This rank's shards of ``model``, checked (see the module's docstring); the names that are shards."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("the model's parameters are DTensors, but torch.distributed is not initialized")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes: dict[str, tuple[int, ...]] = {}
    local: dict[str, torch.Tensor] = {}
    sharded: set[str] = set()
    for name, p in model.named_parameters():
        shapes[name] = tuple(p.shape)
        if not isinstance(p, DTensor):
            local[name] = p.data
            continue
        sharded.add(name)
        local[name] = _local_shard(name, p, rank, world)
    _check_ranks_agree(shapes, group)
    return RankParams(rank, world, shapes, local), sharded


def _local_shard(name: str, p: DTensor, rank: int, world: int) -> torch.Tensor:
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise ConfigError(f"parameter {name!r} is placed on a {mesh.ndim}-D device mesh {tuple(mesh.shape)}: a "
                          "sharded learner supports FSDP2 on a 1-D mesh (HSDP and tensor parallelism are not "
                          "supported)")
    if mesh.size() != world or mesh.mesh.flatten().tolist() != list(range(world)):
        raise ConfigError(f"parameter {name!r} is sharded over ranks {mesh.mesh.flatten().tolist()}, not over all "
                          f"{world} ranks of the job")
    if tuple(p.placements) != (Shard(0),):
        raise ConfigError(f"parameter {name!r} is placed as {tuple(p.placements)}: a sharded learner needs "
                          "FSDP2's Shard(0)")
    if not p.shape:
        raise ConfigError(f"parameter {name!r} is 0-dimensional: it has no rows to shard")
    t = p.to_local()
    start, stop = shard_rows(p.shape[0], rank, world)
    if tuple(t.shape) != (stop - start, *p.shape[1:]) or not t.is_contiguous():
        raise ConfigError(f"rank {rank} holds {tuple(t.shape)} of parameter {name!r} {tuple(p.shape)}, expected "
                          f"rows {start}..{stop} ({(stop - start, *p.shape[1:])}, contiguous)")
    return t


def _check_ranks_agree(shapes: dict[str, tuple[int, ...]], group: Any) -> None:
    """ConfigError on every rank, naming the first rank whose parameters differ from rank 0's (each rank
    checked its own shards against these global shapes)."""
    mine = list(shapes.items())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    for other, theirs in enumerate(everyone):
        if theirs != first:
            raise ConfigError(f"rank {other} disagrees with rank 0 on the layout: {_difference(first, theirs)}")


def _difference(a: Sequence[tuple[str, tuple[int, ...]]], b: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    for (na, sa), (nb, sb) in zip(a, b):
        if na != nb:
            return f"parameter {nb!r} where rank 0 has {na!r}"
        if sa != sb:
            return f"parameter {na!r} has shape {sb} there, {sa} on rank 0"
    return f"{len(b)} parameters there, {len(a)} on rank 0"
