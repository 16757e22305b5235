"""Layout-independent checkpoints: save on one tp/pp/dp layout, resume or evaluate on any other.

A checkpoint is a folder::

    step_<s>/meta.json                      step, layout, config, run identity, where each tensor lives
    step_<s>/model/pp<p>-tp<t>.safetensors      this (pp, tp) rank's shards, by canonical name
    step_<s>/optimizer/pp<p>-tp<t>.safetensors  exp_avg/<name>, exp_avg_sq/<name>, master/<name>
    step_<s>/rng/rank<r>.pt                     torch RNG states (restored when the world matches)
    latest                                      name of the newest complete step folder

Only data-parallel rank 0 writes model and optimizer shards (replicas are identical); every rank
writes its RNG file. Every tensor of the model and the optimizer goes through safetensors, which
writes with the GIL released (``safetensors >= 0.8``: pinned in ``pyproject.toml``), so the rank's
failure watch and heartbeat threads (``ft/watch.py``) keep running during a save of any size;
``torch.save`` writes only the RNG states, a few kilobytes. Loading reassembles each full tensor from the saved shards
(``ParamSpec.shard_dim``) and cuts this rank's shard for the current layout, so tp, pp and dp may
all differ from the saved run. The data position and learning rate need no state of their own:
both are pure functions of the step.

Saving is collective over the default torch.distributed group (the whole world in plain mode, one
replica's world in fault-tolerant mode) and publishes a checkpoint only when every rank wrote all
its files; otherwise the save is abandoned and the previous checkpoint stays ``latest``, intact:

1. Rank 0 removes ``step_*.tmp`` leftovers of killed jobs and creates ``step_<s>.tmp``. The ranks
   agree on the outcome (an all-reduce, bounded by the process group timeout) and on a random
   ``save_id`` that names this save.
2. The tensors are staged in CPU memory, so training may change the model right after the call.
3. Every rank writes its files into ``step_<s>.tmp``; rank 0 also writes ``meta.json`` and the next
   value of ``latest``, so that publication needs no disk space.
4. Publication: rank 0 renames ``step_<s>.tmp`` to ``step_<s>`` and replaces ``latest`` atomically.

Synchronous saves agree with an all-reduce after step 3 and after step 4: either every rank returns
the final path, or every rank raises the same error (the failing rank's message, broadcast) and rank
0 has removed the tmp folder. Asynchronous saves run steps 3-4 in a background thread, where no
collective may run, so the ranks talk through files instead: each rank drops ``done/rank<r>`` on
success or ``failed/rank<r>`` (one JSON line: the error and its message) on failure. Rank 0 waits
for every marker until ``finalize_timeout_s``, gives up as soon as a ``failed/`` marker appears, and
on failure or deadline removes the tmp folder and records the reason in ``step_<s>.failed.tmp``
(keyed by ``save_id``); the other ranks wait for rank 0's verdict (the published ``meta.json``
carrying their ``save_id``, or that file), so a ``PendingSave`` ends the same way on every rank.
A tmp folder is discarded by renaming it first (to ``step_<s>.discarded-<hex>.tmp``), so a rank
still writing into it fails at once instead of recreating files in a folder about to be deleted.

Errors are one line: :class:`CheckpointIOError` for the operating system refusing a write (full
disk, permissions, read-only file system), naming the file and the reason; :class:`CheckpointError`
for everything else, including damaged checkpoints found when reading (corrupt ``meta.json``,
truncated shards, a ``latest`` naming a missing folder).

Each checkpoint is stamped with the :func:`run_identity` of its config: a hash of what defines the
run's trajectory. :func:`find_resume_checkpoint` resumes a run automatically only from its own
checkpoints, and checks the whole checkpoint (:meth:`CheckpointReader.verify`) before any training
state changes.
"""

from __future__ import annotations

import errno as errno_codes
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import Config, LlamaConfig, dump_config, to_dict
from ..models.llama import LlamaStage, stage_layers
from ..parallel.sharding import ParamSpec, shard, unshard

