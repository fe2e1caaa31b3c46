"""The reference workload every driver trains: corpus shards, evaluation batches, initial weights.

Decoupled DiLoCo and its baselines, on the virtual cluster or as real processes, are compared
on the same corpus shards, the same initial weights and the same data order; this module
builds those once from a :class:`~ddiloco.settings.config.Config`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config import Config
from ddiloco.workload.corpus import BatchSampler, Corpus, eval_batches, load_corpus, split_corpus
from ddiloco.workload.evaluate import evaluate
from ddiloco.workload.model import ByteTransformer
from ddiloco.workload.trainer import InnerTrainer, LrSchedule, OptimizerSettings, Precision, build_model


@dataclass(slots=True)
class Workload:
    """Corpus shards, evaluation batches and the initial weights every learner starts from."""

    config: Config
    corpus: Corpus
    eval_set: list[tuple[torch.Tensor, torch.Tensor]]
    initial_state: dict[str, torch.Tensor]
    device: torch.device = torch.device("cpu")
    """Where models are trained and evaluated (``workload/device.py``); data is drawn on the CPU."""

    @classmethod
    def build(cls, config: Config, device: torch.device | None = None, *, data: bytes | None = None) -> "Workload":
        """``data``: the corpus already loaded (``load_corpus``), for callers that build many workloads."""
        if data is None:
            data = load_corpus(config.train.corpus or None, max_bytes=config.train.corpus_max_bytes)
        corpus = split_corpus(data, num_shards=config.run.learners, seq_len=config.model.seq_len)
        batches = eval_batches(
            corpus.eval_data,
            batch_size=config.train.batch_size,
            seq_len=config.model.seq_len,
            max_batches=config.train.eval_batches,
        )
        model = build_model(config.model, config.run.seed)
        device = device or torch.device("cpu")
        batches = [(x.to(device), y.to(device)) for x, y in batches]
        return cls(config, corpus, batches, {k: v.clone() for k, v in model.state_dict().items()}, device)

    def new_model(self) -> ByteTransformer:
        model = ByteTransformer(self.config.model)
        model.load_state_dict(self.initial_state)
        return model.to(self.device)

    def load_model(self, path: Path) -> ByteTransformer:
        """The reference model with the weights of a run's model file (``ddiloco eval``); ConfigError in one
        line when the file is not one, or holds another model (another preset or configuration)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"{str(path)!r} is not a model file (safetensors): {err}") from None
        model = self.new_model()
        try:
            model.load_state_dict(tensors)
        except RuntimeError as err:  # missing, unexpected or mis-shaped parameters
            shapes = ", ".join(line.strip() for line in str(err).splitlines()[1:3])
            raise ConfigError(f"{str(path)!r} holds another model than this configuration's reference model "
                              f"({shapes}): pass the run's --config or --preset; a model of your own (--init) "
                              "is yours to evaluate") from None
        return model

    def new_trainer(self, model: torch.nn.Module) -> InnerTrainer:
        t = self.config.train
        return InnerTrainer(model, OptimizerSettings(lr=t.lr, warmup_steps=t.warmup_steps, weight_decay=t.weight_decay,
                                                     schedule=LrSchedule(t.schedule), lr_min_ratio=t.lr_min_ratio,
                                                     precision=Precision(t.precision)))

    def sampler(self, learner: int, rank: int = 0) -> BatchSampler:
        """Batches of learner ``learner``'s shard; a data-parallel learner's other ranks (``rank`` > 0)
        draw other batches from the same shard."""
        seed = self.config.run.seed * 1_000_003 + learner
        return BatchSampler(
            self.corpus.train_shards[learner],
            batch_size=self.config.train.batch_size,
            seq_len=self.config.model.seq_len,
            seed=seed * 7919 + rank if rank else seed,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.batch_size * self.config.model.seq_len

    def evaluate(self, model: torch.nn.Module) -> float:
        return evaluate(model, self.eval_set)


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of the global weights, in state-dict order: equal runs give equal hashes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
