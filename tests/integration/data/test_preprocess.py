"""``preprocess``: datatrove's JsonlReader + DocumentTokenizer writing Nanoset folders.

The input is C4-shaped JSON lines (``text``, ``timestamp``, ``url``) with edge cases (unicode,
code, an eos written out in the text, empty and null text), tokenized with the offline stdlib
tokenizer. What is checked is what training relies on: every document is the tokenizer's ids plus
one eos, the files decode back to the input texts, the output is the same bytes for the same seed
whatever the workers, a rerun resumes (skips finished tasks) and never mixes two corpora, and bad
input is a one-line InputError. Nothing here downloads: the Hugging Face reader is only built.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import nanotron_recover.data as data_pkg
from nanotron_recover.data.local_corpus import build_local_tokenizer, stdlib_docstring_texts
from nanotron_recover.data.preprocess import (
    DEFAULT_LOGGING_DIR,
    RECORD_FILE,
    _plan,
    _source_of,
    add_preprocess_arguments,
    run_preprocess,
    summarize_nanoset,
    tokenize_to_nanoset,
)
from nanotron_recover.data.tokenization import tokenizer_fingerprint
from nanotron_recover.errors import InputError
from tests.helpers.mpirun_utils import REPO

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x + 1  # a comment\n",
    "",  # rows without text are skipped
    "Unicode survives: naïve café — 東京 🚀, and    odd   spacing .",
    None,  # so are null ones
    "Return the number of items in a container. " * 20,
    "an eos written out </s> stays inside its document",
    "last",
]
KEPT = [t for t in TEXTS if t]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def write_jsonl(path: Path, texts: list[str | None]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            stamp = f"2019-04-2{i % 10}T12:57:54Z"
            row = {"text": text, "timestamp": stamp, "url": f"https://example.com/{i}"}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def c4_jsonl(tmp_path):
    return write_jsonl(tmp_path / "c4-sample.json", TEXTS)


@pytest.fixture(scope="module")
def docstring_shards(tmp_path_factory):
    """1,000 short stdlib docstrings in two JSON-lines files, with C4's columns."""
    folder = tmp_path_factory.mktemp("shards")
    texts = [t[:400] for t in stdlib_docstring_texts()[:1000]]
    return [write_jsonl(folder / f"part-{i}.jsonl", texts[i::2]) for i in range(2)], texts


@pytest.fixture
def tok_dir(local_dataset):
    return str(local_dataset.tokenizer_dir)


def documents(folder: Path) -> list[list[int]]:
    """Every document of a Nanoset folder, as its ids, read with plain numpy (file by file, in file order)."""
    docs = []
    for ds in sorted(Path(folder).glob("*.ds")):
        token_size = int(Path(f"{ds}.metadata").read_text().splitlines()[0].rsplit("|", 1)[1])
        ids = np.fromfile(ds, dtype="<u2" if token_size == 2 else "<u4")
        ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
        assert ends.size and ends[-1] == ids.size and np.all(np.diff(ends) > 0)
        docs += [ids[s:e].tolist() for s, e in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)]
    return docs


def multiset(folder: Path) -> Counter:
    return Counter(map(tuple, documents(folder)))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


