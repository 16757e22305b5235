"""Micro-batch id -> tensor must be a pure function: same everywhere, every time, any order."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.data.corpus import INDEX_FILE, TOKENS_FILE, CorpusWriter, TokenCorpus
from nanotron_recover.data.microbatches import (
    CorpusMicroBatches,
    MicroBatchSource,
    SyntheticMicroBatches,
    build_microbatch_source,
)
from nanotron_recover.errors import InputError

VOCAB = 1000
L = 8


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A corpus whose token at position p is p % 997 (+1), so every sample is identifiable."""
    folder = tmp_path_factory.mktemp("mb") / "corpus"
    rng = np.random.default_rng(0)
    with CorpusWriter(folder, VOCAB, "t", 0) as writer:
        pos = 0
        while pos < 8 * 60:  # a bit more than 60 samples of L=8
            n = int(rng.integers(1, 30))
            writer.add_document(np.arange(pos, pos + n) % 997 + 1)
            pos += n + 1
    return folder


def make(corpus_dir, mbs=4, seed=1234):
    # A fresh TokenCorpus + source each time simulates an independent process.
    return CorpusMicroBatches(TokenCorpus.open(corpus_dir), mbs, L, seed)


def test_same_id_identical_across_independent_sources(corpus_dir):
    a, b = make(corpus_dir), make(corpus_dir)
    for m in [0, 1, 7, 3, 1000, 0]:
        assert torch.equal(a.get(m), b.get(m))


def test_shape_and_dtype_and_rows_are_corpus_samples(corpus_dir):
    src = make(corpus_dir)
    assert isinstance(src, MicroBatchSource)
    batch = src.get(5)
    assert batch.shape == (4, L + 1) and batch.dtype == torch.int64
    corpus = TokenCorpus.open(corpus_dir)
    for row, i in zip(batch, src.sample_indices(5), strict=True):
        assert row.tolist() == corpus.sample(i, L).tolist()


def test_different_ids_and_seeds_differ(corpus_dir):
    src = make(corpus_dir)
    batches = [src.get(m) for m in range(10)]
    for i in range(10):
        for j in range(i + 1, 10):
            assert not torch.equal(batches[i], batches[j])
    assert not torch.equal(make(corpus_dir, seed=1).get(0), make(corpus_dir, seed=2).get(0))


