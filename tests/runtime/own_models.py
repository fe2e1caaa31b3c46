"""Small models of a user's own, for the tests of serving them (``save_initial_state`` -> ``ddiloco sync --init``)."""

from __future__ import annotations

import torch
from torch import nn

from ddiloco.settings.config_sources import build_config


class TiedLM(nn.Module):
    """Embedding and output layer sharing one tensor, as GPT-2 and most HF causal LMs do."""

    def __init__(self, *, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(x))))


def tiny_config() -> object:
    return build_config(preset="tiny", overrides=("run.learners=2",))