# -- what gets written ---------------------------------------------------------------------------
def test_documents_are_the_tokenizer_ids_plus_one_eos_and_decode_back(c4_jsonl, tok_dir, tmp_path):
    summary = tokenize_to_nanoset(c4_jsonl, tmp_path / "out", tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id
    expected = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in KEPT]

    assert summary.num_documents == len(KEPT)
    assert summary.num_tokens == sum(len(ids) for ids in expected)  # encoded lengths + one eos each
    assert (summary.tokenizer, summary.token_size, summary.dtype) == (tok_dir, 2, "uint16")
    assert [p.name for p in summary.files] == ["00000_00000_doc_shuffled.ds"]
    metadata = Path(f"{summary.files[0]}.metadata").read_text().splitlines()
    assert metadata[:2] == [f"{tok_dir}|2", str(summary.num_tokens)]
    # datatrove's three lines, then the fingerprint training compares the tokenizer by.
    assert len(metadata) == 4 and metadata[3] == f"tokenizer_fingerprint={tokenizer_fingerprint(tok)}"
    assert summary.tokenizer_fingerprint == tokenizer_fingerprint(tok)
    docs = documents(tmp_path / "out")
    assert Counter(map(tuple, docs)) == Counter(map(tuple, expected))
    assert all(d[-1] == eos for d in docs) and not any(tok.bos_token_id in d for d in docs)
    assert sorted(tok.decode(d[:-1]) for d in docs) == sorted(KEPT)
    # The readers of the folder see only the Nanoset files; datatrove's logs are hidden inside it.
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == sorted(
        f"00000_00000_doc_shuffled.ds{s}" for s in ("", ".index", ".metadata")
    )
    assert (tmp_path / "out" / DEFAULT_LOGGING_DIR / "completions" / "00000").is_file()


def test_eos_token_can_be_chosen(c4_jsonl, tok_dir, tmp_path):
    tokenize_to_nanoset(c4_jsonl, tmp_path / "out", tok_dir, eos_token="<s>")
    docs = documents(tmp_path / "out")
    assert len(docs) == len(KEPT) and all(d[-1] == 0 for d in docs)  # <s> is id 0


def test_truncation_saved_in_the_tokenizer_does_not_cut_documents(c4_jsonl, tok_dir, tmp_path):
    from tokenizers import Tokenizer

    copy = Path(shutil.copytree(tok_dir, tmp_path / "tok"))
    truncating = Tokenizer.from_file(str(copy / "tokenizer.json"))
    truncating.enable_truncation(8)
    truncating.save(str(copy / "tokenizer.json"))
    tokenize_to_nanoset(c4_jsonl, tmp_path / "out", str(copy))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    expected = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in KEPT]
    assert max(map(len, expected)) > 8 and multiset(tmp_path / "out") == Counter(map(tuple, expected))


def test_same_seed_same_bytes_other_seed_other_order(docstring_shards, tok_dir, tmp_path):
    files, texts = docstring_shards
    a = tokenize_to_nanoset(files[0], tmp_path / "a", tok_dir, seed=3)
    tokenize_to_nanoset(files[0], tmp_path / "b", tok_dir, seed=3)
    tokenize_to_nanoset(files[0], tmp_path / "c", tok_dir, seed=4)
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")
    assert documents(tmp_path / "a") != documents(tmp_path / "c")
    assert multiset(tmp_path / "a") == multiset(tmp_path / "c")
    assert a.num_documents == len(texts[0::2])


def test_two_tasks_two_files_same_documents_whatever_the_workers(docstring_shards, tok_dir, tmp_path):
    files, texts = docstring_shards
    one = tokenize_to_nanoset(files, tmp_path / "one", tok_dir)
    two = tokenize_to_nanoset(files, tmp_path / "two", tok_dir, tasks=2, workers=2)
    assert [p.name for p in two.files] == ["00000_00000_doc_shuffled.ds", "00001_00000_doc_shuffled.ds"]
    assert (two.num_tokens, two.num_documents) == (one.num_tokens, one.num_documents)
    assert one.num_documents == len(texts)
    assert multiset(tmp_path / "two") == multiset(tmp_path / "one")
    # Task r reads file r: the first file's documents are the first output file's.
    tok = AutoTokenizer.from_pretrained(tok_dir)
    first = [tok.decode(d[:-1]) for d in documents(tmp_path / "two")[: len(texts[0::2])]]
    assert sorted(first) == sorted(texts[0::2])
    # Sequential tasks in this process write the same bytes as two worker processes.
    tokenize_to_nanoset(files, tmp_path / "seq", tok_dir, tasks=2, workers=1)
    assert folder_bytes(tmp_path / "seq") == folder_bytes(tmp_path / "two")


