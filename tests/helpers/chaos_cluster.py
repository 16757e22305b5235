"""Chaos campaigns on the emulated Slurm cluster (:mod:`.emulated_cluster`): the cluster target of
the campaign runner (:mod:`nanotron_recover.chaos.runner`) and a campaign launched through ``sbatch``.

:class:`ClusterTarget` is a :class:`~nanotron_recover.chaos.targets.Target` over the nodes of an
:class:`~.emulated_cluster.EmulatedCluster`:

- **ranks**: ``<run_dir>/ranks.json`` (rank, replica, host, pid), whose ``host`` is the node's name
  (each node has its own UTS namespace). The nodes share this machine's pid namespace, so a pid is
  the same everywhere; a pid is signalled only while it runs *on the node the table names* (its
  network namespace is that node's, :meth:`EmulatedCluster.signal`) and runs ``nanotron_recover.cli
  train`` on this run directory;
- **unlisted**: the job's training processes on any node that the rank table does not name, not
  stopped, and started after the rank table or the relaunch record (``generation.json``) was last
  written: a re-join's spawned process, or a relaunched job's ranks before their table. Processes
  of an older generation left on a node that was cut off or frozen (Slurm ends them once the node
  answers again), and a rank declared dead while alive on a node of its own (no survivor on its
  host ends it), are not waited for;
- **node kinds** (:meth:`ClusterTarget.node_fault`): ``node_power_off`` (SIGKILL of every process of
  the node, slurmd and ``/dev/shm`` included), ``link_cut`` (its interface down) and
  ``node_freeze`` (SIGSTOP of every process of it). Each node is given back ``restore_after_s``
  later, as an operator would (powered on with an empty ``/dev/shm``, linked back, thawed: see
  :meth:`ClusterTarget.tick`), so the allocation keeps its nodes: build the cluster with a
  ``slurmd_timeout_s`` above that delay, or Slurm marks the node down and takes it out of the job;
- **the batch host** (the node running the job script, the supervisor and ``mpirun``) is a single
  point of failure (docs/architecture.md, section 5): no node fault and no SIGSTOP ever goes to it
  (:meth:`ClusterTarget.can_strike`); the runner strikes the next replica instead. A SIGKILL of a
  rank process there is a process fault like any other and is sent (``kill_on_batch_host``).

:func:`run_cluster_campaign` is ``nanotron-recover chaos`` with this target: it renders the job
script with ``nanotron-recover slurm`` (``--spare-nodes`` for re-join and relaunch), starts it with
``sbatch --wait`` (whose exit status is the job's), runs the campaign, judges it against the plain
run of the same config, and writes ``chaos.json`` and ``chaos.md``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_recover.chaos.reference import PendingReference, ensure_reference
from nanotron_recover.chaos.report import judge, write_report
from nanotron_recover.chaos.runner import Campaign, CampaignOptions, needs_of
from nanotron_recover.chaos.schedule import Schedule
from nanotron_recover.chaos.targets import RankProcess, Target, process_alive, process_stopped
from nanotron_recover.config import load_config
from nanotron_recover.errors import InputError
from tests.helpers.emulated_cluster import ClusterError, EmulatedCluster, _ns_inode

NODE_KIND_NAMES = {"node_power_off": "node power off", "link_cut": "link cut", "node_freeze": "node freeze"}
_RESTORES = {"node_power_off": "power on", "link_cut": "link restored", "node_freeze": "thawed"}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


_BTIME = _boot_time()


def _started_at(pid: int) -> float | None:
    """Wall-clock start of ``pid`` (to the kernel's tick and the boot time's second)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return _BTIME + int(text[text.rfind(")") + 2 :].split()[19]) / _CLK_TCK


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@dataclass
class NodeFault:
    node: str
    kind: str
    at: float
    restore_due: float
    pids: list[int]
    restored_at: float | None = None
    restore_error: str | None = None


