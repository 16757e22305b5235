"""Preprocessing local C4-schema JSON-lines files with the offline tokenizer.

Two datasets: seven hand-picked rows (edge cases: unicode, code, empty and null text) and
2,000 short stdlib-docstring documents with C4's columns (``text``, ``timestamp``, ``url``),
big enough for many chunks and commits. The properties under test are the ones that make a
multi-day C4 run safe: the output is the same bytes whatever the worker count and however
often the run is killed and resumed, and a folder is never silently mixed with another source.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import nanotron_recover.data.corpus as corpus_mod
from nanotron_recover.data.corpus import INDEX_FILE, TOKENS_FILE, CorpusIndex, TokenCorpus
from nanotron_recover.data.local_corpus import build_local_tokenizer, stdlib_docstring_texts
from nanotron_recover.data.preprocess import (
    add_preprocess_arguments,
    parse_token_count,
    preprocess,
    preprocess_run,
    run_preprocess,
)
from nanotron_recover.data.tokenization import encode_chunks, make_encoder, tokenizer_fingerprint
from nanotron_recover.errors import InputError

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
    stream = index.resume.pop("stream")
    assert index.resume == {
        "rows_read": len(TEXTS),
        "max_tokens": None,
        "partial_tokens": 0,
        "end_of_data": True,
    }
    assert stream["rows"] == len(TEXTS) and stream["state"] and stream["chunk_docs"] > 0
    index.resume["stream"] = stream
    assert index.tokenizer == str(local_dataset.tokenizer_dir)
    assert index.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
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
    assert index.resume["rows_read"] == 1 and index.resume["partial_tokens"] == 0
    # One token more starts (and cuts) the second document, which then has no eos.
    index = run(c4_jsonl, local_dataset, tmp_path / "d", max_tokens=first + 1)
    tokens = TokenCorpus.open(tmp_path / "d").tokens.tolist()
    assert index.num_documents == 2 and tokens.count(tokenizer.eos_token_id) == 1
    assert index.resume["rows_read"] == 2 and index.resume["partial_tokens"] == 1


def test_missing_text_column_is_named(c4_jsonl, local_dataset, tmp_path):
    with pytest.raises(InputError, match=r"no column 'body'.*text, timestamp, url"):
        run(c4_jsonl, local_dataset, tmp_path / "c", text_column="body")
    # The failed run left no corpus that looks finished.
    with pytest.raises(ValueError, match="did not finish"):
        TokenCorpus.open(tmp_path / "c")


def test_tokenizer_without_eos_is_rejected(c4_jsonl, local_dataset, tmp_path):
    no_eos = PreTrainedTokenizerFast(tokenizer_file=str(local_dataset.tokenizer_dir / "tokenizer.json"))
    assert no_eos.eos_token_id is None
    no_eos.save_pretrained(tmp_path / "tok")
    with pytest.raises(InputError, match="no eos token"):
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
    assert run_preprocess(args) == 2
    err = capsys.readouterr().err
    assert "no column 'body'" in err and len(err.strip().splitlines()) == 1


def test_cli_workers_and_chunk_docs():
    args = make_parser().parse_args(["--tokenizer", "tok", "--out", "o"])
    assert args.workers is None and args.chunk_docs > 0
    args = make_parser().parse_args(["--tokenizer", "t", "--out", "o", "--workers", "0", "--chunk-docs", "7"])
    assert args.workers == 0 and args.chunk_docs == 7
    for bad in (["--workers", "-1"], ["--chunk-docs", "0"], ["--workers", "two"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["--tokenizer", "t", "--out", "o", *bad])


def test_parse_token_count_is_exact_for_large_counts():
    assert parse_token_count("12345678901234567") == 12345678901234567
    assert parse_token_count("1.000001M") == 1_000_001


# -- 2,000 C4-schema documents: workers, resume, budgets, mismatches --------------------------
N_DOCS = 2000


@pytest.fixture(scope="module")
def c4_2k(tmp_path_factory):
    """2,000 short documents (plus empty and null rows) in C4's schema, as JSON lines."""
    texts = stdlib_docstring_texts()[:N_DOCS]
    path = tmp_path_factory.mktemp("c4_2k") / "c4-train.00000-of-00001.json"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            if i % 97 == 5:
                text = None if i % 2 else ""  # rows that must be counted but yield no document
            else:
                text = text[:300]
            row = {
                "text": text,
                "timestamp": f"2019-04-{1 + i % 28:02d}T00:00:00Z",
                "url": f"https://e.com/{i}",
            }
            f.write(json.dumps(row) + "\n")
    return path


