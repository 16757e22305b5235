"""``general.benchmark_csv_path``: one row of throughput numbers per training run, as Nanotron's.

Nanotron appends such a row (its benchmark mode) so that sweeps over layouts and batch sizes end in
one table. Here the logging rank appends it at the end of every run whose config sets the path,
with the columns of Nanotron's row that apply (job, run, nodes, sequence length, micro batch,
accumulation, global batch, tokens/s per rank, memory, layout, model shape, dtype, parameters) and
a few of its own (tokens/s of the job, mean step time, steps measured, recovery mode).
"""

from __future__ import annotations

import csv
import datetime
import fcntl
import io
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..models.llama import count_parameters


def throughput(step_times_s: Sequence[float], tokens_per_step: int) -> tuple[int, float, float]:
    """``(steps measured, tokens/s, mean step time in s)`` over the steps of one process.

    The first step is left out when there are others: it pays for start-up (allocations, the
    first collectives, lazy initialisation), which is not the rate training runs at.
    """
    times = list(step_times_s[1:] if len(step_times_s) > 1 else step_times_s)
    total = sum(times)
    if not times or total <= 0:
        return len(times), 0.0, 0.0
    return len(times), len(times) * tokens_per_step / total, total / len(times)


def benchmark_row(cfg: Config, step_times_s: Sequence[float], run: str, world_size: int) -> dict[str, Any]:
    """The row of one run: its config, and its throughput over ``step_times_s``."""
    p, t, m = cfg.parallelism, cfg.tokens, cfg.model.model_config
    steps, tokens_per_s, step_s = throughput(step_times_s, cfg.tokens_per_step)
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    cuda = torch.cuda.is_available()
    # Nanotron's run names may hold %date and %jobid, which it fills in the same way.
    name = run.replace("%date", datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))
    name = name.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))
    return {
        "job_id": os.environ.get("SLURM_JOB_ID", "N/A"),
        "name": name,
        "nodes": math.ceil(world_size / max(local, 1)),
        "world_size": world_size,
        "seq_len": t.sequence_length,
        "mbs": t.micro_batch_size,
        "batch_accum": t.batch_accumulation_per_replica,
        "gbs": t.micro_batch_size * t.batch_accumulation_per_replica * p.dp,
        "steps_measured": steps,
        "step_time_s": f"{step_s:.4f}",
        "tokens_per_s": f"{tokens_per_s:.2f}",
        "tok/s/gpu": f"{tokens_per_s / world_size:.2f}",
        # This (logging) rank's peak, as Nanotron reports its rank 0's; empty on CPU.
        "Mem Alloc (GB)": f"{torch.cuda.max_memory_allocated() / 1024**3:.2f}" if cuda else "",
        "Mem Res (GB)": f"{torch.cuda.max_memory_reserved() / 1024**3:.2f}" if cuda else "",
        "dp": p.dp,
        "pp": p.pp,
        "tp": p.tp,
        "dp_shard": p.dp_shard,
        "pp_engine": p.pp_engine,
        "tp_mode": p.tp_mode,
        "recompute_layer": str(p.recompute_layer),
        "recover": cfg.recover.mode if cfg.recover.enabled else "off",
        "hidden_size": m.hidden_size,
        "num_layers": m.num_hidden_layers,
        "num_heads": m.num_attention_heads,
        "num_kv_heads": m.kv_heads,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": str(m.tie_word_embeddings),
        "dtype": cfg.model.dtype,
        "Total Params": count_parameters(m),
    }


def append_row(path: str | Path, row: dict[str, Any]) -> Path:
    """Append ``row`` to the CSV at ``path`` (its parent folders made), writing the header first
    when the file is new or empty. The file is locked while written, so runs that share one CSV
    (a sweep) do not interleave their rows."""
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    with open(path, "a+", newline="") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                writer.writerow(list(row))
            writer.writerow(list(row.values()))
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return path


def report_run_row(cfg: Config, step_times_s: Sequence[float], run: str) -> None:
    """Append a run's throughput row to ``general.benchmark_csv_path``. A row that cannot be
    written is reported, not fatal: the training it measures is done."""
    path = cfg.general.benchmark_csv_path
    try:
        append_row(path, benchmark_row(cfg, step_times_s, run, cfg.world_size))
    except OSError as e:
        print(f"[nanotron-recover] could not write benchmark row to {path}: {e}", file=sys.stderr, flush=True)
