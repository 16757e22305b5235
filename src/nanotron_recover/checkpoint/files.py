"""Small file operations of a save: fsynced text, best-effort removal, discarding a tmp folder.

A tmp folder is discarded by renaming it first (to ``step_<s>.discarded-<hex>.tmp``), so a rank
still writing into it fails at once instead of recreating files in a folder about to be deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def _write_text(path: Path, text: str) -> None:
    # fsync: these small files decide what is published; a crash must not leave them empty.
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def _discard(folder: Path) -> None:
    """Delete a ``.tmp`` folder other ranks may still be writing into. It is renamed away first:
    atomic, so their next write fails at once and they see it gone; what a write already under way
    leaves in the renamed folder keeps a ``.tmp`` name, which the next save sweeps."""
    trash = folder.with_name(f"{folder.name.removesuffix('.tmp')}.discarded-{secrets.token_hex(4)}.tmp")
    try:
        os.replace(folder, trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)
