"""``--resume``'s choices, apart from the state directory's code (torch), so that ``ddiloco sync``
checks its command line, and refuses a bad one in one line, without importing torch."""

from __future__ import annotations

import enum


class Resume(enum.Enum):
    """What a synchronizer does with the run's state in its state directory.

    A restart after a crash must resume, and a first start must not overwrite another run; a
    ``--resume`` that found nothing used to start a new run quietly, so a wrong path (a typo, a
    volume not mounted) began training from scratch beside the real state. Deploy scripts that
    run one command line for both the first start and every restart say so:
    :attr:`IF_PRESENT`."""

    NEW_RUN = "new run"
    """Start a run: a directory that holds one is refused (``ddiloco sync`` without ``--resume``)."""
    REQUIRED = "required"
    """Continue the run in the directory; none there is an error (``--resume``)."""
    IF_PRESENT = "if present"
    """Continue the run in the directory if it holds one, else start one (``--resume-if-present``)."""