@dataclass
class ClusterTarget(Target):
    """The ranks of a job submitted to ``cluster`` under the job name ``job_name`` (see the module)."""

    cluster: EmulatedCluster
    run_dir: Path
    job_name: str
    restore_after_s: float = 15.0
    kill_on_batch_host: bool = True
    name: str = "emulated cluster"
    job_id: str | None = None
    faults: list[NodeFault] = field(default_factory=list)
    _batch_host: str | None = None
    _scan: tuple[float, list[tuple[str, int]]] = (0.0, [])
    _next_lookup: float = 0.0

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()

    # -- the job ------------------------------------------------------------------------------------
    def find_job(self) -> str | None:
        """The Slurm job id of ``job_name`` (cached once seen)."""
        if self.job_id is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ids = self.cluster.run(
                    "squeue", "-h", "-t", "all", "-n", self.job_name, "-o", "%i", timeout=20
                ).stdout.split()
                self.job_id = ids[0] if ids else None
        return self.job_id

    def batch_host(self) -> str | None:
        """The node running the job script, the supervisor and ``mpirun`` (cached once known)."""
        if self._batch_host is None and self.find_job() is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host = self.cluster.job_info(self.job_id).get("BatchHost", "")
                if host in self.cluster.names:
                    self._batch_host = host
        return self._batch_host

    def _is_train(self, pid: int) -> bool:
        # ``python -m nanotron_recover.cli train ... --run-dir RUN_DIR`` (not the supervisor, whose
        # command line holds mpirun's, nor mpirun)
        argv = _argv(pid)
        return (
            len(argv) > 4
            and Path(argv[0]).name.startswith("python")
            and argv[1:4] == ["-m", "nanotron_recover.cli", "train"]
            and str(self.run_dir) in argv
        )

    def job_processes(self) -> list[tuple[str, int]]:
        """(node, pid) of every live training process of this run on any node (one /proc scan,
        reused for 50 ms)."""
        now = time.monotonic()
        if now - self._scan[0] < 0.05:
            return self._scan[1]
        nodes = {ns: name for name, ns in self.cluster._netns_ids.items()}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            node = nodes.get(_ns_inode(f"/proc/{entry}/ns/net"))
            if node is not None and self._is_train(int(entry)) and process_alive(int(entry)):
                found.append((node, int(entry)))
        self._scan = (now, found)
        return found

    def _table_written(self) -> float:
        """When the rank table or the relaunch record was last written (0 before either)."""
        latest = 0.0
        for name in ("ranks.json", "generation.json"):
            with contextlib.suppress(OSError):
                latest = max(latest, (self.run_dir / name).stat().st_mtime)
        return latest

    # -- Target -------------------------------------------------------------------------------------
    def ranks(self) -> dict[int, RankProcess]:
        import json

        try:
            table = json.loads((self.run_dir / "ranks.json").read_text())
        except (OSError, ValueError):
            return {}
        found = {}
        for row in table if isinstance(table, list) else []:
            try:
                found[int(row["rank"])] = RankProcess(
                    int(row["rank"]), int(row["replica"]), str(row.get("host", "")), int(row["pid"])
                )
            except (KeyError, TypeError, ValueError):
                continue
        return found

    def unlisted(self) -> list[RankProcess]:
        listed = {p.pid for p in self.ranks().values()}
        # Started after the rank table (or the relaunch) was last written: a spawned process is;
        # a rank declared dead while alive and left on a node of its own (nobody on its host ends
        # it) is not, nor a previous generation's process. The boot time is known to the second.
        since = self._table_written() - 1.0
        return [
            RankProcess(None, None, node, pid)
            for node, pid in self.job_processes()
            if pid not in listed and not process_stopped(pid) and (_started_at(pid) or 0.0) >= since
        ]

    def alive(self, proc: RankProcess) -> bool:
        return process_alive(proc.pid)

    def supports(self, kind: str) -> bool:
        return True

    def struck_nodes(self) -> set[str]:
        """Nodes under a node fault not restored yet."""
        return {f.node for f in self.faults if f.restored_at is None}

    def can_strike(self, proc: RankProcess, how: str) -> bool:
        if proc.host not in self.cluster.names:
            return False
        batch = self.batch_host()
        if batch is None or proc.host == batch:
            # The job's single point of failure; unknown yet: spare every node for safety.
            return how == "kill" and self.kill_on_batch_host and batch is not None
        if how == "node":
            return proc.host not in self.struck_nodes() and self.cluster.is_on(proc.host)
        return True

    def signal(self, proc: RankProcess, sig: int) -> bool:
        if not self.can_strike(proc, "stop" if sig == signal.SIGSTOP else "kill"):
            return False
        if not self._is_train(proc.pid):
            return False
        return self.cluster.signal(proc.host, proc.pid, sig)

    def node_fault(self, kind: str, proc: RankProcess) -> list[int] | None:
        if not self.can_strike(proc, "node"):
            return None
        node, now = proc.host, time.time()
        if kind == "node_power_off":
            pids = self.cluster.power_off(node)
        elif kind == "link_cut":
            pids = self.cluster.pids(node)
            self.cluster.cut_link(node)
        elif kind == "node_freeze":
            pids = self.cluster.freeze(node)
        else:
            raise ValueError(f"not a node kind: {kind}")
        self.faults.append(NodeFault(node, kind, now, now + self.restore_after_s, pids))
        return pids

    def _restore(self, fault: NodeFault) -> None:
        try:
            if fault.kind == "node_power_off":
                self.cluster.power_on(fault.node, wait_idle_s=None)
            elif fault.kind == "link_cut":
                self.cluster.restore_link(fault.node)
            else:
                self.cluster.thaw(fault.node)
        except (ClusterError, subprocess.TimeoutExpired) as e:
            fault.restore_error = str(e)[:300]
            fault.restore_due = time.time() + 2.0  # try again
            return
        fault.restored_at = time.time()

    def tick(self) -> None:
        now = time.time()
        if self._batch_host is None and now >= self._next_lookup:  # learn the job's batch host early
            self._next_lookup = now + 0.5
            self.batch_host()
        for fault in self.faults:
            if fault.restored_at is None and now >= fault.restore_due:
                self._restore(fault)

    def restore_all(self) -> None:
        """Give every struck node back now (thaw, link, power on)."""
        for fault in self.faults:
            if fault.restored_at is None:
                self._restore(fault)

    def end_job(self) -> list[int]:
        if self.find_job() is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.cluster.run("scancel", self.job_id, timeout=20)
        self.restore_all()
        self._scan = (0.0, [])
        pids = []
        for node, pid in self.job_processes():
            if self.cluster.signal(node, pid, signal.SIGKILL):
                pids.append(pid)
        return pids

    def node_events(self) -> list[dict[str, Any]]:
        return [
            {
                "node": f.node,
                "kind": f.kind,
                "at": f.at,
                "restored": _RESTORES[f.kind],
                "restored_after_s": None if f.restored_at is None else f.restored_at - f.at,
                "processes": len(f.pids),
                "restore_error": f.restore_error,
            }
            for f in self.faults
        ]


