"""Checkpoint errors: one line each, naming the file.

:class:`CheckpointIOError` is the operating system refusing a write (full disk, permissions,
read-only file system), naming the file and the reason; :class:`CheckpointError` is everything
else, including damaged checkpoints found when reading (corrupt ``meta.json``, truncated shards, a
``latest`` naming a missing folder); :class:`CheckpointTimeoutError` is a wait for an asynchronous
save that ran out of time (the save goes on).

An error crosses ranks as a record (:func:`_error_record`, :func:`_error_from_record`): broadcast
by a synchronous save, written into a marker or verdict file by an asynchronous one, so that every
rank raises the same error.
"""

from __future__ import annotations

import errno as errno_codes
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or read; the message is one line naming the file."""


class CheckpointIOError(CheckpointError):
    """The operating system refused a checkpoint write (ENOSPC, EACCES, EROFS, ...)."""

    def __init__(self, message: str, path: str | Path | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.errno = errno


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """``PendingSave.wait(timeout_s)`` ran out of time; the save goes on in the background."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


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
