"""The round log's file format: records come back in order, a torn or damaged tail ends the
log where it is damaged (said in one line), and a segment of another run is refused; a
resumed synchronizer replays what is intact and refuses a log with a gap."""

from __future__ import annotations

import json
import logging
import struct
import threading
import zlib

import pytest
import torch

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Join
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.round_log import FIRST_MAGIC, RoundLog, read_rounds, segments
from ddiloco.runtime.sync.service import ServiceOptions, SyncService
from ddiloco.settings.config_sources import build_config
from ddiloco.workload.checkpoint import CheckpointError

IDENTITY = {"layout_sha256": "ab" * 32, "shard": 0}


def write(path, records: list[tuple[int, int, bytes]]) -> None:
    log = RoundLog(path, IDENTITY)
    futures = [log.append(fragment, version, False, payload) for fragment, version, payload in records]
    for f in futures:
        f.result(timeout=30)
    log.close()


def test_records_come_back_in_order_across_segments_and_old_segments_are_dropped(tmp_path):
    log = RoundLog(tmp_path, IDENTITY)
    log.append(0, 1, False, b"a" * 10).result(timeout=30)
    second = log.rotate().result(timeout=30)
    log.append(1, 1, True, b"b" * 7).result(timeout=30)
    log.append(0, 2, False, b"")
    log.barrier().result(timeout=30)  # what a state transfer waits for: everything appended is durable
    assert [r.version for r in read_rounds(tmp_path, IDENTITY)] == [1, 1, 2]
    assert [(r.fragment, r.plain, r.payload) for r in read_rounds(tmp_path, IDENTITY, second)] == \
        [(1, True, b"b" * 7), (0, False, b"")]
    log.drop_before(second)
    assert [n for n, _ in segments(tmp_path)] == [second]
    log.close()


def test_a_waiter_that_gave_up_on_its_barrier_never_stops_the_log(tmp_path, monkeypatch):
    """Issue 53: a join whose caller went away cancels the barrier it awaited; resolving that
    future raised on the log's thread and ended it, and every later update and checkpoint waited
    for good. The first record's fsync is held until the barrier has been given up on."""
    log = RoundLog(tmp_path, IDENTITY)
    entered, release = threading.Event(), threading.Event()
    flush = log._flush

    def held_flush() -> None:
        entered.set()
        release.wait(30)
        flush()

    monkeypatch.setattr(log, "_flush", held_flush)
    first = log.append(0, 1, False, b"a")
    assert entered.wait(30)
    abandoned = log.barrier()
    assert abandoned.cancel()  # what asyncio.wrap_future does when the awaiting task is cancelled
    release.set()
    first.result(timeout=30)
    log.append(0, 2, False, b"b").result(timeout=30)  # the thread is still there
    log.barrier().result(timeout=30)
    assert [r.version for r in read_rounds(tmp_path, IDENTITY)] == [1, 2]
    log.close()


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_a_torn_or_damaged_tail_ends_the_log_there_in_one_line(tmp_path, caplog, damage):
    write(tmp_path, [(0, 1, b"x" * 100), (0, 2, b"y" * 100), (0, 3, b"z" * 100)])
    (_, file), = segments(tmp_path)
    data = bytearray(file.read_bytes())
    if damage == "torn":
        del data[-50:]  # the last record cut short: a crash while it was written
    else:
        data[-10] ^= 0xFF  # a bit flipped in the last record's payload
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ddiloco.sync"):
        assert [r.version for r in read_rounds(tmp_path, IDENTITY)] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cut short or damaged" in warnings[0]


def test_a_damaged_record_with_others_after_it_is_refused(tmp_path):
    write(tmp_path, [(0, 1, b"x" * 100), (0, 2, b"y" * 100), (0, 3, b"z" * 100)])
    (_, file), = segments(tmp_path)
    data = bytearray(file.read_bytes())
    data[-200] ^= 0xFF  # inside the second record's payload
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged and records follow it"):
        list(read_rounds(tmp_path, IDENTITY))


def test_a_segment_of_another_run_is_refused_naming_the_file(tmp_path):
    write(tmp_path, [(0, 1, b"x")])
    with pytest.raises(CheckpointError, match=r"rounds-00000000\.log belongs to another run"):
        list(read_rounds(tmp_path, {**IDENTITY, "shard": 1}))
    (tmp_path / "rounds-00000001.log").write_bytes(b"not a log at all")
    with pytest.raises(CheckpointError, match="is not a ddiloco round log"):
        list(read_rounds(tmp_path, IDENTITY))


