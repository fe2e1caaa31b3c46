"""The examples in examples/, run as a user runs them: real processes on 127.0.0.1.

For each example: its ``init`` role writes the initial weights, ``ddiloco sync --init``
serves them, two learner processes of the example train until the synchronizer's token
budget is spent, and the global model they leave behind differs from the initial one and
predicts bytes better. Then what the Hugging Face example serves for tied and untied heads,
and how a learner with a model the synchronizer does not serve is refused. Waits poll with
a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.core.shared.fragments import unflatten_into
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import SERVE_YOUR_MODEL, layout_from_file
from ddiloco.testing import SyncProcess, free_port, status_of, wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE_S = 120.0
"""Bound on any wait: generous on a loaded 2-core machine, never a timing claim."""
STEP_TOKENS = 8 * 32
"""One inner step of the examples' learners here: 8 sequences of 32 bytes."""
MAX_STEPS = 40
"""Each learner leaves after this many steps at the latest ..."""
BUDGET_TOKENS = 60 * STEP_TOKENS
"""... so one learner alone cannot spend the budget: it is spent only once both have trained
(however late one of them starts), and then the synchronizer tells them to stop."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Example:
    script: str
    model_options: tuple[str, ...]
    """Given to ``init`` and to every learner alike."""
    learner_options: tuple[str, ...]


TINY_GPT2 = ("--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32")
CASES = {
    "hf_gpt2": Example("hf_causal_lm.py", TINY_GPT2, ("--batch-size", "8")),
    "own_gru": Example("own_loop.py", ("--d-model", "32", "--layers", "1"), ("--seq-len", "32", "--batch-size", "8")),
}


def example_module(script: str) -> ModuleType:
    """Import an example as the test's own module (``examples/`` is on pytest's ``pythonpath``)."""
    return importlib.import_module(Path(script).stem)


def run_example(script: str, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], stdout=out,
                                stderr=subprocess.STDOUT, env=ENV)


@pytest.fixture
def start_sync(tmp_path: Path) -> Iterator[Callable[[Path], SyncProcess]]:
    """Starts synchronizers for a test and stops whichever the test left running."""
    started: list[SyncProcess] = []

    def start(init: Path) -> SyncProcess:
        started.append(SyncProcess(tmp_path / "port", tmp_path / "sync.log", init=init, learners=2,
                                   tokens=BUDGET_TOKENS, state_dir=tmp_path / "state",
                                   sets=["protocol.heartbeat_s=0.3"], env=ENV, timeout_s=DEADLINE_S))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.stop(DEADLINE_S)


def global_weights(port: int) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The synchronizer's current global model, by parameter name, and its fragment versions."""
    with SyncClient(f"127.0.0.1:{port}") as client:
        header = client.probe("test-reader").header
        state = client.fetch_state()
    weights: dict[str, torch.Tensor] = {}
    for fragment, value in zip(header.fragments, state.fragments, strict=True):
        tensors = [torch.empty(tuple(p.shape)) for p in fragment.params]
        unflatten_into(value.values, tensors)
        weights.update({p.name: t for p, t in zip(fragment.params, tensors)})
    return weights, state.versions()