FORMAT_VERSION = 1
DEFAULT_FINALIZE_TIMEOUT_S = 600.0
IDENTITY_HEX_CHARS = 16
LATEST = "latest"
# The next value of ``latest``, written into the tmp folder with the shards and moved out when the
# checkpoint is published, so publication is renames only and cannot run out of space.
NEXT_LATEST = "latest.next"
STEP_DIR = re.compile(r"step_(\d+)")
# After rank 0's tmp folder disappears, how long the other ranks of an asynchronous save look for
# the verdict it writes right after (published meta.json or the failure file).
VERDICT_GRACE_S = 5.0


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or read; the message is one line naming the file."""


class CheckpointIOError(CheckpointError):
    """The operating system refused a checkpoint write (ENOSPC, EACCES, EROFS, ...)."""

    def __init__(self, message: str, path: str | Path | None = None, errno: int | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.errno = errno


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """``PendingSave.wait(timeout_s)`` ran out of time; the save goes on in the background."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# -- run identity ----------------------------------------------------------------------------------

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


# -- layout --------------------------------------------------------------------------------------


def canonical_stage(name: str, cfg: LlamaConfig, pp: int) -> int:
    """Pipeline stage that saves the tensor ``name`` in a layout with ``pp`` stages."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(p for p in range(pp) if layer in stage_layers(cfg.num_hidden_layers, pp, p))
    return pp - 1  # final norm and output head


def full_model_specs(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    """Specs of every canonical tensor of the model, independent of layout."""
    return LlamaStage(cfg, device="meta").specs


def _file(kind: str, pp_rank: int, tp_rank: int) -> str:
    return f"{kind}/pp{pp_rank}-tp{tp_rank}.safetensors"


# -- finding checkpoints -------------------------------------------------------------------------


def _read_meta(step_dir: Path) -> dict[str, Any]:
    """``meta.json`` of a step folder, or a one-line CheckpointError naming it."""
    f = step_dir / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: corrupt or truncated JSON ({_one_line(e)})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({_one_line(e)})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: corrupt (not a JSON object)")
    problem = None
    try:
        if not isinstance(meta["tensors"], dict) or not isinstance(meta["model_config"], dict):
            problem = "tensors or model_config is not an object"
        for value in (meta["step"], meta["layout"]["tp"], meta["layout"]["pp"]):
            if not isinstance(value, int):
                problem = f"{value!r} where a step, tp or pp number belongs"
    except (KeyError, TypeError) as e:
        problem = f"bad or missing {_one_line(e)}"
    if problem is not None:
        raise CheckpointError(f"{f}: incomplete or corrupt ({problem})")
    return meta


def _find_step_dir(root: Path) -> Path | None:
    """The step folder a checkpoints root resumes from: the one ``latest`` names, or (no ``latest``:
    a job killed between the two renames of its first save) the newest complete ``step_<s>``.
    None when the root holds no checkpoint; a ``latest`` naming a missing or incomplete folder is
    an error, never "no checkpoint" (which would silently restart the run from scratch)."""
    latest = root / LATEST
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{latest}: unreadable ({_one_line(e)})") from e
        if not STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{latest}: corrupt (names {name[:40]!r}, not a step folder)")
        step_dir = root / name
        if not step_dir.is_dir():
            raise CheckpointError(f"{latest}: names {name}, which does not exist")
        if not (step_dir / "meta.json").is_file():
            raise CheckpointError(f"{latest}: names {name}, which is incomplete (no meta.json)")
        return step_dir
    if not root.is_dir():
        return None
    complete = [
        d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and (d / "meta.json").is_file()
    ]  # a step_<s>.tmp never matches: it is an unfinished save
    return max(complete, key=lambda d: int(d.name.split("_")[1]), default=None)


def resolve(path: str | Path) -> Path:
    """A step folder, or a checkpoints root whose ``latest`` (or newest complete step) names one."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        raise CheckpointError(f"{path}: an unfinished save, not a checkpoint")
    if (path / "meta.json").is_file():
        return path
    found = _find_step_dir(path)
    if found is None:
        raise CheckpointError(
            f"no checkpoint at {str(path)!r}: expected a step folder with meta.json or a 'latest' file"
        )
    return found


