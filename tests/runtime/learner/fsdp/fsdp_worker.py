"""A small FSDP2 learner for the sharded-learner tests: ``init FILE`` writes its initial weights;
under ``torchrun``, ``learn PORT ID STEPS OUT`` trains it against ``ddiloco sync`` and each rank writes
``OUT/rank{r}.pt``: its fragments' slices (ranges), anchors and versions, just before it closes (and
rank 0 the synchronizer's global model then, ``OUT/global.pt``).
``--kill-at STEP``: rank 1 of the first incarnation kills itself (SIGKILL) at that step;
``--kill-helper-at STEP``: rank 1 kills its link helper process (SIGKILL) at that step.
``same PORT ID STEPS SEED``: the equivalence runs' learner, sharded under torchrun (rank r trains
batch r) or unsharded alone (both batches at once), which leaves without a flush after STEPS."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.shared.messages import GlobalState
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.learner.ranks import init_group, leave_group
from ddiloco.runtime.learner.runtime import LearnerRuntime, save_initial_state

BATCH = 8


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 7), nn.Tanh(), nn.Linear(7, 12))


def link_helpers() -> list[int]:
    """The pids of this process's link helpers (its children running ``ddiloco.runtime.learner.helper``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid():  # its parent
                continue
            if b"ddiloco.runtime.learner.helper" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return found


MORE_STEPS = 20_000
"""With ``--kill-helper-at``, the ranks train on past STEPS until every fragment merged since the kill
(a slice lost with the helper holds its fragment's next send up to a lease), at most this many steps."""


def merged_since(versions: list[int], before: list[int]) -> bool:
    return all(v > b for v, b in zip(versions, before))


def learn(port: str, learner_id: str, steps: int, out: Path, kill_at: int | None, kill_helper_at: int | None) -> None:
    init_group("gloo")
    rank = dist.get_rank()
    model = build()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = LearnerRuntime(model, f"127.0.0.1:{port}", learner_id, tokens_per_step=BATCH, join_timeout_s=60)
    g = torch.Generator().manual_seed(1000 * rank + runtime.data_position)
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    at_kill: list[int] = []
    step = 0
    while step < steps or (at_kill and not merged_since(runtime.versions, at_kill) and step < MORE_STEPS):
        if runtime.should_stop:
            break
        x = torch.randn(BATCH, 12, generator=g)
        loss = ((model(x) - x.flip(1)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        runtime.step(tokens=BATCH)
        if kill_at is not None and first and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run: slices of this rank may be on their way
        if kill_helper_at is not None and step == kill_helper_at:
            at_kill = runtime.versions  # the same on every rank: their cores apply the same updates at one step
        if kill_helper_at is not None and rank == 1 and step == kill_helper_at:
            (killed,) = link_helpers()
            os.kill(killed, signal.SIGKILL)  # its calls in flight go unanswered; a new helper takes over
            deadline = time.monotonic() + 120.0
            while (helper := runtime.link.calls.helper) is None or helper.pid == killed:  # the new one is up
                assert time.monotonic() < deadline, "no new link helper in 120 s"
                time.sleep(0.05)  # a bounded poll: the link's relay thread starts the new helper and signals no one
        step += 1
    core = runtime.core
    state = settled(runtime, port)
    if rank == 0:  # the global model now, before the flush of close() moves it on
        torch.save({"versions": list(state.versions()), "values": [f.values for f in state.fragments]},
                   out / "global.pt")
    torch.save({"ranges": [s.ranges for s in runtime.slices], "versions": list(core.versions),
                "anchors": [core.anchor(p).clone() for p in range(len(core.versions))],
                "bytes_up": runtime.bytes_up, "bytes_down": runtime.bytes_down, "next_deadline": core.next_deadline(),
                "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "helpers": link_helpers(),
                "versions_at_kill": at_kill},
               out / f"rank{rank}.pt")
    runtime.close()
    leave_group()


def same(port: str, learner_id: str, steps: int, seed: int) -> None:
    """Under torchrun each rank trains its own batch of BATCH; alone, one process trains both ranks'
    batches as one of 2 x BATCH: the same gradient, summed in another order. Synchronous DiLoCo
    ends each step once what it sent is merged, so leaving without a flush ends the run at a point
    that does not depend on timing."""
    sharded = "RANK" in os.environ
    if sharded:
        init_group("gloo")
    ranks = [dist.get_rank()] if sharded else [0, 1]
    model = build()
    if sharded:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = BATCH * len(ranks)
    runtime = LearnerRuntime(model, f"127.0.0.1:{port}", learner_id, tokens_per_step=tokens, join_timeout_s=60)
    batches = [torch.Generator().manual_seed(seed + 1000 * r + runtime.data_position) for r in ranks]
    for _ in range(steps):
        x = torch.cat([torch.randn(BATCH, 12, generator=g) for g in batches])
        loss = ((model(x) - x.flip(1)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        runtime.step(tokens=tokens)
    runtime.close(flush=False)
    if sharded:
        leave_group()


def settled(runtime: LearnerRuntime, port: str) -> GlobalState:
    """The global state (rank 0's fetch; the others get its versions) once the ranks' cores hold some
    fragment at its version: the last rounds' updates reach the cores an exchange after they arrive, so
    idle steps pass (at most ~10 s) until one has. No exchange between the fetch and the ranks' record."""
    for _ in range(100):
        state = None
        if dist.get_rank() == 0:
            with SyncClient(f"127.0.0.1:{port}") as client:
                state = client.fetch_state()
        box = [None if state is None else list(state.versions())]
        dist.broadcast_object_list(box, src=0)
        if any(v == g for v, g in zip(runtime.core.versions, box[0])):
            break
        time.sleep(0.1)
        runtime.step(tokens=BATCH)  # an exchange (a step without training: a step of 0 tokens is refused)
    return state


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1)  # a test that times out has every rank print its threads' stacks
    try:
        if argv[0] == "init":
            save_initial_state(build(), argv[1])
        elif argv[0] == "same":
            same(argv[1], argv[2], int(argv[3]), int(argv[4]))
        else:
            flags = dict(zip(argv[5::2], map(int, argv[6::2])))
            learn(argv[1], argv[2], int(argv[3]), Path(argv[4]), flags.get("--kill-at"), flags.get("--kill-helper-at"))
    except DdilocoError as err:
        print(f"fsdp_worker.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
