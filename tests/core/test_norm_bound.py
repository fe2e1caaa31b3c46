"""The norm bound follows what learners send, the norms it refused included (at the bound,
once per sequence number)."""

from __future__ import annotations

import itertools

import pytest

from ddiloco.core.sync_side.norm_bound import NORM_FLOOR, NORMS_KEPT, NORMS_NEEDED, NormBound

RATIO = 10.0
_seq = itertools.count()


def send(bound: NormBound, norm: float, learner: str = "learner-0") -> bool:
    """One contribution measured as the synchronizer does: True if let in."""
    limit = bound.bound(RATIO)
    bound.measured(learner, next(_seq), norm, limit)
    return norm <= limit


def test_the_initial_scale_holds_until_enough_norms_are_known():
    bound = NormBound(initial_norm=40.0)
    for _ in range(NORMS_NEEDED - 1):
        send(bound, 0.01)
        assert bound.bound(RATIO) == RATIO * 40.0
    send(bound, 0.01)
    assert bound.bound(RATIO) == pytest.approx(RATIO * max(0.01, NORM_FLOOR * 40.0))


def test_a_warm_up_that_grows_the_norms_past_the_ratio_locks_no_one_out():
    """A fragment's first round holds a few warm-up steps, its next a whole period at a larger
    rate: norms grow 13x. Learnt from the norms it let in alone, the bound refused every later
    contribution (the fragment froze for the rest of the run); its refused norms now move it."""
    bound = NormBound(initial_norm=40.0)
    for norm in (0.04,) * 4 + (0.55,) * 4:  # the first two rounds of four learners
        assert send(bound, norm)
    admitted = [send(bound, 0.55) for _ in range(20)]  # five more rounds at the new scale
    assert not admitted[0]  # the lower median is still a warm-up norm
    assert all(admitted[4:])  # from the second round on, every contribution is let in


def test_a_jump_of_a_hundred_times_is_followed_within_two_half_windows():
    bound = NormBound(initial_norm=1.0)
    for _ in range(NORMS_KEPT):
        send(bound, 0.01)
    admitted = [send(bound, 1.0) for _ in range(2 * NORMS_KEPT)]
    assert not admitted[0] and admitted[-1]
    assert admitted.index(True) <= NORMS_KEPT + 2


def test_the_bound_follows_a_change_of_scale_only_as_fast_as_half_its_window_fills():
    """The lag that keeps one member from growing the model round after round: the honest
    learners' norms echo what it pushed in, and a bound that followed them at once would let it
    push harder each round."""
    bound = NormBound(initial_norm=1.0)
    for _ in range(NORMS_KEPT):
        send(bound, 1.0)
    for i in range(NORMS_KEPT // 2 + 1):  # the lower median of 32 is the 16th smallest
        assert bound.bound(RATIO) == RATIO * 1.0, i
        send(bound, 5.0)
    assert bound.bound(RATIO) == RATIO * 5.0


def test_a_member_sending_one_huge_contribution_again_and_again_moves_nothing():
    bound = NormBound(initial_norm=1.0)
    for _ in range(NORMS_KEPT):
        send(bound, 1.0)
    for _ in range(3 * NORMS_KEPT):  # the same sequence number each time: counted once
        bound.measured("member", 7, 1e9, bound.bound(RATIO))
    assert bound.bound(RATIO) == RATIO * 1.0


def test_refused_sends_move_the_bound_no_faster_than_sends_at_the_bound_that_are_let_in():
    """With new sequence numbers (as many as the claim checks let through), refused norms
    count at the bound they exceeded: a member gains nothing by sending above the bound over
    sending at it, which the rule learnt from accepted norms alone allowed too."""
    refused, at_bound = NormBound(initial_norm=1.0), NormBound(initial_norm=1.0)
    for b in (refused, at_bound):
        for _ in range(NORMS_KEPT):
            send(b, 1.0)
    for _ in range(NORMS_KEPT):
        assert not send(refused, 1e9, learner="member")
        assert send(at_bound, at_bound.bound(RATIO), learner="member")
        assert refused.bound(RATIO) == at_bound.bound(RATIO)


def test_the_norms_survive_a_checkpoint_and_an_old_checkpoint_still_loads():
    bound = NormBound(initial_norm=2.0)
    for i in range(3 * NORMS_KEPT):
        send(bound, float(i) / 1000, learner=f"learner-{i % 4}")
    restored = NormBound()
    restored.load_state_dict(bound.state_dict())
    assert restored.bound(RATIO) == bound.bound(RATIO)
    flat = NormBound()
    flat.load_state_dict({"initial_norm": 2.0, "norms": [3.0] * NORMS_NEEDED, "value": None})  # a fragment's old keys
    assert flat.bound(RATIO) == RATIO * 3.0


def test_a_learner_that_registers_again_is_counted_from_its_new_first_send():
    """Sequence numbers start again with each session: keyed by learner id alone, a rejoined
    learner's norms would not count until it passed the old session's numbers."""
    bound = NormBound(initial_norm=1.0)
    for seq in range(NORMS_KEPT):
        bound.measured(("learner-0", "session-1"), seq, 1.0, bound.bound(RATIO))
    for seq in range(NORMS_KEPT // 2 + 1):  # the same learner, a new session, at a new scale
        bound.measured(("learner-0", "session-2"), seq, 5.0, bound.bound(RATIO))
    assert bound.bound(RATIO) == RATIO * 5.0
