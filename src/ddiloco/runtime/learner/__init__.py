"""A learner process: Decoupled DiLoCo inside any PyTorch training loop.

``from ddiloco.runtime.learner import LearnerRuntime`` wraps a model you train yourself
(:mod:`~ddiloco.runtime.learner.runtime`); its link talks to the synchronizer through a
helper process (:mod:`~ddiloco.runtime.learner.link`, :mod:`~ddiloco.runtime.learner.helper`);
``ddiloco learner`` is the reference learner process (:mod:`~ddiloco.runtime.learner.process`).
"""

from ddiloco.runtime.learner.runtime import LayoutMismatch, LearnerRuntime, RuntimeStats, save_initial_state

__all__ = ["LayoutMismatch", "LearnerRuntime", "RuntimeStats", "save_initial_state"]
