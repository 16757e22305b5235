"""Tokenize a text dataset into a :mod:`corpus <nanotron_recover.data.corpus>` folder.

``nanotron-recover preprocess`` runs this once, before training, so that the training loop
only ever memory-maps token ids (no tokenizer, no dataset library, no network in the hot
path). The dataset is *streamed* (``datasets.load_dataset(..., streaming=True)``), so C4-sized
sources never have to fit on disk in text form. Rows are read in chunks of ``chunk_docs``,
tokenized by ``workers`` processes (:mod:`~nanotron_recover.data.tokenization`) and appended,
in source order, to a :class:`~nanotron_recover.data.corpus.CorpusWriter`. The output is a
pure function of (source, tokenizer, ``max_tokens``): the number of workers, the chunk size
and any interruptions change how fast it is made, never a byte of it.

Choices worth knowing:

* Text is encoded with ``add_special_tokens=False``; the writer appends exactly one eos per
  document, and no bos is inserted -- eos alone delimits documents.
* Rows whose text is ``None`` or empty are skipped (they would only add bare eos tokens).
* ``max_tokens`` is exact: the corpus holds ``min(max_tokens, tokens in the dataset)``
  tokens, the last document being cut short (without its eos) to fill the budget. An exact
  size makes corpus sizes, and hence sample counts, predictable from the command line.
* The index records the source (dataset, config, split, files, column), the tokenizer
  (name, content fingerprint, ``len``, eos id) and a ``resume`` record.

Resuming. Every ``commit_tokens`` tokens (or ``_COMMIT_SECONDS``) the writer commits:
``tokens.bin`` is fsynced, then the index is atomically replaced with the token and document
counts and a ``resume`` record: ``rows_read``, the number of source rows whose documents those
tokens are, and ``stream``, the dataset's own ``state_dict()`` at a row at or before that
(see :class:`_Stream`). Re-running the same command on the folder then

* continues an unfinished corpus: ``tokens.bin`` is truncated to the committed count, and the
  stream restarts at ``rows_read`` -- from the saved dataset position when it is usable (same
  ``datasets`` version and ``chunk_docs``), else by re-reading and counting off the rows
  before it. No committed row is tokenized again, no document is lost or duplicated, and the
  result is byte-identical to an uninterrupted run;
* leaves a complete corpus alone -- unless it stopped at a smaller ``max_tokens`` than now
  asked for, in which case it is *extended* (its cut-short last document is dropped and
  re-read whole, ``resume.partial_tokens`` says how long it was);
* refuses (:class:`~nanotron_recover.errors.InputError`) a folder made from another source or
  tokenizer, or holding more tokens than ``max_tokens``. A folder where nothing was committed
  yet is simply started over.

A directory lock (``flock``) keeps two runs from writing the same folder.

``datasets`` and ``transformers`` are imported lazily so that importing the data package
(which the trainer does) stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from nanotron_recover.data.corpus import INDEX_FILE, CorpusIndex, CorpusWriter
from nanotron_recover.data.tokenization import (
    Encoded,
    default_workers,
    encode_chunks,
    load_tokenizer,
    make_encoder,
    tokenizer_fingerprint,
)
from nanotron_recover.errors import InputError

# Rows per tokenization task. A C4 document is ~2 KB of text / ~500 tokens, so a chunk is
# ~1 MB of text: large enough that shipping it to a worker costs little next to encoding it,
# small enough that 2 x workers chunks in flight stay well within memory on a 100-core node.
DEFAULT_CHUNK_DOCS = 512
# Commit (fsync + index) once this many tokens are uncommitted: ~8 MB of uint16 ids, a few
# seconds of work at most, so a crash loses little and fsyncs stay rare.
DEFAULT_COMMIT_TOKENS = 1 << 22
# ...or this long after the last commit, for slow (network-bound) streams.
_COMMIT_SECONDS = 30.0
# The source fields that must match to resume a folder.
_SOURCE_KEYS = ("dataset", "name", "data_files", "split", "text_column")


@dataclass(frozen=True)
class PreprocessResult:
    """What one :func:`preprocess` call did: ``status`` is new, resumed, extended or complete (nothing to do)."""

    index: CorpusIndex
    status: str
    start_row: int
    tokens_written: int
    seconds: float
    workers: int


def preprocess(dataset: str = "allenai/c4", name: str | None = "en", **kwargs: Any) -> CorpusIndex:
    """:func:`preprocess_run` returning only the finished corpus's index (same arguments)."""
    return preprocess_run(dataset, name, **kwargs).index