def test_a_resumed_synchronizer_replays_what_is_intact_and_refuses_a_log_with_a_gap(tmp_path, caplog):
    config = build_config(preset="tiny", overrides=("run.learners=2",))
    first = SyncService(config, ServiceOptions(state_dir=tmp_path))
    codec = get_codec(first.protocol.downlink_codec, block_size=first.protocol.block_size)
    start = first.core.value(0).clone()
    updates = [codec.encode(torch.full((start.numel(),), 0.01 * v)) for v in (1, 2, 3)]
    for version, update in enumerate(updates, 1):
        first.writer.round_log.append(0, version, False, update).result(timeout=30)
    first.writer.close()
    (_, file), = segments(tmp_path)
    file.write_bytes(file.read_bytes()[:-7])  # the last record cut short by a crash

    with caplog.at_level(logging.WARNING, logger="ddiloco.sync"):
        resumed = SyncService(config, ServiceOptions(state_dir=tmp_path, resume=Resume.REQUIRED))
    assert resumed.core.versions()[0] == 2 and resumed.writer.replayed == 2
    expected = start + codec.decode(updates[0], start.numel()) + codec.decode(updates[1], start.numel())
    assert torch.equal(resumed.core.value(0), expected)  # Θ: the sum of the updates sent, bit for bit
    assert sum("cut short or damaged" in r.getMessage() for r in caplog.records) == 1
    resumed.writer.round_log.append(0, 4, False, updates[2]).result(timeout=30)  # version 3 never logged: a gap
    resumed.writer.close()
    with pytest.raises(CheckpointError, match="from version 2 to 4"):
        SyncService(config, ServiceOptions(state_dir=tmp_path, resume=Resume.REQUIRED))


def test_a_record_names_the_steps_its_round_reached_and_a_first_format_segment_is_still_read(tmp_path):
    """Issue 56: a restart moves the learners' data positions as the logged merges did; a state
    directory written before records named them still resumes (its rounds reach nothing)."""
    log = RoundLog(tmp_path, IDENTITY)
    log.append(0, 1, False, b"a" * 10, (("learner-0", 12), ("learner-1", 9))).result(timeout=30)
    log.append(1, 1, True, b"b" * 7).result(timeout=30)
    log.close()
    assert [(r.payload, r.reached) for r in read_rounds(tmp_path, IDENTITY)] == [
        (b"a" * 10, (("learner-0", 12), ("learner-1", 9))), (b"b" * 7, ())]

    old = tmp_path / "old"
    old.mkdir()
    header = json.dumps(IDENTITY, sort_keys=True).encode()
    record = struct.Struct("<IIIQB")
    body = record.pack(5, 0, 2, 3, 0)[8:]
    crc = zlib.crc32(b"hello", zlib.crc32(body))
    (old / "rounds-00000000.log").write_bytes(FIRST_MAGIC + struct.pack("<I", len(header)) + header
                                              + record.pack(5, crc, 2, 3, 0) + b"hello")
    assert [(r.fragment, r.version, r.payload, r.reached) for r in read_rounds(old, IDENTITY)] == [(2, 3, b"hello", ())]


def test_a_resumed_synchronizer_resumes_each_learner_s_data_where_the_logged_rounds_reached(tmp_path):
    config = build_config(preset="tiny", overrides=("run.learners=2",))
    first = SyncService(config, ServiceOptions(state_dir=tmp_path))
    codec = get_codec(first.protocol.downlink_codec, block_size=first.protocol.block_size)
    for p in first.core.owned:  # every fragment's first round merged learner-0's steps up to 7 + p
        update = codec.encode(torch.zeros(first.core.value(p).numel()))
        first.writer.round_log.append(p, 1, False, update, (("learner-0", 7 + p), ("learner-1", 3))).result(timeout=30)
    first.writer.close()
    resumed = SyncService(config, ServiceOptions(state_dir=tmp_path, resume=Resume.REQUIRED))
    positions = [resumed.core.handle(Join(name, "a-new-process"), 0.0)[0].state.data_position
                 for name in ("learner-0", "learner-1", "learner-2")]
    assert positions == [7, 3, 0]  # the least step every fragment's rounds reached; nothing for a newcomer
    resumed.writer.close()
