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
(:func:`_retire_older`): of this run's step folders older than the one just published, the
``keep_last - 1`` newest stay and the rest are renamed to ``retired-step_<s>-<hex>`` (one atomic
rename each, so no reader sees half a folder under a checkpoint's name; a folder that cannot be
renamed stays as it is), then removed within :data:`RETIRE_BUDGET_S` (what is left is removed at a
later publication: a first save with thousands of checkpoints to retire holds no step for long).
Never retired: a newer folder than the one published (a run resumed by hand from an older
checkpoint keeps the later ones), the folder ``latest`` names, another run's checkpoint (its
``meta.json`` carries another identity), one whose ``meta.json`` cannot be read, and the folders
the config names (``checkpoints.resume_checkpoint_path``, ``model.init_method.path``: a relaunch
or a re-join reads them again). The fence is checked before each rename: a writer of an older job,
stopped in the middle, renames nothing more once it wakes. At least two are kept: a process that
read ``latest`` just before a publication (a re-join reading the schedule's origin) still finds
the folder it named.

Until rename 3, ``latest`` keeps naming the previous checkpoint, so a job killed before it resumes
from that one, intact. The exception is the same step saved again: killed between renames 1 and 2,
``latest`` names a folder that is for the moment ``step_<s>.old.tmp``, which reading reports as a
one-line error (``paths.py``) instead of resuming from it; killed between 2 and 3, it names the new
copy, complete.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

from .. import fencing
from .errors import CheckpointError
from .files import _remove
from .meta import _read_meta
from .paths import LATEST, NEXT_LATEST, STEP_DIR

# Retired checkpoints are renamed to this prefix + their name + a random suffix before removal: no
# step-folder pattern matches it (``step_<s>``, the ``step_*.tmp`` a save sweeps at its start).
RETIRED_PREFIX = "retired-"
# The most seconds a publication spends removing retired folders (the rest wait for the next one).
RETIRE_BUDGET_S = 2.0


def _publish(
    root: Path, tmp: Path, final: Path, keep_last: int | None = None, protect: frozenset[Path] = frozenset()
) -> None:
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
        _retire_older(root, final, keep_last, protect)


def _retire_older(
    root: Path,
    published: Path,
    keep_last: int,
    protect: frozenset[Path] = frozenset(),
    budget_s: float | None = None,
) -> list[Path]:
    """Retire this run's checkpoints older than ``published`` beyond the ``keep_last - 1`` newest
    of them (see the module); the folders retired, by their checkpoint names. ``protect``: resolved
    paths never retired."""
    budget_s = RETIRE_BUDGET_S if budget_s is None else budget_s
    try:
        fencing.guard_adopted(f"retirement of checkpoints older than {published.name}")
        identity = _identity(published)
        step = int(STEP_DIR.fullmatch(published.name).group(1))
        older = sorted(
            (int(m.group(1)), d)
            for d in root.iterdir()
            if (m := STEP_DIR.fullmatch(d.name)) and int(m.group(1)) < step
        )
    except (OSError, ValueError, AttributeError):
        return []
    if identity is None:
        return []
    ours = [d for _, d in older if d.resolve() not in protect and _identity(d) == identity]
    retired = []
    for folder in ours[: max(0, len(ours) - (keep_last - 1))]:
        try:
            fencing.guard_adopted(f"retirement of checkpoint {folder.name}")
            if (root / LATEST).read_text().strip() == folder.name:
                continue
            os.replace(folder, root / f"{RETIRED_PREFIX}{folder.name}-{secrets.token_hex(4)}")
        except fencing.Fenced:
            break
        except OSError:
            continue  # it stays a checkpoint, whole: never removed in place
        retired.append(folder)
    deadline = time.monotonic() + budget_s
    for trash in sorted(root.glob(f"{RETIRED_PREFIX}step_*")):
        if time.monotonic() > deadline:
            break
        shutil.rmtree(trash, ignore_errors=True)
    return retired


def _identity(step_dir: Path) -> str | None:
    """The run identity ``meta.json`` records; None when it cannot be read (never retired then)."""
    try:
        value = _read_meta(step_dir).get("run_identity")
    except CheckpointError:
        return None
    return value if isinstance(value, str) else None
