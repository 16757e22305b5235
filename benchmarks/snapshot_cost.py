"""What a node-memory snapshot after every step costs a training step, and why.

One rank's training step in this process, in the order the forward-recovery mode runs it
(``data_parallel/forward/mode.py``): the micro-batches forward and backward (``train_batch``), the
wait for the previous snapshot's copy (``local_phase(OPTIMIZER)`` -> ``NodeSnapshots.wait_exported``),
the optimizer step, then the snapshot of the committed state on its thread (``after_step`` ->
``NodeSnapshots.write`` with ``export_state(copy=False)``), which overlaps the next step's compute.
No MPI and no reduction: what is timed is the snapshot's cost and nothing else. The model is the
tiny LLaMA at hidden 256 (4 layers, intermediate 512: the ``hidden 256`` model of
``node_loss.py``), fp32, ``G`` micro-batches a step as the tiny config has them; the slots live in a
folder under ``/dev/shm`` (node memory, as in a run).

``--repeats`` repetitions, each a block of every variant back to back (``--warmup`` untimed steps,
then ``--steps`` timed ones; the order reversed every other repetition). The machine's load
changes from one repetition to the next (other processes share its cores), so the overhead is the
median over the repetitions of each one's step over its own ``off`` step; the step times are medians
too. Variants:

- ``off``: ``recover.snapshot.interval: 0``;
- ``on``: a snapshot after every step (``interval: 1``); on CUDA through the side stream into the
  pinned buffer (``snapshot_copy.py``);
- ``on, pageable`` (CUDA only): the path before it, the snapshot thread copying the device tensors
  straight into the slot.

Why it costs what it costs, measured apart: the bytes of one snapshot, one snapshot written alone
(nothing else running: export, copy into the mapped slot, publish) and a plain host copy of as many
bytes (``torch`` copy between two buffers): the bandwidth a snapshot gets, against the memory's. On
CUDA also the side-stream copy's own time (CUDA events) and how much of it overlapped the compute
of the next step (the copy's interval against the compute stream's, on the device's clock).

Writes ``<out>/snapshot_cost.{json,md}`` (``snapshot_cost_cuda`` with ``--device cuda``).

    python benchmarks/snapshot_cost.py [--device cpu|cuda] [--repeats 5] [--steps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import describe, machine_info, markdown_table, write_report

from nanotron_recover.config import load_config
from nanotron_recover.data_parallel.forward.snapshot_copy import DeviceCopy
from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.engines.three_d import ThreeDEngine
from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.world import World

MODEL = [
    "model.model_config.hidden_size=256",
    "model.model_config.intermediate_size=512",
    "model.model_config.num_hidden_layers=4",
    "parallelism.dp=1",
]
GOAL = 0.03  # the overhead a snapshot every step may cost (3% of a step)
LR = 1e-3


class Rank:
    """One rank's engine and micro-batches, and optionally its node-memory snapshots."""

    def __init__(self, device: torch.device, root: Path, sets: list[str]) -> None:
        cfg = load_config(tiny_config_path(), [*MODEL, *sets], check_paths=False)
        backend = "nccl" if device.type == "cuda" else "gloo"
        world = World(rank=0, size=1, local_rank=0, device=device, backend=backend)
        self.engine = ThreeDEngine(cfg, world, ParallelContext(1, 1, 1, device=device))
        self.device, self.root = device, root
        t, m = cfg.tokens, cfg.model.model_config
        g = torch.Generator().manual_seed(0)
        self.microbatches = [
            torch.randint(0, m.vocab_size, (t.micro_batch_size, t.sequence_length + 1), generator=g)
            for _ in range(t.batch_accumulation_per_replica)
        ]
        self.scale = 1.0 / len(self.microbatches)
        self.parameters = sum(p.numel() for p in self.engine.stage.parameters())

    def store(self, name: str, timing: bool = False) -> NodeSnapshots:
        snaps = NodeSnapshots(self.root / name, "bench", "tp1pp1", coordinate=0, replica=0)
        if self.device.type == "cuda":
            snaps.copier = DeviceCopy(self.device, timing=timing)
        # How long each write keeps the snapshot thread busy (export, copy, publish), under load.
        write = snaps._export_and_publish
        snaps.busy = []  # type: ignore[attr-defined]

        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            write(*args)
            snaps.busy.append(time.perf_counter() - t0)  # type: ignore[attr-defined]

        snaps._export_and_publish = timed  # type: ignore[method-assign]
        return snaps

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, variant: str, snaps: NodeSnapshots | None, steps: int, warmup: int) -> dict[str, Any]:
        """A block of ``warmup + steps`` steps of ``variant`` (its ``snaps``, kept from block to
        block: the slots' pages are allocated once, as in a run); the timed steps' times and waits.
        The block's last snapshot is finished before it returns: the next block starts clean."""
        device = None if variant == "on, pageable" else self.device
        cuda = self.device.type == "cuda"
        times, waits, copies, overlaps = [], [], [], []
        self.sync()
        ref = None
        if cuda:  # the origin of the device's clock for this run's events
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            begin = end = None
            if cuda:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            self.engine.train_batch(self.microbatches, self.scale)
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            previous = snaps.last_copy if snaps is not None else None
            w0 = time.perf_counter()
            if snaps is not None:
                snaps.wait_exported()  # mode.local_phase(OPTIMIZER)
            wait = time.perf_counter() - w0
            # The 3D engine's optimizer step ends with a device synchronize: the step is done here.
            self.engine.optimizer_step(LR)
            if snaps is not None:
                snaps.write(k + 1, lambda: self.engine.export_state(copy=False), device=device)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
                waits.append(wait)
                if previous is not None and previous.started is not None and ref is not None:
                    # The previous step's copy against this step's compute, on the device's clock.
                    previous.wait()
                    copy_s = previous.seconds() or 0.0
                    start = ref.elapsed_time(previous.started) / 1e3
                    compute = (ref.elapsed_time(begin) / 1e3, ref.elapsed_time(end) / 1e3)
                    copies.append(copy_s)
                    shared = max(0.0, min(start + copy_s, compute[1]) - max(start, compute[0]))
                    overlaps.append(shared / copy_s if copy_s > 0 else 0.0)
        if snaps is not None:
            snaps.wait()
            if snaps.error is not None:
                raise RuntimeError(f"snapshot failed: {snaps.error}")
        out: dict[str, Any] = {
            "step_s": statistics.median(times),
            "wait_s": statistics.median(waits),
            "steps": times,
        }
        if snaps is not None:
            out["thread_s"] = statistics.median(snaps.busy[-steps:])  # type: ignore[attr-defined]
        if copies:
            out["copy_s"] = statistics.median(copies)
            out["overlap"] = statistics.median(overlaps)
        return out

    def copy_floor(self, repeats: int) -> dict[str, float]:
        """One snapshot written alone (export, copy into the mapped slot, publish) and a plain host
        copy of as many bytes, best of ``repeats`` (the slot's pages allocated once, before)."""
        snaps = self.store("alone")
        device = self.device if self.device.type == "cuda" else None
        nbytes = self.engine.export_state(copy=False).nbytes()
        snaps.write(0, lambda: self.engine.export_state(copy=False), asynchronous=False, device=device)
        snaps.write(0, lambda: self.engine.export_state(copy=False), asynchronous=False, device=device)
        best = float("inf")
        for k in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            snaps.write(
                k + 1, lambda: self.engine.export_state(copy=False), asynchronous=False, device=device
            )
            best = min(best, time.perf_counter() - t0)
            if snaps.error is not None:
                raise RuntimeError(f"snapshot failed: {snaps.error}")
        snaps.remove_run()
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        memcpy = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            memcpy = min(memcpy, time.perf_counter() - t0)
        return {"bytes": nbytes, "write_alone_s": best, "memcpy_s": memcpy}


