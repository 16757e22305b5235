"""``<run_dir>/outcome.json``: how a run ended, written once by the run itself.

The launcher (``launch``, the Slurm job) decides its exit status from this record, not from
``mpirun``'s: with ULFM, ranks that leave by SIGKILL, or a job whose every replica died, can leave
``mpirun`` with status 0. No record (or a stale one from an earlier launch, which the launcher
clears before it starts) means the run died without a word: a failure.

Keys: ``status`` (``completed`` | ``stopped``), ``last_step`` (last committed step),
``target_step`` (the step the run was asked to reach; null when the writer does not know it),
``kind`` (null, or a :data:`~.failures.STOP_ORDER` name), ``message`` (one line), ``exit_code``,
``time``, ``token`` (the writer's fencing token, :mod:`.fencing`; null for a writer without one).

A job that lost every replica is recorded too (kind ``all_replicas_lost``, exit 1): by the lowest
rank still running, or, when no rank is left to write it, by the launcher (:mod:`.supervisor`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import fencing
from .atomic_file import write_text_atomically
from .errors import ExitCode
from .failures import Kind

FILENAME = "outcome.json"
# Set by the launcher for the ranks it supervises: it prints the outcome's message itself, so the
# ranks need not (a stop is said once).
SUPERVISED_ENV = "NANOTRON_RECOVER_SUPERVISED"


def write_outcome(
    run_dir: str | Path,
    *,
    status: str,
    last_step: int,
    target_step: int | None,
    exit_code: int,
    kind: str | None = None,
    message: str | None = None,
) -> bool:
    """Write the record atomically; False (nothing raised) if the disk refuses it, or if this
    process was fenced off the run directory by a newer job (:mod:`.fencing`: checked right before
    the rename). The record names the writer's fencing token."""
    if status not in ("completed", "stopped"):
        raise ValueError(f"unknown outcome status {status!r}")
    record = {
        "status": status,
        "last_step": last_step,
        "target_step": target_step,
        "kind": kind,
        "message": message,
        "exit_code": int(exit_code),
        "time": time.time(),
        "token": None if fencing.mine() is None else fencing.mine().as_record(),
    }
    try:
        fencing.publish_text(run_dir, Path(run_dir) / FILENAME, json.dumps(record) + "\n")
        return True
    except fencing.Fenced as e:
        print(f"[nanotron-recover] {e}", file=sys.stderr, flush=True)
        return False
    except OSError:
        return False


def read_outcome(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / FILENAME).read_text())
    except (OSError, ValueError):
        return None


def clear_outcome(run_dir: str | Path) -> None:
    try:
        (Path(run_dir) / FILENAME).unlink()
    except FileNotFoundError:
        pass


ABANDONED = "abandoned.json"


def write_abandoned(run_dir: str | Path, reason: str) -> None:
    """A rank gives the job up as a whole (a re-join stuck past its deadline): the supervisor ends
    ``mpirun`` (which would wait for a frozen process forever) and relaunches the job."""
    record = {"reason": reason, "time": time.time(), "pid": os.getpid()}
    try:
        write_text_atomically(Path(run_dir) / ABANDONED, json.dumps(record) + "\n")
    except OSError:
        pass  # best effort: the rank is about to die either way


def read_abandoned(run_dir: str | Path) -> dict[str, Any] | None:
    """The give-up record, or None when there is none. The file's presence is what counts: one
    that cannot be parsed (a writer that died mid-write on a file system without atomic rename)
    still says the job was given up."""
    path = Path(run_dir) / ABANDONED
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"reason": f"{ABANDONED} unreadable: {e}"}
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"reason": f"{ABANDONED} unparsable: {text[:80]!r}"}


def clear_abandoned(run_dir: str | Path) -> None:
    (Path(run_dir) / ABANDONED).unlink(missing_ok=True)


def is_lost_job(outcome: dict[str, Any] | None) -> bool:
    """Whether ``outcome`` says the job was lost as a whole (no record at all says the same)."""
    return outcome is None or outcome.get("kind") == Kind.ALL_REPLICAS_LOST


def asks_regrow(outcome: dict[str, Any] | None) -> bool:
    """Whether ``outcome`` is a job that stopped to be relaunched at full width (kind ``regrow``)."""
    return outcome is not None and outcome.get("kind") == Kind.REGROW


# How many relaunches the supervisor has left, told to the job: a job asks for a relaunch only
# when one will come.
RELAUNCHES_LEFT_ENV = "NANOTRON_RECOVER_RELAUNCHES_LEFT"


def exit_code_of(outcome: dict[str, Any] | None) -> int:
    """The exit status a launcher reports for ``outcome``: 0 only for a completed run."""
    if outcome is None:
        return int(ExitCode.FAILED)
    if outcome.get("status") == "completed" and outcome.get("last_step") == outcome.get("target_step"):
        return 0
    code = int(outcome.get("exit_code") or ExitCode.FAILED)
    return code if code != 0 else int(ExitCode.FAILED)
