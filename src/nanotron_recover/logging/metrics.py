"""Per-step metrics as JSON lines: ``<run_dir>/metrics.jsonl``, one object per optimizer step.

Keys: step, loss, lr, grad_norm, tokens, step_time_s, tokens_per_s, replicas, ids_digest, the
phase times of ``timing.PhaseTimes.record`` (compute_s ... wall_s) (+ any extra the mode adds). ``ids_digest`` is the sha256 of the sorted micro-batch ids the step
consumed, comma-joined: two runs agree on it exactly when they consumed the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .. import fencing
from ..atomic_file import aside_path
from ..errors import InputError
from .jsonl import read_jsonl


def ids_digest(ids: Iterable[int]) -> str:
    return hashlib.sha256(",".join(str(i) for i in sorted(ids)).encode()).hexdigest()


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a killed job keeps every finished step.

    Opening it reads the file from its end, never all of it, so a relaunch or a new logging rank
    starts in the same time however many steps the run has. Parsing and rewriting the whole file
    took 4.4 s for 135,000 steps on one core; in a long chaos campaign the first step of a relaunch
    took 0.13 s at step 453 and 9.57 s at step 117,084, and re-joins took up to 8.2 s more than
    their spawn, growing the same way (a new writer starts on the next senior replica when a fault
    moves the logging role).

    When it drops records (a resumed run redoes the steps after its checkpoint; a torn last line),
    the bytes it keeps are copied to a new file renamed over the old one: a reader that
    follows the file by its inode (the chaos watch) sees it replaced, even if records were added
    again before it looked, and a writer of an older job that still holds the old file open
    writes where nobody reads. When it drops nothing it appends to the file as it is; every write
    is fenced (:func:`.fencing.guard`) right before it.
    """

    def __init__(self, path: str | Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # An older job's process learns it is fenced here, before it writes anything.
        fencing.guard(self.path.parent, self.path.name)
        # Keep the complete records already there: a resumed run drops the steps after its
        # checkpoint (it redoes them); a writer taking over from a failed one (fault-tolerant mode)
        # drops a line its predecessor died in the middle of and continues after the last step.
        keep = _kept_prefix(self.path, truncate_after_step)
        self.last_step = keep.last_step
        if keep.end < keep.size:
            _replace_with_prefix(self.path, keep.end)
        self._file = self.path.open("a")
        if keep.unterminated:
            fencing.guard(self.path.parent, self.path.name)
            self._file.write("\n")
            self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        if record["step"] <= self.last_step:
            return
        fencing.guard(self.path.parent, self.path.name)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.last_step = record["step"]

    def close(self) -> None:
        self._file.close()


def _replace_with_prefix(path: Path, end: int) -> None:
    """Replace ``path`` by its first ``end`` bytes: copied aside as bytes (no parsing: 0.2 s for
    94 MB, 135,000 steps), then fenced and renamed over it."""
    aside = aside_path(path)
    try:
        with path.open("rb") as src, aside.open("wb") as dst:
            left = end
            while left > 0:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    break  # the file got shorter meanwhile: keep what there was
                dst.write(chunk)
                left -= len(chunk)
        fencing.guard(path.parent, path.name)
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Prefix:
    end: int  # bytes of the file to keep
    size: int  # bytes the file has
    last_step: int  # the step of the last kept record (0: none)
    unterminated: bool  # the last kept record is complete but has no newline yet


_BLOCK = 1 << 16  # bytes read at a time, from the end backwards


def _lines_from_the_end(f: BinaryIO, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of each line of ``f``, the last first. The first one
    given is what follows the last newline (empty when the file ends with one)."""
    pos, buf = size, b""
    while True:
        cut = buf.rfind(b"\n")
        if cut >= 0:
            yield pos + cut + 1, buf[cut + 1 :]
            buf = buf[:cut]
        elif pos == 0:
            yield 0, buf
            return
        else:
            n = min(_BLOCK, pos)
            pos -= n
            f.seek(pos)
            buf = f.read(n) + buf


def _kept_prefix(path: Path, truncate_after_step: int | None) -> _Prefix:
    """How much of ``path`` a new writer keeps: up to the last complete record (with a step of at
    most ``truncate_after_step``). A torn last line is dropped; a bad line before a record that is
    read is an InputError naming its offset."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return _Prefix(0, 0, 0, False)
    with f:
        size = f.seek(0, os.SEEK_END)
        seen_a_line = False
        for k, (offset, line) in enumerate(_lines_from_the_end(f, size)):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                if not seen_a_line:
                    seen_a_line = True  # the last line: its writer was killed in the middle of it
                    continue
                raise InputError(f"{path}: the line at byte {offset} is not a JSON record ({e})") from None
            seen_a_line = True
            if truncate_after_step is not None and record["step"] > truncate_after_step:
                continue
            unterminated = k == 0
            return _Prefix(
                offset + len(line) + (0 if unterminated else 1), size, record["step"], unterminated
            )
    return _Prefix(0, size, 0, False)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (``path`` is the file or its run directory)."""
    path = Path(path)
    return read_jsonl(path / "metrics.jsonl" if path.is_dir() else path)
