"""A real single-node Slurm on this machine, for tests: munged, slurmctld and slurmd on localhost.

Everything lives in one scratch folder this module creates: slurm.conf, state, spool, logs, pid
files and a private munge socket and key, so it never touches (or depends on) a system-wide munge
or Slurm, and two test runs can each have their own cluster on different ports. The daemons are
stopped by the pids in their own pid files, and only after checking that the pid still runs our
binary with our scratch folder on its command line.

The recipe (which plugins, no cgroup.conf, OverSubscribe, RealMemory) was measured on Debian 12 with
Slurm 22.05; see the project's notes. ``python tests/helpers/slurm_local/cluster.py`` starts one, prints
``SLURM_CONF`` and waits for Ctrl-C (handy to try ``nanotron-recover slurm --submit`` by hand).
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

APT_PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (not root)."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed(timeout_s: float = 600) -> None:
    """Install slurm-wlm and munge with apt when they are missing (needs root)."""
    if not missing_binaries():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"{', '.join(missing_binaries())} missing and apt-get is not usable here (needs root on "
            f"Debian/Ubuntu): apt-get install -y {' '.join(APT_PACKAGES)}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *APT_PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if missing_binaries():
        raise RuntimeError(f"still missing after apt-get install: {', '.join(missing_binaries())}")


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """Start with :meth:`start`, stop with :meth:`stop`; ``env`` is what Slurm clients need."""

    def __init__(self, memory_mb: int = 20000, max_oversubscribe: int = 8) -> None:
        self.memory_mb = memory_mb
        self.max_oversubscribe = max_oversubscribe
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.root: Path | None = None
        self.started: list[tuple[str, Path]] = []  # (binary, pid file) of each daemon we started

    # -- paths -------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        assert self.root is not None
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    # -- life cycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> LocalSlurm:
        # Not under pytest's own tmp folder: that one is 0700 root, and munged runs as `munge`.
        self.root = Path(tempfile.mkdtemp(prefix="nr-slurm-"))
        self.root.chmod(0o755)
        try:
            self._start_munge()
            self._write_conf()
            for daemon in ("slurmctld", "slurmd"):
                self._start_daemon(daemon)
            self.wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        assert self.root is not None
        munge = pwd.getpwnam("munge")
        mdir = self.root / "munge"
        mdir.mkdir()
        mdir.chmod(0o755)  # munged insists that everyone can reach its socket
        key = mdir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))  # a private key: nothing else can talk to it
        key.chmod(0o600)
        for path in (mdir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        pid_file = mdir / "munged.pid"
        cmd = [
            _sbin("runuser"),
            "-u",
            "munge",
            "--",
            _sbin("munged"),
            f"--socket={mdir / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={pid_file}",
            f"--log-file={mdir / 'munged.log'}",
            f"--seed-file={mdir / 'munged.seed'}",
        ]
        self._spawn("munged", cmd, pid_file)

    def _write_conf(self) -> None:
        assert self.root is not None
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        r = self.root
        lines = [
            *self._daemon_conf("nrtest", self.node),
            "MpiDefault=none",
            "MinJobAge=600",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            f"NodeName={self.node} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            f"OverSubscribe=FORCE:{self.max_oversubscribe}",
        ]
        # No cgroup.conf on purpose: with these plugins slurmd starts without one.
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon_conf(self, cluster: str, controller: str) -> list[str]:
        """The slurm.conf lines every test cluster shares: its name, the controller's host and two
        free ports, munge (this cluster's own socket), plugins that need no cgroups, root daemons,
        and nodes that come back returning to service by themselves."""
        assert self.root is not None
        return [
            f"ClusterName={cluster}",
            f"SlurmctldHost={controller}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ReturnToService=2",
        ]

    def _start_daemon(self, name: str) -> None:
        assert self.root is not None
        self._spawn(name, [_sbin(name), "-f", str(self.conf)], self.root / f"{name}.pid")

    def _spawn(self, name: str, cmd: list[str], pid_file: Path, timeout_s: float = 30) -> None:
        """Run a daemon that forks into the background; it counts as ours once its pid file appears."""
        assert self.root is not None
        with open(self.root / f"{name}.stdio", "w") as out:
            proc = subprocess.run(cmd, env=self.env, stdout=out, stderr=out, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while not _read_pid(pid_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _read_pid(pid_file):
            raise RuntimeError(f"{name} did not start (exit {proc.returncode}):\n{self.logs(name)}")
        self.started.append((name, pid_file))

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            proc = self.run("sinfo", "-h", "-N", "-o", "%t")
            state = proc.stdout.strip()
            if proc.returncode == 0 and state in ("idle", "mix", "alloc"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node not idle after {timeout_s}s (sinfo: {state!r}):\n{self.logs()}")

    def stop(self, timeout_s: float = 15) -> None:
        """Cancel our jobs, SIGTERM each daemon we started (by its pid file, SIGKILL after
        ``timeout_s``), remove the scratch folder."""
        if any(name == "slurmctld" for name, _ in self.started):
            self._cancel_all(timeout_s)
        for name, pid_file in reversed(self.started):
            pid = _read_pid(pid_file)
            if pid and self._is_ours(pid, name):
                _terminate(pid, timeout_s)
        self.started.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _cancel_all(self, timeout_s: float) -> None:
        # A job's slurmstepd (and its mpirun) would outlive slurmd: end the jobs first.
        try:
            ids = self.job_ids()
            if ids:
                self.run("scancel", "--full", *ids)
            deadline = time.monotonic() + timeout_s
            while self.job_ids() and time.monotonic() < deadline:
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _is_ours(self, pid: int, name: str) -> bool:
        # A pid file can outlive its process and the pid be reused: check binary and scratch path.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return False
        return name in cmdline and str(self.root) in cmdline

    # -- jobs --------------------------------------------------------------------------------
    def job_state(self, job_id: str) -> str:
        proc = self.run("scontrol", "show", "job", job_id)
        m = re.search(r"JobState=(\w+)", proc.stdout)
        return m.group(1) if m else "UNKNOWN"

    def wait_job(self, job_id: str, timeout_s: float, poll_s: float = 1.0) -> str:
        """Poll ``scontrol show job`` until a terminal state; on timeout cancel the job and raise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(poll_s)
        self.run("scancel", job_id)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s}s (last state {state})")

    def job_ids(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def logs(self, *names: str) -> str:
        assert self.root is not None
        files = [self.root / f"{n}.log" for n in names] if names else sorted(self.root.glob("*.log"))
        files += [self.root / "munge" / "munged.log"] if not names or "munged" in names else []
        parts = []
        for f in files:
            try:
                parts.append(f"--- {f.name}\n" + f.read_text()[-3000:])
            except OSError:
                pass
        return "\n".join(parts)


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _terminate(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    ensure_installed()
    cluster = LocalSlurm().start()
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