# -- a campaign -------------------------------------------------------------------------------------
def render_job(
    cluster: EmulatedCluster,
    config: Path,
    run_dir: Path,
    sets: list[str],
    *,
    nodes: int,
    spares: int,
    job_name: str,
    time_min: int,
) -> Path:
    """The job script ``nanotron-recover slurm`` renders (not submitted): ``<run_dir>/job.sbatch``."""
    argv = [sys.executable, "-m", "nanotron_recover.cli", "slurm", "--config", str(config)]
    argv += ["--nodes", str(nodes), "--spare-nodes", str(spares), "--gpus-per-node", "0"]
    argv += ["--time", str(time_min), "--run-dir", str(run_dir), "--job-name", job_name]
    argv += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        argv, env=dict(cluster.mpi_env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nanotron-recover slurm failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return Path(proc.stdout.strip().splitlines()[-1])


def run_cluster_campaign(
    cluster: EmulatedCluster,
    work: Path,
    config: Path,
    sets: list[str],
    schedule: Schedule,
    *,
    nodes: int,
    spares: int,
    timeout_s: float = 1800.0,
    restore_after_s: float = 15.0,
    ref_root: Path | None = None,
    reference: PendingReference | None = None,
    out: Path | None = None,
    hang_floor_s: float = 150.0,
    hang_factor: float = 50.0,
    ready_timeout_s: float = 90.0,
    log=None,
) -> dict[str, Any]:
    """Run ``schedule`` on a job of ``nodes`` + ``spares`` nodes of ``cluster`` (see the module);
    the judged record (what ``<out>/chaos.json`` holds, ``out`` defaulting to the run dir).

    ``reference``: a plain reference started beside the job (``start_reference``), waited for
    before the judgement; without it, the reference is run (or reused) before the job starts.

    ``hang_floor_s``: the smallest no-commit time the runner calls a hang. Across emulated nodes a
    re-join's spawn waits on every node's Open MPI daemon, and a job held where no rank-level
    deadline ends it is the supervisor's commit deadline's (``recover.commit_timeout_s``) to
    relaunch: the floor must exceed that deadline plus a relaunch's start (150 s, for a 45 s
    deadline), or the runner ends a job the supervisor was about to relaunch."""
    config = Path(config).resolve()
    run_dir = (work / "run").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    all_sets = [*sets, f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}"]
    cfg = load_config(config, all_sets)
    job_name = f"chaos-{secrets.token_hex(3)}"
    target = ClusterTarget(cluster, run_dir, job_name, restore_after_s=restore_after_s)
    problems = needs_of(schedule.kinds, cfg, target)
    if problems:
        raise ValueError("; ".join(problems))
    say = log or (lambda line: print(f"chaos (cluster): {line}", file=sys.stderr, flush=True))
    if reference is None:
        ref_dir, reused = ensure_reference(
            config, cfg, list(sets), (ref_root or work / "chaos_reference").resolve(), timeout_s=timeout_s
        )
        say(f"plain reference {'reused' if reused else 'run'}: {ref_dir}")
    else:
        reused = reference.reused
        say(f"plain reference {'reused' if reused else 'started beside the first job'}: {reference.ref_dir}")
    script = render_job(
        cluster,
        config,
        run_dir,
        all_sets,
        nodes=nodes,
        spares=spares,
        job_name=job_name,
        time_min=int(timeout_s // 60) + 10,
    )
    opts = CampaignOptions(
        config=config,
        run_dir=run_dir,
        sets=all_sets,
        schedule=schedule,
        cfg=cfg,
        timeout_s=timeout_s,
        hang_floor_s=hang_floor_s,
        hang_factor=hang_factor,
        ready_timeout_s=ready_timeout_s,
        launch_cmd=["sbatch", "--wait", str(script)],
        launch_env=dict(cluster.mpi_env, OMP_NUM_THREADS="1"),
        log=say,
    )
    say(f"schedule: {', '.join(f'{f.kind}@{f.step}' for f in schedule.faults)}")
    try:
        run = Campaign(opts, target_factory=lambda _run_dir, _pid: target).run()
    finally:
        target.restore_all()
        job = target.find_job()
        if job is not None and cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"):
            cluster.run("scancel", job)
    if reference is not None:
        try:
            ref_dir = reference.wait(timeout_s)
        except InputError as e:
            # What the job did is still judged and written; only the comparison is missing.
            say(f"no comparison with the plain run: {e}")
            ref_dir = None
    job = target.find_job()
    state = cluster.job_state(job) if job else "UNKNOWN"
    info = cluster.job_info(job) if job else {}
    slurm_log = run_dir / f"slurm-{job}.out"
    record = judge(
        run=run,
        schedule=schedule,
        run_dir=run_dir,
        ref_dir=ref_dir,
        dp=cfg.parallelism.dp,
        replica_size=cfg.parallelism.replica_size,
        steps=cfg.tokens.train_steps,
        exact=cfg.recover.exact,
        replay_cmd=f"run_cluster_campaign(..., load_schedule('{(out or run_dir) / 'chaos.json'}'))",
        extra={
            "config": str(config),
            "sets": all_sets,
            "reference_reused": reused,
            "target": "emulated Slurm cluster (tests/helpers/chaos_cluster.py)",
            "cluster": {
                "nodes": cluster.names,
                "job_nodes": nodes,
                "spare_nodes": spares,
                "slurmd_timeout_s": cluster.slurmd_timeout_s,
                "restore_after_s": restore_after_s,
            },
            "slurm": {
                "job_id": job,
                "state": state,
                "exit_code": info.get("ExitCode"),
                "batch_host": target.batch_host(),
                "node_list": info.get("NodeList"),
                "log": str(slurm_log),
            },
            "node_faults": target.node_events(),
        },
    )
    for fault in record["faults"]:  # a node fault is named by what it did, not by a signal
        if fault["kind"] in NODE_KIND_NAMES:
            for t, s in zip(fault["target"], [s for s in fault["signals"] if s["sent"]], strict=False):
                t["signal"] = f"{NODE_KIND_NAMES[fault['kind']]} {s.get('node')}"
    write_report(record, out or run_dir)
    schedule.write((out or run_dir) / "chaos_schedule.json")
    return record


def slurm_log_lines(record: dict[str, Any], pattern: str, limit: int = 20) -> list[str]:
    """Lines of the job's Slurm output matching ``pattern`` (for a report's evidence)."""
    try:
        text = Path(record["slurm"]["log"]).read_text(errors="replace")
    except (OSError, KeyError, TypeError):
        return []
    return [line for line in text.splitlines() if re.search(pattern, line)][:limit]
