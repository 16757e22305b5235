"""What the benchmarks share: running a training job and describing the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from nanotron_recover.demo import tiny_config_path
from nanotron_recover.launcher import train_command


def run_training(
    run_dir: Path, overrides: list[str], nproc: int, timeout_s: float = 1800, quiet: bool = True
) -> None:
    """Train the tiny CPU config with ``overrides`` on ``nproc`` ranks (one thread per rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.DEVNULL if quiet else None
    cmd = train_command(tiny_config_path(), run_dir, overrides, nproc)
    subprocess.run(cmd, check=True, timeout=timeout_s, env=env, stdout=out)


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def describe(machine: dict) -> str:
    gpu = f", GPU {machine['gpu']}" if machine["gpu"] else ", no GPU"
    return f"Machine: {machine['platform']}, {machine['cpus']} CPUs{gpu}, torch {machine['torch']}"


def markdown_table(columns: list[str], rows: list[list]) -> list[str]:
    """A Markdown table, one line per row (cells already formatted as text)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write_report(out: Path, name: str, data: dict, lines: list[str]) -> None:
    """``<out>/<name>.json`` with the raw results and ``<out>/<name>.md`` with ``lines``, printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
