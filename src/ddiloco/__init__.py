"""ddiloco: Decoupled DiLoCo for resilient, asynchronous, low-bandwidth pre-training.

Implements Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training"
(arXiv 2604.21428). The protocol lives once in :mod:`ddiloco.core`; :mod:`ddiloco.sim`
(virtual cluster) and :mod:`ddiloco.runtime` (gRPC processes) only drive it.
"""

__version__ = "0.1.0"
