"""Nanoset folders (datatrove's tokenized format) as micro-batches: id -> tokens, a pure function.

A Nanoset folder is what datatrove's ``DocumentTokenizer`` writes (``nanotron-recover preprocess``,
or Nanotron's ``tools/preprocess_data.py``): ``*.ds`` files of raw little-endian token ids (2 or 4
bytes each), a ``*.ds.index`` of uint64 document ends per file, and a ``*.ds.metadata`` whose first
line is ``tokenizer_name_or_path|token_size``, then the token count (and the count in words); the
folders ``preprocess`` and ``convert-corpus`` write add a line ``tokenizer_fingerprint=sha256:...``,
the content fingerprint of the tokenizer (:mod:`.tokenization`), which other readers ignore.
Samples are read through datatrove's ``DatatroveFolderDataset``: sample ``i`` of a folder is the
``i``-th window of ``sequence_length + 1`` tokens, files in name order, windows never crossing a
file's end (its tail shorter than a window is never read). A folder of ``T_f`` tokens per file holds ``n = sum_f T_f // (L + 1)`` samples.

The sampling rule
-----------------
The trainer asks for micro-batch ``m``; row ``j`` of it is *slot* ``k = (m - first_id) * mbs + j``,
where ``first_id`` is the first micro-batch id of the data stage (a stage that starts at step ``S``
starts at id ``(S - 1) * B``), so every stage reads its data from its own beginning. For a stage of
``D`` folders with ``n_d`` samples each and weights ``w_d`` (normalised; without weights,
``w_d = n_d / N``):

1. An epoch has ``N = sum_d n_d`` slots, of which folder ``d`` gets exactly ``c_d`` -- ``w_d * N``
   rounded by largest remainder (ties to the earlier folder), so ``sum_d c_d = N``.
2. Slot ``k`` is position ``p = k mod N`` of epoch ``e = k // N``. With one folder it is that
   folder's use ``u = k``. With several, the epoch's positions are dealt to the folders by
   shuffling the sequence ``[0] * c_0 + [1] * c_1 + ...`` with a permutation seeded by
   ``(seed, 0, e)``; position ``p`` goes to folder ``d`` and is its use
   ``u = e * c_d + (positions before p that went to d)``.
3. Use ``u`` of folder ``d`` reads its sample ``perm_{d,f}[u mod n_d]``, ``f = u // n_d``, where
   ``perm_{d,f}`` is a permutation of ``range(n_d)`` seeded by ``(seed, 1 + d, f)``.

So every epoch holds the blend's exact proportions, spread through it; a folder's uses come in
increasing order, so it is read through completely (in a new order each pass) before any of its
samples repeats; and any slot is computed without the
slots before it: the tokens of micro-batch ``m`` depend only on the config and ``m``, whichever
replica computes it, in whatever order, after whatever fault. Nanotron's Nanoset keeps the same
proportions per epoch but a different order (it is built by a deficit round-robin and repeats its
index every epoch), so a Nanoset trains on the same data mix here, not on the same sequence of
samples.

Permutations are numpy PCG64 streams (platform-independent for a numpy version); a cache keeps the
last two epochs' (consecutive ids straddle at most one epoch boundary). Memory is O(N) integers per
stage and epoch kept, like Nanotron's index.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from nanotron_recover.data.tokenization import FINGERPRINT_KEY, short_fingerprint
from nanotron_recover.errors import InputError

# Keep this many epoch permutations per stream; two covers ids straddling an epoch boundary.
_CACHE_EPOCHS = 2
# Seed-sequence namespace of the epoch-order permutation; folder d uses 1 + d.
_ORDER_STREAM = 0

T = TypeVar("T")


@dataclass(frozen=True)
class NanosetSummary:
    """What a Nanoset folder holds, checked (see :func:`summarize_nanoset`)."""

    folder: Path
    files: tuple[Path, ...]  # the .ds files, sorted by name
    num_tokens: int
    num_documents: int
    tokenizer: str  # tokenizer_name_or_path, from the metadata
    token_size: int  # bytes per token id: 2 (uint16) or 4 (uint32)
    # The tokenizer's content fingerprint, where the metadata records it (None: an older folder, or
    # one from another tool).
    tokenizer_fingerprint: str | None = None

    @property
    def dtype(self) -> str:
        return "uint16" if self.token_size == 2 else "uint32"

    def num_samples(self, sequence_length: int) -> int:
        """Windows of ``sequence_length + 1`` tokens, counted per file as datatrove does."""
        window = (sequence_length + 1) * self.token_size
        return sum(f.stat().st_size // window for f in self.files)


def summarize_nanoset(folder: str | Path) -> NanosetSummary:
    """Count the tokens and documents of the ``*.ds`` files in ``folder``, checking each file on the way.

    Checked before anything is read for training: the folder exists and holds ``*.ds`` files (not in
    subfolders, as Nanotron reads them); each ``X.ds`` has its ``X.ds.index`` and ``X.ds.metadata``,
    and sizes that agree (a whole number of ids; the last document end and the metadata's count
    equal to the ids in it: a truncated copy is refused, not read short); every file names the same
    tokenizer and token size, and the files that record a tokenizer fingerprint record the same
    one. An InputError, one line, names the first problem.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(
            f"dataset folder {str(folder)!r} does not exist: tokenize a corpus into it with "
            "`nanotron-recover preprocess` or fix the path"
        )
    files = tuple(sorted(folder.glob("*.ds")))
    if not files:
        hint = (
            "it holds our old tokens.bin format: convert it with `nanotron-recover convert-corpus`"
            if (folder / "tokens.bin").exists()
            else "tokenize a corpus into it with `nanotron-recover preprocess`"
        )
        raise InputError(f"dataset folder {str(folder)!r} holds no Nanoset files (*.ds): {hint}")
    num_tokens = num_documents = 0
    first: tuple[str, int] | None = None
    fingerprint: tuple[str, str] | None = None  # (file, fingerprint) of the first file recording one
    for ds in files:
        tokenizer, token_size, count, recorded = read_metadata(ds)
        if first is None:
            first = (tokenizer, token_size)
        elif (tokenizer, token_size) != first:
            raise InputError(
                f"{ds.name} was written with tokenizer {tokenizer!r} ({token_size}-byte ids) but "
                f"{files[0].name} with {first[0]!r} ({first[1]}-byte ids): one folder, one tokenizer"
            )
        if recorded is not None:
            if fingerprint is None:
                fingerprint = (ds.name, recorded)
            elif recorded != fingerprint[1]:
                raise InputError(
                    f"{ds.name} records tokenizer fingerprint {short_fingerprint(recorded)} but "
                    f"{fingerprint[0]} {short_fingerprint(fingerprint[1])}, under one name {tokenizer!r}: "
                    "one folder, one tokenizer"
                )
        size = ds.stat().st_size
        index = Path(f"{ds}.index")
        if not index.is_file():
            raise InputError(f"{ds.name} has no {index.name} (document ends)")
        index_size = index.stat().st_size
        tokens = size // token_size
        if size % token_size or index_size % 8 or count != tokens or _last_end(index) != tokens:
            raise InputError(
                f"{ds.name} is damaged or truncated: {size} bytes of {token_size}-byte ids, "
                f"metadata says {count} tokens, its index ends at {_last_end(index)}"
            )
        num_tokens += tokens
        num_documents += index_size // 8
    assert first is not None
    return NanosetSummary(
        folder, files, num_tokens, num_documents, first[0], first[1], fingerprint[1] if fingerprint else None
    )


