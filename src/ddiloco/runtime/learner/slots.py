"""Fixed shared-memory slots between a learner's training process and its link's helper process.

The training process and the helper (``helper.py``) share one memory region, made once when
the learner starts: per fragment an *out* slot (the Δ the trainer took, for the helper to
upload) and an *in* slot (an update's payload the helper received, for the trainer to apply).
Each is sized for the largest thing it ever holds, so nothing is allocated per step, and the
bytes never cross a pipe: the control messages only say "slot p holds generation g".

A slot is guarded like a seqlock. Its header holds a sequence number, odd while the writer
writes and even once it is done, and the payload's length. The writer makes it odd, writes,
makes it even, and only then announces the (even) number. The reader copies the payload and
checks that the number before and after the copy is the one announced: if the writer began
another write meanwhile (the number moved on), the copy may be torn and is thrown away, never
sent. In-slots are also handed over: the header holds a third word, the number the trainer last
released (it writes the slot's number there once it is done with it, no message), and the
helper writes slot p again only once that word is the slot's number, so a torn update is
impossible by construction. Before a new helper starts (after a crash), the trainer releases
every in slot it does not hold: one the dead helper wrote but never announced is free again.

The region is an anonymous shared file (``memfd_create`` on Linux, an unlinked file
elsewhere) passed to the helper as an open descriptor: it has no name, so nothing is left in
``/dev/shm`` whichever process is killed. On CUDA the trainer registers it as pinned host
memory (``cudaHostRegister``, ``staging.py``), so Δ's payload is copied from the device straight
into its out slot, and updates from their in slot to the device, asynchronously.
"""

from __future__ import annotations

import enum
import mmap
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from ddiloco.core.shared.errors import DdilocoError

HEADER_BYTES = 64
"""Sequence number, length and released number, on a cache line of their own."""
ALIGN = 64


class Slot(enum.IntEnum):
    OUT = 0
    """Δ (or its payload) from the trainer, for the helper to upload."""
    IN = 1
    """An update (payload or decoded values) from the helper, for the trainer to apply."""