def test_folders_are_searched_for_json_lines_files(tmp_path, tok_dir):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    write_jsonl(root / "a.jsonl", ["alpha"])
    write_jsonl(root / "sub" / "b.json", ["beta"])
    with gzip.open(root / "sub" / "c.json.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "gamma"}) + "\n")
    write_jsonl(root / ".hidden" / "d.jsonl", ["hidden"])  # a logging dir, .git: skipped
    (root / "notes.txt").write_text('{"text": "not json lines by name"}\n')
    tokenize_to_nanoset(root, tmp_path / "out", tok_dir, tasks=3)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert sorted(tok.decode(d[:-1]) for d in documents(tmp_path / "out")) == ["alpha", "beta", "gamma"]
    record = json.loads((tmp_path / "out" / DEFAULT_LOGGING_DIR / RECORD_FILE).read_text())
    assert [Path(f).name for f in record["source"]["jsonl"]] == ["a.jsonl", "b.json", "c.json.gz"]


def test_a_task_without_text_leaves_no_files(tmp_path, tok_dir):
    full = write_jsonl(tmp_path / "a.jsonl", ["some text", "more text"])
    empty = write_jsonl(tmp_path / "b.jsonl", ["", None])
    summary = tokenize_to_nanoset([full, empty], tmp_path / "out", tok_dir, tasks=2)
    assert [p.name for p in summary.files] == ["00000_00000_doc_shuffled.ds"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == sorted(
        f"00000_00000_doc_shuffled.ds{s}" for s in ("", ".index", ".metadata")
    )
    assert summary.num_documents == 2


# -- resuming ------------------------------------------------------------------------------------
def test_rerun_skips_completed_tasks_and_redoes_the_rest(docstring_shards, tok_dir, tmp_path):
    files, _ = docstring_shards
    out = tmp_path / "out"
    first = tokenize_to_nanoset(files, out, tok_dir, tasks=2)
    before = folder_bytes(out)
    mtimes = {p: p.stat().st_mtime_ns for p in first.files}
    # Everything done: nothing is written again.
    assert tokenize_to_nanoset(files, out, tok_dir, tasks=2) == first
    assert {p: p.stat().st_mtime_ns for p in first.files} == mtimes
    # Task 1 "crashed": no completion mark, its output gone. The rerun redoes task 1 only.
    (out / DEFAULT_LOGGING_DIR / "completions" / "00001").unlink()
    for p in out.glob("00001_*"):
        p.unlink()
    assert tokenize_to_nanoset(files, out, tok_dir, tasks=2) == first
    assert first.files[0].stat().st_mtime_ns == mtimes[first.files[0]]
    assert first.files[1].stat().st_mtime_ns != mtimes[first.files[1]]
    assert folder_bytes(out) == before


def test_rerun_with_other_arguments_is_refused(docstring_shards, tok_dir, tmp_path):
    files, _ = docstring_shards
    out = tmp_path / "out"
    tokenize_to_nanoset(files[0], out, tok_dir, seed=1)
    with pytest.raises(InputError, match="seed: 1 there vs 2 now") as info:
        tokenize_to_nanoset(files[0], out, tok_dir, seed=2)
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match="source"):
        tokenize_to_nanoset(files[1], out, tok_dir, seed=1)
    with pytest.raises(InputError, match="text_key"):
        tokenize_to_nanoset(files[0], out, tok_dir, seed=1, text_key="url")
    # The same arguments from another working directory (relative paths) still resume.
    cwd = os.getcwd()
    try:
        os.chdir(files[0].parent)
        tokenize_to_nanoset(files[0].name, out, tok_dir, seed=1)
    finally:
        os.chdir(cwd)


def test_another_tokenizers_folder_is_refused(c4_jsonl, tok_dir, tmp_path):
    tokenize_to_nanoset(c4_jsonl, tmp_path / "out", tok_dir)
    other = build_local_tokenizer(tmp_path / "other", vocab_size=300)
    with pytest.raises(InputError, match="already holds data tokenized with") as info:
        tokenize_to_nanoset(c4_jsonl, tmp_path / "out", str(other))
    assert "\n" not in str(info.value)
    # Same name, other logging dir: the .ds files are not this run's to resume.
    with pytest.raises(InputError, match="did not make"):
        tokenize_to_nanoset(c4_jsonl, tmp_path / "out", tok_dir, logging_dir=tmp_path / "logs")


# -- bad input -----------------------------------------------------------------------------------
def _no_eos_tokenizer(tok_dir: str, folder: Path) -> str:
    no_eos = PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / "tokenizer.json"))
    assert no_eos.eos_token_id is None
    no_eos.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing input", "does not exist"),
        ("folder without json lines", "holds no JSON-lines files"),
        ("tokenizer not found", "tokenizer .* not found or not loadable"),
        ("tokenizer without eos", "has no eos token"),
        ("eos not in vocabulary", "is not a token of tokenizer"),
        ("empty corpus", "holds no document with text"),
        ("wrong text key", "under key 'body'"),
        ("more tasks than files", "--tasks 2 but 1 input file"),
        ("out is a file", "is a file, not a folder"),
    ],
)
def test_bad_input_is_a_one_line_input_error(case, message, c4_jsonl, tok_dir, tmp_path):
    inputs, out, tokenizer, kwargs = [c4_jsonl], tmp_path / "out", tok_dir, {}
    if case == "missing input":
        inputs = [tmp_path / "nope.jsonl"]
    elif case == "folder without json lines":
        (tmp_path / "empty_dir").mkdir()
        inputs = [tmp_path / "empty_dir"]
    elif case == "tokenizer not found":
        tokenizer = str(tmp_path / "no-such-tokenizer")
    elif case == "tokenizer without eos":
        tokenizer = _no_eos_tokenizer(tok_dir, tmp_path / "tok")
    elif case == "eos not in vocabulary":
        kwargs = {"eos_token": "<|endoftext|>"}
    elif case == "empty corpus":
        inputs = [write_jsonl(tmp_path / "blank.jsonl", ["", None])]
    elif case == "wrong text key":
        kwargs = {"text_key": "body"}
    elif case == "more tasks than files":
        kwargs = {"tasks": 2}
    elif case == "out is a file":
        out.write_text("x")
    with pytest.raises(InputError, match=message) as info:
        tokenize_to_nanoset(inputs, out, tokenizer, **kwargs)
    assert "\n" not in str(info.value)


