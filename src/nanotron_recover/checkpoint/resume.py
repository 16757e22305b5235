"""Resuming: the checkpoint a starting run resumes from, and where its learning-rate schedule counts from.

:func:`find_resume_checkpoint` resumes a run automatically only from its own checkpoints (stamped
with its run identity, ``identity.py``; another run's only when named in
``checkpoints.resume_checkpoint_path``), and checks the whole checkpoint
(:meth:`CheckpointReader.verify`) before any training state changes. The data position and the
learning rate need no saved state of their own: both are functions of the step and of the
schedule's origin, which ``meta.json`` records.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from .errors import CheckpointError
from .identity import run_identity
from .paths import _find_step_dir, latest_step
from .reader import CheckpointReader


def resumed_lr_schedule_origin(cfg: Config, reader: CheckpointReader) -> int:
    """The optimizer step the learning-rate schedule counts from once ``reader`` is resumed.

    The rate of step ``s`` is ``lr_at(s - 1 - origin)``. A checkpoint records the origin of the run
    that saved it (0 for a schedule never restarted, or for checkpoints from before it was
    recorded), and resuming continues it -- except from a checkpoint named in
    ``checkpoints.resume_checkpoint_path`` with ``checkpoints.load_lr_scheduler: false``: then, as
    Nanotron builds a fresh scheduler, the schedule starts over (warm-up again) at its step. Resuming
    this run's own checkpoints (an automatic resume, a relaunch) therefore continues the restarted
    schedule, which every later checkpoint records.
    """
    ck = cfg.checkpoints
    if ck.resume_checkpoint_path is not None and not ck.load_lr_scheduler:
        return reader.step
    return int(reader.meta.get("lr_schedule_origin", 0))


def lr_schedule_origin_at_start(cfg: Config, checkpoints_path: str | Path) -> int:
    """The origin :func:`resumed_lr_schedule_origin` gives the checkpoint a starting run would
    resume (0 when there is none), reading only its ``meta.json``: for a process spawned into a
    running job (re-join), which takes its state from a replica but needs the same schedule. Every
    checkpoint the job saved records the origin, so its latest one gives it."""
    explicit = cfg.checkpoints.resume_checkpoint_path
    if explicit is not None:
        return resumed_lr_schedule_origin(cfg, CheckpointReader(explicit))
    step_dir = _find_step_dir(Path(checkpoints_path))
    return 0 if step_dir is None else resumed_lr_schedule_origin(cfg, CheckpointReader(step_dir))


def find_resume_checkpoint(
    cfg: Config, checkpoints_path: str | Path, *, rank: int | None = None
) -> CheckpointReader | None:
    """The checkpoint a starting run resumes from, checked completely, or None to start fresh.

    ``checkpoints.resume_checkpoint_path`` when set (explicit: another run's checkpoint is allowed,
    a different model shape is not); otherwise this run's own ``checkpoints_path``, whose checkpoint
    must carry this config's :func:`run_identity`. Every check (identity, model shape, optimizer
    state when it is to be loaded, every shard, ``rank``'s RNG file) runs before any training state
    changes, and gives the same one-line CheckpointError on every rank.
    """
    explicit = cfg.checkpoints.resume_checkpoint_path
    if explicit is not None:
        reader = CheckpointReader(explicit)
    else:
        root = Path(checkpoints_path)
        step_dir = _find_step_dir(root)
        if step_dir is None:
            return None
        reader = CheckpointReader(step_dir)
        saved, this = reader.run_identity, run_identity(cfg)
        if saved != this:
            raise CheckpointError(
                f"{reader.path}: checkpoint belongs to another run (identity {saved or 'unrecorded'} != "
                f"{this}); use another checkpoints_path, or name it in checkpoints.resume_checkpoint_path "
                "to resume it anyway"
            )
    reader.check_model(cfg.model.model_config)
    if cfg.checkpoints.load_optimizer:
        reader.check_optimizer()
    reader.verify(rank)
    return reader


def checkpoints_root(cfg: Config, run_dir: str | Path) -> Path:
    """Where a run's checkpoints go: ``checkpoints.checkpoints_path``, else ``<run_dir>/checkpoints``."""
    path = cfg.checkpoints.checkpoints_path
    return Path(path) if path else Path(run_dir) / "checkpoints"


def resume_step(cfg: Config, checkpoints_path: str | Path) -> int | None:
    """The step :func:`find_resume_checkpoint` would resume from, read from ``latest`` and one
    ``meta.json`` only (nothing is checked or loaded); None without a checkpoint, or when it cannot
    be read (the full check reports why, if the run falls back to it)."""
    explicit = cfg.checkpoints.resume_checkpoint_path
    try:
        return latest_step(explicit if explicit is not None else checkpoints_path)
    except (CheckpointError, OSError):
        return None
