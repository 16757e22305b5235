"""Tokenize text into a Nanoset folder with datatrove (``nanotron-recover preprocess``).

A Nanoset folder is what datatrove's ``DocumentTokenizer`` writes and what training reads
(:mod:`.nanoset`). Each task of the run leaves three files:

* ``<task>_<part>_doc_shuffled.ds``: the token ids of its documents back to back, little-endian
  uint16 (uint32 for vocabularies of more than 65,536 ids);
* ``.ds.index``: where each document ends, in tokens, as little-endian uint64;
* ``.ds.metadata``: ``tokenizer_name_or_path|token_size`` on the first line, then the token count,
  the count in words (datatrove's three lines), and ``tokenizer_fingerprint=sha256:...``, the
  tokenizer's content fingerprint (:func:`.tokenization.tokenizer_fingerprint`).

Preprocessing runs once, before training, so that the training loop only memory-maps token ids
(no tokenizer, no dataset library, no network in the hot path).

The pipeline is datatrove's end to end: a reader (``JsonlReader`` over JSON-lines files, or
``HuggingFaceDatasetReader``), then ``DocumentTokenizer``, run by ``LocalPipelineExecutor``
(``--workers`` processes on this machine) or ``SlurmPipelineExecutor`` (one Slurm job array). What
this module adds around it:

* The tokenizer is loaded with ``transformers`` (:func:`.tokenization.load_tokenizer`), so a local
  folder, a hub id, or a tokenizer shipped without ``tokenizer.json`` all work (datatrove's own
  loader takes a hub id or a ``tokenizer.json`` file only). Its ``tokenizers`` backend is what
  datatrove encodes with, changed in two ways: truncation and padding are off (a saved
  ``tokenizer.json`` may have them on, which would silently cut documents), and the post-processor
  appends the eos token -- the tokenizer's own unless ``eos_token`` says otherwise -- and nothing
  else (no bos). One eos per document keeps documents apart once they are packed into samples.
  The metadata names the tokenizer exactly as it was given and records its fingerprint: training
  compares the tokenizer of the config's ``tokenizer.tokenizer_name_or_path`` by that fingerprint,
  so the config may spell it differently (:func:`.tokenization.check_same_tokenizer`).
* Inputs are explicit: JSON-lines files, and folders of them (``*.jsonl`` / ``*.json``, optionally
  compressed; hidden entries skipped), are listed once, in the order given and sorted within a
  folder. Task ``r`` of ``T`` reads files ``r, r + T, ...`` -- a task reads whole files, so
  ``tasks`` may not exceed the number of files. Rows without text are skipped.
* Documents are shuffled inside each output file with a fixed seed, so the output is a pure function
  of (inputs, tokenizer, eos token, seed, tasks): the number of workers and the executor change how
  fast it is made, never a byte of it.
* Resuming is datatrove's: each finished task leaves a mark in the logging dir (default
  ``<out>/.datatrove``, a hidden folder that readers of ``*.ds`` never see) and a rerun with the same
  logging dir skips those tasks, redoing only the unfinished ones. Beside the marks the run keeps a
  record of its arguments (``preprocess.json``: inputs, tokenizer and its content fingerprint, eos,
  seed, tasks, ...). A rerun with other arguments is refused, and so is an ``out`` that holds another
  tokenizer's data or ``.ds`` files this logging dir did not make: a folder never silently mixes two
  corpora.
* A task whose share of the input has no text leaves no (empty) files behind.

Bad input is an :class:`~nanotron_recover.errors.InputError` with a one-line message. datatrove,
``transformers`` and ``datasets`` are imported inside the functions that use them, so importing the
data package (which every training rank does) stays cheap.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_recover.data.nanoset import NanosetSummary, read_metadata, record_fingerprint, summarize_nanoset
from nanotron_recover.data.tokenization import default_workers, load_tokenizer, tokenizer_fingerprint
from nanotron_recover.errors import InputError

DEFAULT_LOGGING_DIR = ".datatrove"  # inside --out
RECORD_FILE = "preprocess.json"  # in the logging dir: the arguments of the run
INPUT_LIST_FILE = "input_files.txt"  # in the logging dir: the JSON-lines files, one per line
DEFAULT_JOB_NAME = "nanotron-recover-preprocess"
# Bump when the record's meaning changes, so an old logging dir is not resumed by different code.
_RECORD_VERSION = 1
# JSON-lines file names picked up from a folder: .jsonl / .json, optionally compressed.
_JSONL_NAME = re.compile(r"\.jsonl?(\.(gz|bz2|xz|zst|zstd|lz4))?$", re.IGNORECASE)


# -- the output: a Nanoset folder, checked by data.nanoset ----------------------------------------
def _drop_empty_output(data: Any, rank: int, world_size: int, *, folder: str) -> None:
    """Last pipeline step: remove this task's files if it tokenized nothing.

    ``DocumentTokenizer`` leaves an empty ``<rank>_unshuffled.ds`` (and its index and metadata) when
    its share of the input has no text; a zero-length file is not something to memory-map.
    """
    for ds in Path(folder).glob(f"{rank:05d}_*.ds"):
        if ds.stat().st_size == 0:
            for path in (ds, Path(f"{ds}.index"), Path(f"{ds}.metadata")):
                path.unlink(missing_ok=True)


def _record_fingerprint(data: Any, rank: int, world_size: int, *, folder: str, fingerprint: str) -> None:
    """Last pipeline step: add the tokenizer's fingerprint to this task's ``.ds.metadata`` files.

    datatrove writes its three lines; this adds the line training compares tokenizers by. A task
    stopped before this step is not marked complete, so its rerun writes the files again.
    """
    for ds in Path(folder).glob(f"{rank:05d}_*.ds"):
        record_fingerprint(ds, fingerprint)


# -- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """A checked run: the pipeline, where it writes and logs, and how many tasks were done before."""

    pipeline: list[Any]
    out: Path
    logging_dir: Path
    tasks: int
    completed_before: int
    text_key: str


def tokenize_to_nanoset(
    inputs: Sequence[str | Path] | str | Path,
    out: str | Path,
    tokenizer: str,
    *,
    tasks: int = 1,
    workers: int = 1,
    text_key: str = "text",
    eos_token: str | None = None,
    seed: int = 0,
    logging_dir: str | Path | None = None,
) -> NanosetSummary:
    """Tokenize JSON-lines files (or folders of them) into a Nanoset folder at ``out``, on this machine.

    ``tasks`` output files are made (at most one per input file), ``workers`` of them at a time;
    ``eos_token`` (default: the tokenizer's own) ends every document; ``seed`` fixes the document
    order inside each file. ``logging_dir`` (default ``<out>/.datatrove``) holds datatrove's logs
    and completion marks: calling again with the same one skips the tasks already done. See the
    module docstring for what is checked. Returns the summary of the whole folder.

    With ``workers > 1`` the tasks run in datatrove's ``forkserver`` worker processes, which
    re-import the calling script: a script calling this needs the ``if __name__ == "__main__":``
    guard (without it the run hangs in multiprocessing's bootstrap error).
    """
    if workers < 1:
        raise InputError(f"workers must be >= 1, got {workers}")
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    source = {"jsonl": [str(f) for f in _jsonl_files(inputs)]}
    plan = _plan(
        source,
        out,
        str(tokenizer),
        tasks=tasks,
        text_key=text_key,
        eos_token=eos_token,
        seed=seed,
        limit=None,
        logging_dir=logging_dir,
    )
    return _run_local(plan, workers)


def _jsonl_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The JSON-lines files of ``inputs`` (files as given, folders searched), absolute, no duplicates."""
    if not inputs:
        raise InputError("no input files given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = _jsonl_in(path)
            if not found:
                raise InputError(
                    f"input folder {str(path)!r} holds no JSON-lines files (*.jsonl, *.json[.gz])"
                )
        else:
            raise InputError(f"input {str(path)!r} does not exist")
        files += [f.resolve() for f in found]
    unique = list(dict.fromkeys(files))
    for f in unique:
        if "\n" in str(f):
            raise InputError(f"input file name {str(f)!r} contains a newline")
    return unique


def _jsonl_in(folder: Path) -> list[Path]:
    """The JSON-lines files under ``folder``, sorted; hidden files and folders (logs, .git) skipped."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # os.walk descends into what is left
        found += [Path(root, n) for n in names if _JSONL_NAME.search(n) and not n.startswith(".")]
    return sorted(found)


def _plan(
    source: dict[str, Any],
    out: str | Path,
    tokenizer: str,
    *,
    tasks: int,
    text_key: str,
    eos_token: str | None,
    seed: int,
    limit: int | None,
    logging_dir: str | Path | None,
) -> _Plan:
    """Check everything that can be checked before tokenizing, record the run, build the pipeline."""
    if tasks < 1:
        raise InputError(f"--tasks must be >= 1, got {tasks}")
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be >= 1, got {limit}")
    if "jsonl" in source and tasks > len(source["jsonl"]):
        n = len(source["jsonl"])
        raise InputError(
            f"--tasks {tasks} but {n} input file(s): a task reads whole files, so use --tasks {n} or fewer "
            f"(or split the input into more files)"
        )
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file, not a folder")
    logs = Path(logging_dir).absolute() if logging_dir is not None else out / DEFAULT_LOGGING_DIR
    prepared, eos, fingerprint = _prepared_tokenizer(tokenizer, eos_token)
    record = {
        "version": _RECORD_VERSION,
        "out": str(out),
        "source": source,
        "text_key": text_key,
        "limit": limit,
        "tokenizer": tokenizer,
        "tokenizer_fingerprint": fingerprint,
        "eos_token": eos,
        "seed": seed,
        "tasks": tasks,
    }
    _check_out(out, logs, tokenizer, record)

    from datatrove.pipeline.tokens import DocumentTokenizer

    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    _write_atomic(logs / RECORD_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")
    reader = _reader(source, text_key, limit, logs)
    writer = DocumentTokenizer(
        output_folder=str(out),
        tokenizer_name_or_path=tokenizer,  # what the metadata records
        eos_token=eos,
        seed=seed,
    )
    # The step encodes with the prepared backend instead of loading `tokenizer` itself (which
    # datatrove cannot do for a local folder). `tokenizer` is a functools.cached_property, which
    # takes an assigned value by design; it travels to the workers (and Slurm jobs) pickled.
    writer.tokenizer = prepared
    completed = len(list((logs / "completions").glob("[0-9]*"))) if (logs / "completions").is_dir() else 0
    pipeline = [
        reader,
        writer,
        functools.partial(_drop_empty_output, folder=str(out)),
        functools.partial(_record_fingerprint, folder=str(out), fingerprint=fingerprint),
    ]
    return _Plan(pipeline, out, logs, tasks, min(completed, tasks), text_key)


def _prepared_tokenizer(name: str, eos_token: str | None) -> tuple[Any, str, str]:
    """(the ``tokenizers.Tokenizer`` datatrove encodes with, the eos token, the content fingerprint)."""
    try:
        tok = load_tokenizer(name)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"tokenizer {name!r} not found or not loadable: {reason}") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise InputError(
            f"tokenizer {name!r} has no fast (`tokenizers`) version, which datatrove encodes with"
        )
    eos = eos_token if eos_token is not None else tok.eos_token
    if not eos:
        raise InputError(f"tokenizer {name!r} has no eos token to end documents with: pass --eos-token")
    eos_id = backend.token_to_id(eos)
    if eos_id is None:
        raise InputError(f"eos token {eos!r} is not a token of tokenizer {name!r}")

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    prepared = Tokenizer.from_str(backend.to_str())  # a copy: the transformers tokenizer stays as it was
    prepared.no_truncation()
    prepared.no_padding()
    prepared.post_processor = TemplateProcessing(single="$A <EOS>", special_tokens=[("<EOS>", eos_id)])
    return prepared, eos, tokenizer_fingerprint(tok)


def _check_out(out: Path, logs: Path, tokenizer: str, record: dict[str, Any]) -> None:
    """Refuse an ``out`` holding another tokenizer's data or files this logging dir did not make,
    and a rerun with other arguments than the record in the logging dir."""
    existing = sorted(out.glob("*.ds")) if out.is_dir() else []
    names = set()
    for ds in existing:
        try:
            names.add(read_metadata(ds)[0])
        except InputError:
            pass  # an unfinished task's file; the task writes it again
    others = sorted(names - {tokenizer})
    if others:
        raise InputError(
            f"--out {str(out)!r} already holds data tokenized with {others[0]!r}, not {tokenizer!r}: "
            "choose another --out"
        )
    previous = _read_record(logs)
    if previous is not None and previous != json.loads(json.dumps(record)):
        changed = [k for k in sorted(set(record) | set(previous)) if previous.get(k) != record.get(k)]
        detail = "; ".join(
            f"{k}: {_short(previous.get(k))} there vs {_short(record.get(k))} now" for k in changed
        )
        raise InputError(
            f"logging dir {str(logs)!r} belongs to a run with other arguments ({detail}): rerun with the "
            "same arguments to resume it, or choose another --out (or --logging-dir)"
        )
    if previous is None and existing:
        raise InputError(
            f"--out {str(out)!r} already holds {len(existing)} .ds file(s) that logging dir {str(logs)!r} "
            "did not make, so they cannot be resumed: choose another --out, or delete them"
        )


def _short(value: Any, width: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _read_record(logs: Path) -> dict[str, Any] | None:
    path = logs / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError(f"{str(path)!r} is unreadable: delete the logging dir to start over") from None
    if not isinstance(record, dict):
        raise InputError(f"{str(path)!r} is not a preprocess record: delete the logging dir to start over")
    return record


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _reader(source: dict[str, Any], text_key: str, limit: int | None, logs: Path) -> Any:
    """datatrove's reader for ``source``: JSON-lines files, or a Hugging Face dataset."""
    if "jsonl" in source:
        from datatrove.pipeline.readers import JsonlReader

        files = [Path(f) for f in source["jsonl"]]
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
        # One list of files, paths relative to their common folder: every task shards the same list.
        _write_atomic(logs / INPUT_LIST_FILE, "".join(f"{f.relative_to(root)}\n" for f in files))
        return JsonlReader(
            str(root), paths_file=str(logs / INPUT_LIST_FILE), text_key=text_key, limit=limit or -1
        )
    from datatrove.pipeline.readers import HuggingFaceDatasetReader

    hf = source["hf"]
    return HuggingFaceDatasetReader(
        hf["dataset"],
        dataset_options={"name": hf["name"], "split": hf["split"]},
        streaming=hf["streaming"],
        text_key=text_key,
        limit=limit or -1,
    )


def _run_local(plan: _Plan, workers: int) -> NanosetSummary:
    """Run ``plan`` with datatrove's local executor; the summary of the finished folder."""
    if workers < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    from datatrove.executor import LocalPipelineExecutor

    executor = LocalPipelineExecutor(
        plan.pipeline, tasks=plan.tasks, workers=min(workers, plan.tasks), logging_dir=str(plan.logging_dir)
    )
    executor.run()
    if not any(plan.out.glob("*.ds")):
        raise InputError(
            f"the input holds no document with text under key {plan.text_key!r} (empty corpus?): "
            "nothing was written; check the input or --text-column"
        )
    return summarize_nanoset(plan.out)


def _submit_slurm(
    plan: _Plan,
    *,
    partition: str | None,
    account: str | None,
    time_limit: str,
    sbatch_args: list[str],
    cpus_per_task: int,
    mem_per_cpu_gb: int,
    job_name: str,
    workers: int | None,
) -> str | None:
    """Submit ``plan`` as a Slurm job array (datatrove's executor); the job id, None if all tasks are done."""
    from nanotron_recover.slurm import check_allocation

    check_allocation(partition, account, time_limit, sbatch_args)
    if not partition:
        raise InputError("--executor slurm needs --partition (datatrove writes it into the job script)")
    if cpus_per_task < 1 or mem_per_cpu_gb < 1:
        raise InputError("--cpus-per-task and --mem-per-cpu-gb must be >= 1")
    extra: dict[str, Any] = {"account": account} if account else {}
    for option in sbatch_args:
        match = re.fullmatch(r"--([A-Za-z][A-Za-z0-9-]*)(?:=(.*))?", option)
        if not match:
            raise InputError(f"--sbatch-arg {option!r}: use the long form, --name=value (e.g. --qos=high)")
        extra[match.group(1)] = match.group(2) or ""
    from datatrove.executor import SlurmPipelineExecutor

    executor = SlurmPipelineExecutor(
        plan.pipeline,
        tasks=plan.tasks,
        time=time_limit,
        partition=partition,
        cpus_per_task=cpus_per_task,
        mem_per_cpu_gb=mem_per_cpu_gb,
        workers=workers if workers is not None else -1,
        job_name=job_name,
        qos=None,  # datatrove's default, "normal", is not a QOS every cluster has; --sbatch-arg=--qos=X
        # The job runs `launch_pickled_pipeline` from this environment, with this Python.
        env_command=f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH",
        sbatch_args=extra,
        logging_dir=str(plan.logging_dir),
    )
    try:
        executor.run()
    except FileNotFoundError:
        raise InputError(
            "sbatch not found: run this on a Slurm login node, or use --executor local"
        ) from None
    except Exception as e:  # subprocess.CalledProcessError: sbatch printed why on stderr
        if type(e).__name__ != "CalledProcessError":
            raise
        raise InputError(
            f"sbatch refused the job (exit status {e.returncode}; its message is above)"
        ) from None
    return None if executor.job_id in (None, -1) else str(executor.job_id)


# -- command line -------------------------------------------------------------------------------
def _dataset_name(text: str) -> str | None:
    return None if text.lower() == "none" else text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``nanotron-recover preprocess`` options to ``parser``."""
    from nanotron_recover.slurm import add_allocation_arguments

    parser.add_argument(
        "--data-files",
        nargs="+",
        metavar="PATH",
        default=None,
        help="JSON-lines input: files, or folders of *.jsonl / *.json files (optionally .gz, .zst, ...)",
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="a Hugging Face dataset to read instead (e.g. allenai/c4, with --name en); "
        "`--dataset json` with --data-files is the same as --data-files alone",
    )
    parser.add_argument(
        "--name", type=_dataset_name, default=None, help="the dataset's config name (e.g. en), or `none`"
    )
    parser.add_argument("--split", default="train", help="split to read (default: %(default)s)")
    parser.add_argument(
        "--no-streaming",
        dest="streaming",
        action="store_false",
        help="download the whole dataset before reading it (default: stream it)",
    )
    parser.add_argument(
        "--text-column",
        "--text-key",
        dest="text_key",
        default="text",
        help="field holding the text (default: %(default)s); rows without text are skipped",
    )
    parser.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="read at most N documents per task (a sample of a large dataset)",
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer name or local folder (AutoTokenizer)")
    parser.add_argument(
        "--eos-token",
        default=None,
        help="token appended to every document (default: the tokenizer's own eos token, so documents "
        "stay separated once packed into samples)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the document shuffle inside each output file (default: %(default)s); "
        "same seed, same bytes",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the Nanoset folder to write (*.ds, *.ds.index, *.ds.metadata)",
    )
    parser.add_argument(
        "--logging-dir",
        type=Path,
        default=None,
        help=f"datatrove's logs and completion marks (default: <out>/{DEFAULT_LOGGING_DIR}); "
        "rerunning with the same one skips the tasks already done",
    )
    parser.add_argument(
        "--tasks",
        type=_positive_int,
        default=1,
        help="tasks (= output files) to split the work into (default: %(default)s); with --data-files "
        "at most one per input file",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        help="tasks run at the same time (default: local: min(--tasks, usable cores); slurm: no limit)",
    )
    parser.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default="local",
        help="local: worker processes on this machine (default); slurm: submit a job array and return",
    )
    add_allocation_arguments(parser)  # --partition, --account, --time, --sbatch-arg: as `slurm` has them
    parser.add_argument("--job-name", default=DEFAULT_JOB_NAME, help="Slurm job name (default: %(default)s)")
    parser.add_argument("--cpus-per-task", type=int, default=1, help="Slurm CPUs per task (default: 1)")
    parser.add_argument(
        "--mem-per-cpu-gb", type=int, default=2, help="Slurm memory per CPU in GB (default: 2)"
    )


def _source_of(args: argparse.Namespace) -> dict[str, Any]:
    dataset = getattr(args, "dataset", None)
    if args.data_files:
        if dataset not in (None, "json"):
            raise InputError(
                f"--data-files reads JSON-lines files; it cannot be combined with --dataset {dataset}"
            )
        return {"jsonl": [str(f) for f in _jsonl_files(args.data_files)]}
    if dataset in (None, "json"):
        raise InputError(
            "nothing to read: pass --data-files (JSON-lines) or --dataset (a Hugging Face dataset)"
        )
    return {
        "hf": {
            "dataset": dataset,
            "name": getattr(args, "name", None),
            "split": getattr(args, "split", "train"),
            "streaming": getattr(args, "streaming", True),
        }
    }


def run_preprocess(args: argparse.Namespace) -> int:
    """Run ``nanotron-recover preprocess`` from parsed arguments, print a one-line summary; the exit code.

    Bad input prints one line and returns 2, like the other subcommands.
    """
    try:
        plan = _plan(
            _source_of(args),
            args.out,
            str(args.tokenizer),
            tasks=args.tasks,
            text_key=args.text_key,
            eos_token=args.eos_token,
            seed=args.seed,
            limit=args.limit,
            logging_dir=args.logging_dir,
        )
        if plan.completed_before:
            print(
                f"preprocess: {plan.completed_before} of {plan.tasks} task(s) already complete "
                f"(logging dir {plan.logging_dir}); running the rest",
                flush=True,
            )
        if args.executor == "slurm":
            job = _submit_slurm(
                plan,
                partition=args.partition,
                account=args.account,
                time_limit=args.time,
                sbatch_args=list(args.sbatch_args),
                cpus_per_task=args.cpus_per_task,
                mem_per_cpu_gb=args.mem_per_cpu_gb,
                job_name=args.job_name,
                workers=args.workers,
            )
            if job is None:
                print(f"preprocess: all {plan.tasks} task(s) are complete; nothing submitted", flush=True)
            else:
                print(
                    f"preprocess: submitted Slurm job {job} ({plan.tasks} task(s)) writing {plan.out}; "
                    f"logs in {plan.logging_dir}; run the same command again to resubmit unfinished tasks",
                    flush=True,
                )
            return 0
        workers = args.workers or min(plan.tasks, default_workers())
        began = time.perf_counter()
        summary = _run_local(plan, workers)
        seconds = time.perf_counter() - began
    except InputError as e:
        print(f"nanotron-recover preprocess: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    rate = "" if plan.completed_before else f", {summary.num_tokens / max(seconds, 1e-9):,.0f} tok/s"
    print(
        f"preprocess: {summary.folder} holds {summary.num_tokens:,} tokens in {summary.num_documents:,} "
        f"documents ({len(summary.files)} file(s), {summary.dtype}, tokenizer {summary.tokenizer}) "
        f"[{seconds:.1f} s{rate}, {min(workers, plan.tasks)} worker(s)]",
        flush=True,
    )
    return 0
