"""Serving your own model (``save_initial_state`` -> ``ddiloco sync --init``): tied weights,
the embedding fragment, mismatched models; docs/own-models.md states these facts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ddiloco.core.shared.errors import ParameterError
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import SERVE_YOUR_MODEL, layout_from_file, model_layout
from ddiloco.runtime.learner.runtime import (
    LayoutMismatch,
    LearnerRuntime,
    save_initial_state,
)
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.testing import InProcessSync
from own_models import TiedLM, tiny_config


def saved(path) -> tuple[set[str], list[str]]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys()), json.loads(f.metadata()["embedding_names"])


def test_tied_head_is_saved_once_under_the_embedding_name_and_forms_the_embedding_fragment(tmp_path):
    torch.manual_seed(0)
    save_initial_state(TiedLM(), tmp_path / "init.safetensors")
    names, embedding = saved(tmp_path / "init.safetensors")
    assert names == {"embed.weight", "hidden.weight", "hidden.bias"}  # no "head.weight": one tensor
    assert embedding == ["embed.weight"]
    plan = layout_from_file(tmp_path / "init.safetensors", ProtocolConfig(fragments=3, period=6)).plan
    assert [(f.is_embedding, f.param_names) for f in plan.fragments if f.is_embedding] == [(True, ("embed.weight",))]


def test_untied_head_is_served_as_a_dense_tensor_outside_the_embedding_fragment(tmp_path):
    save_initial_state(TiedLM(tied=False), tmp_path / "init.safetensors")
    names, embedding = saved(tmp_path / "init.safetensors")
    assert "head.weight" in names and embedding == ["embed.weight"]
    plan = layout_from_file(tmp_path / "init.safetensors", ProtocolConfig(fragments=3, period=6)).plan
    assert not plan.fragments[plan.fragment_of("head.weight")].is_embedding


def test_a_learner_with_a_tied_head_receives_the_served_embedding_in_its_head(tmp_path):
    torch.manual_seed(0)
    served = TiedLM()
    save_initial_state(served, tmp_path / "init.safetensors")
    config = tiny_config()
    s = InProcessSync(config, ServiceOptions(), layout=layout_from_file(tmp_path / "init.safetensors", config.protocol))
    try:
        torch.manual_seed(1)
        mine = TiedLM()  # other random weights: joining replaces them
        assert not torch.equal(mine.head.weight, served.embed.weight)
        with LearnerRuntime(mine, f"127.0.0.1:{s.port}", "learner-0") as runtime:
            assert torch.equal(mine.head.weight, served.embed.weight)
            opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
            for _ in range(2 * config.protocol.period):
                x = torch.randint(0, 32, (8,))
                nn.functional.cross_entropy(mine(x), x).backward()
                opt.step()
                opt.zero_grad()
                runtime.step(tokens=8)
        assert mine.head.weight is mine.embed.weight
        with SyncClient(f"127.0.0.1:{s.port}") as client:
            assert min(client.fetch_state().versions()) >= 1
    finally:
        s.close()


def test_a_learner_whose_model_has_an_unserved_parameter_is_refused_naming_it(tmp_path):
    save_initial_state(TiedLM(), tmp_path / "init.safetensors")
    config = tiny_config()
    s = InProcessSync(config, ServiceOptions(), layout=layout_from_file(tmp_path / "init.safetensors", config.protocol))
    try:
        with pytest.raises(LayoutMismatch, match="head.weight"):
            LearnerRuntime(TiedLM(tied=False), f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=30)
    finally:
        s.close()


def test_your_own_model_against_the_reference_synchronizer_is_told_about_init():
    """Issue 45: the README's snippet against ``ddiloco sync --preset tiny`` raised a LayoutMismatch whose
    hint ("start learner and synchronizer with the same model options") never mentioned --init."""
    config = tiny_config()
    s = InProcessSync(config, ServiceOptions())  # the reference model: what `ddiloco sync --preset tiny` serves
    try:
        with pytest.raises(LayoutMismatch) as refused:
            LearnerRuntime(TiedLM(), f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=30)
        assert str(refused.value).endswith(SERVE_YOUR_MODEL) and "ddiloco sync --init" in SERVE_YOUR_MODEL
    finally:
        s.close()


def test_layerwise_fragments_of_a_served_model_are_contiguous_in_model_order(tmp_path):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    save_initial_state(model, tmp_path / "init.safetensors")
    protocol = ProtocolConfig(fragments=4, fragmentation="layerwise")
    served = layout_from_file(tmp_path / "init.safetensors", protocol).plan
    in_model_order = model_layout(protocol, model.named_parameters(), []).plan
    assert [f.param_names for f in served.fragments] == [f.param_names for f in in_model_order.fragments]


def test_a_learner_refused_for_its_layout_is_not_left_registered_as_live(tmp_path):
    save_initial_state(TiedLM(), tmp_path / "init.safetensors")
    config = tiny_config()
    s = InProcessSync(config, ServiceOptions(), layout=layout_from_file(tmp_path / "init.safetensors", config.protocol))
    try:
        with pytest.raises(LayoutMismatch):
            LearnerRuntime(TiedLM(tied=False), f"127.0.0.1:{s.port}", "learner-0", join_timeout_s=30)
        with SyncClient(f"127.0.0.1:{s.port}") as client:
            live = [lr["id"] for lr in client.status_dict()["learners"] if lr["alive"]]
        assert live == []
    finally:
        s.close()


def test_a_model_without_parameters_is_refused_before_anything_connects():
    with pytest.raises(ParameterError, match=r"^the model \(Sequential\) has no parameters"):
        LearnerRuntime(nn.Sequential(nn.ReLU()), "127.0.0.1:1", "empty")


@pytest.mark.parametrize("change,problem", [
    (lambda m: m.to(torch.float64), r"'[\w.]+' changed dtype from torch.float32 to torch.float64"),
    (lambda m: m.load_state_dict(m.state_dict(), assign=True), r"'embed.weight' was replaced by a new Parameter"),
])
def test_a_model_changed_under_a_running_learner_stops_it_naming_the_parameter(tmp_path, change, problem):
    """Issue 27: the learner's parameters are views into its flat buffers; a model that casts or
    swaps them afterwards is named at the latest when its fragment is next used, never measured."""
    save_initial_state(TiedLM(), tmp_path / "init.safetensors")
    config = tiny_config()
    s = InProcessSync(config, ServiceOptions(), layout=layout_from_file(tmp_path / "init.safetensors", config.protocol))
    try:
        model = TiedLM()
        runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0")
        runtime.step(tokens=8)
        change(model)
        with pytest.raises(ParameterError, match=rf"^parameter {problem}.* after the learner started"):
            for _ in range(config.protocol.period):
                runtime.step(tokens=8)
        runtime.close(flush=False)
    finally:
        s.close()
