"""Reading the JSON-lines logs (metrics, incidents) that a job may have been killed while writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of ``path``. A torn last line (its writer was killed mid-write) is dropped; a bad
    line anywhere else is an InputError naming it."""
    path = Path(path)
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for k, (lineno, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if k == len(lines) - 1:
                break
            raise InputError(f"{path}:{lineno}: not a JSON record ({e})") from None
    return records
