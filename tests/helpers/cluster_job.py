"""A training job on the emulated cluster (:mod:`.emulated_cluster`), submitted the way a user does
(``nanotron-recover slurm --submit``), with what the node-loss tests and benchmark read of it: its
committed steps, where its ranks run, the node that runs its job script, how it ended, and what it
left on the nodes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nanotron_recover.logging import read_metrics
from tests.helpers.emulated_cluster import EmulatedCluster, _is_zombie

JOB_TIMEOUT_S = 420


class ClusterJob:
    """A training job submitted to the emulated cluster; its run folder is on the shared file system."""

    def __init__(
        self, cluster: EmulatedCluster, work: Path, config: str, sets: list[str], nodes: int, spares: int
    ):
        self.cluster, self.run_dir = cluster, work / "run"
        argv = [sys.executable, "-m", "nanotron_recover.cli", "slurm", "--config", config]
        argv += ["--nodes", str(nodes), "--spare-nodes", str(spares), "--gpus-per-node", "0"]
        argv += ["--time", "15", "--run-dir", str(self.run_dir), "--job-name", work.name, "--submit"]
        argv += [a for s in sets for a in ("--set", s)]
        env = dict(cluster.mpi_env, OMP_NUM_THREADS="1")
        proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        self.id = re.search(r"submitted job (\d+)", proc.stdout).group(1)

    def log(self) -> str:
        path = self.run_dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else self.cluster.logs()

    def committed(self) -> int:
        try:
            return read_metrics(self.run_dir)[-1]["step"]
        except (OSError, ValueError, IndexError, KeyError):
            return 0

    def wait_for_step(self, step: int, timeout_s: float = 180) -> int:
        self.wait_until(lambda: self.committed() >= step, f"step {step}", timeout_s)
        return self.committed()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            state = self.cluster.job_state(self.id)
            if time.monotonic() > deadline or state not in ("PENDING", "CONFIGURING", "RUNNING"):
                self.cluster.run("scancel", self.id)
                raise AssertionError(
                    f"job {self.id} ({state}): no {what} after {timeout_s}s\n{self.log()[-4000:]}"
                )
            time.sleep(0.05)

    def ranks(self) -> list[dict]:
        deadline = time.monotonic() + 120
        while not (self.run_dir / "ranks.json").exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: no rank table after 120 s\n{self.log()[-4000:]}")
            time.sleep(0.05)
        return json.loads((self.run_dir / "ranks.json").read_text())

    def batch_host(self) -> str:
        """The node that runs the job script, the supervisor and mpirun (see the SPOF note in
        docs/architecture.md): the tests take other nodes away."""
        return self.cluster.job_info(self.id)["BatchHost"]

    def host_of(self, replica: int) -> str:
        return next(r["host"] for r in self.ranks() if r["replica"] == replica)

    def finish(self) -> str:
        state = self.cluster.wait_job(self.id, JOB_TIMEOUT_S)
        assert state == "COMPLETED", f"job {self.id} {state}\n{self.log()[-6000:]}"
        assert f"job {self.id} finished" in self.log() and "exit status 0" in self.log(), self.log()[-3000:]
        return self.log()

    def processes_on(self, node: str) -> list[int]:
        """This job's Python processes on ``node`` (their command line names the run folder)."""
        found = []
        for pid in self.cluster.pids(node):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode(errors="replace")).name.startswith("python") and str(
                self.run_dir
            ).encode() in b" ".join(argv):
                if not _is_zombie(pid):
                    found.append(pid)
        return found

    def leftovers(self, nodes: list[str], timeout_s: float = 30) -> dict[str, list[str]]:
        """Processes of this job still on ``nodes``: its ranks (they name the run folder) and the
        runtime's daemons and Slurm steps (anything but slurmd), after Slurm's own clean-up."""
        found: dict[str, list[str]] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            found = {}
            for node in nodes:
                slurmd = self.cluster._slurmd[node].pid
                for pid in self.cluster.pids(node):
                    if pid == slurmd or _is_zombie(pid):
                        continue
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        continue
                    found.setdefault(node, []).append(f"{pid} {cmdline[:120]}")
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)
