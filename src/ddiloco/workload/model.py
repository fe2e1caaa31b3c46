"""A small decoder-only transformer over raw bytes: the reference workload.

Vocabulary is the 256 byte values, so there is no tokenizer and the loss is in nats per
byte. The architecture is GPT-2 shaped (as in nanoGPT): learned positional embedding,
pre-norm blocks of causal self-attention and a GELU MLP, a final norm, and an output head
tied to the token embedding. No dropout, no biases.

With ``n_experts >= 2`` every block's MLP becomes a dropless mixture of experts: a linear
router, top-k softmax gating and ``n_experts`` expert MLPs, plus the usual load-balancing
auxiliary loss (Fedus et al., "Switch Transformers", 2021) added to the training loss.

Construction draws from the global torch RNG: seed it (``torch.manual_seed``) before
building a model; the model never seeds anything itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddiloco.settings.workload_settings import ModelConfig

VOCAB_SIZE = 256
"""One token per byte value."""

INIT_STD = 0.02
"""Standard deviation of every weight at init (residual projections are scaled down)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=False)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MixtureOfExperts(nn.Module):
    """Dropless top-k mixture of expert MLPs with a load-balancing auxiliary loss.

    Each token goes to the ``top_k`` experts with the highest router probability; their
    outputs are summed with those probabilities renormalized over the chosen experts.
    Dispatch gathers each expert's tokens at once (a loop over experts, not tokens).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.n_experts))
        # The balance loss of the last forward. The live tensor (with its graph) is handed
        # over once by pop_aux_loss(), so a model can be deep-copied after a training step;
        # last_aux_loss keeps a detached copy for logging.
        self._aux_loss: Tensor | None = None
        self.last_aux_loss: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens ``x [N, C]``: (gates [N, k], expert ids [N, k], router probs [N, E])."""
        probs = F.softmax(self.router(x), dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        return top_p / top_p.sum(dim=-1, keepdim=True), top_i, probs

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, expert_ids, probs = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token_idx, slot_idx = torch.where(expert_ids == e)
            if token_idx.numel() == 0:
                continue
            y = expert(x[token_idx]) * gates[token_idx, slot_idx].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        # Switch-Transformer balance loss: E * sum_e (fraction of assignments to e) *
        # (mean router probability of e); equals 1 when routing is uniform.
        assigned = F.one_hot(expert_ids, self.n_experts).sum(dim=(0, 1)).to(x.dtype)
        fraction = assigned / expert_ids.numel()
        self._aux_loss = self.n_experts * torch.sum(fraction * probs.mean(dim=0))
        self.last_aux_loss = self._aux_loss.detach()
        return out.view(shape)

    def pop_aux_loss(self) -> Tensor:
        """The balance loss of the last forward (with its graph), which it then forgets."""
        if self._aux_loss is None:
            raise RuntimeError("pop_aux_loss() called without a forward since the last pop")
        aux, self._aux_loss = self._aux_loss, None
        return aux


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model, bias=False)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model, bias=False)
        self.mlp: nn.Module = MixtureOfExperts(config) if config.n_experts else MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteTransformer(nn.Module):
    """Decoder-only byte-level language model (dense or mixture of experts).

    ``forward(idx)`` returns logits ``[B, T, 256]``; ``forward(idx, targets)`` returns the
    mean cross-entropy in nats per byte, plus ``moe_aux_loss_coef`` times the load-balancing
    loss (averaged over blocks) when the model is in training mode and has experts. In eval
    mode the returned loss is the cross-entropy alone, so it is comparable across dense and
    MoE models.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model, bias=False)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one tensor, listed once as tok_emb
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02) everywhere; the projections that write into the residual
        # stream are scaled by 1/sqrt(2 * n_layers) so its variance does not grow with depth.
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:  # norm gains keep their default of one
                continue
            std = residual_std if name.endswith("proj.weight") else INIT_STD
            nn.init.normal_(p, mean=0.0, std=std)

    def embedding_param_names(self) -> tuple[str, ...]:
        """Names (as in ``named_parameters()``) of the token embedding, which the head shares."""
        return ("tok_emb.weight",)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} bytes exceeds model.seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        aux_losses = [b.mlp.pop_aux_loss() for b in self.blocks if self.config.n_experts]
        logits = self.head(self.norm_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        if self.training and aux_losses and self.config.moe_aux_loss_coef:
            loss = loss + self.config.moe_aux_loss_coef * torch.stack(aux_losses).mean()
        return loss
