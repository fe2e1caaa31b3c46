"""A user's script whose inner steps take about a millisecond (a small MLP): issue 57's learner.

``python fast_steps.py init FILE`` writes the initial weights; ``python fast_steps.py learner`` trains
as the copy ``ddiloco launch`` started (``LearnerRuntime.from_env``) until the run's budget is
spent, on random regression data: one task for every copy (as shards of one corpus are), each
copy's own samples drawn by its data shard. (A target per shard made the copies' tasks disagree:
one that started late under load found the global model fitted to the other's and sent outer
gradients a hundred times the fragment's median, which the norm bound refuses.) No logging is configured, as in a
script that never thought of it: what the runtime warns about reaches stderr all the same.
``FAST_STEPS_PAD_S`` in the environment pads every step to at least that long (a test of what is said
about refused work needs the refusals, not the speed).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from ddiloco.runtime.learner.runtime import LearnerRuntime, save_initial_state

BATCH = 16
WIDTH = 32


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))


def learner() -> None:
    torch.set_num_threads(1)
    model = build_model()
    target = torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(int(os.environ.get("DDILOCO_DATA_SHARD", "0")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 0
    pad_s = float(os.environ.get("FAST_STEPS_PAD_S", "0"))
    with LearnerRuntime.from_env(model, tokens_per_step=BATCH) as runtime:
        while not runtime.should_stop:
            started = time.perf_counter()
            x = torch.randn(BATCH, WIDTH, generator=g)
            loss = nn.functional.mse_loss(model(x), x @ target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.step(tokens=BATCH)
            steps += 1
            # The script's own step time (a slower device, as --min-step-s pads ddiloco's learner), not a wait.
            time.sleep(max(0.0, pad_s - (time.perf_counter() - started)))
    print(f"done after {steps} steps", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "init":
        save_initial_state(build_model(), sys.argv[2])
    else:
        learner()
