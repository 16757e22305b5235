"""The run's generation: how many times the job was relaunched inside its allocation, and why.

The supervisor (``launcher.py``) writes ``<run_dir>/generation.json`` before every relaunch after a
lost node (or a job that lost every replica): the generation (1, 2, ...; no file is generation 0),
when the previous job ended, the hosts it lost, the last step it committed and the cause. Every
rank reads it at start-up, and again before it publishes anything shared (a checkpoint, a snapshot,
metrics, the outcome): a process of an older generation -- cut off from the network while its node
stayed up, so the runtime could not end it -- finds a newer number and writes nothing. The new
job's logging rank turns the record into the relaunch's incident. ``run_dir`` is on a filesystem
every node sees, as checkpoints are.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atomic_file import write_text_atomically

FILENAME = "generation.json"


@dataclass
class Relaunch:
    generation: int  # of the job being launched
    cause: str  # failures.Kind: node_lost or job_lost
    ended_at: float  # wall clock when the previous job's mpirun exited
    last_committed: int  # the last step the previous generation committed
    hosts_lost: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # where the new job runs (empty: as before)
    cleanup_s: float = 0.0  # from the previous job's end to its leftovers ended
    probe_s: float = 0.0  # asking which hosts still answer (started at that end: overlaps cleanup_s)
    launched_at: float = 0.0  # wall clock when the new job was started


def read_relaunch(run_dir: str | Path) -> Relaunch | None:
    try:
        return Relaunch(**json.loads((Path(run_dir) / FILENAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_generation(run_dir: str | Path) -> int:
    """The current generation (0 when no relaunch happened)."""
    relaunch = read_relaunch(run_dir)
    return 0 if relaunch is None else relaunch.generation


def write_relaunch(run_dir: str | Path, relaunch: Relaunch) -> None:
    """Atomically: a rank reading it sees the old record or the new one."""
    path = Path(run_dir) / FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(asdict(relaunch)) + "\n")


def clear_relaunch(run_dir: str | Path) -> None:
    """A new run in this directory starts at generation 0."""
    (Path(run_dir) / FILENAME).unlink(missing_ok=True)
