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

Writing is transactional, so that a crash never leaves a corpus that looks finished and an
interrupted writer can be continued:

* :class:`CorpusWriter` first writes an index with ``complete: false``; only
  :meth:`CorpusWriter.close` marks it complete.
* :meth:`CorpusWriter.commit` makes progress durable: it appends the buffered tokens to
  ``tokens.bin`` and fsyncs it, *then* atomically replaces the index (temporary file, fsync,
  ``os.replace``, fsync of the folder) with the new counts and the caller's ``resume`` record.
  The index therefore never counts a token that is not on disk; ``tokens.bin`` may hold more
  (flushed after the last commit), and :meth:`CorpusWriter.reopen` cuts that tail off.
* An interrupted writer (exception, or ``close(complete=False)``) leaves the index of its last
  commit, never counts that are ahead of the caller's resume record.

:meth:`TokenCorpus.open` checks a folder fully before anything is read from it (both files, a
complete and well-typed index, a ``tokens.bin`` of exactly the indexed size) and
:func:`validate_corpus` checks that a corpus fits the model: vocabulary size, and (optionally)
that it was made with the configured tokenizer. Each failure is an
:class:`~nanotron_recover.errors.InputError` whose message is one line naming the file.
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

from nanotron_recover.data.tokenization import load_tokenizer, tokenizer_fingerprint
from nanotron_recover.errors import InputError

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

    ``tokenizer`` is the tokenizer's name or path and ``tokenizer_fingerprint`` a hash of its
    contents (:func:`~nanotron_recover.data.tokenization.tokenizer_fingerprint`), so a corpus
    can be matched to a tokenizer by content; ``vocab_size`` is ``len(tokenizer)``.
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
    tokenizer_fingerprint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        extra = data.pop("extra")
        # Unknown keys live at the top level, where a newer writer put them.
        return json.dumps({**extra, **data}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CorpusIndex:
        """Parse an index; a ValueError (one line) says what is wrong with it."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"corpus index must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if not _is_int(version) or version > FORMAT_VERSION:
            raise ValueError(
                f"unsupported corpus format_version {version!r} (this code reads <= {FORMAT_VERSION})"
            )
        known = {f.name for f in fields(cls)} - {"extra"}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"corpus index is missing field(s): {', '.join(missing)}")
        _check_index_types(data)
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def read(cls, folder: str | Path) -> CorpusIndex:
        """Read ``folder/index.json``."""
        return cls.from_json((Path(folder) / INDEX_FILE).read_text(encoding="utf-8"))

    def write(self, folder: str | Path) -> None:
        """Write ``folder/index.json`` atomically and durably: readers see the old or the new index, never half."""
        path = Path(folder) / INDEX_FILE
        tmp = path.with_name(f".{INDEX_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The dtypes a writer can choose (see dtype_for_vocab); anything else is a corrupt index.
_DTYPES = ("uint16", "uint32")


def _check_index_types(data: dict[str, Any]) -> None:
    """Refuse an index whose known fields have the wrong type or range: readers trust them blindly."""
    for name in ("num_tokens", "num_documents", "eos_token_id"):
        if not _is_int(data[name]) or data[name] < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {data[name]!r}")
    if not _is_int(data["vocab_size"]) or data["vocab_size"] < 1:
        raise ValueError(f"vocab_size must be a whole number >= 1, got {data['vocab_size']!r}")
    if data["dtype"] not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {data['dtype']!r}")
    if not isinstance(data["tokenizer"], str):
        raise ValueError(f"tokenizer must be a string, got {data['tokenizer']!r}")
    if not isinstance(data.get("complete", True), bool):
        raise ValueError(f"complete must be true or false, got {data['complete']!r}")
    fingerprint = data.get("tokenizer_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(f"tokenizer_fingerprint must be a string or null, got {fingerprint!r}")
    for name in ("source", "resume"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise ValueError(f"{name} must be a mapping or null, got {data[name]!r}")


def _one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) as one space: errors are one line."""
    return " ".join(str(text).split())


class CorpusNotFoundError(InputError, FileNotFoundError):
    """A corpus folder or one of its files does not exist (also a FileNotFoundError, for callers that
    treat a missing corpus like any missing file)."""


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


class CorpusWriter:
    """Append documents to a new corpus folder; use as a context manager.

    Each document is written as its ids followed by ``eos_token_id``. ``tokenizer`` is the
    tokenizer's name or path, recorded for humans and for decoding samples later. Any
    existing corpus in ``folder`` is overwritten; :meth:`reopen` continues one instead.
    Progress is durable only at :meth:`commit` and :meth:`close` (see the module docstring):
    if the ``with`` block raises, the index stays at the last commit, ``complete: false``.
    """

    def __init__(
        self,
        folder: str | Path,
        vocab_size: int,
        tokenizer: str,
        eos_token_id: int,
        *,
        source: dict[str, Any] | None = None,
        resume: dict[str, Any] | None = None,
        tokenizer_fingerprint: str | None = None,
    ) -> None:
        self._setup(
            Path(folder), vocab_size, str(tokenizer), eos_token_id, source, resume, tokenizer_fingerprint
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        # Mark the folder incomplete *before* touching tokens.bin, so that a crash at any
        # later point leaves a corpus that readers reject with "did not finish".
        self._committed = self._index(complete=False)
        self._committed.write(self.folder)
        self._file = open(self.folder / TOKENS_FILE, "wb")

    @classmethod
    def reopen(cls, folder: str | Path, index: CorpusIndex | None = None) -> CorpusWriter:
        """Continue the corpus in ``folder`` from ``index`` (default: its own index.json).

        ``index`` may count fewer tokens than the folder holds (e.g. to drop a last document that
        was cut short); it is written first, with ``complete: false``, and then ``tokens.bin`` is
        truncated to its ``num_tokens``, so a crash in between still leaves a resumable folder.
        """
        folder = Path(folder)
        if index is None:
            index = CorpusIndex.read(folder)
        self = cls.__new__(cls)
        self._setup(
            folder,
            index.vocab_size,
            index.tokenizer,
            index.eos_token_id,
            index.source,
            index.resume,
            index.tokenizer_fingerprint,
        )
        if index.dtype != self.dtype.name:
            raise ValueError(
                f"corpus index in {folder} is corrupt: dtype {index.dtype} for vocab {index.vocab_size}"
            )
        path = folder / TOKENS_FILE
        have = path.stat().st_size if path.is_file() else 0
        need = index.num_tokens * self.dtype.itemsize
        if have < need:
            raise ValueError(
                f"corpus tokens file {path} holds {have} bytes, fewer than the {need} its index committed: "
                f"the folder is corrupt, delete it and start again"
            )
        self.num_tokens = index.num_tokens
        self.num_documents = index.num_documents
        self._committed = self._index(complete=False)
        self._committed.write(folder)
        self._file = open(path, "r+b" if path.is_file() else "wb")
        self._file.truncate(need)  # tokens flushed after the last commit are not counted: drop them
        self._file.seek(need)
        return self

    def _setup(
        self,
        folder: Path,
        vocab_size: int,
        tokenizer: str,
        eos_token_id: int,
        source: dict[str, Any] | None,
        resume: dict[str, Any] | None,
        fingerprint: str | None,
    ) -> None:
        self.folder = folder
        self.dtype = dtype_for_vocab(vocab_size)
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.source = source
        self.resume = resume
        self.tokenizer_fingerprint = fingerprint
        self.num_tokens = 0
        self.num_documents = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._closed = False
        self._final: CorpusIndex | None = None

    def _checked(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` as the corpus dtype, after checking it is 1-D, integer and inside the vocabulary."""
        if self._closed:
            raise ValueError("CorpusWriter is closed")
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
        return arr.astype(self.dtype)  # always a copy: the caller may reuse its array

    def add_document(self, ids: Sequence[int] | np.ndarray, *, add_eos: bool = True) -> None:
        """Append one document's ids, then eos (``add_eos=False`` only to cut a document short)."""
        arr = self._checked(np.asarray(ids))
        if add_eos:
            arr = np.concatenate([arr, np.array([self.eos_token_id], dtype=self.dtype)])
        self._append(arr, documents=1)

    def add_documents(self, ids: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many documents at once: ``ids`` holds them back to back, ``lengths[i]`` ids each.

        Equivalent to ``add_document`` on each slice (each gets its eos), without a Python-level
        loop over documents -- the preprocessing hot path.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths.size and int(lengths.min()) < 0):
            raise ValueError("lengths must be a 1-D sequence of non-negative counts")
        arr = self._checked(np.asarray(ids))
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} ids but {arr.size} were given")
        self._append(np.insert(arr, np.cumsum(lengths), self.eos_token_id), documents=lengths.size)

    def _append(self, arr: np.ndarray, *, documents: int) -> None:
        self._buffer.append(arr)
        self._buffered += arr.size
        self.num_tokens += arr.size
        self.num_documents += documents
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()  # bounds memory only; nothing counts as written before commit()

    def set_resume(self, resume: dict[str, Any] | None) -> None:
        """Record where in the source the next document would come from (stored in the index)."""
        self.resume = resume

    def commit(self, resume: dict[str, Any] | None = None) -> CorpusIndex:
        """Make everything added so far durable, with ``resume`` (if given) as the source position.

        Tokens are appended and fsynced before the index that counts them replaces the old one.
        """
        if self._closed:
            raise ValueError("CorpusWriter is closed")
        if resume is not None:
            self.resume = resume
        self._sync()
        self._committed = self._index(complete=False)
        self._committed.write(self.folder)
        return self._committed

    def close(self, *, complete: bool = True) -> CorpusIndex:
        """Flush tokens and, if ``complete``, write the final index atomically; return the index. Idempotent.

        ``complete=False`` (an interrupted writer) leaves the index of the last commit in place.
        """
        if self._final is not None:
            return self._final
        self._sync()
        self._file.close()
        self._closed = True
        if complete:
            self._final = self._index(complete=True)
            self._final.write(self.folder)
        else:
            self._final = self._committed
        return self._final

    def _sync(self) -> None:
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())

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
            tokenizer_fingerprint=self.tokenizer_fingerprint,
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
        """Open ``folder`` after checking all of it; a bad corpus is an :class:`InputError` naming the file.

        Everything a reader relies on is checked here, before any sample is read: both files exist,
        the index is a complete, well-typed index of this format, its dtype fits its vocabulary,
        and ``tokens.bin`` holds exactly ``num_tokens`` whole tokens. The checks read only the
        index and the file's size, so they cost the same on a 100-token and a 100-billion-token
        corpus, and every rank that opens the same folder reaches the same verdict.
        """
        folder = Path(folder)
        if not folder.is_dir():
            if folder.exists():
                raise InputError(
                    f"corpus folder {folder} is not a folder: point dataset_folder at the "
                    "output folder of `nanotron-recover preprocess`"
                )
            raise CorpusNotFoundError(
                f"corpus folder {folder} does not exist: run `nanotron-recover preprocess --out {folder}` first"
            )
        index_path = folder / INDEX_FILE
        tokens_path = folder / TOKENS_FILE
        if not index_path.is_file():
            raise CorpusNotFoundError(
                f"corpus index {index_path} is missing: {folder} is not a finished "
                "`nanotron-recover preprocess` output"
            )
        if not tokens_path.is_file():
            raise CorpusNotFoundError(
                f"corpus tokens file {tokens_path} is missing: re-run `nanotron-recover preprocess`"
            )
        try:
            text = index_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"corpus index {index_path} cannot be read: {_one_line(e)}") from None
        try:
            index = CorpusIndex.from_json(text)
        except json.JSONDecodeError as e:
            raise InputError(
                f"corpus index {index_path} is corrupt: not valid JSON ({_one_line(e)}); "
                "re-run `nanotron-recover preprocess`"
            ) from None
        except (ValueError, TypeError) as e:
            raise InputError(
                f"corpus index {index_path} is corrupt: {_one_line(e)}; re-run `nanotron-recover preprocess`"
            ) from None
        if not index.complete:
            raise InputError(
                f"corpus {folder} is incomplete: preprocessing did not finish (re-run `nanotron-recover "
                f"preprocess` to resume it; {index_path} says complete: false)"
            )
        dtype = np.dtype(index.dtype)
        if dtype != dtype_for_vocab(index.vocab_size):
            raise InputError(
                f"corpus index {index_path} is corrupt: dtype {dtype} for vocab {index.vocab_size} "
                f"(a writer uses {dtype_for_vocab(index.vocab_size)})"
            )
        if not index.eos_token_id < index.vocab_size:
            raise InputError(
                f"corpus index {index_path} is corrupt: eos_token_id {index.eos_token_id} is outside "
                f"the vocabulary [0, {index.vocab_size})"
            )
        expected = index.num_tokens * dtype.itemsize
        try:
            actual = tokens_path.stat().st_size
        except OSError as e:
            raise InputError(f"corpus tokens file {tokens_path} cannot be read: {_one_line(e)}") from None
        if actual % dtype.itemsize:
            raise InputError(
                f"corpus tokens file {tokens_path} is truncated or corrupt: {actual} bytes is not a whole "
                f"number of {dtype.itemsize}-byte {dtype} tokens (index {index_path} says "
                f"{index.num_tokens} tokens = {expected} bytes)"
            )
        if actual != expected:
            raise InputError(
                f"corpus tokens file {tokens_path} is truncated or corrupt: {actual} bytes, "
                f"index says {index.num_tokens} tokens x {dtype.itemsize} bytes = {expected}"
            )
        if index.num_tokens == 0:
            # np.memmap refuses empty files; an empty array behaves identically for reads.
            tokens: np.ndarray = np.empty(0, dtype=dtype)
        else:
            try:
                tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(index.num_tokens,))
            except OSError as e:
                raise InputError(f"corpus tokens file {tokens_path} cannot be read: {_one_line(e)}") from None
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
        """:meth:`num_samples`, but a corpus too small for even one sample is an :class:`InputError`."""
        n = self.num_samples(sequence_length)
        if n < 1:
            raise InputError(
                f"corpus tokens file {self.folder / TOKENS_FILE} holds {self.num_tokens} tokens, fewer than "
                f"the {sequence_length + 1} needed for one sample of tokens.sequence_length {sequence_length}: "
                "lower tokens.sequence_length or preprocess more text into the corpus"
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


def validate_corpus(
    corpus: TokenCorpus | str | Path, *, tokenizer_name_or_path: str | None, vocab_size: int
) -> None:
    """Check that a corpus fits a model; raise :class:`InputError` (one line) naming the config field to change.

    * The corpus's vocabulary must not exceed the model's ``vocab_size`` (a larger model
      vocabulary is fine, e.g. padded embeddings).
    * If ``tokenizer_name_or_path`` is given, it must be the corpus's tokenizer: compared by
      fingerprint when it can be loaded offline (local folder or HF cache) and the corpus
      records one, by name otherwise -- so a tokenizer that was moved still matches, and the
      check never touches the network.
    """
    if not isinstance(corpus, TokenCorpus):
        corpus = TokenCorpus.open(corpus)
    if corpus.vocab_size > vocab_size:
        raise InputError(
            f"the corpus at {corpus.folder} was tokenized with vocab_size {corpus.vocab_size} but the model's "
            f"vocab_size is {vocab_size}: set model.model_config.vocab_size to at least {corpus.vocab_size} "
            f"or re-run `nanotron-recover preprocess` with the model's tokenizer"
        )
    if tokenizer_name_or_path is None:
        return
    given = str(tokenizer_name_or_path)
    recorded = corpus.index.tokenizer
    reason = _tokenizer_mismatch(corpus.index, given)
    if reason is None:
        return
    raise InputError(
        f"the corpus at {corpus.folder} was tokenized with {recorded!r} but tokenizer.tokenizer_name_or_path "
        f"is {given!r} ({reason}): set tokenizer.tokenizer_name_or_path to {recorded!r}, re-run "
        f"`nanotron-recover preprocess --tokenizer {given}`, or set validate_tokenizer: false on the dataset"
    )


def _tokenizer_mismatch(index: CorpusIndex, given: str) -> str | None:
    """Why ``given`` is not the corpus's tokenizer, or None if it is."""
    if index.tokenizer_fingerprint is not None:
        try:
            tokenizer = load_tokenizer(given, offline=True)
        except Exception:  # not loadable offline (hub id not cached, bad path): fall back to names
            tokenizer = None
        if tokenizer is not None:
            if tokenizer_fingerprint(tokenizer) == index.tokenizer_fingerprint:
                return None
            return "a different vocabulary or merges"
    if _same_name(index.tokenizer, given):
        return None
    if index.tokenizer_fingerprint is None:
        return "the corpus records no tokenizer fingerprint, and the names differ"
    return "it could not be loaded offline to compare contents, and the names differ"


def _same_name(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
