"""Micro-batch id -> token tensor, as a pure function.

This is the data half of the project's determinism guarantee. The trainer never iterates a
data loader; it asks "give me micro-batch ``m``" on whichever rank or replica happens to
compute it (after a fault, a different replica may recompute someone else's micro-batch).
The answer therefore depends only on ``(m, seed, data stage, micro_batch_size,
sequence_length)`` -- never on call order, on which ids were asked before, on the process,
or on any hidden RNG state -- and is bit-identical everywhere and every time.

Nanoset-backed sources (config ``dataset: {dataset_folder: ...}``, one folder or a weighted
blend) lay micro-batches over an endless stream of sample slots; the rule, which makes every slot
computable on its own, is in :mod:`nanotron_recover.data.nanoset`. Each data stage starts its
slots at its own first micro-batch id.

Synthetic sources (config ``dataset: null``) draw uniform tokens from a generator seeded by
``(seed, m)``, for benchmarks and tests that need no corpus.

Both use numpy's ``SeedSequence``-seeded PCG64 generators, whose streams are specified and
platform-independent for a given numpy version (all ranks of a job share one environment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from nanotron_recover.data.nanoset import NanosetMicroBatches, summarize_nanoset
from nanotron_recover.data.tokenization import check_same_tokenizer
from nanotron_recover.errors import InputError

if TYPE_CHECKING:
    from nanotron_recover.config import NanosetDatasetsArgs

# Mixed into the synthetic generator's seed so that a synthetic stream never coincides with
# the permutation streams of a Nanoset source that uses the same user seed.
_SYNTHETIC_DOMAIN = 0x5EED_5A17


@runtime_checkable
class MicroBatchSource(Protocol):
    """Anything that maps a micro-batch id to an int64 ``[micro_batch_size, sequence_length + 1]`` tensor.

    The trainer uses ``batch[:, :-1]`` as inputs and ``batch[:, 1:]`` as labels.
    """

    micro_batch_size: int
    sequence_length: int

    def get(self, microbatch_id: int) -> torch.Tensor: ...


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_positive(**values: int) -> None:
    # These come from the config: an InputError is reported as one line, like the config's own checks.
    for name, value in values.items():
        if not _is_int(value) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")


def _check_seed(seed: int) -> None:
    # SeedSequence only takes non-negative entropy; reject rather than silently remap.
    if not _is_int(seed) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")


def _check_id(microbatch_id: int) -> int:
    if not _is_int(microbatch_id):
        raise ValueError(f"microbatch_id must be an integer, got {microbatch_id!r}")
    if microbatch_id < 0:
        raise ValueError(f"microbatch_id must be >= 0, got {microbatch_id}")
    return int(microbatch_id)


class SyntheticMicroBatches:
    """Uniform pseudo-random tokens in ``[0, vocab_size)``, keyed by ``(seed, microbatch_id)``."""

    def __init__(self, vocab_size: int, micro_batch_size: int, sequence_length: int, seed: int) -> None:
        _check_positive(
            vocab_size=vocab_size, micro_batch_size=micro_batch_size, sequence_length=sequence_length
        )
        _check_seed(seed)
        self.vocab_size = int(vocab_size)
        self.micro_batch_size = int(micro_batch_size)
        self.sequence_length = int(sequence_length)
        self.seed = int(seed)

    def get(self, microbatch_id: int) -> torch.Tensor:
        m = _check_id(microbatch_id)
        # A fresh generator per id: no state survives between calls, so order cannot matter.
        rng = np.random.default_rng([_SYNTHETIC_DOMAIN, self.seed, m])
        shape = (self.micro_batch_size, self.sequence_length + 1)
        return torch.from_numpy(rng.integers(0, self.vocab_size, size=shape, dtype=np.int64))

    def __repr__(self) -> str:
        return (
            f"SyntheticMicroBatches(vocab_size={self.vocab_size}, micro_batch_size={self.micro_batch_size}, "
            f"sequence_length={self.sequence_length}, seed={self.seed})"
        )


def build_microbatch_source(
    dataset: NanosetDatasetsArgs | None,
    *,
    vocab_size: int,
    micro_batch_size: int,
    sequence_length: int,
    seed: int,
    first_id: int = 0,
    tokenizer_name_or_path: str | None = None,
) -> MicroBatchSource:
    """The source a data stage asks for: synthetic when ``dataset`` is None, else its Nanoset.

    ``first_id`` is the stage's first micro-batch id, where its data starts. Every check happens
    here, none at the first :meth:`~MicroBatchSource.get`, so a trainer that builds its sources at
    start-up refuses bad data before training, identically on every rank. Each failure is an
    :class:`~nanotron_recover.errors.InputError` whose message is one line naming the folder or
    setting to change:

    * a folder is missing, holds no ``*.ds`` files, or a file is truncated or lacks its index or
      metadata (:func:`~nanotron_recover.data.nanoset.summarize_nanoset`);
    * with ``tokenizer_name_or_path`` given (config ``validate_tokenizer: true``), a folder was
      tokenized with another tokenizer: compared by content, so any spelling of the same tokenizer
      passes (:func:`~nanotron_recover.data.tokenization.check_same_tokenizer`); ``tokenizer_name``,
      ``token_size_in_bytes`` or ``vocab_size`` of the config disagree with the folders;
    * a folder is too small for one sample, or the weights do not match the folders;
    * ``micro_batch_size``, ``sequence_length`` or ``vocab_size`` is not a positive integer, or
      ``seed`` is negative.
    """
    _check_positive(vocab_size=vocab_size, micro_batch_size=micro_batch_size, sequence_length=sequence_length)
    _check_seed(seed)
    if dataset is None:
        return SyntheticMicroBatches(vocab_size, micro_batch_size, sequence_length, seed)
    folders = [summarize_nanoset(path) for path in dataset.read_paths()]
    for folder in folders:
        where = f"dataset folder {str(folder.folder)!r}"
        if tokenizer_name_or_path is not None:
            check_same_tokenizer(
                folder.tokenizer,
                folder.tokenizer_fingerprint,
                tokenizer_name_or_path,
                where=where,
                setting="tokenizer.tokenizer_name_or_path",
                remedy=f"tokenize it again with `nanotron-recover preprocess --tokenizer {tokenizer_name_or_path}`, "
                "or set validate_tokenizer: false on the dataset",
            )
        if dataset.tokenizer_name is not None:
            check_same_tokenizer(
                folder.tokenizer,
                folder.tokenizer_fingerprint,
                dataset.tokenizer_name,
                where=where,
                setting="tokenizer_name",
                remedy="set tokenizer_name to the folder's tokenizer, or remove it",
            )
        if dataset.token_size_in_bytes is not None and dataset.token_size_in_bytes != folder.token_size:
            raise InputError(
                f"{where} stores {folder.token_size}-byte tokens, not token_size_in_bytes "
                f"{dataset.token_size_in_bytes}"
            )
    if dataset.vocab_size is not None and dataset.vocab_size > vocab_size:
        raise InputError(
            f"the dataset's vocab_size {dataset.vocab_size} exceeds model_config.vocab_size {vocab_size}"
        )
    return NanosetMicroBatches(
        folders,
        dataset.weights(),
        micro_batch_size=micro_batch_size,
        sequence_length=sequence_length,
        seed=seed,
        vocab_size=vocab_size,
        first_id=first_id,
    )
