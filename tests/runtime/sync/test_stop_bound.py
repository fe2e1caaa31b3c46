"""Issue 59: every wait of the synchronizer's stop is bounded (``runtime/sync/shutdown.py``).

A disk that stops answering holds the round log's fsync and with it the final checkpoint: the stop
gives up on both within its bound, names them, and the process would exit non-zero (``serve``)."""

from __future__ import annotations

import threading

from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.sync import server
from ddiloco.runtime.sync.round_log import RoundLog
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import Honest, InProcessSync, versions, wait_for

BOUND_S = 3.0


def test_a_stop_whose_disk_hangs_ends_within_its_bound_and_names_what_it_gave_up(tmp_path, monkeypatch):
    config = build_config(preset="tiny", overrides=("run.learners=1", "run.tokens=1000000000",
                                                    "protocol.lease_s=2.0", "protocol.heartbeat_s=0.3"))
    monkeypatch.setattr(server, "stop_deadline_s", lambda state_bytes: BOUND_S)
    s = InProcessSync(config, ServiceOptions(state_dir=tmp_path / "state"))
    honest = Honest(config, s.port, "learner-0", 0)
    try:
        with SyncClient(f"127.0.0.1:{s.port}") as client:
            start = versions(client)
            wait_for(lambda: min(v - v0 for v, v0 in zip(versions(client), start)) >= 1, "a merge")
        entered, hung, flush = threading.Event(), threading.Event(), RoundLog._flush
        log = s.service.writer.round_log

        def hanging_flush(self: RoundLog) -> None:
            if self is log:
                entered.set()
                hung.wait()  # the disk never answers again (released at the end of the test)
            flush(self)

        monkeypatch.setattr(RoundLog, "_flush", hanging_flush)
        assert entered.wait(60), "no round was logged after the disk hung"
        s.close()  # sets the server's closing event, as SIGTERM does; joins the loop's thread (30 s at most)
        assert not s.thread.is_alive()
        assert "the final checkpoint" in s.service.stop_missed and "the round log's last fsync" in s.service.stop_missed
    finally:
        hung.set()
        honest.close()
