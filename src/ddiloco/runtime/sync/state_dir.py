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

import numpy as np
import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.round_log import holds_rounds
from ddiloco.workload.checkpoint import CheckpointError, fsync_dir, sync_and_uncache

FORMAT = "ddiloco-sync-checkpoint-2"
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
LEGACY_NAME = "synchronizer.safetensors"
"""The single-file checkpoint of ddiloco before fragment-by-fragment checkpoints (not read)."""
_FOLDER = re.compile(r"checkpoint-(\d{6,})$")
_TENSORS = ("value", "momentum", "residual", "residual_scales")


class StateDir:
    def __init__(self, path: Path, *, resume: Resume) -> None:
        self.path = path
        if resume is Resume.REQUIRED and not has_checkpoint(path):  # before anything is created
            raise ConfigError(f"--resume: --state-dir {str(path)!r} holds no run's state (no checkpoint, no round "
                              "log): start without --resume for a new run, or pass --resume-if-present to resume "
                              "only when there is one")
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
        if has_checkpoint(path) and resume is Resume.NEW_RUN:
            self.close()
            raise ConfigError(
                f"--state-dir {str(path)!r} already holds a run's state: pass --resume to continue that run, "
                "or choose another directory"
            )

    @property
    def current(self) -> Path | None:
        """The folder of the latest whole checkpoint, if any."""
        return current_checkpoint(self.path)

    def load(self) -> dict[str, Any] | None:
        """The latest checkpoint — its fragments read lazily, one at a time — or None when there is none."""
        return load_latest(self.path)

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


def load_latest(path: Path) -> dict[str, Any] | None:
    """The latest checkpoint in the state directory ``path`` — its fragments read lazily, one at a
    time — or None when there is none. Reads only: no lock is taken (``ddiloco export`` reads the
    directory of a synchronizer that may be running)."""
    if (path / LEGACY_NAME).exists() and current_checkpoint(path) is None:
        raise CheckpointError(f"{path / LEGACY_NAME} is a checkpoint of an older ddiloco (one file, "
                              f"fp32 outer state), which this version does not read: resume with that version "
                              f"or start a new run in another --state-dir")
    folder = current_checkpoint(path)
    if folder is None:
        return None
    manifest = folder / MANIFEST
    try:
        document = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest} is missing: the checkpoint named by {path / CURRENT} is "
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


def current_checkpoint(path: Path) -> Path | None:
    try:
        name = (path / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    if not _FOLDER.match(name):
        raise CheckpointError(f"{path / CURRENT} names {name!r}, not a checkpoint folder")
    return path / name


def has_checkpoint(path: Path) -> bool:
    """Does the state directory ``path`` hold a run's state: a checkpoint (of this version or an
    older one) or a round log with a round in it?"""
    return (path / CURRENT).exists() or (path / LEGACY_NAME).exists() or holds_rounds(path)


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
        name = f"fragment-{index:05d}.safetensors"
        size, sha256 = write_tensors(self.folder / name, tensors)
        self.bytes += size
        small = {k: v for k, v in state.items() if k not in _TENSORS}
        self.fragments.append({**small, "index": index, "file": name, "bytes": size, "sha256": sha256,
                               "tensors": sorted(tensors)})

    def commit(self, state: dict[str, Any]) -> int:
        """Write the manifest and make this checkpoint the latest; returns its size in bytes."""
        manifest = json.dumps({"format": FORMAT, "state": state, "fragments": self.fragments}, sort_keys=True)
        _write(self.folder / MANIFEST, manifest.encode())
        fsync_dir(self.folder)
        previous = current_checkpoint(self.root)
        _write(self.root / f"{CURRENT}.tmp", self.folder.name.encode())
        os.replace(self.root / f"{CURRENT}.tmp", self.root / CURRENT)
        fsync_dir(self.root)
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
        tensors = read_tensors(self.folder / entry["file"], entry["sha256"])
        return {**{k: v for k, v in entry.items() if k not in ("file", "bytes", "sha256", "tensors")},
                **{name: tensors.get(name) for name in _TENSORS}}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))



_DTYPES = {torch.float32: ("F32", torch.float32, np.float32), torch.bfloat16: ("BF16", torch.int16, np.int16),
           torch.int8: ("I8", torch.int8, np.int8)}
"""Each state dtype: its safetensors name, and the dtype numpy reads and writes its bytes as."""
_BY_NAME = {name: (dtype, np_dtype) for dtype, (name, _, np_dtype) in _DTYPES.items()}
_READ_BYTES = 8 << 20


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write a safetensors file straight from the tensors' memory (no serialized copy); returns
    its size and SHA-256. Any safetensors reader opens it."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": _DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset,
                                                                                               offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (len(text).to_bytes(8, "little"), text,
                     *(memoryview(t.view(_DTYPES[t.dtype][1]).numpy()).cast("B") for t in tensors.values())):
            f.write(part)
            digest.update(part)
        sync_and_uncache(f)
    return 8 + len(text) + offset, digest.hexdigest()


def read_tensors(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """A fragment file's tensors, read one by one into their own memory after the file's hash is checked."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_READ_BYTES):
                digest.update(block)
        if digest.hexdigest() != sha256:
            raise CheckpointError(f"{path} is damaged: its SHA-256 is not the one in its manifest")
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            tensors = {}
            for name, spec in header.items():
                if name == "__metadata__":
                    continue
                dtype, np_dtype = _BY_NAME[spec["dtype"]]
                start, end = spec["data_offsets"]
                count = (end - start) // np.dtype(np_dtype).itemsize
                array = np.fromfile(f, dtype=np_dtype, count=count, offset=8 + size + start - f.tell())
                tensors[name] = torch.from_numpy(array).view(dtype).reshape(spec["shape"])
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError) as err:  # hash-checked, so written wrong: never by this code
        raise CheckpointError(f"{path} is damaged: {err}") from None
    return tensors


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

