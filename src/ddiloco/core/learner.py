"""The learner's side of the protocol as an I/O-free state machine.

The training loop stays the user's: after each inner step it calls :meth:`Learner.record_step`,
which returns the contributions that fell due (to be sent in the background), and it hands
every update that arrives to :meth:`Learner.apply_update` between two steps. The learner
keeps, per fragment, the anchor a_p (the last global value it adopted) with its version,
and the tokens, steps and compute seconds accumulated since the fragment was last sent.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Mapping

import torch

from ddiloco.core.codecs import Codec, get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.fragments import FragmentPlan, flatten, unflatten_into
from ddiloco.core.grace import MovingAverage
from ddiloco.core.messages import Contribution, FragmentUpdate, GlobalState


class UpdateResult(enum.Enum):
    APPLIED = "applied"
    IGNORED = "ignored"
    """Already held (duplicate or older); nothing changed."""
    GAP = "gap"
    """A version was missed: the learner needs the full state (``adopt``) before it can go on."""


@dataclass(frozen=True, slots=True)
class UnencodedContribution:
    """A due contribution whose Δ is taken but not yet compressed (see ``record_step_unencoded``)."""

    header: Contribution
    """Every field of the contribution but its payload, which is empty."""
    delta: torch.Tensor
    codec: Codec

    @property
    def fragment(self) -> int:
        return self.header.fragment

    def encode(self) -> Contribution:
        return dataclasses.replace(self.header, payload=self.codec.encode(self.delta))


@dataclass(slots=True)
class _Counters:
    tokens: int = 0
    steps: int = 0
    compute_s: float = 0.0
    first_step: int = 1


class Learner:
    """One learner's protocol state; holds references to the model's parameters, not copies."""

    def __init__(
        self,
        learner_id: str,
        config: ProtocolConfig,
        plan: FragmentPlan,
        named_parameters: Mapping[str, torch.Tensor],
    ) -> None:
        config.validate()
        self.learner_id = learner_id
        self.config = config
        self.plan = plan
        self._uplink = get_codec(config.codec, block_size=config.block_size)
        self._downlink = get_codec(config.downlink_codec, block_size=config.block_size)
        self._tensors = [[named_parameters[n] for n in f.param_names] for f in plan.fragments]
        self._anchors = [flatten(ts) for ts in self._tensors]
        self.versions: list[int] = [-1] * len(plan.fragments)
        """-1 until the learner adopts the global state; it may not contribute before."""
        self._counters = [_Counters() for _ in plan.fragments]
        self._seq = [0] * len(plan.fragments)
        self.step = 0
        self.step_time = MovingAverage()
        self.waiting: set[int] = set()
        """Fragments sent and not yet updated (only used when ``config.blocking``)."""

    @property
    def joined(self) -> bool:
        return min(self.versions) >= 0

    def can_step(self) -> bool:
        """False while a blocking (synchronous) learner waits for the fragments it sent."""
        return self.joined and not self.waiting

    def adopt(self, state: GlobalState) -> None:
        """Take the global value of every fragment: joining, rejoining or recovering from a gap."""
        if len(state.fragments) != len(self._tensors):
            raise ValueError(f"state has {len(state.fragments)} fragments, expected {len(self._tensors)}")
        for frag in state.fragments:
            values = frag.values.to(torch.float32).flatten()
            if values.numel() != self.plan.fragments[frag.fragment].numel:
                raise ValueError(f"fragment {frag.fragment}: {values.numel()} values, expected "
                                 f"{self.plan.fragments[frag.fragment].numel}")
            unflatten_into(values, self._tensors[frag.fragment])
            self._anchors[frag.fragment] = values.clone()
            self.versions[frag.fragment] = frag.version
        self._counters = [_Counters(first_step=self.step + 1) for _ in self._tensors]
        self._seq = [0] * len(self._tensors)  # the synchronizer forgets our numbering on register
        self.waiting.clear()

    def record_step(self, tokens: int, duration_s: float) -> list[Contribution]:
        """Account one finished inner step; return the contributions now due (in fragment order)."""
        return [d.encode() for d in self.record_step_unencoded(tokens, duration_s)]

    def record_step_unencoded(self, tokens: int, duration_s: float) -> list[UnencodedContribution]:
        """Like :meth:`record_step`, but leaves the compression to the caller.

        Δ is taken now (the parameters move on with the next step); ``encode()`` may then
        run on another thread, so a real learner never compresses inside its training loop.
        """
        if not self.joined:
            raise RuntimeError("learner stepped before adopting the global state")
        self.step += 1
        self.step_time.add(duration_s)
        for c in self._counters:
            c.tokens += tokens
            c.steps += 1
            c.compute_s += duration_s
        return [self._contribution(p) for p in self.plan.due(self.step)]

    def _contribution(self, p: int) -> UnencodedContribution:
        delta = self._anchors[p] - flatten(self._tensors[p])
        counters = self._counters[p]
        contribution = UnencodedContribution(
            header=Contribution(
                learner_id=self.learner_id,
                fragment=p,
                base_version=self.versions[p],
                seq=self._seq[p],
                tokens=counters.tokens,
                steps=counters.steps,
                compute_s=counters.compute_s,
                step_time_s=self.step_time.get(),
                codec=self._uplink.name,
                payload=b"",
                first_step=counters.first_step,
            ),
            delta=delta,
            codec=self._uplink,
        )
        self._seq[p] += 1
        self._counters[p] = _Counters(first_step=self.step + 1)
        if self.config.blocking:
            self.waiting.add(p)
        return contribution

    def flush(self) -> list[Contribution]:
        """End of training: send every fragment that has unsent steps, due or not."""
        return [d.encode() for d in self.flush_unencoded()]

    def flush_unencoded(self) -> list[UnencodedContribution]:
        """:meth:`flush` without the compression (see :meth:`record_step_unencoded`)."""
        return [self._contribution(p) for p, c in enumerate(self._counters) if c.steps > 0]

    def requeue(self, contribution: Contribution | UnencodedContribution) -> None:
        """A contribution could not be delivered: fold its counters into the fragment's next one.

        Its Δ needs no keeping — the next Δ is measured from the same anchor and contains it.
        """
        if isinstance(contribution, UnencodedContribution):
            contribution = contribution.header
        counters = self._counters[contribution.fragment]
        counters.tokens += contribution.tokens
        counters.steps += contribution.steps
        counters.compute_s += contribution.compute_s
        counters.first_step = min(counters.first_step, contribution.first_step)
        self.waiting.discard(contribution.fragment)

    def apply_update(self, update: FragmentUpdate) -> UpdateResult:
        """Merge a new global value: anchor ← Θ, θ ← α·θ + (1−α)·Θ."""
        p = update.fragment
        if not 0 <= p < len(self._tensors) or update.codec != self._downlink.name:
            raise ValueError(f"update for fragment {p} with codec {update.codec!r} does not fit this learner")
        if update.version <= self.versions[p]:
            return UpdateResult.IGNORED
        if update.version != self.versions[p] + 1:
            return UpdateResult.GAP
        anchor = self._anchors[p]
        anchor += self._downlink.decode(update.payload, anchor.numel())
        self.versions[p] = update.version
        alpha = self.config.alpha
        local = flatten(self._tensors[p])
        unflatten_into(local.mul_(alpha).add_(anchor, alpha=1.0 - alpha) if alpha else anchor, self._tensors[p])
        self.waiting.discard(p)
        return UpdateResult.APPLIED

    def anchor(self, fragment: int) -> torch.Tensor:
        """The global value this learner last adopted for ``fragment`` (do not modify)."""
        return self._anchors[fragment]
