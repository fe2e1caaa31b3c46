"""``ddiloco learner``: train the reference workload as one learner of a real run.

Run it once per learner (``--id`` names it); under ``torchrun`` it is one data-parallel job
of several ranks (gloo on CPU), of which rank 0 talks to the synchronizer. The process itself
is :mod:`ddiloco.commands.learner_process`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddiloco.settings.config import Config

HELP = "train the reference workload as one learner connected to `ddiloco sync`"

JOIN_TIMEOUT_S = 600.0
"""How long ``ddiloco learner`` waits at start for a synchronizer that does not answer: long enough
for one started later by hand or by a scheduler, short enough that a wrong address ends."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.commands.options import add_device_option, add_log_level_option, add_workload_options
    from ddiloco.settings.config_sources import PRESETS

    parser = sub.add_parser(
        "learner",
        help=HELP,
        description="Train one learner of a Decoupled DiLoCo run against a synchronizer. Without "
        "workload options it trains the synchronizer's own configuration; with them (the same as the "
        "synchronizer's) it checks that both agree. Under torchrun it is data parallel over its ranks.",
    )
    parser.add_argument("--connect", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                        help="the synchronizer's address; a synchronizer sharded by fragment: every shard's")
    parser.add_argument("--id", required=True, metavar="NAME", help="this learner's id (stable across restarts)")
    parser.add_argument("--index", type=int, metavar="N",
                        help="data shard (default: the id's trailing number, else assigned by the synchronizer)")
    add_workload_options(parser)
    add_device_option(parser)
    parser.set_defaults(preset=None)
    for action in parser._actions:  # noqa: SLF001 - the shared option's help names another default
        if action.dest == "preset":
            action.help = f"size preset: {', '.join(PRESETS)} (default: the synchronizer's whole configuration)"
    parser.add_argument("--fsdp", action="store_true",
                        help="under torchrun: shard the model over the job's ranks with FSDP2 (each rank holds, sends "
                        "and receives its own slice) instead of data parallel copies")
    parser.add_argument("--token-file", metavar="FILE", help="shared auth token (else $DDILOCO_TOKEN)")
    parser.add_argument("--secret-file", metavar="FILE",
                        help="this learner's own secret, when the synchronizer has --credentials (else $DDILOCO_SECRET)")
    parser.add_argument("--tls-ca", metavar="FILE", help="trust this certificate authority (TLS)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch intra-op threads (default: train.threads)")
    parser.add_argument("--max-steps", type=int, metavar="N", help="stop after N inner steps (default: the run's budget)")
    parser.add_argument("--min-step-s", type=float, default=0.0, metavar="SECONDS",
                        help="pad every inner step to at least this long (emulates slower hardware)")
    parser.add_argument("--join-timeout", type=float, metavar="SECONDS", default=JOIN_TIMEOUT_S,
                        help=f"give up if the synchronizer stays unreachable this long at start (default: "
                             f"{JOIN_TIMEOUT_S:g}; 0 waits for ever); a warning comes after a few seconds")
    add_log_level_option(parser)
    parser.add_argument("--progress-file", metavar="FILE",
                        help="keep this learner's own step count in FILE (JSON, rewritten about twice a second)")
    parser.add_argument("--batch-log", metavar="FILE",
                        help="append where this process's data resumed and each batch it trains, a line each (the "
                        "evidence `ddiloco chaos` counts batches trained twice or skipped across restarts from)")
    parser.add_argument("--tensorboard-dir", metavar="DIR",
                        help="also write the progress lines as TensorBoard scalars into DIR (rank 0)")
    parser.set_defaults(func=run)


def _resolve_config(args: argparse.Namespace, sync_config: dict) -> Config:
    """The synchronizer's configuration, with the local options on top; with ``--preset``, the
    local options alone (and the run's M, its data shards). Without ``--preset`` a learner's
    ``--set`` changes one value of the run it joins: it once switched to the default preset
    silently, then failed on a model shape the synchronizer did not have."""
    from ddiloco.commands.options import config_from_args
    from ddiloco.settings.config_sources import apply_override, config_of_sync, load_toml

    if args.preset is None:
        config = config_of_sync(sync_config)
        if args.config:
            config = load_toml(config, args.config)
        for assignment in args.overrides or ():
            config = apply_override(config, assignment)
        run = replace(config.run, seed=config.run.seed if args.seed is None else args.seed)
        return replace(config, run=run, train=replace(config.train, corpus=args.corpus or config.train.corpus)).validate()
    config = config_from_args(args)
    learners = int(sync_config["run"]["learners"])
    return replace(config, run=replace(config.run, learners=learners, mode=sync_config["run"]["mode"]))


def run(args: argparse.Namespace) -> int:
    from ddiloco.commands import learner_process as process

    return process.run(args, lambda sync_config: _resolve_config(args, sync_config))
