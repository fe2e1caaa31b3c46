"""A Hugging Face causal LM, trained as a Decoupled DiLoCo learner in its own training loop.

The model is built from a ``transformers`` config with random weights: nothing is
downloaded (no hub weights, no tokenizer: every byte of a local text is a token, vocabulary
256). One script plays each role of a run::

    python examples/hf_causal_lm.py init gpt2-init.safetensors        # once, anywhere
    ddiloco sync --init gpt2-init.safetensors --learners 2 --tokens 2000000
    python examples/hf_causal_lm.py learner --connect 127.0.0.1:7000 --id learner-0
    python examples/hf_causal_lm.py learner --connect 127.0.0.1:7000 --id learner-1

or all three in one command (``ddiloco launch``), then the trained model as a Hugging Face folder::

    ddiloco launch --learners 2 --init gpt2-init.safetensors --tokens 2000000 -- python examples/hf_causal_lm.py learner
    ddiloco export runs/launch/sync-state --init gpt2-init.safetensors --hf gpt2-trained/

``init`` and ``learner`` must be given the same model options (``--arch``, sizes,
``--untied-head``): the synchronizer serves the parameters of the model ``init`` saved, and a
learner whose model has other parameters is refused before it trains. A learner's own
random initialization does not matter: it adopts the synchronizer's weights when it joins.

Tied weights: GPT-2 (and Llama with ``tie_word_embeddings``) share one tensor between the
input embedding and ``lm_head``; ``named_parameters()`` lists it once, under the embedding's
name, and that is the only name the synchronizer serves. See docs/own-models.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never touch the hub

import argparse
import logging
import sys
import time

import torch
import torch.nn.functional as F
from byte_text import ByteBatches, learner_seed, load_bytes
from roles import roles_parser, run_role
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.learner.runtime import LearnerRuntime, save_initial_state

PROG = "hf_causal_lm.py"
VOCAB_SIZE = 256
"""Byte-level: token id = byte value."""


def build_model(args: argparse.Namespace) -> PreTrainedModel:
    """A randomly initialized causal LM of the chosen architecture and size."""
    sizes = {"--d-model": args.d_model, "--layers": args.layers, "--heads": args.heads, "--seq-len": args.seq_len}
    for option, value in sizes.items():
        if value < 1:
            raise DdilocoError(f"{option} must be >= 1, got {value}")
    if args.d_model % args.heads:
        raise DdilocoError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.arch == "gpt2":
        if args.untied_head:
            raise DdilocoError("--untied-head applies to --arch llama (GPT-2 always ties its head)")
        # No dropout: a model that sees each byte window about once has nothing to regularize.
        config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=args.seq_len, n_embd=args.d_model,
                            n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=not args.untied_head, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config)


def embedding_names(model: nn.Module) -> list[str]:
    """The token embedding's name in ``named_parameters()`` (which also covers a tied head).

    Passed to ``save_initial_state`` explicitly: its default takes every ``nn.Embedding``,
    which for GPT-2 would add the learned position embedding ``transformer.wpe`` — a dense
    tensor that every step updates, better merged by RDA like the other dense weights.
    """
    token_embedding = model.get_input_embeddings().weight
    return [name for name, p in model.named_parameters() if p is token_embedding]


def lm_loss(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of a ``(batch, seq)`` batch."""
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1))


def init(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = build_model(args)
    names = embedding_names(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_initial_state(model, args.out, embedding_names=names)
    n_params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    print(f"{args.arch}: {n_params:,} parameters ({'tied' if tied else 'untied'} head), "
          f"embedding fragment {names}; wrote {args.out}")
    print(f"serve it with: ddiloco sync --init {args.out} --learners 2 --tokens 2000000")


def learner(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.id = args.id or os.environ.get("DDILOCO_LEARNER_ID", "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.id} %(levelname)s %(message)s")
    model = build_model(args)
    model.train()
    batches = ByteBatches(load_bytes(args.text), batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=learner_seed(args.id, args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
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
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="architecture (default gpt2)")
    parser.add_argument("--untied-head", action="store_true", help="llama: lm_head its own tensor, not the embedding")
    parser.add_argument("--d-model", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="context length in bytes (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights (init), batch order (learner)")


def build_parser() -> argparse.ArgumentParser:
    return roles_parser(PROG, __doc__.splitlines()[0], add_model_options, init, learner, lr=1e-3)


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
