"""Following a running job from its run directory: its commits, incidents, relaunches and outcome.

The runner decides when to send a fault, whether the job reacted and whether it hangs from what the
job itself records (never from its output): ``metrics.jsonl`` (one line per committed step, with
its wall-clock ``time`` and ``replicas``), ``incidents.jsonl`` (one line per failure, re-join or
relaunch), ``generation.json`` (written by the supervisor before a relaunch) and ``outcome.json``.

The JSON-lines files are tailed, not re-read: only the bytes appended since the last poll are
parsed, up to the last complete line, so polling every few milliseconds costs little. A file that
got shorter or was replaced is read again whole: a new metrics writer that drops records (a
relaunched job redoes the steps after the state it restored; a line torn by its predecessor)
renames the records it keeps over ``metrics.jsonl``, so the new inode tells the watch even when
the redone steps were appended before it looked.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..generation import read_generation
from ..outcome import read_outcome


class JsonlTail:
    """The complete records of a JSON-lines file, kept up to date by :meth:`poll`."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""

    def poll(self) -> tuple[list[dict[str, Any]], bool]:
        """(records appended since the last poll, whether the file was rewritten and read again)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return [], False
        rewritten = False
        if st.st_ino != self._inode or st.st_size < self._offset:
            rewritten = self._inode is not None
            self._inode, self._offset, self._partial, self.records = st.st_ino, 0, b"", []
        if st.st_size == self._offset:
            return [], rewritten
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
        except OSError:
            return [], rewritten
        self._offset += len(data)
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        new = []
        for line in data[:cut].splitlines():
            if line.strip():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by a writer killed mid-write
        self.records.extend(new)
        return new, rewritten


@dataclass
class Commit:
    step: int
    time: float  # the record's wall clock
    replicas: int | None
    seen_at: float  # when the runner saw it


@dataclass
class RunWatch:
    """What the runner knows of the job, refreshed by :meth:`poll`."""

    run_dir: Path
    started_at: float = field(default_factory=time.time)
    commits: list[Commit] = field(default_factory=list)  # every new step seen, in order
    step_drops: list[tuple[float, int, int]] = field(default_factory=list)  # (seen_at, from, to)
    generations: list[tuple[float, int]] = field(default_factory=list)  # (seen_at, generation)
    outcome: dict[str, Any] | None = None
    last_progress: float = 0.0  # the last commit or relaunch seen (wall clock)

    def __post_init__(self) -> None:
        self.metrics = JsonlTail(self.run_dir / "metrics.jsonl")
        self.incidents_tail = JsonlTail(self.run_dir / "incidents.jsonl")
        self.last_progress = self.started_at
        self._slow_due = 0.0
        self.generation = 0

    @property
    def incidents(self) -> list[dict[str, Any]]:
        return self.incidents_tail.records

    @property
    def last_step(self) -> int:
        records = self.metrics.records
        return int(records[-1]["step"]) if records else 0

    @property
    def replicas(self) -> int | None:
        records = self.metrics.records
        return records[-1].get("replicas") if records else None

    def last_commit_at(self) -> float | None:
        return self.commits[-1].seen_at if self.commits else None

    def step_time_s(self, last: int = 20) -> float | None:
        """Median seconds between consecutive commits over the last ``last`` of them."""
        records = [r for r in self.metrics.records[-(last + 1) :] if isinstance(r.get("time"), (int, float))]
        gaps = sorted(b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False))
        gaps = [g for g in gaps if g > 0]
        return gaps[len(gaps) // 2] if gaps else None

    def poll(self) -> None:
        now = time.time()
        before = self.last_step
        new, rewritten = self.metrics.poll()
        if rewritten and self.last_step < before:
            self.step_drops.append((now, before, self.last_step))
        if not rewritten:  # a re-read file holds what was seen before (or less): no new commit
            for record in new:
                self.commits.append(
                    Commit(
                        int(record.get("step", 0)),
                        float(record.get("time", now)),
                        record.get("replicas"),
                        now,
                    )
                )
                self.last_progress = now
        self.incidents_tail.poll()
        if now >= self._slow_due:  # small files that change rarely: ten times a second
            self._slow_due = now + 0.1
            generation = read_generation(self.run_dir)
            if generation != self.generation:
                self.generation = generation
                self.generations.append((now, generation))
                self.last_progress = now
            self.outcome = read_outcome(self.run_dir)
