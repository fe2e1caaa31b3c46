"""The control messages between a training process and its link's helper.

The hot one (a contribution's announce) is a fixed struct: the helper must read from it exactly
the contribution the trainer announced (the bytes it uploads follow from it), whatever its
fields; what the struct cannot carry goes pickled. An in slot's release is a word in shared
memory, no message; a step's messages reach the helper in one system call, and one held for a
helper that died meanwhile reaches none.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

import numpy as np
import pytest

from ddiloco.core.shared.messages import Contribution, Progress, Session
from ddiloco.runtime.learner import helper_wire
from ddiloco.runtime.learner.calls import HelperCalls
from ddiloco.runtime.learner.helper_wire import Msg, Pipe, PipeClosed, SendFrames
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.learner.slots import Slot, SlotArea, SlotLayout
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import train_until_updates
from ddiloco.workload.workload import Workload

FRAMES = SendFrames("learner-7", "int4", "0123456789ab")
HEADER = Contribution("learner-7", Session(2**64 - 3, 41), fragment=3, base_version=1234, seq=56, tokens=4096,
                      steps=8, compute_s=0.125, step_time_s=0.0157, codec="int4", payload=b"", first_step=977,
                      progress=Progress("0123456789ab", 123456, 980))


def through_pipe(data: bytes, frames: SendFrames | None = FRAMES) -> list[tuple]:
    """What the helper's end reads from ``data`` (whole frames, back to back)."""
    ours, theirs = socket.socketpair()
    try:
        Pipe(ours).send_frames(data)
        ours.close()
        pipe, read = Pipe(theirs, frames), []
        while True:
            try:
                read.append(pipe.recv())
            except PipeClosed:
                return read
    finally:
        theirs.close()


def test_every_contribution_field_is_carried_by_the_fixed_struct():
    assert tuple(f.name for f in dataclasses.fields(Contribution)) == helper_wire._CARRIED, \
        "Contribution gained or lost a field: carry it in helper_wire.SendFrames (and name it in _CARRIED)"


@pytest.mark.parametrize("header", [HEADER, dataclasses.replace(HEADER, progress=None, first_step=0)])
def test_a_packed_send_reads_as_the_contribution_announced(header):
    frame = FRAMES.send(17, 1, header, header.fragment, 2**40, True)
    assert frame[4] == Msg.SEND  # a fixed struct, not a pickle
    (msg,) = through_pipe(frame)
    assert msg == (Msg.SEND, 17, 1, header, header.fragment, 2**40, True)


@pytest.mark.parametrize("change", [{"learner_id": "learner-8"}, {"codec": "fp32"},
                                    {"progress": Progress("ba9876543210", 1, 1)},
                                    {"session": Session(2**64, 1)}])  # beyond the struct's range
def test_a_contribution_the_struct_cannot_carry_goes_pickled_and_whole(change):
    header = dataclasses.replace(HEADER, **change)
    frame = FRAMES.send(3, 0, header, header.fragment, 8, False)
    assert frame[4] == helper_wire.PICKLED
    (msg,) = through_pipe(frame)
    assert msg == (Msg.SEND, 3, 0, header, header.fragment, 8, False)


def test_frames_back_to_back_read_in_order():
    data = FRAMES.send(1, 0, HEADER, 3, 6, False) + helper_wire.pickled((Msg.BEAT, 4, 0, "x")) \
        + FRAMES.send(2, 0, HEADER, 3, 8, True)
    assert through_pipe(data) == [(Msg.SEND, 1, 0, HEADER, 3, 6, False), (Msg.BEAT, 4, 0, "x"),
                                  (Msg.SEND, 2, 0, HEADER, 3, 8, True)]


def test_a_fixed_struct_on_a_pipe_that_reads_none_is_refused():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        Pipe(ours).send_frames(FRAMES.send(1, 0, HEADER, 3, 6, False))
        with pytest.raises(PipeClosed, match="fixed-struct"):
            Pipe(theirs).recv()  # the training process's end: never misread


def test_an_in_slot_is_written_again_only_once_its_reader_released_it():
    """The helper's side of the hand-over (no message: a word in the slot's header, which a helper
    started after a crash reads as its predecessor left it)."""
    helper_side = SlotArea(SlotLayout((8,), (16,)))
    trainer_side = SlotArea(helper_side.layout, os.dup(helper_side.fd))
    assert helper_side.free(Slot.IN, 0)  # never written
    seq = helper_side.write(Slot.IN, 0, np.ones(16, dtype=np.uint8))
    assert not helper_side.free(Slot.IN, 0)  # the trainer holds it
    assert trainer_side.view(Slot.IN, 0, seq) is not None
    trainer_side.release(Slot.IN, 0)
    assert helper_side.free(Slot.IN, 0)
    helper_side.write(Slot.IN, 0, np.zeros(16, dtype=np.uint8))
    assert not helper_side.free(Slot.IN, 0)
    helper_side.begin(Slot.IN, 0)  # a helper killed mid-write: never announced, so free for the next
    assert helper_side.free(Slot.IN, 0)
    helper_side.write(Slot.IN, 0, np.ones(16, dtype=np.uint8))  # ... or killed before it announced the write:
    assert not helper_side.free(Slot.IN, 0)
    trainer_side.release_all(Slot.IN, held=set())  # the trainer, before the next helper starts, holds none
    assert helper_side.free(Slot.IN, 0)
    seq = helper_side.write(Slot.IN, 0, np.ones(16, dtype=np.uint8))
    trainer_side.release_all(Slot.IN, held={0})  # one the trainer holds stays held
    assert not helper_side.free(Slot.IN, 0)


