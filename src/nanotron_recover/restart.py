"""The checkpoint-restart baseline's launcher: relaunch the whole job after every failure.

This is the classic way to survive faults, done as well as users do it: checkpoints every
``checkpoints.checkpoint_interval`` steps, saved asynchronously (staged to CPU memory, written in
the background). When any rank dies, Open MPI (launched *without* ULFM here) tears the job down; the
launcher relaunches it on the same number of ranks (replacement hardware), the trainer resumes from
the latest checkpoint and recomputes the steps since then.

Each restart is an incident in ``<run_dir>/incidents.jsonl``: the failed step and phase (from the
injected victim's death record when there is one), the step resumed from, the steps recomputed, and
``stall_s``: wall time from the failure until the relaunched job committed the failed step again,
i.e. everything the fault cost. A launch that fails without committing a new step and without an
injected death is a real error, not a fault to ride out: the launcher stops there. So does a run
whose outcome record (``<run_dir>/outcome.json``) says it stopped on bad input, an I/O error or a
deterministic exception, with that stop's exit status.

Each launch runs under the supervisor of :mod:`.supervisor`: success is the run's own record that it
committed every step, never mpirun's status alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import latest_step
from .config import Config
from .ft.faults import read_deaths
from .logging import IncidentLog, read_metrics
from .logging.wandb_logger import RunLogger, run_name_for_config
from .supervisor import default_grace_s, launch_env, report, run_supervised

# Stops that are not faults to ride out: a relaunch would meet the same input, disk or exception.
NOT_FAULTS = ("input", "io", "deterministic")


@dataclass
class Restart:
    number: int
    failed_at: float  # wall clock of the death (or of the launcher noticing, for real faults)
    step: int  # the step the job was in when it failed
    phase: str | None
    failed_replicas: list[int]
    failed_ranks: list[int]
    resumed_from_step: int
    exit_code: int


def committed_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r["step"] for r in read_metrics(path)), default=0)


def run_with_restarts(
    cfg: Config,
    run_dir: Path,
    launch_cmd: list[str],
    checkpoints_path: Path,
    *,
    grace_s: float | None = None,
    target_step: int | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``launch_cmd`` (an mpirun command line) under the supervisor until the run completes;
    returns the final exit status (see :func:`.supervisor.run_supervised`)."""
    grace_s = default_grace_s(cfg.recover.heartbeat_timeout_s) if grace_s is None else grace_s
    target_step = cfg.tokens.train_steps if target_step is None else target_step
    env = launch_env() if env is None else env
    restarts: list[Restart] = []
    while True:
        started = time.time()
        before = committed_steps(run_dir)
        result = run_supervised(launch_cmd, run_dir, grace_s=grace_s, env=env)
        code = result.exit_code
        if code == 0:
            break
        outcome = result.outcome or {}
        if outcome.get("status") == "stopped" and outcome.get("kind") in NOT_FAULTS:
            print(f"[nanotron-recover] the run stopped ({outcome['kind']}): not restarting", file=sys.stderr)
            _write_incidents(cfg, run_dir, restarts)
            return report(result, run_dir, target_step=target_step)
        if result.interrupted_by is not None:
            print("[nanotron-recover] interrupted: not restarting", file=sys.stderr)
            _write_incidents(cfg, run_dir, restarts)
            return report(result, run_dir, target_step=target_step)
        deaths = read_deaths(run_dir, since=started)
        progressed = committed_steps(run_dir) > before
        status = result.returncode if result.returncode is not None else code
        if not deaths and not progressed:
            print(
                f"[nanotron-recover] launch failed (exit {status}) without progress: not restarting",
                file=sys.stderr,
            )
            _write_incidents(cfg, run_dir, restarts)
            return report(result, run_dir, target_step=target_step)
        if len(restarts) >= cfg.recover.max_restarts:
            print(f"[nanotron-recover] giving up after {len(restarts)} restarts", file=sys.stderr)
            _write_incidents(cfg, run_dir, restarts)
            return report(result, run_dir, target_step=target_step)
        resumed = latest_step(checkpoints_path) or 0
        first = deaths[0] if deaths else None
        restarts.append(
            Restart(
                number=len(restarts) + 1,
                failed_at=first["time"] if first else time.time(),
                step=first["step"] if first else committed_steps(run_dir) + 1,
                phase=first["phase"] if first else None,
                failed_replicas=sorted({d["replica"] for d in deaths}),
                failed_ranks=sorted({d["rank"] for d in deaths}),
                resumed_from_step=resumed,
                exit_code=status,
            )
        )
        print(
            f"[nanotron-recover] restart {len(restarts)}: job failed at step {restarts[-1].step}, "
            f"relaunching from the checkpoint of step {resumed}",
            flush=True,
        )
    _write_incidents(cfg, run_dir, restarts)
    return report(result, run_dir, target_step=target_step)


def _write_incidents(cfg: Config, run_dir: Path, restarts: list[Restart]) -> None:
    """Stall times need the relaunched job's commit times, so incidents are written at the end, to
    incidents.jsonl and, with ``logging.wandb``, to a W&B run ``<name>-restarts`` of the same group
    (each relaunched job logs its steps to a run of its own)."""
    commit_time = {}
    if (run_dir / "metrics.jsonl").exists():
        commit_time = {r["step"]: r.get("time") for r in read_metrics(run_dir)}
    log = IncidentLog(run_dir / "incidents.jsonl")
    wandb_run = RunLogger()
    if restarts:
        wandb_run = RunLogger.start(cfg.logging.wandb, run_dir, f"{run_name_for_config(cfg)}-restarts", cfg)
    for r in restarts:
        recommitted = commit_time.get(r.step)
        record = {
            "step": r.step,
            "phase": r.phase,
            "failed_replicas": r.failed_replicas,
            "failed_ranks": r.failed_ranks,
            "action": "restart",
            "restart": r.number,
            "resumed_from_step": r.resumed_from_step,
            "recomputed_steps": max(r.step - 1 - r.resumed_from_step, 0),
            "stall_s": (recommitted - r.failed_at) if recommitted else None,
            "exit_code": r.exit_code,
        }
        log.write(record)
        wandb_run.log_incident(record)
    wandb_run.finish()
