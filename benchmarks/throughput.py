"""Training throughput and peak memory of the plain trainer: the 3D engine and HSDP on the same model.

Rows for the tiny CPU config (the local docstring corpus), grouped by world size so that each HSDP
row sits next to 3D rows with as many ranks and the same tokens per step:

- 2 ranks: ``3d dp=2``, ``3d tp=2 x dp=1``, ``hsdp dp_shard=2 x dp=1``
- 4 ranks: ``3d tp=2 x pp=2 x dp=1``, ``3d tp=2 x dp=2``, ``hsdp dp_shard=2 x dp=2``

and a GPU-sized config on one GPU when a GPU is present. tokens/s is the median over the steps after
the first few (warm-up). Peak memory per rank is read from outside the job: while it runs, every
0.2 s, the ``VmHWM`` (peak resident set) in ``/proc/<pid>/status`` of each rank process (a process
whose command line runs ``nanotron_recover.cli`` for this run's folder); the table gives the largest
over the ranks.

Writes ``benchmarks/results/throughput.json`` and ``throughput.md``.

    python benchmarks/throughput.py [--steps 20 | --quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import describe, machine_info, markdown_table, run_training, write_report

from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.logging import read_metrics

WARMUP_STEPS = 3
DEFAULT_STEPS = 20
QUICK_STEPS = 8
POLL_S = 0.2
RUN_TIMEOUT_S = 600
GPU_TIMEOUT_S = 3000
RANK_MODULE = b"nanotron_recover.cli"
MIB = 1024 * 1024

MICROBATCHES_PER_STEP = 8  # the tiny config's dp=2 x batch_accumulation_per_replica=4


def layout(dp: int, tp: int = 1, pp: int = 1, dp_shard: int = 1) -> tuple[str, list[str], int]:
    """(row name, overrides, ranks) of one layout of the tiny config. Every layout keeps the same
    micro-batches per step (dp x batch_accumulation_per_replica), so all rows train on the same
    tokens per step."""
    if dp_shard > 1:
        name = f"hsdp dp_shard={dp_shard} x dp={dp}"
    else:
        name = "3d " + " x ".join([f"tp={tp}"] * (tp > 1) + [f"pp={pp}"] * (pp > 1) + [f"dp={dp}"])
    sizes = {"dp": dp, "tp": tp, "pp": pp, "dp_shard": dp_shard}
    overrides = [f"parallelism.{k}={v}" for k, v in sizes.items()]
    overrides.append(f"tokens.batch_accumulation_per_replica={MICROBATCHES_PER_STEP // dp}")
    return name, overrides, dp * tp * pp * dp_shard


# Grouped by world size: each HSDP row next to 3D rows with as many ranks.
TINY_ROWS = [
    layout(dp=2),
    layout(dp=1, tp=2),
    layout(dp=1, dp_shard=2),
    layout(dp=1, tp=2, pp=2),
    layout(dp=2, tp=2),
    layout(dp=2, dp_shard=2),
]

GPU_MODEL = [
    "model.dtype=bfloat16",
    "model.model_config.hidden_size=2048",
    "model.model_config.intermediate_size=5504",
    "model.model_config.num_attention_heads=16",
    "model.model_config.num_key_value_heads=16",
    "model.model_config.num_hidden_layers=16",
    "model.model_config.vocab_size=32000",
    "model.model_config.max_position_embeddings=2048",
    "tokens.sequence_length=2048",
    "tokens.micro_batch_size=4",
    "tokens.batch_accumulation_per_replica=4",
]


class PeakRSS:
    """The peak resident set (``VmHWM``) of each rank of one run, polled from ``/proc`` while it runs.

    A rank is a process whose command line is ``python -m nanotron_recover.cli ...`` and holds the
    run folder as one of its arguments; ``mpirun`` (whose command line holds both too, but not as its
    first arguments) is left out. ``VmHWM`` only grows, so sampling misses at most what a rank adds in
    its last ``period_s`` before it exits."""

    def __init__(self, run_dir: Path, period_s: float = POLL_S):
        self.marker = os.fsencode(str(run_dir))
        self.period_s = period_s
        self.peak_kib: dict[int, int] = {}  # pid -> largest VmHWM seen, KiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def _is_rank(self, argv: list[bytes]) -> bool:
        return len(argv) > 3 and argv[1] == b"-m" and argv[2] == RANK_MODULE and self.marker in argv

    def sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                # The command line is read every time: a forked launcher daemon becomes a rank by exec,
                # keeping its pid.
                with open(f"{entry.path}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if not self._is_rank(argv):
                    continue
                with open(f"{entry.path}/status") as f:
                    status = f.read()
            except OSError:  # the process ended meanwhile
                continue
            found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
            if found:
                pid = int(entry.name)
                self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), int(found.group(1)))

    def per_rank_mib(self) -> list[float]:
        """Peak resident set of every rank seen, in MiB, largest first."""
        return sorted((kib * 1024 / MIB for kib in self.peak_kib.values()), reverse=True)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def measure(name: str, overrides: list[str], nproc: int, workdir: Path, timeout_s: float) -> dict:
    run_dir = workdir / slug(name)
    start = time.perf_counter()
    with PeakRSS(run_dir) as memory:
        run_training(run_dir, overrides, nproc, timeout_s)
    wall_s = time.perf_counter() - start
    rows = read_metrics(run_dir)[WARMUP_STEPS:]
    tps = [r["tokens_per_s"] for r in rows]
    per_rank = memory.per_rank_mib()
    if len(per_rank) != nproc:
        print(f"warning: {name}: saw {len(per_rank)} rank processes, expected {nproc}", file=sys.stderr)
    result = {
        "name": name,
        "engine": "hsdp" if name.startswith("hsdp") else "3d",
        "ranks": nproc,
        "steps_measured": len(rows),
        "tokens_per_step": rows[0]["tokens"],
        "median_tokens_per_s": statistics.median(tps),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in rows),
        "peak_rss_mib_max_over_ranks": per_rank[0] if per_rank else None,
        "peak_rss_mib_per_rank": [round(m, 1) for m in per_rank],
        "ranks_sampled": len(per_rank),
        "wall_s": round(wall_s, 1),
        # The corpus lives in a temporary folder: leave its path out of the committed results.
        "overrides": [o for o in overrides if not o.startswith("data_stages")],
    }
    mem = f"{result['peak_rss_mib_max_over_ranks']:.0f} MiB" if per_rank else "n/a"
    print(f"{name}: {result['median_tokens_per_s']:.0f} tokens/s, peak RSS {mem}, {wall_s:.0f} s", flush=True)
    return result


def notes(steps: int) -> list[str]:
    return [
        "Notes:",
        "",
        f"- {steps} steps per run, the first {WARMUP_STEPS} left out of the medians; one thread per rank "
        "(`OMP_NUM_THREADS=1`), ranks oversubscribed when there are more than CPUs.",
        "- Rows with the same number of ranks train the same model on the same tokens per step "
        "(dp x batch_accumulation_per_replica = 8 micro-batches), so they compare the engines directly.",
        "- Peak RSS per rank: the largest `VmHWM` (peak resident set) over the rank processes, sampled "
        f"from `/proc/<pid>/status` every {POLL_S} s while the job runs. On CPU it is dominated by the "
        "Python interpreter, torch and the MPI libraries: the tiny model has about 0.14 M parameters, "
        "so its parameters, gradients and AdamW state are a few MiB and what HSDP shards barely shows "
        "at this size.",
        "- On GPU the column is still the host process's resident set; the GPU memory of a rank would "
        "need `torch.cuda.max_memory_allocated()` read inside the ranks, which the trainer does not "
        "record.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    n_steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if n_steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dataset = ensure_local_dataset(tmp / "data")
        corpus = f"data_stages.0.data.dataset={{dataset_folder: {dataset.corpus_dir}}}"
        steps = f"tokens.train_steps={n_steps}"
        common = [corpus, steps, "checkpoints.save_final_state=false"]
        for name, overrides, nproc in TINY_ROWS:
            results.append(measure(name, common + overrides, nproc, tmp, RUN_TIMEOUT_S))
        if torch.cuda.is_available():
            gpu = [steps, "checkpoints.save_final_state=false", "parallelism.dp=1", *GPU_MODEL]
            results.append(measure("llama-0.9B bf16 1 GPU", gpu, 1, tmp, GPU_TIMEOUT_S))
    data = {"machine": machine_info(), "steps": n_steps, "warmup_steps": WARMUP_STEPS, "results": results}
    write_report(out, "throughput", data, report_lines(data))
    return 0


def report_lines(data: dict) -> list[str]:
    """The Markdown report of ``data`` (what ``throughput.json`` holds)."""
    columns = [
        "run",
        "ranks",
        "tokens/step",
        "median step time (s)",
        "median tokens/s",
        "peak RSS per rank (MiB, max over ranks)",
    ]
    rows = [
        [
            r["name"],
            r["ranks"],
            r["tokens_per_step"],
            f"{r['median_step_time_s']:.4f}",
            f"{r['median_tokens_per_s']:.0f}",
            "n/a" if r["peak_rss_mib_max_over_ranks"] is None else f"{r['peak_rss_mib_max_over_ranks']:.0f}",
        ]
        for r in data["results"]
    ]
    return [describe(data["machine"]), "", *markdown_table(columns, rows), "", *notes(data["steps"])]


if __name__ == "__main__":
    sys.exit(main())
