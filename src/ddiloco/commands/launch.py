"""``ddiloco launch``: a synchronizer and M copies of your own training script, supervised.

What ``torchrun`` is to data parallel: one command starts ``ddiloco sync`` and M copies of
the script after ``--``, each told the synchronizer's address, its learner id, its data shard
and the run's token through the environment (:mod:`ddiloco.runtime.script_env`, read by
``LearnerRuntime.from_env``). The children are the process launcher's
(:class:`~ddiloco.runtime.launch.processes.Processes`): they die with the launcher even on
``kill -9``. A copy that crashes is started again under its id (it rejoins the run as itself),
up to ``--max-restarts`` times; their output is shown after their names and kept in their
logs. Ctrl-C or SIGTERM stops the learners (they flush and leave),
then the synchronizer (its final checkpoint). A finished run ends with ``model.safetensors``
(:func:`~ddiloco.runtime.sync.model_export.export_run`). A copy that ends before it ever joined the run
is a broken script or command line, which restarting cannot mend: the launch stops, in one
line, exit 2. The exit code is 0 when the run finished and every copy exited 0, 130 when
stopped by a signal, 1 otherwise. No torch here: the children import it.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from pathlib import Path

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.launch.command_lines import SyncLine

DEFAULT_OUT = "runs/launch"


HELP = "start a synchronizer and M copies of your training script (LearnerRuntime.from_env), supervised"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "launch",
        help=HELP,
        description="Start `ddiloco sync` and M copies of COMMAND, each told the synchronizer's address, its "
        "learner id, data shard and the run's token through $DDILOCO_CONNECT, $DDILOCO_LEARNER_ID, "
        "$DDILOCO_DATA_SHARD/$DDILOCO_DATA_SHARDS and $DDILOCO_TOKEN (LearnerRuntime.from_env(model) reads "
        "them). A copy that crashes is restarted; Ctrl-C stops the run cleanly. "
        "Example: ddiloco launch --learners 2 --init init.safetensors --tokens 2000000 -- python train.py",
    )
    parser.add_argument("--learners", type=int, required=True, metavar="M", help="copies of COMMAND to run")
    parser.add_argument("--init", metavar="FILE", help="serve your own model: initial weights from "
                        "save_initial_state() (else the reference workload of --preset)")
    parser.add_argument("--preset", help="size preset of the run's protocol and reference model (ddiloco sync's)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with the run's configuration (ddiloco sync's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, metavar="N", help="stop the run after N tokens over all learners")
    budget.add_argument("--time", type=float, metavar="SECONDS", help="stop the run after this many wall seconds")
    parser.add_argument("--http-port", type=int, metavar="PORT", help="serve the synchronizer's status page here")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"logs (DIR/logs/*.log) and the synchronizer's state (DIR/sync-state) "
                        f"(default {DEFAULT_OUT})")
    parser.add_argument("--resume", action="store_true", help="continue the run in DIR/sync-state")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="start a crashed copy again up to N times (default 3)")
    parser.add_argument("--token-file", metavar="FILE", help="the run's shared token (else $DDILOCO_TOKEN, if set)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="your training script, e.g. -- python train.py ARGS")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.learners < 1:
        raise ConfigError(f"--learners must be at least 1, got {args.learners}")
    if not command:
        raise ConfigError("no command after --: ddiloco launch --learners M -- python train.py ARGS")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"{command[0]!r}: no such command (the first word after --)")
    if args.init and not Path(args.init).is_file():
        raise ConfigError(f"--init {args.init!r}: no such file")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    token = None
    if args.token_file:
        from ddiloco.runtime.auth import load_token

        token = load_token(args.token_file)
    from ddiloco.runtime.launch.supervise import STATE_DIR, STOPPED, Launch

    out = Path(args.out)
    _check_resume(out, out / STATE_DIR, args.resume)
    if args.resume:
        _say_changes(out / STATE_DIR, args.learners, args.tokens, args.time)
    if args.http_port == 0:  # a free one now, so that the launcher can say where
        from ddiloco.runtime.launch.local_run import free_port

        args.http_port = free_port()
    with Launch(out, command, args.learners, _sync_line(args, out / STATE_DIR), token=token,
                max_restarts=args.max_restarts) as launch:
        code = launch.run()
    export = (f"ddiloco export {shlex.quote(str(out / STATE_DIR))} OUT.safetensors"
              + (f" --init {shlex.quote(args.init)}" if args.init else ""))
    if code == 0:
        from ddiloco.outputs.reporting import MODEL_FILE
        from ddiloco.runtime.sync.model_export import export_run

        export_run([out / STATE_DIR], out / MODEL_FILE, Path(args.init) if args.init else None)
        print(f"the run finished; wrote its global model to {out / MODEL_FILE} (load it with "
              f"model.load_state_dict(safetensors.torch.load_file(...)); or: {export})")
    elif code == STOPPED:
        print(f"the run stopped; its state is in {out / STATE_DIR}: continue it with the same command plus "
              f"--resume (ddiloco launch --resume --out {shlex.quote(str(out))} ...); its model so far: {export}")
    return code


def _check_resume(out: Path, state_dir: Path, resume: bool) -> None:
    """Refuse, in ``ddiloco launch``'s own terms, a new run where one is already kept, or ``--resume``
    where there is none (``ddiloco sync`` would refuse both, naming its own ``--state-dir``)."""
    held = False
    if state_dir.exists():  # only then the state directory's code (torch)
        from ddiloco.runtime.sync.state_dir import has_checkpoint

        held = has_checkpoint(state_dir)
    if held and not resume:
        raise ConfigError(f"--out {str(out)!r} already holds a run ({state_dir}): pass --resume to continue it, "
                          "or choose another --out")
    if resume and not held:
        raise ConfigError(f"--resume: --out {str(out)!r} holds no run to continue (nothing in {state_dir}): "
                          "start without --resume for a new run")


def _say_changes(state_dir: Path, learners: int, tokens: int | None, time_s: float | None) -> None:
    """What ``--resume`` changes of the run it continues, on the launcher's output (the synchronizer
    says it in its own log, which a launch does not show): a new number of learners was accepted silently."""
    from ddiloco.runtime.launch.local_run import announce
    from ddiloco.runtime.sync.resume import changed_on_resume
    from ddiloco.runtime.sync.state_dir import load_latest

    saved = (load_latest(state_dir) or {}).get("service", {}).get("config", {})
    now = {"run": {"learners": learners, **({"tokens": tokens} if tokens is not None else {}),
                   **({"time_s": time_s} if time_s is not None else {})}}
    changed = changed_on_resume(saved, now)
    if changed:
        announce(f"launch: resuming the run in {state_dir} with {', '.join(changed)}")


def _sync_line(args: argparse.Namespace, state_dir: Path) -> SyncLine:
    """``ddiloco sync``'s command line, less where it listens and where it writes its port (the launcher's)."""
    return SyncLine(learners=args.learners, state_dir=state_dir, exit_when_finished=True, init=args.init,
                    preset=args.preset, config=args.config, sets=tuple(args.overrides), tokens=args.tokens,
                    time_s=args.time, http_port=args.http_port, resume=args.resume, token_file=args.token_file)
