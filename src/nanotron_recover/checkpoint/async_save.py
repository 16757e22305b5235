"""Asynchronous saves: :class:`PendingSave`, and how the ranks agree through files.

An asynchronous save stages its tensors in CPU memory and writes them in a background thread, where
no collective may run, so the ranks talk through files in ``step_<s>.tmp`` instead: each rank drops
``done/rank<r>`` on success or ``failed/rank<r>`` (one JSON line: the error and its message) on
failure. Rank 0 waits for every marker until ``finalize_timeout_s``, gives up as soon as a
``failed/`` marker appears, and on failure or deadline removes the tmp folder and records the reason
in ``step_<s>.failed.tmp`` (keyed by ``save_id``); otherwise it publishes (``publish.py``). The
other ranks wait for rank 0's verdict (the published ``meta.json`` carrying their ``save_id``, or
that file), so a ``PendingSave`` ends the same way on every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .collective import _rank_world
from .errors import (
    CheckpointError,
    CheckpointTimeoutError,
    _error_from_record,
    _error_record,
    _guarded,
    _io_error,
    _one_line,
)
from .files import _discard
from .publish import _publish

# After rank 0's tmp folder disappears, how long the other ranks of an asynchronous save look for
# the verdict it writes right after (published meta.json or the failure file).
VERDICT_GRACE_S = 5.0


def _verdict_file(root: Path, step: int) -> Path:
    return root / f"step_{step}.failed.tmp"  # a .tmp name: the next save cleans it up


class PendingSave:
    """An asynchronous save in flight: its tensors are staged in CPU memory and a thread writes them.

    Every rank's ``PendingSave`` ends the same way: with the published path, or with the save's
    error (kept, and raised by every ``wait``/``poll`` after the failure)."""

    def __init__(self, path: Path, step: int) -> None:
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
    keep_last: int | None = None,
    protect: frozenset[Path] = frozenset(),
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
        _finalize(root, tmp, final, step, world, nonce, timeout_s, start, keep_last, protect)
        return
    outcome = _wait_verdict(
        root, tmp, final, step, nonce, start + timeout_s + VERDICT_GRACE_S + 0.05 * timeout_s
    )
    if outcome is None:
        return
    raise outcome


def _finalize(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    world: int,
    nonce: int,
    timeout_s: float,
    start: float,
    keep_last: int | None = None,
    protect: frozenset[Path] = frozenset(),
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
        _publish(root, tmp, final, keep_last, protect)
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
