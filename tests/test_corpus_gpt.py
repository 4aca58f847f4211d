"""Tests of the embedded demo data (cbs_tracker.demo.corpus) and the small GPT (cbs_tracker.demo.gpt)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cbs_tracker.demo import corpus as corpus_mod
from cbs_tracker.demo.corpus import (
    SequenceStream,
    corpus_files,
    evaluate,
    load_corpus,
    sample_batch,
    stdlib_root,
    validation_starts,
    windows,
)
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

torch.set_num_threads(1)

SMALL = 200_000  # bytes: enough for a few hundred windows, read in ~10 ms


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A small directory tree shaped like a standard library."""
    files = {
        "b.py": b"print('b')\n",
        "a.py": b"import os\n",
        "a/z.py": b"# a/z\n",
        "a_b.py": b"x = 1\n",
        "test/test_x.py": b"def test(): pass\n",
        "site-packages/pkg/mod.py": b"EXCLUDED\n",
        "dist-packages/mod.py": b"EXCLUDED\n",
        "pkg/__pycache__/c.py": b"EXCLUDED\n",
        "notes.txt": b"EXCLUDED\n",
        "pkg/c.pyc": b"EXCLUDED\n",
    }
    for rel, data in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return tmp_path


# ---------------------------------------------------------------- corpus files and splits


def test_corpus_files_sorted_relative_paths_without_site_packages(fake_root: Path) -> None:
    rel = [p.relative_to(fake_root).as_posix() for p in corpus_files(fake_root)]
    # Plain string order of the "/"-joined relative paths ("." < "/" < "_").
    assert rel == ["a.py", "a/z.py", "a_b.py", "b.py", "test/test_x.py"]


def test_load_corpus_concatenates_and_holds_out_last_percent(fake_root: Path) -> None:
    corpus_mod._CACHE.clear()
    expected = b"".join(
        (fake_root / r).read_bytes() for r in ["a.py", "a/z.py", "a_b.py", "b.py", "test/test_x.py"]
    )
    c = load_corpus(root=fake_root, val_fraction=0.1)
    assert c.num_files == 5 and c.num_bytes == len(expected)
    num_val = math.floor(0.1 * len(expected))
    assert bytes(c.val) == expected[len(expected) - num_val :]
    assert bytes(c.train) == expected[: len(expected) - num_val]
    assert c.train.dtype == np.uint8 and c.val.dtype == np.uint8
    assert not c.train.flags.writeable  # shared cache: nobody may write into it


def test_stdlib_corpus_is_every_stdlib_file_and_val_is_last_percent() -> None:
    c = load_corpus()
    files = corpus_files()
    assert c.num_files == len(files) > 100
    assert c.num_bytes == sum(p.stat().st_size for p in files)
    assert c.val.size == math.floor(0.01 * c.num_bytes)
    # The validation split is the tail of the last files in sorted order.
    tail = b"".join(p.read_bytes() for p in files[-40:])
    assert bytes(c.val) == tail[-c.val.size :]
    assert not any("site-packages" in p.parts for p in files)
    assert all(Path(stdlib_root()) in p.parents for p in files)


def test_load_corpus_deterministic_and_max_bytes_is_prefix() -> None:
    corpus_mod._CACHE.clear()
    a = load_corpus(max_bytes=SMALL)
    corpus_mod._CACHE.clear()
    b = load_corpus(max_bytes=SMALL)
    assert a.num_bytes == SMALL
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.val.size == SMALL // 100
    first = b"".join(p.read_bytes() for p in corpus_files()[: a.num_files])
    assert bytes(a.train) + bytes(a.val) == first[:SMALL]
    # A cached load returns views of the same bytes.
    assert load_corpus(max_bytes=SMALL).train.base is b.train.base


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"max_bytes": 10},
            ValueError,
            r"load_corpus: max_bytes=10 is not allowed; it must be >= 1024",
        ),
        ({"max_bytes": 1e6}, TypeError, r"load_corpus: max_bytes must be an int, got float"),
        (
            {"val_fraction": 1.0},
            ValueError,
            r"val_fraction=1.0 is not allowed; it must be in \(0, 1\)",
        ),
        ({"val_fraction": "1%"}, TypeError, r"val_fraction must be a float, got str"),
        (
            {"root": "/nonexistent-cbs-dir"},
            ValueError,
            r"root='/nonexistent-cbs-dir' is not a directory",
        ),
    ],
)
def test_load_corpus_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_corpus(**kwargs)


