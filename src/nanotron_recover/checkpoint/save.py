"""Saving: :func:`save_checkpoint`, collective over the default torch.distributed group.

A save involves every rank of the group (the whole world in plain mode, one replica's world in
fault-tolerant mode) and publishes a checkpoint only when every rank wrote all its files; otherwise
the save is abandoned and the previous checkpoint stays ``latest``, intact:

1. Rank 0 removes ``step_*.tmp`` leftovers of killed jobs and creates ``step_<s>.tmp``. The ranks
   agree on the outcome (an all-reduce, bounded by the process group timeout) and on a random
   ``save_id`` that names this save.
2. The tensors are staged in CPU memory, so training may change the model right after the call.
3. Every rank writes its files into ``step_<s>.tmp``; rank 0 also writes ``meta.json`` (``meta.py``)
   and the next value of ``latest``, so that publication needs no disk space.
4. Publication: rank 0 renames ``step_<s>.tmp`` to ``step_<s>`` and replaces ``latest`` atomically
   (``publish.py``).

Synchronous saves agree with an all-reduce after step 3 and after step 4 (``collective.py``): either
every rank returns the final path, or every rank raises the same error (the failing rank's message,
broadcast) and rank 0 has removed the tmp folder. Asynchronous saves run steps 3-4 in a background
thread and agree through files (``async_save.py``).

Only data-parallel rank 0 writes model and optimizer shards (replicas are identical); every rank
writes its RNG file. Every tensor of the model and the optimizer goes through safetensors, which
writes with the GIL released (``safetensors >= 0.8``: pinned in ``pyproject.toml``), so the rank's
failure watch and heartbeat threads (``ft/watch.py``) keep running during a save of any size;
``torch.save`` writes only the RNG states (:func:`_torch_save`), a few kilobytes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import Config
from ..models.llama import LlamaStage
from .async_save import PendingSave, _abandon, _async_write, _mark_failed
from .collective import _agree, _rank_world, _shared_failure
from .errors import CheckpointError, _guarded, _io_error
from .files import _discard, _remove, _write_text
from .meta import _meta
from .paths import NEXT_LATEST, _file
from .publish import _publish

DEFAULT_FINALIZE_TIMEOUT_S = 600.0


def save_checkpoint(
    root: str | Path,
    step: int,
    cfg: Config,
    stage: LlamaStage,
    optimizer_state: dict[str, dict[str, torch.Tensor]] | None,
    *,
    tp: int,
    pp: int,
    dp_rank: int,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
    finalize_timeout_s: float = DEFAULT_FINALIZE_TIMEOUT_S,
) -> Path | PendingSave:
    """Collective over the default torch.distributed group: every rank calls it with its own stage.

    Synchronous: returns the published path on every rank, or raises the same CheckpointError
    (CheckpointIOError for a refused write) on every rank, with ``latest`` untouched. Asynchronous:
    returns a ``PendingSave`` once the tensors are staged; the files are written by a background
    thread and rank 0 abandons the save when a rank fails or ``finalize_timeout_s`` passes. A caller
    must ``wait()`` for a pending save before starting the next one.
    """
    root = Path(root)
    rank, world = _rank_world()
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"

    failure: CheckpointError | None = None
    nonce = 0
    if rank == 0:
        nonce = secrets.randbits(62)
        try:
            if root.is_dir():
                for stale in root.glob("step_*.tmp"):  # left by a killed job, or a failed save
                    _remove(stale)
            if tmp.exists():  # could not be deleted: never reuse its markers or files
                _discard(tmp)
            tmp.mkdir(parents=True)
            for sub in ("model", "optimizer", "rng") + (("done", "failed") if asynchronous else ()):
                (tmp / sub).mkdir()
        except OSError as e:
            failure = _io_error(step, tmp, e)
            _discard(tmp)
    first, nonce = _agree(failure, nonce)
    if first is not None:
        raise _shared_failure(first, failure)

    pp_rank, tp_rank = stage.pp_rank, stage.tp_rank

    def stage_state() -> dict[Path, Callable[[], None]]:
        """Copy this rank's state to CPU memory; returns the writes to do, by file."""
        tensors: dict[str, torch.Tensor] = {}
        opt_tensors: dict[str, torch.Tensor] = {}
        if dp_rank == 0:
            params = dict(stage.named_parameters())
            for name, spec in stage.specs.items():
                if spec.is_tied_copy:
                    continue  # the embedding on the first stage is the saved copy
                tensors[spec.canonical_name] = params[name].detach().cpu().contiguous().clone()
                for key, value in (optimizer_state or {}).get(name, {}).items():
                    opt_tensors[f"{key}/{spec.canonical_name}"] = value.detach().cpu().contiguous().clone()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        writes: dict[Path, Callable[[], None]] = {}
        if tensors:
            f_model = tmp / _file("model", pp_rank, tp_rank)
            writes[f_model] = lambda: save_file(tensors, f_model)
        if opt_tensors:
            f_opt = tmp / _file("optimizer", pp_rank, tp_rank)
            writes[f_opt] = lambda: save_file(opt_tensors, f_opt)
        f_rng = tmp / "rng" / f"rank{rank}.pt"
        writes[f_rng] = lambda: _torch_save(rng, f_rng)
        if rank == 0:
            meta = _meta(cfg, step, tp, pp, world, optimizer_state is not None, extra, nonce)
            writes[tmp / "meta.json"] = lambda: _write_text(tmp / "meta.json", json.dumps(meta, indent=1))
            writes[tmp / NEXT_LATEST] = lambda: _write_text(tmp / NEXT_LATEST, final.name)
        return writes

    def write_all(writes: dict[Path, Callable[[], None]]) -> None:
        try:
            for path, write in writes.items():
                _guarded(step, path, write)
        except CheckpointError:
            for path in writes:  # free the space this rank took, so others can still report
                _remove(path)
            raise

    if asynchronous:
        pending = PendingSave(final, step)
        try:
            writes = stage_state()
        except Exception as e:  # e.g. out of memory: tell the others before giving up
            error = _io_error(step, tmp, e)
            if rank != 0:
                _mark_failed(tmp, rank, error)
            else:
                _abandon(root, tmp, step, nonce, error)
            if error is e:
                raise
            raise error from e
        pending._start(
            lambda: _async_write(
                root,
                tmp,
                final,
                step,
                rank,
                world,
                nonce,
                writes,
                write_all,
                finalize_timeout_s,
                cfg.checkpoints.keep_last,
                _named_by_config(cfg),
            )
        )
        return pending

    try:
        write_all(stage_state())
    except CheckpointError as e:
        failure = e
    except Exception as e:  # staging (e.g. out of memory): still agree, or the peers would hang
        failure = _io_error(step, tmp, e)
    first, _ = _agree(failure)
    if first is None and rank == 0:
        try:
            _publish(root, tmp, final, cfg.checkpoints.keep_last, _named_by_config(cfg))
        except OSError as e:
            failure = _io_error(step, final, e)
    first, _ = _agree(failure)
    if first is not None:
        if rank == 0:
            _discard(tmp)
        raise _shared_failure(first, failure)
    return final


def _named_by_config(cfg: Config) -> frozenset[Path]:
    """The checkpoints the config names, which a relaunch or a re-join reads again: never retired."""
    named = (cfg.checkpoints.resume_checkpoint_path, getattr(cfg.model.init_method, "path", None))
    return frozenset(Path(p).resolve() for p in named if p)


def _torch_save(obj: Any, path: Path) -> None:
    # Through a Python file object: torch.save on a path reports a full disk as an opaque
    # RuntimeError, a file object gives the OSError with its errno.
    with open(path, "wb") as f:
        torch.save(obj, f)