def latest_step(root: str | Path) -> int | None:
    """Step of the checkpoint ``root`` would resume from; None when it holds none.

    Raises CheckpointError when ``latest`` names a missing folder or ``meta.json`` is damaged."""
    root = Path(root)
    step_dir = root if (root / "meta.json").is_file() else _find_step_dir(root)
    return None if step_dir is None else int(_read_meta(step_dir)["step"])


# -- saving ----------------------------------------------------------------------------------


def _io_error(step: int, path: Path, e: BaseException) -> CheckpointError:
    """One-line error for a failed write of ``path``: CheckpointIOError when the OS refused it."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        # safetensors reports OS errors as SafetensorError("... (os error 28)").
        match = re.search(r"os error (\d+)", str(e))
        code = int(match.group(1)) if match else None
    if code is not None:
        where = getattr(e, "filename", None) or path
        reason = os.strerror(code) if code in errno_codes.errorcode else _one_line(e)
        return CheckpointIOError(f"checkpoint step {step} not saved: {where}: {reason}", where, code)
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(f"checkpoint step {step} not saved: {path}: {type(e).__name__}: {_one_line(e)}")


def _guarded(step: int, path: Path, write: Callable[[], None]) -> None:
    try:
        write()
    except CheckpointError:
        raise
    except Exception as e:
        raise _io_error(step, path, e) from e


def _write_text(path: Path, text: str) -> None:
    # fsync: these small files decide what is published; a crash must not leave them empty.
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _error_record(error: CheckpointError) -> dict[str, Any]:
    io = isinstance(error, CheckpointIOError)
    return {
        "error": type(error).__name__,
        "message": str(error),
        "path": error.path if io else None,
        "errno": error.errno if io else None,
    }


def _error_from_record(record: dict[str, Any]) -> CheckpointError:
    if record.get("error") == CheckpointIOError.__name__:
        return CheckpointIOError(record["message"], record.get("path"), record.get("errno"))
    return CheckpointError(record["message"])


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(failure: CheckpointError | None, nonce: int = 0) -> tuple[int | None, int]:
    """All-reduce (MIN) over the default group: the lowest failing rank (None if none failed) and
    rank 0's ``nonce``. Doubles as a barrier, bounded by the process group's timeout."""
    rank, world = _rank_world()
    if world == 1:
        return (0 if failure is not None else None), nonce
    never = torch.iinfo(torch.int64).max
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor(
        [rank if failure is not None else world, nonce if rank == 0 else never],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    first, agreed_nonce = (int(x) for x in flags.tolist())
    return (first if first < world else None), agreed_nonce


def _shared_failure(first: int, own: CheckpointError | None) -> CheckpointError:
    """The error of the lowest failing rank, on every rank (broadcast from it), so all raise alike."""
    rank, world = _rank_world()
    if world == 1 and own is not None:
        return own
    payload = [_error_record(own) if rank == first and own is not None else None]
    dist.broadcast_object_list(payload, src=first)
    if rank == first and own is not None:
        return own
    return _error_from_record(payload[0])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def _discard(folder: Path) -> None:
    """Delete a ``.tmp`` folder other ranks may still be writing into. It is renamed away first:
    atomic, so their next write fails at once and they see it gone; what a write already under way
    leaves in the renamed folder keeps a ``.tmp`` name, which the next save sweeps."""
    trash = folder.with_name(f"{folder.name.removesuffix('.tmp')}.discarded-{secrets.token_hex(4)}.tmp")
    try:
        os.replace(folder, trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def _verdict_file(root: Path, step: int) -> Path:
    return root / f"step_{step}.failed.tmp"  # a .tmp name: the next save cleans it up


class PendingSave:
    """An asynchronous save in flight: its tensors are staged in CPU memory and a thread writes them.

    Every rank's ``PendingSave`` ends the same way: with the published path, or with the save's
    error (kept, and raised by every ``wait``/``poll`` after the failure)."""

    def __init__(self, path: Path, step: int):
        self.path, self.step = path, step
        self._finished = threading.Event()
        self._error: CheckpointError | None = None
        self._thread: threading.Thread | None = None

    def _start(self, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except CheckpointError as e:
                self._error = e
            except BaseException as e:  # kept for wait(), not lost with the thread
                self._error = CheckpointError(
                    f"checkpoint step {self.step} not saved: {type(e).__name__}: {_one_line(e)}"
                )
                self._error.__cause__ = e
            finally:
                self._finished.set()

        self._thread = threading.Thread(target=run, name=f"checkpoint-step{self.step}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """True once the save is published or abandoned."""
        return self._finished.is_set()

    @property
    def error(self) -> CheckpointError | None:
        """The save's error once it failed; None while in flight or after success."""
        return self._error if self.done else None

    def poll(self) -> Path | None:
        """Non-blocking: None while in flight, the path once published; raises the save's error."""
        if not self.done:
            return None
        if self._error is not None:
            raise self._error
        return self.path

    def wait(self, timeout_s: float | None = None) -> Path:
        """The published path; raises the save's error, or CheckpointTimeoutError after
        ``timeout_s`` (the save goes on: wait again or abandon the process)."""
        if not self._finished.wait(timeout_s):
            raise CheckpointTimeoutError(
                f"checkpoint step {self.step}: still being written after {timeout_s:.0f}s ({self.path})"
            )
        if self._error is not None:
            raise self._error
        return self.path


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
                root, tmp, final, step, rank, world, nonce, writes, write_all, finalize_timeout_s
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
            _publish(root, tmp, final)
        except OSError as e:
            failure = _io_error(step, final, e)
    first, _ = _agree(failure)
    if first is not None:
        if rank == 0:
            _discard(tmp)
        raise _shared_failure(first, failure)
    return final


