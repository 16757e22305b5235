"""A longer chaos campaign on this host: every one-host fault kind, sent from outside to a real job.

Runs ``nanotron-recover chaos`` (the command is the benchmark; this script only fixes the
campaign and keeps its report) on the tiny CPU model: 4 replicas with re-join, exact mode (bit for
bit against the plain run), checkpoints every ``--checkpoint-interval`` steps, node-memory snapshots every step, ``--faults`` faults drawn with
``--seed`` from kill, freeze, kill_two, kill_all, kill_during_recovery, kill_during_rejoin,
kill_during_save and kill_during_snapshot. Writes ``benchmarks/results/chaos_local.json`` and
``chaos_local.md`` (the campaign's ``chaos.json`` / ``chaos.md`` with the machine added);
``--replay benchmarks/results/chaos_local.json`` sends the same schedule again.

    python benchmarks/chaos.py [--seed 3] [--faults 10] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import describe, machine_info, portable, write_json

from nanotron_recover.chaos.kinds import LOCAL_KINDS
from nanotron_recover.demo import tiny_config_path


def campaign_sets(steps: int, dp: int, checkpoint_interval: int) -> list[str]:
    return [
        "model.model_config.hidden_size=32",
        "model.model_config.intermediate_size=64",
        "tokens.sequence_length=32",
        "tokens.micro_batch_size=1",
        f"tokens.train_steps={steps}",
        f"parallelism.dp={dp}",
        "tokens.batch_accumulation_per_replica=2",
        "recover.enabled=true",
        # Exact mode: the job must equal the one-process plain run bit for bit. Without it the
        # summation order of 4 replicas against 1 process drifts the loss past any fixed tolerance
        # within a few hundred steps, faults or not (1e-5 relative first exceeded at step 218).
        "recover.exact=true",
        "recover.rejoin.mode=spawn",
        "recover.rejoin.max_failures_per_replica=10",
        "recover.rejoin.join_timeout_s=60",
        "recover.heartbeat_period_s=0.5",
        "recover.heartbeat_timeout_s=3",
        "recover.watchdog_timeout_s=60",
        "recover.gate_timeout_s=30",
        f"checkpoints.checkpoint_interval={checkpoint_interval}",
        "checkpoints.save_final_state=false",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--checkpoint-interval", type=int, default=25)
    parser.add_argument("--kinds", default=",".join(LOCAL_KINDS))
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--keep-run",
        type=Path,
        help="copy the campaign's run folder (the job's log, incidents, stall traces) here at the end",
    )
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "nanotron_recover.cli", "chaos", "--config", str(tiny_config_path())]
        cmd += ["--run-dir", str(run_dir), "--seed", str(args.seed), "--faults", str(args.faults)]
        cmd += ["--kinds", args.kinds, "--first-step", "20", "--timeout-s", str(args.timeout_s)]
        for s in campaign_sets(args.steps, args.dp, args.checkpoint_interval):
            cmd += ["--set", s]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout_s + 300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
        if args.keep_run is not None:
            shutil.copytree(run_dir, args.keep_run, dirs_exist_ok=True)
        record = json.loads((run_dir / "chaos.json").read_text())
        machine = machine_info()
        record["machine"] = machine
        record["benchmark"] = {"command": " ".join(cmd[1:]), "chaos_exit_status": rc}
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "chaos_local.json", record, indent=1)
        header = [
            f"{describe(machine)}. `python benchmarks/chaos.py --seed {args.seed} --faults {args.faults} "
            f"--steps {args.steps}`: {args.dp} replicas of the tiny model (hidden 32), re-join on, "
            "every fault sent from outside by `nanotron-recover chaos`.",
            "",
        ]
        # Through portable(), like the JSON: the report names the scratch run folder.
        report = portable("\n".join(header) + (run_dir / "chaos.md").read_text())
        (out / "chaos_local.md").write_text(report)
        print((out / "chaos_local.md").read_text())
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
