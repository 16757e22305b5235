"""MPI worker for tests/integration/ft/test_creation_faults.py: a communicator creation torn by a
failure, then later creations from communicators with a higher context id.

Run under ``mpirun --with-ft ulfm`` on N ranks; the last rank is the victim. Every rank builds
``low = COMM_WORLD.Dup()`` and then ``high = COMM_WORLD.Dup()`` (so ``high``'s context id is the
higher one). The survivors tell the victim they are about to create, and call ``low.Dup()``; the
victim waits for those messages, gives the survivors ``--kill-delay`` seconds to be inside the
``Dup`` (waiting for the victim in its context-id allocation), and SIGKILLs itself. The ``Dup``
fails on the survivors. With ``--reset`` they then handle it as the product handles a failed
creation (:func:`ulfm.creation_failed`, which must call it a fault). Then they shrink ``high`` and
duplicate what the shrink gave (both creations from communicators with a higher context id than
``low``), and check the duplicate with an ``Allreduce``.

A ``Split`` would not do: it first exchanges colors and keys with a blocking ``Allgather``, which
is where a member that never arrives makes it fail, before the context-id allocation.

Each survivor writes ``<out>/stage<r>.json`` after each stage (``failed``: what the torn ``Dup``
raised; ``shrunk``; ``done``) and ``<out>/rank<r>.json`` at the end; the victim writes
``rank<r>.json`` before it dies. Open MPI 5.0.11 leaves its context-id allocator gated on ``low``
after the torn creation, so without ``--reset`` the shrink of ``high`` never returns.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

_TAG = 7


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, out / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reset", action="store_true", help="handle the torn Dup with ulfm.creation_failed()")
    ap.add_argument("--kill-delay", type=float, default=0.5)
    ap.add_argument("--dump-after", type=float, default=30.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from nanotron_recover.ft import ulfm
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    victim = size - 1
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "reset": args.reset}
    low = world.Dup()
    high = world.Dup()
    for comm in (low, high):
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    low.Barrier()

    if rank == victim:
        for _ in range(size - 1):
            world.Recv(np.empty(1, dtype=np.int64), source=MPI.ANY_SOURCE, tag=_TAG)
        time.sleep(args.kill_delay)  # the survivors are inside the creation by now
        record.update(killed=True, killed_at=time.time())
        _write(args.out, f"rank{rank}.json", record)
        os.kill(os.getpid(), signal.SIGKILL)

    world.Send(np.array([rank], dtype=np.int64), dest=victim, tag=_TAG)
    t0 = time.monotonic()
    try:
        low.Dup().Free()
        record["created"] = True  # not expected: the victim was a member
    except MPI.Exception as exc:
        record.update(error_class=exc.Get_error_class(), error=MPI.Get_error_string(exc.Get_error_class()))
        if args.reset:
            record["fault"] = ulfm.creation_failed(exc)
    record["create_s"] = time.monotonic() - t0
    _write(args.out, f"stage{rank}.json", {**record, "stage": "failed"})
    ulfm.revoke_comm(low)

    t0 = time.monotonic()
    shrunk = high.Shrink()
    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
    record["shrink_s"] = time.monotonic() - t0
    _write(args.out, f"stage{rank}.json", {**record, "stage": "shrunk"})
    dup = shrunk.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    total = np.array([rank], dtype=np.int64)
    dup.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    record.update(size=dup.Get_size(), total=int(total[0]), done=True)
    _write(args.out, f"stage{rank}.json", {**record, "stage": "done"})
    _write(args.out, f"rank{rank}.json", record)
    os._exit(0)


if __name__ == "__main__":
    main()
