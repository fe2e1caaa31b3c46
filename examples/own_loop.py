"""Your own PyTorch model and training loop as a Decoupled DiLoCo learner.

Nothing here comes from ddiloco but the three calls that make a loop a learner:
``save_initial_state`` (once, for the synchronizer), ``LearnerRuntime(...)`` around the loop
and ``runtime.step(tokens=...)`` after each optimizer step. The model is a byte-level GRU
language model whose output layer is tied to its input embedding. One script plays each
role of a run::

    python examples/own_loop.py init gru-init.safetensors
    ddiloco sync --init gru-init.safetensors --learners 2 --tokens 2000000
    python examples/own_loop.py learner --connect 127.0.0.1:7000 --id learner-0
    python examples/own_loop.py learner --connect 127.0.0.1:7000 --id learner-1

or, the synchronizer and both learners in one command that restarts a learner that crashes::

    ddiloco launch --learners 2 --init gru-init.safetensors --tokens 2000000 -- python examples/own_loop.py learner

``init`` and ``learner`` take the same model options (``--d-model``, ``--layers``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from byte_text import ByteBatches, learner_seed, load_bytes
from roles import Role, roles_parser, run_role
from torch import nn

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.learner.runtime import LearnerRuntime, save_initial_state

PROG = "own_loop.py"
VOCAB_SIZE = 256
"""Byte-level: token id = byte value."""


class ByteGRU(nn.Module):
    """Embedding -> GRU -> LayerNorm -> output layer that shares the embedding's weights."""

    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        if d_model < 1 or layers < 1:
            raise DdilocoError(f"need --d-model >= 1 and --layers >= 1, got {d_model} and {layers}")
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.gru = nn.GRU(d_model, d_model, num_layers=layers, batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        # nn.Embedding's N(0, 1) would make the tied head's first logits of size sqrt(d_model).
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        # Tied: one tensor, listed once by named_parameters() (as "embed.weight"). The
        # default embedding_names of save_initial_state (every nn.Embedding) finds it.
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, 256)`` for the byte after each position."""
        hidden, _ = self.gru(self.embed(ids))
        return self.head(self.norm(hidden))


def build_model(args: argparse.Namespace) -> ByteGRU:
    """The model the model options describe, randomly initialized."""
    return ByteGRU(args.d_model, args.layers)


def lm_loss(model: ByteGRU, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of a ``(batch, seq)`` batch."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1))


def init(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = build_model(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_initial_state(model, args.out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ByteGRU: {n_params:,} parameters; wrote {args.out}")
    print(f"serve it with: ddiloco sync --init {args.out} --learners 2 --tokens 2000000")


def learner(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.id = args.id or os.environ.get("DDILOCO_LEARNER_ID", "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.id} %(levelname)s %(message)s")
    model = build_model(args)
    batches = ByteBatches(load_bytes(args.text), batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=learner_seed(args.id, args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    token = args.token_file.read_text().strip() if args.token_file else os.environ.get("DDILOCO_TOKEN")
    steps, loss_sum, started = 0, 0.0, time.monotonic()
    # Joining downloads the global weights into `model`, replacing its random ones, and says where this
    # learner's data resumes: a restarted one skips the batches whose work already reached the global model.
    options = {"join_timeout_s": args.join_timeout, "on_data_position": batches.skip_to}
    # Under `ddiloco launch`, the address, id and token come from the environment it sets.
    runtime = (LearnerRuntime(model, args.connect, args.id, token=token, **options) if args.connect
               else LearnerRuntime.from_env(model, **options))
    with runtime:
        print(f"{args.id} resuming data at batch {runtime.data_position}", flush=True)
        while not runtime.should_stop and (args.max_steps is None or steps < args.max_steps):
            ids = batches.next()
            loss = lm_loss(model, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.step(tokens=ids.numel())  # merges global updates that arrived; never waits
            steps += 1
            loss_sum += loss.item()
            if steps % args.log_every == 0:
                print(f"{args.id} step {steps}: loss {loss_sum / args.log_every:.3f} "
                      f"({steps / (time.monotonic() - started):.1f} steps/s)", flush=True)
                loss_sum = 0.0
    print(f"{args.id} done after {steps} steps", flush=True)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """What defines the model: ``init`` and every learner must agree on these."""
    parser.add_argument("--d-model", type=int, default=128, help="embedding and GRU width (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="stacked GRU layers (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights (init), batch order (learner)")


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """The learner's only: a GRU has no context length, so ``init`` needs none."""
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default 128)")


def build_parser(prog: str = PROG, learner_role: Role = learner) -> argparse.ArgumentParser:
    """``init`` and ``learner`` (``fsdp_loop.py`` brings its own learner role for the same model)."""
    return roles_parser(prog, __doc__.splitlines()[0], add_model_options, init, learner_role, lr=3e-3,
                        data_options=add_data_options)


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
