"""Payload-sized byte buffers whose memory is touched off the GIL.

``bytearray(n)`` zero-fills all of its memory at once, and ``a.tobytes() + b.tobytes()``
copies twice, each by the thread that holds the GIL. At 1B parameters a fragment's int4
payload is 22 MB; while a checkpoint was being written beside it, one such fill or copy took
0.17–0.3 s on this 24 GB host, and the synchronizer's event loop answered nothing meanwhile
(status, uploads, update streams). Fresh anonymous memory is zero on demand instead: its
pages are faulted in by whoever first writes them — a compiled kernel that released the GIL,
or an upload's chunks one MiB at a time between two awaits.
"""

from __future__ import annotations

import mmap

MMAP_FROM_BYTES = 1 << 20
"""Smaller buffers come from the heap (a mapping per small update would be many mappings)."""


def fresh_buffer(size: int) -> memoryview:
    """``size`` writable zero bytes, in anonymous memory from ``MMAP_FROM_BYTES`` up."""
    return memoryview(mmap.mmap(-1, size) if size >= MMAP_FROM_BYTES else bytearray(size))
