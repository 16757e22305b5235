"""Failure records: what a rank knew about its own end, left where the survivors can read it.

A rank that leaves the job for a reason it knows -- an injected fault, a phase that outlived its
watchdog deadline, an exception while computing micro-batches, a peer error in its replica's torch
world -- writes one small JSON record to ``<run_dir>/faults/`` *before* it dies. The survivors read
the records of the ranks that failed when they log the incident: the record gives the failure's
``kind``, the phase and the wall-clock time of the failure (so detection latency is measured from
the real moment of failure), and for an exception the micro-batch ids and the error, which is how a
deterministic error is told from a transient one (see ``data_parallel/forward/incidents.py``).

A rank killed from outside leaves no record; the survivors then classify the failure themselves
(``crash`` or ``hang``, see ``ft/processes.py``).

Kinds: :data:`~nanotron_recover.failures.RECORD_KINDS` (``failures.py`` says what each means).
Records need ``run_dir`` on a filesystem that every node sees, as checkpoints do.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..atomic_file import write_text_atomically
from ..failures import RECORD_KINDS


def faults_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "faults"


def write_record(run_dir: str | Path, name: str, record: dict[str, Any]) -> None:
    """Write ``faults/<name>.json`` atomically; best effort (a full disk must not keep a rank alive)."""
    if record.get("kind") not in RECORD_KINDS:
        raise ValueError(f"unknown failure kind {record.get('kind')!r}")
    record = {"time": time.time(), "pid": os.getpid(), **record}
    path = faults_dir(run_dir) / f"{name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(record))
    except OSError:
        pass


def read_records(
    run_dir: str | Path,
    ranks: list[int] | None = None,
    since: float = 0.0,
    pids: dict[int, int] | None = None,
) -> list[dict]:
    """Records of ranks among ``ranks`` (all if None) written at or after ``since``, oldest first.

    With ``pids`` (rank -> pid), only the records the process now at that rank wrote: after a
    re-join a logical rank is a new process, and its predecessor's record is not its story. A rank
    missing from ``pids`` (a process lost before the job knew its pid) keeps all its records."""
    out = []
    for f in sorted(faults_dir(run_dir).glob("step*_rank*.json")):
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if (ranks is None or record.get("rank") in ranks) and record.get("time", 0.0) >= since:
            pid = pids.get(record["rank"]) if pids is not None else None
            if pid is not None and record.get("pid", pid) != pid:
                continue
            out.append(record)
    return sorted(out, key=lambda r: r["time"])