def run2k(c4_2k, local_dataset, out, **kwargs):
    kwargs.setdefault("workers", 0)
    kwargs.setdefault("progress", False)
    return preprocess(
        "json", None, data_files=[str(c4_2k)], tokenizer=str(local_dataset.tokenizer_dir), out=out, **kwargs
    )


@pytest.fixture(scope="module")
def reference(c4_2k, local_dataset, tmp_path_factory):
    """The uninterrupted, in-process (workers=0) corpus: its index and tokens.bin bytes."""
    out = tmp_path_factory.mktemp("ref") / "corpus"
    index = run2k(c4_2k, local_dataset, out)
    assert index.num_documents == N_DOCS - len(range(5, N_DOCS, 97))
    assert index.resume["rows_read"] == N_DOCS and index.num_tokens > 50_000
    return index, (out / TOKENS_FILE).read_bytes()


def same_corpus(a, b):
    """Equal indexes, up to the saved stream position (it depends on the chunk size used)."""

    def strip(index):
        return {**asdict(index), "resume": {k: v for k, v in index.resume.items() if k != "stream"}}

    return strip(a) == strip(b)


def tokens_of(folder):
    return (Path(folder) / TOKENS_FILE).read_bytes()


@pytest.mark.parametrize(("workers", "chunk_docs"), [(1, 64), (2, 100)])
def test_worker_count_does_not_change_a_byte(c4_2k, local_dataset, reference, tmp_path, workers, chunk_docs):
    index = run2k(c4_2k, local_dataset, tmp_path / "c", workers=workers, chunk_docs=chunk_docs)
    assert tokens_of(tmp_path / "c") == reference[1]
    assert same_corpus(index, reference[0])


def test_budget_with_workers_is_a_prefix(c4_2k, local_dataset, reference, tmp_path):
    budget = 12_345
    index = run2k(c4_2k, local_dataset, tmp_path / "c", workers=2, chunk_docs=32, max_tokens=budget)
    assert index.num_tokens == budget
    assert tokens_of(tmp_path / "c") == reference[1][: 2 * budget]  # uint16


# A child process that preprocesses until its 3rd commit, then stalls until it is killed.
_KILLED_CHILD = r"""
import sys, time
from dataclasses import asdict
from pathlib import Path
import nanotron_recover.data.corpus as corpus
from nanotron_recover.data.preprocess import preprocess

data, tokenizer, out, marker = sys.argv[1:5]
commit = corpus.CorpusWriter.commit
commits = 0

def commit_then_stall(self, resume=None):
    global commits
    index = commit(self, resume)
    commits += 1
    if commits == 3:
        Path(marker).write_text(str(index.num_tokens))
        time.sleep(600)
    return index

corpus.CorpusWriter.commit = commit_then_stall
preprocess("json", None, data_files=[data], tokenizer=tokenizer, out=Path(out), progress=False,
           workers=2, chunk_docs=50, commit_tokens=1)
"""


