"""``nanotron-recover demo``: the main job on an embedded default, no network, a few minutes on CPU.

1. Builds the offline corpus (a BPE tokenizer and tokens from Python's standard-library docstrings).
2. Trains the tiny LLaMA of ``configs/tiny_cpu.yaml`` on 4 data-parallel replicas in plain mode:
   the fault-free reference.
3. Trains it again in the fault-tolerant mode while replicas are killed mid-step (SIGKILL): one in
   the forward pass, one in the middle of the gradient reduction.
4. Prints the comparison (same micro-batch ids every step, loss difference at rounding level) and
   the incidents, and writes the loss-curve plot.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from .config import Config, load_config
from .data import ensure_local_dataset
from .launcher import heartbeat_of, train_command
from .logging import read_incidents
from .supervisor import default_grace_s, supervise

REPLICAS = 4


def tiny_config_path() -> Path:
    """The tiny CPU config, shipped inside the package so the demo works from any directory."""
    return Path(str(resources.files("nanotron_recover") / "configs" / "tiny_cpu.yaml"))


def demo_faults(steps: int) -> list[dict]:
    """Two replicas lost at a third and two thirds of the run, in two different phases."""
    first, second = max(steps // 3, 1), max(2 * steps // 3, 2)
    return [
        {"step": first, "replica": 3, "phase": "forward", "microbatch": 1},
        {"step": second, "replica": 1, "phase": "reduce", "microbatch": 0},
    ]


def _train(
    cfg: Config, config: Path, run_dir: Path, overrides: list[str], nproc: int, timeout_s: float
) -> int:
    """Train under the launcher's supervisor: the status is the run's own record of how it ended."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = train_command(config, run_dir, overrides, nproc, heartbeat=heartbeat_of(cfg))
    return supervise(
        cmd,
        run_dir,
        grace_s=default_grace_s(cfg.recover.heartbeat_timeout_s),
        target_step=cfg.tokens.train_steps,
        env=env,
        timeout_s=timeout_s,
        prefix="nanotron-recover demo",
    )


def run_demo(out: Path, steps: int | None = None, timeout_s: float = 1800) -> int:
    from .compare import compare_runs, format_comparison, plot_comparison

    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building the offline corpus under {out / 'data'}", flush=True)
    data = ensure_local_dataset(out / "data")
    config = tiny_config_path()
    common = [
        f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
        f"parallelism.dp={REPLICAS}",
        "tokens.batch_accumulation_per_replica=2",
    ]
    if steps is not None:
        common.append(f"tokens.train_steps={steps}")
    cfg = load_config(config, common)
    steps = cfg.tokens.train_steps
    faults = demo_faults(steps)
    runs = {
        "plain": common,
        "recover": common + ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"],
    }
    for name, overrides in runs.items():
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a previous demo's metrics, checkpoints, faults
        print(
            f"\n[demo] {name}: {cfg.world_size} ranks, B={cfg.microbatches_per_step}, {steps} steps",
            flush=True,
        )
        code = _train(
            cfg,
            config,
            run_dir,
            overrides + [f"checkpoints.checkpoints_path={run_dir / 'ckpt'}"],
            cfg.world_size,
            timeout_s,
        )
        if code != 0:
            print(f"[demo] {name} training failed with exit status {code}", file=sys.stderr)
            return code

    result = compare_runs([out / "plain", out / "recover"])
    print("\n" + format_comparison(result))
    print("\nincidents (recover):")
    for inc in read_incidents(out / "recover"):
        print(
            f"  step {inc['step']}: replicas {inc['failed_replicas']} killed in {inc['phase']}, "
            f"{inc['action']}, {inc['extra_microbatches']} micro-batches redone, "
            f"detected in {inc['detect_s']:.3f}s, recovered in {inc['recover_s']:.3f}s"
        )
    png = plot_comparison(result, out / "comparison.png")
    print(f"\n[demo] plot: {png}\n[demo] runs: {out / 'plain'}, {out / 'recover'}")
    return 0