def test_load_corpus_empty_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \.py bytes found under root="):
        load_corpus(root=tmp_path)


# ---------------------------------------------------------------- windows and sampling


def test_windows_targets_are_inputs_shifted_by_one() -> None:
    data = np.arange(50, dtype=np.uint8)
    x, y = windows(data, np.array([0, 7, 41]), 8)
    assert x.dtype == torch.int64 and x.shape == (3, 8) == y.shape
    assert x[1].tolist() == list(range(7, 15)) and y[1].tolist() == list(range(8, 16))
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert y[2, -1].item() == 49  # last valid start reaches the last byte
    with pytest.raises(ValueError, match=r"windows: starts must lie in \[0, 41\] for seq_len=8"):
        windows(data, np.array([42]), 8)
    with pytest.raises(TypeError, match=r"windows: data must be a 1-D numpy uint8 array"):
        windows(np.arange(50), np.array([0]), 8)


def test_sample_batch_reproducible_and_shifted() -> None:
    c = load_corpus(max_bytes=SMALL)
    x1, y1 = sample_batch(c.train, 6, 32, torch.Generator().manual_seed(3))
    x2, y2 = sample_batch(c.train, 6, 32, torch.Generator().manual_seed(3))
    assert x1.shape == (6, 32) and x1.dtype == torch.int64
    torch.testing.assert_close(x1, x2)
    torch.testing.assert_close(x1[:, 1:], y1[:, :-1])
    with pytest.raises(ValueError, match=r"sample_batch: batch_sequences=0 is not allowed"):
        sample_batch(c.train, 0, 32)


def test_stream_order_independent_of_microbatch_split() -> None:
    data = load_corpus(max_bytes=SMALL).train
    one = SequenceStream(data, seq_len=64, seed=5, block_size=7)  # blocks cross the batches
    two = SequenceStream(data, seq_len=64, seed=5, block_size=7)
    for _ in range(4):
        x, y = one.next_batch(8)  # A = 1, 8 sequences
        parts = [two.next_batch(4) for _ in range(2)]  # A = 2, 4 sequences each
        torch.testing.assert_close(x, torch.cat([p[0] for p in parts]))
        torch.testing.assert_close(y, torch.cat([p[1] for p in parts]))
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert one.position == two.position == 32


def test_stream_ranks_slice_the_global_batch() -> None:
    data = load_corpus(max_bytes=SMALL).train
    single = SequenceStream(data, seq_len=16, seed=1)
    ranks = [SequenceStream(data, seq_len=16, seed=1) for _ in range(3)]
    for _ in range(2):
        x, _ = single.next_batch(6)
        per_rank = [s.next_batch(2, rank=r, world_size=3)[0] for r, s in enumerate(ranks)]
        torch.testing.assert_close(x, torch.cat(per_rank))
    assert {s.position for s in ranks} == {single.position}


def test_stream_is_pure_in_seed_and_index_and_resumes() -> None:
    data = load_corpus(max_bytes=SMALL).train
    s = SequenceStream(data, seq_len=32, seed=0, block_size=16)
    starts = s.starts(0, 100)
    assert starts.min() >= 0 and starts.max() <= data.size - 33
    np.testing.assert_array_equal(s.starts(37, 20), starts[37:57])
    # Independent truth for the definition: block j is default_rng([seed, j]).integers(...).
    block1 = np.random.default_rng([0, 1]).integers(0, data.size - 32, size=16, dtype=np.int64)
    np.testing.assert_array_equal(starts[16:32], block1)
    assert not np.array_equal(SequenceStream(data, seq_len=32, seed=1).starts(0, 100), starts)

    s.next_batch(5)
    state = s.state_dict()
    expected = s.next_batch(3)
    resumed = SequenceStream(data, seq_len=32, seed=0, block_size=16)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed.next_batch(3), expected)
    with pytest.raises(ValueError, match=r"seed=0 in the state differs from this stream's seed=9"):
        SequenceStream(data, seq_len=32, seed=9, block_size=16).load_state_dict(state)
    with pytest.raises(KeyError, match=r"missing key 'position'"):
        resumed.load_state_dict({"version": 1})


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda d: SequenceStream(d, seq_len=0),
            ValueError,
            r"SequenceStream: seq_len=0 is not allowed; it must be >= 1",
        ),
        (
            lambda d: SequenceStream(d, seq_len=8, seed=-1),
            ValueError,
            r"SequenceStream: seed=-1 is not allowed",
        ),
        (
            lambda d: SequenceStream(d, seq_len=8, seed=1.5),
            TypeError,
            r"SequenceStream: seed must be an int, got float",
        ),
        (
            lambda d: SequenceStream(d[:8], seq_len=8),
            ValueError,
            r"seq_len=8 needs at least 9 bytes, data has 8",
        ),
        (
            lambda d: SequenceStream(d, seq_len=8).next_batch(2, rank=2, world_size=2),
            ValueError,
            r"rank=2 is not allowed; it must be < world_size=2",
        ),
        (
            lambda d: SequenceStream(list(d), seq_len=8),
            TypeError,
            r"data must be a 1-D numpy uint8 array, got list",
        ),
    ],
)
def test_stream_errors(call, error: type, match: str) -> None:
    data = np.arange(100, dtype=np.uint8)
    with pytest.raises(error, match=match):
        call(data)


