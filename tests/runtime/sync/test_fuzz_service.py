"""Issue 16: ten thousand generated messages across every RPC against a live service.

A seeded mutation fuzzer speaks as a member holding per-learner credentials (mallory), as the
shared token, with wrong or no credentials and in another protocol version; it names the
honest learners, itself and made-up ids, uses boundary numbers for every counter and index,
real and forged sessions, payloads of the right size and of the wrong one, and flips,
truncates and extends the serialized bytes. Two honest learners train all along. Nothing may
end a call with an unhandled error, the core host must keep ticking, memory and ledgers stay
bounded, and every merge carries only work the honest learners (or mallory, for herself) sent.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import random
import struct
from typing import Any, Callable

import grpc
import pytest
import torch

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Join
from ddiloco.runtime.auth import client_metadata
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.service import SERVICE_NAME, ServiceOptions
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import Honest, versions, wait_for

MESSAGES = 10_000
SEED = 16
CREDENTIALS = {"learner-0": "s0", "learner-1": "s1", "mallory": "sm"}
TOKEN = "operators"
BOUNDARY = [0, 1, 2, 7, 255, 2**31 - 1, 2**32, 2**48, 2**48 + 1, 2**62 - 1, 2**63, 2**64 - 1]
UNHANDLED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Fuzzer:
    """Draws one call at a time from a seeded generator: (RPC, request bytes or chunks, metadata)."""

    def __init__(self, rng: random.Random, incarnation: int, mallory: pb.Session, fragments: list[int]) -> None:
        self.rng = rng
        self.incarnation = incarnation
        self.mallory = mallory
        self.fragments = fragments
        self.int4 = get_codec("int4")

    def number(self) -> int:
        return self.rng.choice(BOUNDARY) if self.rng.random() < 0.5 else self.rng.randrange(0, 1000)

    def learner(self) -> str:
        return self.rng.choice(["mallory", "mallory", "learner-0", "learner-1", "ghost", "x" * 200, "", "a b"])

    def session(self) -> pb.Session:
        r = self.rng.random()
        if r < 0.5:
            return self.mallory
        if r < 0.8:
            return pb.Session(incarnation=self.incarnation, number=self.number())
        return pb.Session(incarnation=self.number(), number=self.number())

    def progress(self) -> pb.Progress:
        return pb.Progress(boot=self.rng.choice(["mb", "other", ""]), tokens=self.number(), steps=self.number())

    def metadata(self) -> tuple:
        r = self.rng.random()
        if r < 0.7:
            return client_metadata("sm", "mallory")
        if r < 0.8:
            return client_metadata(TOKEN)
        if r < 0.85:
            return client_metadata("wrong", self.rng.choice(["learner-0", "mallory", "ghost"]))
        if r < 0.9:
            return client_metadata(None)
        return (("ddiloco-protocol", str(self.rng.choice([1, 3, 99]))), ("authorization", "Bearer sm"),
                ("ddiloco-learner", "mallory"))

    def payload(self, fragment: int) -> bytes:
        numel = self.fragments[fragment % len(self.fragments)]
        r = self.rng.random()
        if r < 0.4:
            scale = self.rng.choice([1e-4, 1e-2, 1.0, 1e30, float("nan"), float("inf")])
            if math.isfinite(scale):
                return self.int4.encode(torch.full((numel,), scale))
            return struct.pack("<f", scale) + self.int4.encode(torch.ones(numel))[4:]  # a non-finite block scale
        good = len(self.int4.encode(torch.zeros(numel)))
        size = self.rng.choice([good, good - 1, good + 1, 0, 3])
        return self.rng.randbytes(max(size, 0))

    def mutate(self, data: bytes) -> bytes:
        if not data or self.rng.random() < 0.85:
            return data
        b = bytearray(data)
        for _ in range(self.rng.randint(1, 4)):
            op = self.rng.random()
            if op < 0.5 and b:
                b[self.rng.randrange(len(b))] ^= 1 << self.rng.randrange(8)
            elif op < 0.8 and b:
                del b[self.rng.randrange(len(b)):]
            else:
                b += self.rng.randbytes(self.rng.randint(1, 16))
        return bytes(b)

    def draw(self) -> tuple[str, Any, tuple]:
        rpc = self.rng.choice(["Join", "Join", "Heartbeat", "Contribute", "Contribute", "Contribute", "Updates",
                               "FetchState", "Leave", "Status"])
        meta = self.metadata()
        if rpc == "Join":
            msg = pb.JoinRequest(learner_id=self.learner(), boot=self.rng.choice(["mb", "m2", ""]),
                                 probe=self.rng.random() < 0.3, tokens_per_step=self.rng.choice([0, 256, 2**24, 2**25]))
        elif rpc == "Heartbeat":
            msg = pb.HeartbeatRequest(learner_id=self.learner(), session=self.session(), progress=self.progress())
        elif rpc == "Leave":
            msg = pb.LeaveRequest(learner_id=self.learner(), session=self.session(), progress=self.progress())
        elif rpc == "Updates":
            msg = pb.UpdatesRequest(learner_id=self.learner(), session=self.session(),
                                    have_versions=[self.number() for _ in range(self.rng.randint(0, 5))])
        elif rpc == "FetchState":
            msg = pb.FetchStateRequest()
        elif rpc == "Status":
            msg = pb.StatusRequest(learner_offset=self.number(), learner_limit=self.number())
        else:
            return rpc, self.chunks(), meta
        return rpc, self.mutate(msg.SerializeToString()), meta

    def chunks(self) -> list[bytes]:
        fragment = self.rng.choice([0, 1, 2, 3, 99, 2**31])
        data = self.payload(fragment)
        header = pb.ContributionHeader(
            learner_id=self.learner(), session=self.session(), fragment=fragment, base_version=self.number(),
            seq=self.number(), tokens=self.number(), steps=self.number(),
            compute_s=self.rng.choice([0.01, -1.0, 1e300, float("nan")]),
            step_time_s=self.rng.choice([0.01, 0.0, 1e9]), codec=self.rng.choice(["int4", "int4", "fp32", ""]),
            payload_bytes=self.rng.choice([len(data), len(data) + 1, 2**40]), first_step=self.number(),
            progress=self.progress())
        split = self.rng.randint(0, len(data))
        chunks = [pb.ContributionChunk(header=header, data=data[:split])]
        if self.rng.random() < 0.7:
            chunks.append(pb.ContributionChunk(offset=self.rng.choice([split, split + 1, 0]), data=data[split:]))
        if self.rng.random() < 0.05:
            chunks.append(pb.ContributionChunk(header=header))
        return [self.mutate(c.SerializeToString()) for c in chunks]


def call(channel: grpc.Channel, rpc: str, request: Any, metadata: tuple) -> grpc.StatusCode:
    path = f"/{SERVICE_NAME}/{rpc}"
    try:
        if rpc == "Contribute":
            channel.stream_unary(path)(iter(request), metadata=metadata, timeout=30)
        elif rpc in ("Join", "FetchState", "Updates"):
            stream = channel.unary_stream(path)(request, metadata=metadata, timeout=2 if rpc == "Updates" else 30)
            for _ in stream:
                pass
        else:
            channel.unary_unary(path)(request, metadata=metadata, timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
def test_ten_thousand_generated_messages_crash_nothing_and_change_the_model_only_through_its_members(inproc_sync):
    config = build_config(preset="tiny", overrides=("run.learners=2", "run.tokens=1000000000", "protocol.lease_s=2.0",
                                                   "protocol.heartbeat_s=0.3"))
    s = inproc_sync(config, ServiceOptions(token=TOKEN, credentials=CREDENTIALS))
    service = s.service
    merged_by: collections.Counter[str] = collections.Counter()
    on_round: Callable = service.records.on_round

    def watch(record, elapsed_s):  # every merge, with whose work it carried
        merged_by.update(m.learner_id for m in record.merged)
        on_round(record, elapsed_s)

    service.records.on_round = watch
    address = f"127.0.0.1:{s.port}"
    honest = [Honest(config, s.port, f"learner-{m}", m, secret=CREDENTIALS[f"learner-{m}"]) for m in range(2)]
    with SyncClient(address, token="sm", learner_id="mallory") as mallory:
        session = mallory.join(Join("mallory", "mb")).state.session
    fuzzer = Fuzzer(random.Random(SEED), service.incarnation,
                    pb.Session(incarnation=session.incarnation, number=session.number),
                    [f.numel for f in service.layout.plan.fragments])
    calls = [fuzzer.draw() for _ in range(MESSAGES)]
    rss_before = rss_bytes()
    channels = [grpc.insecure_channel(address) for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        codes = list(pool.map(lambda i: call(channels[i % 4], *calls[i]), range(MESSAGES)))
    for channel in channels:
        channel.close()
    rss_growth = rss_bytes() - rss_before
    outcomes = collections.Counter(code.name for code in codes)
    print(f"fuzz outcomes over {MESSAGES} messages: {dict(outcomes)}; RSS growth {rss_growth / 2**20:.1f} MiB")

    assert sum(outcomes.values()) == MESSAGES and not UNHANDLED & set(codes), outcomes
    assert not service.host.crashed.is_set()
    assert rss_growth < 300 * 2**20
    assert set(merged_by) <= {"learner-0", "learner-1", "mallory"}, merged_by
    with SyncClient(address, token=TOKEN) as operator:
        start = versions(operator)
        wait_for(lambda: min(v - v0 for v, v0 in zip(versions(operator), start)) >= 1, "honest merges after the fuzz")
        for h in honest:
            h.close()
        status = operator.status_dict()
    accepted = {lr["id"]: lr["accepted"] for lr in status["learners"]}
    for m, h in enumerate(honest):  # nothing the fuzzer sent was taken as theirs
        assert accepted[f"learner-{m}"] == h.runtime.stats.contributions_sent
    assert status["learners_total"] <= 4 * config.run.learners
    assert len(service.ledger.counts) <= 2 * (status["learners_total"] + 2) * (len(service.layout.plan.fragments) + 1)
