"""Where the hosts of a local run sit and how fast their links are: ``--link-rate`` and ``--topology``.

A topology groups learners into regions. Each region reaches the rest of the run through
one link, capped per direction (``up``: out of the region, ``down``: into it); a region of
one learner is that learner's own link. The synchronizer has a link of its own, uncapped
unless ``[sync] rate`` says otherwise. ``--link-rate R`` is the topology in which every
learner is its own region on a link of R. A topology file::

    [sync]
    rate = "1gbit"                # optional: the synchronizer's link

    [[region]]
    name = "us-east"
    rate = "50mbit"               # both directions; or up = "..." and down = "..."
    learners = ["learner-0", "learner-1"]

    [[region]]
    name = "asia"
    up = "5mbit"
    down = "10mbit"
    learners = ["learner-2", "learner-3"]

Rates are bits per second with a unit, as ``tc`` writes them: ``bit``, ``kbit``, ``mbit``,
``gbit`` (``/s`` optional, any case). Every learner of the run is placed exactly once.
Mistakes are one :class:`~ddiloco.core.shared.errors.ConfigError` naming the file and the value,
before anything is created.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config_sources import read_toml

UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_RATE = re.compile(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)(?:/s)?\s*")
REGION_KEYS = ("name", "rate", "up", "down", "learners")


def parse_rate(text: object, what: str) -> float:
    """``"20mbit"`` -> 20e6 bits per second; anything else is a ConfigError naming ``what``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        raise ConfigError(f"{what}: rate {text!r} has no unit (write it as a string, e.g. \"{text}mbit\")")
    if not isinstance(text, str):
        raise ConfigError(f"{what}: a rate is a string with a unit such as \"20mbit\", got {text!r}")
    match = _RATE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{what}: cannot read rate {text!r}; write it as tc does, e.g. 500kbit, 20mbit, 1gbit")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        raise ConfigError(f"{what}: rate {text!r} has no unit (bit, kbit, mbit or gbit per second)")
    if unit not in UNITS:
        raise ConfigError(f"{what}: unknown unit {match.group(2)!r} in {text!r} (bit, kbit, mbit or gbit per second)")
    bps = number * UNITS[unit]
    if not (math.isfinite(bps) and bps > 0):
        raise ConfigError(f"{what}: rate {text!r} must be positive")
    if bps < 8:
        raise ConfigError(f"{what}: rate {text!r} must be at least 8bit (one byte per second)")
    return bps


def format_rate(bps: float | None) -> str:
    """A rate as a person reads it (``uncapped`` for None)."""
    if bps is None:
        return "uncapped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


@dataclass(frozen=True, slots=True)
class Link:
    """One capped (or uncapped: None) link, per direction, in bits per second."""

    up_bps: float | None = None
    """Out of the hosts behind it, toward the rest of the run."""
    down_bps: float | None = None
    """Into the hosts behind it."""

    def describe(self) -> str:
        if self.up_bps == self.down_bps:
            return format_rate(self.up_bps)
        return f"up {format_rate(self.up_bps)}, down {format_rate(self.down_bps)}"


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    link: Link
    learners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    """The synchronizer's link and the learners' regions; every learner in exactly one."""

    sync: Link
    regions: tuple[Region, ...]

    def region_of(self, learner: str) -> Region:
        return next(r for r in self.regions if learner in r.learners)

    def to_dict(self) -> dict[str, Any]:
        return {"sync": {"up_bps": self.sync.up_bps, "down_bps": self.sync.down_bps},
                "regions": [{"name": r.name, "up_bps": r.link.up_bps, "down_bps": r.link.down_bps,
                             "learners": list(r.learners)} for r in self.regions]}


def uniform(learners: list[str], rate_bps: float | None) -> Topology:
    """Every learner its own region on a link of ``rate_bps`` each way (``--link-rate``; None: uncapped)."""
    link = Link(rate_bps, rate_bps)
    return Topology(Link(), tuple(Region(name, link, (name,)) for name in learners))


def load_topology(path: str | Path, learners: list[str]) -> Topology:
    """Read a topology file for a run whose learners are ``learners``; mistakes are one ConfigError."""
    data = read_toml(path, "topology")
    where = f"topology file {path}"
    unknown = sorted(set(data) - {"sync", "region"})
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (expected [sync] and [[region]] tables)")
    sync = data.get("sync", {})
    if not isinstance(sync, dict) or set(sync) - {"rate", "up", "down"}:
        raise ConfigError(f"{where}: [sync] takes rate, or up and down, only")
    entries = data.get("region", [])
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{where}: expected at least one [[region]] table")
    placed: dict[str, str] = {}
    regions = []
    for number, entry in enumerate(entries, 1):
        region = _region(entry, f"{where}, region {number}", learners, placed)
        if any(r.name == region.name for r in regions):
            raise ConfigError(f"{where}: region name {region.name!r} is used twice")
        regions.append(region)
    missing = [name for name in learners if name not in placed]
    if missing:
        raise ConfigError(f"{where}: {missing[0]} is not placed in any region (every learner of the run must be)")
    return Topology(_link(sync, f"{where}, [sync]"), tuple(regions))


def _region(entry: dict[str, Any], where: str, learners: list[str], placed: dict[str, str]) -> Region:
    unknown = sorted(set(entry) - set(REGION_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(REGION_KEYS)})")
    name = entry.get("name", "")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", name):
        raise ConfigError(f"{where}: name must be 1-32 letters, digits, '.', '_' or '-', got {name!r}")
    members = entry.get("learners")
    if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
        raise ConfigError(f"{where} ({name}): learners must be a non-empty list of learner ids")
    for member in members:
        if member not in learners:
            raise ConfigError(f"{where} ({name}): unknown host {member!r} (this run has "
                              f"{learners[0]} .. {learners[-1]})")
        if member in placed:
            raise ConfigError(f"{where} ({name}): {member} is placed twice (already in region {placed[member]!r})")
        placed[member] = name
    return Region(name, _link(entry, f"{where} ({name})"), tuple(members))


def _link(entry: dict[str, Any], where: str) -> Link:
    if "rate" in entry and ("up" in entry or "down" in entry):
        raise ConfigError(f"{where}: give rate, or up and down, not both")
    both = parse_rate(entry["rate"], f"{where}, rate") if "rate" in entry else None
    up = parse_rate(entry["up"], f"{where}, up") if "up" in entry else both
    down = parse_rate(entry["down"], f"{where}, down") if "down" in entry else both
    return Link(up, down)
