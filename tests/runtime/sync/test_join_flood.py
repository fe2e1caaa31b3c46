"""Issues 53 and 59 on real processes: a member holding the run's token opens joins by the
thousand and abandons each after its first reply, while two honest learners train.

Before the fix the round log's thread died of the first abandoned join whose barrier it resolved
(``round_log._settle``): no update, state transfer or checkpoint went out again, the honest
learners were held in a join loop for good, and a SIGTERM waited for ever on the final checkpoint.
"""

from __future__ import annotations

import re
import signal
import threading

import pytest

from ddiloco.core.shared.deadlines import stop_deadline_s
from ddiloco.testing import DEADLINE_S, Procs, free_port, learner_args, status_of, sync_args, wait_for

FLOOD_JOINS = 1500
PACE = ("--min-step-s", "0.02")
"""The learners' steps padded to 20 ms: the flood, not their speed, is under test, and spinning they
take the cores the synchronizer and the rest of the suite run on."""
STOPPED = re.compile(r"final checkpoint written to \S+ at fragment versions (\[[\d, ]+\])")
RESUMED = re.compile(r"resumed from \S+: fragment versions (\[[\d, ]+\])")


def versions(port: int) -> list[int] | None:
    s = status_of(port)
    return None if s is None else [f["version"] for f in s["fragments"]]


@pytest.mark.slow
def test_a_flood_of_abandoned_joins_stops_neither_the_merges_nor_a_rejoin_nor_the_stop(tmp_path):
    port, procs, state = free_port(), Procs(tmp_path), tmp_path / "state"
    run = sync_args(port, "--time", "900", "--state-dir", str(state))
    try:
        sync = procs.start("sync", *run)
        for i in range(2):
            procs.start(f"learner-{i}", *learner_args(port, f"learner-{i}", *PACE))
        wait_for(lambda: (s := status_of(port)) and sum(lr["alive"] for lr in s["learners"]) == 2, "both learners")
        before = wait_for(lambda: versions(port), "the first status")
        wait_for(lambda: min(v - b for v, b in zip(versions(port), before)) >= 2, "merges before the flood")

        started, ended = threading.Event(), {}
        flood = threading.Thread(target=lambda: ended.update(join_flood(f"127.0.0.1:{port}", FLOOD_JOINS,
                                                                        started=started)))
        flood.start()
        assert started.wait(DEADLINE_S)
        procs.kill9("learner-1")  # an honest learner dies during the flood, and its operator restarts it
        procs.start("learner-1", *learner_args(port, "learner-1", *PACE))
        flood.join(timeout=4 * DEADLINE_S)
        assert not flood.is_alive() and sum(ended.values()) == FLOOD_JOINS and ended.get("abandoned"), ended

        after = versions(port)
        wait_for(lambda: min(v - a for v, a in zip(versions(port), after)) >= 3, "merges after the flood")
        s = wait_for(lambda: (s := status_of(port)) and {lr["id"]: lr for lr in s["learners"]}.get("learner-1", {})
                     .get("registrations", 0) >= 2 and s, "learner-1's restart to rejoin")
        assert s["honest_refused_steps"] == 0

        sync.send_signal(signal.SIGTERM)
        bound_s = stop_deadline_s(4 * 10**6)  # far more than the tiny preset's state
        assert sync.wait(timeout=bound_s) == 0, procs.log("sync")[-2000:]
        stopped = STOPPED.search(procs.log("sync"))
        assert stopped, procs.log("sync")[-2000:]

        resumed = procs.start("sync-resumed", *run, "--resume")
        found = wait_for(lambda: RESUMED.search(procs.log("sync-resumed")), "the resumed synchronizer's first line")
        assert found.group(1) == stopped.group(1)  # nothing merged was lost across the stop
        wait_for(lambda: status_of(port), "the resumed synchronizer to serve")  # its SIGTERM handler is set
        resumed.send_signal(signal.SIGTERM)
        assert resumed.wait(timeout=bound_s) == 0
    finally:
        procs.kill_all()


def join_flood(address: str, joins: int, *, at_once: int = 8, token: str | None = None,
               started: threading.Event | None = None) -> dict[str, int]:
    """``joins`` Join calls under distinct ids, ``at_once`` at a time, each cancelled after its first
    reply (a member holding the run's token that abandons every join): what each call ended with,
    counted. ``started`` is set once a tenth of them have been made."""
    import asyncio
    import collections

    import grpc

    from ddiloco.runtime.auth import client_metadata
    from ddiloco.runtime.proto import ddiloco_pb2 as pb
    from ddiloco.runtime.sync.service import SERVICE_NAME

    ended: collections.Counter[str] = collections.Counter()
    metadata = client_metadata(token)

    async def flood() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            join = channel.unary_stream(f"/{SERVICE_NAME}/Join", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
            gate = asyncio.Semaphore(at_once)

            async def one(i: int) -> None:
                async with gate:
                    call = join(pb.JoinRequest(learner_id=f"flood-{i}", boot=f"f{i}").SerializeToString(),
                                timeout=DEADLINE_S, metadata=metadata)
                    try:
                        async for _ in call:
                            call.cancel()
                            break
                        ended["abandoned"] += 1
                    except grpc.aio.AioRpcError as err:
                        ended[err.details().split(":")[0]] += 1
                    except asyncio.CancelledError:
                        ended["abandoned"] += 1
                    if started is not None and sum(ended.values()) >= joins // 10:
                        started.set()

            await asyncio.gather(*(one(i) for i in range(joins)))

    asyncio.run(flood())
    return dict(ended)
