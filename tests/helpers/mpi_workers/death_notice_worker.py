"""MPI worker for tests/integration/ft/test_death_notices.py: a death the runtime reports to nobody,
then announced by ``nanotron_recover.ft.death_notices``.

Run under ``mpirun --with-ft ulfm -n 1`` on one host. The launch process spawns two processes (one
spawn, so one job of their own) and the three merge: rank 0 is the launch, ranks 1 and 2 the
spawned ones. Every rank publishes its :func:`~nanotron_recover.ft.processes.this_process`.

1. Rank 0 SIGKILLs itself; ranks 1 and 2 agree (a fault) and shrink. No launch process is left.
2. Rank 1 SIGKILLs itself. Rank 2 starts a non-blocking agreement on the shrunk communicator and
   polls it for ``--wait`` seconds: Open MPI 5.0.11 does not tell it about rank 1, so it stays
   pending. Rank 2 then starts the death notices (``--period``) and polls again.

Rank 2 writes ``<out>/rank2.json``: whether the agreement completed before the notices (and after
how long), whether it completed after them, the error it ended with and the size of the shrink
that follows. Ranks 0 and 1 write theirs before they die.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _write(out: Path, rank: int, record: dict[str, Any]) -> None:
    tmp = out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, out / f"rank{rank}.json")


def _poll(request: Any, seconds: float, record: dict[str, Any], key: str) -> bool:
    """Poll ``request`` for up to ``seconds``; when it completes, ``record[key]`` is the time it took
    and ``record["agree"]`` how it ended ("ok" or the MPI error class)."""
    from mpi4py import MPI

    t0 = time.monotonic()
    record[key] = None
    while time.monotonic() - t0 < seconds:
        try:
            done = request.Test()
            outcome: Any = "ok"
        except MPI.Exception as exc:
            done, outcome = True, exc.Get_error_class()
        if done:
            record[key], record["agree"] = time.monotonic() - t0, outcome
            return True
        time.sleep(0.01)
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wait", type=float, default=3.0)
    ap.add_argument("--period", type=float, default=0.2)
    ap.add_argument("--bound", type=float, default=20.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(60, exit=False)

    from nanotron_recover.ft.death_notices import DeathNotices, PmixEvents
    from nanotron_recover.ft.processes import this_process
    from nanotron_recover.ft.ulfm import MPI

    errors = MPI.ERRORS_RETURN
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        inter = MPI.COMM_WORLD.Spawn(sys.executable, [__file__, *sys.argv[1:]], 2, root=0)
        inter.Set_errhandler(errors)
        world = inter.Merge(high=False)
    else:
        parent.Set_errhandler(errors)
        world = parent.Merge(high=True)
    world.Set_errhandler(errors)
    rank = world.Get_rank()
    processes = world.allgather(this_process(rank))
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "process": processes[rank].__dict__}

    # 1. The launch process dies; the spawned ones are told and go on without it.
    world.Barrier()
    if rank == 0:
        _write(args.out, rank, {**record, "killed": True})
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        world.Agree(0)
        record["first_agree"] = "ok"
    except MPI.Exception as exc:
        record["first_agree"] = exc.Get_error_class()
    pair = world.Shrink()
    pair.Set_errhandler(errors)
    pair.Barrier()

    # 2. A spawned process dies with no launch process left.
    if rank == 1:
        _write(args.out, rank, {**record, "killed": True})
        os.kill(os.getpid(), signal.SIGKILL)
    flag = np.ones(1, dtype=np.intc)
    request = pair.Iagree(flag)
    done = _poll(request, args.wait, record, "done_before_notices_s")
    if not done:
        events = PmixEvents()
        record["pmix"] = events.why_not or "available"
        DeathNotices(args.period, lambda: processes, events.announce_death).start()
        done = _poll(request, args.bound, record, "done_after_notices_s")
    if done:
        record["shrunk_size"] = pair.Shrink().Get_size()
    _write(args.out, rank, record)
    os._exit(0)


if __name__ == "__main__":
    main()
