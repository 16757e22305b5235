"""The ablation: static world vs adaptive world, and what spares are for, in the real engine.

One fault schedule, five runs of the tiny LLaMA on 4 replicas with one micro-batch each (``B = 4``):

* ``plain``: no faults, the reference curve;
* ``static+shadow`` (the default): every step sums the same ``B`` micro-batches; a replica left over
  by ``G = ceil(B/W)`` shadows a Major, so a dead Major's work is covered for free;
* ``static+zero``: the paper's spares: they compute too and contribute zeros, but a dead Major's
  micro-batches are recomputed by the survivors;
* ``static+off``: idle spares; a dead Major's micro-batches are recomputed;
* ``adaptive``: what elastic trainers do (torchft): lost micro-batches are dropped, every step
  averages over what was summed, the batch shrinks with the world.

The schedule loses half the replicas: replica 3 at step ``steps/3`` (3 left: ``G = 2``, two Majors and
one spare shadowing replica 0), then replica 0, the shadowed Major, at ``2*steps/3``. Per run: loss
deviation from plain per step (max, and mean over the last 10 steps), committed tokens, effective
tokens/s per rank (committed tokens over wall time, divided by the initial ranks), and the
micro-batches recomputed at the faults. Writes ``ablation.{json,md,png}`` to ``--out``.

    python benchmarks/ablation.py          # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from common import describe, machine_info, markdown_table, run_training, write_report  # noqa: E402

from nanotron_recover.data import ensure_local_dataset  # noqa: E402
from nanotron_recover.logging import read_incidents, read_metrics  # noqa: E402

RUNS: list[tuple[str, list[str]]] = [
    ("plain", []),
    ("static+shadow", ["recover.policy=static_world", "recover.spares=shadow"]),
    ("static+zero", ["recover.policy=static_world", "recover.spares=zero"]),
    ("static+off", ["recover.policy=static_world", "recover.spares=off"]),
    ("adaptive", ["recover.policy=adaptive_world", "recover.spares=off"]),
]
REPLICAS = 4


def summarize(name: str, run_dir: Path, wall_s: float, plain: list[dict] | None) -> dict:
    metrics = read_metrics(run_dir)
    incidents = read_incidents(run_dir)
    committed = sum(r["tokens"] for r in metrics)
    deviation = (
        [abs(r["loss"] - p["loss"]) for r, p in zip(metrics, plain, strict=True)]
        if plain
        else [0.0] * len(metrics)
    )
    same_ids = plain is None or all(
        r["ids_digest"] == p["ids_digest"] for r, p in zip(metrics, plain, strict=True)
    )
    return {
        "run": name,
        "wall_s": wall_s,
        "committed_steps": len(metrics),
        "committed_tokens": committed,
        "effective_tokens_per_s_per_rank": committed / wall_s / REPLICAS,
        "faults": len(incidents),
        "actions": [i["action"] for i in incidents],
        "recomputed_microbatches": sum(i["extra_microbatches"] for i in incidents),
        "dropped_microbatches": sum(len(i["lost_ids"]) for i in incidents if i["action"] == "drop"),
        "same_ids_as_plain": same_ids,
        "max_abs_loss_deviation": max(deviation),
        "mean_abs_loss_deviation_last10": statistics.mean(deviation[-10:]),
        "loss": [r["loss"] for r in metrics],
        "loss_deviation": deviation,
        "step_time_s": [r["step_time_s"] for r in metrics],
    }


def plot(results: list[dict], fault_steps: list[int], out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        steps = range(1, len(r["loss"]) + 1)
        a.plot(steps, r["loss"], label=r["run"], linewidth=1.1)
        if r["run"] != "plain":
            b.semilogy(steps, [max(d, 1e-12) for d in r["loss_deviation"]], label=r["run"], linewidth=1.1)
    for ax in (a, b):
        for s in fault_steps:
            ax.axvline(s, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlabel("step")
        ax.legend()
    a.set_ylabel("loss")
    a.set_title("Loss per step (dotted: a replica fails)")
    b.set_ylabel("|loss - plain loss| (floor 1e-12)")
    b.set_title("Deviation from the fault-free run")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    steps = args.steps
    faults = [
        {"step": steps // 3, "replica": 3, "phase": "forward"},
        {"step": 2 * steps // 3, "replica": 0, "phase": "backward"},
    ]
    out = Path(args.out)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        common = [
            f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
            f"tokenizer.tokenizer_name_or_path={data.tokenizer_dir}",
            f"parallelism.dp={REPLICAS}",
            "tokens.batch_accumulation_per_replica=1",
            f"tokens.train_steps={steps}",
            "checkpoints.save_final_state=false",
        ]
        plain = None
        for name, extra in RUNS:
            run_dir = tmp / name
            sets = common + (
                [] if name == "plain" else ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"]
            )
            started = time.perf_counter()
            run_training(run_dir, sets + extra, REPLICAS)
            summary = summarize(name, run_dir, time.perf_counter() - started, plain)
            results.append(summary)
            if name == "plain":
                plain = read_metrics(run_dir)
            print(
                f"{name}: {summary['wall_s']:.1f}s, max dev {summary['max_abs_loss_deviation']:.2e}",
                flush=True,
            )
    out.mkdir(parents=True, exist_ok=True)
    plot(results, [f["step"] for f in faults], out / "ablation.png")
    ours = next(r for r in results if r["run"] == "static+shadow")
    columns = [
        "run",
        "same ids as plain",
        "max abs loss dev.",
        "mean abs dev. (last 10 steps)",
        "committed tokens",
        "recomputed / dropped micro-batches",
        "effective tokens/s/rank",
        "vs static+shadow",
    ]
    rows = [
        [
            r["run"],
            "yes" if r["same_ids_as_plain"] else "no",
            f"{r['max_abs_loss_deviation']:.2e}",
            f"{r['mean_abs_loss_deviation_last10']:.2e}",
            r["committed_tokens"],
            f"{r['recomputed_microbatches']} / {r['dropped_microbatches']}",
            f"{r['effective_tokens_per_s_per_rank']:.0f}",
            f"{r['effective_tokens_per_s_per_rank'] / ours['effective_tokens_per_s_per_rank']:.2f}",
        ]
        for r in results
    ]
    machine = machine_info()
    header = (
        f"{describe(machine)}. Tiny LLaMA, {REPLICAS} replicas x 1 micro-batch (B=4), {steps} steps; "
        f"replica 3 fails at step {faults[0]['step']} (forward), replica 0, the Major a spare shadows, "
        f"at step {faults[1]['step']} (backward)."
    )
    data_out = {"machine": machine, "steps": steps, "faults": faults, "runs": results}
    write_report(out, "ablation", data_out, [header, "", *markdown_table(columns, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
