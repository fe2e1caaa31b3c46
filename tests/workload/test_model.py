"""Behaviour of the byte-level transformer: init, training, determinism, causality, MoE."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.workload.corpus import BatchSampler, eval_batches, load_corpus, split_corpus
from ddiloco.workload.evaluate import evaluate
from ddiloco.workload.model import VOCAB_SIZE, ByteTransformer, MixtureOfExperts, ModelConfig

TINY = ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2)
TINY_MOE = ModelConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine an
    # OpenMP team that loses a core to another process slows each step by 10x or more.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def corpus():
    return split_corpus(load_corpus(max_bytes=2**20), num_shards=1, seq_len=32)


def build(config: ModelConfig, seed: int = 0) -> ByteTransformer:
    torch.manual_seed(seed)
    return ByteTransformer(config)


def train(model, corpus, *, steps: int, seed: int = 0, lr: float = 1e-2) -> list[float]:
    sampler = BatchSampler(corpus.train_shards[0], batch_size=16, seq_len=32, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x, y = sampler.next_batch()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_model_loss_at_init_is_about_ln256(corpus):
    model = build(ModelConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    batches = eval_batches(corpus.eval_data, batch_size=16, seq_len=32, max_batches=2)
    assert evaluate(model, batches) == pytest.approx(math.log(VOCAB_SIZE), abs=0.3)
    x = torch.randint(0, VOCAB_SIZE, (4, 32), generator=torch.Generator().manual_seed(1))
    logits = model(x)
    assert logits.shape == (4, 32, VOCAB_SIZE)
    # Uniformly random targets: expected loss is ln(256) plus half the logit variance.
    loss = model(x, torch.randint(0, VOCAB_SIZE, (4, 32)))
    assert loss.item() == pytest.approx(math.log(VOCAB_SIZE), abs=0.1)


def test_model_dense_training_reduces_loss(corpus):
    model = build(TINY)
    batches = eval_batches(corpus.eval_data, batch_size=16, seq_len=32, max_batches=4)
    before = evaluate(model, batches)
    train(model, corpus, steps=40)
    after = evaluate(model, batches)
    assert after < before - 1.5, (before, after)


def test_model_same_seed_gives_identical_weights_and_losses(corpus):
    a, b = build(TINY_MOE, seed=3), build(TINY_MOE, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert train(a, corpus, steps=5) == train(b, corpus, steps=5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = build(TINY_MOE, seed=4)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_model_construction_does_not_reseed_global_rng():
    torch.manual_seed(0)
    ByteTransformer(TINY)
    after_one = torch.rand(1)
    torch.manual_seed(0)
    ByteTransformer(TINY)
    ByteTransformer(TINY)
    assert not torch.equal(after_one, torch.rand(1))


def test_model_moe_trains_and_routes_to_several_experts(corpus):
    model = build(TINY_MOE)
    batches = eval_batches(corpus.eval_data, batch_size=16, seq_len=32, max_batches=4)
    before = evaluate(model, batches)
    losses = train(model, corpus, steps=40)
    after = evaluate(model, batches)
    assert after < before - 1.5, (before, after)
    assert all(math.isfinite(v) for v in losses)

    moe_inputs = []
    moe = model.blocks[0].mlp
    assert isinstance(moe, MixtureOfExperts)
    handle = moe.register_forward_hook(lambda mod, args, out: moe_inputs.append(args[0]))
    with torch.no_grad():
        model(batches[0][0])
        handle.remove()
        gates, expert_ids, probs = moe.route(moe_inputs[0].reshape(-1, TINY_MOE.d_model))
    assert expert_ids.shape == gates.shape == (16 * 32, TINY_MOE.top_k)
    torch.testing.assert_close(gates.sum(-1), torch.ones(16 * 32))
    used = torch.bincount(expert_ids.flatten(), minlength=TINY_MOE.n_experts)
    assert (used > 0).sum() >= 2, used


def test_model_moe_eval_loss_excludes_aux_loss(corpus):
    model = build(TINY_MOE)
    x, y = eval_batches(corpus.eval_data, batch_size=8, seq_len=32, max_batches=1)[0]
    with torch.no_grad():
        train_loss = model.train()(x, y)
        eval_loss = model.eval()(x, y)
    aux = torch.stack([b.mlp.last_aux_loss for b in model.blocks]).mean()
    assert aux >= 1.0 - 1e-5  # the balance loss is minimal (1) at uniform routing
    torch.testing.assert_close(train_loss, eval_loss + TINY_MOE.moe_aux_loss_coef * aux)


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_model_is_causal(config):
    model = build(config).eval()
    x = torch.randint(0, VOCAB_SIZE, (2, 32), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % VOCAB_SIZE
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_model_head_is_tied_to_embedding_and_listed_once():
    model = build(TINY)
    assert model.head.weight is model.tok_emb.weight
    names = dict(model.named_parameters())
    assert model.embedding_param_names()
    for name in model.embedding_param_names():
        assert names[name] is model.tok_emb.weight
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1
    assert "head.weight" not in names


def test_model_residual_projections_have_scaled_init():
    config = ModelConfig(d_model=128, n_layers=8, n_heads=4, seq_len=16)
    model = build(config)
    std = 0.02 / math.sqrt(2 * config.n_layers)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(std, rel=0.1)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(std, rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_model_rejects_sequence_longer_than_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        build(TINY)(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"d_model": 30, "n_heads": 4}, "n_heads"),
        ({"d_model": 0}, "d_model"),
        ({"seq_len": 0}, "seq_len"),
        ({"n_layers": -1}, "n_layers"),
        ({"n_heads": 0}, "n_heads"),
        ({"mlp_ratio": 0}, "mlp_ratio"),
        ({"n_experts": 1}, "n_experts"),
        ({"n_experts": -2}, "n_experts"),
        ({"n_experts": 4, "top_k": 5}, "top_k"),
        ({"n_experts": 4, "top_k": 0}, "top_k"),
        ({"d_model": 32.0}, "d_model"),
        ({"n_layers": True}, "n_layers"),
        ({"moe_aux_loss_coef": -0.1}, "moe_aux_loss_coef"),
    ],
)
def test_model_config_validate_names_bad_field(overrides, field):
    config = ModelConfig(**overrides)
    with pytest.raises(ConfigError, match=field):
        config.validate()
    with pytest.raises(ValueError, match=field):  # ConfigError is a ValueError
        ByteTransformer(config)


def test_model_config_defaults_validate():
    ModelConfig().validate()
    TINY_MOE.validate()
    ModelConfig(n_experts=8, top_k=8).validate()


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_model_deepcopies_after_a_training_step_with_tie_intact(config, corpus):
    model = build(config)
    train(model, corpus, steps=1)
    clone = copy.deepcopy(model)
    assert clone.head.weight is clone.tok_emb.weight
    for (name, p), q in zip(model.named_parameters(), clone.parameters()):
        assert torch.equal(p, q) and p is not q, name