class DsMetadata(NamedTuple):
    """What a ``.ds.metadata`` says."""

    tokenizer: str
    token_size: int
    count: int
    tokenizer_fingerprint: str | None  # None when the file records none


def read_metadata(ds: Path) -> DsMetadata:
    """Tokenizer name, token size, token count and tokenizer fingerprint from ``ds``'s ``.ds.metadata``."""
    path = Path(f"{ds}.metadata")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        name, size = lines[0].rsplit("|", 1)
        token_size, count = int(size), int(lines[1])
    except FileNotFoundError:
        raise InputError(f"{ds.name} has no {path.name}") from None
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        raise InputError(
            f"{path.name} is not datatrove metadata (`tokenizer|token_size`, then the token count)"
        ) from None
    if token_size not in (2, 4):
        raise InputError(f"{path.name}: token size {token_size}, expected 2 or 4 bytes")
    prefix = f"{FINGERPRINT_KEY}="
    recorded = [line.removeprefix(prefix).strip() for line in lines[2:] if line.startswith(prefix)]
    return DsMetadata(name, token_size, count, recorded[-1] if recorded and recorded[-1] else None)


def fingerprint_line(fingerprint: str) -> str:
    """The ``.ds.metadata`` line that records a tokenizer's content fingerprint."""
    return f"{FINGERPRINT_KEY}={fingerprint}"