def test_validation_starts_evenly_spaced_over_val() -> None:
    val = np.zeros(1001, dtype=np.uint8)
    starts = validation_starts(val, 100, 11)
    assert starts.tolist() == [j * 90 for j in range(11)]  # last start = 1001 - 100 - 1
    assert validation_starts(val, 100, 1).tolist() == [0]


# ---------------------------------------------------------------- the GPT


def test_default_gpt_size_and_tied_head() -> None:
    model = GPT()
    c = model.config
    d, v, t, n = c.d_model, c.vocab_size, c.context_length, c.n_layer
    per_block = (
        2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    )
    assert model.num_parameters() == v * d + t * d + n * per_block + 2 * d == 445_952
    assert model.lm_head.weight is model.wte.weight
    assert GPT(GPTConfig(tie_weights=False)).num_parameters() == 445_952 + v * d
    assert GPT(GPTConfig.preset("10m")).num_parameters() >= 10_000_000


def test_init_follows_nanogpt() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, d_model=256, n_head=4))
    qkv = model.blocks[0].attn.c_attn.weight
    proj = model.blocks[0].mlp.c_proj.weight
    # Sample std of ~2e5 normal draws: relative error ~ 1/sqrt(2 n) < 0.2%; allow 3%.
    assert qkv.std().item() == pytest.approx(0.02, rel=0.03)
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
    assert model.blocks[0].attn.c_attn.bias.abs().max().item() == 0.0


def test_loss_at_init_is_log_vocab() -> None:
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 256, (64, 128))
    targets = torch.randint(0, 256, (64, 128))
    _, loss = model(idx, targets)
    # Logits z = ln_f(h) . w with w ~ N(0, 0.02^2) and unit-variance LayerNorm outputs:
    # Var z = d 0.02^2 = 0.0512, and E logsumexp ~ ln V + Var z / 2 for small Var z, so
    # E loss ~ ln 256 + 0.0256 (targets independent of logits). Second-order error and the
    # sampling error over 8192 positions (~0.003) stay well below 0.015.
    expected = math.log(256) + 0.5 * 128 * 0.02**2
    assert loss.item() == pytest.approx(expected, abs=0.015)
    assert loss.item() > math.log(256)


def test_ignore_index_means_over_labelled_tokens() -> None:
    torch.manual_seed(1)
    model = GPT()
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    targets[0, :5] = -100
    targets[1, 10:] = 7
    logits, loss = model(idx, targets)
    mask = targets != -100
    manual = -F.log_softmax(logits, -1)[mask].gather(-1, targets[mask][:, None]).mean()
    torch.testing.assert_close(loss, manual)
    assert logits.shape == (2, 16, 256)
    # Any ignore_index value works: 7 marks the unlabelled positions here.
    targets_7 = torch.where(mask, targets, torch.full_like(targets, 7))
    _, loss_7 = model(idx, targets_7, ignore_index=7)
    mask7 = targets_7 != 7
    manual_7 = -F.log_softmax(logits, -1)[mask7].gather(-1, targets_7[mask7][:, None]).mean()
    torch.testing.assert_close(loss_7, manual_7)


def test_causal_masking() -> None:
    torch.manual_seed(2)
    model = GPT().eval()
    idx = torch.randint(0, 256, (1, 40))
    changed = idx.clone()
    changed[0, 25] = (idx[0, 25] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :25], b[:, :25], rtol=0, atol=1e-6)
    assert (a[:, 25:] - b[:, 25:]).abs().max() > 1e-4  # the change is seen from position 25 on


