"""Split a model's parameters into fragments that are synchronized at staggered steps.

Fragment p is sent every ``period`` (H) inner steps, at steps s with s % H == t_p. Spreading
the offsets t_p over the period spreads the communication over time, so the network carries
a steady trickle instead of one burst per period (Streaming DiLoCo). The token embedding
(and a tied output head) is a fragment of its own because it is merged differently (plain
mean, not RDA): its rows are updated sparsely, so its learners' deltas are not near-orthogonal.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ddiloco.core.shared.choices import Fragmentation
from ddiloco.core.shared.errors import ConfigError

STRATEGIES = tuple(name.value for name in Fragmentation)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fragment:
    """One unit of synchronization: a set of whole parameter tensors."""

    index: int
    """Position in the plan, 0..P-1."""
    param_names: tuple[str, ...]
    """Names from ``model.named_parameters()``, in model order."""
    numel: int
    """Total number of elements: the length of the fragment's flat vector."""
    offset: int
    """t_p in [0, period): the fragment is due at steps s with s % period == offset."""
    is_embedding: bool
    """Holds the token embedding (and tied head); merged with the plain mean."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentPlan:
    """The fragments of one model and the period H at which each one is synchronized."""

    fragments: tuple[Fragment, ...]
    period: int
    """H: inner steps between two synchronizations of the same fragment."""
    _by_offset: dict[int, list[int]] = field(init=False, repr=False, compare=False)
    _by_name: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ConfigError(f"period must be >= 1, got {self.period}")
        if not self.fragments:
            raise ConfigError("a fragment plan needs at least one fragment")
        by_offset: dict[int, list[int]] = {}
        by_name: dict[str, int] = {}
        for position, frag in enumerate(self.fragments):
            if frag.index != position:
                raise ConfigError(f"fragment at position {position} has index {frag.index}")
            if not 0 <= frag.offset < self.period:
                raise ConfigError(
                    f"fragment {position} offset {frag.offset} not in [0, {self.period})"
                )
            by_offset.setdefault(frag.offset, []).append(position)
            for name in frag.param_names:
                if name in by_name:
                    raise ConfigError(f"parameter {name!r} is in two fragments")
                by_name[name] = position
        # Lookup tables: due() runs every inner step, fragment_of() per parameter.
        object.__setattr__(self, "_by_offset", by_offset)
        object.__setattr__(self, "_by_name", by_name)

    def due(self, step: int) -> list[int]:
        """Indices of the fragments to send after ``step`` inner steps (step >= 1)."""
        if step < 1:
            raise ValueError(f"step counts inner steps done and must be >= 1, got {step}")
        return list(self._by_offset.get(step % self.period, ()))

    def fragment_of(self, name: str) -> int:
        """Index of the fragment holding parameter ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is in no fragment") from None


def plan_fragments(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    *,
    num_fragments: int,
    period: int,
    strategy: str = "balanced",
    embedding_names: Collection[str] = (),
) -> FragmentPlan:
    """Assign every parameter tensor to one of ``num_fragments`` fragments.

    ``named_shapes`` is ``[(name, tuple(p.shape)) for name, p in model.named_parameters()]``.
    The embedding tensors (``embedding_names``) form fragment 0 alone when there are at least
    two fragments; the others are distributed over the remaining fragments by ``strategy``:
    ``balanced`` (greedy bin packing, largest first: near-equal fragment sizes, hence a
    steady bandwidth), ``layerwise`` (contiguous runs in model order) or ``strided``
    (round-robin in model order). Offsets are spread evenly: t_p = (p * period) // P.
    """
    if period < 1:
        raise ConfigError(f"period must be >= 1, got {period}")
    if num_fragments < 1:
        raise ConfigError(f"protocol.fragments must be >= 1, got {num_fragments}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown fragment strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    names = [name for name, _ in named_shapes]
    if not names:
        raise ConfigError("cannot plan fragments for a model without parameters")
    if len(set(names)) != len(names):
        raise ConfigError("parameter names must be unique")
    unknown = sorted(set(embedding_names) - set(names))
    if unknown:
        raise ConfigError(f"embedding_names not among the parameters: {unknown}")
    sizes = {name: math.prod(shape) for name, shape in named_shapes}
    embedding = [n for n in names if n in embedding_names]

    if num_fragments == 1:
        groups = [names]
    else:
        rest = [n for n in names if n not in embedding_names]
        bins = num_fragments - 1 if embedding else num_fragments
        if len(rest) < bins:
            raise ConfigError(
                f"protocol.fragments={num_fragments} needs at least {bins} non-embedding tensors, the model has "
                f"{len(rest)} (a fragment holds whole tensors): set protocol.fragments to at most "
                f"{len(rest) + (num_fragments - bins)}"
            )
        split = {"balanced": _balanced, "layerwise": _layerwise, "strided": _strided}[strategy]
        groups = ([embedding] if embedding else []) + split(rest, sizes, bins)

    order = {name: i for i, name in enumerate(names)}
    fragments = tuple(
        Fragment(
            index=p,
            param_names=tuple(sorted(group, key=order.__getitem__)),
            numel=sum(sizes[n] for n in group),
            offset=(p * period) // num_fragments,
            is_embedding=any(n in embedding_names for n in group),
        )
        for p, group in enumerate(groups)
    )
    return FragmentPlan(fragments=fragments, period=period)


def _balanced(names: list[str], sizes: dict[str, int], bins: int) -> list[list[str]]:
    """Greedy bin packing: largest tensor first into the currently lightest bin."""
    rank = {name: i for i, name in enumerate(names)}
    largest_first = sorted(names, key=lambda n: (-sizes[n], rank[n]))
    heap = [(0, b) for b in range(bins)]  # (load, bin): ties go to the lowest bin index
    groups: list[list[str]] = [[] for _ in range(bins)]
    for name in largest_first:
        load, b = heapq.heappop(heap)
        groups[b].append(name)
        heapq.heappush(heap, (load + sizes[name], b))
    return groups


def _layerwise(names: list[str], sizes: dict[str, int], bins: int) -> list[list[str]]:
    """Contiguous runs in model order, each cut placed nearest to k/bins of the total."""
    prefix = list(itertools.accumulate(sizes[n] for n in names))  # prefix[i]: sum of 0..i
    cuts = [0]
    for k in range(1, bins):
        target = prefix[-1] * k / bins
        lo, hi = cuts[-1] + 1, len(names) - (bins - k)  # keep every group non-empty
        c = bisect.bisect_left(prefix, target)
        candidates = {min(max(c, lo), hi), min(max(c + 1, lo), hi)}
        # A cut at c ends the group before names[c]; the mass before it is prefix[c - 1].
        cuts.append(min(candidates, key=lambda cut: (abs(prefix[cut - 1] - target), cut)))
    cuts.append(len(names))
    return [names[a:b] for a, b in zip(cuts, cuts[1:])]


def _strided(names: list[str], sizes: dict[str, int], bins: int) -> list[list[str]]:
    """Round-robin in model order: every fragment gets a slice of every depth."""
    return [names[b::bins] for b in range(bins)]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate into a new 1-D float32 vector: a fragment travels as one flat vector."""
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` in place, cast to their dtypes."""
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat vector has shape {tuple(flat.shape)}, expected ({total},)")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
            offset += n
