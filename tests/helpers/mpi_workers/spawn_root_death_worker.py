"""MPI worker for tests/integration/ft/test_rank_fixes.py: the root of ``MPI_Comm_spawn`` dies while
the spawn allocates the new intercommunicator's context id.

Run under ``mpirun --with-ft ulfm -n 2`` on one host. Both launch processes spawn one process
(``--child``) from ``COMM_WORLD``, root 0. The root loads ``die_in_nextcid.c``'s library
(``--die-lib``) before MPI: it SIGKILLs itself as it starts the allocation's first exchange with
the spawned process's root, while rank 1 waits in the allocation's broadcast from it. Every launch
process imports MPI through ``nanotron_recover.ft.ulfm``, which loads the Open MPI fixes when the
launch's environment names them (``rank_fixes.ENV``).

Each launch process touches ``<out>/rank<r>.spawning`` as it enters ``Spawn``. Rank 1 writes
``<out>/rank1.json`` once its ``Spawn`` ends: how (returned, or the MPI error class
it raised) and after how long. Open MPI 5.0.11 alone never ends it (the failure is dropped and the
allocation retried, forever): no record. The spawned process waits in ``MPI_Init`` for the dead
root either way; the test ends the job.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--die-lib", required=True)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        from mpi4py import MPI  # MPI_Init connects to the parents

        MPI.Comm.Get_parent().Disconnect()
        return
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == 0:
        ctypes.CDLL(args.die_lib, mode=ctypes.RTLD_GLOBAL)  # before libmpi, like the fix

    from nanotron_recover.ft import rank_fixes
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()
    record: dict = {"rank": rank, "fix_loaded": rank_fixes.load()}
    (args.out / f"rank{rank}.spawning").touch()
    started = time.monotonic()
    try:
        world.Spawn(sys.executable, [__file__, *sys.argv[1:], "--child"], maxprocs=1, root=0)
        record["spawn"] = "returned"
    except MPI.Exception as e:
        record["spawn"] = e.Get_error_class()
    record["spawn_s"] = time.monotonic() - started
    record["kept"] = rank_fixes.kept_errors()
    tmp = args.out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.out / f"rank{rank}.json")
    os._exit(0)  # no MPI_Finalize with a dead peer (ulfm.py)


if __name__ == "__main__":
    main()
