"""The tokenizer side of preprocessing: loading, fingerprinting, and ordered parallel encoding.

* :func:`load_tokenizer` wraps ``AutoTokenizer.from_pretrained`` (optionally offline-only).
* :func:`tokenizer_fingerprint` identifies a tokenizer by *content* -- its vocabulary, its BPE
  merges, ``len(tokenizer)`` and its eos id -- so a corpus can be checked against a tokenizer
  wherever it was loaded from (a hub id, a cache, a copied folder). The serialization of
  ``tokenizer.json`` is deliberately not hashed as is: it also holds truncation/padding state
  and changes shape between ``tokenizers`` releases, which would make the same tokenizer look
  different after an upgrade.
* :func:`make_encoder` turns a tokenizer into a small picklable callable, ``texts -> Encoded``.
  For fast tokenizers it carries only the ``tokenizers`` JSON (shipped once per worker, not
  per chunk), so a worker never loads ``transformers``; the same encoder is used in-process and
  in workers, which is what makes ``workers=0`` and ``workers=N`` produce identical ids.
* :func:`encode_chunks` maps an encoder over chunks of texts, in a pool of *spawned* worker
  processes (fork is unsafe once torch or the tokenizer's own thread pool is running), and
  yields results in input order. At most ``2 * workers`` chunks are in flight, so a streamed
  dataset is never read far ahead of what has been written (``Pool.imap`` would read the
  whole input eagerly). Each worker encodes single-threaded (``TOKENIZERS_PARALLELISM=false``):
  ``workers`` is then the number of cores tokenizing, and N workers never oversubscribe N cores.

Nothing here is imported by the trainer's hot path; ``transformers`` is imported lazily.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import numpy as np


class Encoded(NamedTuple):
    """A chunk of encoded texts: all ids back to back, and each text's id count (0 for empty text)."""

    ids: np.ndarray  # uint32
    lengths: np.ndarray  # int64, one per input text


Encoder = Callable[[list[str]], Encoded]


def load_tokenizer(name_or_path: str, *, offline: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)``; ``offline`` only looks at local files and the cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=offline)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """``sha256:<hex>`` of the tokenizer's vocabulary, merges, ``len(tokenizer)`` and eos id (see module docstring)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    merges = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        if model.get("merges") is not None:
            # Older tokenizers releases store a merge as "a b", newer ones as ["a", "b"].
            merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    payload = {"vocab": vocab, "merges": merges, "len": len(tokenizer), "eos": tokenizer.eos_token_id}
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _pack(ids_lists: list[list[int]]) -> Encoded:
    lengths = np.fromiter((len(ids) for ids in ids_lists), dtype=np.int64, count=len(ids_lists))
    flat = np.fromiter(itertools.chain.from_iterable(ids_lists), dtype=np.uint32, count=int(lengths.sum()))
    return Encoded(flat, lengths)


class FastEncoder:
    """Encode with a ``tokenizers.Tokenizer`` rebuilt from its JSON; picklable and cheap to ship.

    Mirrors what a transformers fast tokenizer's ``__call__`` does for plain text: no
    truncation or padding, and its ``split_special_tokens`` setting (whether "</s>" written in
    a document is the eos token or just text), which lives outside the tokenizer's JSON.
    """

    def __init__(self, tokenizer_json: str, *, split_special_tokens: bool = False) -> None:
        self.tokenizer_json = tokenizer_json
        self.split_special_tokens = split_special_tokens
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}  # workers rebuild it from the JSON

    def __call__(self, texts: list[str]) -> Encoded:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.tokenizer_json)
            # A saved tokenizer.json may have these on; they would silently change the ids.
            tok.no_truncation()
            tok.no_padding()
            tok.encode_special_tokens = self.split_special_tokens
            self._tokenizer = tok
        # add_special_tokens=False: no bos/eos template; the corpus writer appends eos itself.
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return _pack([e.ids for e in encodings])


class HFEncoder:
    """Fallback for tokenizers without a ``tokenizers`` backend: call the transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str]) -> Encoded:
        return _pack(self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"])


def make_encoder(tokenizer: Any) -> Encoder:
    """The picklable encoder for ``tokenizer`` (fast backend when it has one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        split = bool(getattr(tokenizer, "split_special_tokens", False))
        return FastEncoder(backend.to_str(), split_special_tokens=split)
    return HFEncoder(tokenizer)


def default_workers() -> int:
    """The cores this process may run on (affinity-aware, unlike a bare ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# -- worker side ---------------------------------------------------------------------------
_WORKER_ENCODER: Encoder | None = None
# How often a worker checks that the process that started it is still alive.
_PARENT_POLL_SECONDS = 1.0


def _init_worker(encoder: Encoder, parent_pid: int) -> None:
    global _WORKER_ENCODER
    # One thread per worker: `workers` processes then use `workers` cores, no more.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C goes to the whole process group; the parent decides what happens, not the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_ENCODER = encoder
    # A worker blocks on its task queue, whose pipe it holds open itself, so it would outlive a
    # parent killed with SIGKILL (the crash that resume exists for). Watch for that and exit.
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)


def _encode_in_worker(texts: list[str]) -> Encoded:
    assert _WORKER_ENCODER is not None, "worker was not initialised"
    return _WORKER_ENCODER(texts)


# -- parent side ---------------------------------------------------------------------------
def encode_chunks(encoder: Encoder, chunks: Iterable[list[str]], workers: int) -> Iterator[Encoded]:
    """``encoder(chunk)`` for each chunk, in order; ``workers=0`` encodes in this process.

    With ``workers >= 1`` a spawned process pool encodes up to ``2 * workers`` chunks ahead of
    the consumer. Closing the generator early (a token budget is reached, an error) cancels the
    queued chunks and waits only for those already being encoded. A worker that dies (e.g.
    killed for memory) raises ``BrokenProcessPool`` here instead of hanging the run.
    """
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    source = iter(chunks)
    head = list(itertools.islice(source, 2))
    if workers == 0 or len(head) < 2:
        # A single chunk (a small dataset, a resume near the end) costs less to encode here
        # than starting processes would; the output is the same either way.
        for chunk in itertools.chain(head, source):
            yield encoder(chunk)
        return
    source = itertools.chain(head, source)

    # concurrent.futures rather than multiprocessing.Pool: Pool.terminate() can deadlock with
    # large tasks in flight, and a Pool whose worker dies waits for its result forever.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(encoder, os.getpid()),
    )
    pending: deque[Future[Encoded]] = deque()
    try:
        for chunk in source:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future[Encoded]) -> Encoded:
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise BrokenProcessPool(
            "a tokenization worker died: killed (e.g. out of memory: lower --workers or --chunk-docs), "
            "or, when preprocess is called from a script, that script lacks the "
            "`if __name__ == '__main__':` guard that spawned processes need"
        ) from e
