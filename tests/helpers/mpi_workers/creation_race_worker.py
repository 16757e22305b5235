"""MPI worker for tests/integration/ft/test_creation_faults.py: communicator creations torn by a revoke.

Run under ``mpirun --with-ft ulfm``. Every rank builds ``base = COMM_WORLD.Dup()``; then, ``--trials``
times: ``comm = base.Dup()``; one rank (``trial % size``) revokes ``comm`` from a thread after a
random 5-50 ms while every rank, that one included, creates communicators from ``comm`` in a loop
(``--op dup``: ``comm.Dup()``; ``split``: ``comm.Split(0)``; ``both``: alternately) until one raises.
Each error goes to :func:`ulfm.creation_failed`, the product's handler of a failed creation; if it
does not call the error a fault, the rank re-raises and dies with a traceback, as the product
would. Every rank writes ``<out>/rank<r>.json``: the error class of each trial and, for each, what
the plain :func:`ulfm.is_fault` (for blocking calls) says about it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, out / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--op", choices=("dup", "split", "both"), default="both")
    ap.add_argument("--dump-after", type=float, default=50.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from nanotron_recover.ft import ulfm
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    rng = random.Random(f"{rank} {os.getpid()}")
    base = world.Dup()
    base.Set_errhandler(MPI.ERRORS_RETURN)
    errors: list[dict[str, Any]] = []
    for trial in range(args.trials):
        comm = base.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        base.Barrier()
        revoker = None
        if trial % size == rank:
            delay = rng.uniform(0.005, 0.05)
            revoker = threading.Thread(target=lambda c=comm, d=delay: (time.sleep(d), c.Revoke()))
            revoker.start()
        created = 0
        split = args.op == "split" or (args.op == "both" and trial % 2 == 1)
        while True:
            try:
                made = comm.Split(0, rank) if split else comm.Dup()
            except MPI.Exception as exc:
                errors.append(
                    {
                        "trial": trial,
                        "op": "split" if split else "dup",
                        "created": created,
                        "error_class": exc.Get_error_class(),
                        "blocking_is_fault": ulfm.is_fault(exc),
                    }
                )
                if not ulfm.creation_failed(exc):
                    raise
                break
            made.Free()
            created += 1
        if revoker is not None:
            revoker.join()
        base.Barrier()
        ulfm.retire_comm(comm)
    _write(args.out, f"rank{rank}.json", {"rank": rank, "errors": errors, "done": True})
    os._exit(0)


if __name__ == "__main__":
    main()
