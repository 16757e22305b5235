"""``nanotron-recover snapshots clean``: give back one run's node-memory snapshots on this host.

A forward-recovery job keeps every rank's state in its node's shared memory
(``recover.snapshot.dir``, by default ``/dev/shm/nanotron-recover-{uid}``, one folder per run:
``data_parallel/forward/snapshots.py``), tens of GB per node that outlive every process of the job.
The ranks remove them when the job completes or stops without a relaunch; whatever ends the job
otherwise leaves them: ``scancel``, the time limit, a job lost with no relaunch left, a node a
relaunch no longer used. So the Slurm job script ends, whatever way it ends, by running this command
on every node of its allocation (``templates/nanotron_recover.sbatch.in``), and ``launch`` runs it
on its own host once the supervisor is done with the run.

The run is named as the ranks name it (:func:`~.data_parallel.forward.snapshot_folder.snapshot_run_id`):
from the config (with the same ``--set`` overrides) and the run directory, or by its id
(``--run-id``). Only that run's folder is removed, only inside the user's private snapshot folder,
never through a symlink (:func:`~.data_parallel.forward.snapshot_folder.remove_run_snapshots`). The
command says what it removed (files and bytes) in one line and exits 0, also when there was
nothing to remove; 1 when the folder is refused (not this user's own, a symlink) or something could
not be removed.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:
    from .config import Config
    from .data_parallel.forward.snapshot_folder import Removed

PREFIX = "nanotron-recover snapshots clean"


def add_snapshots_arguments(parser: argparse.ArgumentParser) -> None:
    """``nanotron-recover snapshots clean ...``: the action, then the run it acts on."""
    from .config import add_config_arguments

    parser.add_argument(
        "action",
        choices=["clean"],
        help="clean: remove one run's node-memory snapshots on this host, only inside this user's "
        "private snapshot folder, and say what was removed (exit 0 also when there was nothing)",
    )
    # The run's config and its --set overrides, as given to train (they make its run id).
    add_config_arguments(
        parser, required=False, config_help="the run's YAML config (its run id and recover.snapshot.dir)"
    )
    parser.add_argument("--run-dir", help="the run directory given to train (with --config)")
    parser.add_argument("--run-id", help="the run's snapshot id instead of --config and --run-dir")
    parser.add_argument(
        "--dir",
        help="the snapshot folder (default: the config's recover.snapshot.dir, else "
        "/dev/shm/nanotron-recover-{uid})",
    )


def run_snapshots(args: argparse.Namespace) -> int:
    """``nanotron-recover snapshots ACTION ...``: the exit status."""
    if args.action == "clean":
        return clean(args)
    raise InputError(f"unknown snapshots action {args.action!r}")  # pragma: no cover


def target(args: argparse.Namespace) -> tuple[str, str]:
    """(snapshot folder, run id) named by ``clean``'s arguments; InputError when they name none."""
    from .config import SnapshotArgs, load_config

    if args.run_id:
        if args.config or args.run_dir:
            raise InputError("snapshots clean: give either --run-id or --config with --run-dir, not both")
        return args.dir or SnapshotArgs().dir, args.run_id
    if not (args.config and args.run_dir):
        raise InputError("snapshots clean needs --config and --run-dir (as given to train), or --run-id")
    from .data_parallel.forward.snapshot_folder import snapshot_run_id

    cfg = load_config(args.config, args.overrides, check_paths=False)
    return args.dir or cfg.recover.snapshot.dir, snapshot_run_id(cfg, Path(args.run_dir))


def clean(args: argparse.Namespace) -> int:
    """Remove the run's snapshots on this host and say what was removed; the exit status."""
    from .data_parallel.forward.snapshot_folder import SnapshotDirRefused, remove_run_snapshots

    root, run_id = target(args)
    host = socket.gethostname()
    try:
        removed = remove_run_snapshots(root, run_id)
    except ValueError as error:
        raise InputError(f"snapshots clean: --run-id {error}") from None
    except SnapshotDirRefused as refused:
        print(f"{PREFIX}: {host}: nothing removed: {refused}", file=sys.stderr, flush=True)
        return 1
    print(f"{PREFIX}: {describe(removed, host)}", flush=True)
    return 1 if removed.errors else 0


def clean_this_host(cfg: Config, run_dir: str | Path) -> str | None:
    """What ``launch`` does once the supervisor is done with a forward-recovery run: remove the
    run's snapshots on this host; the line that says what was removed (None: nothing was there, or
    snapshots are off). Never raises: a failed cleanup must not change the run's exit status."""
    from .data_parallel.forward.snapshot_folder import (
        SnapshotDirRefused,
        remove_run_snapshots,
        snapshot_run_id,
    )

    snapshot = cfg.recover.snapshot
    if not snapshot.interval:
        return None
    host = socket.gethostname()
    try:
        removed = remove_run_snapshots(snapshot.dir, snapshot_run_id(cfg, Path(run_dir)))
    except (OSError, ValueError, SnapshotDirRefused) as error:
        return f"{host}: node-memory snapshots not removed: {error}"
    if not removed.files and not removed.errors:
        return None
    return describe(removed, host)


def describe(removed: Removed, host: str) -> str:
    """One line: what was removed from which folder on ``host`` (and what could not be)."""
    run = removed.path.name
    if not removed.files and not removed.errors:
        return f"{host}: no node-memory snapshots of run {run} under {removed.path.parent}"
    line = (
        f"{host}: removed {removed.files} files, {_size(removed.nbytes)} ({removed.nbytes} bytes) of "
        f"node-memory snapshots of run {run} from {removed.path}"
    )
    if removed.errors:
        shown = "; ".join(removed.errors[:3]) + (
            f"; {len(removed.errors) - 3} more" if len(removed.errors) > 3 else ""
        )
        line += f"; could not remove {len(removed.errors)}: {shown}"
    return line


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
