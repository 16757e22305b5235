"""What the benchmarks share: running a training job and describing the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from nanotron_recover.demo import tiny_config_path
from nanotron_recover.launcher import train_command
from nanotron_recover.session_dirs import fresh_session


def run_training(
    run_dir: Path, overrides: list[str], nproc: int, timeout_s: float = 1800, quiet: bool = True
) -> None:
    """Train the tiny CPU config with ``overrides`` on ``nproc`` ranks (one thread per rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.DEVNULL if quiet else None
    cmd = train_command(tiny_config_path(), run_dir, overrides, nproc)
    subprocess.run(fresh_session(cmd), check=True, timeout=timeout_s, env=env, stdout=out)


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


REPO = Path(__file__).resolve().parents[1]
# A run's scratch folder (tempfile's): its name changes from run to run and means nothing later.
_SCRATCH = re.compile(re.escape(tempfile.gettempdir().rstrip("/")) + r"/[^/\s\"']+")


def portable(value: Any) -> Any:
    """``value`` with this machine's paths taken out of every string: the repository as ``.``, a
    run's scratch folder as ``SCRATCH``; results are read on other machines."""
    if isinstance(value, str):
        return _SCRATCH.sub("SCRATCH", value.replace(str(REPO) + "/", "").replace(str(REPO), "."))
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(json.loads(json.dumps(data, default=str))), indent=indent) + "\n")


def write_report(out: Path, name: str, data: dict, lines: list[str]) -> None:
    """``<out>/<name>.json`` with the raw results and ``<out>/<name>.md`` with ``lines``, printed;
    both without this machine's paths (:func:`portable`)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", data)
    (out / f"{name}.md").write_text(portable("\n".join(lines)) + "\n")
    print("\n".join(lines))