@pytest.mark.slow
def test_a_step_reaches_the_helper_in_one_system_call(inproc_sync, monkeypatch):
    config = build_config(preset="tiny", overrides=("run.learners=1",))
    s = inproc_sync(config)
    workload = Workload.build(config)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=60)
    calls: list[int] = []  # per step, the sends of the training thread within it
    inside = threading.Event()
    step, send_frames = runtime.step, Pipe.send_frames

    def counted(tokens: int) -> None:
        calls.append(0)
        inside.set()
        try:
            step(tokens)
        finally:
            inside.clear()

    def send(pipe: Pipe, data: bytes, **kw: object) -> None:
        if inside.is_set() and threading.current_thread() is threading.main_thread():
            calls[-1] += 1
        send_frames(pipe, data, **kw)

    if hasattr(os, "SCHED_BATCH"):  # its wake-ups never preempt the training thread (helper.yield_to_trainer)
        assert os.sched_getscheduler(runtime.link.calls.helper.pid) == os.SCHED_BATCH
    monkeypatch.setattr(runtime, "step", counted)
    monkeypatch.setattr(Pipe, "send_frames", send)
    train_until_updates(runtime, workload, model, 2)
    assert runtime.stats.contributions_sent >= 2 and runtime.stats.updates_applied >= 2
    assert max(calls) == 1  # the announces of one step: one send


class Running:
    """A helper as ``HelperCalls`` sees one: its end of a real socket pair."""

    def __init__(self) -> None:
        ours, self.theirs = socket.socketpair()
        self.pipe = Pipe(ours)
        self.theirs.setblocking(False)

    def received(self) -> bytes:
        try:
            return self.theirs.recv(1 << 16)
        except BlockingIOError:
            return b""


def test_calls_held_in_a_step_go_together_and_never_to_a_successor():
    calls, first = HelperCalls(), Running()
    assert calls.started(first) == []
    frames = [FRAMES.send(rid, 0, HEADER, 3, 2 * rid, False) for rid in range(3)]
    with calls.batched():
        calls.call(calls.next_rid(), HEADER, 0, frames[0])
        other = threading.Thread(target=calls.call, args=(calls.next_rid(), HEADER, 0, frames[1]))
        other.start()
        other.join()
        assert first.received() == frames[1]  # another thread's call is not held
        calls.call(calls.next_rid(), HEADER, 0, frames[2])
        assert first.received() == b""
    assert first.received() == frames[0] + frames[2]  # one write
    with calls.batched():
        rid = calls.next_rid()
        calls.call(rid, HEADER, 0, frames[0])
        calls.gone()  # the helper died mid-step
        second = Running()
        assert rid in calls.started(second)  # reported lost when its successor starts ...
    assert second.received() == b"" and first.received() == b""  # ... so sent to neither


def test_a_call_answered_while_it_is_still_being_recorded_ends_for_good():
    """The relay may hear a call's outcome before ``call`` has returned (a heartbeat answered at once):
    the call must end then, not come back once ``call`` records it (a flush then waited without end)."""
    calls, helper = HelperCalls(), Running()
    calls.started(helper)
    rid = calls.next_rid()
    answered = threading.Thread(target=calls.done, args=(rid,))
    send = helper.pipe.send_frames

    def send_and_answer(data: bytes, **kw) -> None:
        send(data, **kw)
        answered.start()  # the relay, on another thread, as the helper answers
        answered.join(timeout=1.0)  # it waits for the call's record (the fix); before, it ended here, first

    helper.pipe.send_frames = send_and_answer
    calls.call(rid, HEADER, 0, FRAMES.send(rid, 0, HEADER, 3, 2, False))
    answered.join()
    assert calls.requests == {}


def test_a_helper_thread_with_something_to_report_after_the_trainer_closed_ends_quietly():
    """An update that arrived as the learner closed: the helper's receiver reported it on a pipe the
    trainer had closed, and its thread's traceback went into the learner's log (the every-fault-kind
    chaos test found it there once in ten runs)."""
    from ddiloco.runtime.learner.helper import _until_closed

    ours, theirs = socket.socketpair()
    pipe = Pipe(ours)
    theirs.close()
    ours.shutdown(socket.SHUT_RDWR)  # as the helper's close leaves it
    raised: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: raised.append(args.exc_value)
    try:
        thread = threading.Thread(target=_until_closed, args=(lambda: pipe.send(Msg.READY),))
        thread.start()
        thread.join(timeout=30)
    finally:
        threading.excepthook = hook
        ours.close()
    assert not thread.is_alive() and raised == []
