"""The cross-replica gradient reduction of forward recovery against a bare MPI allreduce and gloo.

``--dp`` ranks are started with ``mpirun`` (the project's line: ULFM, the heartbeat detector with
the ``recover:`` defaults, HAN and cuda collectives off). Each rank holds an fp32 gradient buffer of
``--params`` elements, as the engine's ``grads_flat`` after backward, and times, interleaved, one
repetition after the other:

- ``ours``: the project's reduction path, driven as ``data_parallel/forward/step.py`` drives it: a
  :class:`BucketedReduction` over the gradient buffer and the bookkeeping vector (``2B + 2W``
  float64, ``B = W = dp``) cut into ``--bucket-mb`` buckets, ``reset()`` then ``reduce()`` over the
  fault-tolerant communicator's ``allreduce_`` in the current epoch, snapshots included. The
  time spent inside ``allreduce_`` is reported beside it (the rest is the bucket code's own cost:
  snapshots, copies); the commit agree that follows in a step is timed apart and not included;
- ``bare MPI``: one ``MPI.COMM_WORLD.Allreduce`` (in place, SUM) of the same gradient buffer;
- ``bare MPI, buckets``: the same ``Allreduce`` calls as ours makes (one per bucket, the
  bookkeeping vector's included), in place, without the bucket code: what ours costs beyond MPI
  itself, with Open MPI choosing its algorithm for the same message sizes;
- ``gloo``: one ``torch.distributed.all_reduce`` of the same buffer in a gloo world of the same
  ranks (what the plain mode does on CPU).

Before every repetition the buffer is refilled with the rank's contribution (not timed) and the
ranks meet at a barrier; a repetition's time is the slowest rank's. Each figure is the median over
``--reps`` repetitions after one warm-up. ``ratio`` is ours / bare MPI.

``--device cuda`` (one GPU is enough: every rank uses GPU ``rank % count``) puts the gradient
buffer in device memory, as on a GPU cluster, where the Open MPI wheel reduces host memory only:
``ours`` is then the staged pipeline (``staging.py``: pinned staging buffers that are the
snapshots, copies on their own streams, out-of-place reductions) and ``pageable`` the path it
replaced (per bucket: a device clone as the snapshot, ``.cpu()`` into pageable memory, an in-place
``Allreduce``, a copy back, nothing overlapped); ``bare MPI`` reduces a host buffer of the same
bytes (the network's limit), and the achieved device->host and host->device bandwidths of pageable
and pinned memory are measured beside them (``copy_gbps``). Written as ``reduction_cuda.json``.

Writes ``<out>/reduction.json`` (``runs``: one entry per size; the top-level ``ours_s``,
``bare_mpi_s``, ``gloo_s`` and ``ratio`` are those of the largest size) and ``<out>/reduction.md``.
``--before FILE`` adds the numbers of an earlier ``reduction.json`` to the table (same sizes).

    python benchmarks/reduction.py [--params 10M 50M] [--dp 4] [--reps 15] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEARTBEAT = (1.0, 5.0)  # recover.heartbeat_period_s, heartbeat_timeout_s defaults
BUCKET_MB = 25.0  # recover.bucket_size_mb default


def parse_count(text: str) -> int:
    """``10M`` -> 10_000_000, ``500k`` -> 500_000, ``1e6`` -> 1_000_000, ``123`` -> 123."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower())
    value = float(text[:-1]) * scale if scale else float(text)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole count: {text}")
    return int(value)


def label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)


