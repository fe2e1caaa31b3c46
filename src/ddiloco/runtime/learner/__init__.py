"""A learner process: Decoupled DiLoCo inside any PyTorch training loop.

``from ddiloco.runtime.learner import LearnerRuntime`` wraps a model you train yourself
(:mod:`~ddiloco.runtime.learner.runtime`); its link talks to the synchronizer through a
helper process (:mod:`~ddiloco.runtime.learner.link`, :mod:`~ddiloco.runtime.learner.helper`);
``ddiloco learner`` is the reference learner process (:mod:`~ddiloco.runtime.learner.process`).

The names below are imported when first asked for (PEP 562), not with the package: the helper
process starts from ``ddiloco.runtime.learner.helper`` once per learner, and importing the
training side with it (the runtime, its link, torch's distributed and the model files) cost each
helper a second or more of CPU beside its trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddiloco.runtime.learner.runtime import LayoutMismatch, LearnerRuntime, RuntimeStats, save_initial_state

__all__ = ["LayoutMismatch", "LearnerRuntime", "RuntimeStats", "save_initial_state"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("ddiloco.runtime.learner.runtime"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
