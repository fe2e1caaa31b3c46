"""A model a sharded learner cannot measure a right Δ on is refused in one line naming the parameter or rank.

``fully_shard`` runs on torch's fake process group (one process plays a rank of a larger job), except
where ranks must really disagree: two gloo processes.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.fragments import plan_fragments
from ddiloco.runtime.learner.fsdp.rank_params import rank_params
from ddiloco.runtime.learner.runtime import is_sharded


@pytest.fixture
def fake_rank():
    def start(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def test_a_shard_s_rows_and_slices_are_what_fsdp_placed(fake_rank) -> None:
    fake_rank(1, 3)
    model = mlp()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model)
    assert is_sharded(model)
    params, sharded = rank_params(model)  # world 3 on the fake group: the agreement check is not run here
    assert sharded == set(full) and params.rank == 1 and params.world == 3
    assert torch.equal(params.local["0.weight"], full["0.weight"][4:8])  # 10 rows in 3: 4, 4, 2
    plan = plan_fragments(list(params.shapes.items()), num_fragments=1, period=4)
    (spec,) = params.slices(plan)
    assert spec.numel == params.local_plan(plan).fragments[0].numel == sum(t.numel() for t in params.local.values())


def test_a_fragment_mixing_sharded_and_plain_parameters_is_refused_naming_one(fake_rank) -> None:
    fake_rank(0, 2)
    model = mlp()
    fully_shard(model[0])  # the last layer stays a plain tensor on every rank
    params, sharded = rank_params(model)
    plan = plan_fragments(list(params.shapes.items()), num_fragments=1, period=4)
    with pytest.raises(ConfigError, match=r"parameter '2.weight' \(fragment 0\) is not an FSDP2 shard"):
        params.check_fragments(plan, sharded)


def test_a_two_dimensional_mesh_is_refused_naming_the_parameter(fake_rank) -> None:
    fake_rank(0, 4)
    model = mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))  # HSDP: replicate over one dimension, shard over one
    with pytest.raises(ConfigError, match=r"parameter '0.weight' is placed on a 2-D device mesh \(2, 2\)"):
        rank_params(model)


def test_a_placement_other_than_shard_0_is_refused(fake_rank) -> None:
    fake_rank(0, 2)
    model = mlp()
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    with pytest.raises(ConfigError, match=r"parameter '0.weight' is placed as \(Shard\(dim=1\),\)"):
        rank_params(model)


def _disagreeing_rank(rank: int, store: str, result: "multiprocessing.Queue[str]") -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10 if rank == 0 else 12))  # rank 1 built another model
        fully_shard(model)
        rank_params(model)
        result.put(f"{rank}: accepted")
    except ConfigError as err:
        result.put(f"{rank}: {err}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_disagree_on_the_layout_are_refused_on_every_rank_naming_the_rank(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_disagreeing_rank, args=(r, str(tmp_path / "store"), result)) for r in range(2)]
    for p in procs:
        p.start()
    lines = sorted(result.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    expected = "rank 1 disagrees with rank 0 on the layout: parameter '0.weight' has shape (12, 6) there, (10, 6) on rank 0"
    assert lines == [f"0: {expected}", f"1: {expected}"]
