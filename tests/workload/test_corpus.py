"""Corpus loading, sharding, batch sampling and evaluation batches."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.shared.errors import ConfigError
from ddiloco.workload import corpus as corpus_mod
from ddiloco.workload.corpus import (
    BatchSampler,
    Corpus,
    default_corpus_files,
    eval_batches,
    load_corpus,
    split_corpus,
    stdlib_root,
)
from ddiloco.workload.evaluate import evaluate

SMALL = 2**20


def test_corpus_default_is_nonempty_deterministic_and_starts_with_first_file():
    data = load_corpus(max_bytes=SMALL)
    assert len(data) == SMALL
    assert data == load_corpus(max_bytes=SMALL)
    assert data == corpus_mod._concatenate(default_corpus_files(), SMALL)  # cache agrees
    first = default_corpus_files()[0].read_bytes()
    assert data.startswith(first + b"\n")
    assert b"def " in data and b"import " in data
    assert load_corpus(max_bytes=1000) == data[:1000]


def test_corpus_default_files_are_sorted_stdlib_sources_without_tests():
    files = default_corpus_files()
    root = stdlib_root()
    rel = [f.relative_to(root).parts for f in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    banned = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert not any(banned & set(parts[:-1]) for parts in rel)
    assert ("argparse.py",) in rel


def test_corpus_default_contains_no_test_file_content():
    data = load_corpus()
    test_dir = stdlib_root() / "test"
    candidates = sorted(test_dir.glob("test_*.py"))[:20] if test_dir.is_dir() else []
    if not candidates:
        pytest.skip("this Python installation ships no stdlib test suite")
    for path in candidates:
        text = path.read_bytes()
        if len(text) < 2000:
            continue
        chunk = text[len(text) // 2 : len(text) // 2 + 400]
        assert chunk not in data, path


def test_corpus_dir_reads_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.txt").write_text("first file ünïcode\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third, nested")
    (tmp_path / ".hidden").write_text("hidden file")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden dir")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "empty.txt").write_text("")
    data = load_corpus(tmp_path)
    assert data == "first file ünïcode\n\nsecond file\n\nthird, nested".encode()
    assert load_corpus(str(tmp_path), max_bytes=5) == b"first"


def test_corpus_dir_missing_or_unusable_raises_config_error_naming_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="nope"):
        load_corpus(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(empty)
    (empty / "x.bin").write_bytes(b"\x80\x81\x82")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(empty)
    a_file = tmp_path / "file.txt"
    a_file.write_text("hello")
    with pytest.raises(ConfigError, match="file.txt"):
        load_corpus(a_file)
    with pytest.raises(ConfigError) as info:
        load_corpus(missing)
    assert "\n" not in str(info.value)
    small = tmp_path / "small"
    small.mkdir()
    (small / "t.txt").write_text("short")
    with pytest.raises(ConfigError, match="small"):
        load_corpus(small, min_bytes=129)
    with pytest.raises(ConfigError, match="max_bytes"):
        load_corpus(small, max_bytes=0)


def test_split_deals_chunks_so_every_shard_and_the_eval_set_span_the_corpus():
    data = bytes(range(256)) * 4000  # 1 MB: chunks of CHUNK_BYTES
    c = split_corpus(data, num_shards=3, seq_len=16, eval_fraction=0.1)
    assert isinstance(c, Corpus) and len(c.train_shards) == 3
    assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in c.train_shards)
    lengths = [s.numel() for s in c.train_shards]
    assert max(lengths) - min(lengths) <= corpus_mod.CHUNK_BYTES
    assert sum(lengths) + c.eval_data.numel() == len(data)
    assert c.eval_data.numel() >= 0.1 * len(data)
    # A corpus whose first and second halves differ: every shard and the eval set hold both.
    halves = b"a" * 500_000 + b"b" * 500_000
    c = split_corpus(halves, num_shards=4, seq_len=16)
    for part in (*c.train_shards, c.eval_data):
        counts = torch.bincount(part.long(), minlength=256)
        assert counts[ord("a")] > 0.3 * part.numel() and counts[ord("b")] > 0.3 * part.numel()
    # Shards are independent tensors: writing one leaves the others alone.
    before = c.train_shards[1].clone()
    c.train_shards[0][:] = 0
    assert torch.equal(c.train_shards[1], before)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    num_shards=st.integers(1, 8),
    seq_len=st.integers(1, 64),
    eval_fraction=st.floats(0.01, 0.5),
)
def test_split_either_partitions_the_bytes_or_refuses(n, num_shards, seq_len, eval_fraction):
    data = bytes(i % 251 for i in range(n))
    try:
        c = split_corpus(data, num_shards=num_shards, seq_len=seq_len, eval_fraction=eval_fraction)
    except ConfigError as err:
        assert "seq_len" in str(err)
        return
    parts = torch.cat([*c.train_shards, c.eval_data])
    assert sorted(parts.tolist()) == sorted(data)  # every byte in exactly one place
    assert min(s.numel() for s in c.train_shards) >= seq_len + 1
    assert c.eval_data.numel() >= max(eval_fraction * n, corpus_mod.MIN_EVAL_WINDOWS * seq_len + 1)


def test_split_rejects_too_small_corpus_and_bad_arguments():
    with pytest.raises(ConfigError, match="seq_len"):
        split_corpus(b"x" * 200, num_shards=4, seq_len=32)
    split_corpus(b"x" * 400, num_shards=4, seq_len=32)
    for kwargs, field in [
        ({"num_shards": 0, "seq_len": 8}, "num_shards"),
        ({"num_shards": 1, "seq_len": 0}, "seq_len"),
        ({"num_shards": 1, "seq_len": 8, "eval_fraction": 1.0}, "eval_fraction"),
    ]:
        with pytest.raises(ConfigError, match=field):
            split_corpus(b"x" * 1000, **kwargs)


@pytest.fixture(scope="module")
def shard():
    return split_corpus(load_corpus(max_bytes=SMALL), num_shards=2, seq_len=64).train_shards[1]


def draw(sampler: BatchSampler, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_reproducible_for_seed_and_different_across_seeds(shard):
    a = draw(BatchSampler(shard, batch_size=4, seq_len=64, seed=7), 3)
    b = draw(BatchSampler(shard, batch_size=4, seq_len=64, seed=7), 3)
    c = draw(BatchSampler(shard, batch_size=4, seq_len=64, seed=8), 3)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    assert not torch.equal(a[0][0], a[1][0])  # successive batches differ


def test_sampler_ignores_global_rng(shard):
    torch.manual_seed(0)
    a = BatchSampler(shard, batch_size=4, seq_len=64, seed=1).next_batch()
    torch.manual_seed(123)
    b = BatchSampler(shard, batch_size=4, seq_len=64, seed=1).next_batch()
    assert torch.equal(a[0], b[0])


def test_sampler_batches_are_shifted_windows_of_the_shard(shard):
    x, y = BatchSampler(shard, batch_size=8, seq_len=64, seed=0).next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])
    raw = bytes(shard.tolist())
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes([int(row_y[-1])])
        assert window in raw


def test_sampler_reaches_both_ends_of_a_tiny_shard():
    shard = torch.arange(10, dtype=torch.uint8)
    sampler = BatchSampler(shard, batch_size=64, seq_len=4, seed=0)
    starts = {int(v) for _ in range(4) for v in sampler.next_batch()[0][:, 0]}
    assert starts == set(range(6))  # every start in [0, len - seq_len - 1]


def test_sampler_state_dict_round_trip_resumes_same_sequence(shard):
    sampler = BatchSampler(shard, batch_size=4, seq_len=64, seed=5)
    draw(sampler, 3)
    state = json.loads(json.dumps(sampler.state_dict()))  # plain data, survives JSON
    expected = draw(sampler, 4)
    resumed = BatchSampler(shard, batch_size=4, seq_len=64, seed=999)
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected, draw(resumed, 4)):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    with pytest.raises(ValueError):
        resumed.load_state_dict({"batches_drawn": 1})


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="seq_len"):
        BatchSampler(torch.zeros(8, dtype=torch.uint8), batch_size=2, seq_len=8, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        BatchSampler(torch.zeros(80, dtype=torch.uint8), batch_size=0, seq_len=8, seed=0)


def test_eval_batches_are_deterministic_non_overlapping_windows():
    data = torch.arange(200, dtype=torch.uint8)
    batches = eval_batches(data, batch_size=4, seq_len=10, max_batches=3)
    assert len(batches) == 3 and all(x.shape == (4, 10) for x, _ in batches)
    again = eval_batches(data, batch_size=4, seq_len=10, max_batches=3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    xs = torch.cat([x for x, _ in batches])
    assert torch.equal(xs.flatten(), torch.arange(120))  # consecutive, from the start
    assert all(torch.equal(x + 1, y) for x, y in batches)
    short = eval_batches(data, batch_size=8, seq_len=10, max_batches=100)
    assert [x.shape[0] for x, _ in short] == [8, 8, 3]  # 19 windows: last batch partial
    with pytest.raises(ConfigError):
        eval_batches(data[:10], batch_size=1, seq_len=10, max_batches=1)


class _MeanTarget(torch.nn.Module):
    """Toy model whose 'loss' is the mean target value, to check evaluate's weighting."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(1, 1)
        self.seen_training: list[bool] = []

    def forward(self, x, y):
        self.seen_training.append(self.training)
        assert not torch.is_grad_enabled()
        return y.float().mean()


def test_evaluate_weights_by_targets_and_restores_modes():
    model = _MeanTarget()
    model.train()
    model.inner.eval()  # mixed modes must come back exactly as they were
    batches = [
        (torch.zeros(2, 3), torch.full((2, 3), 1.0)),
        (torch.zeros(1, 3), torch.full((1, 3), 4.0)),
    ]
    assert evaluate(model, batches) == pytest.approx((6 * 1.0 + 3 * 4.0) / 9)
    assert model.seen_training == [False, False]
    assert model.training and not model.inner.training
    with pytest.raises(ValueError):
        evaluate(model, [])


def test_corpus_default_cache_is_used(monkeypatch):
    load_corpus(max_bytes=SMALL)
    monkeypatch.setattr(corpus_mod, "default_corpus_files", lambda: pytest.fail("re-read"))
    assert len(load_corpus(max_bytes=SMALL)) == SMALL
