"""Tokenization throughput: ``preprocess`` on datatrove against the preprocess code it replaced.

The corpus is every stdlib docstring (:func:`~nanotron_recover.data.stdlib_docstring_texts`,
uncapped), repeated ``--repeat`` times so that a run tokenizes millions of tokens and lasts long
enough for the timing to mean something, written as two JSON-lines files; the tokenizer is the
offline byte-level BPE (:func:`~nanotron_recover.data.build_local_tokenizer`, ``--vocab-size`` ids).

Each configuration runs the real command line in a fresh process and is timed from start to exit
(Python start-up and imports included, as a user sees it), ``--trials`` times; the table gives the
median. Tokens per second are the output's tokens (eos included) over that time.

* new: ``nanotron-recover preprocess --data-files A B --tasks 2 --workers W`` (this checkout):
  datatrove's ``JsonlReader`` + ``DocumentTokenizer`` under ``LocalPipelineExecutor``; W tasks run
  at once, each in its own process when W > 1.
* old: ``nanotron-recover preprocess --dataset json --data-files A B --workers W`` of the commit
  before datatrove replaced it (``--old-src``: the ``src`` folder of a checkout of that commit, e.g.
  ``git worktree add ../old-preprocess 252de8d`` then ``--old-src ../old-preprocess/src``): a ``datasets`` stream
  tokenized by W spawned worker processes into ``tokens.bin``.

* new, 1 thread: the same with ``TOKENIZERS_PARALLELISM=false``. datatrove encodes a batch with
  ``encode_batch``, which by default spreads it over the Rust tokenizer's threads (all cores), while
  the old workers were single-threaded by design; this row compares core for core.

Both must produce the same documents (the same multiset of token sequences; the new output is
shuffled inside each file), which the benchmark checks. The trials are interleaved (trial 1 of
every configuration, then trial 2, ...) so that a busy machine slows all of them alike.

Writes ``benchmarks/results/tokenization.json`` and ``tokenization.md``.

    python benchmarks/tokenization.py --old-src ../old-preprocess/src [--repeat 30] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from common import describe, machine_info, markdown_table, write_report

from nanotron_recover.data import build_local_tokenizer, stdlib_docstring_texts, summarize_nanoset

SRC = Path(__file__).resolve().parent.parent / "src"
WORKERS = (1, 2)
FILES = 2
# Implementation -> (code, extra environment).
IMPLS = {
    "old": ("old", {}),
    "new": ("new", {}),
    "new, 1 thread": ("new", {"TOKENIZERS_PARALLELISM": "false"}),
}


def write_corpus(folder: Path, repeat: int) -> tuple[list[Path], dict]:
    texts = stdlib_docstring_texts(max_chars=10**9) * repeat
    folder.mkdir(parents=True)
    files = [folder / f"part-{i}.jsonl" for i in range(FILES)]
    for i, path in enumerate(files):
        with open(path, "w", encoding="utf-8") as f:
            for text in texts[i::FILES]:
                f.write(json.dumps({"text": text}) + "\n")
    return files, {"documents": len(texts), "chars": sum(map(len, texts)), "repeat": repeat, "files": FILES}


def command(impl: str, files: list[Path], tokenizer: Path, out: Path, workers: int) -> list[str]:
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "preprocess", "--data-files", *map(str, files)]
    cmd += ["--tokenizer", str(tokenizer), "--out", str(out), "--workers", str(workers)]
    if impl == "new":
        return cmd + ["--tasks", str(FILES)]
    return cmd + ["--dataset", "json", "--name", "none", "--no-progress"]


def documents(impl: str, out: Path, eos: int) -> Counter:
    """The output's documents as a multiset of token tuples."""
    docs: Counter = Counter()
    if impl == "new":
        for ds in summarize_nanoset(out).files:
            ids = np.fromfile(ds, dtype="<u2")
            ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
            docs.update(tuple(d) for d in np.split(ids, ends[:-1]))
        return docs
    index = json.loads((out / "index.json").read_text())
    ids = np.fromfile(out / "tokens.bin", dtype=index["dtype"])
    docs.update(tuple(d) for d in np.split(ids, np.flatnonzero(ids == eos)[:-1] + 1))
    return docs


