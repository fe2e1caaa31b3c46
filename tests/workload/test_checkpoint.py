"""Checkpoints: round trip, damage detection, and kill -9 at arbitrary instants of a write."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from ddiloco.testing import wait_for
from ddiloco.workload.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def test_round_trip_keeps_nesting_none_and_tensors(tmp_path: Path) -> None:
    state = {"fragments": [{"value": torch.arange(6.0), "momentum": None}], "n": 3, "names": {"a": [1, "x"]}}
    save_checkpoint(tmp_path / "c.safetensors", state)
    loaded = load_checkpoint(tmp_path / "c.safetensors")
    assert torch.equal(loaded["fragments"][0]["value"], state["fragments"][0]["value"])
    assert loaded["fragments"][0]["momentum"] is None and loaded["n"] == 3 and loaded["names"] == {"a": [1, "x"]}


def test_a_damaged_or_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"v": torch.ones(1000)})
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing")


def _write_forever(path: str) -> None:
    n = 0
    while True:
        n += 1
        save_checkpoint(Path(path), {"version": n, "values": torch.full((1 << 20,), float(n)),
                                     "tail": torch.full((7,), float(n))})


def test_kill_9_during_writes_never_leaves_a_checkpoint_that_loads_wrong(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(1234)
    last = 0
    for _ in range(4):
        writer = ctx.Process(target=_write_forever, args=(str(path),), daemon=True)
        writer.start()
        try:
            wait_for(lambda: path.exists() and load_checkpoint(path)["version"] > last, "a new checkpoint")
            time.sleep(rng.uniform(0.0, 0.05))  # land anywhere inside the next write
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
        finally:
            if writer.is_alive():
                writer.kill()
        state = load_checkpoint(path)
        version = state["version"]
        assert version >= last
        assert torch.all(state["values"] == version) and torch.all(state["tail"] == version)
        last = version
