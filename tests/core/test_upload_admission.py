"""The admission of uploads, decided by the core (``core/sync_side/upload_admission.py``); the
runtime's ``call_limits.py`` holds the buffers and closes the streams it names."""

from __future__ import annotations

from ddiloco.core.shared.messages import RejectReason, Session
from ddiloco.core.sync_side.upload_admission import UPLOADS_PER_LEARNER, InFlight, UploadAdmission

OLD, NEW = Session(1, 1), Session(1, 2)


def test_one_upload_per_learner_and_fragment_and_two_per_learner_the_rest_busy():
    admission = UploadAdmission(max_learners=4)
    admission.admit(InFlight("a", NEW, 0))
    assert admission.refusal("a", 0)[0] is RejectReason.BUSY  # the same fragment again
    assert admission.refusal("a", 1) is None and admission.refusal("b", 0) is None
    admission.admit(InFlight("a", NEW, 1))
    assert UPLOADS_PER_LEARNER == 2 and admission.refusal("a", 2)[0] is RejectReason.BUSY
    admission.end(InFlight("a", NEW, 0))
    assert admission.refusal("a", 2) is None  # a finished upload frees its place


def test_a_learner_registered_again_ends_its_older_sessions_uploads_and_only_those():
    admission = UploadAdmission(max_learners=4)
    for upload in (InFlight("a", OLD, 0), InFlight("a", NEW, 1), InFlight("b", OLD, 0)):
        admission.admit(upload)
    ended = admission.superseded("a", NEW)
    assert [(e.upload, e.reason) for e in ended] == [(InFlight("a", OLD, 0), RejectReason.SUPERSEDED)]
    assert admission.in_flight == [InFlight("a", NEW, 1), InFlight("b", OLD, 0)]


def test_only_a_full_pool_asks_which_sessions_live_and_the_ended_ones_make_way():
    admission = UploadAdmission(max_learners=1)
    admission.admit(InFlight("a", OLD, 0))
    assert admission.crowded() == []  # room left: no session is asked about
    admission.admit(InFlight("b", OLD, 0))
    holders = admission.crowded()
    assert holders == [InFlight("a", OLD, 0), InFlight("b", OLD, 0)]
    admission.end(InFlight("b", OLD, 0))  # ended while the core was asked: not ended twice
    ended = admission.not_live(holders, [True, False])
    assert ended == [] and admission.in_flight == [InFlight("a", OLD, 0)]
    admission.admit(InFlight("c", NEW, 0))
    ended = admission.not_live(admission.crowded(), [False, True])
    assert [(e.upload.learner, e.reason) for e in ended] == [("a", RejectReason.UNKNOWN_LEARNER)]


def test_the_questions_come_in_one_order_for_both_drivers():
    """``consider`` then ``with_live``, as the service (``call_limits.py``) and the simulator
    (``sim/sync_node.py``) both ask: older sessions end first; a busy upload is refused before any
    session is asked about; only a full pool asks, and only then do ended sessions make way."""
    admission = UploadAdmission(max_learners=1)
    admission.admit(InFlight("a", OLD, 0))
    admission.admit(InFlight("b", OLD, 0))  # every place taken
    busy = admission.consider("b", OLD, 0)
    assert busy.refused[0] is RejectReason.BUSY and busy.check == [] and busy.ended == []
    renewed = admission.consider("a", NEW, 1)  # a's older session's upload ends: a place is free
    assert [e.upload for e in renewed.ended] == [InFlight("a", OLD, 0)]
    assert renewed.refused is None and renewed.check == []
    admission.admit(InFlight("a", NEW, 1))
    crowded = admission.consider("c", NEW, 0)
    assert crowded.refused is None and crowded.check == [InFlight("b", OLD, 0), InFlight("a", NEW, 1)]
    settled = admission.with_live("c", 0, crowded.check, [False, True])
    assert [(e.upload.learner, e.reason) for e in settled.ended] == [("b", RejectReason.UNKNOWN_LEARNER)]
    assert settled.refused is None and settled.check == []
