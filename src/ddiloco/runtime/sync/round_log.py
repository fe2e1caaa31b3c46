"""The round log: every merged round's update, durable before any learner receives it.

A checkpoint alone loses the rounds merged since it was written, and with them the progress
of every learner that already holds them. The log closes that gap: the core says when a
round merged (:class:`~ddiloco.core.shared.actions.LogRound`), the update is appended here, and the
update stream sends it only once it is on disk (``core_host``). A restart with ``--resume``
loads the latest checkpoint and replays what follows it
(:meth:`~ddiloco.core.sync_side.synchronizer.Synchronizer.replay_round`), so every fragment comes back
at the newest version any learner received, with the same value bit for bit.

Why the update and not the whole state: the update is what the downlink sends (0.53 bytes
per parameter of a fragment per round with int4), so the log costs the disk what the network
already carries; Θ is the sum of the updates, and the outer momentum is recovered from them
within a tested tolerance (``GlobalFragment.replay``).

Files: ``rounds-NNNNNNNN.log`` segments in the state directory, each beginning with a header
naming the model's layout and the shard (a segment of another run is refused), then records
``length, crc32, fragment, version, plain, payload, reached``: ``reached`` names, per merged
contribution, its learner and the last step it covered, so that a restart moves the learners' data
positions as the merges did (issue 56: from the checkpoint alone, a learner resumed up to every
round since it behind and trained that data again). Segments of the first format (no ``reached``)
are still read: their rounds leave the positions where the checkpoint has them. One thread writes them and fsyncs once
for every record queued meanwhile (group commit). A checkpoint starts a new segment before it
copies its first fragment and, once it is the latest, deletes the segments before that one.
A record cut short or damaged (a crash mid-write, a bad disk) ends its segment: it is
reported in one line and the run resumes from what is intact (the restarted process writes
a new segment). Such a record was never durable, so its update never left. A damaged record with
others after it is not a crash mid-write but a damaged file: refused, in one line.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import queue
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ddiloco.workload.checkpoint import CheckpointError, fsync_dir, sync_and_uncache

log = logging.getLogger("ddiloco.sync")

MAGIC = b"ddiloco-round-log-2\n"
FIRST_MAGIC = b"ddiloco-round-log-1\n"
"""Segments written before records named what they reached: read, never written."""
_HEADER = struct.Struct("<I")
_RECORD = struct.Struct("<IIIQB")
"""Length of the payload, CRC-32 of what follows it, fragment, version, plain."""
_REACHED = struct.Struct("<I")
"""Length of the ``reached`` block after the payload (JSON: ``[[learner_id, step], ...]``)."""
_SEGMENT = re.compile(r"rounds-(\d{8})\.log$")


class _Control(enum.Enum):
    """What the log's thread is asked besides appending a round."""

    BARRIER = "barrier"
    """Resolve once everything before is durable."""
    ROTATE = "rotate"
    """Start a new segment."""
    CLOSE = "close"


@dataclass(frozen=True, slots=True)
class LoggedRound:
    fragment: int
    version: int
    plain: bool
    payload: bytes
    reached: tuple[tuple[str, int], ...] = ()


def segments(path: Path) -> list[tuple[int, Path]]:
    """The log's segments in ``path``, oldest first."""
    found = [(int(m.group(1)), p) for p in path.iterdir() if (m := _SEGMENT.match(p.name))]
    return sorted(found)


def holds_rounds(path: Path) -> bool:
    """Whether a segment in ``path`` holds a record: a header alone is a start that never merged
    (before issue 45 a synchronizer that could not listen left one behind), not a run's state."""
    for _, file in segments(path) if path.is_dir() else ():
        with file.open("rb") as f:
            f.seek(len(MAGIC))
            raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size or file.stat().st_size > len(MAGIC) + _HEADER.size + _HEADER.unpack(raw)[0]:
            return True  # a damaged header counts as state: its restore says what is wrong with it
    return False


def read_rounds(path: Path, identity: dict[str, object], first: int = 0) -> Iterator[LoggedRound]:
    """The records of every segment numbered ``first`` or later, in order; a record cut short
    or damaged ends its segment (said in one line: a crash while it was written, so the next
    segment, written after the restart, follows what precedes it). :class:`CheckpointError`
    if a segment belongs to another run."""
    for number, file in segments(path):
        if number < first:
            continue
        with file.open("rb") as f:
            with_reached = _check_header(f, file, identity)
            while True:
                at = f.tell()
                head = f.read(_RECORD.size)
                if not head:
                    break
                record = _record(f, head, with_reached)
                if record is None:  # the end of what that incarnation made durable; later segments go on
                    if f.read(1):
                        raise CheckpointError(f"{file}: the record at byte {at} is damaged and records follow it "
                                              "(not a crash mid-write: a damaged disk or file); the rounds after it "
                                              "cannot be restored")
                    log.warning("round log %s: the record at byte %d is cut short or damaged (a crash while it "
                                "was written); replaying what precedes it", file, at)
                    break
                yield record


def _check_header(f: BinaryIO, file: Path, identity: dict[str, object]) -> bool:
    """Read a segment's header: True if its records name what they reached (the current format)."""
    magic = f.read(len(MAGIC))
    raw = f.read(_HEADER.size)
    if magic not in (MAGIC, FIRST_MAGIC) or len(raw) != _HEADER.size:
        raise CheckpointError(f"{file} is not a ddiloco round log")
    try:
        header = json.loads(f.read(_HEADER.unpack(raw)[0]))
    except ValueError:
        raise CheckpointError(f"{file} has a damaged header") from None
    if header != identity:
        raise CheckpointError(f"{file} belongs to another run ({header}, this synchronizer is {identity}): "
                              "start with the same --preset/--config/--set/--init and --shard, or another --state-dir")
    return magic == MAGIC


