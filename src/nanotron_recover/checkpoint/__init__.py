"""Layout-independent checkpoints: save on one tp/pp/dp layout, resume or evaluate on any other.

A checkpoints root holds::

    step_<s>/meta.json                          step, layout, config, run identity, where each tensor lives
    step_<s>/model/pp<p>-tp<t>.safetensors      this (pp, tp) rank's shards, by canonical name
    step_<s>/optimizer/pp<p>-tp<t>.safetensors  exp_avg/<name>, exp_avg_sq/<name>, master/<name>
    step_<s>/rng/rank<r>.pt                     torch RNG states (restored when the world matches)
    latest                                      name of the newest complete step folder

and, while a save is under way or after one failed, names ending in ``.tmp``, which are never a
checkpoint and which the next save removes::

    step_<s>.tmp/                       the save being written (with latest.next; done/ and failed/
                                        markers when asynchronous)
    step_<s>.old.tmp/                   the previous copy of a step saved again, while it is replaced
    step_<s>.discarded-<hex>.tmp/       a tmp folder being deleted
    step_<s>.failed.tmp                 why rank 0 abandoned an asynchronous save

Only data-parallel rank 0 writes model and optimizer shards (replicas are identical); every rank
writes its RNG file. Loading reassembles each full tensor from the saved shards and cuts this
rank's shard for the current layout, so tp, pp and dp may all differ from the saved run. The data
position and learning rate need no state of their own: both are pure functions of the step.

Saving is collective over the default torch.distributed group and publishes a checkpoint only when
every rank wrote all its files; otherwise the save is abandoned and the previous checkpoint stays
``latest``, intact. Errors are one line naming the file. A run resumes automatically only from its
own checkpoints, checked completely before any training state changes.

One concept per module, each importing only those above it:

=================  ================================================================================
``errors.py``      CheckpointError, CheckpointIOError, CheckpointTimeoutError; errors across ranks
``identity.py``    :func:`run_identity`, the hash of what defines a run's trajectory
``meta.py``        the format: ``meta.json`` built and checked, which pipeline stage saves a tensor
``paths.py``       names on disk; the step folder a root resumes from (``latest``, :func:`resolve`)
``files.py``       fsynced small files, removal, discarding a tmp folder
``collective.py``  how the ranks of a synchronous save agree (all-reduce, broadcast error)
``publish.py``     publication: every rename of a published path (``step_<s>``, ``latest``)
``async_save.py``  :class:`PendingSave` and the marker-file protocol of asynchronous saves
``save.py``        :func:`save_checkpoint`: prepare, stage, write, publish
``reader.py``      :class:`CheckpointReader`: verify and load a checkpoint of any layout
``resume.py``      :func:`find_resume_checkpoint`, :func:`resume_step` (its step, cheaply), the
                   learning-rate schedule's origin on resume
=================  ================================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_names import lazy_names

if TYPE_CHECKING:
    from .async_save import VERDICT_GRACE_S, PendingSave
    from .errors import CheckpointError, CheckpointIOError, CheckpointTimeoutError
    from .identity import IDENTITY_HEX_CHARS, run_identity
    from .meta import FORMAT_VERSION, canonical_stage, full_model_specs
    from .paths import LATEST, NEXT_LATEST, STEP_DIR, latest_step, resolve
    from .reader import CheckpointReader
    from .resume import (
        checkpoints_root,
        find_resume_checkpoint,
        lr_schedule_origin_at_start,
        resume_step,
        resumed_lr_schedule_origin,
    )
    from .save import DEFAULT_FINALIZE_TIMEOUT_S, save_checkpoint

# Imported on first use: most of these modules import torch, which a torch-free caller of one of them
# (the run's identity in ``snapshots clean``, ``checkpoint.paths`` in the supervisor) must not load.
_LAZY = {
    "VERDICT_GRACE_S": ".async_save",
    "PendingSave": ".async_save",
    "CheckpointError": ".errors",
    "CheckpointIOError": ".errors",
    "CheckpointTimeoutError": ".errors",
    "IDENTITY_HEX_CHARS": ".identity",
    "run_identity": ".identity",
    "FORMAT_VERSION": ".meta",
    "canonical_stage": ".meta",
    "full_model_specs": ".meta",
    "LATEST": ".paths",
    "NEXT_LATEST": ".paths",
    "STEP_DIR": ".paths",
    "latest_step": ".paths",
    "resolve": ".paths",
    "CheckpointReader": ".reader",
    "checkpoints_root": ".resume",
    "find_resume_checkpoint": ".resume",
    "lr_schedule_origin_at_start": ".resume",
    "resume_step": ".resume",
    "resumed_lr_schedule_origin": ".resume",
    "DEFAULT_FINALIZE_TIMEOUT_S": ".save",
    "save_checkpoint": ".save",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "DEFAULT_FINALIZE_TIMEOUT_S",
    "FORMAT_VERSION",
    "IDENTITY_HEX_CHARS",
    "LATEST",
    "NEXT_LATEST",
    "STEP_DIR",
    "VERDICT_GRACE_S",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointReader",
    "CheckpointTimeoutError",
    "PendingSave",
    "canonical_stage",
    "checkpoints_root",
    "find_resume_checkpoint",
    "full_model_specs",
    "latest_step",
    "lr_schedule_origin_at_start",
    "resolve",
    "resume_step",
    "resumed_lr_schedule_origin",
    "run_identity",
    "save_checkpoint",
]
