"""Incident log: ``<run_dir>/incidents.jsonl``, one JSON object per failure the job survived.

Keys: step, phase, failed_replicas, failed_ranks, epoch (the world epoch after recovery), action
(``promote_spare`` | ``policy_boundary`` | ``mixed`` | ``none``), lost_ids, extra_microbatches,
detect_s (the victim's death to the logging survivor noticing; null for faults that were not
injected, whose time of death is unknown), recover_s (noticing to the step committed, minus the
time spent recomputing lost micro-batches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import fencing
from .jsonl import read_jsonl


class IncidentLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        fencing.guard(self.path.parent, self.path.name)  # not for a process of an older job
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_incidents(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/incidents.jsonl`` (the file or its run directory); none if absent."""
    path = Path(path)
    if path.is_dir():
        path = path / "incidents.jsonl"
    return read_jsonl(path) if path.exists() else []