class SlotError(DdilocoError):
    """No shared memory for the slots: the learner cannot run its link."""


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Every fragment's slot sizes in bytes (payload only, without the header)."""

    out_bytes: tuple[int, ...]
    in_bytes: tuple[int, ...]

    def offsets(self) -> list[tuple[int, int]]:
        """Per fragment, the offsets of its out and in slots' headers."""
        at, result = 0, []
        for out_size, in_size in zip(self.out_bytes, self.in_bytes):
            out_at = at
            at += HEADER_BYTES + _aligned(out_size)
            result.append((out_at, at))
            at += HEADER_BYTES + _aligned(in_size)
        return result

    @property
    def total(self) -> int:
        return sum(2 * HEADER_BYTES + _aligned(o) + _aligned(i) for o, i in zip(self.out_bytes, self.in_bytes))

    @property
    def mapped_bytes(self) -> int:
        """The region's size: whole pages (what ``cudaHostRegister`` pins)."""
        return -(-max(self.total, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def shared_file(size: int, name: str = "ddiloco-slots") -> int:
    """An open descriptor of a new anonymous shared file of ``size`` bytes (``SlotError`` if none)."""
    try:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        else:
            where = "/dev/shm" if os.path.isdir("/dev/shm") else None
            with tempfile.TemporaryFile(dir=where) as f:
                fd = os.dup(f.fileno())
        os.ftruncate(fd, max(size, 1))
    except OSError as err:
        raise SlotError(f"no shared memory for the learner's link ({size:,} bytes of slots): {err}") from None
    return fd


class SlotArea:
    """The slots of one learner, mapped from the shared file ``fd`` (made here when None)."""

    def __init__(self, layout: SlotLayout, fd: int | None = None) -> None:
        self.layout = layout
        self.fd = shared_file(layout.mapped_bytes) if fd is None else fd
        try:
            self._map = mmap.mmap(self.fd, layout.mapped_bytes)
        except (OSError, ValueError) as err:
            raise SlotError(f"cannot map the learner's link slots ({layout.total:,} bytes): {err}") from None
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._slots = []
        for p, (out_at, in_at) in enumerate(layout.offsets()):
            pair = []
            for at, size in ((out_at, layout.out_bytes[p]), (in_at, layout.in_bytes[p])):
                header = self.bytes[at:at + 24].view(np.uint64)
                pair.append((header, self.bytes[at + HEADER_BYTES:at + HEADER_BYTES + size]))
            self._slots.append(pair)

    def payload(self, kind: Slot, p: int) -> np.ndarray:
        """The whole slot as uint8 (write into it between ``begin`` and ``end``)."""
        return self._slots[p][kind][1]

    def begin(self, kind: Slot, p: int) -> np.ndarray:
        """Start writing slot p: its number turns odd (a reader's copy from now on is torn)."""
        header, payload = self._slots[p][kind]
        seq = int(header[0])
        header[0] = seq + 1 if seq % 2 == 0 else seq + 2  # still odd: a writer that died mid-write
        return payload

    def end(self, kind: Slot, p: int, nbytes: int) -> int:
        """Finish writing ``nbytes`` into slot p; returns its new even number, to announce."""
        header = self._slots[p][kind][0]
        header[1] = nbytes
        seq = int(header[0]) + 1
        header[0] = seq
        return seq

    def write(self, kind: Slot, p: int, data: np.ndarray) -> int:
        """Copy the bytes ``data`` into slot p (one memcpy); returns the number to announce."""
        payload = self.begin(kind, p)
        payload[: data.nbytes] = data.reshape(-1).view(np.uint8)
        return self.end(kind, p, data.nbytes)

    def read(self, kind: Slot, p: int, seq: int) -> bytes | None:
        """A copy of slot p as written at number ``seq``; None if it was written again since (or
        is being written): the copy could be torn."""
        header, payload = self._slots[p][kind]
        if seq % 2 or int(header[0]) != seq:  # odd: announced mid-write, which a writer never does
            return None
        data = payload[: int(header[1])].tobytes()
        return data if int(header[0]) == seq else None

    def view(self, kind: Slot, p: int, seq: int) -> np.ndarray | None:
        """Slot p's payload without a copy (the reader owns the slot until it releases it); None
        if it does not hold number ``seq``."""
        header, payload = self._slots[p][kind]
        return payload[: int(header[1])] if int(header[0]) == seq else None

    def release(self, kind: Slot, p: int) -> None:
        """The reader is done with slot p as it holds it now (the writer may write it again)."""
        header = self._slots[p][kind][0]
        header[2] = header[0]

    def give_back(self, kind: Slot, p: int) -> None:
        """Free the memory behind slot p's whole pages (they read as zeros until written again): a
        slot that holds something only now and then counts in no process's resident set between.
        Only while its writer cannot write it (before :meth:`release`)."""
        payload = self._slots[p][kind][1]
        at, size = payload.ctypes.data - self.address(), payload.nbytes
        start, end = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE, (at + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_REMOVE"):
            self._map.madvise(mmap.MADV_REMOVE, start, end - start)

    def release_all(self, kind: Slot, held: set[int]) -> None:
        """Release every slot but those the reader still holds: before a new writer starts, what a
        writer that died left in the others (a write it never announced) is free to overwrite."""
        for p in range(len(self._slots)):
            if p not in held:
                self.release(kind, p)

    def free(self, kind: Slot, p: int) -> bool:
        """May the writer write slot p? Once its reader released what it holds (or nothing was ever
        announced there: a number still odd is a write its writer did not finish, never announced)."""
        header = self._slots[p][kind][0]
        seq = int(header[0])
        return seq % 2 == 1 or int(header[2]) == seq

    def address(self) -> int:
        return int(self.bytes.ctypes.data)
