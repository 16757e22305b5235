"""Equivalence check for a machine with one GPU: 3 replicas (tp=pp=1, each its own torch world on
the same GPU; NCCL refuses two ranks of one world on one GPU) lose one replica mid-step; the run
must match the plain run step by step.

The DP reduction goes over MPI from the CUDA gradient buffers (staged through host memory). Writes
``gpu_recovery.json`` and ``gpu_recovery.md`` to ``--out``. Runs on CPU too (``--cpu``), which is how
the script itself is checked on machines without a GPU.

    python benchmarks/gpu_recovery_check.py [--cpu] [--steps 12] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import markdown_table, write_report

from nanotron_recover.cli import train_command
from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.logging import read_incidents, read_metrics


def train(run_dir: Path, sets: list[str], nproc: int, env: dict[str, str]) -> None:
    subprocess.run(train_command(tiny_config_path(), run_dir, sets, nproc), check=True, timeout=900, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (checks the script itself)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.cpu:
        env["NANOTRON_RECOVER_DEVICE"] = "cpu"
    device = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        common = [
            f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
            f"tokens.train_steps={args.steps}",
            "checkpoints.save_final_state=false",
            "model.dtype=float32",
            "model.model_config.hidden_size=256",
            "model.model_config.intermediate_size=688",
            "model.model_config.num_hidden_layers=4",
            "tokens.sequence_length=128",
            "tokens.micro_batch_size=4",
        ]
        train(tmp / "plain", common + ["parallelism.dp=1", "tokens.batch_accumulation_per_replica=6"], 1, env)
        faults = [{"step": 3, "replica": 1, "phase": "backward", "microbatch": 1}]
        recover = common + [
            "parallelism.dp=3",
            "tokens.batch_accumulation_per_replica=2",
            "recover.enabled=true",
            f"recover.faults={json.dumps(faults)}",
        ]
        train(tmp / "recover", recover, 3, env)
        plain, rec = read_metrics(tmp / "plain"), read_metrics(tmp / "recover")
        incidents = read_incidents(tmp / "recover")
        digests = {p.read_text().strip() for p in (tmp / "recover" / "parameters").glob("*.sha256")}
    rows = []
    for p, r in zip(plain, rec, strict=True):
        rel = abs(p["loss"] - r["loss"]) / abs(p["loss"])
        rows.append(
            {
                "step": p["step"],
                "plain": p["loss"],
                "recover": r["loss"],
                "rel_diff": rel,
                "ids_equal": p["ids_digest"] == r["ids_digest"],
                "replicas": r["replicas"],
            }
        )
    ok = (
        all(x["ids_equal"] and x["rel_diff"] <= 1e-5 for x in rows)
        and len(digests) == 1
        and len(incidents) == 1
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": device,
        "ok": ok,
        "steps": rows,
        "incidents": incidents,
        "replica_digests": len(digests),
    }
    name = "gpu_recovery" if device != "cpu" else "gpu_recovery_cpu_dryrun"
    table = markdown_table(
        ["step", "plain loss", "recover loss", "rel diff", "ids equal", "replicas"],
        [
            [
                x["step"],
                f"{x['plain']:.6f}",
                f"{x['recover']:.6f}",
                f"{x['rel_diff']:.1e}",
                x["ids_equal"],
                x["replicas"],
            ]
            for x in rows
        ],
    )
    header = f"Device: {device}. 3 replicas (tp=pp=1), replica 1 killed at step 3 (backward). ok={ok}"
    write_report(out, name, result, [header, "", *table])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