# -- one rank under mpirun ------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    # MPI and the failure watch (which carries the heartbeats) first, before the slow torch import,
    # as `nanotron-recover train` does.
    from nanotron_recover.ft.heartbeat import start_mpi

    start_mpi(*HEARTBEAT)
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from nanotron_recover.data_parallel.forward.buckets import BucketedReduction
    from nanotron_recover.ft.comm import FaultTolerantComm
    from nanotron_recover.parallel.world import create_store

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, dp = world.Get_rank(), world.Get_size()
    ftc = FaultTolerantComm(1, 1, dp)  # dp replicas of one rank: the DP communicator is every rank
    store = create_store(world, rank, dp, timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=dp, timeout=timedelta(seconds=300))

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    contribution = torch.randn(args.params, generator=torch.Generator().manual_seed(rank)).to(device)
    grads = torch.empty_like(contribution)  # the engine's grads_flat
    host = torch.empty(args.params)  # what bare MPI reduces on a GPU: host memory of the same bytes
    B = dp  # one micro-batch per replica
    book = torch.zeros(2 * B + 2 * dp, dtype=torch.float64)  # as StepTransaction.attach
    numel = max(1, int(args.bucket_mb * 2**20) // grads.element_size())
    reduction = BucketedReduction([grads, book], numel)

    class TimedComm:
        """``ftc`` with the seconds spent inside its ``allreduce_`` counted."""

        inside = 0.0

        def allreduce_(self, buf: Any, epoch: int, out: Any = None) -> None:
            t0 = time.perf_counter()
            ftc.allreduce_(buf, epoch, out=out)
            TimedComm.inside += time.perf_counter() - t0

    comm = TimedComm()

    def ours() -> dict[str, float]:
        reduction.reset()  # a new step (StepTransaction.run)
        book.zero_()  # _fill_bookkeeping: this replica's id counted once
        book[rank] = 1.0
        TimedComm.inside = 0.0
        t0 = time.perf_counter()
        reduction.reduce(comm, ftc.epoch, before_bucket=lambda b: None)
        if cuda:
            torch.cuda.synchronize()  # the optimizer would read the buffer now
        t1 = time.perf_counter()
        ftc.agree(True)  # the commit, timed apart
        return {"s": t1 - t0, "allreduce_s": TimedComm.inside, "agree_s": time.perf_counter() - t1}

    def bare() -> dict[str, float]:
        t0 = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, (host if cuda else grads).numpy(), op=MPI.SUM)
        return {"s": time.perf_counter() - t0}

    def bare_buckets() -> dict[str, float]:
        t0 = time.perf_counter()
        for b in reduction.buckets:
            view = host[: b.view.numel()] if b.view.is_cuda else b.view
            world.Allreduce(MPI.IN_PLACE, view.numpy(), op=MPI.SUM)
        return {"s": time.perf_counter() - t0}

    def gloo() -> dict[str, float]:
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        return {"s": time.perf_counter() - t0}

    def pageable() -> dict[str, float]:
        """The device path before staging: one bucket at a time, nothing overlapped."""
        t0 = time.perf_counter()
        for b in reduction.buckets:
            snapshot = b.view.clone()
            staged = b.view.cpu()
            world.Allreduce(MPI.IN_PLACE, staged.numpy(), op=MPI.SUM)
            b.view.copy_(staged)
            del snapshot
        torch.cuda.synchronize()
        return {"s": time.perf_counter() - t0}

    variants = {"ours": ours, "bare_mpi": bare, "bare_mpi_buckets": bare_buckets}
    variants.update({"pageable": pageable} if cuda else {"gloo": gloo})
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name, run in variants.items():
            grads.copy_(contribution)  # what backward left in the buffer
            if cuda:
                host.copy_(contribution.cpu())
                torch.cuda.synchronize()
            world.Barrier()
            mine = run()
            slowest = {k: world.allreduce(v, op=MPI.MAX) for k, v in mine.items()}
            if rep > 0:  # the first round is the warm-up
                times[name].append(slowest)
    # The sum is the same in every variant (up to the order of additions).
    expected = torch.zeros_like(contribution)
    for r in range(dp):
        expected += torch.randn(args.params, generator=torch.Generator().manual_seed(r))
    ok = bool(torch.allclose(grads.cpu(), expected, rtol=1e-4, atol=1e-4))
    if rank == 0:
        result = {
            name: {k: statistics.median(t[k] for t in ts) for k in ts[0]} | {"reps_s": [t["s"] for t in ts]}
            for name, ts in times.items()
        }
        result["sums_agree"] = ok
        if cuda:
            result["copy_gbps"] = copy_bandwidths(grads)
        Path(args.json).write_text(json.dumps(result))
    world.Barrier()
    dist.destroy_process_group()
    ftc.close()
    sys.stdout.flush()
    os._exit(0)  # no MPI_Finalize, as the trainer (it can block with the heartbeat detector on)


def copy_bandwidths(device_buf: Any, reps: int = 5) -> dict[str, float]:
    """Achieved device->host and host->device GB/s of ``device_buf``, pageable and pinned memory."""
    import torch

    out = {}
    for kind, pinned in (("pageable", False), ("pinned", True)):
        host = torch.empty(device_buf.numel(), dtype=device_buf.dtype, pin_memory=pinned)
        for name, dst, src in (("d2h", host, device_buf), ("h2d", device_buf, host)):
            best = float("inf")
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[f"{name}_{kind}"] = device_buf.numel() * device_buf.element_size() / best / 1e9
    return out


