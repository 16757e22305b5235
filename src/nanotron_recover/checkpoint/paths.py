"""Names on disk, and which step folder a checkpoints root resumes from.

A checkpoint is the folder ``step_<s>`` (:data:`STEP_DIR`) with its ``meta.json``; the file
``latest`` names the newest one. Shards are ``model/pp<p>-tp<t>.safetensors`` and
``optimizer/pp<p>-tp<t>.safetensors`` (:func:`_file`). A name ending in ``.tmp`` is an unfinished
or abandoned save, never a checkpoint; the next save removes it.

``latest`` decides: a root resumes from the folder it names, and a ``latest`` naming a missing or
incomplete folder is an error, never "no checkpoint" (which would silently restart the run from
scratch). Without ``latest`` (a job killed between the renames of its first save, ``publish.py``)
the newest complete ``step_<s>`` is the checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import CheckpointError, _one_line
from .meta import _read_meta

LATEST = "latest"
# The next value of ``latest``, written into the tmp folder with the shards and moved out when the
# checkpoint is published, so publication is renames only and cannot run out of space.
NEXT_LATEST = "latest.next"
STEP_DIR = re.compile(r"step_(\d+)")


def _file(kind: str, pp_rank: int, tp_rank: int) -> str:
    return f"{kind}/pp{pp_rank}-tp{tp_rank}.safetensors"


def _find_step_dir(root: Path) -> Path | None:
    """The step folder a checkpoints root resumes from: the one ``latest`` names, or (no ``latest``:
    a job killed between the two renames of its first save) the newest complete ``step_<s>``.
    None when the root holds no checkpoint; a ``latest`` naming a missing or incomplete folder is
    an error, never "no checkpoint" (which would silently restart the run from scratch)."""
    latest = root / LATEST
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{latest}: unreadable ({_one_line(e)})") from e
        if not STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{latest}: corrupt (names {name[:40]!r}, not a step folder)")
        step_dir = root / name
        if not step_dir.is_dir():
            raise CheckpointError(f"{latest}: names {name}, which does not exist")
        if not (step_dir / "meta.json").is_file():
            raise CheckpointError(f"{latest}: names {name}, which is incomplete (no meta.json)")
        return step_dir
    if not root.is_dir():
        return None
    complete = [
        d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and (d / "meta.json").is_file()
    ]  # a step_<s>.tmp never matches: it is an unfinished save
    return max(complete, key=lambda d: int(d.name.split("_")[1]), default=None)


def resolve(path: str | Path) -> Path:
    """A step folder, or a checkpoints root whose ``latest`` (or newest complete step) names one."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        raise CheckpointError(f"{path}: an unfinished save, not a checkpoint")
    if (path / "meta.json").is_file():
        return path
    found = _find_step_dir(path)
    if found is None:
        raise CheckpointError(
            f"no checkpoint at {str(path)!r}: expected a step folder with meta.json or a 'latest' file"
        )
    return found


def latest_step(root: str | Path) -> int | None:
    """Step of the checkpoint ``root`` would resume from; None when it holds none.

    Raises CheckpointError when ``latest`` names a missing folder or ``meta.json`` is damaged."""
    root = Path(root)
    step_dir = root if (root / "meta.json").is_file() else _find_step_dir(root)
    return None if step_dir is None else int(_read_meta(step_dir)["step"])