def test_damaged_nanoset_is_named(c4_jsonl, tok_dir, tmp_path):
    summary = tokenize_to_nanoset(c4_jsonl, tmp_path / "out", tok_dir)
    ds = summary.files[0]
    with open(ds, "r+b") as f:
        f.truncate(ds.stat().st_size - 2)
    with pytest.raises(InputError, match=f"{ds.name} is damaged or truncated"):
        summarize_nanoset(tmp_path / "out")
    with pytest.raises(InputError, match="holds no Nanoset files"):
        summarize_nanoset(tmp_path)


# -- the command line ----------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_preprocess_arguments(parser)
    return parser.parse_args(argv)


def test_cli_end_to_end_in_a_subprocess(c4_jsonl, tok_dir, tmp_path):
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "preprocess", "--data-files", str(c4_jsonl)]
    cmd += ["--tokenizer", tok_dir, "--out", str(tmp_path / "out")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO / "src"))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = summarize_nanoset(tmp_path / "out")
    assert summary.num_documents == len(KEPT)
    assert f"holds {summary.num_tokens:,} tokens in {len(KEPT)} documents" in run.stdout
    # Again: nothing left to do, said so.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert again.returncode == 0 and "1 of 1 task(s) already complete" in again.stdout
    # Bad input: status 2, one line, no traceback.
    missing = cmd[:5] + [str(tmp_path / "missing.jsonl")] + cmd[6:]
    bad = subprocess.run(missing, capture_output=True, text=True, timeout=180, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"nanotron-recover preprocess: error: input {str(tmp_path / 'missing.jsonl')!r} does not exist"
    ]