def test_adamw_steps_reduce_validation_loss() -> None:
    torch.manual_seed(0)
    c = load_corpus(max_bytes=100_000)
    model = GPT()
    stream = SequenceStream(c.train, seq_len=64, seed=0)
    optimizer = make_adamw(model, lr=3e-3, weight_decay=0.1)
    before = evaluate(model, c.val, seq_len=64, num_sequences=32)
    for _ in range(30):
        x, y = stream.next_batch(16)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = evaluate(model, c.val, seq_len=64, num_sequences=32)
    # Bytes of Python source have far less than ln 256 nats of entropy: 30 steps learn the
    # unigram/bigram statistics (a drop of more than 1.5 nats in practice).
    assert before > 5.0 and after < before - 1.0


def test_evaluate_matches_model_loss_and_restores_mode() -> None:
    torch.manual_seed(3)
    c = load_corpus(max_bytes=SMALL)
    model = GPT().train()
    got = evaluate(model, c.val, seq_len=32, num_sequences=10, batch=3)
    assert model.training
    x, y = windows(c.val, validation_starts(c.val, 32, 10), 32)
    with torch.no_grad():
        _, loss = model.eval()(x, y)
    assert got == pytest.approx(loss.item(), rel=1e-5)


def test_make_adamw_decays_only_matrices() -> None:
    model = GPT()
    opt = make_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(
        p.dim() == 1 for p in no_decay["params"]
    )
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_parameters()
    assert any(p is model.wte.weight for p in decay["params"])
    with pytest.raises(ValueError, match=r"make_adamw: lr=0 is not allowed; it must be > 0"):
        make_adamw(model, lr=0, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"make_adamw: weight_decay=-1 is not allowed"):
        make_adamw(model, lr=1e-3, weight_decay=-1)
    with pytest.raises(TypeError, match=r"make_adamw: lr must be a float, got str"):
        make_adamw(model, lr="1e-3", weight_decay=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_layer": 0}, ValueError, r"GPTConfig: n_layer=0 is not allowed; it must be >= 1"),
        ({"d_model": 130}, ValueError, r"GPTConfig: d_model=130 must be divisible by n_head=4"),
        ({"n_head": 2.0}, TypeError, r"GPTConfig: n_head must be an int, got float"),
        (
            {"dropout": 1.0},
            ValueError,
            r"GPTConfig: dropout=1.0 is not allowed; it must be in \[0, 1\)",
        ),
        ({"dropout": None}, TypeError, r"GPTConfig: dropout must be a float, got NoneType"),
        ({"tie_weights": 1}, TypeError, r"GPTConfig: tie_weights must be a bool, got 1"),
    ],
)
def test_gpt_config_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GPTConfig(**kwargs)


def test_gpt_config_keyword_only_presets_and_forward_errors() -> None:
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
    assert GPTConfig.preset("demo") == GPTConfig()
    assert GPTConfig.preset("10m", context_length=512).context_length == 512
    with pytest.raises(
        ValueError,
        match=r"GPTConfig.preset: name='huge' is not allowed; choose one of \['10m', 'demo', 'gpt2-medium', 'gpt2-small'\]",
    ):
        GPTConfig.preset("huge")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"GPT: config must be a GPTConfig, got dict"):
        GPT({"n_layer": 2})  # type: ignore[arg-type]
    model = GPT(GPTConfig(context_length=8))
    with pytest.raises(
        ValueError, match=r"GPT.forward: sequence length 9 exceeds context_length=8"
    ):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"GPT.forward: targets shape \(1, 4\) differs from idx shape \(1, 8\)"
    ):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_gpt2_presets_have_gpt2s_parameter_counts_without_being_built() -> None:
    """The count from the shape is the built model's (every preset small enough to build here, and GPT-2's
    shapes with one layer and a small vocabulary); at full size it is GPT-2's published 124M and 350M."""
    for config in (GPTConfig.preset("demo"), GPTConfig.preset("10m"), GPTConfig(bias=False, tie_weights=False),
                   GPTConfig.preset("gpt2-small", n_layer=1, vocab_size=300, context_length=64),
                   GPTConfig.preset("gpt2-medium", n_layer=1, vocab_size=300, context_length=64)):
        assert config.num_parameters() == GPT(config).num_parameters(), config
    small, medium = GPTConfig.preset("gpt2-small"), GPTConfig.preset("gpt2-medium")
    assert (small.n_layer, small.d_model, small.n_head, small.context_length, small.vocab_size) == (12, 768, 12, 1024, 50257)
    assert (medium.n_layer, medium.d_model, medium.n_head) == (24, 1024, 16)
    assert small.num_parameters() == 124_439_808 and medium.num_parameters() == 354_823_168
