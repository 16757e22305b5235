"""MPI worker for tests/integration/ft/test_nonblocking.py: do non-blocking collectives report faults?

Run under ``mpirun --with-ft ulfm``. Plain mpi4py on a ``Dup`` of ``COMM_WORLD`` with
``ERRORS_RETURN``, none of the project's communicator code. Each iteration:

1. every rank posts ``--window`` ``Iallreduce`` (in place, SUM) on buffers of ``--k`` float64;
   buffer ``j`` of initial rank ``r`` holds ``(r + 1) * (j + 1)``, so a sum tells who took part;
2. it completes them (``--wait all``: one ``Waitall``; ``each``: one ``Wait`` per request, in order).
   On an MPI error it records the error class, revokes the communicator and then completes every
   request still pending (*drains* them: none may write into a buffer after this), recording how
   each one ended;
3. ``Agree`` on the communicator: bit 0 is "my reductions succeeded", bit 1 "go on". A failure
   that no reduction saw is seen here (the agree fails on every survivor alike).
   If the agree did not return bit 0: ``Shrink``, and the iteration is redone from the
   contributions in the smaller world; otherwise the sums are checked.

The loop ends when the agree says so: a rank votes "stop" once ``--min-seconds`` have passed, at
least ``--min-iters`` iterations committed, and 3 of them after its last recovery.

Faults: ``--kill RANK:ITER:POINT`` SIGKILLs RANK in ITER at POINT: ``before_post`` (the others have
their whole window in flight, the victim none), ``mid_post`` (after posting half of its window),
``after_post`` (all posted, dies before waiting). ``--revoke RANK:ITER`` makes RANK revoke the
communicator after posting, instead of waiting (no process fails). From outside, the test SIGKILLs
a rank whenever it likes, after every rank wrote ``ready<rank>`` (its pid).

Every rank writes ``<out>/rank<r>.json``: the faults it saw (where, error class, seconds after
posting), how the drained requests ended, the recoveries, the committed iterations and whether
their sums were right.
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

OK, GO_ON = 0x1, 0x2


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, out / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=6)
    ap.add_argument("--k", type=int, default=1 << 16, help="float64 elements per buffer")
    ap.add_argument("--wait", choices=("all", "each"), default="each")
    ap.add_argument("--kill", action="append", default=[], help="RANK:ITER:POINT")
    ap.add_argument("--revoke", action="append", default=[], help="RANK:ITER")
    ap.add_argument("--min-iters", type=int, default=4)
    ap.add_argument("--min-seconds", type=float, default=0.0)
    ap.add_argument("--dump-after", type=float, default=40.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from nanotron_recover.ft.ulfm import MPI  # the project's MPI settings (no Finalize, async finalize)

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    kills = {(int(r), int(i)): p for r, i, p in (s.split(":") for s in args.kill)}
    revokes = {(int(r), int(i)) for r, i in (s.split(":") for s in args.revoke)}
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "faults": [], "drains": [], "recoveries": []}
    committed: list[dict[str, Any]] = []

    comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.Barrier()
    _write(args.out, f"ready{rank}", {"rank": rank, "pid": os.getpid()})
    start = time.monotonic()

    def die(it: int, point: str) -> None:
        record.update(killed=True, killed_iter=it, killed_point=point, killed_at=time.time())
        _write(args.out, f"rank{rank}.json", record)
        os.kill(os.getpid(), signal.SIGKILL)

    def members() -> list[int]:
        return list(
            MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world.Get_group())
        )

    it = since_recovery = 0
    while True:
        point = kills.get((rank, it))
        if point == "before_post":
            die(it, point)
        bufs = [np.full(args.k, float((rank + 1) * (j + 1))) for j in range(args.window)]
        reqs: list[Any] = []
        t0 = time.monotonic()
        failed = False
        waited = 0  # requests completed without error before the fault (``--wait each``)
        try:
            for j in range(args.window):
                if point == "mid_post" and j == args.window // 2:
                    die(it, point)
                reqs.append(comm.Iallreduce(MPI.IN_PLACE, bufs[j], op=MPI.SUM))
            if point == "after_post":
                die(it, point)
            if (rank, it) in revokes:
                revokes.discard((rank, it))  # once: the redone iteration runs normally
                record["revoked_iter"] = it
                comm.Revoke()
            if args.wait == "all":
                MPI.Request.Waitall(reqs)
            else:
                for r in reqs:
                    r.Wait()
                    waited += 1
        except MPI.Exception as exc:
            failed = True
            record["faults"].append(
                {
                    "iter": it,
                    "where": "wait",
                    "error": MPI.Get_error_string(exc.Get_error_class()),
                    "error_class": exc.Get_error_class(),
                    "after_s": time.monotonic() - t0,
                    "revoked": bool(comm.Is_revoked()),
                    "posted": len(reqs),
                    "completed_before": waited,
                }
            )
            try:
                comm.Revoke()
            except MPI.Exception:
                pass
            # Drain: every request must be complete before its buffer is touched again.
            ends = []
            for r in reqs[waited + 1 :] if args.wait == "each" else reqs:
                try:
                    r.Wait()
                    ends.append("ok")
                except MPI.Exception as e:
                    ends.append(MPI.Get_error_string(e.Get_error_class()))
            record["drains"].append({"iter": it, "ends": ends, "after_s": time.monotonic() - t0})
        done = (
            args.min_iters <= it + 1
            and since_recovery + 1 >= 3
            and time.monotonic() - start >= args.min_seconds
        )
        vote = (0 if failed else OK) | (0 if done else GO_ON)
        try:
            value = comm.Agree(vote)
        except MPI.Exception as exc:
            if not failed:
                record["faults"].append(
                    {
                        "iter": it,
                        "where": "agree",
                        "error": MPI.Get_error_string(exc.Get_error_class()),
                        "error_class": exc.Get_error_class(),
                        "after_s": time.monotonic() - t0,
                    }
                )
            value = 0
        if not value & OK:
            while True:
                try:
                    shrunk = comm.Shrink()
                    break
                except MPI.Exception:
                    comm.Ack_failed()
            try:
                comm.Free()
            except MPI.Exception:
                pass
            comm = shrunk
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            record["recoveries"].append({"iter": it, "members": members(), "at": time.time()})
            since_recovery = 0
            continue  # redo this iteration from the contributions
        alive = members()
        expected = [float(sum(m + 1 for m in alive) * (j + 1)) for j in range(args.window)]
        right = all(bool(np.all(b == e)) for b, e in zip(bufs, expected, strict=True))
        committed.append({"iter": it, "size": len(alive), "sums_right": right})
        it += 1
        since_recovery += 1
        if not value & GO_ON:
            break
    record.update(committed=committed, final_members=members(), done=True, seconds=time.monotonic() - start)
    _write(args.out, f"rank{rank}.json", record)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
