"""The run identity stamped into every checkpoint's ``meta.json``.

:func:`run_identity` is a short hash of what defines the run's trajectory; a run resumes
automatically only from checkpoints that carry its own (``resume.py``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..config import Config, to_dict

IDENTITY_HEX_CHARS = 16


# Data-stage fields that only change speed or sanity checks, not which tokens a step sees.
_DATA_KNOBS = frozenset(
    {
        "num_loading_workers",
        "dataset_processing_num_proc_per_process",
        "dataset_overwrite_cache",
        "validate_tokenizer",
        # A local copy of the same folders, and fields that only restate the folders' metadata
        # or change nothing here: the samples are the same.
        "dataset_read_path",
        "return_positions",
        "tokenizer_name",
        "vocab_size",
        "token_size_in_bytes",
    }
)


def _canonical(value: Any, drop: frozenset[str] = frozenset()) -> Any:
    """JSON-ready, with every number a float so that ``lr: 1`` and ``lr: 1.0`` hash the same."""
    if isinstance(value, dict):
        return {str(k): _canonical(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, drop) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value) if abs(value) < 2**53 else str(value)
    return str(value)


def run_identity(cfg: Config) -> str:
    """A short hash of the config fields that define the run's trajectory.

    Included: the model (architecture, dtype, init), the optimizer and its schedule, sequence length,
    micro-batch size, the micro-batches per step ``B`` (not dp and the accumulation separately: a
    resume on another layout keeping ``B`` is the same run), data stages, tokenizer and seed.
    Excluded: everything a resume may change (parallelism, train_steps, checkpoints, logging,
    recover, names, profiling) and data-loading knobs.
    """
    fields = {
        "model": {
            "model_config": to_dict(cfg.model.model_config),
            "dtype": cfg.model.dtype,
            "init_method": to_dict(cfg.model.init_method),
        },
        "optimizer": to_dict(cfg.optimizer),
        "sequence_length": cfg.tokens.sequence_length,
        "micro_batch_size": cfg.tokens.micro_batch_size,
        "microbatches_per_step": cfg.microbatches_per_step,
        "data_stages": _canonical(to_dict(cfg.data_stages), _DATA_KNOBS),
        "tokenizer": to_dict(cfg.tokenizer),
        "seed": cfg.general.seed,
    }
    blob = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:IDENTITY_HEX_CHARS]
