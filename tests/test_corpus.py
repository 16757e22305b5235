"""The on-disk corpus: round trips, dtype choice, sample windows and every clear-error case."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanotron_recover.data.corpus import (
    INDEX_FILE,
    TOKENS_FILE,
    CorpusIndex,
    CorpusWriter,
    TokenCorpus,
    dtype_for_vocab,
)

EOS = 3


def write_corpus(folder, docs, vocab_size=100, eos=EOS):
    with CorpusWriter(folder, vocab_size, "test-tokenizer", eos) as writer:
        for doc in docs:
            writer.add_document(doc)
    return writer.close()


def flat(docs, eos=EOS):
    out = []
    for doc in docs:
        out += list(doc) + [eos]
    return out


DOCS = [[10, 11, 12], [20, 21], list(range(30, 45)), [50]]


def test_round_trip_counts_and_tokens(tmp_path):
    index = write_corpus(tmp_path / "c", DOCS)
    expected = flat(DOCS)
    assert index.num_tokens == len(expected)
    assert index.num_documents == len(DOCS)
    assert index.complete and index.dtype == "uint16" and index.eos_token_id == EOS
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_tokens == len(expected)
    assert corpus.vocab_size == 100
    assert corpus.index == CorpusIndex.read(tmp_path / "c")
    assert corpus.tokens.tolist() == expected
    # Raw file really is little-endian uint16.
    raw = np.fromfile(tmp_path / "c" / TOKENS_FILE, dtype="<u2")
    assert raw.tolist() == expected


def test_samples_are_windows_of_l_plus_one_overlapping_by_one(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    corpus = TokenCorpus.open(tmp_path / "c")
    expected = flat(DOCS)
    L = 4
    n = corpus.num_samples(L)
    assert n == (len(expected) - 1) // L
    for i in range(n):
        s = corpus.sample(i, L)
        assert s.dtype == np.int64 and s.shape == (L + 1,)
        assert s.tolist() == expected[i * L : i * L + L + 1]
        if i > 0:
            assert s[0] == corpus.sample(i - 1, L)[-1]


def test_samples_are_writable_copies(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    corpus = TokenCorpus.open(tmp_path / "c")
    s = corpus.sample(0, 4)
    s[:] = 0  # must not touch the read-only memory map
    assert corpus.sample(0, 4).tolist() == flat(DOCS)[:5]


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(1, "uint16"), (65535, "uint16"), (65536, "uint32"), (200_000, "uint32")]
)
def test_dtype_chosen_by_vocab(tmp_path, vocab, dtype):
    assert dtype_for_vocab(vocab) == np.dtype(dtype)
    top = vocab - 1
    index = write_corpus(tmp_path / "c", [[top, 0]], vocab_size=vocab, eos=0)
    assert index.dtype == dtype
    assert (tmp_path / "c" / TOKENS_FILE).stat().st_size == 3 * np.dtype(dtype).itemsize
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == [top, 0, 0]


def test_out_of_vocab_id_is_rejected_naming_the_id(tmp_path):
    with pytest.raises(ValueError, match="token id 100 .*vocab_size 100"):
        with CorpusWriter(tmp_path / "c", 100, "t", EOS) as writer:
            writer.add_document([1, 100, 2])


def test_negative_id_and_bad_eos_rejected(tmp_path):
    with pytest.raises(ValueError, match="-1"):
        with CorpusWriter(tmp_path / "c", 100, "t", EOS) as writer:
            writer.add_document(np.array([1, -1]))
    with pytest.raises(ValueError, match="eos_token_id 100"):
        CorpusWriter(tmp_path / "d", 100, "t", 100)


def test_numpy_input_and_large_documents_flush(tmp_path, monkeypatch):
    import nanotron_recover.data.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "_FLUSH_TOKENS", 7)  # force many partial flushes
    docs = [np.arange(i, i + 5, dtype=np.int32) for i in range(20)]
    write_corpus(tmp_path / "c", docs)
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == flat([d.tolist() for d in docs])


def test_index_json_contents_and_extra_fields_round_trip(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    data = json.loads((tmp_path / "c" / INDEX_FILE).read_text())
    for key in (
        "format_version",
        "dtype",
        "num_tokens",
        "num_documents",
        "vocab_size",
        "tokenizer",
        "eos_token_id",
    ):
        assert key in data
    assert data["complete"] is True
    assert data["tokenizer"] == "test-tokenizer"
    # A newer writer's unknown field survives a read/write cycle.
    data["future_field"] = {"x": 1}
    index = CorpusIndex.from_json(json.dumps(data))
    assert index.extra == {"future_field": {"x": 1}}
    assert json.loads(index.to_json()) == data


def test_index_rejects_newer_format_and_missing_fields():
    good = CorpusIndex(10, 1, 100, "uint16", "t", 3)
    data = json.loads(good.to_json())
    with pytest.raises(ValueError, match="format_version"):
        CorpusIndex.from_json(json.dumps({**data, "format_version": 99}))
    del data["num_tokens"]
    with pytest.raises(ValueError, match="num_tokens"):
        CorpusIndex.from_json(json.dumps(data))


def test_missing_folder_says_to_run_preprocess(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*nanotron-recover preprocess"):
        TokenCorpus.open(tmp_path / "nope")


@pytest.mark.parametrize("name", [INDEX_FILE, TOKENS_FILE])
def test_missing_file_is_named(tmp_path, name):
    write_corpus(tmp_path / "c", DOCS)
    (tmp_path / "c" / name).unlink()
    with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
        TokenCorpus.open(tmp_path / "c")


def test_truncated_tokens_file_is_rejected(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    path = tmp_path / "c" / TOKENS_FILE
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenCorpus.open(tmp_path / "c")


def test_corrupt_index_json_is_rejected(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    (tmp_path / "c" / INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        TokenCorpus.open(tmp_path / "c")


def test_interrupted_writer_leaves_an_incomplete_corpus(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with CorpusWriter(tmp_path / "c", 100, "t", EOS) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("boom")
    index = CorpusIndex.read(tmp_path / "c")
    assert index.complete is False and index.num_tokens == 4
    with pytest.raises(ValueError, match="preprocessing did not finish"):
        TokenCorpus.open(tmp_path / "c")


def test_writer_marks_incomplete_while_writing(tmp_path):
    # A reader that looks while the writer is still running must not see a finished corpus.
    writer = CorpusWriter(tmp_path / "c", 100, "t", EOS)
    writer.add_document([1, 2, 3])
    with pytest.raises(ValueError, match="preprocessing did not finish"):
        TokenCorpus.open(tmp_path / "c")
    writer.close()
    assert TokenCorpus.open(tmp_path / "c").num_tokens == 4


def test_rewriting_a_folder_replaces_the_old_corpus(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    write_corpus(tmp_path / "c", [[7]])
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == [7, EOS]


def test_out_of_range_sample(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    corpus = TokenCorpus.open(tmp_path / "c")
    n = corpus.num_samples(4)
    with pytest.raises(IndexError, match=f"sample {n} out of range"):
        corpus.sample(n, 4)
    with pytest.raises(IndexError):
        corpus.sample(-1, 4)


def test_too_small_corpus_names_both_numbers(tmp_path):
    write_corpus(tmp_path / "c", [[5, 6]])  # 3 tokens
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_samples(2) == 1
    assert corpus.num_samples(3) == 0
    with pytest.raises(ValueError, match=r"3 tokens.*4 needed.*sequence_length 3"):
        corpus.sample(0, 3)
    with pytest.raises(ValueError, match=r"3 tokens.*sequence_length 3"):
        corpus.require_samples(3)


def test_empty_corpus_opens(tmp_path):
    write_corpus(tmp_path / "c", [])
    corpus = TokenCorpus.open(tmp_path / "c")
    assert corpus.num_tokens == 0 and corpus.num_samples(8) == 0
