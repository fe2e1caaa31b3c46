"""A learner meeting a newer synchronizer, whose protocol and configuration carry settings this
learner does not know: the learner says so in one line, naming the settings and both versions,
instead of dying on a TypeError from ``ProtocolConfig(**fields)``; it never registers."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from ddiloco import __version__
from ddiloco.cli import main
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime.auth import PROTOCOL_VERSION
from ddiloco.runtime.client import JoinResult, SyncClient
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.service import SyncService
from ddiloco.settings.config_sources import build_config
from ddiloco.workload.workload import Workload

CONFIG = build_config(preset="tiny", overrides=("run.learners=2",))


def join_result(protocol: dict, run: dict | None = None) -> JoinResult:
    header = pb.JoinHeader(protocol_json=json.dumps(protocol), run_json=json.dumps(run or CONFIG.to_dict()))
    return JoinResult(header=header, state=None)  # type: ignore[arg-type]


@pytest.fixture
def newer_sync(inproc_sync, monkeypatch):
    """An in-process synchronizer whose join replies carry a protocol setting this version lacks."""
    original = SyncService._header

    def newer(self, data_shard):
        header = original(self, data_shard)
        header.protocol_json = json.dumps({**json.loads(header.protocol_json), "zeta_s": 1.0})
        run = json.loads(header.run_json)
        run["protocol"]["zeta_s"] = 1.0
        header.run_json = json.dumps(run)
        return header

    monkeypatch.setattr(SyncService, "_header", newer)
    return inproc_sync(CONFIG)


def test_the_same_version_reads_the_synchronizers_protocol_and_configuration_back():
    sent = ProtocolConfig(period=7, merge="rda-median", lease_s=3.0)
    result = join_result(asdict(sent))
    assert ProtocolConfig(**result.protocol) == sent
    assert result.run_config == CONFIG.to_dict()


def test_settings_from_a_newer_synchronizer_are_one_line_naming_them_and_both_versions():
    with pytest.raises(ConfigError) as caught:
        join_result({**asdict(ProtocolConfig()), "zeta_s": 1.0, "adaptive_quorum": True}).protocol
    line = str(caught.value)
    assert "\n" not in line and line.startswith("version skew")
    assert "adaptive_quorum, zeta_s" in line and __version__ in line and f"wire protocol {PROTOCOL_VERSION}" in line
    newer_run = {**CONFIG.to_dict(), "scavenging": {"extra": 2}}
    newer_run["train"] = {**newer_run["train"], "warmup_tokens": 5}
    with pytest.raises(ConfigError, match=r"^version skew: .*configuration .*: scavenging, train\.warmup_tokens\. "):
        join_result(asdict(ProtocolConfig()), newer_run).run_config


def test_a_learner_runtime_meeting_a_newer_synchronizer_stops_with_that_line_and_holds_no_lease(newer_sync):
    with pytest.raises(ConfigError, match="^version skew: .*protocol .*: zeta_s"):
        LearnerRuntime(Workload.build(CONFIG).new_model(), f"127.0.0.1:{newer_sync.port}", "learner-0")
    with SyncClient(f"127.0.0.1:{newer_sync.port}") as client:
        assert client.status_dict()["learners"] == []


def test_the_learner_command_prints_it_as_one_line(newer_sync, capsys):
    code = main(["learner", "--connect", f"127.0.0.1:{newer_sync.port}", "--id", "learner-0", "--join-timeout", "30"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("ddiloco: error: version skew") and err.count("\n") == 1 and "protocol.zeta_s" in err
