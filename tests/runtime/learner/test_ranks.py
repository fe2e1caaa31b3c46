"""What rank 0 tells the other ranks after every step (``runtime/learner/ranks.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddiloco.runtime.learner.ranks import StepFlags, share_step


def test_step_flags_travel_as_one_small_cpu_tensor_and_come_back_the_same():
    for flags in (StepFlags(False, False, frozenset()), StepFlags(True, False, frozenset({0, 3})),
                  StepFlags(False, True, frozenset({1}))):
        encoded = flags.encode(4)
        assert encoded.device.type == "cpu" and encoded.numel() == 6
        assert StepFlags.decode(encoded) == flags


def test_share_step_hands_every_rank_rank_0_s_flags_and_fragments(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        params = [[torch.ones(3)], [torch.zeros(2), torch.full((2,), 7.0)]]
        flags = StepFlags(True, False, frozenset({1}))
        assert share_step(flags, params, None) == flags
        assert params[1][1].tolist() == [7.0, 7.0]  # rank 0's values, untouched on rank 0
    finally:
        dist.destroy_process_group()
