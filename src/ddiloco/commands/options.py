"""Options shared by the commands that train the reference workload (run, compare, learner).

The configuration (presets, defaults) sits beside the model's and imports torch: each function
imports it when called, so a command that only needs :func:`positive_seconds` starts fast."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.workload_settings import DEVICE_CHOICES

if TYPE_CHECKING:
    from ddiloco.runtime.launch.topology import Topology
    from ddiloco.settings.config import Config


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """Preset, config file, overrides, seed and corpus: what defines the workload."""
    from ddiloco.settings.config_sources import PRESETS

    parser.add_argument("--preset", default="default", help=f"size preset: {', '.join(PRESETS)} (default: default)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with [run], [model], [train], [protocol], ...")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set protocol.quorum=2")
    parser.add_argument("--seed", type=int, help="seed for weights, data order, jitter and failures")
    parser.add_argument("--corpus", metavar="DIR", help="train on this directory of text files")


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """Where learners train; not part of the run's configuration (mixed hardware joins one run)."""
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help=f"where learners train: {DEVICE_CHOICES} (default: auto, the first of cuda, mps, cpu)")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (argparse turns the error into one line, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_log_level_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log messages of this level and above, on stderr (default: info)")


def _by_preset(key: str) -> str:
    from ddiloco.settings.config_sources import MAIN_JOB, PRESETS

    return ", ".join(f"{p} {MAIN_JOB[p]['faults'][key]:g}" for p in PRESETS)


def add_cluster_options(parser: argparse.ArgumentParser, *, with_mode: bool = True, main_job: bool = False) -> None:
    """Everything a virtual run needs on top of the workload; ``main_job``: the failure
    defaults are ``ddiloco run``'s (:data:`ddiloco.settings.config_sources.MAIN_JOB`), else none."""
    from ddiloco.settings.config import MODES, FaultConfig

    add_workload_options(parser)
    if with_mode:
        parser.add_argument("--mode", help=f"one of {', '.join(MODES)} (default: decoupled)")
    parser.add_argument("--learners", type=int, metavar="M", help="number of learners (default 4)")
    defaults = FaultConfig()
    parser.add_argument("--mtbf", type=float, metavar="SECONDS",
                        help="mean virtual seconds between failures of each learner; 0 = none (default: "
                        + (f"{_by_preset('mtbf_s')}; real processes: 0)" if main_job else "0)"))
    parser.add_argument("--downtime", type=float, metavar="SECONDS",
                        help="mean virtual seconds a failed learner stays down (default: "
                        + (f"{_by_preset('downtime_s')})" if main_job else f"{defaults.downtime_s:g})"))
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, metavar="N", help="budget: tokens over all learners (preset's by default)")
    budget.add_argument("--time", type=float, metavar="SECONDS", help="budget: virtual seconds instead of tokens")
    parser.add_argument("--out", metavar="DIR", help="output directory")
    add_device_option(parser)


def config_from_args(args: argparse.Namespace, *, main_job: bool = False, processes: bool = False) -> Config:
    """The run's configuration; ``main_job`` (``ddiloco run`` on the virtual cluster) adds the
    preset's failures and slow learner (:data:`ddiloco.settings.config_sources.MAIN_JOB`) beneath the file,
    the overrides and the flags; ``processes`` (``--runtime processes``) a training time where no budget is given."""
    from ddiloco.settings.config_sources import build_config

    return build_config(
        preset=args.preset,
        main_job=main_job,
        processes=processes,
        config_file=args.config,
        overrides=tuple(args.overrides),
        run__mode=getattr(args, "mode", None),
        run__learners=getattr(args, "learners", None),
        run__seed=args.seed,
        run__tokens=getattr(args, "tokens", None),
        run__time_s=getattr(args, "time", None),
        faults__mtbf_s=getattr(args, "mtbf", None),
        faults__downtime_s=getattr(args, "downtime", None),
        train__corpus=args.corpus,
    )


def add_hosts_options(parser: argparse.ArgumentParser) -> None:
    """Where the processes of a local run live, and how fast their links are (--hosts netns)."""
    from ddiloco.runtime.launch.placement import Hosts

    parser.add_argument("--hosts", choices=[str(h) for h in Hosts], default=str(Hosts.LOCAL),
                        help="local: every process on 127.0.0.1 (default); netns: the synchronizer and each "
                        "learner in its own network namespace behind a capped link (root)")
    links = parser.add_mutually_exclusive_group()
    links.add_argument("--link-rate", metavar="RATE",
                       help="with --hosts netns: cap every learner's link at RATE each way, e.g. 20mbit, 500kbit")
    links.add_argument("--topology", metavar="FILE.toml",
                       help="with --hosts netns: regions of learners and their link rates (docs/bandwidth.md)")


def topology_from_args(args: argparse.Namespace, learners: int) -> "Topology | None":
    """The run's topology for --hosts netns (None for local), checked before anything is created."""
    from ddiloco.runtime.launch.netns import check_available
    from ddiloco.runtime.launch.placement import Hosts
    from ddiloco.runtime.launch.topology import load_topology, parse_rate, uniform

    if args.hosts != Hosts.NETNS:
        given = "--link-rate" if args.link_rate is not None else "--topology" if args.topology else None
        if given:
            raise ConfigError(f"{given} needs --hosts netns (links are capped between network namespaces)")
        return None
    names = [f"learner-{i}" for i in range(learners)]
    if args.topology:
        topology = load_topology(args.topology, names)
    else:
        topology = uniform(names, None if args.link_rate is None else parse_rate(args.link_rate, "--link-rate"))
    check_available()
    return topology
