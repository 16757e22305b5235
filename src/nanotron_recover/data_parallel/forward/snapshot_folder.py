"""The node-memory snapshot folder as files, without torch: whose folder it is, where one run's
snapshots live in it, and their removal.

What :mod:`.snapshots` writes and reads is checked against this module's rules (a private folder of
this user, ``{uid}`` replaced; one plain name per run). The removal is here, apart from the writer,
because it runs where nothing else of training does: ``nanotron-recover snapshots clean``, one
process per node as the Slurm job script's last step. Importing torch there (seconds of CPU on a busy
node, for every node of the allocation, at the end of every job) was most of that step's cost.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...config import Config


def snapshot_run_id(cfg: Config, run_dir: Path) -> str:
    """The run a snapshot belongs to: the trajectory's identity and the run directory (two runs of
    one config in two directories never read each other's snapshots)."""
    from ...checkpoint.identity import run_identity

    where = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{run_identity(cfg)}-{where}"


class SnapshotSkipped(Exception):
    """A snapshot not written because its slot does not fit (no room, or over ``max_mb``): the
    job goes on, relaunches use an older snapshot or the disk checkpoint."""


class SnapshotDirRefused(SnapshotSkipped):
    """``recover.snapshot.dir`` is not a private folder of this user: no snapshot is written into
    it nor read from it."""


class SnapshotFenced(SnapshotSkipped):
    """This process no longer belongs to the job (``may_publish`` answered False): it touches no
    slot, so a newer generation's snapshots on this node stay as they are."""


_FIX = "point recover.snapshot.dir at a folder of your own, e.g. /dev/shm/nanotron-recover-{uid}"


def snapshot_dir(configured: str | Path) -> Path:
    """``recover.snapshot.dir`` with ``{uid}`` replaced by this process's user id."""
    return Path(str(configured).replace("{uid}", str(os.getuid())))


def private_root(configured: str | Path) -> Path:
    """The snapshot folder, created ``0700`` if missing, after checking it is this user's own: a
    real directory (``lstat``: not a symlink), owned by this uid, mode ``0700`` (fixed when it is
    ours and looser), inside a parent that no other user may rename it in. Raises
    :class:`SnapshotDirRefused` with one line saying why otherwise."""
    root = snapshot_dir(configured)
    try:
        root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        parent = os.lstat(root.parent)
        st = os.lstat(root)
    except OSError as error:
        raise SnapshotDirRefused(
            f"node snapshots off: cannot create {root} ({os.strerror(error.errno or 0)}); {_FIX}"
        ) from error
    _check_private(root, parent, st)
    return root


def existing_private_root(configured: str | Path) -> Path | None:
    """The snapshot folder if it exists (None otherwise: nothing is created), after the checks of
    :func:`private_root`; :class:`SnapshotDirRefused` when they fail."""
    root = snapshot_dir(configured)
    try:
        st = os.lstat(root)
        parent = os.lstat(root.parent)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SnapshotDirRefused(
            f"node snapshots: cannot read {root} ({os.strerror(error.errno or 0)})"
        ) from error
    _check_private(root, parent, st)
    return root


def _check_private(root: Path, parent: os.stat_result, st: os.stat_result) -> None:
    """Raise :class:`SnapshotDirRefused` unless ``root`` (``st``, from ``lstat``) is a private
    folder of this user inside ``parent``; make it ``0700`` when it is ours and looser."""
    uid, fix = os.getuid(), _FIX
    # A folder anyone may write without the sticky bit: another user could swap ours for a link.
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX and parent.st_uid != uid:
        raise SnapshotDirRefused(
            f"node snapshots off: {root.parent} is writable by every user without the sticky bit; {fix}"
        )
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise SnapshotDirRefused(f"node snapshots off: {root} is {what}; {fix}")
    if st.st_uid != uid:
        raise SnapshotDirRefused(
            f"node snapshots off: {root} belongs to uid {st.st_uid}, not to this user (uid {uid}); {fix}"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(root, 0o700, follow_symlinks=False)
        except (OSError, NotImplementedError) as error:
            raise SnapshotDirRefused(
                f"node snapshots off: cannot make {root} private (mode {stat.S_IMODE(st.st_mode):o}): {error}"
            ) from error


@dataclass(frozen=True)
class Removed:
    """What :func:`remove_run_snapshots` removed on this host: the run's folder, how many files
    and how many bytes of memory they held (allocated blocks), and what could not be removed."""

    path: Path
    files: int = 0
    nbytes: int = 0
    errors: tuple[str, ...] = ()


def run_folder(root: str | Path, run_id: str) -> Path:
    """``<root>/<run_id>``; ``ValueError`` unless ``run_id`` is one plain name (a run id from
    ``restore.snapshot_run_id`` always is), so that nothing outside ``root`` is ever named."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id:
        raise ValueError(f"{run_id!r} is not a run id (one name, as `snapshot_run_id` makes it)")
    return snapshot_dir(root) / run_id


def remove_run_snapshots(root: str | Path, run_id: str) -> Removed:
    """Remove every snapshot of run ``run_id`` on this host: the folder ``<root>/<run_id>`` with
    every replica's and coordinate's slots, whatever generation wrote them.

    Only inside a private folder of this user (the checks of :func:`private_root`, without creating
    it: a missing folder removes nothing); :class:`SnapshotDirRefused` otherwise. Never through a
    symlink: a link in the run's place is removed itself, not what it points to, and the tree is
    removed with ``shutil.rmtree``, which does not follow links on Linux. Removing what is already
    gone is not an error (several ranks of one node may remove the same run at once)."""
    path = run_folder(root, run_id)
    if existing_private_root(root) is None:
        return Removed(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Removed(path)
    if not stat.S_ISDIR(st.st_mode):  # a link or a file in the run's place: that entry alone
        try:
            os.unlink(path)
        except FileNotFoundError:
            return Removed(path)
        except OSError as error:
            return Removed(path, errors=(f"{path}: {os.strerror(error.errno or 0)}",))
        return Removed(path, 1, st.st_blocks * 512)
    files, nbytes = held(path)
    errors: list[str] = []

    def failed(function: Any, name: str, info: Any) -> None:
        error = info[1] if isinstance(info, tuple) else info  # onerror's exc_info, onexc's exception
        if not isinstance(error, FileNotFoundError):
            errors.append(f"{name}: {error.strerror if isinstance(error, OSError) else error}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=failed)
    return Removed(path, files, nbytes, tuple(errors))


def held(folder: Path) -> tuple[int, int]:
    """(files, bytes allocated) under ``folder``, links not followed (a link counts, its target not)."""
    files = nbytes = 0
    for parent, dirs, names in os.walk(folder, followlinks=False):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            files += 1
            nbytes += st.st_blocks * 512
    return files, nbytes
