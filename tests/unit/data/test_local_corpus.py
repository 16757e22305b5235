"""The offline stdlib-docstring tokenizer and Nanoset corpus: deterministic, exact vocab, cached builds."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import nanotron_recover.data.local_corpus as local_corpus
from nanotron_recover.data.local_corpus import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    build_local_corpus,
    build_local_tokenizer,
    ensure_local_dataset,
    stdlib_docstring_texts,
)
from nanotron_recover.data.preprocess import summarize_nanoset


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    try:  # huggingface_hub reads the variable at import time; make sure it is seen anyway
        import huggingface_hub.constants as hub_constants

        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    except (ImportError, AttributeError):
        pass


def digest(texts):
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


def test_texts_are_deterministic_across_processes():
    texts = stdlib_docstring_texts()
    assert len(texts) > 500 and sum(map(len, texts)) > 200_000
    assert len(set(texts)) == len(texts)
    assert stdlib_docstring_texts() == texts
    # A fresh interpreter, with a different set of modules already imported, gets the same texts.
    code = (
        "import hashlib, json; from nanotron_recover.data.local_corpus import stdlib_docstring_texts; "
        "print(hashlib.sha256(json.dumps(stdlib_docstring_texts()).encode()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == digest(texts)


def test_max_chars_cuts_exactly():
    texts = stdlib_docstring_texts(max_chars=1000)
    assert sum(map(len, texts)) == 1000
    assert texts[:-1] == stdlib_docstring_texts()[: len(texts) - 1]
    with pytest.raises(ValueError, match="max_chars"):
        stdlib_docstring_texts(max_chars=0)


def test_tokenizer_is_deterministic_and_loads_offline(tmp_path):
    a = build_local_tokenizer(tmp_path / "a")
    b = build_local_tokenizer(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert "tokenizer.json" in files
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok) == 512
    assert tok.bos_token_id == BOS_TOKEN_ID == 0 and tok.convert_ids_to_tokens(0) == "<s>"
    assert tok.eos_token_id == EOS_TOKEN_ID == 1 and tok.convert_ids_to_tokens(1) == "</s>"
    text = "Return a new list containing all items from the iterable in ascending order. ü → 漢字\n\tx"
    ids = tok(text)["input_ids"]
    assert BOS_TOKEN_ID not in ids and EOS_TOKEN_ID not in ids  # specials are the writer's job
    assert max(ids) < 512
    assert tok.decode(ids) == text  # byte-level: lossless, even for characters never seen in training
    english = "Return a new list containing all items from the iterable in ascending order."
    assert len(tok(english)["input_ids"]) < len(english) / 2  # merges learned from the docstrings


@pytest.mark.parametrize("vocab_size", [258, 300, 1024])
def test_vocab_size_is_exact(tmp_path, vocab_size):
    tok = AutoTokenizer.from_pretrained(build_local_tokenizer(tmp_path / "t", vocab_size))
    assert len(tok) == vocab_size
    assert max(tok.get_vocab().values()) == vocab_size - 1


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        build_local_tokenizer(tmp_path / "t", 100)


def documents(folder):
    """Each document of a Nanoset folder as a list of ids."""
    docs = []
    for ds in summarize_nanoset(folder).files:
        ids = np.fromfile(ds, dtype="<u2")
        ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
        docs += [ids[a:b].tolist() for a, b in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)]
    return docs


def test_corpus_is_deterministic(tmp_path):
    for name in ("a", "b"):
        build_local_tokenizer(tmp_path / f"tok-{name}")
        summary = build_local_corpus(
            tmp_path / f"corpus-{name}", tmp_path / f"tok-{name}", max_tokens=20_000, tokenizer_name="tok"
        )
        assert 15_000 < summary.num_tokens <= 20_000 and summary.tokenizer == "tok"
    (a,) = summarize_nanoset(tmp_path / "corpus-a").files
    (b,) = summarize_nanoset(tmp_path / "corpus-b").files
    for suffix in ("", ".index", ".metadata"):
        assert Path(f"{a}{suffix}").read_bytes() == Path(f"{b}{suffix}").read_bytes()


def test_whole_corpus_is_the_docstrings(local_dataset):
    tok = AutoTokenizer.from_pretrained(local_dataset.tokenizer_dir)
    summary = summarize_nanoset(local_dataset.corpus_dir)
    # The metadata names the tokenizer where it is now, not the temporary build folder.
    assert summary.tokenizer == str(local_dataset.tokenizer_dir) and summary.token_size == 2
    # max_tokens: the first docstrings, whole, as many as fit in 300k tokens with one eos each.
    texts = stdlib_docstring_texts()
    sizes = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
    kept = int(np.searchsorted(np.cumsum(sizes), 300_000, side="right"))
    assert 0 < kept < len(texts)
    assert summary.num_documents == kept and summary.num_tokens == sum(sizes[:kept]) <= 300_000
    assert sum(sizes[: kept + 1]) > 300_000
    docs = documents(local_dataset.corpus_dir)
    assert all(d[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in d[:-1] for d in docs)
    assert not any(BOS_TOKEN_ID in d for d in docs) and max(max(d) for d in docs) < 512
    assert sorted(tok.decode(d[:-1]) for d in docs) == sorted(texts[:kept])
    # Nothing but the Nanoset files in the corpus folder.
    assert sorted(p.suffix for p in local_dataset.corpus_dir.iterdir()) == [".ds", ".index", ".metadata"]


def test_max_tokens_below_the_first_document(tmp_path):
    build_local_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match="less than the first document"):
        build_local_corpus(tmp_path / "c", tmp_path / "tok", max_tokens=2)


def test_ensure_reuses_an_existing_build(local_dataset, monkeypatch):
    root = local_dataset.corpus_dir.parent.parent
    (ds,) = summarize_nanoset(local_dataset.corpus_dir).files
    before = ds.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a complete dataset")

    monkeypatch.setattr(local_corpus, "build_local_tokenizer", fail)
    monkeypatch.setattr(local_corpus, "build_local_corpus", fail)
    assert ensure_local_dataset(root) == local_dataset
    assert ds.stat().st_mtime_ns == before


def test_ensure_builds_keys_and_repairs(tmp_path):
    small = ensure_local_dataset(tmp_path, vocab_size=300, max_tokens=5_000)
    summary = summarize_nanoset(small.corpus_dir)
    assert 0 < summary.num_tokens <= 5_000 and summary.tokenizer == str(small.tokenizer_dir)
    assert len(AutoTokenizer.from_pretrained(small.tokenizer_dir)) == 300
    # Different parameters get their own build; nothing temporary is left behind.
    other = ensure_local_dataset(tmp_path, vocab_size=300, max_tokens=6_000)
    assert other.corpus_dir != small.corpus_dir
    assert sorted(os.listdir(tmp_path)) == sorted(
        [small.corpus_dir.parent.name, other.corpus_dir.parent.name]
    )
    # A damaged build is replaced by a fresh one.
    (ds,) = summary.files
    data = ds.read_bytes()
    ds.write_bytes(data[:100])
    assert ensure_local_dataset(tmp_path, vocab_size=300, max_tokens=5_000) == small
    assert ds.read_bytes() == data
    assert len(os.listdir(tmp_path)) == 2


def test_ensure_losing_a_race_uses_the_winners_build(tmp_path, monkeypatch):
    winner = ensure_local_dataset(tmp_path, vocab_size=300, max_tokens=5_000)
    summary_before = summarize_nanoset(winner.corpus_dir)
    # Simulate a second process that checked before the winner finished: it sees no build,
    # builds its own, and then finds the winner's build in place when it tries to rename.
    real = local_corpus._is_complete
    calls = []

    def not_yet_then_real(dataset):
        calls.append(dataset)
        return False if len(calls) == 1 else real(dataset)

    monkeypatch.setattr(local_corpus, "_is_complete", not_yet_then_real)
    assert ensure_local_dataset(tmp_path, vocab_size=300, max_tokens=5_000) == winner
    assert len(calls) >= 2
    assert summarize_nanoset(winner.corpus_dir) == summary_before
    assert os.listdir(tmp_path) == [winner.corpus_dir.parent.name]  # the loser's temp build is gone