def test_each_epoch_uses_every_sample_exactly_once(tmp_path):
    with CorpusWriter(tmp_path / "c", VOCAB, "t", 0) as writer:
        writer.add_document(np.arange(1, 8 * 24 + 1) % VOCAB)  # 193+1 tokens -> 24 samples of L=8
    corpus = TokenCorpus.open(tmp_path / "c")
    n = corpus.num_samples(L)
    assert n == 24
    mbs = 6  # divides n: 4 micro-batches per epoch
    src = CorpusMicroBatches(corpus, mbs, L, seed=7)
    epochs = []
    for e in range(3):
        rows = [i for m in range(e * n // mbs, (e + 1) * n // mbs) for i in src.sample_indices(m)]
        assert sorted(rows) == list(range(n))
        epochs.append(rows)
        # And the tensors really contain those samples.
        got = {tuple(r) for m in range(e * n // mbs, (e + 1) * n // mbs) for r in src.get(m).tolist()}
        assert got == {tuple(corpus.sample(i, L).tolist()) for i in range(n)}
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch


def test_rows_straddling_an_epoch_boundary(tmp_path):
    with CorpusWriter(tmp_path / "c", VOCAB, "t", 0) as writer:
        writer.add_document(np.arange(1, 8 * 10 + 1))  # 10 samples
    src = CorpusMicroBatches(TokenCorpus.open(tmp_path / "c"), 3, L, seed=0)  # 3 does not divide 10
    rows = [i for m in range(10) for i in src.sample_indices(m)]  # 30 slots = 3 epochs
    for e in range(3):
        assert sorted(rows[e * 10 : (e + 1) * 10]) == list(range(10))


def test_permutation_cache_is_bounded(corpus_dir):
    src = make(corpus_dir)
    for m in range(0, 2000, 37):
        src.get(m)
    assert len(src._permutations) <= 2


def test_synthetic_is_deterministic_and_in_range():
    a = SyntheticMicroBatches(50, 3, 16, seed=9)
    b = SyntheticMicroBatches(50, 3, 16, seed=9)
    assert isinstance(a, MicroBatchSource)
    for m in [4, 0, 4, 123456789]:
        x = a.get(m)
        assert x.shape == (3, 17) and x.dtype == torch.int64
        assert int(x.min()) >= 0 and int(x.max()) < 50
        assert torch.equal(x, b.get(m))
    assert not torch.equal(a.get(0), a.get(1))
    assert not torch.equal(a.get(0), SyntheticMicroBatches(50, 3, 16, seed=10).get(0))
    # Big enough draws cover the whole range, including vocab_size - 1.
    assert set(SyntheticMicroBatches(5, 8, 64, 0).get(0).unique().tolist()) == set(range(5))


def test_negative_ids_and_bad_arguments(corpus_dir):
    for src in (make(corpus_dir), SyntheticMicroBatches(10, 2, 4, 0)):
        with pytest.raises(ValueError, match="microbatch_id must be >= 0"):
            src.get(-1)
    with pytest.raises(ValueError, match="seed"):
        SyntheticMicroBatches(10, 2, 4, -1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        SyntheticMicroBatches(10, 0, 4, 0)


def test_build_source(corpus_dir):
    synth = build_microbatch_source(None, vocab_size=77, micro_batch_size=2, sequence_length=5, seed=3)
    assert isinstance(synth, SyntheticMicroBatches) and synth.get(0).shape == (2, 6)
    src = build_microbatch_source(
        corpus_dir, vocab_size=VOCAB, micro_batch_size=4, sequence_length=L, seed=1234
    )
    assert isinstance(src, CorpusMicroBatches)
    assert torch.equal(src.get(3), make(corpus_dir).get(3))
    # A larger model vocab than the corpus's is fine (e.g. padded embeddings).
    build_microbatch_source(
        str(corpus_dir), vocab_size=VOCAB + 24, micro_batch_size=4, sequence_length=L, seed=0
    )


def test_vocab_mismatch_is_an_input_error_naming_both_sizes(corpus_dir):
    with pytest.raises(
        InputError,
        match=r"vocab_size 1000 but the model's vocab_size is 512: set model.model_config.vocab_size",
    ):
        build_microbatch_source(corpus_dir, vocab_size=512, micro_batch_size=4, sequence_length=L, seed=0)


def test_tokenizer_is_checked_only_when_asked(corpus_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {"vocab_size": VOCAB, "micro_batch_size": 4, "sequence_length": L, "seed": 0}
    # The corpus records tokenizer "t" (and no fingerprint, so names are compared).
    build_microbatch_source(corpus_dir, **kwargs)
    build_microbatch_source(corpus_dir, tokenizer_name_or_path="t", **kwargs)
    with pytest.raises(InputError, match=r"tokenized with 't' but tokenizer.tokenizer_name_or_path is 'u'"):
        build_microbatch_source(corpus_dir, tokenizer_name_or_path="u", **kwargs)
    # Synthetic data has no tokenizer to disagree with.
    build_microbatch_source(None, tokenizer_name_or_path="u", **kwargs)


def test_corpus_from_another_tokenizer_is_refused(local_dataset, tmp_path, monkeypatch):
    from nanotron_recover.data.local_corpus import build_local_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {"vocab_size": 512, "micro_batch_size": 2, "sequence_length": 16, "seed": 0}
    src = build_microbatch_source(
        local_dataset.corpus_dir, tokenizer_name_or_path=str(local_dataset.tokenizer_dir), **kwargs
    )
    assert src.get(0).shape == (2, 17)
    other = build_local_tokenizer(tmp_path / "other", vocab_size=400)
    with pytest.raises(InputError, match="different vocabulary or merges"):
        build_microbatch_source(local_dataset.corpus_dir, tokenizer_name_or_path=str(other), **kwargs)


def test_corpus_too_small_for_sequence_length(corpus_dir):
    with pytest.raises(InputError, match="sequence_length 100000") as info:
        build_microbatch_source(
            corpus_dir, vocab_size=VOCAB, micro_batch_size=1, sequence_length=100_000, seed=0
        )
    message = str(info.value)
    assert "\n" not in message
    assert str(corpus_dir / TOKENS_FILE) in message and "100001 needed" in message


def copy_corpus(corpus_dir, tmp_path):
    return shutil.copytree(corpus_dir, tmp_path / "copy")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / TOKENS_FILE).write_bytes((d / TOKENS_FILE).read_bytes()[:-4]), "truncated"),
        (lambda d: (d / TOKENS_FILE).write_bytes((d / TOKENS_FILE).read_bytes()[:-1]), "not a whole number"),
        (lambda d: (d / INDEX_FILE).unlink(), "is missing"),
        (lambda d: (d / INDEX_FILE).write_text("{"), "not valid JSON"),
        (lambda d: (d / INDEX_FILE).write_text('{"format_version": 1, "num_tokens": 4}'), "missing field"),
    ],
    ids=["truncated", "partial-token", "no-index", "index-not-json", "index-missing-keys"],
)
def test_a_damaged_corpus_is_refused_when_the_source_is_built(corpus_dir, tmp_path, damage, expected):
    # At construction, not at the first get(): the trainer builds every stage's source at start-up.
    folder = copy_corpus(corpus_dir, tmp_path)
    damage(folder)
    with pytest.raises(InputError, match=expected) as info:
        build_microbatch_source(folder, vocab_size=VOCAB, micro_batch_size=1, sequence_length=L, seed=0)
    assert "\n" not in str(info.value)
    assert str(folder) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer, got 0"),
        ({"sequence_length": 0}, "sequence_length must be a positive integer, got 0"),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
    ],
)
@pytest.mark.parametrize("synthetic", [True, False], ids=["synthetic", "corpus"])
def test_bad_arguments_are_input_errors(corpus_dir, kwargs, expected, synthetic):
    args = {"vocab_size": VOCAB, "micro_batch_size": 1, "sequence_length": L, "seed": 0, **kwargs}
    with pytest.raises(InputError, match=expected):
        build_microbatch_source(None if synthetic else corpus_dir, **args)


def test_missing_dataset_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nanotron-recover preprocess"):
        build_microbatch_source(
            tmp_path / "nope", vocab_size=VOCAB, micro_batch_size=1, sequence_length=4, seed=0
        )


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, 400), min_size=1, max_size=12),
    seed=st.integers(0, 2**32),
    mbs=st.integers(1, 7),
)
def test_get_is_a_pure_function_of_the_id(corpus_dir, ids, seed, mbs):
    # Reference: every id computed by its own, brand-new source (no cache, no history).
    corpus = TokenCorpus.open(corpus_dir)
    reference = {m: CorpusMicroBatches(corpus, mbs, L, seed).get(m) for m in set(ids)}
    shared = CorpusMicroBatches(corpus, mbs, L, seed)
    for m in ids:  # arbitrary order, repeats, cache evictions
        assert torch.equal(shared.get(m), reference[m])
    synth = SyntheticMicroBatches(VOCAB, mbs, L, seed)
    for m in ids:
        assert torch.equal(synth.get(m), SyntheticMicroBatches(VOCAB, mbs, L, seed).get(m))
