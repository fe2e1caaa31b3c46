"""The synchronizer's state directory: an exclusive lock and the latest checkpoint.

Two synchronizers must never share a state directory (each would overwrite the other's
checkpoints), so the directory is locked with ``flock`` for the life of the process; the
lock dies with the process, even on ``kill -9``. Checkpoints are written atomically
(:mod:`ddiloco.runtime.checkpoint`).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.runtime.checkpoint import load_checkpoint, save_checkpoint

CHECKPOINT_NAME = "synchronizer.safetensors"


class StateDir:
    def __init__(self, path: Path, *, resume: bool) -> None:
        self.path = path
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"--state-dir {str(path)!r}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"--state-dir {str(path)!r} is in use by another synchronizer") from None
        self._fd: int | None = fd
        if self.checkpoint_path.exists() and not resume:
            self.close()
            raise ConfigError(
                f"--state-dir {str(path)!r} already holds a checkpoint: pass --resume to continue that run, "
                "or choose another directory"
            )

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_NAME

    def load(self) -> dict[str, Any] | None:
        """The latest checkpoint, or None when there is none yet."""
        return load_checkpoint(self.checkpoint_path) if self.checkpoint_path.exists() else None

    def save(self, state: dict[str, Any]) -> int:
        return save_checkpoint(self.checkpoint_path, state)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
