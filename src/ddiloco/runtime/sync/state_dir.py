"""The synchronizer's state directory: an exclusive lock and the latest checkpoint, a fragment per file.

Two synchronizers must never share a state directory (each would overwrite the other's
checkpoints), so the directory is locked with ``flock`` for the life of the process; the
lock dies with the process, even on ``kill -9``.

A checkpoint is a folder ``checkpoint-NNNNNN/``: one safetensors file per fragment (its value,
momentum and residual) and ``manifest.json`` (the core's and the service's state, each
fragment's version and norms, and the SHA-256 of every fragment file). It is written a
fragment at a time — each fragment copied on the core's thread, written and let go before
the next — so a checkpoint costs one fragment of memory, not a copy of the model. It becomes
the latest when ``CURRENT`` names it: ``CURRENT`` is replaced atomically (``os.replace``)
after every file of the folder and the folder itself are fsynced, so a crash at any instant
leaves ``CURRENT`` naming a whole checkpoint; a half-written folder is never named and is
removed at the next save. A restore reads it back the same way, a fragment at a time, and
checks each file against its hash before anything of it is used.

Each fragment is copied whole (value, momentum, residual and version together) but the
fragments are copied one after another while rounds go on, so a checkpoint's fragments may be
a few versions apart: every fragment is independent in the protocol, and each restored one
is a state the synchronizer served.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ddiloco.errors import ConfigError
from ddiloco.runtime.checkpoint import CheckpointError

FORMAT = "ddiloco-sync-checkpoint-2"
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
LEGACY_NAME = "synchronizer.safetensors"
"""The single-file checkpoint of ddiloco before fragment-by-fragment checkpoints (not read)."""
_FOLDER = re.compile(r"checkpoint-(\d{6,})$")
_TENSORS = ("value", "momentum", "residual", "residual_scales")


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
        if has_checkpoint(path) and not resume:
            self.close()
            raise ConfigError(
                f"--state-dir {str(path)!r} already holds a checkpoint: pass --resume to continue that run, "
                "or choose another directory"
            )

    @property
    def current(self) -> Path | None:
        """The folder of the latest whole checkpoint, if any."""
        return current_checkpoint(self.path)

    def load(self) -> dict[str, Any] | None:
        """The latest checkpoint — its fragments read lazily, one at a time — or None when there is none."""
        if (self.path / LEGACY_NAME).exists() and self.current is None:
            raise CheckpointError(f"{self.path / LEGACY_NAME} is a checkpoint of an older ddiloco (one file, "
                                  f"fp32 outer state), which this version does not read: resume with that version "
                                  f"or start a new run in another --state-dir")
        folder = self.current
        if folder is None:
            return None
        manifest = folder / MANIFEST
        try:
            document = json.loads(manifest.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{manifest} is missing: the checkpoint named by {self.path / CURRENT} is "
                                  "incomplete") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{manifest} is damaged: {err}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise CheckpointError(f"{manifest} is not a ddiloco synchronizer checkpoint (format "
                                  f"{document.get('format') if isinstance(document, dict) else None!r})")
        try:
            state = document["state"]
            state["core"]["fragments"] = LazyFragments(folder, document["fragments"])
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{manifest} is damaged: no {err}") from None
        return state

    def begin(self, number: int) -> CheckpointDraft:
        """A new checkpoint folder to write fragments into (leftovers of unfinished writes removed)."""
        keep = self.current
        for folder in self.path.iterdir():
            if _FOLDER.match(folder.name) and folder != keep:
                shutil.rmtree(folder, ignore_errors=True)
        return CheckpointDraft(self.path, self.path / f"checkpoint-{number:06d}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def current_checkpoint(path: Path) -> Path | None:
    try:
        name = (path / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    if not _FOLDER.match(name):
        raise CheckpointError(f"{path / CURRENT} names {name!r}, not a checkpoint folder")
    return path / name


def has_checkpoint(path: Path) -> bool:
    """Does the state directory ``path`` hold a checkpoint (of this version or an older one)?"""
    return (path / CURRENT).exists() or (path / LEGACY_NAME).exists()


class CheckpointDraft:
    """One checkpoint being written: fragment files first, then the manifest, then ``CURRENT``."""

    def __init__(self, root: Path, folder: Path) -> None:
        self.root = root
        self.folder = folder
        folder.mkdir()
        self.fragments: list[dict[str, Any]] = []
        self.bytes = 0

    def add_fragment(self, index: int, state: dict[str, Any]) -> None:
        """Write one fragment's state (:meth:`GlobalFragment.state_dict`); its memory can go after this."""
        tensors = {name: state[name].contiguous() for name in _TENSORS if state.get(name) is not None}
        data = st_save(tensors)
        name = f"fragment-{index:05d}.safetensors"
        _write(self.folder / name, data)
        self.bytes += len(data)
        small = {k: v for k, v in state.items() if k not in _TENSORS}
        self.fragments.append({**small, "index": index, "file": name, "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest(), "tensors": sorted(tensors)})

    def commit(self, state: dict[str, Any]) -> int:
        """Write the manifest and make this checkpoint the latest; returns its size in bytes."""
        manifest = json.dumps({"format": FORMAT, "state": state, "fragments": self.fragments}, sort_keys=True)
        _write(self.folder / MANIFEST, manifest.encode())
        _fsync_dir(self.folder)
        previous = current_checkpoint(self.root)
        _write(self.root / f"{CURRENT}.tmp", self.folder.name.encode())
        os.replace(self.root / f"{CURRENT}.tmp", self.root / CURRENT)
        _fsync_dir(self.root)
        if previous is not None and previous != self.folder:
            shutil.rmtree(previous, ignore_errors=True)
        return self.bytes + len(manifest)

    def abandon(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class LazyFragments(Sequence[dict[str, Any]]):
    """A checkpoint's fragments, each read (and checked against its hash) only when asked for."""

    def __init__(self, folder: Path, entries: list[dict[str, Any]]) -> None:
        self.folder = folder
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        entry = self.entries[i]
        path = self.folder / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CheckpointError(f"cannot read {path}: {err.strerror}") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path} is damaged: its SHA-256 is not the one in {self.folder / MANIFEST}")
        try:
            tensors = st_load(data)
        except SafetensorError as err:
            raise CheckpointError(f"{path} is damaged: {err}") from None
        del data
        return {**{k: v for k, v in entry.items() if k not in ("file", "bytes", "sha256", "tensors")},
                **{name: tensors.get(name) for name in _TENSORS}}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def versions(self) -> list[int]:
        return [int(e["version"]) for e in self.entries]


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

