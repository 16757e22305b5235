"""Preprocessing a local C4-schema JSON-lines file with the offline tokenizer."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nanotron_recover.data.corpus import CorpusIndex, TokenCorpus
from nanotron_recover.data.preprocess import (
    add_preprocess_arguments,
    parse_token_count,
    preprocess,
    run_preprocess,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x + 1  # a comment\n",
    "",  # empty documents are skipped
    "Unicode survives: naïve café — 東京 🚀, and    odd   spacing .",
    None,  # so are null ones
    "Return the number of items in a container. " * 20,
    "last",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def c4_jsonl(tmp_path):
    path = tmp_path / "c4-sample.json"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(TEXTS):
            row = {"text": text, "timestamp": f"2019-04-2{i}T12:57:54Z", "url": f"https://example.com/{i}"}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def tokenizer(local_dataset):
    return AutoTokenizer.from_pretrained(local_dataset.tokenizer_dir)


def run(c4_jsonl, local_dataset, out, **kwargs):
    return preprocess(
        "json",
        None,
        data_files=[str(c4_jsonl)],
        tokenizer=str(local_dataset.tokenizer_dir),
        out=out,
        progress=False,
        **kwargs,
    )


def expected_ids(tokenizer):
    out = []
    for text in TEXTS:
        if text:
            out += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def test_corpus_matches_tokenizer_and_decodes_back(c4_jsonl, local_dataset, tokenizer, tmp_path):
    index = run(c4_jsonl, local_dataset, tmp_path / "corpus")
    corpus = TokenCorpus.open(tmp_path / "corpus")
    tokens = corpus.tokens.tolist()
    assert tokens == expected_ids(tokenizer)

    eos = tokenizer.eos_token_id
    assert index.eos_token_id == eos == 1
    assert index.vocab_size == len(tokenizer) == 512
    assert index.num_tokens == len(tokens)
    kept = [t for t in TEXTS if t]
    assert index.num_documents == len(kept)
    # Documents are exactly the eos-separated segments; the last token is eos; no bos anywhere.
    assert tokens[-1] == eos
    assert tokenizer.bos_token_id not in tokens
    segments = np.split(np.array(tokens), np.flatnonzero(np.array(tokens) == eos) + 1)[:-1]
    assert [tokenizer.decode(s[:-1].tolist()) for s in segments] == kept
    assert index.source["dataset"] == "json" and index.source["text_column"] == "text"
    assert index.resume == {"rows_read": len(TEXTS)}
    assert CorpusIndex.read(tmp_path / "corpus") == index


def test_max_tokens_is_exact_and_a_prefix(c4_jsonl, local_dataset, tokenizer, tmp_path):
    full = expected_ids(tokenizer)
    for budget in (1, 5, 37, len(full) - 1):
        index = run(c4_jsonl, local_dataset, tmp_path / f"c{budget}", max_tokens=budget)
        assert index.num_tokens == budget
        assert TokenCorpus.open(tmp_path / f"c{budget}").tokens.tolist() == full[:budget]
    bigger = run(c4_jsonl, local_dataset, tmp_path / "big", max_tokens=10 * len(full))
    assert bigger.num_tokens == len(full)


def test_max_tokens_on_a_document_boundary_keeps_its_eos(c4_jsonl, local_dataset, tokenizer, tmp_path):
    first = len(tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]) + 1
    index = run(c4_jsonl, local_dataset, tmp_path / "c", max_tokens=first)
    tokens = TokenCorpus.open(tmp_path / "c").tokens.tolist()
    assert index.num_documents == 1 and tokens[-1] == tokenizer.eos_token_id and len(tokens) == first
    assert index.resume == {"rows_read": 1}
    # One token more starts (and cuts) the second document, which then has no eos.
    index = run(c4_jsonl, local_dataset, tmp_path / "d", max_tokens=first + 1)
    tokens = TokenCorpus.open(tmp_path / "d").tokens.tolist()
    assert index.num_documents == 2 and tokens.count(tokenizer.eos_token_id) == 1


def test_missing_text_column_is_named(c4_jsonl, local_dataset, tmp_path):
    with pytest.raises(ValueError, match=r"no column 'body'.*text, timestamp, url"):
        run(c4_jsonl, local_dataset, tmp_path / "c", text_column="body")
    # The failed run left no corpus that looks finished.
    with pytest.raises(ValueError, match="did not finish"):
        TokenCorpus.open(tmp_path / "c")


def test_tokenizer_without_eos_is_rejected(c4_jsonl, local_dataset, tmp_path):
    no_eos = PreTrainedTokenizerFast(tokenizer_file=str(local_dataset.tokenizer_dir / "tokenizer.json"))
    assert no_eos.eos_token_id is None
    no_eos.save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match="no eos token"):
        preprocess(
            "json", None, data_files=[str(c4_jsonl)], tokenizer=str(tmp_path / "tok"), out=tmp_path / "c"
        )


def test_bad_max_tokens(c4_jsonl, local_dataset, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        run(c4_jsonl, local_dataset, tmp_path / "c", max_tokens=0)


def make_parser():
    parser = argparse.ArgumentParser(prog="nanotron-recover preprocess")
    add_preprocess_arguments(parser)
    return parser


def test_cli_defaults_and_parsing(tmp_path):
    args = make_parser().parse_args(["--tokenizer", "tok", "--out", str(tmp_path / "o")])
    assert args.dataset == "allenai/c4" and args.name == "en" and args.split == "train"
    assert args.text_column == "text" and args.data_files is None and args.max_tokens is None
    assert args.out == tmp_path / "o"
    args = make_parser().parse_args(
        ["--dataset", "json", "--name", "none", "--data-files", "a.json", "b.json", "--max-tokens", "1.5k"]
        + ["--tokenizer", "tok", "--out", "o"]
    )
    assert args.name is None and args.data_files == ["a.json", "b.json"] and args.max_tokens == 1500
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--out", "o"])  # --tokenizer is required


@pytest.mark.parametrize(
    ("text", "value"), [("300000", 300_000), ("300_000", 300_000), ("2M", 2_000_000), ("1B", 10**9)]
)
def test_parse_token_count(text, value):
    assert parse_token_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "0", "1.5", "-3", "2X"])
def test_parse_token_count_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_token_count(text)


def test_cli_runs_and_prints_summary(c4_jsonl, local_dataset, tokenizer, tmp_path, capsys):
    out = tmp_path / "cli"
    args = make_parser().parse_args(
        ["--dataset", "json", "--name", "none", "--data-files", str(c4_jsonl)]
        + ["--tokenizer", str(local_dataset.tokenizer_dir), "--out", str(out), "--max-tokens", "40"]
    )
    assert run_preprocess(args) == 0
    summary = capsys.readouterr().out.strip()
    assert len(summary.splitlines()) == 1
    assert "40 tokens" in summary and str(out) in summary
    assert TokenCorpus.open(out).tokens.tolist() == expected_ids(tokenizer)[:40]


def test_cli_reports_user_errors(c4_jsonl, local_dataset, tmp_path, capsys):
    args = make_parser().parse_args(
        ["--dataset", "json", "--name", "none", "--data-files", str(c4_jsonl), "--text-column", "body"]
        + ["--tokenizer", str(local_dataset.tokenizer_dir), "--out", str(tmp_path / "o")]
    )
    assert run_preprocess(args) == 1
    assert "no column 'body'" in capsys.readouterr().err
