"""``<run_dir>/run.json``: what a run is asked to do, for readers that see only its directory.

The logging rank writes it once training starts (and again in each relaunched generation): the
target step, the layout (``dp``, ``tp``, ``pp``, ``dp_shard``, ranks per replica), ``B``, the
recovery mode and whether lost replicas re-join. ``nanotron-recover watch`` and the Prometheus
exporter read it to give a step its target (and so an ETA) and a rank of a failed replica its state
(parked when it waits to re-join, lost when it left with its replica).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..atomic_file import write_text_atomically

FILENAME = "run.json"


def write_run_info(run_dir: str | Path, info: dict[str, Any]) -> None:
    """Atomically: a reader sees the old record or the new one. Best effort: a run does not stop
    because the file that describes it to watchers could not be written."""
    try:
        write_text_atomically(Path(run_dir) / FILENAME, json.dumps(info, indent=1) + "\n")
    except OSError:
        pass


def read_run_info(run_dir: str | Path) -> dict[str, Any] | None:
    """The record, or None when there is none (yet) or it cannot be read."""
    try:
        info = json.loads((Path(run_dir) / FILENAME).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
