"""MPI worker for tests/integration/ft/test_creation_faults.py: a communicator whose context id and
ULFM epoch are those of a freed one that agreed, met by the ERA agreement's history.

Run under ``mpirun --with-ft ulfm`` on 4 ranks. Ranks 0-2 build ``trio``, ranks 0, 1 and 3 build
``other``. Rank 2 creates (and frees) 10 communicators alone, so it has created the most. Ranks
0-2 duplicate ``trio`` into ``old`` (its epoch: one more than rank 2's count), agree on it 5 times
and let it go: with ``ulfm.retire_comm`` (the product's way), or with ``Free`` (``--free``). Then
ranks 0, 1 and 3 duplicate ``other`` ``--rounds`` times, agreeing 6 times on each duplicate and
freeing it. Their counts grow by one a round, so one round's duplicate reaches ``old``'s epoch;
with ``old`` freed, it also takes ``old``'s context id (the lowest free on all three), and its 5th
agree meets ``old``'s 5th in the history of ranks 0 and 1 (rank 3, which never saw ``old``, does
not hold it, so the history is not collected). Open MPI 5.0.11 then prints "removing old agreement
... from history, due to cycling of identifiers"; in the product the same meeting hung the job
(see ``ulfm.retire_comm``).

Each rank writes ``<out>/rank<r>.json`` at the end (agrees run, and the values they returned).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--free", action="store_true", help="free the old communicator instead of retiring it")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dump-after", type=float, default=30.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from nanotron_recover.ft import ulfm
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rank = world.Get_rank()
    assert world.Get_size() == 4, "run on 4 ranks"
    trio = world.Split(0 if rank < 3 else MPI.UNDEFINED, rank)
    other = world.Split(0 if rank != 2 else MPI.UNDEFINED, rank)
    if rank == 2:
        for _ in range(10):
            MPI.COMM_SELF.Dup().Free()
    agreed: list[int] = []
    if rank < 3:
        old = trio.Dup()
        agreed += [old.Agree(1) for _ in range(5)]
        if args.free:
            old.Free()
        else:
            ulfm.retire_comm(old)
    if rank != 2:
        for _ in range(args.rounds):
            new = other.Dup()
            agreed += [new.Agree(1) for _ in range(6)]
            new.Free()  # each round's epoch is one more than the last one's: rounds never meet
    world.Barrier()
    record = {"rank": rank, "done": True, "agrees": len(agreed), "all_one": all(v == 1 for v in agreed)}
    tmp = args.out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.out / f"rank{rank}.json")
    os._exit(0)


if __name__ == "__main__":
    main()