def run_once(impl: str, cmd: list[str], old_src: Path, extra_env: dict[str, str]) -> float:
    src = SRC if impl == "new" else old_src
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra_env)
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--old-src", type=Path, required=True, help="src folder of a checkout of the commit before datatrove"
    )
    parser.add_argument("--repeat", type=int, default=30, help="copies of the docstrings (default 30)")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    old_src = args.old_src.resolve()
    old_commit = subprocess.run(
        ["git", "-C", str(old_src), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import nanotron_recover.data.corpus as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(old_src)),
    )
    if probe.returncode != 0 or not probe.stdout.strip().startswith(str(old_src)):
        raise SystemExit(f"--old-src {old_src} does not hold the old code (nanotron_recover/data/corpus.py)")

    times: dict[tuple[str, int], list[float]] = {(name, w): [] for w in WORKERS for name in IMPLS}
    load_before = os.getloadavg()
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files, corpus = write_corpus(tmp / "corpus", args.repeat)
        tokenizer = build_local_tokenizer(tmp / "tok", args.vocab_size)
        for trial in range(args.trials):
            for (name, workers), seconds in times.items():
                code, extra_env = IMPLS[name]
                out = tmp / "out"
                cmd = command(code, files, tokenizer, out, workers)
                seconds.append(run_once(code, cmd, old_src, extra_env))
                docs = documents(code, out, eos=1)
                if reference is None:
                    reference = docs
                elif docs != reference:
                    raise SystemExit(f"{name}, {workers} worker(s): other documents than the first run")
                shutil.rmtree(out)
                print(f"trial {trial}: {name}, workers={workers}: {seconds[-1]:.2f} s", flush=True)
    assert reference is not None
    tokens = sum(len(d) * n for d, n in reference.items())
    results = []
    for (name, workers), seconds in times.items():
        median = statistics.median(seconds)
        results.append(
            {
                "impl": name,
                "workers": workers,
                "tasks": FILES if IMPLS[name][0] == "new" else None,
                "env": IMPLS[name][1],
                "seconds": [round(t, 3) for t in seconds],
                "median_s": round(median, 3),
                "tokens": tokens,
                "tokens_per_s": round(tokens / median),
            }
        )
    corpus["tokens"] = tokens
    machine = machine_info()
    data = {
        "machine": machine,
        "old_commit": old_commit,
        "corpus": corpus,
        "vocab_size": args.vocab_size,
        "trials": args.trials,
        # The caller's, which "old" and "new" ran with.
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
        "same_documents": True,
        # 1-minute load averages before and after: other work on the machine shows up in the times.
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "results": results,
    }
    by = {(r["impl"], r["workers"]): r for r in results}
    rows = [
        [
            name,
            w,
            f"{by[name, w]['median_s']:.2f}",
            f"{by[name, w]['tokens_per_s']:,}",
            f"{by[name, w]['tokens_per_s'] / by['old', w]['tokens_per_s']:.2f}x",
        ]
        for w in WORKERS
        for name in IMPLS
    ]
    lines = [
        "# Tokenization throughput: datatrove pipeline vs the old preprocess",
        "",
        describe(machine),
        "",
        f"Corpus: all {corpus['documents'] // args.repeat:,} stdlib docstrings x {args.repeat} = "
        f"{corpus['documents']:,} documents, {corpus['chars']:,} characters, {tokens:,} tokens "
        f"(eos included) with the offline BPE of {args.vocab_size} ids, in {FILES} JSON-lines files.",
        "",
        f"- old: `preprocess` of commit {old_commit[:7]}: a `datasets` stream encoded by W spawned, "
        "single-threaded worker processes into `tokens.bin`;",
        f"- new: datatrove `JsonlReader` + `DocumentTokenizer` (`preprocess --tasks {FILES} --workers W`), "
        "W tasks at a time, each encoding with the Rust tokenizer's threads;",
        "- new, 1 thread: the same with `TOKENIZERS_PARALLELISM=false`, core for core with old.",
        "",
        f"Each time is the median of {args.trials} runs of the whole command, start-up (Python, torch, "
        "tokenizer) included, trials interleaved; every run wrote the same documents. Load average "
        f"{data['load_average'][0]} before, {data['load_average'][1]} after.",
        "",
        *markdown_table(["implementation", "workers", "seconds", "tokens/s", "vs old"], rows),
    ]
    write_report(Path(args.out), "tokenization", data, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
