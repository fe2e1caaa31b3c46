"""Where a learner trains: ``--device auto|cpu|cuda|cuda:N|mps``.

Only the learners' models and inner optimizers move; the synchronizer stays on the CPU
(its merge loops are CPU kernels, and the paper's synchronizer is a CPU box). A device
asked for and absent is a configuration error, not a silent fallback: a run that was meant
to use a GPU and trains on the CPU instead wastes the hours it takes to notice.
"""

from __future__ import annotations

import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.workload_settings import DEVICE_CHOICES


def resolve_device(name: str) -> torch.device:
    """The torch device for ``name``; ``auto`` is CUDA, else MPS, else the CPU."""
    name = name.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("--device mps: Apple's MPS backend is not available on this machine")
        return torch.device("mps")
    if name == "cuda" or name.startswith("cuda:"):
        index = name.partition(":")[2]
        if index and not index.isdigit():
            raise ConfigError(f"--device {name!r}: expected cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available (torch {torch.__version__}, "
                              f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'})")
        if index and int(index) >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device(name)
    raise ConfigError(f"--device {name!r}: expected one of {DEVICE_CHOICES}")


def process_group_backend(device: torch.device) -> str:
    """torch.distributed backend for the ranks of one learner: NCCL between GPUs, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"
