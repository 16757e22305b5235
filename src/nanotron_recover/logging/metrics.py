"""Per-step metrics as JSON lines: ``<run_dir>/metrics.jsonl``, one object per optimizer step.

Keys: step, loss, lr, grad_norm, tokens, step_time_s, tokens_per_s, replicas, ids_digest, the
phase times of ``timing.PhaseTimes.record`` (compute_s ... wall_s) (+ any extra the mode adds). ``ids_digest`` is the sha256 of the sorted micro-batch ids the step
consumed, comma-joined: two runs agree on it exactly when they consumed the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import fencing
from .jsonl import read_jsonl


def ids_digest(ids: Iterable[int]) -> str:
    return hashlib.sha256(",".join(str(i) for i in sorted(ids)).encode()).hexdigest()


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a killed job keeps every finished step."""

    def __init__(self, path: str | Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Keep the complete records already there: a resumed run drops the steps after its
        # checkpoint (it redoes them); a writer taking over from a failed one (fault-tolerant mode)
        # drops a line its predecessor died in the middle of and continues after the last step.
        kept = read_jsonl(self.path) if self.path.exists() else []
        if truncate_after_step is not None:
            kept = [r for r in kept if r["step"] <= truncate_after_step]
        # Rewritten aside and renamed: a reader (the supervisor, a live view) never sees it half
        # written, and a writer of an older job (fencing.py) never replaces it.
        fencing.publish_text(self.path.parent, self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.last_step = max((r["step"] for r in kept), default=0)
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        if record["step"] <= self.last_step:
            return
        fencing.guard(self.path.parent, self.path.name)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.last_step = record["step"]

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (``path`` is the file or its run directory)."""
    path = Path(path)
    return read_jsonl(path / "metrics.jsonl" if path.is_dir() else path)
