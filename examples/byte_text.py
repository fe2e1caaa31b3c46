"""Byte-level training text for the examples: no tokenizer, nothing downloaded.

Every byte is a token (vocabulary 256), so any local text trains a language model as it is.
By default the text is the Python standard library's top-level ``*.py`` modules: present on
every machine that runs Python, real prose-like code, and the same bytes for one Python
version. Replace it with your own data (``--text FILE_OR_DIR``).

Each learner draws random windows from the whole text with its own seed (derived from its
id), so two learners see different batches without having to agree on a sharding.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 2 * 2**20
"""Read at most this much text (2 MiB): plenty for a small model, quick to load."""

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
"""Files read from a directory given as ``--text``."""


class TextError(Exception):
    """The training text cannot be used; the scripts print it as one line and exit 2."""


def default_text_dir() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_bytes(path: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """A file, or a directory's text files (top level, sorted by name), as a uint8 tensor.

    Raises :class:`TextError` naming the path if it holds no text.
    """
    root = default_text_dir() if path is None else path
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
    else:
        raise TextError(f"--text {str(root)!r}: no such file or directory")
    chunks: list[bytes] = []
    size = 0
    for file in files:
        if size >= max_bytes:
            break
        data = file.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
    text = b"\n".join(chunks)
    if len(text) < 2:
        raise TextError(f"--text {str(root)!r}: no text to train on")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def learner_seed(learner_id: str, seed: int = 0) -> int:
    """A stable per-learner seed (``hash()`` of a string changes between processes)."""
    return zlib.crc32(learner_id.encode()) ^ seed


class ByteBatches:
    """Random windows of ``seq_len`` bytes, ``batch_size`` at a time, as int64 token ids.

    Batch ``i`` depends only on the seed and ``i``, so a restarted learner can resume its data
    where it reached the global model (:meth:`skip_to` with ``LearnerRuntime.data_position``)."""

    def __init__(self, data: torch.Tensor, *, batch_size: int, seq_len: int, seed: int) -> None:
        if batch_size < 1 or seq_len < 2:
            raise TextError(f"need --batch-size >= 1 and --seq-len >= 2, got {batch_size} and {seq_len}")
        if data.numel() <= seq_len:
            raise TextError(f"the text has {data.numel()} bytes; windows of --seq-len {seq_len} need more")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.batch = 0
        """The index of the batch :meth:`next` returns."""
        self.generator = torch.Generator()

    def skip_to(self, batch: int) -> None:
        """Return batch ``batch`` next (where a restarted learner's data resumes)."""
        self.batch = batch

    def next(self) -> torch.Tensor:
        """A ``(batch_size, seq_len)`` batch; the model predicts each byte from the ones before."""
        self.generator.manual_seed(self.seed * 1_000_003 + self.batch)
        self.batch += 1
        starts = torch.randint(0, self.data.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len)
        return self.data[starts[:, None] + offsets].long()
