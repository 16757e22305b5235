"""Tokenize a text dataset into a :mod:`corpus <nanotron_recover.data.corpus>` folder.

``nanotron-recover preprocess`` runs this once, before training, so that the training loop
only ever memory-maps token ids (no tokenizer, no dataset library, no network in the hot
path). The dataset is *streamed* (``datasets.load_dataset(..., streaming=True)``), so C4-sized
sources never have to fit on disk in text form; documents are tokenized in batches with the
fast tokenizer and appended to a :class:`~nanotron_recover.data.corpus.CorpusWriter`.

Choices worth knowing:

* Text is encoded with ``add_special_tokens=False``; the writer appends exactly one eos per
  document, and no bos is inserted -- eos alone delimits documents.
* Rows whose text is ``None`` or empty are skipped (they would only add bare eos tokens).
* ``max_tokens`` is exact: the corpus holds ``min(max_tokens, tokens in the dataset)``
  tokens, the last document being cut short (without its eos) to fill the budget. An exact
  size makes corpus sizes, and hence sample counts, predictable from the command line.
* The source (dataset, config, split, files, column) and the number of source rows
  consumed are recorded in the index, for provenance and for resuming later.

``datasets`` and ``transformers`` are imported lazily so that importing the data package
(which the trainer does) stays cheap.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nanotron_recover.data.corpus import CorpusIndex, CorpusWriter

# Documents tokenized per call: the fast tokenizer parallelises inside a batch, and a few
# hundred documents amortise the Python overhead without overshooting max_tokens by much.
_BATCH_DOCUMENTS = 256


def preprocess(
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
) -> CorpusIndex:
    """Stream ``dataset`` (config ``name``, ``split``), tokenize ``text_column`` into a corpus at ``out``.

    For local files pass e.g. ``dataset="json", name=None, data_files=[...]``. Returns the
    index of the finished corpus.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (or None for the whole dataset), got {max_tokens}")

    from transformers import AutoTokenizer

    tokenizer = str(tokenizer)  # a Path is fine too; the index records a string
    if data_files is not None:
        data_files = [str(f) for f in data_files]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    eos = tok.eos_token_id
    if eos is None:
        raise ValueError(
            f"tokenizer {tokenizer} has no eos token, which the corpus needs to separate documents"
        )
    vocab_size = len(tok)

    rows = _stream_rows(dataset, name, data_files=data_files, split=split)
    source: dict[str, Any] = {
        "dataset": dataset,
        "name": name,
        "data_files": data_files,
        "split": split,
        "text_column": text_column,
    }

    from tqdm import tqdm

    bar = tqdm(
        total=max_tokens,
        unit="tok",
        unit_scale=True,
        desc="preprocess",
        disable=not progress or not sys.stderr.isatty(),
    )
    rows_read = 0
    full = False
    with bar, CorpusWriter(out, vocab_size, tokenizer, eos, source=source) as writer:
        for batch in _batches(_texts(rows, text_column, dataset), _BATCH_DOCUMENTS):
            encoded = tok(batch, add_special_tokens=False, verbose=False)["input_ids"]
            for ids in encoded:
                rows_read += 1
                if not ids:
                    continue
                before = writer.num_tokens
                if max_tokens is not None and len(ids) + 1 > max_tokens - before:
                    # Fill the budget exactly: the last document loses its tail and its eos.
                    writer.add_document(ids[: max_tokens - before], add_eos=False)
                else:
                    writer.add_document(ids)
                bar.update(writer.num_tokens - before)
                full = max_tokens is not None and writer.num_tokens >= max_tokens
                if full:
                    break
            if full:
                break
        writer.set_resume({"rows_read": rows_read})
    return writer.close()


def _stream_rows(
    dataset: str, name: str | None, *, data_files: list[str] | None, split: str
) -> Iterable[dict]:
    import datasets

    return datasets.load_dataset(dataset, name, data_files=data_files, split=split, streaming=True)


def _texts(rows: Iterable[dict], text_column: str, dataset: str) -> Iterator[str]:
    for row in rows:
        if text_column not in row:
            raise ValueError(
                f"dataset {dataset} has no column {text_column!r} (columns: {', '.join(sorted(row))}); "
                f"pass --text-column"
            )
        text = row[text_column]
        # None/empty become "" so the row still counts as read; the caller skips empty encodings.
        yield text if isinstance(text, str) else ("" if text is None else str(text))


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_token_count(text: str) -> int:
    """Parse ``300000``, ``300_000``, ``300k``, ``1.5M``, ``2B`` into a positive token count."""
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kmbgtKMBGT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid token count {text!r} (examples: 300000, 300k, 1.5M, 2B)")
    value = float(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2).lower()]
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
    parser.add_argument("--out", type=Path, required=True, help="corpus folder to write")
    parser.add_argument(
        "--max-tokens",
        type=parse_token_count,
        default=None,
        help="stop after this many tokens (e.g. 300k, 1.5M)",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="hide the progress bar (hidden anyway off a TTY)",
    )


def run_preprocess(args: argparse.Namespace) -> int:
    """Run :func:`preprocess` from parsed CLI arguments and print a one-line summary; returns the exit code."""
    try:
        index = preprocess(
            args.dataset,
            args.name,
            data_files=args.data_files,
            split=args.split,
            text_column=args.text_column,
            tokenizer=args.tokenizer,
            out=args.out,
            max_tokens=args.max_tokens,
            progress=getattr(args, "progress", True),
        )
    except (ValueError, FileNotFoundError) as e:
        # User errors (bad column, tokenizer without eos, ...) carry a clear message; no traceback.
        print(f"nanotron-recover preprocess: error: {e}", file=sys.stderr)
        return 1
    print(
        f"preprocess: wrote {index.num_tokens:,} tokens from {index.num_documents:,} documents "
        f"(vocab_size {index.vocab_size}, {index.dtype}) to {args.out}"
    )
    return 0