def live_processes_in_group(pgid):
    """Pids in process group ``pgid`` that have not exited (zombies count as exited)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


def test_sigkill_then_rerun_gives_the_uninterrupted_bytes(c4_2k, local_dataset, reference, tmp_path):
    out, marker = tmp_path / "c", tmp_path / "committed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = [str(c4_2k), str(local_dataset.tokenizer_dir), str(out), str(marker)]
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, *args], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached its 3rd commit"
            time.sleep(0.1)
        # The child, its 2 tokenizing workers and multiprocessing's resource tracker.
        assert len(live_processes_in_group(child.pid)) == 4
        child.send_signal(signal.SIGKILL)  # no cleanup of any kind runs in the child
        assert child.wait(timeout=60) == -signal.SIGKILL
        # Its tokenizing workers notice the orphaning and exit by themselves, within seconds.
        deadline = time.monotonic() + 30
        while live_processes_in_group(child.pid):
            assert time.monotonic() < deadline, "tokenizing workers outlived their killed parent"
            time.sleep(0.2)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        try:  # whatever is left of the child's session (nothing, if the check above passed)
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    killed = CorpusIndex.read(out)
    assert not killed.complete and killed.num_tokens == int(marker.read_text()) > 0
    assert 0 < killed.resume["rows_read"] < N_DOCS
    with pytest.raises(ValueError, match="did not finish"):
        TokenCorpus.open(out)
    # Tokens flushed after the last commit (a crash between append and index) must be dropped.
    with open(out / TOKENS_FILE, "ab") as f:
        f.write(b"\xff\x01" * 999)

    lines = []
    index = run2k(c4_2k, local_dataset, out, workers=2, chunk_docs=50, log=lines.append)
    assert len(lines) == 1 and "resuming" in lines[0] and f"row {killed.resume['rows_read']:,}" in lines[0]
    assert "from the dataset's saved position" in lines[0]  # not by re-reading every row before it
    assert tokens_of(out) == reference[1]
    assert same_corpus(index, reference[0])


class Interrupt(Exception):
    pass


def interrupt_after_commits(monkeypatch, n):
    """Make the n-th commit raise (after it is durable), like a crash right after it."""
    commit = corpus_mod.CorpusWriter.commit
    count = {"n": 0}

    def patched(self, resume=None):
        index = commit(self, resume)
        count["n"] += 1
        if count["n"] == n:
            raise Interrupt
        return index

    monkeypatch.setattr(corpus_mod.CorpusWriter, "commit", patched)


@pytest.mark.parametrize(("budget", "workers"), [(None, 0), (30_001, 0), (20_000, 2)])
def test_interrupted_runs_compose_with_the_budget(
    c4_2k, local_dataset, reference, tmp_path, monkeypatch, budget, workers
):
    out = tmp_path / "c"
    small_commits = {"chunk_docs": 20, "commit_tokens": 1}  # a commit after every 20 documents
    # Two interruptions, so that a resumed run is itself resumed.
    for n in (2, 3):
        with monkeypatch.context() as m:
            interrupt_after_commits(m, n)
            with pytest.raises(Interrupt):
                run2k(c4_2k, local_dataset, out, max_tokens=budget, workers=workers, **small_commits)
        assert not CorpusIndex.read(out).complete
    index = run2k(c4_2k, local_dataset, out, max_tokens=budget, workers=workers, **small_commits)
    fresh = run2k(c4_2k, local_dataset, tmp_path / "fresh", max_tokens=budget)
    assert tokens_of(out) == tokens_of(tmp_path / "fresh") == reference[1][: 2 * (budget or 10**9)]
    assert same_corpus(index, fresh)


@pytest.fixture(scope="module")
def c4_shards(c4_2k, tmp_path_factory):
    """The same 2,000 rows split over three files, as C4 is split over many."""
    lines = c4_2k.read_text(encoding="utf-8").splitlines(keepends=True)
    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for i, (a, b) in enumerate([(0, 700), (700, 1300), (1300, N_DOCS)]):
        path = folder / f"c4-train.{i:05d}-of-00003.json"
        path.write_text("".join(lines[a:b]), encoding="utf-8")
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("resume_chunk_docs", [40, 64])
def test_resume_across_shards(c4_shards, local_dataset, reference, tmp_path, monkeypatch, resume_chunk_docs):
    out = tmp_path / "c"
    kwargs = {"data_files": c4_shards, "tokenizer": str(local_dataset.tokenizer_dir), "out": out}
    kwargs.update(progress=False, workers=0, commit_tokens=1)
    with monkeypatch.context() as m:
        interrupt_after_commits(m, 30)  # after row 1,200, inside the second file
        with pytest.raises(Interrupt):
            preprocess("json", None, chunk_docs=40, **kwargs)
    assert CorpusIndex.read(out).resume["rows_read"] == 1200
    lines = []
    preprocess("json", None, chunk_docs=resume_chunk_docs, log=lines.append, **kwargs)
    # The saved dataset position is only valid for the chunk size it was taken with; with
    # another, the rows are re-read and counted off instead. Same bytes either way.
    if resume_chunk_docs == 40:
        assert "saved position at row 1,200" in lines[0]
    else:
        assert "re-reading the rows before it" in lines[0]
    assert tokens_of(out) == reference[1]


@pytest.mark.parametrize("chunk_docs", [512, 20])
def test_larger_budget_extends_a_complete_corpus(c4_2k, local_dataset, reference, tmp_path, chunk_docs):
    out = tmp_path / "c"
    small = run2k(c4_2k, local_dataset, out, max_tokens=10_001, chunk_docs=chunk_docs)
    assert small.complete and small.resume["partial_tokens"] > 0  # its last document was cut short
    lines = []
    index = run2k(c4_2k, local_dataset, out, max_tokens=25_000, chunk_docs=chunk_docs, log=lines.append)
    assert "extending" in lines[0] and f"row {small.resume['rows_read'] - 1:,}" in lines[0]
    # Small chunks: the last whole chunk before the cut left a saved position to start from.
    assert ("saved position" in lines[0]) == (chunk_docs == 20)
    assert same_corpus(index, run2k(c4_2k, local_dataset, tmp_path / "fresh", max_tokens=25_000))
    assert tokens_of(out) == reference[1][:50_000]
    # ...and then to the whole dataset.
    assert same_corpus(run2k(c4_2k, local_dataset, out, chunk_docs=chunk_docs), reference[0])
    assert tokens_of(out) == reference[1]


def test_budget_on_a_document_boundary_extends_without_redoing_it(c4_2k, local_dataset, reference, tmp_path):
    tokens = np.frombuffer(reference[1], dtype=np.uint16)
    boundary = int(np.flatnonzero(tokens == 1)[40]) + 1  # just after the 41st document's eos
    out = tmp_path / "c"
    small = run2k(c4_2k, local_dataset, out, max_tokens=boundary)
    assert small.num_documents == 41 and small.resume["partial_tokens"] == 0
    assert same_corpus(run2k(c4_2k, local_dataset, out), reference[0])
    assert tokens_of(out) == reference[1]


def test_complete_corpus_is_left_alone(c4_2k, local_dataset, reference, tmp_path):
    out = tmp_path / "c"
    run2k(c4_2k, local_dataset, out, max_tokens=5000)
    before = (out / TOKENS_FILE).stat().st_mtime_ns, (out / INDEX_FILE).read_bytes()
    lines = []
    result = preprocess_run(
        "json",
        None,
        data_files=[str(c4_2k)],
        tokenizer=str(local_dataset.tokenizer_dir),
        out=out,
        max_tokens=5000,
        progress=False,
        workers=0,
        log=lines.append,
    )
    assert result.status == "complete" and result.tokens_written == 0
    assert len(lines) == 1 and "already complete" in lines[0]
    assert ((out / TOKENS_FILE).stat().st_mtime_ns, (out / INDEX_FILE).read_bytes()) == before
    # A corpus that reached the end of the data is complete for any larger budget too.
    whole = tmp_path / "whole"
    run2k(c4_2k, local_dataset, whole)
    lines = []
    assert same_corpus(run2k(c4_2k, local_dataset, whole, max_tokens=10**9, log=lines.append), reference[0])
    assert "already complete" in lines[0]


def test_budget_below_what_is_written_is_refused(c4_2k, local_dataset, tmp_path):
    run2k(c4_2k, local_dataset, tmp_path / "c", max_tokens=5000)
    with pytest.raises(InputError, match=r"already holds 5,000 tokens, more than --max-tokens 4,999"):
        run2k(c4_2k, local_dataset, tmp_path / "c", max_tokens=4999)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    return build_local_tokenizer(tmp_path_factory.mktemp("tok300") / "tok", vocab_size=300)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"split": "validation"}, "split: 'train' in the folder vs 'validation' given"),
        ({"text_column": "url"}, "text_column: 'text' in the folder vs 'url' given"),
        ({"dataset": "csv"}, "dataset: 'json' in the folder vs 'csv' given"),
        ({"name": "en"}, "name: None in the folder vs 'en' given"),
        ({"data_files": ["other.json"]}, "data_files:"),
        ({"tokenizer": "OTHER"}, "tokenizer:"),
    ],
)
def test_folder_from_another_source_is_an_input_error(
    c4_2k, local_dataset, other_tokenizer, tmp_path, monkeypatch, change, named
):
    out = tmp_path / "c"
    interrupt_after_commits(monkeypatch, 1)
    with pytest.raises(Interrupt):
        run2k(c4_2k, local_dataset, out, commit_tokens=1000)
    monkeypatch.undo()
    committed = (out / INDEX_FILE).read_bytes()
    kwargs = {
        "dataset": "json",
        "name": None,
        "data_files": [str(c4_2k)],
        "tokenizer": str(local_dataset.tokenizer_dir),
        "split": "train",
        "text_column": "text",
        **change,
    }
    if kwargs["tokenizer"] == "OTHER":
        kwargs["tokenizer"] = str(other_tokenizer)
    dataset, name = kwargs.pop("dataset"), kwargs.pop("name")
    with pytest.raises(InputError, match="holds a corpus made differently") as info:
        preprocess(dataset, name, out=out, progress=False, workers=0, **kwargs)
    message = str(info.value)
    assert named in message and "\n" not in message and "--out" in message
    assert (out / INDEX_FILE).read_bytes() == committed  # untouched


def test_moved_tokenizer_still_resumes(c4_2k, local_dataset, reference, tmp_path, monkeypatch):
    # The fingerprint, not the path, identifies the tokenizer.
    out = tmp_path / "c"
    interrupt_after_commits(monkeypatch, 2)
    with pytest.raises(Interrupt):
        run2k(c4_2k, local_dataset, out, commit_tokens=3000)
    monkeypatch.undo()
    moved = shutil.copytree(local_dataset.tokenizer_dir, tmp_path / "moved-tokenizer")
    index = preprocess(
        "json", None, data_files=[str(c4_2k)], tokenizer=str(moved), out=out, progress=False, workers=0
    )
    assert tokens_of(out) == reference[1] and index.num_tokens == reference[0].num_tokens


def test_failed_start_with_nothing_committed_is_started_over(c4_2k, local_dataset, reference, tmp_path):
    out = tmp_path / "c"
    with pytest.raises(InputError, match="no column 'body'"):
        run2k(c4_2k, local_dataset, out, text_column="body")
    assert same_corpus(run2k(c4_2k, local_dataset, out), reference[0])


def test_unreadable_index_is_an_input_error(c4_2k, local_dataset, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / INDEX_FILE).write_text("{oops")
    with pytest.raises(InputError, match="unreadable corpus index"):
        run2k(c4_2k, local_dataset, out)


def test_out_that_is_a_file_is_an_input_error(c4_2k, local_dataset, tmp_path):
    (tmp_path / "c").write_text("not a folder")
    with pytest.raises(InputError, match="is a file"):
        run2k(c4_2k, local_dataset, tmp_path / "c")


def test_budget_already_filled_when_resumed(c4_2k, local_dataset, reference, tmp_path, monkeypatch):
    # Interrupted with exactly `budget` tokens committed: the rerun only has to mark it complete.
    out = tmp_path / "c"
    with monkeypatch.context() as m:
        interrupt_after_commits(m, 3)
        with pytest.raises(Interrupt):
            run2k(c4_2k, local_dataset, out, chunk_docs=20, commit_tokens=1)
    committed = CorpusIndex.read(out)
    index = run2k(c4_2k, local_dataset, out, chunk_docs=20, max_tokens=committed.num_tokens)
    assert index.complete and index.num_tokens == committed.num_tokens
    assert index.resume["rows_read"] == 60 and index.resume["stream"] == committed.resume["stream"]
    assert tokens_of(out) == reference[1][: 2 * committed.num_tokens]
    # ...and it can still be extended, from the saved position.
    lines = []
    assert same_corpus(run2k(c4_2k, local_dataset, out, chunk_docs=20, log=lines.append), reference[0])
    assert "saved position at row 60" in lines[0]


def test_a_second_writer_on_the_same_folder_is_refused(c4_2k, local_dataset, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a concurrent preprocess would hold it
        with pytest.raises(InputError, match="another `nanotron-recover preprocess` is writing"):
            run2k(c4_2k, local_dataset, out)
    finally:
        os.close(fd)
    assert run2k(c4_2k, local_dataset, out, max_tokens=100).num_tokens == 100


def test_bad_workers_and_chunk_docs(c4_2k, local_dataset, tmp_path):
    with pytest.raises(InputError, match="workers"):
        run2k(c4_2k, local_dataset, tmp_path / "c", workers=-1)
    with pytest.raises(InputError, match="chunk_docs"):
        run2k(c4_2k, local_dataset, tmp_path / "c", chunk_docs=0)


def test_cli_resume_and_complete_messages(c4_2k, local_dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli"
    argv = ["--dataset", "json", "--name", "none", "--data-files", str(c4_2k)]
    argv += ["--tokenizer", str(local_dataset.tokenizer_dir), "--out", str(out), "--workers", "0"]
    # The module, not the package's `preprocess` function of the same name.
    monkeypatch.setattr(
        importlib.import_module("nanotron_recover.data.preprocess"), "DEFAULT_COMMIT_TOKENS", 2000
    )
    with monkeypatch.context() as m:
        interrupt_after_commits(m, 2)
        with pytest.raises(Interrupt):
            run_preprocess(make_parser().parse_args(argv))
    capsys.readouterr()
    assert run_preprocess(make_parser().parse_args(argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "resuming" in lines[0] and "wrote" in lines[1] and "tok/s" in lines[1]
    assert run_preprocess(make_parser().parse_args(argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "already complete" in lines[0]
    assert run_preprocess(make_parser().parse_args([*argv, "--split", "test"])) == 2
    assert "split: 'train' in the folder vs 'test' given" in capsys.readouterr().err


# -- the ordered worker pool ---------------------------------------------------------------
def test_encode_chunks_is_ordered_bounded_and_cleans_up(tokenizer):
    encoder = make_encoder(tokenizer)
    texts = [t[:200] for t in stdlib_docstring_texts()[:600]]
    chunks = [texts[i : i + 7] for i in range(0, len(texts), 7)]
    serial = list(encode_chunks(encoder, chunks, workers=0))

    pulled = []

    def source():
        for chunk in chunks:
            pulled.append(chunk)
            yield chunk

    results = encode_chunks(encoder, source(), workers=2)
    first = next(results)
    assert len(pulled) <= 4  # at most 2 x workers chunks read ahead of the consumer
    workers = multiprocessing.active_children()
    assert len(workers) == 2  # really tokenized in other processes
    parallel = [first, *results]
    assert len(parallel) == len(serial)
    for a, b in zip(parallel, serial, strict=True):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.lengths, b.lengths)
    assert not any(p.is_alive() for p in workers)

    # Stopping early (a token budget) terminates the pool instead of draining it.
    results = encode_chunks(encoder, chunks, workers=2)
    next(results)
    workers = multiprocessing.active_children()
    results.close()
    assert workers and not any(p.is_alive() for p in workers)


def test_single_chunk_needs_no_pool(tokenizer, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was started for a single chunk")

    monkeypatch.setattr("multiprocessing.get_context", no_pool)
    out = list(encode_chunks(make_encoder(tokenizer), [["one chunk", "", "only"]], workers=8))
    assert len(out) == 1 and out[0].lengths[1] == 0 and out[0].lengths.size == 3


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_fast_encoder_matches_the_transformers_call(local_dataset, split_special_tokens):
    tokenizer = AutoTokenizer.from_pretrained(
        local_dataset.tokenizer_dir, split_special_tokens=split_special_tokens
    )
    texts = [t for t in TEXTS if t] + ["</s> special <s> tokens in text", "\t\n  \u00a0x"]
    encoder = pickle.loads(pickle.dumps(make_encoder(tokenizer)))  # as a worker receives it
    encoded = encoder(texts)
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert encoded.lengths.tolist() == [len(ids) for ids in expected]
    assert encoded.ids.tolist() == [i for ids in expected for i in ids]
    assert (tokenizer.eos_token_id in encoded.ids.tolist()) == (not split_special_tokens)


def test_fingerprint_is_by_content(local_dataset, other_tokenizer, tmp_path):
    tok = AutoTokenizer.from_pretrained(local_dataset.tokenizer_dir)
    copy = shutil.copytree(local_dataset.tokenizer_dir, tmp_path / "copy")
    fp = tokenizer_fingerprint(tok)
    assert fp.startswith("sha256:") and fp == tokenizer_fingerprint(AutoTokenizer.from_pretrained(copy))
    assert fp != tokenizer_fingerprint(AutoTokenizer.from_pretrained(other_tokenizer))