def test_cli_help_and_defaults():
    parser = argparse.ArgumentParser()
    add_preprocess_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "default: the tokenizer's own eos token, so documents stay separated" in text
    args = parse(["--tokenizer", "t", "--out", "o", "--data-files", "a.jsonl"])
    assert (args.tasks, args.workers, args.seed) == (1, None, 0)
    assert (args.executor, args.text_key) == ("local", "text")
    assert (args.eos_token, args.logging_dir, args.limit, args.partition, args.account) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert parse(["--tokenizer", "t", "--out", "o", "--text-key", "body"]).text_key == "body"
    with pytest.raises(SystemExit):
        parse(["--tokenizer", "t", "--out", "o", "--tasks", "0"])


def test_cli_sources(tmp_path, c4_jsonl):
    base = ["--tokenizer", "t", "--out", "o"]
    assert _source_of(parse(base + ["--data-files", str(c4_jsonl)])) == {"jsonl": [str(c4_jsonl.resolve())]}
    assert _source_of(parse(base + ["--dataset", "json", "--data-files", str(c4_jsonl)]))["jsonl"]
    hf = _source_of(parse(base + ["--dataset", "allenai/c4", "--name", "en"]))
    assert hf == {"hf": {"dataset": "allenai/c4", "name": "en", "split": "train", "streaming": True}}
    with pytest.raises(InputError, match="nothing to read"):
        _source_of(parse(base))
    with pytest.raises(InputError, match="cannot be combined"):
        _source_of(parse(base + ["--dataset", "allenai/c4", "--data-files", str(c4_jsonl)]))


def test_hugging_face_source_builds_datatroves_reader_without_reading(tok_dir, tmp_path):
    source = {"hf": {"dataset": "allenai/c4", "name": "en", "split": "validation", "streaming": True}}
    plan = _plan(
        source,
        tmp_path / "out",
        tok_dir,
        tasks=4,
        text_key="text",
        eos_token=None,
        seed=0,
        limit=10,
        logging_dir=None,
    )
    reader, writer = plan.pipeline[0], plan.pipeline[1]
    assert type(reader).__name__ == "HuggingFaceDatasetReader"
    assert (reader.dataset, reader.dataset_options, reader.streaming, reader.limit) == (
        "allenai/c4",
        {"name": "en", "split": "validation"},
        True,
        10,
    )
    assert type(writer).__name__ == "DocumentTokenizer" and writer.tokenizer_name_or_path == tok_dir
    assert writer.token_size == 2