# -- the driver -----------------------------------------------------------------------------------
def run_size(n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from nanotron_recover.launcher import mpirun_command
    from nanotron_recover.session_dirs import fresh_session

    out = tmp / f"{n}.json"
    program = [sys.executable, str(Path(__file__).resolve()), "--worker", "--params", str(n)]
    program += ["--reps", str(args.reps), "--bucket-mb", str(args.bucket_mb), "--json", str(out)]
    program += ["--device", args.device]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        fresh_session(mpirun_command(args.dp, program, heartbeat=HEARTBEAT)), check=True, timeout=900, env=env
    )
    raw = json.loads(out.read_text())
    if not raw["sums_agree"]:
        raise SystemExit(f"{n} parameters: the reduced gradients differ from the expected sum")
    nbytes = 4 * n
    ours, bare, bucketed = raw["ours"], raw["bare_mpi"], raw["bare_mpi_buckets"]
    # On a GPU the fourth variant is the path staging replaced; on CPU it is gloo.
    other = "pageable" if args.device == "cuda" else "gloo"
    extra = {"pageable_s": raw[other]["s"], "copy_gbps": raw["copy_gbps"]} if other == "pageable" else {}
    return extra | {
        "device": args.device,
        "params": n,
        "dp": args.dp,
        "bytes": nbytes,
        "buckets": -(-nbytes // int(args.bucket_mb * 2**20)),
        "ours_s": ours["s"],
        "ours_allreduce_s": ours["allreduce_s"],
        "ours_other_s": ours["s"] - ours["allreduce_s"],
        "agree_s": ours["agree_s"],
        "bare_mpi_s": bare["s"],
        "bare_mpi_buckets_s": bucketed["s"],
        "gloo_s": raw["gloo"]["s"] if other == "gloo" else None,
        "ratio": ours["s"] / bare["s"],
        "ratio_buckets": ours["s"] / bucketed["s"],
        "ours_gbps": nbytes / ours["s"] / 1e9,
        "bare_mpi_gbps": nbytes / bare["s"] / 1e9,
        "reps_s": {k: raw[k]["reps_s"] for k in ("ours", "bare_mpi", "bare_mpi_buckets", other)},
    }


def report(results: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    from common import describe, markdown_table

    lines = ["# Gradient reduction across replicas", "", describe(results["machine"]), ""]
    lines += [
        f"{results['dp']} ranks under mpirun, one per replica; fp32 gradients, {results['bucket_mb']:g} MB "
        f"buckets; seconds per step's reduction, median of {results['reps']} repetitions (the slowest "
        "rank of each). ours: the bucketed, snapshotted reduction over the fault-tolerant communicator "
        "(`inside allreduce`: the part spent in MPI; the rest is the bucket code's own); bare MPI: one "
        "in-place `Allreduce` of the buffer; bare MPI, buckets: the same in-place `Allreduce` calls as "
        "ours, one per bucket, without the bucket code; gloo: `torch.distributed.all_reduce`.",
        "",
    ]
    cuda = results.get("device") == "cuda"
    if cuda:
        lines += [
            "Gradients in GPU memory: ours stages them through pinned host buffers (the snapshots), "
            "copies on their own streams overlapping the reductions; pageable: the path before it "
            "(a device clone, `.cpu()`, an in-place `Allreduce`, a copy back, bucket after bucket); "
            "bare MPI reduces host memory of the same bytes.",
            "",
        ]
    other = ("pageable s", "pageable_s") if cuda else ("gloo s", "gloo_s")
    old = {r["params"]: r for r in (before or {}).get("runs", [])}
    columns = ["parameters", "MB", "ours s", "inside allreduce s", "bare MPI s", "bare MPI, buckets s"]
    columns += [other[0], "ours / bare", "ours / bare, buckets"]
    if old:
        columns += ["ours s before", "ours / bare before"]
    rows = []
    for r in results["runs"]:
        row = [
            label(r["params"]),
            f"{r['bytes'] / 2**20:.0f}",
            f"{r['ours_s']:.3f}",
            f"{r['ours_allreduce_s']:.3f}",
            f"{r['bare_mpi_s']:.3f}",
            f"{r['bare_mpi_buckets_s']:.3f}",
            f"{r[other[1]]:.3f}",
            f"{r['ratio']:.2f}",
            f"{r['ratio_buckets']:.2f}",
        ]
        if old:
            b = old.get(r["params"])
            row += [f"{b['ours_s']:.3f}", f"{b['ratio']:.2f}"] if b else ["-", "-"]
        rows.append(row)
    lines += markdown_table(columns, rows)
    if cuda:
        gbps = results["runs"][-1]["copy_gbps"]
        lines += [
            "",
            "Copies of the largest buffer, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in gbps.items()),
        ]
    if old:
        lines += ["", f"Before: {before.get('code', 'an earlier version of the bucket code')}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, nargs="+", default=[10**7, 5 * 10**7])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the gradients live")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--before", type=Path, help="an earlier reduction.json to compare with")
    parser.add_argument("--code", default="", help="what code was measured (recorded in the JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import machine_info, write_report

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
    results: dict[str, Any] = {
        "machine": machine_info(),
        "device": args.device,
        "dp": args.dp,
        "reps": args.reps,
        "bucket_mb": args.bucket_mb,
        "code": args.code,
    }
    with tempfile.TemporaryDirectory() as tmp:
        results["runs"] = [run_size(n, args, Path(tmp)) for n in sorted(args.params)]
    largest = results["runs"][-1]
    results.update({k: largest[k] for k in ("params", "ours_s", "bare_mpi_s", "gloo_s", "ratio")})
    before = json.loads(args.before.read_text()) if args.before else None
    name = "reduction_cuda" if args.device == "cuda" else "reduction"
    write_report(args.out, name, results, report(results, before))


if __name__ == "__main__":
    main()
