"""The adaptive grace window: g = min(γ·max(0, τ·ξ_step − (ξ_quorum + ξ_sync)), g_max)."""

from ddiloco.core.shared.grace import GraceWindow, effective_quorum


def test_window_uses_the_slack_left_by_quorum_and_sync_times():
    g = GraceWindow(overlap_steps=4, gamma=0.5, max_s=100.0)
    assert g.length_s(step_time_s=2.0) == 4.0  # 0.5 · 4·2
    g.observe_quorum(3.0)
    g.observe_sync(1.0)
    assert g.length_s(step_time_s=2.0) == 0.5 * (8.0 - 4.0)


def test_window_is_zero_without_slack_and_capped_by_max():
    g = GraceWindow(overlap_steps=1, gamma=0.9, max_s=3.0)
    g.observe_sync(10.0)
    assert g.length_s(step_time_s=1.0) == 0.0
    big = GraceWindow(overlap_steps=100, gamma=0.9, max_s=3.0)
    assert big.length_s(step_time_s=1.0) == 3.0


def test_quorum_drops_to_live_learners_unless_strict():
    assert effective_quorum(4, alive=2, strict=False) == 2
    assert effective_quorum(4, alive=0, strict=False) == 1
    assert effective_quorum(4, alive=2, strict=True) == 4
    assert effective_quorum(2, alive=5, strict=False) == 2
