"""Issue 25's stalled-upload attack against a live run, measured.

Starts a real ``ddiloco sync --preset tiny --learners 2`` (a budget it cannot spend) and two real
learners on loopback; once they merge, a member with the shared token registers, keeps its lease
with heartbeats and for ``STALL_S`` keeps 100 ``Contribute`` streams open from the same host,
reopening each one the server closes: a third under its own session, a third under a forged one,
a third without a header, each sending its header (if any) and then nothing. Prints the fragment
versions the honest learners merged during the stall, the rejections by reason, goodput and the
honest learners' refused steps (issue 42: the member's own are kept apart). ``--json FILE``
writes them, stamped.

    PYTHONPATH=src python benchmarks/bench_sync_stall.py [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
from stamp import load_now, stamp

from ddiloco.core.shared.messages import Heartbeat, Join, Progress, Session
from ddiloco.core.sync_side.refusals import honest_learner_steps
from ddiloco.runtime import wire
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.testing import Procs, free_port, learner_args, status_of, sync_args, wait_for

STALL_S = 30.0
STREAMS = 100
MEMBER = "mallory"


def stall(address: str, session: Session, i: int, stop: threading.Event) -> None:
    """One stalled stream after another until ``stop``."""
    named = {0: wire.session_to_pb(session),
             1: pb.Session(incarnation=session.incarnation, number=session.number + 1 + i)}

    def chunks():
        if i % 3 in named:
            yield pb.ContributionChunk(header=pb.ContributionHeader(
                learner_id=MEMBER, fragment=i % 3, seq=i, tokens=1, steps=1, codec="int4", payload_bytes=2000,
                session=named[i % 3]))
        stop.wait(60)

    with SyncClient(address) as client:
        while not stop.is_set():
            try:
                client.stub.Contribute(chunks(), metadata=client.metadata, timeout=60)
            except grpc.RpcError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    started = stamp(__file__)
    port = free_port()
    procs = Procs(Path(tempfile.mkdtemp(prefix="bench_sync_stall-")))
    procs.start("sync", *sync_args(port, "--set", "run.tokens=1000000000"))
    try:
        wait_for(lambda: status_of(port), "the synchronizer")
        for i in range(2):
            procs.start(f"l{i}", *learner_args(port, f"learner-{i}"))
        wait_for(lambda: (s := status_of(port)) and min(f["version"] for f in s["fragments"]) >= 2, "merges", 180)
        address = f"127.0.0.1:{port}"
        member = SyncClient(address)
        session = member.join(Join(MEMBER, "mb")).state.session
        stop = threading.Event()

        def heartbeats() -> None:
            while not stop.wait(0.3):
                try:
                    member.heartbeat(Heartbeat(MEMBER, session, Progress("mb")))
                except Exception:  # noqa: BLE001 (a refused heartbeat changes nothing here)
                    pass

        before = [f["version"] for f in status_of(port)["fragments"]]
        with concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
            pool.submit(heartbeats)
            for i in range(STREAMS):
                pool.submit(stall, address, session, i, stop)
            time.sleep(STALL_S)
            after = status_of(port)
            stop.set()
        merged = [f["version"] - v for f, v in zip(after["fragments"], before)]
        honest = honest_learner_steps(after["learners"], hostile=[MEMBER])
        figures = {"stall_s": STALL_S, "streams": STREAMS, "versions_merged": merged,
                   "rejections": after["rejections"],
                   "rejected_per_learner": {lr["id"]: lr["rejected"] for lr in after["learners"]},
                   "refused_steps_per_learner": {lr["id"]: lr["refused_steps"] for lr in after["learners"]},
                   "goodput": after["goodput"], "honest_refused_steps": honest}
        print(f"stall {STALL_S:.0f} s: versions merged per fragment {merged}, {sum(merged)} in all")
        print("rejections", after["rejections"])
        print("rejected per learner", figures["rejected_per_learner"])
        print(f"goodput {after['goodput']:.1%}, honest steps refused {honest:,} (the member's left out)")
        if args.json:
            Path(args.json).write_text(json.dumps({**started, "load_at_end": load_now(), **figures}, indent=2) + "\n")
    finally:
        procs.kill_all()


if __name__ == "__main__":
    main()
