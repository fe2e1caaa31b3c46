"""Training text: loading a corpus, sharding it per learner, sampling batches.

**Default corpus: the Python standard library's own source code.** Every ``*.py`` file
under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, concatenated with a
newline between files, up to a byte cap (16 MiB by default; CPython 3.11 gives about
12 MB). Directories named ``test``, ``tests``, ``idle_test``, ``site-packages`` and
``__pycache__`` are skipped (the test suites are huge, repetitive and sometimes
deliberately malformed), and so are the build-specific ``_sysconfigdata_*`` module and
``config-*`` directory, so two machines with the same Python version read the same bytes.
Why this corpus: it is on every machine that can run ddiloco, needs no download or
network, is real human-written text with long-range structure, and is large enough that a
small model does not memorise it in a CPU-sized run. It is deterministic for a given
Python version (not across versions: compare runs on the same interpreter).

``--corpus DIR`` replaces it with every regular, non-hidden file under DIR that decodes as
UTF-8, in the same order and format.

Data flows as: :func:`load_corpus` (bytes) -> :func:`split_corpus` (one disjoint training
shard per learner, plus a held-out evaluation tail) -> :class:`BatchSampler` per learner
and :func:`eval_batches` for evaluation.
"""

from __future__ import annotations

import codecs
import functools
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ddiloco.core.shared.errors import ConfigError

DEFAULT_MAX_BYTES = 16 * 2**20
"""Default cap on the corpus size, in bytes."""

SEPARATOR = b"\n"
"""Written between two files of a corpus."""

MIN_EVAL_WINDOWS = 4
"""The evaluation tail holds at least this many non-overlapping sequences."""

_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _sorted_files(root: Path, *, skip_dir, keep_file) -> list[Path]:
    """Regular files under ``root`` (symlinked dirs not followed), sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for name in filenames:
            path = Path(dirpath, name)
            if keep_file(name) and path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> tuple[Path, ...]:
    """The standard-library source files that make up the default corpus, in corpus order."""
    return tuple(
        _sorted_files(
            stdlib_root(),
            skip_dir=lambda d: d in _STDLIB_SKIP_DIRS or _is_hidden(d) or d.startswith("config-"),
            keep_file=lambda f: f.endswith(".py")
            and not f.startswith("_sysconfigdata_")
            and not _is_hidden(f),
        )
    )


def _read_utf8_prefix(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` if they decode as UTF-8 (a multi-byte character cut
    at the limit is fine), else None. Unreadable files count as not text."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit)
            complete = fh.read(1) == b""
    except OSError:
        return None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError:
        return None
    return data


def _concatenate(paths: tuple[Path, ...] | list[Path], max_bytes: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    for path in paths:
        if size >= max_bytes:
            break
        if parts:
            parts.append(SEPARATOR)
            size += len(SEPARATOR)
        data = _read_utf8_prefix(path, max(max_bytes - size, 0))
        if not data:  # not text, unreadable or empty: skip it (and the separator)
            if parts:
                parts.pop()
                size -= len(SEPARATOR)
            continue
        parts.append(data)
        size += len(data)
    return b"".join(parts)[:max_bytes]


@functools.lru_cache(maxsize=4)
def _default_corpus(max_bytes: int) -> bytes:
    return _concatenate(default_corpus_files(), max_bytes)


def load_corpus(
    directory: str | Path | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_bytes: int = 1,
) -> bytes:
    """The corpus as bytes: the standard library's source (``directory=None``, cached in
    process) or the UTF-8 files under ``directory``, at most ``max_bytes`` of it.

    Raises :class:`ConfigError` naming the path if ``directory`` is missing, is not a
    directory, or yields fewer than ``min_bytes`` bytes of text (pass ``seq_len + 1`` to
    require at least one training sequence).
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ConfigError(f"corpus max_bytes must be a positive integer, got {max_bytes!r}")
    if directory is None:
        data, where = _default_corpus(max_bytes), f"standard library at {stdlib_root()}"
    else:
        root = Path(directory)
        if not root.exists():
            raise ConfigError(f"corpus directory {str(root)!r} does not exist")
        if not root.is_dir():
            raise ConfigError(f"corpus path {str(root)!r} is not a directory")
        files = _sorted_files(root, skip_dir=_is_hidden, keep_file=lambda f: not _is_hidden(f))
        data, where = _concatenate(files, max_bytes), f"corpus directory {str(root)!r}"
    if not data:
        raise ConfigError(f"{where} holds no UTF-8 text files")
    if len(data) < min_bytes:
        raise ConfigError(f"{where} holds {len(data)} bytes of text, need at least {min_bytes}")
    return data


CHUNK_BYTES = 16 * 1024
"""Unit of the split: shards and the held-out set are made of chunks dealt from the whole corpus."""


@dataclass(frozen=True)
class Corpus:
    """A corpus split for training: one disjoint shard per learner plus held-out data."""

    train_shards: tuple[Tensor, ...]
    """uint8 1-D, one per learner; disjoint, each a mix of chunks from the whole corpus."""
    eval_data: Tensor
    """uint8 1-D held-out chunks, spread evenly over the corpus, never trained on."""


