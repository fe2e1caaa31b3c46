"""``ddiloco export --hf``: a run that served the Hugging Face example's model ends in a folder
``from_pretrained`` loads, holding the synchronizer's Θ (tied head included), beside the plain
``state_dict`` file the same model loads strictly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import layout_from_file
from ddiloco.runtime.learner.runtime import LearnerRuntime, save_initial_state
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import InProcessSync, versions, wait_for
from ddiloco.workload.model_file import parameters

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_an_hf_run_exports_a_folder_from_pretrained_loads_with_the_synchronizers_theta(tmp_path: Path) -> None:
    import hf_causal_lm  # examples/ is on pytest's pythonpath; it needs transformers

    args = hf_causal_lm.build_parser().parse_args(["init", "unused", "--d-model", "32", "--layers", "2",
                                                   "--heads", "2", "--seq-len", "16"])
    torch.manual_seed(0)
    model = hf_causal_lm.build_model(args)
    init = tmp_path / "init.safetensors"
    save_initial_state(model, init)
    config = build_config(preset="tiny", overrides=("run.learners=1",))
    layout = layout_from_file(init, config.protocol)
    sync = InProcessSync(config, ServiceOptions(), layout=layout)
    try:
        address = f"127.0.0.1:{sync.port}"
        with SyncClient(address) as client:
            runtime = LearnerRuntime(model, address, "learner-0")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            while min(versions(client)) < 1:
                ids = torch.randint(0, 256, (4, 16))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                runtime.step(tokens=ids.numel())
            runtime.close()
            wait_for(lambda: client.status_dict()["pending_tokens"] == 0, "every contribution merged")
            theta = client.fetch_state()
        out, folder = tmp_path / "model.safetensors", tmp_path / "hf"
        assert main(["export", "--from", address, "--init", str(init), "--hf", str(folder), str(out)]) == 0
    finally:
        sync.close()
    expected = parameters(layout.plan, layout.shapes, {f.fragment: f.values for f in theta.fragments})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    held = dict(loaded.named_parameters())
    for name, value in expected.items():
        assert torch.equal(held[name], value), name
    assert torch.equal(loaded.lm_head.weight, expected["transformer.wte.weight"])  # still tied
    plain = hf_causal_lm.build_model(args)
    plain.load_state_dict(load_file(out))  # strict: lm_head.weight, the tied name, is in the file
    ids = torch.randint(0, 256, (2, 16))
    assert torch.equal(plain.eval()(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits)