def held_out_loss(module: ModuleType, example: Example, weights: dict[str, torch.Tensor]) -> float:
    """The example's own loss, on fixed batches, of its model holding ``weights``."""
    args = module.build_parser().parse_args(["init", "unused", *example.model_options])
    model = module.build_model(args)
    params = dict(model.named_parameters())
    assert set(params) == set(weights)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    batches = module.ByteBatches(module.load_bytes(), batch_size=16, seq_len=32, seed=1234)
    model.eval()
    with torch.no_grad():
        return sum(module.lm_loss(model, batches.next()).item() for _ in range(4)) / 4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_example_two_learners_spend_the_budget_and_improve_the_global_model(name: str, tmp_path: Path,
                                                                            start_sync) -> None:
    example = CASES[name]
    init = tmp_path / "init.safetensors"
    made = run_example(example.script, "init", str(init), *example.model_options, log=tmp_path / "init.log")
    assert made.wait(timeout=DEADLINE_S) == 0, (tmp_path / "init.log").read_text()
    sync = start_sync(init)
    port = sync.port

    learners = {i: run_example(example.script, "learner", "--connect", f"127.0.0.1:{port}", "--id", f"learner-{i}",
                               *example.model_options, *example.learner_options, "--max-steps", str(MAX_STEPS),
                               "--threads", "1", "--log-every", "5",
                               log=tmp_path / f"learner-{i}.log")
                for i in range(2)}
    for i, proc in learners.items():
        log = tmp_path / f"learner-{i}.log"
        try:
            code = proc.wait(timeout=DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert code == 0, log.read_text()
        assert f"learner-{i} done after" in log.read_text()

    finished = wait_for(lambda: (s := status_of(port)) and s["finished"] and s, "the run to finish",
                        timeout_s=DEADLINE_S)
    assert finished["tokens"] >= BUDGET_TOKENS
    assert {lr["id"] for lr in finished["learners"] if lr["accepted"] > 0} == {"learner-0", "learner-1"}

    initial = load_file(str(init))
    final, versions = global_weights(port)
    assert min(versions) >= 1, f"a fragment was never merged: versions {versions}"
    assert set(final) == set(initial)
    moved = [n for n in initial if not torch.equal(final[n], initial[n])]
    assert len(moved) == len(initial), f"unchanged: {sorted(set(initial) - set(moved))}"
    assert all(torch.isfinite(t).all() for t in final.values())

    module = example_module(example.script)
    before, after = held_out_loss(module, example, initial), held_out_loss(module, example, final)
    print(f"{name}: loss of the global model {before:.3f} -> {after:.3f} (uniform: {math.log(256):.3f})")
    assert after < before - 0.1
    assert sync.stop(DEADLINE_S) == 0, sync.log.read_text()


@pytest.mark.parametrize("script", ["own_loop.py", "hf_causal_lm.py", "fsdp_loop.py"])
@pytest.mark.parametrize(("option", "value"), [("--lr", "0"), ("--log-every", "0"), ("--max-steps", "-1")])
def test_a_learner_given_a_bad_value_says_so_in_one_line_and_exits_2_before_it_starts(
        script: str, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The examples' shared command line (``examples/roles.py``) checks the learner's values before
    anything starts: nothing to connect to is given, so getting past the check would fail otherwise."""
    assert example_module(script).main(["learner", option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"{script}: error: need --lr > 0, --log-every >= 1, --max-steps >= 0")


@pytest.mark.parametrize(("options", "served_head", "embedding"), [
    (("--arch", "gpt2"), None, "transformer.wte.weight"),
    (("--arch", "llama"), None, "model.embed_tokens.weight"),
    (("--arch", "llama", "--untied-head"), "lm_head.weight", "model.embed_tokens.weight"),
])
def test_hf_init_serves_a_tied_head_once_as_the_embedding_and_an_untied_head_densely(
        options: tuple[str, ...], served_head: str | None, embedding: str, tmp_path: Path) -> None:
    module = example_module("hf_causal_lm.py")
    init = tmp_path / "init.safetensors"
    assert module.main(["init", str(init), *options, "--d-model", "16", "--layers", "1", "--heads", "2",
                        "--seq-len", "16"]) == 0
    layout = layout_from_file(init, ProtocolConfig(fragments=3, period=6))
    assert ("lm_head.weight" in layout.shapes) == (served_head is not None)  # a tied head is not served twice
    embedding_fragments = [f.param_names for f in layout.plan.fragments if f.is_embedding]
    assert embedding_fragments == [(embedding,)]  # GPT-2's position embedding wpe is merged by RDA
    if served_head:
        assert not layout.plan.fragments[layout.plan.fragment_of(served_head)].is_embedding


@pytest.mark.slow
def test_hf_learner_whose_model_has_an_unserved_head_exits_2_with_one_line_naming_it(tmp_path: Path,
                                                                                    start_sync) -> None:
    tiny_llama = ("--arch", "llama", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16")
    init = tmp_path / "init.safetensors"
    made = run_example("hf_causal_lm.py", "init", str(init), *tiny_llama, log=tmp_path / "init.log")
    assert made.wait(timeout=DEADLINE_S) == 0, (tmp_path / "init.log").read_text()
    sync = start_sync(init)
    untied = subprocess.run([sys.executable, str(EXAMPLES / "hf_causal_lm.py"), "learner", "--connect",
                             f"127.0.0.1:{sync.port}", "--id", "learner-0", *tiny_llama, "--untied-head",
                             "--threads", "1", "--join-timeout", "60"],
                            capture_output=True, text=True, env=ENV, timeout=DEADLINE_S, check=False)
    assert untied.returncode == 2
    errors = [line for line in untied.stderr.splitlines() if "error" in line.lower()]
    assert errors == [("hf_causal_lm.py: error: parameters ['lm_head.weight'] are not served by the synchronizer "
                       f"(another model?): {SERVE_YOUR_MODEL}")]
    assert "Traceback" not in untied.stderr


@pytest.mark.slow
def test_fsdp_example_a_two_rank_sharded_learner_beside_an_unsharded_one_spends_the_budget(tmp_path: Path,
                                                                                         start_sync) -> None:
    """examples/fsdp_loop.py: own_loop's model, sharded over a 2-rank torchrun job (gloo), and own_loop's
    unsharded learner beside it: both are merged, and the global model predicts bytes better."""
    example = CASES["own_gru"]
    init = tmp_path / "init.safetensors"
    made = run_example(example.script, "init", str(init), *example.model_options, log=tmp_path / "init.log")
    assert made.wait(timeout=DEADLINE_S) == 0, (tmp_path / "init.log").read_text()
    sync = start_sync(init)
    common = ("learner", "--connect", f"127.0.0.1:{sync.port}", *example.model_options, *example.learner_options,
              "--threads", "1", "--log-every", "5")

    # The unsharded learner joins first; the sharded one trains 2 ranks' batches a step, so half the steps
    # each leave the budget to be spent by both together.
    plain = run_example("own_loop.py", *common, "--id", "learner-1", "--max-steps", str(MAX_STEPS),
                        log=tmp_path / "plain.log")
    wait_for(lambda: (s := status_of(sync.port)) and any(lr["id"] == "learner-1" for lr in s["learners"]),
             "the unsharded learner to join", timeout_s=DEADLINE_S)
    with open(tmp_path / "sharded.log", "ab") as out:
        sharded = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-port", str(free_port()), str(EXAMPLES / "fsdp_loop.py"), *common,
                                    "--id", "learner-0", "--max-steps", str(MAX_STEPS // 2)],
                                   stdout=out, stderr=subprocess.STDOUT, env=ENV)
    for proc, log in ((sharded, "sharded.log"), (plain, "plain.log")):
        try:
            code = proc.wait(timeout=2 * DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert code == 0, (tmp_path / log).read_text()[-4000:]
    text = (tmp_path / "sharded.log").read_text()
    assert "learner-0 rank 0 done after" in text and "learner-0 rank 1 done after" in text

    finished = wait_for(lambda: (s := status_of(sync.port)) and s["finished"] and s, "the run to finish",
                        timeout_s=DEADLINE_S)
    assert {lr["id"] for lr in finished["learners"] if lr["accepted"] > 0} == {"learner-0", "learner-1"}
    assert "slice_mismatch" not in finished["rejections"], finished["rejections"]
    initial = load_file(str(init))
    final, versions = global_weights(sync.port)
    assert min(versions) >= 1, f"a fragment was never merged: versions {versions}"
    module = example_module(example.script)
    assert held_out_loss(module, example, final) < held_out_loss(module, example, initial) - 0.1
    assert sync.stop(DEADLINE_S) == 0, sync.log.read_text()