def _torch_save(obj: Any, path: Path) -> None:
    # Through a Python file object: torch.save on a path reports a full disk as an opaque
    # RuntimeError, a file object gives the OSError with its errno.
    with open(path, "wb") as f:
        torch.save(obj, f)


def _mark_failed(tmp: Path, rank: int, error: CheckpointError) -> None:
    """Tell rank 0 this rank failed (``failed/rank<r>``, one JSON line), atomically and best effort."""
    part = tmp / "failed" / f".rank{rank}.part"
    try:
        part.write_text(json.dumps(_error_record(error)) + "\n")
        os.replace(part, tmp / "failed" / f"rank{rank}")
    except OSError:
        try:  # a full disk may refuse even these bytes; an empty marker still stops rank 0's wait
            (tmp / "failed" / f"rank{rank}").touch()
        except OSError:
            pass  # rank 0 gives up at its deadline instead


def _read_failed(tmp: Path, step: int) -> CheckpointError | None:
    """The error of the lowest rank that dropped a ``failed/`` marker, if any did."""
    try:
        names = [p.name for p in (tmp / "failed").iterdir() if re.fullmatch(r"rank\d+", p.name)]
    except OSError:
        return None
    if not names:
        return None
    name = min(names, key=lambda n: int(n[4:]))
    try:
        return _error_from_record(json.loads((tmp / "failed" / name).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return CheckpointError(f"checkpoint step {step} not saved: {name} failed to write its files")


def _abandon(root: Path, tmp: Path, step: int, nonce: int, error: CheckpointError) -> None:
    """Rank 0 of an asynchronous save: drop the tmp folder, then leave the verdict for the others
    (after the removal, which frees the space the verdict needs on a full disk)."""
    _discard(tmp)
    if _rank_world()[1] == 1:
        return  # nobody waits for a verdict
    verdict = _verdict_file(root, step)
    try:
        part = verdict.with_name(verdict.name + ".part")
        part.write_text(json.dumps({"save_id": nonce, **_error_record(error)}) + "\n")
        os.replace(part, verdict)
    except OSError:
        pass  # the other ranks then report that the save was abandoned, without the reason


def _async_write(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    rank: int,
    world: int,
    nonce: int,
    writes: dict[Path, Callable[[], None]],
    write_all: Callable[[dict[Path, Callable[[], None]]], None],
    timeout_s: float,
) -> None:
    """The background part of an asynchronous save, on one rank (no collectives: files only)."""
    start = time.monotonic()
    try:
        write_all(writes)
        if rank != 0:
            marker = tmp / "done" / f"rank{rank}"
            _guarded(step, marker, marker.touch)
    except CheckpointError as error:
        if rank == 0:
            _abandon(root, tmp, step, nonce, error)
            raise
        if not tmp.is_dir():  # rank 0 abandoned under us: its reason is the real one
            verdict = _wait_verdict(root, tmp, final, step, nonce, time.monotonic() + VERDICT_GRACE_S)
            if verdict is not None:
                raise verdict from error
            raise
        _mark_failed(tmp, rank, error)
        raise
    if rank == 0:
        _finalize(root, tmp, final, step, world, nonce, timeout_s, start)
        return
    outcome = _wait_verdict(
        root, tmp, final, step, nonce, start + timeout_s + VERDICT_GRACE_S + 0.05 * timeout_s
    )
    if outcome is None:
        return
    raise outcome


def _finalize(
    root: Path, tmp: Path, final: Path, step: int, world: int, nonce: int, timeout_s: float, start: float
) -> None:
    """Rank 0 of an asynchronous save: publish once every rank is done; abandon at the first
    ``failed/`` marker or at the deadline."""
    deadline = start + timeout_s
    pause = 0.005
    while True:
        error = _read_failed(tmp, step)
        if error is not None:
            _abandon(root, tmp, step, nonce, error)
            raise error
        try:
            done = {p.name for p in (tmp / "done").iterdir()}
        except OSError as e:
            error = _io_error(step, tmp / "done", e)
            _abandon(root, tmp, step, nonce, error)
            raise error from e
        missing = [r for r in range(1, world) if f"rank{r}" not in done]
        # Past the deadline even with every marker in (rank 0's own writes were the slow ones): the
        # other ranks stop waiting for a verdict soon after it, so publishing now could contradict
        # the failure they report.
        if time.monotonic() > deadline:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            who = f"rank(s) {shown}" if missing else "rank 0"
            error = CheckpointError(
                f"checkpoint step {step} not saved: {who} did not finish writing {tmp} within {timeout_s:g}s"
            )
            _abandon(root, tmp, step, nonce, error)
            raise error
        if not missing:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    try:
        shutil.rmtree(tmp / "done")
        (tmp / "failed").rmdir()
        _publish(root, tmp, final)
    except OSError as e:
        error = _io_error(step, final, e)
        _abandon(root, tmp, step, nonce, error)
        raise error from e


def _wait_verdict(
    root: Path, tmp: Path, final: Path, step: int, nonce: int, deadline: float
) -> CheckpointError | None:
    """A rank other than 0: None once rank 0 published this save (``final/meta.json`` carries its
    ``save_id``), else the error rank 0 recorded, or one saying it was abandoned."""
    vanished: float | None = None
    pause = 0.005
    while True:
        if not tmp.is_dir():
            # os.replace(tmp, final) is atomic: once tmp is gone, final holds this save or rank 0
            # gave up and writes the verdict right after removing tmp.
            try:
                if json.loads((final / "meta.json").read_text()).get("save_id") == nonce:
                    return None
            except (OSError, ValueError):
                pass
            try:
                record = json.loads(_verdict_file(root, step).read_text())
                if record.get("save_id") == nonce:
                    return _error_from_record(record)
            except (OSError, ValueError, KeyError):
                pass
            vanished = time.monotonic() if vanished is None else vanished
            if time.monotonic() > vanished + VERDICT_GRACE_S:
                return CheckpointError(f"checkpoint step {step} not saved: abandoned by rank 0 ({tmp})")
        if time.monotonic() > deadline:
            return CheckpointError(
                f"checkpoint step {step} not saved: no outcome from rank 0 for {tmp} in time"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rank 0, every rank's files written: make ``final`` the checkpoint ``latest`` names. Renames
    only; a job killed in between leaves ``latest`` naming the previous (intact) checkpoint."""
    old = None
    if final.exists():  # the same step saved again (e.g. after a resume): keep it until replaced
        old = root / f"{final.name}.old.tmp"
        _remove(old)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
        try:
            os.replace(final / NEXT_LATEST, root / LATEST)
        except OSError:
            os.replace(final, tmp)  # not published after all: the caller discards it
            raise
    except OSError:
        if old is not None:  # put the previous copy back: ``latest`` may name it
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _meta(
    cfg: Config,
    step: int,
    tp: int,
    pp: int,
    world: int,
    has_optimizer: bool,
    extra: dict | None,
    save_id: int,
) -> dict:
    mcfg = cfg.model.model_config
    specs = full_model_specs(mcfg)
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": {"tp": tp, "pp": pp, "dp": cfg.parallelism.dp},
        "world_size": world,
        "dtype": cfg.model.dtype,
        "has_optimizer": has_optimizer,
        "run_identity": run_identity(cfg),
        "save_id": save_id,
        "model_config": asdict(mcfg),
        "tensors": {
            name: {
                "full_shape": list(spec.full_shape),
                "shard_dim": spec.shard_dim,
                "stage": canonical_stage(name, mcfg, pp),
            }
            for name, spec in specs.items()
        },
        "config_yaml": dump_config(cfg),
        # The step the learning-rate schedule counts from (see resumed_lr_schedule_origin).
        "lr_schedule_origin": cfg.lr_schedule_origin,
        **(extra or {}),
    }


# -- reading ---------------------------------------------------------------------------------


class CheckpointReader:
    """Reassembles full canonical tensors from a checkpoint saved with any layout."""

    def __init__(self, path: str | Path):
        self.path = resolve(path)
        self.meta = _read_meta(self.path)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: unsupported checkpoint format {self.meta.get('format_version')}"
            )
        self.saved_tp = int(self.meta["layout"]["tp"])
        self.saved_pp = int(self.meta["layout"]["pp"])

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def run_identity(self) -> str | None:
        """The saving run's :func:`run_identity`; None for checkpoints from before it was recorded."""
        return self.meta.get("run_identity")

    def _optimizer_keys(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["master"] if self.meta.get("dtype") != "float32" else [])

    def verify(self, rank: int | None = None) -> None:
        """Check the whole checkpoint without loading tensors: every shard file the saved layout
        implies opens, holds every expected entry with its expected shape (a truncated or corrupt
        file fails here), and this ``rank``'s RNG file, when present, loads."""
        expected: dict[str, dict[str, list[int]]] = {}
        for name, info in self.meta["tensors"].items():
            try:
                shape = [int(n) for n in info["full_shape"]]
                dim, stage = info["shard_dim"], int(info["stage"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.path / 'meta.json'}: corrupt entry for {name}") from e
            if dim is not None:
                shape[dim] //= self.saved_tp
            kinds = {"model": [None]}
            if self.meta.get("has_optimizer"):
                kinds["optimizer"] = self._optimizer_keys()
            for kind, keys in kinds.items():
                for t in range(self.saved_tp):
                    entries = expected.setdefault(_file(kind, stage, t), {})
                    for key in keys:
                        entries[name if key is None else f"{key}/{name}"] = shape
        for rel, entries in sorted(expected.items()):
            f = self.path / rel
            if not f.is_file():
                raise CheckpointError(f"{self.path}: missing {rel}")
            try:
                with safe_open(f, framework="pt") as handle:
                    stored = set(handle.keys())
                    for entry, shape in entries.items():
                        if entry not in stored:
                            raise CheckpointError(f"{f}: no entry {entry!r}")
                        got = list(handle.get_slice(entry).get_shape())
                        if got != shape:
                            raise CheckpointError(f"{f}: {entry} has shape {got}, expected {shape}")
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(e)})") from e
        if rank is not None:
            self._read_rng(rank)

    def full(self, name: str, kind: str = "model", key: str | None = None) -> torch.Tensor:
        """The full tensor ``name`` (model weights, or optimizer state ``key``)."""
        info = self.meta["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} (is this checkpoint for the same model?)")
        stored = name if key is None else f"{key}/{name}"
        parts = []
        for t in range(self.saved_tp):
            f = self.path / _file(kind, info["stage"], t)
            if not f.is_file():
                raise CheckpointError(f"{self.path}: missing {f.relative_to(self.path)}")
            try:
                with safe_open(f, framework="pt") as handle:
                    if stored not in handle.keys():
                        raise CheckpointError(f"{f}: no entry {stored!r}")
                    parts.append(handle.get_tensor(stored))
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(e)})") from e
        spec = ParamSpec(tuple(info["full_shape"]), info["shard_dim"], name)
        try:
            full = unshard(parts, spec)
        except RuntimeError as e:
            raise CheckpointError(
                f"{self.path}: shards of {name} do not fit together ({_one_line(e)})"
            ) from e
        if list(full.shape) != info["full_shape"]:
            raise CheckpointError(
                f"{self.path}: {name} reassembles to {list(full.shape)}, expected {info['full_shape']}"
            )
        return full

    def check_model(self, cfg: LlamaConfig) -> None:
        saved = self.meta["model_config"]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
        ):
            if saved.get(key) != getattr(cfg, key):
                raise CheckpointError(
                    f"{self.path}: saved model has {key}={saved.get(key)}, config says {getattr(cfg, key)}"
                )
        if (saved.get("num_key_value_heads") or saved.get("num_attention_heads")) != cfg.kv_heads:
            raise CheckpointError(f"{self.path}: saved model has a different num_key_value_heads")
        if saved.get("tie_word_embeddings") != cfg.tie_word_embeddings:
            raise CheckpointError(
                f"{self.path}: saved model has tie_word_embeddings={saved.get('tie_word_embeddings')}"
            )

    @torch.no_grad()
    def load_model(self, stage: LlamaStage) -> None:
        self.check_model(stage.cfg)
        params = dict(stage.named_parameters())
        for name, spec in stage.specs.items():
            full = self.full(spec.canonical_name)
            params[name].copy_(shard(full, spec, stage.tp_rank, stage.tp))

    def check_optimizer(self) -> None:
        if not self.meta.get("has_optimizer"):
            raise CheckpointError(
                f"{self.path} has no optimizer state (converted weights?); set load_optimizer: false"
            )

    def load_optimizer_state(self, stage: LlamaStage) -> dict[str, dict[str, torch.Tensor]]:
        self.check_optimizer()
        keys = self._optimizer_keys()
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, spec in stage.specs.items():
            state[name] = {
                key: shard(self.full(spec.canonical_name, "optimizer", key), spec, stage.tp_rank, stage.tp)
                for key in keys
            }
        return state

    def _read_rng(self, rank: int) -> dict[str, torch.Tensor] | None:
        """This rank's saved RNG states; None when the file is absent (RNG state is optional)."""
        f = self.path / "rng" / f"rank{rank}.pt"
        if not f.is_file():
            return None
        try:
            rng = torch.load(f, weights_only=True)
            if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
                raise ValueError("no CPU RNG state")
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable RNG state ({_one_line(e)})") from e
        return rng

    def load_rng(self, rank: int, world_size: int) -> None:
        """Restore this rank's RNG state when resuming on the same world size."""
        if self.meta.get("world_size") != world_size:
            return
        rng = self._read_rng(rank)
        if rng is None:
            return
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


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