def measure(rank: Rank, variants: list[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``args.repeats`` repetitions; each runs one block of every variant, back to back (the order
    reversed every other time), so the variants of a repetition meet the same load."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    stores = {v: rank.store(v.replace(", ", "_"), timing=True) for v in variants if v != "off"}
    try:
        for r in range(args.repeats):
            for v in variants if r % 2 == 0 else variants[::-1]:
                runs[v].append(rank.run(v, stores.get(v), args.steps, args.warmup))
            print(
                f"{torch.get_num_threads()} threads, repeat {r + 1}/{args.repeats}: "
                + ", ".join(f"{v} {runs[v][-1]['step_s'] * 1e3:.1f} ms" for v in variants),
                flush=True,
            )
    finally:
        for snaps in stores.values():
            snaps.remove_run()
    return runs


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per variant, medians over the repetitions: the step, the wait before the optimizer, the
    snapshot thread's busy time, and the overhead: each repetition's step over its own ``off``
    step (the load of the machine changes from one repetition to the next, not inside one)."""
    out: dict[str, dict[str, float]] = {}
    for v, rs in runs.items():
        out[v] = {
            "step_s": statistics.median(x["step_s"] for x in rs),
            "wait_s": statistics.median(x["wait_s"] for x in rs),
            "overhead": statistics.median(
                x["step_s"] / off["step_s"] - 1 for x, off in zip(rs, runs["off"], strict=True)
            ),
            "lost_s": statistics.median(
                x["step_s"] - off["step_s"] for x, off in zip(rs, runs["off"], strict=True)
            ),
        }
        if "thread_s" in rs[0]:
            out[v]["thread_s"] = statistics.median(x["thread_s"] for x in rs)
    return out


def report(results: dict[str, Any]) -> list[str]:
    """The Markdown report of a measurement (``results`` as written to the JSON)."""
    threads = results["threads"]
    cuda = results["device"] == "cuda"
    stats = {int(t): s for t, s in results["summary"].items()}
    variants = list(stats[threads[0]])
    head = stats[threads[0]]
    nbytes, alone, memcpy = results["snapshot_bytes"], results["write_alone_s"], results["memcpy_s"]
    rows = []
    for t in threads:
        for v in variants:
            x = stats[t][v]
            steps = [r["step_s"] * 1e3 for r in results["runs"][str(t)][v]]
            rows.append(
                [
                    str(t),
                    v,
                    f"{x['step_s'] * 1e3:.1f}",
                    "-" if v == "off" else f"{x['overhead']:+.1%} ({x['lost_s'] * 1e3:+.1f} ms)",
                    f"{x['thread_s'] * 1e3:.1f}" if "thread_s" in x else "-",
                    "-" if v == "off" else f"{x['wait_s'] * 1e3:.2f}",
                    f"{min(steps):.1f} - {max(steps):.1f}",
                ]
            )
    lines = [
        "# What a node-memory snapshot after every step costs",
        "",
        describe(results["machine"]) + f"; device {results['device']}.",
        "",
        f"`python benchmarks/snapshot_cost.py{' --device cuda' if cuda else ''}`: one rank's step of "
        f"the tiny LLaMA at hidden 256 ({results['parameters']:,} parameters, fp32, "
        f"{results['microbatches']} micro-batches a step) in the order of the forward-recovery mode "
        "(compute, the wait for the previous snapshot's copy, the optimizer, the snapshot on its thread), "
        f"without MPI. {results['repeats']} repetitions, each a block of {results['steps']} timed steps "
        f"(after {results['warmup']}) of every variant back to back; medians over the repetitions, the "
        "overhead of each repetition against its own `off` block (other processes load this machine's "
        "cores, differently from one repetition to the next: the range column). The slots in "
        "`/dev/shm`. Snapshot thread: how long each write kept it busy (export, copy into the slot, "
        "publish) while the next step ran.",
        "",
        *markdown_table(
            [
                "torch threads",
                "snapshots",
                "step ms",
                "overhead",
                "snapshot thread ms",
                "wait before the optimizer ms",
                "step ms, min - max of the repetitions",
            ],
            rows,
        ),
        "",
        f"One snapshot is {nbytes / 1e6:.1f} MB (parameters and AdamW's two moments; an fp32 model "
        f"has no separate masters). Written alone, nothing else running, it takes {alone * 1e3:.1f} ms "
        f"({nbytes / alone / 1e9:.2f} GB/s, {alone / head['off']['step_s']:.1%} of a step); a plain "
        f"copy of as many bytes between two buffers takes {memcpy * 1e3:.1f} ms "
        f"({nbytes / memcpy / 1e9:.2f} GB/s).",
    ]
    if cuda and "side_stream_copy_s" in results:
        copy, overlap = results["side_stream_copy_s"], results["side_stream_overlap"]
        lines += [
            "",
            f"The side-stream copy into the pinned buffer: {copy * 1e3:.2f} ms a snapshot "
            f"({nbytes / copy / 1e9:.1f} GB/s); {overlap:.0%} of it ran while the compute stream ran "
            "the next step's forward and backward (the copy's interval against the compute's, CUDA events).",
        ]
    on = head["on"]
    if on["overhead"] > results["goal"] and not cuda:
        busy, lost = on["thread_s"], on["lost_s"]
        text = (
            f"Above the {results['goal']:.0%} goal: {on['overhead']:+.1%}, {lost * 1e3:.1f} ms a step. The "
            f"cause is CPU and memory time the step has no idle core to hide in: the next step "
            f"computes on every core ({threads[0]} torch threads on {results['cores']} cores), so the "
            f"snapshot thread, which needs {alone * 1e3:.1f} ms alone, is busy {busy * 1e3:.1f} ms "
            f"beside the compute ({nbytes / busy / 1e9:.2f} GB/s instead of {nbytes / alone / 1e9:.2f}: "
            "the cores and their memory bandwidth are shared), and the step loses "
            + (
                "about that time"
                if 0.7 * busy <= lost <= 1.3 * busy
                else ("more than that" if lost > busy else "less than that")
            )
            + f" ({lost * 1e3:.1f} ms)."
        )
        if len(threads) > 1:
            one = stats[threads[-1]]["on"]
            text += (
                f" With {threads[-1]} torch thread (a core left to the snapshot thread, shared with "
                f"whatever else runs here) the step loses {one['lost_s'] * 1e3:.1f} ms "
                f"({one['overhead']:+.1%}) for {one['thread_s'] * 1e3:.1f} ms of snapshot thread."
            )
        text += (
            " Even alone the copy is "
            f"{alone / head['off']['step_s']:.1%} of a step: the floor is bytes / memory bandwidth "
            "per snapshot, and `recover.snapshot.interval` divides it. On a GPU node the copy is the "
            "side stream's and the write into the slot one core's of many (`--device cuda`)."
        )
        lines += ["", text]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=15, help="repetitions (at least 5)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps that start each block")
    parser.add_argument(
        "--threads",
        default=None,
        help="torch threads, a comma list (default: torch's own, and 1 as well on CPU)",
    )
    parser.add_argument("--set", action="append", default=[], help="config overrides, a.b=v")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--from-json", help="write the report of an earlier measurement again, measuring nothing"
    )
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        results["lines"] = lines = report(results)
        name = "snapshot_cost" if results["device"] == "cpu" else "snapshot_cost_cuda"
        write_report(Path(args.out), name, results, lines)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    default_threads = torch.get_num_threads()
    if args.threads:
        thread_counts = [int(t) for t in args.threads.split(",")]
    else:
        thread_counts = [default_threads] + ([1] if device.type == "cpu" and default_threads > 1 else [])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="snapshot-cost-", dir=base))
    variants = ["off", "on"] + (["on, pageable"] if device.type == "cuda" else [])
    by_threads: dict[int, dict[str, list[dict[str, Any]]]] = {}
    try:
        rank = Rank(device, root, args.set)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            by_threads[threads] = measure(rank, variants, args)
        torch.set_num_threads(thread_counts[0])
        floor = rank.copy_floor(max(args.repeats, 5))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    stats = {t: summary(runs) for t, runs in by_threads.items()}
    results: dict[str, Any] = {
        "machine": machine_info(),
        "device": args.device,
        "cores": os.cpu_count(),
        "threads": thread_counts,
        "model": MODEL + args.set,
        "parameters": rank.parameters,
        "microbatches": len(rank.microbatches),
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "goal": GOAL,
        "overhead": stats[thread_counts[0]]["on"]["overhead"],
        "summary": {str(t): s for t, s in stats.items()},
        "snapshot_bytes": floor["bytes"],
        "write_alone_s": floor["write_alone_s"],
        "memcpy_s": floor["memcpy_s"],
        "runs": {str(t): runs for t, runs in by_threads.items()},
    }
    if device.type == "cuda":
        ons = [r for r in by_threads[thread_counts[0]]["on"] if "copy_s" in r]
        results["side_stream_copy_s"] = statistics.median(r["copy_s"] for r in ons)
        results["side_stream_overlap"] = statistics.median(r["overlap"] for r in ons)
    lines = report(results)
    results["lines"] = lines
    name = "snapshot_cost" if device.type == "cpu" else "snapshot_cost_cuda"
    write_report(Path(args.out), name, results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
