"""The on-disk corpus: round trips, dtype choice, sample windows, commits and resume, and every clear-error case."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

import nanotron_recover.data as data_pkg
from nanotron_recover.data.corpus import (
    INDEX_FILE,
    TOKENS_FILE,
    CorpusIndex,
    CorpusWriter,
    TokenCorpus,
    dtype_for_vocab,
    validate_corpus,
)
from nanotron_recover.data.local_corpus import build_local_tokenizer
from nanotron_recover.errors import InputError

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


def open_error(folder) -> str:
    """The message of the InputError that opening ``folder`` raises; it must be one line."""
    with pytest.raises(InputError) as info:
        TokenCorpus.open(folder)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def set_index(folder, **changes):
    data = json.loads((folder / INDEX_FILE).read_text())
    data.update(changes)
    (folder / INDEX_FILE).write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"format_version": 1}', "missing field(s): num_tokens, num_documents, vocab_size"),
    ],
)
def test_bad_index_json_is_one_input_error_naming_the_file(tmp_path, text, expected):
    write_corpus(tmp_path / "c", DOCS)
    (tmp_path / "c" / INDEX_FILE).write_text(text)
    message = open_error(tmp_path / "c")
    assert str(tmp_path / "c" / INDEX_FILE) in message and expected in message


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"num_tokens": "24"}, "num_tokens must be a whole number >= 0, got '24'"),
        ({"num_tokens": -1}, "num_tokens must be a whole number >= 0, got -1"),
        ({"vocab_size": 0}, "vocab_size must be a whole number >= 1, got 0"),
        ({"dtype": "float32"}, "dtype must be one of uint16, uint32, got 'float32'"),
        ({"dtype": "uint32"}, "dtype uint32 for vocab 100"),
        ({"eos_token_id": 100}, "eos_token_id 100 is outside the vocabulary [0, 100)"),
        ({"complete": "yes"}, "complete must be true or false"),
        ({"tokenizer": None}, "tokenizer must be a string"),
        ({"format_version": 99}, "unsupported corpus format_version 99"),
    ],
)
def test_ill_typed_index_fields_are_refused_naming_the_file(tmp_path, changes, expected):
    write_corpus(tmp_path / "c", DOCS)
    set_index(tmp_path / "c", **changes)
    message = open_error(tmp_path / "c")
    assert f"corpus index {tmp_path / 'c' / INDEX_FILE} is corrupt" in message
    assert expected in message


def test_tokens_file_that_is_not_whole_tokens_is_named(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    path = tmp_path / "c" / TOKENS_FILE
    path.write_bytes(path.read_bytes()[:-1])  # half a uint16
    message = open_error(tmp_path / "c")
    assert f"corpus tokens file {path} is truncated or corrupt" in message
    assert "not a whole number of 2-byte uint16 tokens" in message


@pytest.mark.parametrize("delta", [-2, +2], ids=["shorter", "longer"])
def test_tokens_file_of_the_wrong_length_is_named_with_both_counts(tmp_path, delta):
    index = write_corpus(tmp_path / "c", DOCS)
    path = tmp_path / "c" / TOKENS_FILE
    raw = path.read_bytes()
    path.write_bytes(raw[:delta] if delta < 0 else raw + b"\0" * delta)
    message = open_error(tmp_path / "c")
    assert f"corpus tokens file {path} is truncated or corrupt: {len(raw) + delta} bytes" in message
    assert f"index says {index.num_tokens} tokens" in message


def test_missing_files_are_input_errors_too(tmp_path):
    # Also FileNotFoundErrors (see test_missing_file_is_named), and one line naming the file.
    write_corpus(tmp_path / "c", DOCS)
    (tmp_path / "c" / INDEX_FILE).unlink()
    assert f"corpus index {tmp_path / 'c' / INDEX_FILE} is missing" in open_error(tmp_path / "c")
    assert "does not exist" in open_error(tmp_path / "nope")


def test_a_file_instead_of_a_folder_is_named(tmp_path):
    (tmp_path / "c").write_text("tokens")
    assert f"corpus folder {tmp_path / 'c'} is not a folder" in open_error(tmp_path / "c")


def test_incomplete_corpus_is_an_input_error(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    set_index(tmp_path / "c", complete=False)
    assert "preprocessing did not finish" in open_error(tmp_path / "c")


def test_interrupted_writer_leaves_its_last_commit(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with CorpusWriter(tmp_path / "c", 100, "t", EOS, resume={"rows": 0}) as writer:
            writer.add_document([1, 2, 3])
            writer.commit({"rows": 1})
            writer.add_document([4, 5])  # not committed: its resume position was never recorded
            raise RuntimeError("boom")
    index = CorpusIndex.read(tmp_path / "c")
    assert index.complete is False and index.num_tokens == 4 and index.num_documents == 1
    assert index.resume == {"rows": 1}
    # The uncommitted document was flushed to disk but is not counted.
    assert (tmp_path / "c" / TOKENS_FILE).stat().st_size == 7 * 2
    with pytest.raises(ValueError, match="preprocessing did not finish"):
        TokenCorpus.open(tmp_path / "c")


def test_commit_is_durable_and_never_ahead_of_the_tokens(tmp_path):
    writer = CorpusWriter(tmp_path / "c", 100, "t", EOS, resume={"rows": 0}, tokenizer_fingerprint="sha256:x")
    first = CorpusIndex.read(tmp_path / "c")
    assert first.num_tokens == 0 and first.resume == {"rows": 0} and first.tokenizer_fingerprint == "sha256:x"
    writer.add_documents(np.array([10, 11, 12, 20]), [3, 1])
    index = writer.commit({"rows": 2})
    assert index == CorpusIndex.read(tmp_path / "c") and not index.complete
    assert index.num_tokens == 6 and index.num_documents == 2
    assert np.fromfile(tmp_path / "c" / TOKENS_FILE, dtype="<u2").tolist() == [10, 11, 12, EOS, 20, EOS]
    final = writer.close()
    assert final.complete and final.resume == {"rows": 2} and final.tokenizer_fingerprint == "sha256:x"


def test_reopen_drops_the_uncommitted_tail_and_continues(tmp_path, monkeypatch):
    import nanotron_recover.data.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "_FLUSH_TOKENS", 3)  # uncommitted documents do reach the disk
    with pytest.raises(KeyboardInterrupt):
        with CorpusWriter(tmp_path / "c", 100, "t", EOS, source={"s": 1}, resume={"rows": 0}) as writer:
            writer.add_document(DOCS[0])
            writer.add_document(DOCS[1])
            writer.commit({"rows": 2})
            writer.add_document(DOCS[2])
            raise KeyboardInterrupt
    assert (tmp_path / "c" / TOKENS_FILE).stat().st_size > len(flat(DOCS[:2])) * 2

    writer = CorpusWriter.reopen(tmp_path / "c")
    assert (writer.num_tokens, writer.num_documents) == (len(flat(DOCS[:2])), 2)
    assert writer.resume == {"rows": 2} and writer.source == {"s": 1}
    assert not CorpusIndex.read(tmp_path / "c").complete
    for doc in DOCS[2:]:
        writer.add_document(doc)
    index = writer.close()
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == flat(DOCS)
    assert index.num_documents == len(DOCS) and index.source == {"s": 1}


def test_reopen_from_an_earlier_index_truncates_to_it(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    index = CorpusIndex.read(tmp_path / "c")
    index.num_tokens, index.num_documents = len(flat(DOCS[:1])), 1  # e.g. drop a cut-short tail
    writer = CorpusWriter.reopen(tmp_path / "c", index)
    # The shorter index is on disk, incomplete, before the file is cut: a crash here is resumable.
    assert CorpusIndex.read(tmp_path / "c").num_tokens == len(flat(DOCS[:1]))
    writer.add_document([7])
    writer.close()
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == flat([DOCS[0], [7]])


def test_reopen_refuses_a_tokens_file_shorter_than_the_index(tmp_path):
    write_corpus(tmp_path / "c", DOCS)
    path = tmp_path / "c" / TOKENS_FILE
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="fewer than the .* its index committed"):
        CorpusWriter.reopen(tmp_path / "c")


def test_add_documents_equals_add_document(tmp_path):
    docs = [[5, 6, 7], [], [8], list(range(20, 40))]
    with CorpusWriter(tmp_path / "bulk", 100, "t", EOS) as writer:
        writer.add_documents(np.array([t for d in docs for t in d], dtype=np.uint32), [len(d) for d in docs])
    assert TokenCorpus.open(tmp_path / "bulk").tokens.tolist() == flat(docs)
    assert writer.close().num_documents == len(docs)
    with CorpusWriter(tmp_path / "bad", 100, "t", EOS) as writer:
        with pytest.raises(ValueError, match="lengths add up to 3 ids but 2"):
            writer.add_documents(np.array([1, 2]), [1, 2])
        with pytest.raises(ValueError, match="non-negative"):
            writer.add_documents(np.array([1, 2]), [3, -1])
        with pytest.raises(ValueError, match="token id 100"):
            writer.add_documents(np.array([1, 100]), [2])
        assert writer.num_tokens == 0


def test_added_document_is_copied(tmp_path):
    ids = np.array([1, 2, 3], dtype=np.uint16)
    with CorpusWriter(tmp_path / "c", 100, "t", EOS) as writer:
        writer.add_document(ids, add_eos=False)
        ids[:] = 9  # the caller reuses its buffer before the writer flushed
    assert TokenCorpus.open(tmp_path / "c").tokens.tolist() == [1, 2, 3]


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


def test_index_without_fingerprint_still_reads():
    data = json.loads(CorpusIndex(10, 1, 100, "uint16", "t", 3).to_json())
    del data["tokenizer_fingerprint"]  # written before fingerprints existed
    assert CorpusIndex.from_json(json.dumps(data)).tokenizer_fingerprint is None


# -- validate_corpus -----------------------------------------------------------------------
def test_validate_corpus_vocab_size(tmp_path):
    write_corpus(tmp_path / "c", DOCS, vocab_size=100)
    validate_corpus(tmp_path / "c", tokenizer_name_or_path=None, vocab_size=100)
    validate_corpus(TokenCorpus.open(tmp_path / "c"), tokenizer_name_or_path=None, vocab_size=128)
    with pytest.raises(
        InputError, match=r"vocab_size 100 .* vocab_size is 99: set model.model_config.vocab_size"
    ):
        validate_corpus(str(tmp_path / "c"), tokenizer_name_or_path=None, vocab_size=99)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_validate_corpus_tokenizer_by_fingerprint(local_dataset, tmp_path, offline):
    corpus = TokenCorpus.open(local_dataset.corpus_dir)
    assert corpus.index.tokenizer_fingerprint is not None
    validate_corpus(corpus, tokenizer_name_or_path=str(local_dataset.tokenizer_dir), vocab_size=512)
    # Same contents elsewhere: fine, whatever the name.
    moved = shutil.copytree(local_dataset.tokenizer_dir, tmp_path / "moved")
    validate_corpus(corpus, tokenizer_name_or_path=str(moved), vocab_size=512)
    # A different tokenizer is refused even though the vocabulary fits.
    other = build_local_tokenizer(tmp_path / "other", vocab_size=300)
    with pytest.raises(InputError, match="different vocabulary or merges") as info:
        validate_corpus(corpus, tokenizer_name_or_path=str(other), vocab_size=512)
    message = str(info.value)
    assert "tokenizer.tokenizer_name_or_path" in message and "validate_tokenizer" in message
    assert "\n" not in message


def test_validate_corpus_tokenizer_by_name_when_it_cannot_be_loaded(local_dataset, tmp_path, offline):
    # A hub id that is not in the cache cannot be loaded offline: only the name can be compared.
    shutil.copytree(local_dataset.corpus_dir, tmp_path / "c")
    index = CorpusIndex.read(tmp_path / "c")
    index.tokenizer = "some-org/not-cached-tokenizer"
    index.write(tmp_path / "c")
    validate_corpus(tmp_path / "c", tokenizer_name_or_path="some-org/not-cached-tokenizer", vocab_size=512)
    with pytest.raises(InputError, match="could not be loaded offline"):
        validate_corpus(tmp_path / "c", tokenizer_name_or_path="some-org/other-tokenizer", vocab_size=512)
    # Without a recorded fingerprint, names decide too.
    write_corpus(tmp_path / "old", DOCS)  # tokenizer "test-tokenizer", no fingerprint
    validate_corpus(tmp_path / "old", tokenizer_name_or_path="test-tokenizer", vocab_size=100)
    with pytest.raises(InputError, match="records no tokenizer fingerprint"):
        validate_corpus(
            tmp_path / "old", tokenizer_name_or_path=str(local_dataset.tokenizer_dir), vocab_size=100
        )


def test_package_exports_resolve():
    for name in data_pkg.__all__:
        assert getattr(data_pkg, name) is not None
    # The function, not the submodule of the same name.
    assert data_pkg.preprocess is sys.modules["nanotron_recover.data.preprocess"].preprocess