def preprocess_run(
    dataset: str = "allenai/c4",
    name: str | None = "en",
    *,
    data_files: list[str] | None = None,
    split: str = "train",
    text_column: str = "text",
    tokenizer: str,
    out: Path,
    max_tokens: int | None = None,
    progress: bool = True,
    workers: int | None = None,
    chunk_docs: int = DEFAULT_CHUNK_DOCS,
    commit_tokens: int | None = None,
    log: Callable[[str], None] | None = None,
) -> PreprocessResult:
    """Stream ``dataset`` (config ``name``, ``split``), tokenize ``text_column`` into a corpus at ``out``.

    For local files pass e.g. ``dataset="json", name=None, data_files=[...]``. ``workers``
    tokenizing processes (default: the usable cores; 0 = in this process) handle ``chunk_docs``
    rows at a time, and progress is committed every ``commit_tokens`` tokens (default
    ``DEFAULT_COMMIT_TOKENS``). An unfinished corpus at ``out`` is resumed (see the module
    docstring); ``log`` receives a line when that happens or when there is nothing to do.
    Workers are *spawned* processes, so a script calling this with ``workers >= 1`` needs the
    usual ``if __name__ == "__main__":`` guard. Returns the index and what this run did (status,
    rows, tokens, seconds).
    """
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"max_tokens must be >= 1 (or None for the whole dataset), got {max_tokens}")
    if chunk_docs < 1:
        raise InputError(f"chunk_docs must be >= 1, got {chunk_docs}")
    commit_tokens = DEFAULT_COMMIT_TOKENS if commit_tokens is None else commit_tokens
    if commit_tokens < 1:
        raise InputError(f"commit_tokens must be >= 1, got {commit_tokens}")
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise InputError(f"workers must be >= 0 (0 = tokenize in this process), got {workers}")
    note = log or (lambda _line: None)

    tokenizer = str(tokenizer)  # a Path is fine too; the index records a string
    if data_files is not None:
        data_files = [str(f) for f in data_files]
    out = Path(out)
    try:
        tok = load_tokenizer(tokenizer)
    except OSError as e:
        raise InputError(f"cannot load tokenizer {tokenizer!r}: {str(e).splitlines()[0]}") from None
    eos = tok.eos_token_id
    if eos is None:
        raise InputError(
            f"tokenizer {tokenizer} has no eos token, which the corpus needs to separate documents"
        )
    vocab_size = len(tok)
    fingerprint = tokenizer_fingerprint(tok)
    source: dict[str, Any] = {
        "dataset": dataset,
        "name": name,
        "data_files": data_files,
        "split": split,
        "text_column": text_column,
    }

    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a corpus folder")
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        status, committed = _plan(out, source, tokenizer, fingerprint, vocab_size, eos, max_tokens)
        if status == "complete":
            assert committed is not None
            note(
                f"preprocess: {out} is already complete ({committed.num_tokens:,} tokens from "
                f"{committed.num_documents:,} documents); nothing to do"
            )
            return PreprocessResult(committed, status, _rows_read(committed), 0, 0.0, 0)
        start_row = _rows_read(committed)
        stream = _Stream(
            dataset,
            name,
            data_files=data_files,
            split=split,
            text_column=text_column,
            chunk_docs=chunk_docs,
            start_row=start_row,
            saved=(committed.resume or {}).get("stream") if committed is not None else None,
        )
        if committed is None:
            writer = CorpusWriter(
                out,
                vocab_size,
                tokenizer,
                eos,
                source=source,
                resume=_resume_record(0, max_tokens),
                tokenizer_fingerprint=fingerprint,
            )
        else:
            writer = CorpusWriter.reopen(out, committed)
            how = (
                f"from the dataset's saved position at row {stream.saved['rows']:,}"
                if stream.saved is not None
                else "re-reading the rows before it"
            )
            note(
                f"preprocess: {'extending' if status == 'extended' else 'resuming'} {out} at source row "
                f"{start_row:,} ({how}); {committed.num_tokens:,} tokens and "
                f"{committed.num_documents:,} documents were already written"
            )
        start_tokens = writer.num_tokens
        began = time.perf_counter()
        with writer:
            _fill(
                writer,
                stream,
                make_encoder(tok),
                workers=workers,
                start_row=start_row,
                max_tokens=max_tokens,
                commit_tokens=commit_tokens,
                progress=progress,
            )
        seconds = time.perf_counter() - began
        index = writer.close()
    return PreprocessResult(index, status, start_row, index.num_tokens - start_tokens, seconds, workers)


