"""Micro-batch id -> token tensor, as a pure function.

This is the data half of the project's determinism guarantee. The trainer never iterates a
data loader; it asks "give me micro-batch ``m``" on whichever rank or replica happens to
compute it (after a fault, a different replica may recompute someone else's micro-batch).
The answer therefore depends only on ``(m, seed, corpus or vocab, micro_batch_size,
sequence_length)`` -- never on call order, on which ids were asked before, on the process,
or on any hidden RNG state -- and is bit-identical everywhere and every time.

Corpus-backed sources lay micro-batches over an endless stream of *sample slots*: row ``j``
of micro-batch ``m`` is slot ``k = m * micro_batch_size + j``. Slot ``k`` belongs to epoch
``e = k // N`` (``N`` = samples in the corpus) at position ``k % N``, and reads sample
``perm_e[k % N]`` where ``perm_e`` is a permutation of ``range(N)`` drawn from a generator
seeded by ``(seed, e)``. Every sample is thus used exactly once per epoch, each epoch is
shuffled differently, and any slot can be computed without computing the ones before it.
Permutations are cached (a couple of epochs, since consecutive ids straddle at most one
epoch boundary); the cache only saves time, it never changes an answer.

Synthetic sources (config ``dataset: null``) draw uniform tokens from a generator seeded by
``(seed, m)``, for benchmarks and tests that need no corpus.

Both use numpy's ``SeedSequence``-seeded PCG64 generators, whose streams are specified and
platform-independent for a given numpy version (all ranks of a job share one environment).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from nanotron_recover.data.corpus import TokenCorpus, validate_corpus
from nanotron_recover.errors import InputError

# Mixed into the synthetic generator's seed so that a synthetic stream never coincides with
# the permutation stream of a corpus source that uses the same user seed.
_SYNTHETIC_DOMAIN = 0x5EED_5A17
# Keep this many epoch permutations; two covers the id ranges that straddle an epoch boundary.
_PERMUTATION_CACHE_EPOCHS = 2


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


class CorpusMicroBatches:
    """Micro-batches of shuffled corpus samples, epoch after epoch (see module docstring)."""

    def __init__(self, corpus: TokenCorpus, micro_batch_size: int, sequence_length: int, seed: int) -> None:
        _check_positive(micro_batch_size=micro_batch_size, sequence_length=sequence_length)
        _check_seed(seed)
        self.corpus = corpus
        self.micro_batch_size = int(micro_batch_size)
        self.sequence_length = int(sequence_length)
        self.seed = int(seed)
        self.num_samples = corpus.require_samples(self.sequence_length)
        self._permutations: OrderedDict[int, np.ndarray] = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (a permutation of ``range(num_samples)``), cached."""
        perm = self._permutations.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            perm.flags.writeable = False  # callers share the cached array
            self._permutations[epoch] = perm
            while len(self._permutations) > _PERMUTATION_CACHE_EPOCHS:
                self._permutations.popitem(last=False)
        else:
            self._permutations.move_to_end(epoch)
        return perm

    def sample_indices(self, microbatch_id: int) -> list[int]:
        """Corpus sample index of each row of micro-batch ``microbatch_id``."""
        m = _check_id(microbatch_id)
        first = m * self.micro_batch_size
        out = []
        for k in range(first, first + self.micro_batch_size):
            epoch, pos = divmod(k, self.num_samples)
            out.append(int(self.permutation(epoch)[pos]))
        return out

    def get(self, microbatch_id: int) -> torch.Tensor:
        rows = [self.corpus.sample(i, self.sequence_length) for i in self.sample_indices(microbatch_id)]
        return torch.from_numpy(np.stack(rows))

    def __repr__(self) -> str:
        return (
            f"CorpusMicroBatches({self.corpus!r}, micro_batch_size={self.micro_batch_size}, "
            f"sequence_length={self.sequence_length}, seed={self.seed})"
        )


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
    dataset_folder: str | Path | None,
    *,
    vocab_size: int,
    micro_batch_size: int,
    sequence_length: int,
    seed: int,
    tokenizer_name_or_path: str | None = None,
) -> MicroBatchSource:
    """The source the config asks for: synthetic when ``dataset_folder`` is None, else the corpus there.

    Every check happens here, none at the first :meth:`~MicroBatchSource.get`, so a trainer that
    builds its sources at start-up refuses bad data before training, identically on every rank.
    Each failure is an :class:`~nanotron_recover.errors.InputError` whose message is one line
    naming the file or the setting to change:

    * the corpus folder or one of its files is missing (also a ``FileNotFoundError``), or the
      index is unreadable, not JSON, misses keys, or is incomplete (:meth:`TokenCorpus.open`);
    * ``tokens.bin`` is truncated: not a whole number of tokens, or not the index's token count;
    * the corpus vocabulary exceeds ``vocab_size``, or, when ``tokenizer_name_or_path`` is given
      (config ``validate_tokenizer: true``), the corpus was made with another tokenizer
      (:func:`~nanotron_recover.data.corpus.validate_corpus`);
    * the corpus is too small for one sample of ``sequence_length + 1`` tokens;
    * ``micro_batch_size``, ``sequence_length`` or ``vocab_size`` is not a positive integer, or
      ``seed`` is negative.
    """
    if dataset_folder is None:
        return SyntheticMicroBatches(vocab_size, micro_batch_size, sequence_length, seed)
    _check_positive(vocab_size=vocab_size, micro_batch_size=micro_batch_size, sequence_length=sequence_length)
    _check_seed(seed)
    corpus = TokenCorpus.open(dataset_folder)
    validate_corpus(corpus, tokenizer_name_or_path=tokenizer_name_or_path, vocab_size=vocab_size)
    # The constructor checks that the corpus holds at least one sample.
    return CorpusMicroBatches(corpus, micro_batch_size, sequence_length, seed)