def split_corpus(
    data: bytes, *, num_shards: int, eval_fraction: float = 0.05, seq_len: int
) -> Corpus:
    """Cut ``data`` into chunks, hold out evenly spaced chunks (at least ``eval_fraction`` of
    the bytes and ``MIN_EVAL_WINDOWS`` sequences) for evaluation, and deal the others
    round-robin to ``num_shards`` shards.

    Dealing, rather than cutting the corpus into contiguous slices, gives every learner the
    same distribution (the sorted stdlib would otherwise give one learner ``asyncio`` and
    another ``xml``): DiLoCo's learners sample i.i.d. from one dataset, and data parallel —
    the baseline — averages over all of it at every step. Every shard must hold a training
    sequence (``seq_len + 1`` bytes), else :class:`ConfigError`.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"num_shards must be a positive integer, got {num_shards!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    n = len(data)
    eval_len = max(math.ceil(eval_fraction * n), MIN_EVAL_WINDOWS * seq_len + 1)
    chunk = max(seq_len + 1, min(CHUNK_BYTES, n // (16 * (num_shards + 1))))
    everything = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    chunks = list(torch.split(everything, chunk))
    held = _evenly_spaced_covering(chunks, eval_len) or set(range(len(chunks)))
    train = [c for i, c in enumerate(chunks) if i not in held]
    shards = tuple(torch.cat(train[s::num_shards]) if train[s::num_shards] else everything[:0]
                   for s in range(num_shards))
    if min(s.numel() for s in shards) < seq_len + 1:
        raise ConfigError(
            f"corpus of {n} bytes is too small: after holding out {eval_len} bytes for "
            f"evaluation, {num_shards} shard(s) need seq_len+1={seq_len + 1} bytes each"
        )
    return Corpus(train_shards=shards, eval_data=torch.cat([chunks[i] for i in sorted(held)]))


def _evenly_spaced_covering(chunks: list[Tensor], min_bytes: int) -> set[int] | None:
    """Indices of the fewest evenly spaced chunks holding ``min_bytes``, leaving one to train on."""
    total = len(chunks)
    for k in range(1, total):
        ids = {((2 * i + 1) * total) // (2 * k) for i in range(k)}
        if sum(chunks[i].numel() for i in ids) >= min_bytes:
            return ids
    return None


def _mix64(x: int) -> int:
    """SplitMix64 finalizer: a bijection on 64-bit integers that scrambles every bit."""
    x &= 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & 0xFFFF_FFFF_FFFF_FFFF
    return x ^ (x >> 31)


class BatchSampler:
    """Random contiguous windows from one shard, from its own seeded torch.Generator (so
    learners are independent and reproducible).

    Batch ``i`` is drawn from a generator seeded with a hash of ``(seed, i)``, so the whole
    position in the stream is the integer ``i``: :meth:`state_dict` is two integers (JSON
    friendly) and resuming costs nothing. Samplers never touch the global RNG.
    """

    def __init__(self, shard: Tensor, *, batch_size: int, seq_len: int, seed: int) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if shard.dim() != 1:
            raise ConfigError(f"a shard must be 1-D, got shape {tuple(shard.shape)}")
        if shard.numel() < seq_len + 1:
            raise ConfigError(
                f"shard of {shard.numel()} bytes is shorter than seq_len+1={seq_len + 1}"
            )
        self.shard = shard
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = int(seed)
        self.batches_drawn = 0
        self._offsets = torch.arange(seq_len + 1)
        self._generator = torch.Generator()

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """``(x, y)``, int64 ``[batch_size, seq_len]``; ``y[:, t]`` is the byte that follows
        ``x[:, t]`` in the shard (targets are the inputs shifted by one)."""
        self._generator.manual_seed(_mix64(_mix64(self.seed) + self.batches_drawn))
        self.batches_drawn += 1
        num_starts = self.shard.numel() - self.seq_len  # starts in [0, len - seq_len - 1]
        starts = torch.randint(num_starts, (self.batch_size, 1), generator=self._generator)
        windows = self.shard[starts + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def skip_to(self, batch: int) -> None:
        """Draw batch ``batch`` next (a restarted learner resumes at its ``data_position``)."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        self.batches_drawn = batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"seed", "batches_drawn"}:
            raise ValueError(f"not a BatchSampler state: keys {sorted(state)}")
        if int(state["batches_drawn"]) < 0:
            raise ValueError(f"batches_drawn must be >= 0, got {state['batches_drawn']}")
        self.seed = int(state["seed"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_batches(
    eval_data: Tensor, *, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[Tensor, Tensor]]:
    """Fixed evaluation batches: consecutive non-overlapping windows from the start of
    ``eval_data``, ``batch_size`` per batch (the last batch may be smaller), at most
    ``max_batches`` batches. Same input, same batches."""
    sizes = (("batch_size", batch_size), ("seq_len", seq_len), ("max_batches", max_batches))
    for name, value in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    num_windows = min((eval_data.numel() - 1) // seq_len, batch_size * max_batches)
    if num_windows < 1:
        raise ConfigError(
            f"evaluation data of {eval_data.numel()} bytes is shorter than "
            f"seq_len+1={seq_len + 1}"
        )
    starts = torch.arange(num_windows).unsqueeze(1) * seq_len
    windows = eval_data[starts + torch.arange(seq_len + 1)].long()
    return [(w[:, :-1], w[:, 1:]) for w in torch.split(windows, batch_size)]
