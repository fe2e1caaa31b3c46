"""How much wide-area bandwidth data parallel and Decoupled DiLoCo need (docs/bandwidth.md).

Both are measured per site and per direction, because a site's WAN link is what one buys.

- Data parallel all-reduces every step's gradients (``dp_bits``, bf16) across the ``sites``.
  A ring all-reduce (or reduce-scatter + all-gather) puts 2(K - 1)/K of the payload on each
  site's link in each direction, plus 2(K - 1) latency hops. It can hide behind the backward
  pass (``backward_share`` of the step) and nothing else: any excess lengthens the step.
- Decoupled DiLoCo sends every parameter once per H inner steps, one fragment at a time
  (P = H by default: one fragment per step), quantized to ``bits`` (int4). With the
  synchronizer sharded by fragment across the sites, each fragment's contributions go to
  its owner and the merged value comes back: again 2(K - 1)/K of the fragment per site and
  direction. Transfers are pipelined behind compute; a fragment must make its round trip
  within ``overlap_steps`` (tau) steps, else the learner waits for the excess.

The required bandwidth is the smallest link at which compute utilization (compute time /
step time) reaches ``target_utilization``. docs/bandwidth.md gives the sources of each input
and which ones the presets had to assume.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Mapping

from ddiloco.core.shared.errors import ConfigError

GBIT = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthInputs:
    """Everything the model needs; defaults are the ``paper-8dc`` preset."""

    params: float = 10e9
    """Model parameters."""
    step_s: float = 2.0
    """Compute time of one inner step, without any wide-area communication."""
    sites: int = 8
    """Datacenters (one learner each for Decoupled DiLoCo; one data-parallel group each)."""
    dp_bits: float = 16.0
    """Bits per gradient value all-reduced by data parallel (bf16)."""
    bits: float = 4.0
    """Bits per outer-gradient value sent by Decoupled DiLoCo (int4), both directions."""
    block_size: int = 0
    """Quantization block: adds a 32-bit scale per block (the runtime's codec); 0 = ignore."""
    inner_steps: int = 40
    """H: inner steps between two synchronizations of the same fragment."""
    fragments: int | None = None
    """P: fragments; None = H (one fragment per step, the paper's default)."""
    overlap_steps: int = 5
    """tau: steps a fragment has for its round trip before the learner must wait."""
    target_utilization: float = 0.95
    """Compute utilization the link must allow (compute time / step time)."""
    backward_share: float = 2.0 / 3.0
    """Share of a step data parallel can overlap its all-reduce with (the backward pass)."""
    latency_s: float = 0.0
    """One-way wide-area latency between sites."""

    def __post_init__(self) -> None:
        checks: dict[str, tuple[float, Callable[[float], bool], str]] = {
            "params": (self.params, lambda v: v > 0, "positive"),
            "step_s": (self.step_s, lambda v: v > 0, "positive"),
            "sites": (self.sites, lambda v: v >= 1, ">= 1"),
            "dp_bits": (self.dp_bits, lambda v: v > 0, "positive"),
            "bits": (self.bits, lambda v: v > 0, "positive"),
            "block_size": (self.block_size, lambda v: v >= 0, ">= 0"),
            "inner_steps": (self.inner_steps, lambda v: v >= 1, ">= 1"),
            "overlap_steps": (self.overlap_steps, lambda v: v >= 0, ">= 0"),
            "target_utilization": (self.target_utilization, lambda v: 0 < v <= 1, "in (0, 1]"),
            "backward_share": (self.backward_share, lambda v: 0 <= v <= 1, "in [0, 1]"),
            "latency_s": (self.latency_s, lambda v: v >= 0, ">= 0"),
        }
        if self.fragments is not None:
            checks["fragments"] = (self.fragments, lambda v: v >= 1, ">= 1")
        for name, (value, ok, what) in checks.items():
            if not (math.isfinite(value) and ok(value)):
                raise ConfigError(f"{name} must be {what}, got {value}")

    @property
    def fragment_count(self) -> int:
        return self.inner_steps if self.fragments is None else self.fragments

    @property
    def wire_bits(self) -> float:
        """Bits per value on the wire for Decoupled DiLoCo, scales included."""
        return self.bits + (32.0 / self.block_size if self.block_size else 0.0)


PRESETS: dict[str, BandwidthInputs] = {
    # 8 datacenters: published ~198 Gbit/s for data parallel vs ~0.84 for Decoupled DiLoCo.
    "paper-8dc": BandwidthInputs(),
    # 12B model across 4 US regions on 2-5 Gbit/s, "more than 20x" faster than data parallel.
    "paper-12b-4regions": BandwidthInputs(params=12e9, step_s=1.0, sites=4),
}
PUBLISHED = {
    "paper-8dc": {"dp_gbps": 198.0, "decoupled_gbps": 0.84},
    "paper-12b-4regions": {"link_gbps": [2.0, 5.0], "min_speedup": 20.0},
}
PRESET_LINKS_GBPS = {"paper-8dc": (), "paper-12b-4regions": (2.0, 5.0)}


def preset(name: str) -> BandwidthInputs:
    if name not in PRESETS:
        raise ConfigError(f"unknown bandwidth preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def with_overrides(inputs: BandwidthInputs, **overrides: object) -> BandwidthInputs:
    """``inputs`` with every non-None override applied (and validated)."""
    known = {f.name for f in fields(BandwidthInputs)}
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"unknown bandwidth input {sorted(unknown)[0]!r}")
    return replace(inputs, **{k: v for k, v in overrides.items() if v is not None})


def parse_params(text: str) -> float:
    """'12B', '350M', '1.5e10' -> parameter count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if match is None:
        raise ConfigError(f"cannot read parameter count {text!r}; try 12B, 350M or 1.2e10")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return float(match.group(1)) * scale


def _ring_share(sites: int) -> float:
    return 2.0 * (sites - 1) / sites


def dp_bits_per_step(x: BandwidthInputs) -> float:
    """Bits each site's link carries per step and direction under data parallel."""
    return _ring_share(x.sites) * x.params * x.dp_bits


def decoupled_bits_per_step(x: BandwidthInputs) -> float:
    """Average bits per site, step and direction under Decoupled DiLoCo (sharded synchronizer)."""
    return _ring_share(x.sites) * x.params * x.wire_bits / x.inner_steps


def learner_bytes_per_step(x: BandwidthInputs, *, header_bytes: float = 0.0) -> float:
    """Bytes one learner uploads (and downloads) per inner step.

    This is what the runtime's wire counters should show per learner and direction: the
    learner sends every parameter once per H steps at ``wire_bits`` and receives the merged
    fragments back the same way. ``header_bytes`` is the framing of one message (P messages
    per H steps); 0 gives the payload alone. :func:`check_counted_bytes` compares it with
    what a run counted.
    """
    return (x.params * x.wire_bits / 8.0 + header_bytes * x.fragment_count) / x.inner_steps


def dp_step_s(x: BandwidthInputs, link_bps: float) -> float:
    """Step time of data parallel on a link of ``link_bps`` bits/s per site and direction."""
    if x.sites == 1:
        return x.step_s
    comm_s = dp_bits_per_step(x) / link_bps + 2 * (x.sites - 1) * x.latency_s
    return x.step_s + max(0.0, comm_s - x.backward_share * x.step_s)


def decoupled_step_s(x: BandwidthInputs, link_bps: float) -> float:
    """Average step time of a Decoupled DiLoCo learner on a link of ``link_bps`` bits/s.

    The link must keep up with one fragment per H/P steps (throughput), and each fragment's
    round trip must fit in tau steps (deadline); what does not fit is waited for.
    """
    if x.sites == 1:
        return x.step_s
    streaming_s = max(x.step_s, decoupled_bits_per_step(x) / link_bps)
    fragment_bits = _ring_share(x.sites) * x.params * x.wire_bits / x.fragment_count
    round_trip_s = fragment_bits / link_bps + 2.0 * x.latency_s
    wait_s = max(0.0, round_trip_s - x.overlap_steps * x.step_s)
    return streaming_s + wait_s * x.fragment_count / x.inner_steps


def required_bps(x: BandwidthInputs, step_time: Callable[[BandwidthInputs, float], float]) -> float:
    """Smallest link (bits/s) at which compute utilization reaches the target; inf if none does."""
    if x.sites == 1:
        return 0.0
    target_s = x.step_s / x.target_utilization * (1 + 1e-12)
    lo, hi = 1.0, 1e18
    if step_time(x, hi) > target_s:
        return math.inf  # latency alone already misses the target
    for _ in range(200):  # bisection in log space: step time falls as the link grows
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if step_time(x, mid) <= target_s else (mid, hi)
        if hi / lo < 1 + 1e-9:
            break
    return hi


@dataclass(frozen=True, slots=True)
class LinkResult:
    """Both methods on a given link: step times, utilizations and the speed-up."""

    link_gbps: float
    dp_step_s: float
    decoupled_step_s: float
    dp_utilization: float
    decoupled_utilization: float
    speedup: float


@dataclass(frozen=True, slots=True)
class BandwidthResult:
    inputs: BandwidthInputs
    dp_gbps: float
    decoupled_gbps: float
    learner_bytes_per_step: float
    links: tuple[LinkResult, ...]

    @property
    def reduction(self) -> float:
        return self.dp_gbps / self.decoupled_gbps if self.decoupled_gbps > 0 else math.inf

    def to_json(self) -> dict[str, object]:
        return {
            "inputs": asdict(self.inputs),
            "dp_gbps": self.dp_gbps,
            "decoupled_gbps": self.decoupled_gbps,
            "reduction": self.reduction,
            "learner_bytes_per_step": self.learner_bytes_per_step,
            "links": [asdict(link) for link in self.links],
        }


def evaluate(x: BandwidthInputs, links_gbps: tuple[float, ...] = ()) -> BandwidthResult:
    """Required bandwidth of both methods, and their speeds on each given link."""
    for link in links_gbps:
        if not (link > 0 and math.isfinite(link)):
            raise ConfigError(f"link bandwidth must be positive, got {link} Gbit/s")
    results = []
    for link in links_gbps:
        dp_s, dd_s = dp_step_s(x, link * GBIT), decoupled_step_s(x, link * GBIT)
        results.append(LinkResult(link, dp_s, dd_s, x.step_s / dp_s, x.step_s / dd_s, dp_s / dd_s))
    return BandwidthResult(
        inputs=x,
        dp_gbps=required_bps(x, dp_step_s) / GBIT,
        decoupled_gbps=required_bps(x, decoupled_step_s) / GBIT,
        learner_bytes_per_step=learner_bytes_per_step(x),
        links=tuple(results),
    )


# --- cross-check against counted bytes (virtual cluster, gRPC runtime) ------------------------


@dataclass(frozen=True, slots=True)
class ByteCheck:
    """Fragment bytes one direction of a run counted, against :func:`learner_bytes_per_step`."""

    direction: str
    learners: int
    steps: int
    """Inner steps the run completed, summed over learners."""
    counted_bytes: int
    """Bytes on fragments >= 0 (fragment -1, registration and heartbeats, is left out)."""
    predicted_bytes: float
    """Model bytes per learner and step x ``steps`` x ``rounds_per_period``."""
    end_allowance_bytes: float
    """What the end of a run may add or take away: one message per fragment and learner (the
    final flush of unsent progress adds one; a last round merged after the learners flushed
    and left is not sent to them)."""
    rounds_per_period: float

    @property
    def counted_per_step(self) -> float:
        return self.counted_bytes / self.steps if self.steps else 0.0

    @property
    def predicted_per_step(self) -> float:
        return self.predicted_bytes / self.steps if self.steps else 0.0

    @property
    def ratio(self) -> float:
        """Counted / predicted; slightly above 1 by the end allowance and codec padding."""
        return self.counted_bytes / self.predicted_bytes if self.predicted_bytes > 0 else math.inf

    def agrees(self, rel_tol: float = 1e-3) -> bool:
        """Counted lies within the end allowance of predicted, up to ``rel_tol``
        (per-block scales and packed codes round up to whole bytes in each message)."""
        low = (self.predicted_bytes - self.end_allowance_bytes) * (1.0 - rel_tol)
        high = (self.predicted_bytes + self.end_allowance_bytes) * (1.0 + rel_tol)
        return low <= self.counted_bytes <= high


def check_counted_bytes(counts: Mapping[tuple[str, int, str], int], steps_per_learner: Mapping[str, int],
                        x: BandwidthInputs, *, header_bytes: float = 0.0,
                        rounds_per_period: float = 1.0) -> dict[str, ByteCheck]:
    """Compare a run's byte counters with the model, per direction ("up", "down").

    ``counts`` maps (learner, fragment, direction) to bytes, as ``ByteLedger.counts`` of
    either driver (:mod:`ddiloco.measures`) does; fragment -1
    (control traffic: registration, full-state fetches, heartbeats) is left out.
    ``steps_per_learner`` maps each learner to the inner steps it completed; ``x`` holds the
    run's parameter count, bits, ``block_size``, period H and fragments P; ``header_bytes``
    is the framing of one message. The uplink carries each fragment once per H steps. The
    downlink carries every merged version of each fragment, ``rounds_per_period`` of them
    per H steps: 1 when the grace window gathers all learners into one round (the model's
    assumption), up to M when their phases drift apart.
    """
    if not rounds_per_period > 0:
        raise ConfigError(f"rounds_per_period must be positive, got {rounds_per_period}")
    learners = sorted(steps_per_learner)
    steps = int(sum(steps_per_learner.values()))
    per_step = learner_bytes_per_step(x, header_bytes=header_bytes)
    one_of_each = x.params * x.wire_bits / 8.0 + header_bytes * x.fragment_count
    checks = {}
    for direction, rounds in (("up", 1.0), ("down", rounds_per_period)):
        counted = sum(n for (learner, fragment, d), n in counts.items()
                      if d == direction and fragment >= 0 and learner in steps_per_learner)
        checks[direction] = ByteCheck(direction, len(learners), steps, int(counted), per_step * steps * rounds,
                                      one_of_each * len(learners), rounds)
    return checks
