"""Serving a :class:`~ddiloco.runtime.sync.service.SyncService` over gRPC: bind, run, shut down."""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import signal
import socket
from pathlib import Path

import grpc

from ddiloco.core.shared.deadlines import STOP_CALLS_S, stop_deadline_s
from ddiloco.core.shared.errors import ConfigError, DdilocoError
from ddiloco.core.shared.kernels import compile_kernels
from ddiloco.runtime.auth import Address
from ddiloco.runtime.sync.service import SERVICE_NAME, SyncService
from ddiloco.runtime.sync.shutdown import StopDeadline
from ddiloco.runtime.wire import KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES

log = logging.getLogger("ddiloco.sync")

SERVER_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def check_can_listen(listen: Address, option: str = "--listen") -> None:
    """Bind ``listen`` once and let it go, before the state directory or anything else is created:
    a port in use is then one line, and leaves nothing behind. gRPC, asked to bind it, logged its
    own error line (``add_port.cc``) and the state directory kept a lock file and an empty round
    log, which the retry took for a run's state."""
    if listen.port == 0:
        return
    try:
        infos = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ConfigError(f"cannot listen on {listen}: {err.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise ConfigError(f"cannot listen on {listen}: {err.strerror} (another synchronizer, or another "
                                      f"program, holds the port: choose another {option} port)") from None
                if err.errno == errno.EACCES:
                    raise ConfigError(f"cannot listen on {listen}: {err.strerror} ({option}: a port below 1024 "
                                      "needs root)") from None
                # Anything else (an address family this host lacks, of several a name resolves to) is gRPC's to judge.


class SyncServer:
    """A started gRPC server around one service (``start`` binds, ``stop`` checkpoints and closes)."""

    def __init__(self, service: SyncService) -> None:
        self.service = service
        self._server: grpc.aio.Server | None = None
        self.closing = asyncio.Event()

    async def start(self, listen: Address, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind and start serving; returns the port (useful with port 0)."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers([handlers(self.service)])
        target = str(listen)
        try:
            port = server.add_insecure_port(target) if credentials is None else server.add_secure_port(target, credentials)
        except RuntimeError as err:
            raise ConfigError(f"cannot listen on {target}: {err}") from None
        if port == 0:
            raise ConfigError(f"cannot listen on {target} (address in use?)")
        compile_kernels()  # before the first contribution, not during it
        self.service.start_host()
        await server.start()
        self._server = server
        self.service.port = port
        s = self.service
        log.info("synchronizer %s listening on %s:%d (%s, M=%d, %d fragments, incarnation %x)",
                 "resumed" if s.writer.checkpoints or s.writer.replayed else "started", listen.host, port, s.config.run.mode,
                 s.config.run.learners, len(s.layout.plan.fragments), s.incarnation)
        return port

    async def stop(self) -> None:
        """No more calls, then the service's final checkpoint (so it holds every merge), within the
        stop's bound (``deadlines.stop_deadline_s``)."""
        deadline = StopDeadline(stop_deadline_s(self.service.core.state_bytes))
        self.service.streams.close_all()
        if self._server is not None:
            await deadline.wait(self._server.stop(grace=STOP_CALLS_S), "the calls in flight to end")
        await self.service.stop(deadline)


def handlers(s: SyncService) -> grpc.GenericRpcHandler:
    """The service's RPCs by name (requests arrive as raw bytes: the service parses them)."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Join": grpc.unary_stream_rpc_method_handler(s.join),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(s.heartbeat),
        "Contribute": grpc.stream_unary_rpc_method_handler(s.contribute),
        "Updates": grpc.unary_stream_rpc_method_handler(s.updates),
        "FetchState": grpc.unary_stream_rpc_method_handler(s.fetch_state),
        "Leave": grpc.unary_unary_rpc_method_handler(s.leave),
        "Status": grpc.unary_unary_rpc_method_handler(s.status),
    })


async def serve(service: SyncService, listen: Address, *, credentials: grpc.ServerCredentials | None = None,
                port_file: Path | None = None, exit_when_finished: bool = False) -> None:
    """Run ``service`` until SIGINT/SIGTERM (or the end of the run with ``exit_when_finished``)."""
    server = SyncServer(service)
    port = await server.start(listen, credentials)
    loop = asyncio.get_running_loop()
    stopped_by: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        stopped_by.append(sig.name)
        server.closing.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, port_file)
    try:
        assert service.host is not None
        waits = [asyncio.ensure_future(server.closing.wait()), asyncio.ensure_future(service.host.crashed.wait())]
        if exit_when_finished:
            waits.append(asyncio.ensure_future(service.host.finished.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    finally:
        why = f" on {stopped_by[0]}" if stopped_by else ""
        saving = service.writer.state_dir
        log.info("shutting down%s%s", why, f": writing the final checkpoint to {saving.path}" if saving else "")
        await server.stop()
        _say_saved(service, stopped_by[0] if stopped_by else None)
    if service.stop_missed:
        raise DdilocoError(f"the stop gave up waiting for {', '.join(service.stop_missed)}; the round log holds "
                           "every round merged since the last checkpoint that was written: restart with --resume")
    if service.host.failure is not None:
        raise DdilocoError(f"the synchronizer's core failed ({service.host.failure!r}); the log has the traceback; "
                           "restart with --resume from the last checkpoint")


def _say_saved(service: SyncService, signal_name: str | None) -> None:
    """The last line of a clean stop: what was saved, and how to go on."""
    saving = service.writer.state_dir
    versions = list(service.view.versions)
    if service.stop_missed or (service.host is not None and service.host.failure is not None):
        return  # the failure is raised, with its own advice
    if saving is None:
        log.info("stopped at fragment versions %s; nothing saved (no --state-dir)", versions)
    elif signal_name is not None and not service.view.finished:
        log.info("stopped by %s: final checkpoint written to %s at fragment versions %s; resume the run with the "
                 "same options plus --resume (ddiloco sync --state-dir %s --resume ...); learners reconnect by "
                 "themselves", signal_name, saving.path, versions, saving.path)
    else:
        log.info("final checkpoint written to %s at fragment versions %s", saving.path, versions)


def _dump_tasks() -> None:
    """``kill -USR2 PID``: log where every asyncio task of the service is waiting."""
    for task in asyncio.all_tasks():
        out = io.StringIO()
        try:
            task.print_stack(file=out)
        except TypeError:  # a task of grpc's compiled coroutines has no Python frames to print
            out.write(repr(task))
        log.warning("task %s:\n%s", task.get_name(), out.getvalue())