def record_fingerprint(ds: Path, fingerprint: str) -> None:
    """Add (or replace) the fingerprint line of ``ds``'s ``.ds.metadata``, atomically; the other
    lines stay as they are."""
    path = Path(f"{ds}.metadata")
    lines = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if not line.startswith(f"{FINGERPRINT_KEY}=")
    ]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join([*lines, fingerprint_line(fingerprint)]), encoding="utf-8")
    os.replace(tmp, path)


def _last_end(index: Path) -> int:
    size = index.stat().st_size
    if size < 8:
        return 0
    with open(index, "rb") as f:
        f.seek(size - size % 8 - 8)
        return int.from_bytes(f.read(8), "little")


def blend_counts(weights: Sequence[float], n: int) -> list[int]:
    """Slots per epoch of each folder: ``w_d * n`` by largest remainder, summing to ``n``."""
    total = float(sum(weights))
    exact = [w / total * n for w in weights]
    counts = [math.floor(x) for x in exact]
    # Hand out what flooring dropped, biggest remainder first, ties to the earlier folder.
    order = sorted(range(len(exact)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in order[: n - sum(counts)]:
        counts[d] += 1
    return counts


class _PerEpoch(Generic[T]):
    """``build(epoch)`` for the last few epochs asked for, cached; a pure function either way."""

    def __init__(self, build: Callable[[int], T]) -> None:
        self.build = build
        self._cache: OrderedDict[int, T] = OrderedDict()

    def __call__(self, epoch: int) -> T:
        value = self._cache.get(epoch)
        if value is None:
            value = self.build(epoch)
            self._cache[epoch] = value
            while len(self._cache) > _CACHE_EPOCHS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(epoch)
        return value


def _permutation(n: int, seed: int, stream: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed, stream, epoch]).permutation(n)
    perm.flags.writeable = False  # shared through the cache
    return perm


def _deal(counts: Sequence[int], seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 2 of the rule for one epoch: each position's folder, and its use within the epoch."""
    n = int(sum(counts))
    starts = np.cumsum([0, *counts[:-1]])
    # Position p takes entry perm[p] of [0]*c_0 + [1]*c_1 + ...: its folder is the block holding it.
    folder = np.searchsorted(starts, _permutation(n, seed, _ORDER_STREAM, epoch), side="right") - 1
    # Rank of each position among its folder's, in position order (a stable sort keeps that order).
    by_folder = np.argsort(folder, kind="stable")
    use = np.empty(n, dtype=np.int64)
    use[by_folder] = np.arange(n) - np.repeat(starts, counts)
    for array in (folder, use):
        array.flags.writeable = False
    return folder, use


class NanosetMicroBatches:
    """Micro-batches of a (blended) Nanoset stage, by the sampling rule of the module docstring."""

    def __init__(
        self,
        folders: Sequence[NanosetSummary],
        weights: Sequence[float] | None,
        *,
        micro_batch_size: int,
        sequence_length: int,
        seed: int,
        vocab_size: int,
        first_id: int = 0,
    ) -> None:
        from datatrove.utils.dataset import DatatroveFolderDataset

        if not folders:
            raise InputError("a Nanoset stage needs at least one dataset folder")
        self.micro_batch_size = int(micro_batch_size)
        self.sequence_length = int(sequence_length)
        self.seed, self.vocab_size, self.first_id = int(seed), int(vocab_size), int(first_id)
        self.folders = list(folders)
        self.sizes = [f.num_samples(self.sequence_length) for f in self.folders]
        for f, n in zip(self.folders, self.sizes, strict=True):
            if n < 1:
                raise InputError(
                    f"dataset folder {str(f.folder)!r} holds no sample of sequence_length + 1 = "
                    f"{self.sequence_length + 1} tokens in any of its files ({f.num_tokens} tokens in all)"
                )
        if weights is not None and len(weights) != len(self.folders):
            raise InputError(f"{len(weights)} dataset weights for {len(self.folders)} dataset folders")
        if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
            raise InputError(f"dataset weights must be finite and > 0, got {list(weights)}")
        self.epoch_slots = sum(self.sizes)
        self.counts = blend_counts(weights if weights is not None else self.sizes, self.epoch_slots)
        self._dealt = _PerEpoch(lambda e: _deal(self.counts, self.seed, e))
        self._samples = [
            _PerEpoch(lambda f, n=n, d=d: _permutation(n, self.seed, 1 + d, f))
            for d, n in enumerate(self.sizes)
        ]
        # shuffle=False: our permutations are the only shuffling; files are read in name order.
        self._datasets = [
            DatatroveFolderDataset(
                str(f.folder),
                seq_len=self.sequence_length,
                filename_pattern="*.ds",
                recursive=False,
                token_size=f.token_size,
                shuffle=False,
            )
            for f in self.folders
        ]
        for f, ds, n in zip(self.folders, self._datasets, self.sizes, strict=True):
            if len(ds) != n:  # datatrove counts windows as we do; a mismatch means another reader
                raise InputError(
                    f"dataset folder {str(f.folder)!r}: datatrove reads {len(ds)} samples, expected {n}"
                )

    def locate(self, slot: int) -> tuple[int, int]:
        """(folder, sample) of ``slot``: steps 1-3 of the sampling rule."""
        if len(self.folders) == 1:
            folder, use = 0, slot
        else:
            epoch, position = divmod(slot, self.epoch_slots)
            folders, uses = self._dealt(epoch)
            folder = int(folders[position])
            use = epoch * self.counts[folder] + int(uses[position])
        passes, position = divmod(use, self.sizes[folder])
        return folder, int(self._samples[folder](passes)[position])

    def slots(self, microbatch_id: int) -> range:
        m = int(microbatch_id)
        if m < 0:
            raise ValueError(f"microbatch_id must be >= 0, got {m}")
        if m < self.first_id:
            raise ValueError(f"micro-batch {m} comes before this stage's first id {self.first_id}")
        first = (m - self.first_id) * self.micro_batch_size
        return range(first, first + self.micro_batch_size)

    def get(self, microbatch_id: int) -> torch.Tensor:
        rows = []
        for slot in self.slots(microbatch_id):
            folder, sample = self.locate(slot)
            row = self._datasets[folder][sample]["input_ids"]
            if int(row.max()) >= self.vocab_size:
                raise InputError(
                    f"dataset folder {str(self.folders[folder].folder)!r} sample {sample} holds token id "
                    f"{int(row.max())} >= model vocab_size {self.vocab_size}: the data was tokenized "
                    "with a larger vocabulary than the model's"
                )
            rows.append(row)
        return torch.stack(rows)

    def __repr__(self) -> str:
        return (
            f"NanosetMicroBatches({[str(f.folder) for f in self.folders]}, counts={self.counts}, "
            f"micro_batch_size={self.micro_batch_size}, sequence_length={self.sequence_length}, "
            f"seed={self.seed}, first_id={self.first_id})"
        )
