"""Both sides of the TCP eager workaround (``ft/transport.py``): the hang it removes, and its cost.

Three ranks on this host, forced onto Open MPI's TCP transport (``--mca btl tcp,self``, as between
the nodes of a cluster), with ULFM, the heartbeat detector (0.5 s / 2 s) and a failure-watch thread
polling ``Test`` every 50 ms under ``MPI_THREAD_MULTIPLE``, as the project's ranks run. Two
variants of the same reduction of a float32 buffer:

- ``rendezvous``: Open MPI's defaults (TCP eager limit 64 KiB), one ``Allreduce`` of the buffer;
- ``eager``: the project's (the limit of ``TCP_EAGER_LIMIT_BYTES``), one ``Allreduce`` per slice of
  :func:`~nanotron_recover.ft.transport.eager_slices`, as ``comm.allreduce_`` does.

``hang``: ``--trials`` runs per variant. The ranks loop over reductions of ``--hang-mb``; rank 1
freezes itself (SIGSTOP) in one; 0.3 s later, while rank 0 waits on it, this script SIGKILLs rank 2.
Rank 0 must leave its reduction with a fault error: a trial that has not after ``--wait-s`` is a
hang, and its native stack (``py-spy``, if installed) is kept.

``time``: ``--reps`` fault-free reductions of ``--time-mb`` per variant, after 3 warm-ups; the
median of the slowest rank's time, and each rank's peak resident memory.

Writes ``tcp_eager.json`` and ``tcp_eager.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import describe, machine_info, markdown_table, write_report

RENDEZVOUS_LIMIT = 64 << 10  # Open MPI 5's default btl_tcp_eager_limit


def worker(args: argparse.Namespace) -> None:
    """One rank: reductions in a loop (``hang``) or timed (``time``)."""
    import resource
    import threading

    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    import numpy as np
    from mpi4py import MPI

    from nanotron_recover.ft.transport import eager_slices

    out = Path(args.json)
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    (out / f"pid{rank}").write_text(str(os.getpid()))

    def watch() -> None:  # the project's FailureWatch in miniature: it keeps MPI progressing
        w = comm.Dup()
        w.Set_errhandler(MPI.ERRORS_RETURN)
        buf = bytearray(8)
        req = w.Irecv(buf, source=MPI.ANY_SOURCE, tag=77)
        while True:
            try:
                req.Test()
            except MPI.Exception:
                try:
                    w.Failure_ack()
                except MPI.Exception:
                    pass
                req = w.Irecv(buf, source=MPI.ANY_SOURCE, tag=77)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    mb = args.hang_mb if args.mode == "hang" else args.time_mb
    x = np.ones(int(mb * 2**20) // 4, dtype=np.float32)
    y = np.empty_like(x)
    parts = eager_slices(x.size, x.itemsize) if args.variant == "eager" else [slice(0, x.size)]

    def reduce() -> None:
        for p in parts:
            comm.Allreduce(x[p], y[p], op=MPI.SUM)

    if args.mode == "hang":
        i = 0
        while True:
            i += 1
            if rank == 1 and i == 20:
                (out / "frozen").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            try:
                reduce()
            except MPI.Exception as exc:
                (out / f"error{rank}").write_text(f"{time.time()} {exc.Get_error_class()}")
                break
        time.sleep(1)
        os._exit(0)
    times = []
    for rep in range(args.reps + 3):
        comm.Barrier()
        t0 = time.perf_counter()
        reduce()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if rep >= 3:
            times.append(dt)
    ok = bool(np.all(y == comm.Get_size()))
    rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, root=0)
    if rank == 0:
        (out / "time.json").write_text(repr({"times": times, "ok": ok, "rss_mb": rss, "calls": len(parts)}))
    comm.Barrier()
    os._exit(0)


def mpirun(variant: str, mode: str, out: Path, args: argparse.Namespace) -> list[str]:
    """The project's ``mpirun`` line (``launcher.mpirun_command``) on the TCP transport, with the
    variant's eager limit."""
    from nanotron_recover.ft.transport import TCP_EAGER_LIMIT_BYTES
    from nanotron_recover.launcher import mpirun_command

    program = [sys.executable, __file__, "--worker", "--variant", variant, "--mode", mode, "--json", str(out)]
    program += ["--hang-mb", str(args.hang_mb), "--time-mb", str(args.time_mb), "--reps", str(args.reps)]
    cmd = mpirun_command(3, program, heartbeat=(0.5, 2.0))
    cmd[cmd.index("^ofi")] = "tcp,self"  # one host: the transport between a cluster's nodes
    limit = TCP_EAGER_LIMIT_BYTES if variant == "eager" else RENDEZVOUS_LIMIT
    cmd[cmd.index("btl_tcp_eager_limit") + 1] = str(limit)
    return cmd


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    from nanotron_recover.session_dirs import fresh_session

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(  # fresh: a killed mpirun's session folder must not stop this one
        fresh_session(cmd), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL ``mpirun`` and every process below it. The ranks are not in mpirun's process group
    (its daemon starts them in their own), and a rank deadlocked in Open MPI outlives its daemon:
    the tree is read from /proc before anything is killed."""
    from nanotron_recover.chaos.targets import descendants

    below = descendants(proc.pid)
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def hang_trial(variant: str, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True)
    proc = start(mpirun(variant, "hang", out, args), out / "log")
    try:
        deadline = time.monotonic() + 120
        while not ((out / "frozen").exists() and (out / "pid2").exists()):
            if time.monotonic() > deadline or proc.poll() is not None:
                return {"error": "rank 1 never froze", "log": (out / "log").read_text()[-2000:]}
            time.sleep(0.01)
        time.sleep(0.3)
        killed_at = time.time()
        os.kill(int((out / "pid2").read_text()), signal.SIGKILL)
        error = out / "error0"
        while not error.exists() and time.time() - killed_at < args.wait_s:
            time.sleep(0.01)
        if error.exists():
            return {"hung": False, "error_after_s": float(error.read_text().split()[0]) - killed_at}
        stack = ""
        spy = shutil.which("py-spy")
        if spy:
            pid0 = (out / "pid0").read_text()
            dump = subprocess.run(
                [spy, "dump", "--native", "--pid", pid0], capture_output=True, text=True, timeout=60
            )
            stack = dump.stdout[-3000:]
        return {"hung": True, "stack": stack}
    finally:
        stop(proc)


def time_run(variant: str, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True)
    proc = start(mpirun(variant, "time", out, args), out / "log")
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
    import ast

    return ast.literal_eval((out / "time.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument(
        "--wait-s", type=float, default=15.0, help="a rank 0 still in its reduction then hangs"
    )
    parser.add_argument("--hang-mb", type=float, default=8.0)
    parser.add_argument("--time-mb", type=float, default=40.0)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["rendezvous", "eager"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["hang", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    variants = ["rendezvous", "eager"]
    results: dict = {
        "machine": machine_info(),
        "args": vars(args) | {"out": str(args.out)},
        "hang": {},
        "time": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for t in range(args.trials):
            for v in variants:  # interleaved, so both see the same machine
                trial = hang_trial(v, Path(scratch) / f"hang-{v}-{t}", args)
                results["hang"].setdefault(v, []).append(trial)
                print(v, t, {k: trial[k] for k in trial if k != "stack"}, flush=True)
        for v in variants:
            results["time"][v] = time_run(v, Path(scratch) / f"time-{v}", args)
    rows = []
    for v in variants:
        trials = results["hang"][v]
        hung = sum(bool(t.get("hung")) for t in trials)
        # The self-deadlock's signature in rank 0's native stack (ft/transport.py).
        signature = ("mca_btl_tcp_frag_recv", "mca_pml_ob1_revoke_comm", "pthread_mutex_lock")
        deadlocked = sum(all(f in t.get("stack", "") for f in signature) for t in trials if t.get("hung"))
        errs = sorted(t["error_after_s"] for t in trials if "error_after_s" in t)
        timed = results["time"][v]
        rows.append(
            [
                v,
                f"{hung} of {len(trials)}",
                f"{deadlocked} of {hung}" if hung else "-",
                f"{statistics.median(errs):.3f}" if errs else "-",
                f"{max(errs):.3f}" if errs else "-",
                timed["calls"],
                f"{statistics.median(timed['times']):.3f}",
                "yes" if timed["ok"] else "NO",
                f"{max(timed['rss_mb']):.0f}",
            ]
        )
    lines = [
        "# A peer killed in a reduction over TCP: rendezvous against eager messages",
        "",
        describe(results["machine"]),
        "",
    ]
    lines += [
        f"3 ranks on one host over Open MPI's TCP transport, ULFM, heartbeat detector 0.5 s / 2 s, a watch thread "
        f"polling MPI every 50 ms (`MPI_THREAD_MULTIPLE`). Hang: rank 1 frozen in a reduction of {args.hang_mb:g} MB, "
        f"rank 2 SIGKILLed 0.3 s later; a hang is rank 0 still inside it {args.wait_s:g} s after the kill. "
        f"Time: a fault-free reduction of {args.time_mb:g} MB (float32), median of {args.reps} (slowest rank).",
        "",
    ]
    lines += markdown_table(
        [
            "variant",
            "hangs",
            "of them in the self-deadlock",
            "rank 0's error after the kill, median s",
            "max s",
            f"calls per {args.time_mb:g} MB",
            "reduction s",
            "sum right",
            "peak RSS per rank, MB",
        ],
        rows,
    )
    lines += [
        "",
        "rendezvous: Open MPI's default eager limit (64 KiB), one `Allreduce`; eager: the project's "
        "(`ft/transport.py`), one `Allreduce` per slice below the limit. In the self-deadlock: rank 0's "
        "native stack (`py-spy dump --native`) has `mca_btl_tcp_frag_recv` -> `mca_pml_ob1_revoke_comm` -> "
        "`pthread_mutex_lock`, the thread waiting on the endpoint lock it holds.",
    ]
    write_report(args.out, "tcp_eager", results, lines)


if __name__ == "__main__":
    main()