def _fill(
    writer: CorpusWriter,
    stream: _Stream,
    encoder: Callable[[list[str]], Encoded],
    *,
    workers: int,
    start_row: int,
    max_tokens: int | None,
    commit_tokens: int,
    progress: bool,
) -> None:
    """Encode ``stream``'s chunks and append them to ``writer`` in order, committing as it goes; sets the final resume record."""
    from tqdm import tqdm

    rows = start_row
    partial = 0
    full = max_tokens is not None and writer.num_tokens >= max_tokens
    end_of_data = False
    # The stream position after the last chunk written whole (None: count rows from the start).
    position = stream.saved
    committed_tokens, last_commit = writer.num_tokens, time.monotonic()
    bar = tqdm(
        total=max_tokens,
        initial=writer.num_tokens,
        unit="tok",
        unit_scale=True,
        desc="preprocess",
        disable=not progress or not sys.stderr.isatty(),
    )
    with bar:
        if not full:
            results = encode_chunks(encoder, stream.chunks(), workers)
            try:
                for encoded in results:
                    # Chunks are encoded in order, so positions pair up with results in order.
                    chunk_end = stream.positions.popleft()
                    before = writer.num_tokens
                    used, partial, full = _write_chunk(writer, encoded, max_tokens)
                    rows += used
                    bar.update(writer.num_tokens - before)
                    if full:
                        break
                    position = chunk_end
                    pending = writer.num_tokens - committed_tokens
                    if pending >= commit_tokens or time.monotonic() - last_commit >= _COMMIT_SECONDS:
                        writer.commit(_resume_record(rows, max_tokens, stream=position))
                        committed_tokens, last_commit = writer.num_tokens, time.monotonic()
                else:
                    end_of_data = True
            finally:
                results.close()  # stops the worker pool when the budget ends the run early
    writer.set_resume(
        _resume_record(rows, max_tokens, partial_tokens=partial, end_of_data=end_of_data, stream=position)
    )


def _write_chunk(writer: CorpusWriter, encoded: Encoded, max_tokens: int | None) -> tuple[int, int, bool]:
    """Append one encoded chunk, honouring the budget; return (rows used, tokens of a cut-short last document, budget full)."""
    lengths = encoded.lengths
    nonempty = lengths > 0
    sizes = np.where(nonempty, lengths + 1, 0)  # tokens each row adds, eos included
    remaining = None if max_tokens is None else max_tokens - writer.num_tokens
    if remaining is None or int(sizes.sum()) < remaining:
        writer.add_documents(encoded.ids, lengths[nonempty])
        return lengths.size, 0, False
    # The budget ends inside this chunk, at row i: the first whose document reaches it.
    cum = np.cumsum(sizes)
    i = int(np.searchsorted(cum, remaining, side="left"))
    head_ids = int(lengths[:i].sum())
    writer.add_documents(encoded.ids[:head_ids], lengths[:i][nonempty[:i]])
    taken = remaining - (int(cum[i - 1]) if i else 0)
    doc = encoded.ids[head_ids : head_ids + int(lengths[i])]
    if taken == doc.size + 1:
        writer.add_document(doc)  # fits exactly, eos included
        return i + 1, 0, True
    writer.add_document(doc[:taken], add_eos=False)  # cut short to fill the budget exactly
    return i + 1, taken, True


