"""``<run_dir>/commit.json``: the last step the job committed, written by the logging rank.

The supervisor asks "did the job commit a new step?" to decide whether a relaunch makes progress,
and a relaunch restores no state newer than that step. Both used to read the last line of
``metrics.jsonl``, which a logging rank that takes over rewrites and which any old process could
append to. This record is one small file, replaced atomically after every commit (a reader sees the
old record or the new one, never a torn one), fenced like every shared write (:mod:`.fencing`), and
it names the token of the job that wrote it::

    {"step": <int>, "token": {"nonce": ..., "generation": ...} | null, "time": <wall clock>}

It is not ``fsync``-ed: it must survive the death of the process that wrote it (the rename does
that), not of the file server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from . import fencing

FILENAME = "commit.json"


@dataclass(frozen=True)
class CommitRecord:
    step: int
    token: fencing.Token | None
    time: float


def write_commit(run_dir: str | Path, step: int) -> None:
    """Record ``step`` as the last committed one; raises :class:`fencing.Fenced` for a process of
    an older job and OSError when the disk refuses."""
    mine = fencing.mine()
    record = {"step": int(step), "token": None if mine is None else mine.as_record(), "time": time.time()}
    fencing.publish_text(run_dir, Path(run_dir) / FILENAME, json.dumps(record) + "\n")


def read_commit(run_dir: str | Path) -> CommitRecord | None:
    """The record, or None when there is none (or it cannot be read: the caller falls back)."""
    try:
        record = json.loads((Path(run_dir) / FILENAME).read_text())
        token = record.get("token")
        return CommitRecord(
            int(record["step"]),
            None if token is None else fencing.Token(str(token["nonce"]), int(token["generation"])),
            float(record.get("time", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_commit(run_dir: str | Path) -> None:
    (Path(run_dir) / FILENAME).unlink(missing_ok=True)
