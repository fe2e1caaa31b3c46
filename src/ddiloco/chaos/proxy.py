"""A fault-injecting TCP proxy: each learner's link to the synchronizer goes through one.

gRPC over HTTP/2 is only bytes on a TCP connection to the proxy, so it can delay them
(latency), meter them (a token-bucket bandwidth cap), cut the connections (RST) or hold
everything (a blackhole partition) without knowing the protocol. It holds bytes during a
partition rather than dropping them: that is what TCP does across a partition that heals
before a timeout, and dropping bytes mid-stream would corrupt the stream instead of
partitioning it. Every proxy of a run lives on one asyncio loop in one daemon thread of
the ``ddiloco chaos`` process, so none can outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 64
"""Bytes in flight per direction and connection are bounded (4 MiB): past it, the proxy stops reading."""
BURST_S = 0.05
"""A bandwidth cap lets through bursts of this many seconds of its rate ..."""
MIN_BURST_BYTES = 1500
"""... and at least one Ethernet frame's worth."""

T = TypeVar("T")


class TokenBucket:
    """A bandwidth cap for one direction of one link; rate 0 means uncapped."""

    def __init__(self) -> None:
        self.rate_bytes_per_s = 0.0
        self.burst_bytes = 0.0
        self._tokens = 0.0
        self._stamp = 0.0

    def set_rate(self, rate_bytes_per_s: float, now: float) -> None:
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = max(MIN_BURST_BYTES, rate_bytes_per_s * BURST_S)
        self._tokens, self._stamp = 0.0, now

    def piece_bytes(self) -> int:
        """The largest write that one wait for tokens may cover."""
        return int(self.burst_bytes) if self.rate_bytes_per_s else CHUNK_BYTES

    async def take(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        while self.rate_bytes_per_s:
            now = loop.time()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self.rate_bytes_per_s)
            self._stamp = now
            if self._tokens >= n:
                self._tokens -= n
                return
            await asyncio.sleep((n - self._tokens) / self.rate_bytes_per_s)


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close so that the peer sees a reset (SO_LINGER 0), not an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Listens on ``listen_host``:<port> and forwards every connection to ``upstream``; faults are set on the loop."""

    def __init__(self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.delay_s = 0.0
        self.buckets = {"up": TokenBucket(), "down": TokenBucket()}
        self._healed = asyncio.Event()
        self._healed.set()
        self._resetting_until = 0.0
        self._connections: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0
        self.bytes = {"up": 0, "down": 0}
        self.connections_accepted = 0
        self.connections_reset = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    # ---- faults (called on the loop) ---------------------------------------------------

    def set_latency(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def set_bandwidth(self, rate_bytes_per_s: float) -> None:
        now = asyncio.get_running_loop().time()
        for bucket in self.buckets.values():
            bucket.set_rate(rate_bytes_per_s, now)

    def reset(self, hold_s: float = 0.0) -> None:
        """Reset every open connection now, and every new one for ``hold_s`` seconds."""
        self._resetting_until = asyncio.get_running_loop().time() + hold_s
        for client, upstream in list(self._connections):
            self._reset(client, upstream)

    def set_partitioned(self, partitioned: bool) -> None:
        if partitioned:
            self._healed.clear()
        else:
            self._healed.set()

    # ---- forwarding ---------------------------------------------------------------------

    def _reset(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter | None) -> None:
        self.connections_reset += 1
        _abort_with_rst(client)
        if upstream is not None:
            _abort_with_rst(upstream)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        loop = asyncio.get_running_loop()
        if loop.time() < self._resetting_until:
            self._reset(writer, None)
            return
        await self._healed.wait()  # a partitioned link completes no handshake: the client's bytes wait
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # the synchronizer is down: the learner sees its connection refused
            self._reset(writer, None)
            return
        pair = (writer, up_writer)
        self._connections.add(pair)
        try:
            await asyncio.gather(self._spawn(self._pump(reader, up_writer, "up")),
                                 self._spawn(self._pump(up_reader, writer, "down")))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(pair)
            for w in pair:
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Read into a bounded queue; deliver each chunk after the delay, within the cap, when not partitioned."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        bucket = self.buckets[direction]

        async def read() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(CHUNK_BYTES):
                    await queue.put((loop.time(), data))
            await queue.put((loop.time(), b""))

        reading = self._spawn(read())
        try:
            while True:
                arrived, data = await queue.get()
                await self._healed.wait()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                wait_s = arrived + self.delay_s - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                step = bucket.piece_bytes()
                for offset in range(0, len(data), step):
                    piece = data[offset:offset + step]
                    await bucket.take(len(piece))
                    await self._healed.wait()
                    writer.write(piece)
                    await writer.drain()
                    self.bytes[direction] += len(piece)
        finally:
            reading.cancel()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pair in list(self._connections):
            for writer in pair:
                writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


class ProxyHost:
    """One event loop in a daemon thread holding every proxy of a run; the caller's thread never blocks on I/O."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: dict[str, FaultProxy] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-proxies", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0) -> T:
        """Run ``fn`` on the proxies' loop (awaiting it if it returns a coroutine) and return its result."""

        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def add(self, name: str, upstream_port: int, upstream_host: str = "127.0.0.1",
            listen_host: str = "127.0.0.1") -> int:
        """Start a proxy named ``name`` on ``listen_host`` in front of ``upstream``; returns the port to connect to."""

        async def start() -> int:
            proxy = FaultProxy(upstream_host, upstream_port, listen_host)
            self.proxies[name] = proxy
            return await proxy.start()

        return self.call(start)

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def close_all() -> None:
            for proxy in self.proxies.values():
                await proxy.close()

        with contextlib.suppress(Exception):  # closing must not hide the error that made us close
            self.call(close_all, timeout_s=5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
