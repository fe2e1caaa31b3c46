"""The norm bound follows what learners send, the norms it refused included."""

from __future__ import annotations

import pytest

from ddiloco.core.norm_bound import NORM_FLOOR, NORMS_KEPT, NORMS_NEEDED, NormBound

RATIO = 10.0


def test_the_initial_scale_holds_until_enough_norms_are_known():
    bound = NormBound(initial_norm=40.0)
    for _ in range(NORMS_NEEDED - 1):
        bound.measured(0.01)
        assert bound.bound(RATIO) == RATIO * 40.0
    bound.measured(0.01)
    assert bound.bound(RATIO) == pytest.approx(RATIO * max(0.01, NORM_FLOOR * 40.0))


def test_a_warm_up_that_grows_the_norms_past_the_ratio_locks_no_one_out():
    """A fragment's first round holds a few warm-up steps, its next a whole period at a larger
    rate: norms grow 13x. Learnt from the norms it let in alone, the bound refused every later
    contribution (the fragment froze for the rest of the run); its refused norms now move it."""
    bound = NormBound(initial_norm=40.0)
    for norm in (0.04,) * 4 + (0.55,) * 4:  # the first two rounds of four learners
        bound.measured(norm)
    admitted = []
    for _ in range(20):  # five more rounds at the new scale
        admitted.append(0.55 <= bound.bound(RATIO))
        bound.measured(0.55)
    assert not admitted[0]  # the lower median is still a warm-up norm
    assert all(admitted[4:])  # from the second round on, every contribution is let in


def test_the_bound_follows_a_change_of_scale_only_as_fast_as_half_its_window_fills():
    """The lag that keeps one member from growing the model round after round: the honest
    learners' norms echo what it pushed in, and a bound that followed them at once would let it
    push harder each round."""
    bound = NormBound(initial_norm=1.0)
    for _ in range(NORMS_KEPT):
        bound.measured(1.0)
    for i in range(NORMS_KEPT // 2 + 1):  # the lower median of 32 is the 16th smallest
        assert bound.bound(RATIO) == RATIO * 1.0, i
        bound.measured(5.0)
    assert bound.bound(RATIO) == RATIO * 5.0


def test_the_norms_survive_a_checkpoint_and_an_old_checkpoint_still_loads():
    bound = NormBound(initial_norm=2.0)
    for i in range(3 * NORMS_KEPT):
        bound.measured(float(i))
    restored = NormBound()
    restored.load_state_dict(bound.state_dict())
    assert restored.bound(RATIO) == bound.bound(RATIO) == RATIO * float(2 * NORMS_KEPT + (NORMS_KEPT - 1) // 2)
    flat = NormBound()
    flat.load_state_dict({"initial_norm": 2.0, "norms": [3.0] * NORMS_NEEDED, "value": None})  # a fragment's old keys
    assert flat.bound(RATIO) == RATIO * 3.0
