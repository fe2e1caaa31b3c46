"""``ddiloco sync``: the synchronizer service of a real (multi-process, multi-host) run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import signal
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.core.shared.errors import ConfigError

if TYPE_CHECKING:
    import grpc

    from ddiloco.runtime.auth import Address
    from ddiloco.runtime.status.page_process import StatusPageProcess
    from ddiloco.runtime.sync.service import ServiceOptions, SyncService
    from ddiloco.settings.config import Config

HELP = "serve the synchronizer (gRPC) that learner processes connect to"
DEFAULT_LISTEN = "127.0.0.1:7000"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.commands.options import add_log_level_option, add_workload_options  # the presets: torch
    from ddiloco.runtime.sync.resume import Resume

    parser = sub.add_parser(
        "sync",
        help=HELP,
        description="Run the Decoupled DiLoCo synchronizer as a gRPC service: learners started with "
        "`ddiloco learner --connect HOST:PORT` stream their fragments to it. Give it the same workload "
        "options as the learners (--preset, --config, --set, --seed) and the number of learners.",
    )
    add_workload_options(parser)
    parser.add_argument("--learners", type=int, metavar="M", help="number of learners M (quorum, data shards)")
    parser.add_argument("--mode", choices=("decoupled", "diloco"), help="decoupled (default) or diloco (synchronous)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, metavar="N", help="stop the run after N tokens over all learners")
    budget.add_argument("--time", type=float, metavar="SECONDS", help="stop the run after this many wall seconds")
    parser.add_argument("--shard", metavar="I/N",
                        help="serve shard I of N: the fragments p with p mod N = I (run N of these; learners "
                        "--connect to all of them)")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to serve on (default {DEFAULT_LISTEN}; port 0 picks a free one)")
    parser.add_argument("--state-dir", metavar="DIR", help="write checkpoints here (atomically)")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_const", const=Resume.REQUIRED,
                        default=Resume.NEW_RUN,
                        help="continue the run in --state-dir (its checkpoint and round log); none there is an error")
    resume.add_argument("--resume-if-present", dest="resume", action="store_const", const=Resume.IF_PRESENT,
                        help="continue the run in --state-dir if it holds one, else start a new one (for a deploy "
                        "script's single command line: the first start and every restart)")
    parser.add_argument("--checkpoint-every-rounds", type=int, default=20, metavar="N",
                        help="checkpoint after N merged rounds (default 20) ...")
    parser.add_argument("--checkpoint-every", type=float, default=30.0, metavar="SECONDS",
                        help="... or after this many seconds with merges, whichever first (default 30)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="shared auth token (else $DDILOCO_TOKEN); beyond loopback it or --credentials is required")
    parser.add_argument("--credentials", metavar="FILE",
                        help="per-learner credentials, one 'learner-id: secret' line each: every learner speaks only "
                        "for itself (with --token-file too, the token admits operators: status, state fetches)")
    parser.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate chain (PEM)")
    parser.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)")
    parser.add_argument("--init", metavar="FILE",
                        help="serve your own model: initial weights from runtime.save_initial_state()")
    parser.add_argument("--port-file", metavar="FILE", help="write the port actually bound to FILE")
    parser.add_argument("--metrics-port", type=int, metavar="PORT", help="expose Prometheus metrics on this port")
    parser.add_argument("--http-port", type=int, metavar="PORT",
                        help="serve a live status page on http://HOST:PORT/ (JSON at /api/status; 0 picks a free "
                        "port); beyond loopback it needs the token")
    parser.add_argument("--exit-when-finished", action="store_true",
                        help="exit once the budget is spent and the last contributions are merged")
    add_log_level_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddiloco.commands.options import config_from_args
    from ddiloco.runtime.sync.resume import Resume

    with contextlib.suppress(AttributeError, ValueError, OSError):  # stderr may not be a file
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.resume is not Resume.NEW_RUN and not args.state_dir:
        flag = "--resume" if args.resume is Resume.REQUIRED else "--resume-if-present"
        raise ConfigError(f"{flag} needs --state-dir: without one there is no run's state to continue")
    config = config_from_args(args)
    shard = 0
    if args.shard is not None:
        shard, shards = parse_shard(args.shard)
        if config.protocol.shards not in (1, shards):
            raise ConfigError(f"--shard {args.shard} conflicts with protocol.shards={config.protocol.shards}")
        config = replace(config, protocol=replace(config.protocol, shards=shards)).validate()
    # The configuration is checked: only now the service's code (gRPC, torch), so a bad value costs neither.
    from ddiloco.runtime.auth import (
        Address,
        load_credentials,
        load_token,
        parse_address,
        require_token_beyond_loopback,
        server_credentials,
    )
    from ddiloco.runtime.status.page_process import StatusPageProcess
    from ddiloco.runtime.sync.server import check_can_listen
    from ddiloco.runtime.sync.service import ServiceOptions

    listen = parse_address(args.listen, option="--listen", allow_port_zero=True)
    token = load_token(args.token_file)
    secrets = load_credentials(args.credentials)
    require_token_beyond_loopback(listen, token, secrets)
    credentials = server_credentials(args.tls_cert, args.tls_key)
    check_can_listen(listen)  # before the state directory and the status page exist: a failed start leaves nothing
    if args.metrics_port is not None:
        check_can_listen(Address(listen.host, args.metrics_port), option="--metrics-port")
    options = ServiceOptions(
        state_dir=Path(args.state_dir) if args.state_dir else None,
        resume=args.resume,
        token=token,
        credentials=secrets,
        checkpoint_every_rounds=max(1, args.checkpoint_every_rounds),
        checkpoint_every_s=args.checkpoint_every,
        shard=shard,
    )
    page = None
    if args.http_port is not None:  # bound now: a port in use fails before the model is read
        page = StatusPageProcess(Address(listen.host if listen.is_loopback else "0.0.0.0", args.http_port), token)
    try:
        return _serve(args, config, listen, credentials, options, page)
    finally:
        if page is not None:
            page.close()


def _serve(args: argparse.Namespace, config: Config, listen: Address, credentials: grpc.ServerCredentials | None,
           options: ServiceOptions, page: StatusPageProcess | None) -> int:
    from ddiloco.runtime.auth import Address
    from ddiloco.runtime.layout import layout_from_file
    from ddiloco.runtime.sync.memory import fewer_malloc_arenas, give_back_freed_memory
    from ddiloco.runtime.sync.server import serve
    from ddiloco.runtime.sync.service import SyncService

    fewer_malloc_arenas()  # before the model is read and the gRPC threads start
    give_back_freed_memory(every_s=1.0)
    layout = None
    if args.init:
        layout = layout_from_file(args.init, config.protocol.for_mode(config.run.mode, config.run.learners))
    service = SyncService(config, options, layout=layout)
    # What exists now (modules, compiled kernels, the model's layout) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks its ~270k objects (0.1 s
    # with the GIL held, during which no RPC is answered).
    gc.freeze()
    metrics_server = None
    if args.metrics_port is not None:  # on the service's own interface, behind its token beyond loopback
        metrics_server = service.metrics.serve(Address(listen.host, args.metrics_port), options.token)

    async def main() -> None:
        feed = None
        if page is not None:
            feed = asyncio.ensure_future(page.publish(lambda: _status_dict(service)))
        try:
            await serve(service, listen, credentials=credentials,
                        port_file=Path(args.port_file) if args.port_file else None,
                        exit_when_finished=args.exit_when_finished)
        finally:
            if feed is not None:  # awaited: a failure of the feed is raised here, not logged at exit
                feed.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feed

    try:
        asyncio.run(main())
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


async def _status_dict(service: SyncService) -> dict[str, Any] | None:
    """What the status page shows: the Status call's answer; None until the service serves."""
    from ddiloco.runtime.status.wire_form import status_to_dict

    return None if service.host is None else status_to_dict(await service.status_reply())


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` into (I, N), with 0 <= I < N."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise ConfigError(f"--shard {text!r}: expected I/N, e.g. 0/2") from None
    if not sep or n < 1 or not 0 <= i < n:
        raise ConfigError(f"--shard {text!r}: expected I/N with N >= 1 and 0 <= I < N")
    return i, n
