"""MPI worker for tests/integration/ft/test_rank_fixes.py: a process-failure notice that reaches
the survivors while they create a communicator.

Run under ``mpirun --with-ft ulfm`` on 3 ranks. The victim (the last rank) loads
``die_in_activate.c``'s library (``--die-lib``) before MPI: it SIGKILLs itself as it enters
``ompi_comm_activate`` of the first creation, ``COMM_WORLD.Dup()``, when the others are in theirs.
Every rank imports MPI through ``nanotron_recover.ft.ulfm``, which loads the Open MPI fixes when the
launch's environment names it (``rank_fixes.ENV``). The survivors then revoke and shrink the world
and reduce over it, and each writes ``<out>/rank<r>.json``: how the ``Dup`` ended, the shrunk
size, the sum, and how many revokes the fix caught. Without the fix, Open MPI 5.0.x crashes them
inside the ``Dup`` (a null ``c_coll``), and no record is written.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--die-lib", required=True)
    args = ap.parse_args()
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == size - 1:
        os.environ["DIE_IN_ACTIVATE"] = "1"
        ctypes.CDLL(args.die_lib, mode=ctypes.RTLD_GLOBAL)  # before libmpi, like the fix

    from nanotron_recover.ft import rank_fixes
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()
    record: dict = {"rank": rank, "fix_loaded": rank_fixes.load()}
    try:
        world.Dup()
        record["dup"] = "returned"
    except MPI.Exception as e:
        record["dup"] = f"raised {e.Get_error_class()}"
    world.Revoke()
    shrunk = world.Shrink()
    record.update(size=shrunk.Get_size(), total=shrunk.allreduce(rank), caught=rank_fixes.caught())
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # no MPI_Finalize with a dead peer (ulfm.py)


if __name__ == "__main__":
    main()
