"""Test-suite-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: tests share 2 cores with each other's learner processes, and a
    2-thread torch slows down many times over when another process takes a core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
