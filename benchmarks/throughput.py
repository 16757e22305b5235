"""Training throughput of the plain trainer: tokens/s for the tiny CPU config, and for a GPU-sized
config when a GPU is present.

Writes ``benchmarks/results/throughput.json`` and ``throughput.md``. The first steps are warm-up and
are left out of the median.

    python benchmarks/throughput.py [--steps 30] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from common import describe, machine_info, markdown_table, run_training, write_report

from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.logging import read_metrics

WARMUP_STEPS = 3


def measure(name: str, overrides: list[str], nproc: int, workdir: Path, timeout_s: float) -> dict:
    run_dir = workdir / name
    run_training(run_dir, overrides, nproc, timeout_s)
    rows = read_metrics(run_dir)[WARMUP_STEPS:]
    tps = [r["tokens_per_s"] for r in rows]
    return {
        "name": name,
        "ranks": nproc,
        "steps_measured": len(rows),
        "tokens_per_step": rows[0]["tokens"],
        "median_tokens_per_s": statistics.median(tps),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in rows),
        # The corpus lives in a temporary folder: leave its path out of the committed results.
        "overrides": [o for o in overrides if not o.startswith("data_stages")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        corpus = f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}"
        steps = f"tokens.train_steps={args.steps}"
        common = [corpus, steps, "checkpoints.save_final_state=false"]
        results.append(measure("tiny-cpu dp=2", common, 2, tmp, 1800))
        results.append(
            measure(
                "tiny-cpu tp=2 pp=2 dp=1",
                common
                + [
                    "parallelism.dp=1",
                    "parallelism.tp=2",
                    "parallelism.pp=2",
                    "tokens.batch_accumulation_per_replica=8",
                ],
                4,
                tmp,
                1800,
            )
        )
        if torch.cuda.is_available():
            gpu = [
                steps,
                "checkpoints.save_final_state=false",
                "parallelism.dp=1",
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
            results.append(measure("llama-0.9B bf16 1 GPU", gpu, 1, tmp, 3000))
    machine = machine_info()
    columns = ["run", "ranks", "tokens/step", "median step time (s)", "median tokens/s"]
    rows = [
        [
            r["name"],
            r["ranks"],
            r["tokens_per_step"],
            f"{r['median_step_time_s']:.4f}",
            f"{r['median_tokens_per_s']:.0f}",
        ]
        for r in results
    ]
    data = {"machine": machine, "results": results}
    write_report(out, "throughput", data, [describe(machine), "", *markdown_table(columns, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
