"""The paper's 512-A100 run, by the fault simulator: forward recovery vs checkpoint-restart.

LLaMA-7B on C4 (``configs/llama7b_c4.yaml``: tp=4, pp=2, dp=64, B=8192 micro-batches of 2048
tokens), a replica group (8 GPUs) failing every 5 steps until 32 replicas (256 GPUs) are gone,
checkpoints every 2, 16 and 64 steps, all runs compared at the paper's 234 GPU-hours (1,645 s of
the 512-GPU allocation). Constants: the ``a100-512`` profile (``nanotron-recover simulate
--constants``). Crashes in the forward pass of the first micro-batch (as in benchmarks/faults.py),
and a second table with hangs (found by the 10 s heartbeat timeout of the config) striking halfway
through a step's compute. Writes ``simulate_512.{json,md,png}`` to ``--out``; nothing is measured,
it runs in seconds.

    python benchmarks/simulate_512.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import markdown_table, write_report

from nanotron_recover.config import add_config_arguments
from nanotron_recover.simulate.constants import get_profile
from nanotron_recover.simulate.events import CKPT, FORWARD, REJOIN, breakdown
from nanotron_recover.simulate.options import add_simulate_arguments
from nanotron_recover.simulate.report import (
    PAPER,
    Simulation,
    format_rows,
    header,
    paper_lines,
    plot,
    run_simulation,
    to_json,
)

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama7b_c4.yaml"
COMMON = ["--every", "5", "--until", "32", "--budget-gpu-hours", "234", "--rejoin"]


def simulation(extra: list[str]) -> Simulation:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    add_simulate_arguments(parser)
    return run_simulation(parser.parse_args(["--config", str(CONFIG), *COMMON, *extra]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    crash = simulation(["--fault-kind", "crash", "--fault-at", "0"])
    hang = simulation(["--fault-kind", "hang", "--fault-at", "0.5"])
    plot(crash, out / "simulate_512.png")
    unit = breakdown(crash.workload, get_profile("a100-512"))

    def hang_rows() -> list[str]:
        rows = [
            [r.run, r.faults, f"{r.stall_mean_s:.1f} ({r.stall_max_s:.1f})", f"{r.ratio_vs_forward:.2f}"]
            for r in hang.rows
        ]
        return markdown_table(["run", "faults", "stall/fault mean (max) s", "vs forward"], rows)

    b = unit
    lines = [
        "# The paper's 512-A100 run, simulated",
        "",
        "`python benchmarks/simulate_512.py` (the same as `nanotron-recover simulate --config "
        "configs/llama7b_c4.yaml " + " ".join(COMMON) + " --fault-at 0`). A model, not a measurement: "
        "its constants and their sources are listed by `nanotron-recover simulate --constants`; the "
        "ones that matter most here (MFU, start-up, file-system bandwidth) are assumed, the repair cost "
        "is extrapolated from 4-16 CPU ranks. Its this-machine twin is checked against measurements in "
        "[simulate_validation.md](simulate_validation.md).",
        "",
        *[f"- {line}" for line in header(crash)],
        "",
        "## Crashes (forward pass of the first micro-batch)",
        "",
        *format_rows(crash),
        "",
        *[f"- {line}" for line in paper_lines(crash)],
        "",
        "Stall per fault: forward, the fault step's extra time; checkpoint-restart, the time lost from "
        "the fault to the failed step's re-commit (relaunch, start-up, load, recompute); the paper's "
        "figures match the model's *max* per fault (a fault just before the next checkpoint). Tokens "
        "are those of the steps that stand at the budget; late tokens/s is the last quarter of it.",
        "",
        "## Hangs (halfway through a step's compute, detected by the 10 s heartbeat timeout)",
        "",
        *hang_rows(),
        "",
        "## Unit costs at full width (64 replicas)",
        "",
        *markdown_table(
            ["term", "seconds"],
            [
                ["fault-free step (compute + DP reduce + optimizer)", f"{b['step_s']:.2f}"],
                ["  compute: (128 + pp - 1) micro-batches x one stage", f"{b['compute_s']:.2f}"],
                ["  cross-replica reduce + optimizer (forward-recovery path)", f"{b['reduce_ft_s']:.2f}"],
                ["forward: detect a crash / a hang", f"{b['detect_crash_s']:.3f} / {b['detect_hang_s']:.1f}"],
                [
                    "forward: repair at 512 ranks (revoke, shrink, agree; extrapolated)",
                    f"{b['repair_s']:.4f}",
                ],
                [
                    f"forward: redo G_ext = {b['g_ext_first_fault']:.0f} micro-batches (first fault)",
                    f"{b['redo_first_fault_s']:.2f}",
                ],
                ["ckpt: relaunch (tear down, mpirun again)", f"{b['relaunch_s']:.1f}"],
                ["ckpt: start-up of 512 ranks", f"{b['restart_start_s']:.1f}"],
                [
                    f"ckpt: load ({b['state_bytes_per_rank'] / 2**30:.1f} GiB per rank, 512 ranks)",
                    f"{b['load_s']:.1f}",
                ],
                ["ckpt: restart before recompute", f"{b['restart_s']:.1f}"],
                [
                    "ckpt: save, blocking (stage to CPU) / background write",
                    f"{b['save_block_s']:.2f} / {b['save_write_s']:.1f}",
                ],
                ["re-join: spawn + state transfer + rebuild + agree", f"{b['join_s']:.1f}"],
            ],
        ),
    ]
    data = {
        "paper": PAPER,
        "unit_costs_s": unit,
        "crash": to_json(crash),
        "hang": to_json(hang),
        "modes": [FORWARD, CKPT, REJOIN],
    }
    write_report(out, "simulate_512", data, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
