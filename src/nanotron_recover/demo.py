"""``nanotron-recover demo``: the main job on an embedded default, no network, a few minutes on CPU.

Builds the offline corpus (BPE tokenizer + tokens from Python's standard-library docstrings), then
trains the tiny LLaMA of ``configs/tiny_cpu.yaml`` with two data-parallel replicas under mpirun and
prints the loss curve.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

from .cli import mpirun_command
from .config import load_config
from .data import ensure_local_dataset
from .logging import read_metrics


def tiny_config_path() -> Path:
    """The tiny CPU config, shipped inside the package so the demo works from any directory."""
    return Path(str(resources.files("nanotron_recover") / "configs" / "tiny_cpu.yaml"))


def run_demo(out: Path, steps: int | None = None, timeout_s: float = 1800) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building the offline corpus under {out / 'data'}", flush=True)
    data = ensure_local_dataset(out / "data")
    config = tiny_config_path()
    overrides = [f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}"]
    if steps is not None:
        overrides.append(f"tokens.train_steps={steps}")
    cfg = load_config(config, overrides)
    run_dir = out / "plain"
    program = [
        sys.executable,
        "-m",
        "nanotron_recover.cli",
        "train",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
    ]
    program += [arg for o in overrides for arg in ("--set", o)]
    print(f"[demo] training {config.name}: {cfg.world_size} ranks, B={cfg.microbatches_per_step}", flush=True)
    code = subprocess.call(mpirun_command(cfg.world_size, program), timeout=timeout_s)
    if code != 0:
        print(f"[demo] training failed with exit status {code}", file=sys.stderr)
        return code
    rows = read_metrics(run_dir)
    print("\nstep  loss     tokens/s  ids_digest")
    for r in rows:
        print(f"{r['step']:4d}  {r['loss']:.4f}  {r['tokens_per_s']:8.0f}  {r['ids_digest'][:12]}")
    print(f"\n[demo] metrics: {run_dir / 'metrics.jsonl'}")
    return 0
