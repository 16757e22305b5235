"""MPI worker for tests/integration/ft/test_comm.py: a loop of DP reductions + step agrees, with injected faults.

Run under ``mpirun --with-ft ulfm``. Every rank writes ``<out>/rank<r>.json`` with
what it saw; the pytest side asserts on those files. Each iteration is one "step":

1. a rank listed in ``--kill RANK:ITER`` SIGKILLs itself at the start of ITER
   (after writing a file with the wall-clock time of the kill); one listed in
   ``--freeze RANK:ITER`` SIGSTOPs itself there instead (the heartbeat detector
   must find it; run with the detector's MCA parameters);
2. ``buf = [replica + 1] * k`` (the "snapshot"), ``allreduce_(buf, epoch)``, ``agree(True)``;
3. on ``WorldChanged`` the step is redone from the snapshot in the new epoch.

``--kill-in-recover RANK:POINT`` makes RANK SIGKILL itself when its first recovery
reaches POINT (a ``FaultTolerantComm`` fault-hook point name; the ``start:*`` ones are passed
while the first world is built). A rank that is told
to leave records the ``RecoveryResult`` from the ``on_leave`` hook, then dies. ``--watch`` starts the
failure watch and records every failure it reports, with its wall-clock time.
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

from nanotron_recover.ft import (
    AllReplicasFailed,
    FaultTolerantComm,
    StaleEpoch,
    Topology,
    Watchdog,
    WorldChanged,
)


def _write(out: Path, rank: int, record: dict[str, Any]) -> None:
    # Write-then-rename so the test never reads a half-written file of a rank that died.
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, out / f"rank{rank}.json")


def _pairs(specs: list[str]) -> dict[int, str]:
    return {int(s.split(":", 1)[0]): s.split(":", 1)[1] for s in specs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--k", type=int, default=16, help="elements per reduction")
    ap.add_argument("--kill", action="append", default=[], help="RANK:ITER")
    ap.add_argument("--freeze", action="append", default=[], help="RANK:ITER")
    ap.add_argument("--watch", action="store_true", help="record what the failure watch reports")
    ap.add_argument("--compute-s", type=float, default=0.0, help="busy non-MPI work before each step")
    ap.add_argument("--kill-in-recover", action="append", default=[], help="RANK:POINT")
    ap.add_argument("--manual-recover", action="append", default=[], help="RANK:ITER")
    ap.add_argument("--step-deadline", type=float, default=60.0)
    ap.add_argument("--dump-after", type=float, default=25.0, help="dump Python stacks if still alive")
    ap.add_argument("--torch", action="store_true", help="also reduce a torch CPU tensor at the end")
    args = ap.parse_args()

    # If this rank hangs (in a collective or in MPI_Finalize at exit), say where before the
    # test's timeout kills the job.
    faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    kill_iter = {r: int(it) for r, it in _pairs(args.kill).items()}
    freeze_iter = {r: int(it) for r, it in _pairs(args.freeze).items()}
    kill_point = _pairs(args.kill_in_recover).get(rank)
    manual_iter = {r: int(it) for r, it in _pairs(args.manual_recover).items()}
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    (args.out / f"pid{rank}").write_text(str(os.getpid()))  # for a test that signals from outside

    def fault_hook(point: str) -> None:
        if point == kill_point:
            record.update(killed_in_recover=point, killed_at=time.time())
            _write(args.out, rank, record)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_leave(result: Any) -> None:
        record.update(left=True, leave_result=result.as_dict(), left_at=time.time())
        _write(args.out, rank, record)

    noticed: list[dict[str, Any]] = []

    def on_notice(ranks: list[int], when: float) -> None:
        noticed.append({"ranks": ranks, "time": when})

    comm = FaultTolerantComm(
        args.tp,
        args.pp,
        args.replicas,
        on_leave=on_leave,
        fault_hook=fault_hook if kill_point else None,
        on_failure_notice=on_notice if args.watch else None,
    )
    topo = Topology(tp=args.tp, pp=args.pp, n_replicas=args.replicas)
    c = topo.coords(rank)
    if comm.startup_repair is not None:
        record["startup_repair"] = comm.startup_repair.as_dict()
    record.update(
        replica=comm.replica,
        pp=comm.pp_rank,
        tp=comm.tp_rank,
        local_rank=comm.local_rank,
        topology_ok=(comm.replica, comm.pp_rank, comm.tp_rank, comm.local_rank)
        == (c.replica, c.pp, c.tp, c.local_rank),
        initial_dp_size=comm.dp_size,
        initial_dp_rank=comm.dp_rank,
        initial_dp_members=comm.dp_comm.allgather(rank),
        initial_replica_members=comm.replica_comm.allgather(rank),
        initial_global_size=comm.global_comm.Get_size(),
    )

    watchdog = Watchdog()
    steps: list[dict[str, Any]] = []
    changes: list[dict[str, Any]] = []
    stale_checks: list[str] = []
    try:
        for it in range(args.iters):
            if kill_iter.get(rank) == it:
                record.update(killed=True, killed_at=time.time(), killed_iter=it)
                _write(args.out, rank, record)
                os.kill(os.getpid(), signal.SIGKILL)
            if freeze_iter.get(rank) == it:
                record.update(frozen=True, killed_at=time.time(), killed_iter=it)
                _write(args.out, rank, record)
                os.kill(os.getpid(), signal.SIGSTOP)
                record.update(woke=True)  # only if nobody removed this process while it slept
                _write(args.out, rank, record)
            end = time.perf_counter() + args.compute_s
            while time.perf_counter() < end:  # "compute": no MPI call, the watch must still notice
                pass
            if manual_iter.get(rank) == it:
                # A recovery without any failure: everyone must follow into a new epoch.
                changes.append({"iter": it, **comm.recover().as_dict()})
            attempts = 0
            while True:
                attempts += 1
                buf = np.full(args.k, float(comm.replica + 1), dtype=np.float64)  # the snapshot
                epoch = comm.epoch
                try:
                    with watchdog.phase(f"iter {it} attempt {attempts}", args.step_deadline):
                        comm.allreduce_(buf, epoch)
                        committed, _ = comm.agree(True)
                except WorldChanged as wc:
                    changes.append({"iter": it, **wc.result.as_dict()})
                    # A reduction tagged with the old epoch must be refused, not silently run.
                    try:
                        comm.allreduce_(np.zeros(1), epoch)
                        stale_checks.append("not raised")
                    except StaleEpoch:
                        stale_checks.append("StaleEpoch")
                    continue
                steps.append(
                    {
                        "iter": it,
                        "epoch": epoch,
                        "attempts": attempts,
                        "value": float(buf[0]),
                        "uniform": bool(np.all(buf == buf[0])),
                        "committed": committed,
                        "dp_size": comm.dp_size,
                    }
                )
                break
        if args.torch:
            import torch

            t = torch.full((5,), float(comm.replica + 1), dtype=torch.float32)
            comm.allreduce_(t, comm.epoch)
            record["torch_value"] = t.tolist()
            # Out of place, as a staged device bucket is reduced: the input stays the contribution.
            mine, total = torch.full((3,), float(comm.replica + 1)), torch.zeros(3)
            comm.allreduce_(mine, comm.epoch, out=total)
            record["out_of_place"] = [mine.tolist(), total.tolist()]
        # Agree is a logical AND: one False vote must give False everywhere.
        record["agree_and"], _ = comm.agree(comm.dp_rank != 0)
        # Stop requests are an OR: each replica sets its own bit, everyone gets them all.
        record["stop_or"] = comm.agree(True, stop=1 << (comm.replica % 8))[1]
    except AllReplicasFailed as exc:
        record.update(all_failed=True, all_failed_result=exc.result.as_dict())
        _write(args.out, rank, record)
        watchdog.stop()
        return
    watchdog.stop()
    record.update(
        steps=steps,
        changes=changes,
        stale_checks=stale_checks,
        final_epoch=comm.epoch,
        alive_replicas=comm.alive_replicas,
        alive_ranks=comm.alive_ranks,
        dp_size=comm.dp_size,
        dp_rank=comm.dp_rank,
        dp_members=comm.dp_comm.allgather(rank),
        replica_members=comm.replica_comm.allgather(rank),
        global_size=comm.global_comm.Get_size(),
        noticed=noticed,
        done=True,
    )
    comm.close()
    _write(args.out, rank, record)
    sys.stdout.flush()
    # Leave without MPI_Finalize, as the trainer does: with the heartbeat detector on, Finalize in a
    # world that lost a process can wait forever (seen here with Open MPI 5.0.11).
    os._exit(0)


if __name__ == "__main__":
    main()
