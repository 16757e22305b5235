"""A tokenized corpus on disk: one flat array of token ids plus a small JSON index.

Layout of a corpus folder::

    tokens.bin   every document's token ids followed by its eos, back to back, as raw
                 little-endian uint16 (vocab_size <= 65535) or uint32 (larger vocabularies)
    index.json   a :class:`CorpusIndex`: counts, dtype, tokenizer, and a ``complete`` flag

Why this shape: training reads fixed-length windows at random offsets, so the corpus only
has to support "give me tokens [a, b)". A flat array that is memory-mapped read-only does
that in O(1) with no parsing, is shared by every process on a node through the page cache,
and is trivially checked for truncation (file size == num_tokens * itemsize). Document
boundaries are kept implicitly by the eos tokens, as in GPT/LLaMA-style packing.

Samples: for a sequence length ``L`` sample ``i`` is tokens ``[i*L, i*L + L + 1)``, i.e.
``L + 1`` tokens so that inputs (``[:-1]``) and labels (``[1:]``) are both ``L`` long.
Consecutive samples therefore overlap by exactly one token and every token is predicted
exactly once per epoch (except the very first token, which is only ever an input).

Writing is crash-aware: :class:`CorpusWriter` first writes an index with
``complete: false`` and only marks it complete in :meth:`CorpusWriter.close`, so a reader
never mistakes a half-written corpus for a finished one. The index is always replaced
atomically (write a temporary file, then ``os.replace``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.json"

# Flush the in-memory token buffer to disk once it holds this many tokens: large enough that
# writes are efficient, small enough that memory stays bounded on huge datasets.
_FLUSH_TOKENS = 1 << 20


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclass
class CorpusIndex:
    """Metadata of a corpus folder, stored as ``index.json``.

    ``source`` describes where the text came from (dataset, config, split, ...) and
    ``resume`` holds a position in that source so that preprocessing can be resumed;
    both are free-form dicts owned by the writer of the corpus. Keys this version does
    not know are kept in ``extra`` so an older reader round-trips a newer index intact.
    """

    num_tokens: int
    num_documents: int
    vocab_size: int
    dtype: str
    tokenizer: str
    eos_token_id: int
    complete: bool = True
    format_version: int = FORMAT_VERSION
    source: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        extra = data.pop("extra")
        # Unknown keys live at the top level, where a newer writer put them.
        return json.dumps({**extra, **data}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CorpusIndex:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"corpus index must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"unsupported corpus format_version {version!r} (this code reads <= {FORMAT_VERSION})"
            )
        known = {f.name for f in fields(cls)} - {"extra"}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"corpus index is missing field(s): {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def read(cls, folder: str | Path) -> CorpusIndex:
        """Read ``folder/index.json``."""
        return cls.from_json((Path(folder) / INDEX_FILE).read_text(encoding="utf-8"))

    def write(self, folder: str | Path) -> None:
        """Write ``folder/index.json`` atomically: readers see the old or the new index, never half."""
        path = Path(folder) / INDEX_FILE
        tmp = path.with_name(f".{INDEX_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class CorpusWriter:
    """Append documents to a new corpus folder; use as a context manager.

    Each document is written as its ids followed by ``eos_token_id``. ``tokenizer`` is the
    tokenizer's name or path, recorded for humans and for decoding samples later. Any
    existing corpus in ``folder`` is overwritten. If the ``with`` block raises, the tokens
    written so far are flushed but the index stays ``complete: false``.
    """

    def __init__(
        self,
        folder: str | Path,
        vocab_size: int,
        tokenizer: str,
        eos_token_id: int,
        *,
        source: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.dtype = dtype_for_vocab(vocab_size)
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.tokenizer = str(tokenizer)
        self.eos_token_id = eos_token_id
        self.source = source
        self.resume: dict[str, Any] | None = None
        self.num_tokens = 0
        self.num_documents = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._closed = False
        self._final: CorpusIndex | None = None

        self.folder.mkdir(parents=True, exist_ok=True)
        # Mark the folder incomplete *before* touching tokens.bin, so that a crash at any
        # later point leaves a corpus that readers reject with "did not finish".
        self._index(complete=False).write(self.folder)
        self._file = open(self.folder / TOKENS_FILE, "wb")

    def add_document(self, ids: Sequence[int] | np.ndarray, *, add_eos: bool = True) -> None:
        """Append one document's ids, then eos (``add_eos=False`` only to cut a document short)."""
        if self._closed:
            raise ValueError("CorpusWriter is closed")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            hi, lo = int(arr.max()), int(arr.min())
            if hi >= self.vocab_size:
                raise ValueError(f"token id {hi} is out of range for vocab_size {self.vocab_size}")
            if lo < 0:
                raise ValueError(f"token id {lo} is negative")
        if add_eos:
            arr = np.concatenate([arr.astype(self.dtype), np.array([self.eos_token_id], dtype=self.dtype)])
        else:
            arr = arr.astype(self.dtype)
        self._buffer.append(arr)
        self._buffered += arr.size
        self.num_tokens += arr.size
        self.num_documents += 1
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def set_resume(self, resume: dict[str, Any] | None) -> None:
        """Record where in the source the next document would come from (stored in the index)."""
        self.resume = resume

    def close(self, *, complete: bool = True) -> CorpusIndex:
        """Flush tokens, write the final index atomically and return it. Idempotent."""
        if self._final is not None:
            return self._final
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._closed = True
        self._final = self._index(complete=complete)
        self._final.write(self.folder)
        return self._final

    def _flush(self) -> None:
        if self._buffer:
            np.concatenate(self._buffer).tofile(self._file)
            self._buffer.clear()
            self._buffered = 0

    def _index(self, *, complete: bool) -> CorpusIndex:
        return CorpusIndex(
            num_tokens=self.num_tokens,
            num_documents=self.num_documents,
            vocab_size=self.vocab_size,
            dtype=self.dtype.name,
            tokenizer=self.tokenizer,
            eos_token_id=self.eos_token_id,
            complete=complete,
            source=self.source,
            resume=self.resume,
        )

    def __enter__(self) -> CorpusWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(complete=exc_type is None)


