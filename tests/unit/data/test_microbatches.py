"""Micro-batch id -> tensor must be a pure function: same everywhere, every time, any order.

The synthetic source is tested here; the Nanoset source (folders, blends, stages) in test_nanoset.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.config import NanosetDatasetsArgs
from nanotron_recover.data.microbatches import (
    MicroBatchSource,
    SyntheticMicroBatches,
    build_microbatch_source,
)
from nanotron_recover.errors import InputError

VOCAB = 1000
L = 8


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


def test_negative_ids_and_bad_arguments():
    with pytest.raises(ValueError, match="microbatch_id must be >= 0"):
        SyntheticMicroBatches(10, 2, 4, 0).get(-1)
    with pytest.raises(ValueError, match="seed"):
        SyntheticMicroBatches(10, 2, 4, -1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        SyntheticMicroBatches(10, 0, 4, 0)


def test_build_synthetic_source():
    src = build_microbatch_source(None, vocab_size=VOCAB, micro_batch_size=2, sequence_length=L, seed=3)
    assert isinstance(src, SyntheticMicroBatches)
    assert torch.equal(src.get(5), SyntheticMicroBatches(VOCAB, 2, L, 3).get(5))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer, got 0"),
        ({"sequence_length": 0}, "sequence_length must be a positive integer, got 0"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
    ],
)
@pytest.mark.parametrize("synthetic", [True, False], ids=["synthetic", "nanoset"])
def test_bad_arguments_are_input_errors(tmp_path, kwargs, expected, synthetic):
    # Arguments are checked before any folder is opened (this one does not exist).
    dataset = None if synthetic else NanosetDatasetsArgs(dataset_folder=str(tmp_path / "nope"))
    args = {"vocab_size": VOCAB, "micro_batch_size": 1, "sequence_length": L, "seed": 0, **kwargs}
    with pytest.raises(InputError, match=expected):
        build_microbatch_source(dataset, **args)


def test_missing_dataset_folder(tmp_path):
    dataset = NanosetDatasetsArgs(dataset_folder=str(tmp_path / "nope"))
    with pytest.raises(
        InputError, match="does not exist: tokenize a corpus into it with `nanotron-recover preprocess`"
    ):
        build_microbatch_source(dataset, vocab_size=VOCAB, micro_batch_size=1, sequence_length=4, seed=0)


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, 400), min_size=1, max_size=12),
    seed=st.integers(0, 2**32),
    mbs=st.integers(1, 7),
)
def test_synthetic_get_is_a_pure_function_of_the_id(ids, seed, mbs):
    synth = SyntheticMicroBatches(VOCAB, mbs, L, seed)
    for m in ids:  # arbitrary order and repeats
        assert torch.equal(synth.get(m), SyntheticMicroBatches(VOCAB, mbs, L, seed).get(m))


def test_a_corpus_trains_with_any_spelling_of_its_tokenizer_and_not_with_another(
    local_dataset, tmp_path, monkeypatch
):
    """The check training runs at start-up: the folder's recorded fingerprint against the config's
    tokenizer, however it is spelled; a tokenizer trained with another vocabulary is refused."""
    from nanotron_recover.data import tokenization
    from nanotron_recover.data.local_corpus import build_local_tokenizer

    tokenization._fingerprint_of.cache_clear()
    ds = NanosetDatasetsArgs(dataset_folder=str(local_dataset.corpus_dir))
    kwargs = {"vocab_size": 512, "micro_batch_size": 1, "sequence_length": 8, "seed": 0}
    tok = local_dataset.tokenizer_dir
    monkeypatch.chdir(tok.parent)
    for spelling in (str(tok / "tokenizer.json"), "tokenizer", "tokenizer/tokenizer.json", f"{tok}/"):
        assert build_microbatch_source(ds, tokenizer_name_or_path=spelling, **kwargs).get(0).shape == (1, 9)
    other = str(build_local_tokenizer(tmp_path / "other", vocab_size=300))
    with pytest.raises(InputError) as info:
        build_microbatch_source(ds, tokenizer_name_or_path=other, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"dataset folder {str(local_dataset.corpus_dir)!r} was tokenized with {str(tok)!r} (sha256:"
    )
    assert f"), not tokenizer.tokenizer_name_or_path {other!r} (sha256:" in message
    assert message.endswith(
        f"a different tokenizer; tokenize it again with `nanotron-recover preprocess --tokenizer {other}`, "
        "or set validate_tokenizer: false on the dataset"
    )
    with pytest.raises(InputError, match=f"not tokenizer_name {other!r} \\(sha256:"):
        build_microbatch_source(
            NanosetDatasetsArgs(dataset_folder=str(local_dataset.corpus_dir), tokenizer_name=other), **kwargs
        )
    tokenization._fingerprint_of.cache_clear()
