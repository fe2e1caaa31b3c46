"""``ddiloco run``: train the reference workload with Decoupled DiLoCo (or a baseline).

The virtual cluster is the default runtime: it is deterministic (same seed, same weights),
it expresses failures, mixed hardware and slow links, and it runs M learners on a laptop
without M processes fighting over its cores. ``--runtime processes`` runs the same
configuration as a real gRPC synchronizer and M learner processes on localhost (``--mode dp``:
M data-parallel ranks), or with ``--hosts netns`` each in its own network namespace behind a
capped link. SIGINT or SIGTERM stops a process run cleanly: its files are written and the
exit code is 130, as for an interrupted virtual run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.core.shared.errors import ConfigError, DdilocoError

if TYPE_CHECKING:  # the command line starts without torch and grpc
    from ddiloco.outputs.reporting import ProgressFn
    from ddiloco.runtime.launch.topology import Topology
    from ddiloco.settings.config import Config

HELP = "train on the virtual cluster (default: Decoupled DiLoCo, 4 learners)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.commands.options import add_cluster_options, add_hosts_options  # the presets: torch

    parser = sub.add_parser(
        "run",
        help=HELP,
        description="Train the reference byte-level transformer with Decoupled DiLoCo (or a baseline) "
        "on a deterministic virtual cluster: real PyTorch training, virtual time, seeded failures.",
    )
    add_cluster_options(parser, main_job=True)
    parser.add_argument("--runtime", choices=("virtual", "processes"), default="virtual",
                        help="virtual cluster (default, deterministic) or real processes on this host (gRPC)")
    add_hosts_options(parser)
    parser.set_defaults(func=run, out=None)


def run(args: argparse.Namespace) -> int:
    from ddiloco.commands.options import config_from_args, topology_from_args
    from ddiloco.core.shared.protocol_config import Mode
    from ddiloco.runtime.launch.placement import Hosts

    virtual = args.runtime == "virtual"
    if not virtual and (args.mtbf or args.downtime is not None):  # one line, not a trace silently ignored
        flag = f"--mtbf {args.mtbf:g}" if args.mtbf else f"--downtime {args.downtime:g}"
        raise ConfigError(f"{flag}: --runtime processes takes no simulated failure trace; inject kill -9 (and "
                          "SIGSTOP, cut links, synchronizer crashes) into real processes with `ddiloco chaos`")
    config = config_from_args(args, main_job=virtual, processes=not virtual)  # real processes: no failure trace
    if virtual and args.hosts != Hosts.LOCAL:
        raise ConfigError("--hosts netns needs --runtime processes (the virtual cluster has its own links)")
    topology = topology_from_args(args, config.run.learners)
    if not virtual:
        config.validate_for_processes()
    # The configuration is checked: only now what trains it (torch), so a bad value costs no torch import.
    from ddiloco.commands.display import console, print_report, progress_bar, what_happened
    from ddiloco.commands.interrupt import sigterm_as_interrupt
    from ddiloco.commands.live_view import live_view
    from ddiloco.outputs.reporting import MODEL_FILE, prepare_out, write_run
    from ddiloco.sim.experiment import Interrupted, run_virtual
    from ddiloco.workload.device import resolve_device

    device = resolve_device(args.device)
    out = prepare_out(args.out or f"runs/{config.run.mode}")
    label = f"{config.run.mode} M={config.run.learners}"
    if virtual:
        try:
            with sigterm_as_interrupt(), live_view(label, console) as (progress, observer):
                summary, rows = run_virtual(config, device=device, progress=progress, observer=observer, out=out)
        except Interrupted as stop:
            s = stop.summary
            console.print(f"ddiloco: interrupted at {s['done']:.0%} of the budget (virtual t={s['virtual_time_s']:.0f} s): "
                          f"kept {out}/metrics.jsonl ({len(stop.rows)} rows), TensorBoard events, config.toml and "
                          "a partial summary.json", highlight=False, soft_wrap=True)
            return 130
    else:
        from ddiloco.runtime.launch.local_run import state_dirs  # grpc only when asked for

        if config.run.time_s and not config.run.tokens:
            console.print(f"training for {config.run.time_s:g} s of wall time from the first learner's join "
                          "(--time or --tokens to choose), after the processes' start-up", highlight=False)
        with progress_bar(label) as progress:
            summary, rows = run_real(config, out, progress, device=str(device), topology=topology)
        write_run(out, config, summary, rows)
        if Mode(config.run.mode).uses_protocol:  # the model the final evaluation read, from the final checkpoints
            from ddiloco.runtime.sync.model_export import export_run

            export_run(state_dirs(out, config.protocol.shards), out / MODEL_FILE)
    print_report([summary], f"ddiloco run ({args.preset} preset, seed {config.run.seed})",
                 what_happened(summary, slow_factor=config.cluster.slow_factor))
    console.print(f"wrote {out}/summary.json, metrics.jsonl, config.toml, plot.png")
    if summary.get("interrupted"):
        console.print(f"ddiloco: interrupted by {summary['signal']}: stopped cleanly (final checkpoint and files "
                      "written)", highlight=False)
        return 130
    return 0


def run_real(config: Config, out: Path, progress: ProgressFn | None = None, *, timeout_s: float | None = None,
             device: str = "cpu", topology: Topology | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``--runtime processes``: the protocol's modes as a synchronizer and M learners
    (:func:`~ddiloco.runtime.launch.launcher.run_processes`), ``--mode dp`` as M data-parallel ranks
    (:func:`~ddiloco.baseline.data_parallel.run_data_parallel`); the same summary and rows either way."""
    from ddiloco.baseline.data_parallel import run_data_parallel
    from ddiloco.core.shared.protocol_config import Mode
    from ddiloco.runtime.launch.launcher import run_processes

    mode = Mode(config.run.mode)
    if mode is Mode.DP:
        return run_data_parallel(config, out, progress, timeout_s=timeout_s, device=device, topology=topology)
    if not mode.uses_protocol:
        raise DdilocoError(f"--runtime processes runs modes {Mode.DECOUPLED}, {Mode.DILOCO} and {Mode.DP}, not "
                           f"{config.run.mode!r} (elastic data parallel runs on the virtual cluster)")
    return run_processes(config, out, progress, timeout_s=timeout_s, device=device, topology=topology)