def _record(f: BinaryIO, head: bytes, with_reached: bool) -> LoggedRound | None:
    if len(head) != _RECORD.size:
        return None
    length, crc, fragment, version, plain = _RECORD.unpack(head)
    payload = f.read(length)
    if len(payload) != length:
        return None
    block = b""
    if with_reached:
        raw = f.read(_REACHED.size)
        block = raw + f.read(_REACHED.unpack(raw)[0]) if len(raw) == _REACHED.size else raw
    if zlib.crc32(block, zlib.crc32(payload, zlib.crc32(head[8:]))) != crc:
        return None
    reached = tuple((str(name), int(step)) for name, step in json.loads(block[_REACHED.size:])) if block else ()
    return LoggedRound(fragment, version, bool(plain), payload, reached)


class RoundLog:
    """Appends rounds on its own thread, one fsync per batch; ``append`` returns a future that
    is done when the record is durable (or failed: the error is logged, and the caller sends
    anyway, without the guarantee)."""

    def __init__(self, path: Path, identity: dict[str, object]) -> None:
        self.path = path
        self.identity = identity
        self.failures = 0
        self._queue: queue.Queue[tuple[LoggedRound | _Control, Future]] = queue.Queue()
        self._file: BinaryIO | None = None
        self.segment = max((n for n, _ in segments(path)), default=-1) + 1
        self._open(self.segment)
        self._thread = threading.Thread(target=self._run, name="ddiloco-round-log", daemon=True)
        self._thread.start()

    def append(self, fragment: int, version: int, plain: bool, payload: bytes,
               reached: tuple[tuple[str, int], ...] = ()) -> Future:
        return self._put(LoggedRound(fragment, version, plain, payload, reached))

    def barrier(self) -> Future:
        """A future done once everything appended so far is durable."""
        return self._put(_Control.BARRIER)

    def rotate(self) -> Future:
        """Start a new segment after everything appended so far; the future gives its number."""
        return self._put(_Control.ROTATE)

    def drop_before(self, number: int) -> None:
        """Delete the segments older than ``number`` (a checkpoint holds what they held)."""
        for n, file in segments(self.path):
            if n < number:
                file.unlink(missing_ok=True)

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued and close the file; False if that did not end within ``timeout_s``."""
        try:
            self._put(_Control.CLOSE).result(timeout_s)
        except TimeoutError:
            return False
        self._thread.join()
        return True

    def _put(self, item: LoggedRound | _Control) -> Future:
        done: Future = Future()
        self._queue.put((item, done))
        return done

    def _open(self, number: int) -> None:
        header = json.dumps(self.identity, sort_keys=True).encode()
        file = self.path / f"rounds-{number:08d}.log"
        with file.open("xb") as f:
            f.write(MAGIC + _HEADER.pack(len(header)) + header)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.path)
        if self._file is not None:
            self._file.close()
        self._file = file.open("ab")
        self.segment = number

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            waiting: list[Future] = []
            for item, done in batch:
                if item is _Control.CLOSE:
                    self._sync(waiting)
                    self._file.close()
                    _settle(done, None)
                    return
                if item is _Control.BARRIER:
                    waiting.append(done)
                    continue
                if item is _Control.ROTATE:
                    self._sync(waiting)
                    self._guard(lambda: self._open(self.segment + 1), [done], self.segment + 1)
                    continue
                self._guard(lambda r=item: self._write(r), [], None)
                waiting.append(done)
            self._sync(waiting)

    def _write(self, r: LoggedRound) -> None:
        assert self._file is not None
        body = _RECORD.pack(len(r.payload), 0, r.fragment, r.version, int(r.plain))[8:]
        reached = json.dumps([list(x) for x in r.reached], separators=(",", ":")).encode()
        block = _REACHED.pack(len(reached)) + reached
        crc = zlib.crc32(block, zlib.crc32(r.payload, zlib.crc32(body)))
        self._file.write(_RECORD.pack(len(r.payload), crc, r.fragment, r.version, int(r.plain)))
        self._file.write(r.payload)
        self._file.write(block)

    def _sync(self, waiting: list[Future]) -> None:
        if waiting:
            self._guard(self._flush, waiting, None)
            waiting.clear()

    def _flush(self) -> None:
        assert self._file is not None
        sync_and_uncache(self._file)  # read back only after a crash

    def _guard(self, work, futures: list[Future], result: object) -> None:
        try:
            work()
        except OSError as err:
            self.failures += 1
            if self.failures == 1:
                log.error("round log %s: %s; merged rounds are sent without being logged, and a crash now "
                          "loses those merged since the last checkpoint", self.path, err)
            for f in futures:
                _settle(f, None)
            return
        for f in futures:
            _settle(f, result)


def _settle(done: Future, result: object) -> None:
    """Resolve a waiter's future unless it gave up on it: a join whose caller went away cancels the
    barrier it awaited (``asyncio.wrap_future``), and ``set_result`` on a cancelled future raises.
    Raised on the log's thread, that ended the thread, and with it every later barrier, update and
    checkpoint: a flood of abandoned joins stopped the run for good (issue 53)."""
    with contextlib.suppress(InvalidStateError):
        done.set_result(result)
