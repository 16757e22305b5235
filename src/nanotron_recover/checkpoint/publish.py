"""Publication: the renames that make a written step folder the checkpoint ``latest`` names.

Rank 0 publishes once every rank wrote all its files into ``step_<s>.tmp``: after the ranks agreed
(synchronous saves, ``save.py``) or after every ``done/`` marker came in (asynchronous saves,
``async_save.py``). The save already wrote the next value of ``latest`` into the tmp folder
(``latest.next``), so publication needs no disk space: it is renames only, each atomic. Every rename
of a published path is in this module, in :func:`_publish`:

1. ``step_<s>`` -> ``step_<s>.old.tmp``, only when the same step was saved before (e.g. after a
   resume): the previous copy is kept until the new one is in place;
2. ``step_<s>.tmp`` -> ``step_<s>``;
3. ``step_<s>/latest.next`` -> ``latest``: the checkpoint is published;

and, when a rename fails, back to how things were: ``step_<s>`` -> ``step_<s>.tmp`` (3 failed; the
caller discards the tmp folder) and ``step_<s>.old.tmp`` -> ``step_<s>`` (``latest`` may name it).

Before each rename the writer's fencing token is checked (``fencing.py``): a process of an older
job (stopped or cut off while a newer one took the run over) gets a refused write (``Fenced``, a
PermissionError) and its save is abandoned like one the disk refused.

With ``checkpoints.keep_last`` set, a publication then retires older checkpoints
(:func:`_retire_older`): of the step folders older than the one just published, the
``keep_last - 1`` newest stay and the rest are removed, each renamed away first (``files._discard``)
so no reader ever sees half a folder under a checkpoint's name. Nothing newer than the published
step is touched (a run resumed by hand from an older checkpoint keeps the later ones), nor the
folder ``latest`` names. At least two are kept: a process that read ``latest`` just before a
publication (a re-join reading the schedule's origin) still finds the folder it named.

Until rename 3, ``latest`` keeps naming the previous checkpoint, so a job killed before it resumes
from that one, intact. The exception is the same step saved again: killed between renames 1 and 2,
``latest`` names a folder that is for the moment ``step_<s>.old.tmp``, which reading reports as a
one-line error (``paths.py``) instead of resuming from it; killed between 2 and 3, it names the new
copy, complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import fencing
from .files import _discard, _remove
from .paths import LATEST, NEXT_LATEST, STEP_DIR


def _publish(root: Path, tmp: Path, final: Path, keep_last: int | None = None) -> None:
    """Rank 0, every rank's files written: make ``final`` the checkpoint ``latest`` names. Renames
    only; a job killed in between leaves ``latest`` naming the previous (intact) checkpoint. Then,
    with ``keep_last``, older checkpoints are retired (best effort: the save has succeeded)."""
    old = None
    # Each rename is fenced at its own moment (fencing.py): a writer stopped for minutes between
    # its save and this publication, while a newer job took the run over, publishes nothing.
    fencing.guard_adopted(f"checkpoint {final.name}")
    if final.exists():  # the same step saved again (e.g. after a resume): keep it until replaced
        old = root / f"{final.name}.old.tmp"
        _remove(old)
        os.replace(final, old)
    try:
        fencing.guard_adopted(f"checkpoint {final.name}")
        os.replace(tmp, final)
        try:
            fencing.guard_adopted(f"{LATEST} -> {final.name}")
            os.replace(final / NEXT_LATEST, root / LATEST)
        except OSError:
            os.replace(final, tmp)  # not published after all: the caller discards it
            raise
    except OSError:
        if old is not None:  # put the previous copy back: ``latest`` may name it
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        _retire_older(root, final, keep_last)


def _retire_older(root: Path, published: Path, keep_last: int) -> list[Path]:
    """Remove the checkpoints older than ``published`` beyond the ``keep_last - 1`` newest of them;
    the folders removed. Never ``published``, a newer one, or the one ``latest`` names; nothing at
    all from a process fenced off the run (a stale writer must not delete the new job's state)."""
    try:
        fencing.guard_adopted(f"removal of checkpoints older than {published.name}")
        named = (root / LATEST).read_text().strip()
        step = int(STEP_DIR.fullmatch(published.name).group(1))
        older = sorted(
            (int(m.group(1)), d)
            for d in root.iterdir()
            if (m := STEP_DIR.fullmatch(d.name)) and int(m.group(1)) < step and d.name != named
        )
    except (OSError, ValueError, AttributeError):
        return []
    retired = [d for _, d in older[: max(0, len(older) - (keep_last - 1))]]
    for folder in retired:
        _discard(folder)
    return retired