def test_cli_reports_user_errors_as_one_line(c4_jsonl, tok_dir, tmp_path, capsys):
    args = parse(["--data-files", str(c4_jsonl), "--tokenizer", tok_dir, "--out", str(tmp_path / "o")])
    args.tasks = 3
    assert run_preprocess(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanotron-recover preprocess: error: --tasks 3 but 1 input")


# -- slurm executor ------------------------------------------------------------------------------
FAKE_SBATCH = """#!/bin/bash
# Records each submitted script, answers like sbatch.
n=$(ls "$SBATCH_LOG"/*.sbatch 2>/dev/null | wc -l)
cp "${@: -1}" "$SBATCH_LOG/$n.sbatch"
echo "$@" > "$SBATCH_LOG/$n.args"
echo "Submitted batch job $((4242 + n))"
"""


def test_slurm_executor_submits_a_job_array_with_the_slurm_options(
    docstring_shards, tok_dir, tmp_path, monkeypatch, capsys
):
    files, _ = docstring_shards
    bin_dir, log = tmp_path / "bin", tmp_path / "submitted"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SBATCH_LOG", str(log))
    argv = ["--data-files", *map(str, files), "--tokenizer", tok_dir, "--out", str(tmp_path / "out")]
    argv += ["--tasks", "2", "--executor", "slurm", "--partition", "cpu", "--account", "proj42"]
    argv += ["--time", "02:00:00", "--sbatch-arg=--qos=high", "--workers", "1"]
    assert run_preprocess(parse(argv)) == 0
    assert "submitted Slurm job 4242 (2 task(s))" in capsys.readouterr().out
    script = (log / "0.sbatch").read_text()
    for line in ("--partition=cpu", "--account=proj42", "--time=02:00:00", "--qos=high", "--array=0-1%1"):
        assert f"#SBATCH {line}" in script.splitlines(), script
    assert "--qos=normal" not in script
    assert f"export PATH={Path(sys.executable).parent}:$PATH" in script
    assert "launch_pickled_pipeline" in script and str(tmp_path / "out" / DEFAULT_LOGGING_DIR) in script
    assert (tmp_path / "out" / DEFAULT_LOGGING_DIR / "executor.pik").is_file()
    # Then datatrove's stats-merging job, once the array is done.
    assert "--dependency=afterok:4242" in (log / "1.sbatch").read_text() + (log / "1.args").read_text()

    path = [p for p in os.environ["PATH"].split(os.pathsep) if p != str(bin_dir)]
    monkeypatch.setenv("PATH", os.pathsep.join(path))  # no sbatch: the errors come before submitting
    no_partition = [a for a in argv if a not in ("--partition", "cpu")]
    assert run_preprocess(parse(no_partition)) == 2
    assert "--executor slurm needs --partition" in capsys.readouterr().err
    bad_time = [("two days" if a == "02:00:00" else a) for a in argv]
    assert run_preprocess(parse(bad_time)) == 2
    assert "is not a Slurm time" in capsys.readouterr().err


@pytest.fixture(scope="module")
def slurm():
    from tests.helpers.slurm_local.cluster import LocalSlurm, SlurmUnavailable, ensure_installed

    try:
        ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm: {e}")
    cluster = LocalSlurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.mpi
def test_slurm_job_array_writes_the_same_bytes_as_a_local_run(slurm, docstring_shards, tok_dir, tmp_path):
    """A real (local) Slurm runs the datatrove job array `preprocess --executor slurm` submits."""
    files, _ = docstring_shards
    out = tmp_path / "slurm"
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "preprocess", "--data-files", *map(str, files)]
    cmd += ["--tokenizer", tok_dir, "--out", str(out), "--tasks", "2", "--executor", "slurm"]
    cmd += ["--partition", "debug", "--time", "10"]
    env = dict(slurm.env, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO / "src"))
    submit = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert submit.returncode == 0, submit.stderr[-3000:]
    marks = [out / DEFAULT_LOGGING_DIR / "completions" / f"{r:05d}" for r in range(2)]
    deadline = time.monotonic() + 240
    while (slurm.job_ids() or not all(m.is_file() for m in marks)) and time.monotonic() < deadline:
        time.sleep(1)
    logs = "\n".join(p.read_text()[-2000:] for p in (out / DEFAULT_LOGGING_DIR / "slurm_logs").glob("*.out"))
    assert all(m.is_file() for m in marks), logs + slurm.logs()
    tokenize_to_nanoset(files, tmp_path / "local", tok_dir, tasks=2)
    assert folder_bytes(out) == folder_bytes(tmp_path / "local")
    assert summarize_nanoset(out).num_tokens == summarize_nanoset(tmp_path / "local").num_tokens
    # Rerun: every task is complete, nothing is submitted.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert again.returncode == 0 and "all 2 task(s) are complete; nothing submitted" in again.stdout


# -- the rest of the package -----------------------------------------------------------------------
def test_fingerprint_is_by_content(local_dataset, tmp_path):
    tok = AutoTokenizer.from_pretrained(local_dataset.tokenizer_dir)
    copy = shutil.copytree(local_dataset.tokenizer_dir, tmp_path / "copy")
    other = build_local_tokenizer(tmp_path / "other", vocab_size=300)
    fp = tokenizer_fingerprint(tok)
    assert fp.startswith("sha256:") and fp == tokenizer_fingerprint(AutoTokenizer.from_pretrained(copy))
    assert fp != tokenizer_fingerprint(AutoTokenizer.from_pretrained(other))


def test_package_exports_resolve():
    for name in data_pkg.__all__:
        assert getattr(data_pkg, name) is not None
    assert data_pkg.tokenize_to_nanoset is tokenize_to_nanoset
