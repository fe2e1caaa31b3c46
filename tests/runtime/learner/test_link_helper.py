"""The learner's link helper process: its slots, its start, its death and its trainer's.

A slot written again while the helper copies it is never sent torn; a helper that cannot start
is one line, never a hang; a helper killed with kill -9 while a contribution is in flight is a
link failure the learner survives (a new helper, the next contribution accepted); a trainer
killed with kill -9 leaves no helper behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.learner import helper_process
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.learner.slots import Slot, SlotArea, SlotError, SlotLayout
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import train_steps, train_until_updates, wait_for
from ddiloco.workload.workload import Workload

CONFIG = build_config(preset="tiny", overrides=("run.learners=1",))


def test_a_slot_read_across_a_write_is_refused():
    slots = SlotArea(SlotLayout((64,), (16,)))
    seq = slots.write(Slot.OUT, 0, np.full(64, 7, dtype=np.uint8))
    assert seq % 2 == 0 and slots.read(Slot.OUT, 0, seq) == bytes([7] * 64)
    payload = slots.begin(Slot.OUT, 0)  # the trainer writes again: the announced copy is gone
    payload[:10] = 9
    assert slots.read(Slot.OUT, 0, seq) is None and slots.read(Slot.OUT, 0, seq + 1) is None  # odd: mid-write
    later = slots.end(Slot.OUT, 0, 64)
    assert slots.read(Slot.OUT, 0, seq) is None and slots.read(Slot.OUT, 0, later)[:10] == bytes([9] * 10)


def test_a_slot_hammered_by_a_writer_never_yields_a_torn_copy():
    """The writer fills the slot with one byte value per generation; every copy the reader accepts
    must hold one value throughout, and be the generation announced."""
    slots, size = SlotArea(SlotLayout((1 << 20,), (0,))), 1 << 20
    announced, stop = [slots.write(Slot.OUT, 0, np.zeros(size, dtype=np.uint8))], threading.Event()

    def writer() -> None:
        value = 0
        while not stop.is_set():
            value = (value + 1) % 251
            payload = slots.begin(Slot.OUT, 0)
            payload[: size // 2] = value
            payload[size // 2:] = value
            announced.append(slots.end(Slot.OUT, 0, size))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):  # how many are refused depends on the interleaving: none may be torn
            seq = announced[-1]
            data = slots.read(Slot.OUT, 0, seq)
            arr = np.frombuffer(data or b"\0", dtype=np.uint8)
            assert (arr == arr[0]).all(), f"torn copy of generation {seq}"
    finally:
        stop.set()
        thread.join()
    data = slots.read(Slot.OUT, 0, announced[-1])  # the writer is done: its last generation reads whole
    assert data is not None and len(set(data)) == 1


def test_no_shared_memory_is_one_line(monkeypatch):
    def refuse(*_: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "memfd_create", refuse)
    with pytest.raises(SlotError, match="no shared memory for the learner's link .*No space left on device"):
        SlotArea(SlotLayout((100,), (100,)))


@pytest.mark.slow
@pytest.mark.parametrize("command, says", [
    (["/nonexistent/python"], "could not start the learner's link helper .*No such file"),
    ([sys.executable, "-c", "raise SystemExit(3)"], r"exited \(exit code 3\) before it was ready"),
])
def test_a_helper_that_cannot_start_fails_the_runtime_in_one_line(inproc_sync, monkeypatch, command, says):
    s = inproc_sync(CONFIG)
    monkeypatch.setattr(helper_process, "HELPER_COMMAND", command)
    with pytest.raises(DdilocoError, match=says) as failed:
        LearnerRuntime(Workload.build(CONFIG).new_model(), f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=60)
    assert "\n" not in str(failed.value)


@pytest.mark.slow
def test_a_helper_killed_mid_upload_is_replaced_and_the_next_contribution_accepted(inproc_sync):
    s = inproc_sync(CONFIG)
    workload = Workload.build(CONFIG)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=60)
    try:
        train_steps(runtime, workload, model, 0, 1, until=lambda: runtime.backlog > 0)
        assert runtime.backlog > 0  # a contribution is on its way
        first = runtime.link.calls.helper
        os.kill(first.pid, signal.SIGKILL)
        sent = runtime.stats.contributions_sent
        train_steps(runtime, workload, model, 0, 1, deadline_s=90,
                    until=lambda: runtime.link.relay.restarts == 1 and runtime.stats.contributions_sent >= sent + 2)
        assert runtime.link.relay.restarts == 1 and runtime.link.calls.helper.pid != first.pid
        assert runtime.stats.contributions_sent >= sent + 2  # accepted through the new helper
        assert first.proc.poll() == -signal.SIGKILL
    finally:
        runtime.close()
    (learner,) = s.call(lambda: s.service.status_reply()).learners
    assert learner.accepted >= 2


@pytest.mark.slow
def test_a_delta_the_helper_compresses_and_updates_it_decodes_reach_both_sides(inproc_sync):
    """Codecs the core does not fuse (fp32 up, int8 down): Δ travels raw in its slot and the helper
    compresses it; updates come back decoded into their slot."""
    config = build_config(preset="tiny", overrides=("run.learners=1", "protocol.codec=fp32",
                                                    "protocol.downlink_codec=int8"))
    s = inproc_sync(config)
    workload = Workload.build(config)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=60)
    assert not any(runtime.core.decodes_updates(p) for p in range(len(runtime.plan.fragments)))
    train_until_updates(runtime, workload, model, 2)
    assert runtime.stats.contributions_sent >= 2 and runtime.stats.updates_applied >= 2
    numels = {f.numel for f in runtime.plan.fragments}
    assert runtime.stats.bytes_up >= 4 * min(numels) * runtime.stats.contributions_sent  # fp32 on the wire


TRAINER = textwrap.dedent("""
    import sys, time
    from ddiloco.settings.config_sources import build_config
    from ddiloco.runtime.learner.runtime import LearnerRuntime
    from ddiloco.workload.workload import Workload
    config = build_config(preset="tiny", overrides=("run.learners=1",))
    runtime = LearnerRuntime(Workload.build(config).new_model(), sys.argv[1], "learner-0", join_timeout_s=60)
    print(runtime.link.calls.helper.pid, flush=True)
    time.sleep(600)  # the trainer only has to stay alive: the test kills it, and waits on events, not on this
""")


@pytest.mark.slow
def test_a_helper_dies_with_its_trainer(inproc_sync):
    s = inproc_sync(CONFIG)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"127.0.0.1:{s.port}"], stdout=subprocess.PIPE,
                               text=True)
    try:
        helper_pid = int(trainer.stdout.readline())
        assert alive(helper_pid)
        trainer.kill()
        trainer.wait()
        wait_for(lambda: not alive(helper_pid), "the helper to exit after its trainer was killed")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
