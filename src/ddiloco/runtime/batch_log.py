"""Which batches of its data stream each learner process trained, in a file that outlives kill -9.

A restarted ``ddiloco learner`` resumes its data at the synchronizer's ``data_position``
(``core/sync_side/data_position.py``): what reached the global model is trained again for at most about
one period H, and nothing is skipped. Checking that on real processes (``ddiloco chaos``) needs
where each process resumed and how far it trained before it died, and a kill -9 leaves no last
word. So ``ddiloco learner --batch-log FILE`` appends a line when its data resumes
(``resumed N``) and one per batch it trained (``trained K``, the sampler's own index), each in a
single write(2) on a file opened for appending: a line the kernel took is in the file after the
process dies. Every process of one learner appends to the same file, so the file is the
learner's whole stream across its restarts. A crash of the machine may lose the tail: this is a
check's evidence, not state anything resumes from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RESUMED = "resumed"
TRAINED = "trained"


@dataclass(frozen=True)
class ProcessBatches:
    """What one learner process trained: batches ``resumed_at`` to ``trained_to - 1`` (none if equal)."""

    resumed_at: int
    trained_to: int


class BatchLog:
    """Appends one process's batches to ``path`` (nothing when None: the log is off, or not rank 0)."""

    def __init__(self, path: Path | None, resumed_at: int) -> None:
        self._fd = None if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._write(f"{RESUMED} {resumed_at}")

    def trained(self, batch: int) -> None:
        """Batch ``batch`` of the stream was trained (its optimizer step is done)."""
        self._write(f"{TRAINED} {batch}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, line: str) -> None:
        if self._fd is not None:
            os.write(self._fd, f"{line}\n".encode())


def read_batch_log(path: Path) -> list[ProcessBatches]:
    """Each process's batches, in the order the processes ran (none if the file does not exist).

    A process trains its batches in order from where it resumed, so its last ``trained`` line says
    how far it went. A last line without its newline (cut short) is ignored.
    """
    try:
        lines = path.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []
    processes: list[ProcessBatches] = []
    for line in lines:
        word, _, number = line.partition(" ")
        if word == RESUMED:
            processes.append(ProcessBatches(int(number), int(number)))
        elif word == TRAINED and processes:
            processes[-1] = ProcessBatches(processes[-1].resumed_at, int(number) + 1)
        else:
            raise ValueError(f"{path}: not a batch log line: {line!r}")
    return processes
