"""How much memory a synchronizer holds for its model, said at start and checked against the host.

Users size a synchronizer host by this figure, so it is computed from the same holders the
code has (docs/runtime.md, "The synchronizer's memory", measures each):

- the state, always: Θ in fp32 (4 bytes a parameter), and with the fused int4 downlink the
  lean outer state — momentum bf16 (2), residual int8 (1) and a float32 scale per block;
  other downlink codecs keep momentum and residual in fp32 (4 + 4);
- while rounds are open: the int4 payloads of the contributions pending in them (about 0.53
  per learner) — at most every fragment's round at once — and one float32 buffer as large as
  the largest fragment, which each round's close sums into (``core/sync_side/accumulate.py``);
- the replay log's budget (``core/sync_side/replay.py``: an eighth of the fp32 state, at least 64 MiB);
- transients bounded by fragments, not by the model: each state transfer (join or fetch)
  holds a copy of one fragment, a checkpoint write one fragment's state and its file's bytes,
  a restore one fragment's file and tensors;
- the process itself (Python, torch, numba, gRPC): about ``PROCESS_BYTES``.

The synchronizer logs the figure at start and refuses to start, with one line, on a host
whose available memory is below its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ddiloco.core.shared.codecs import fused_int4
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.fragments import FragmentPlan
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.replay import replay_budget
from ddiloco.runtime.sync.call_limits import STATE_TRANSFERS
from ddiloco.settings.units import human_bytes, human_count

log = logging.getLogger("ddiloco.sync")

PROCESS_BYTES = 400 << 20
"""A synchronizer process with nothing to hold (measured: ~370 MB resident)."""
INT4_BYTES_PER_PARAM = 0.5
LEAN_STATE_BYTES_PER_PARAM = 4 + 2 + 1
FP32_STATE_BYTES_PER_PARAM = 4 + 4 + 4


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    params: int
    state: int
    """Θ and the outer state: held from start to end."""
    open_rounds: int
    """Pending payloads with every fragment's round open (an upper bound) and the close's buffer."""
    replay: int
    transients: int
    """Transfers, a checkpoint write and a restore at once, a fragment each."""

    @property
    def steady(self) -> int:
        return PROCESS_BYTES + self.state + self.open_rounds + self.replay

    @property
    def peak(self) -> int:
        return self.steady + self.transients

    def describe(self) -> str:
        return (f"{human_count(self.params)} parameters: state {human_bytes(self.state)}, open rounds up to "
                f"{human_bytes(self.open_rounds)}, replay {human_bytes(self.replay)} -> steady up to "
                f"{human_bytes(self.steady)}, peak up to {human_bytes(self.peak)}")


def memory_plan(numels: Sequence[int], *, learners: int, lean: bool, block_size: int, transfers: int) -> MemoryPlan:
    """The memory a synchronizer holding fragments of ``numels`` parameters needs."""
    params = sum(numels)
    largest = max(numels, default=0)
    per_param = LEAN_STATE_BYTES_PER_PARAM if lean else FP32_STATE_BYTES_PER_PARAM
    scales = 4 * sum(-(-n // block_size) for n in numels) if lean else 0
    fragment_state = per_param * largest
    return MemoryPlan(
        params=params,
        state=per_param * params + scales,
        open_rounds=int(learners * INT4_BYTES_PER_PARAM * params) + 4 * largest,
        replay=replay_budget(4 * params),
        # transfers × one fp32 fragment, a checkpoint's fragment copy and file bytes, a restore's file and tensors
        transients=transfers * 4 * largest + 4 * fragment_state,
    )


_M_ARENA_MAX = -8


def _glibc(name: str) -> Callable[..., int] | None:
    """glibc's function ``name`` (None off glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def fewer_malloc_arenas() -> None:
    """Keep glibc to two malloc arenas in the synchronizer process.

    By default every gRPC thread may get an arena of its own, and payload-sized blocks freed in
    one stay resident there while the next payload is allocated in another. Measured with 200M
    parameters (bench_sync_scale, 8 learners): two arenas lower the steady state by about 1 byte
    per parameter at the same merge rate. (A fixed mapping threshold, so that freed payloads
    always leave the process, saved 2 bytes per parameter but halved the merge rate: each
    payload's mapping and unmapping stalls every thread.) A no-op off glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 2)


def give_back_freed_memory(every_s: float) -> None:
    """Every ``every_s`` seconds, hand the pages of freed heap blocks back to the kernel (glibc's
    ``malloc_trim``), from a daemon thread.

    Payloads (int4, 0.53 bytes per parameter of a fragment) arrive, wait in a round and are
    freed at its close in another order than they came; the holes they leave stay resident
    until something of their size is allocated in them. Trimming releases them in place
    (``madvise``), without unmapping, so the next payload costs a page fault per 4 KiB it
    reuses rather than a mapping. Measured at 200M parameters (bench_sync_scale, 8 learners,
    once a second): steady 13.5 → 13.0–13.2 and peak 15.6 → 14.0 bytes per parameter, at no
    lower merge rate. A no-op off glibc."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return

    def loop() -> None:
        while True:
            time.sleep(every_s)
            trim(0)

    threading.Thread(target=loop, name="ddiloco-trim", daemon=True).start()


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable of this host (None where the kernel does not say)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shard_memory_plan(protocol: ProtocolConfig, plan: FragmentPlan, shard: int, learners: int) -> MemoryPlan:
    """The memory plan of one synchronizer shard: the fragments it owns."""
    downlink = protocol.downlink()
    return memory_plan([f.numel for f in plan.fragments if protocol.shard_of(f.index) == shard], learners=learners,
                       lean=fused_int4(downlink), block_size=protocol.block_size, transfers=STATE_TRANSFERS)


def check_memory(plan: MemoryPlan, available: int | None) -> None:
    """Log what the synchronizer will hold; :class:`ConfigError` if the host has less available."""
    log.info("synchronizer memory for %s", plan.describe())
    if available is not None and available < plan.peak:
        raise ConfigError(f"this synchronizer needs up to {human_bytes(plan.peak)} for "
                          f"{human_count(plan.params)} parameters and the host has {human_bytes(available)} "
                          "available: run more shards (protocol.shards) or use a larger host")