class TokenCorpus:
    """A read-only, memory-mapped corpus folder; open with :meth:`TokenCorpus.open`."""

    def __init__(self, folder: Path, index: CorpusIndex, tokens: np.ndarray) -> None:
        self.folder = folder
        self._index = index
        self._tokens = tokens

    @classmethod
    def open(cls, folder: str | Path) -> TokenCorpus:
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"corpus folder {folder} does not exist: run `nanotron-recover preprocess --out {folder}` first"
            )
        index_path = folder / INDEX_FILE
        tokens_path = folder / TOKENS_FILE
        if not index_path.is_file():
            raise FileNotFoundError(f"corpus index {index_path} is missing")
        if not tokens_path.is_file():
            raise FileNotFoundError(f"corpus tokens file {tokens_path} is missing")
        try:
            index = CorpusIndex.read(folder)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"corpus index {index_path} is corrupt: {e}") from None
        if not index.complete:
            raise ValueError(
                f"corpus {folder} is incomplete: preprocessing did not finish (re-run `nanotron-recover preprocess`)"
            )
        dtype = np.dtype(index.dtype)
        if dtype != dtype_for_vocab(index.vocab_size):
            raise ValueError(
                f"corpus index {index_path} is corrupt: dtype {dtype} for vocab {index.vocab_size}"
            )
        expected = index.num_tokens * dtype.itemsize
        actual = tokens_path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"corpus tokens file {tokens_path} is truncated or corrupt: {actual} bytes, "
                f"index says {index.num_tokens} tokens x {dtype.itemsize} bytes = {expected}"
            )
        if index.num_tokens == 0:
            # np.memmap refuses empty files; an empty array behaves identically for reads.
            tokens: np.ndarray = np.empty(0, dtype=dtype)
        else:
            tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(index.num_tokens,))
        return cls(folder, index, tokens)

    @property
    def index(self) -> CorpusIndex:
        return self._index

    @property
    def num_tokens(self) -> int:
        return self._index.num_tokens

    @property
    def vocab_size(self) -> int:
        return self._index.vocab_size

    @property
    def tokens(self) -> np.ndarray:
        """The whole token array (read-only memory map)."""
        return self._tokens

    def num_samples(self, sequence_length: int) -> int:
        """How many ``sequence_length + 1``-token samples the corpus holds (see module docstring)."""
        if sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
        return max(0, (self.num_tokens - 1) // sequence_length)

    def require_samples(self, sequence_length: int) -> int:
        """:meth:`num_samples`, but a corpus too small for even one sample is a ValueError."""
        n = self.num_samples(sequence_length)
        if n < 1:
            raise ValueError(
                f"corpus {self.folder} has {self.num_tokens} tokens, fewer than the "
                f"{sequence_length + 1} needed for one sample of sequence_length {sequence_length}"
            )
        return n

    def sample(self, i: int, sequence_length: int) -> np.ndarray:
        """Sample ``i``: tokens ``[i*L, i*L + L + 1)`` as a fresh int64 array."""
        n = self.require_samples(sequence_length)
        if not 0 <= i < n:
            raise IndexError(
                f"sample {i} out of range: corpus has {n} samples of sequence_length {sequence_length}"
            )
        start = i * sequence_length
        return np.array(self._tokens[start : start + sequence_length + 1], dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"TokenCorpus({str(self.folder)!r}, num_tokens={self.num_tokens}, vocab_size={self.vocab_size})"
        )