def _resume_record(
    rows_read: int,
    max_tokens: int | None,
    *,
    partial_tokens: int = 0,
    end_of_data: bool = False,
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The index's ``resume``: rows whose documents are written, how the run ended, and a stream position.

    ``stream`` (see :class:`_Stream`) is a saved dataset position at or before ``rows_read``.
    """
    return {
        "rows_read": rows_read,
        "max_tokens": max_tokens,
        "partial_tokens": partial_tokens,
        "end_of_data": end_of_data,
        "stream": stream,
    }


def _rows_read(index: CorpusIndex | None) -> int:
    return 0 if index is None else int((index.resume or {}).get("rows_read", 0))


def _plan(
    out: Path,
    source: dict[str, Any],
    tokenizer: str,
    fingerprint: str,
    vocab_size: int,
    eos: int,
    max_tokens: int | None,
) -> tuple[str, CorpusIndex | None]:
    """How to start on ``out``: ("new", None), ("resumed" | "extended", index to continue from) or ("complete", index)."""
    if not (out / INDEX_FILE).is_file():
        return "new", None
    try:
        index = CorpusIndex.read(out)
    except (ValueError, TypeError, OSError) as e:
        raise InputError(
            f"--out {out} holds an unreadable corpus index ({e}): delete the folder or choose another --out"
        ) from None
    if not index.complete and index.num_tokens == 0 and _rows_read(index) == 0:
        return "new", None  # nothing was committed, so nothing is lost by starting over
    differences = _differences(index, source, tokenizer, fingerprint, vocab_size, eos)
    if differences:
        raise InputError(
            f"--out {out} holds a corpus made differently ({'; '.join(differences)}): pass the same "
            f"arguments to resume it, or choose another --out"
        )
    if index.resume is None or "rows_read" not in index.resume:
        raise InputError(f"--out {out} has no resume record, so it cannot be continued: choose another --out")
    if max_tokens is not None and index.num_tokens > max_tokens:
        raise InputError(
            f"--out {out} already holds {index.num_tokens:,} tokens, more than --max-tokens {max_tokens:,}: "
            f"raise --max-tokens or choose another --out"
        )
    if not index.complete:
        return "resumed", index
    if index.resume.get("end_of_data") or index.num_tokens == max_tokens:
        return "complete", index
    if "partial_tokens" not in index.resume:
        return "complete", index  # written before extending was possible: how it ended is unknown
    # Complete at an earlier, smaller budget: continue from before its cut-short last document.
    partial = int(index.resume.get("partial_tokens", 0))
    index.num_tokens -= partial
    if partial:
        index.num_documents -= 1
    index.resume = _resume_record(
        _rows_read(index) - (1 if partial else 0), max_tokens, stream=index.resume.get("stream")
    )
    index.complete = False
    return "extended", index


def _differences(
    index: CorpusIndex, source: dict[str, Any], tokenizer: str, fingerprint: str, vocab_size: int, eos: int
) -> list[str]:
    """What differs between the folder's corpus and this run, as ``field: 'there' vs 'given'`` items."""
    if index.source is None:
        return ["it records no source"]
    out = [
        f"{key}: {index.source.get(key)!r} in the folder vs {source[key]!r} given"
        for key in _SOURCE_KEYS
        if index.source.get(key) != source[key]
    ]
    if index.tokenizer_fingerprint is not None:
        same_tokenizer = index.tokenizer_fingerprint == fingerprint
    else:  # written before fingerprints: the best we can do is name, size and eos
        same_tokenizer = (index.tokenizer, index.vocab_size, index.eos_token_id) == (
            tokenizer,
            vocab_size,
            eos,
        )
    if not same_tokenizer:
        out.append(
            f"tokenizer: {index.tokenizer!r} in the folder vs {tokenizer!r} given, a different vocabulary"
        )
    return out


@contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (where the platform has one)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"another `nanotron-recover preprocess` is writing to {folder}: wait for it or choose another --out"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


class _Stream:
    """The source's ``text_column``, chunk by chunk, starting at a given row.

    After each chunk it records where the dataset stands (``positions``: rows read so far and
    the dataset's ``state_dict()``, in the order chunks are handed out), so that the resume
    record can point the next run straight at that place instead of re-reading every row
    before it -- on C4 that is the difference between an instant resume and re-downloading
    hundreds of GB. A saved state is only trusted with the same ``datasets`` version and chunk
    size (the state depends on the batch size it was taken with); otherwise, and for any rows
    past the state, the stream is read from the start and rows are counted off.
    """

    def __init__(
        self,
        dataset: str,
        name: str | None,
        *,
        data_files: list[str] | None,
        split: str,
        text_column: str,
        chunk_docs: int,
        start_row: int = 0,
        saved: dict[str, Any] | None = None,
    ) -> None:
        import datasets

        self.dataset, self.name, self.data_files, self.split = dataset, name, data_files, split
        self.text_column = text_column
        self.chunk_docs = chunk_docs
        self.start_row = start_row
        self.version = datasets.__version__
        # Start from the saved position (then count off the rows between it and start_row)?
        self.saved = saved if self._usable(saved) else None
        self.positions: deque[dict[str, Any] | None] = deque()

    def chunks(self) -> Iterator[list[str]]:
        """Texts of rows ``start_row, start_row + 1, ...`` in lists of at most ``chunk_docs``."""
        import datasets

        stream = datasets.load_dataset(
            self.dataset, self.name, data_files=self.data_files, split=self.split, streaming=True
        )
        rows = 0
        if self.saved is not None:
            stream.load_state_dict(self.saved["state"])
            rows = int(self.saved["rows"])
        skip = self.start_row - rows
        # Column batches, not row dicts: several times faster to read, and already chunk-shaped.
        for batch in stream.iter(batch_size=self.chunk_docs):
            if self.text_column not in batch:
                raise InputError(
                    f"dataset {self.dataset} has no column {self.text_column!r} "
                    f"(columns: {', '.join(sorted(batch))}); pass --text-column"
                )
            texts = batch[self.text_column]
            rows += len(texts)
            if skip:
                dropped = min(skip, len(texts))
                texts, skip = texts[dropped:], skip - dropped
                if not texts:
                    continue
            self.positions.append(self._position(stream, rows))
            # None/empty become "" so the row still counts as read; empty encodings are skipped.
            yield [t if isinstance(t, str) else ("" if t is None else str(t)) for t in texts]

    def _position(self, stream: Any, rows: int) -> dict[str, Any] | None:
        try:
            state = stream.state_dict()
            json.dumps(state)  # it goes into index.json
        except Exception:  # a dataset type without (serialisable) state: resume by counting rows
            return None
        return {"rows": rows, "state": state, "chunk_docs": self.chunk_docs, "datasets": self.version}

    def _usable(self, saved: dict[str, Any] | None) -> bool:
        return (
            isinstance(saved, dict)
            and saved.get("state") is not None
            and saved.get("chunk_docs") == self.chunk_docs
            and saved.get("datasets") == self.version
            and isinstance(saved.get("rows"), int)
            and 0 <= saved["rows"] <= self.start_row
        )


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_token_count(text: str) -> int:
    """Parse ``300000``, ``300_000``, ``300k``, ``1.5M``, ``2B`` into a positive token count."""
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kmbgtKMBGT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid token count {text!r} (examples: 300000, 300k, 1.5M, 2B)")
    # Decimal, not float: "12345678901234567" and "1.000001M" must stay exact.
    value = Decimal(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid token count {text!r}: must be a positive whole number")
    return int(value)


def _dataset_name(text: str) -> str | None:
    return None if text.lower() == "none" else text


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``nanotron-recover preprocess`` options to ``parser``."""
    parser.add_argument(
        "--dataset",
        default="allenai/c4",
        help="HF dataset id, or a loader like `json` (default: %(default)s)",
    )
    parser.add_argument(
        "--name",
        type=_dataset_name,
        default="en",
        help="dataset config name, or `none` (default: %(default)s)",
    )
    parser.add_argument(
        "--data-files", nargs="+", metavar="F", default=None, help="local data files, e.g. for --dataset json"
    )
    parser.add_argument("--split", default="train", help="split to read (default: %(default)s)")
    parser.add_argument(
        "--text-column", default="text", help="column holding the text (default: %(default)s)"
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer name or local folder (AutoTokenizer)")
    parser.add_argument(
        "--out", type=Path, required=True, help="corpus folder to write; an unfinished one is resumed"
    )
    parser.add_argument(
        "--max-tokens",
        type=parse_token_count,
        default=None,
        help="stop after exactly this many tokens (e.g. 300k, 1.5M); a larger value extends a finished --out",
    )
    parser.add_argument(
        "--workers",
        type=_non_negative_int,
        default=None,
        help="tokenizing processes (default: the usable CPU cores; 0 = tokenize in this process)",
    )
    parser.add_argument(
        "--chunk-docs",
        type=_positive_int,
        default=DEFAULT_CHUNK_DOCS,
        metavar="N",
        help="documents per tokenization task (default: %(default)s); resume with the same value "
        "to restart from the dataset's saved position instead of re-reading the rows before it",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="hide the progress bar (hidden anyway off a TTY)",
    )


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def run_preprocess(args: argparse.Namespace) -> int:
    """Run :func:`preprocess` from parsed CLI arguments and print a one-line summary; returns the exit code.

    User errors (bad column, another source in --out, missing files, ...) are printed as one
    line and return 2, like the other subcommands; other ValueErrors return 1.
    """
    try:
        result = preprocess_run(
            args.dataset,
            args.name,
            data_files=args.data_files,
            split=args.split,
            text_column=args.text_column,
            tokenizer=args.tokenizer,
            out=args.out,
            max_tokens=args.max_tokens,
            progress=getattr(args, "progress", True),
            workers=getattr(args, "workers", None),
            chunk_docs=getattr(args, "chunk_docs", DEFAULT_CHUNK_DOCS),
            log=lambda line: print(line, flush=True),
        )
    except (InputError, FileNotFoundError) as e:
        print(f"nanotron-recover preprocess: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"nanotron-recover preprocess: error: {e}", file=sys.stderr)
        return 1
    if result.status == "complete":
        return 0  # preprocess already said so
    index = result.index
    rate = result.tokens_written / result.seconds if result.seconds > 0 else 0.0
    print(
        f"preprocess: wrote {index.num_tokens:,} tokens from {index.num_documents:,} documents "
        f"(vocab_size {index.vocab_size}, {index.dtype}) to {args.out} "
        f"[{result.tokens_written:,} this run in {result.seconds:.1f} s, {rate:,.0f} tok/s, "
        f"{result.workers} workers]"
    )
    return 0
