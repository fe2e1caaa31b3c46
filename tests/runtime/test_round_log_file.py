"""The round log's file format: records come back in order, a torn or damaged tail ends the
log where it is damaged (said in one line), and a segment of another run is refused."""

from __future__ import annotations

import logging

import pytest

from ddiloco.runtime.checkpoint import CheckpointError
from ddiloco.runtime.sync.round_log import RoundLog, read_rounds, segments

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
    log.append(0, 2, False, b"").result(timeout=30)
    assert [r.version for r in read_rounds(tmp_path, IDENTITY)] == [1, 1, 2]
    assert [(r.fragment, r.plain, r.payload) for r in read_rounds(tmp_path, IDENTITY, second)] == \
        [(1, True, b"b" * 7), (0, False, b"")]
    log.drop_before(second)
    assert [n for n, _ in segments(tmp_path)] == [second]
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


def test_a_segment_of_another_run_is_refused_naming_the_file(tmp_path):
    write(tmp_path, [(0, 1, b"x")])
    with pytest.raises(CheckpointError, match=r"rounds-00000000\.log belongs to another run"):
        list(read_rounds(tmp_path, {**IDENTITY, "shard": 1}))
    (tmp_path / "rounds-00000001.log").write_bytes(b"not a log at all")
    with pytest.raises(CheckpointError, match="is not a ddiloco round log"):
        list(read_rounds(tmp_path, IDENTITY))
