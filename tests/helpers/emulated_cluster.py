"""An emulated multi-node Slurm cluster on one machine, made of Linux namespaces: node loss for tests.

Each node is a set of namespaces with its own slurmd:

- a **network namespace** (``ip netns add``) with one veth whose other end sits on a bridge in the
  root namespace, and its own address on a private /24 (the bridge holds ``.1``, node ``k`` holds
  ``.k+1``); loopback up. The node names go into ``/etc/hosts`` (each line carries a marker comment
  and exactly those lines are removed at teardown), so every node resolves every other one;
- a **UTS namespace**, so ``hostname`` on the node says its own name (Open MPI and Slurm both tell
  nodes apart by hostname: ranks on two nodes never take the shared-memory path);
- a **mount namespace** with a private tmpfs on ``/dev/shm``: whatever a node keeps in memory there
  (shared-memory segments, node-memory snapshots) is gone when the node's last process dies, as
  with a real power loss, and no node can read another node's ``/dev/shm``. The rest of the file
  system is shared, like a cluster's shared file system.

slurmd is the first process of a node, started as::

    nsenter --net=/run/netns/NS unshare --uts --mount --propagation private \\
        sh -c 'hostname NODE; mount -t tmpfs tmpfs /dev/shm; exec slurmd -D -N NODE -f CONF'

``nsenter`` joins only the network namespace and ``unshare`` creates the two others. ``ip netns
exec`` is not used: it remounts ``/sys`` for the namespace, and slurmd then fails its cgroup checks.
Every process of a node descends from its slurmd (the job steps, Open MPI's ``prted``, the ranks),
so it inherits the three namespaces. slurmctld and munged run in the root namespace; slurmctld is
reached on the bridge address, and munged's unix socket (a path in the shared file system) is
reached from every node. Both are those of :class:`LocalSlurm` (the single-node test Slurm in
``slurm_local/cluster.py``): private munge key and socket, scratch folder, daemons stopped by pid.

Open MPI across the nodes needs its traffic kept on the cluster's subnet, and root allowed:
``PRTE_MCA_prte_if_include=<subnet>``, ``OMPI_MCA_btl_tcp_if_include=<subnet>``,
``OMPI_ALLOW_RUN_AS_ROOT=1``, ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` (:attr:`EmulatedCluster.mpi_env`
has them; a job submitted with ``sbatch`` carries them over). Inside a Slurm allocation mpirun
starts its daemons with srun. Without Slurm (a hostfile), mpirun needs an ``ssh`` stand-in that
enters the named node: :attr:`EmulatedCluster.ssh_agent`, a script in the scratch folder, set by
:attr:`EmulatedCluster.hostfile_env` (``PRTE_MCA_plm_ssh_agent``).

Faults: :meth:`~EmulatedCluster.power_off` (SIGKILL of every process in the node's namespaces; the
node's memory goes with them), :meth:`~EmulatedCluster.power_on` (a fresh slurmd, fresh
``/dev/shm``), :meth:`~EmulatedCluster.cut_link` / :meth:`~EmulatedCluster.restore_link` (the
node's interface down: it keeps running, unreachable), :meth:`~EmulatedCluster.freeze` /
:meth:`~EmulatedCluster.thaw` (SIGSTOP / SIGCONT of every process of the node: a hung node).

CPUs: by default every process of every node may run on every CPU of this machine, and the kernel
moves them between CPUs as it likes. A real node's processes never run on another node's cores.
With ``node_cpus=True`` each node gets a fixed share of this machine's CPUs (round-robin over the
CPUs the caller may use: with 6 nodes on 2 CPUs, nodes 1, 3, 5 on the first, 2, 4, 6 on the
second), set on its slurmd and on the ssh stand-in's commands, so that every process of the node
inherits it. Measured with a dp=3 job of busy-waiting MPI ranks on 2 CPUs: free, 0.15-0.16 s a
step on average with 14-20% of the steps over 0.3 s (the ranks migrate between the CPUs);
confined, 0.04-0.13 s by placement with none over 0.3 s. One exception: a process that ``mpirun``
spawns (``MPI_Comm_spawn``) runs on the CPUs of ``mpirun``'s own node, wherever it is placed (the
runtime binds it within the CPU set it read on that node).

Use :func:`emulated_cluster` as a context manager in scripts, or :func:`cluster_fixture` for a
pytest fixture. Teardown (:meth:`EmulatedCluster.stop`, safe to call twice) kills only processes in
the cluster's own namespaces and the daemons it started (each pid checked before the signal),
deletes the veths, the bridge and the namespaces, and removes its ``/etc/hosts`` lines. Needs root,
``ip``, ``nsenter``, ``unshare``, Slurm and munge. ``python tests/helpers/emulated_cluster.py``
starts a 4-node cluster, prints how to use it, and waits for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: the repository root makes `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.slurm_local.cluster import (  # noqa: E402
    LocalSlurm,
    SlurmUnavailable,
    _read_pid,
    _sbin,
    _terminate,
    ensure_installed,
)

MARKER = "# nanotron-recover emulated cluster"
HOSTS = Path("/etc/hosts")
LOCK = Path("/run/lock/nanotron-recover-emulated-cluster.lock")
NETNS_DIR = Path("/run/netns")
NODE_IFACE = "eth0"
TOOLS = ("ip", "nsenter", "unshare", "taskset")
SUBNET_BASE = "10.77"


class ClusterError(RuntimeError):
    """Something of the emulated cluster did not come up (or down) in time."""


@dataclass(frozen=True)
class Node:
    name: str  # Slurm NodeName and the node's hostname
    address: str  # its address on the cluster's subnet
    netns: str  # network namespace, /run/netns/<netns>
    veth: str  # the root-namespace end of its link, on the bridge

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, /etc/hosts, daemons)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        return str(e)
    return None


def _run(cmd: Sequence[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise ClusterError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns_inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in_netns(netns_id: tuple[int, int] | None) -> list[int]:
    """Every process whose network namespace is ``netns_id`` (what ``ip netns pids`` reports)."""
    if netns_id is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ns_inode(f"{entry}/ns/net") == netns_id:
            found.append(int(entry.name))
    return sorted(found)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return f"--- {path.name}\n" + path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"--- {path.name}: (none)"


class EmulatedCluster(LocalSlurm):
    """``n_nodes`` emulated nodes ``{prefix}1..{prefix}N`` under one slurmctld.

    Start with :meth:`start` (or use :func:`emulated_cluster`), stop with :meth:`stop`. ``env`` is
    what Slurm clients need (``SLURM_CONF``), ``mpi_env`` adds what Open MPI needs across nodes.
    """

    def __init__(
        self,
        n_nodes: int = 4,
        cpus_per_node: int = 2,
        memory_mb: int = 2000,
        max_oversubscribe: int = 8,
        prefix: str | None = None,
        subnet: str | None = None,
        slurmd_timeout_s: int = 10,
        node_cpus: bool = False,
    ) -> None:
        super().__init__(memory_mb=memory_mb, max_oversubscribe=max_oversubscribe)
        if not 1 <= n_nodes <= 200:
            raise ValueError(f"n_nodes must be in 1..200, not {n_nodes}")
        self.n_nodes = n_nodes
        self.cpus = cpus_per_node
        self.slurmd_timeout_s = slurmd_timeout_s
        self.node_cpus = node_cpus
        self.tag = secrets.token_hex(2)
        # Node names of their own (e.g. e3f2an1): two clusters up at once never share a hostname.
        self.prefix = prefix or f"e{self.tag}n"
        self.requested_subnet = subnet
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = f"nrbr{self.tag}"
        self.nodes: list[Node] = []
        self.owner_pid = os.getpid()
        # What exists, so that teardown removes exactly that (and may run twice).
        self._netns: list[Node] = []
        self._netns_ids: dict[str, tuple[int, int]] = {}
        self._veths: list[str] = []
        self._bridge_up = False
        self._hosts_written = False
        self._slurmd: dict[str, subprocess.Popen] = {}
        self._frozen: set[str] = set()
        self._dark: set[str] = set()  # powered off with their link dropped first

    # -- names and environments ------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def cpus_of(self, node: str | Node) -> list[int] | None:
        """The CPUs every process of ``node`` runs on, or None (any CPU) without ``node_cpus``: the
        CPUs this process may use, dealt round-robin to the nodes (several nodes per CPU when there
        are more nodes than CPUs, several CPUs per node otherwise)."""
        if not self.node_cpus:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        index = self.nodes.index(self.get_node(node))
        if len(self.nodes) >= len(cpus):
            return [cpus[index % len(cpus)]]
        return cpus[index :: len(self.nodes)]

    def _pinned(self, node: Node) -> list[str]:
        """``taskset -c CPUS`` for a command that starts processes of ``node`` (nothing without
        ``node_cpus``); its children inherit the CPU set."""
        cpus = self.cpus_of(node)
        return [] if cpus is None else ["taskset", "-c", ",".join(map(str, cpus))]

    @property
    def addresses(self) -> dict[str, str]:
        return {n.name: n.address for n in self.nodes}

    @property
    def bridge_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def get_node(self, name: str | Node) -> Node:
        if isinstance(name, Node):
            return name
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} (nodes: {', '.join(self.names)})")

    @property
    def mpi_env(self) -> dict[str, str]:
        """``env`` plus what Open MPI needs across the emulated nodes."""
        assert self.subnet is not None
        return dict(
            self.env,
            PRTE_MCA_prte_if_include=str(self.subnet),
            OMPI_MCA_btl_tcp_if_include=str(self.subnet),
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        )

    @property
    def ssh_agent(self) -> Path:
        """The ``ssh`` stand-in for mpirun with a hostfile: ``ssh_agent NODE COMMAND...`` runs the
        command on NODE (in its namespaces); it fails like an unreachable host when NODE is off."""
        assert self.root is not None
        return self.root / "node-agent.sh"

    @property
    def hostfile_env(self) -> dict[str, str]:
        """``mpi_env`` plus the ssh stand-in, for mpirun with a hostfile outside Slurm."""
        return dict(self.mpi_env, PRTE_MCA_plm_ssh_agent=str(self.ssh_agent))

    def write_hostfile(self, path: Path, nodes: Sequence[str] | None = None, slots: int = 1) -> Path:
        path.write_text("".join(f"{name} slots={slots}\n" for name in (nodes or self.names)))
        return path

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        # Not under pytest's tmp folder: that one is 0700 root, and munged runs as `munge`.
        self.root = Path(tempfile.mkdtemp(prefix=f"nr-emu-{self.tag}-"))
        self.root.chmod(0o755)
        try:
            self._make_network()
            self._write_hosts()
            self._start_munge()
            self._write_conf()
            self._write_agent()
            self._start_daemon("slurmctld")
            for node in self.nodes:
                self._start_slurmd(node)
            self.wait_nodes_idle(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> EmulatedCluster:
        return self if self.root is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _make_network(self) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two clusters starting at once pick different subnets
            self.subnet = self._pick_subnet()
            hosts = list(self.subnet.hosts())
            if len(hosts) < self.n_nodes + 1:
                raise ValueError(f"{self.subnet} is too small for {self.n_nodes} nodes")
            self.nodes = [
                Node(
                    name=f"{self.prefix}{k}",
                    address=str(hosts[k]),
                    netns=f"nr-{self.tag}-{self.prefix}{k}",
                    veth=f"nrv{self.tag}n{k}",
                )
                for k in range(1, self.n_nodes + 1)
            ]
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._bridge_up = True
            _run(["ip", "addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            _run(["ip", "netns", "add", node.netns])
            self._netns.append(node)
            ns_id = _ns_inode(node.netns_path)
            assert ns_id is not None, node.netns_path
            self._netns_ids[node.name] = ns_id
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    node.veth,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    NODE_IFACE,
                    "netns",
                    node.netns,
                ]
            )
            self._veths.append(node.veth)
            _run(["ip", "link", "set", node.veth, "master", self.bridge, "up"])
            inside = ["nsenter", f"--net={node.netns_path}", "ip"]
            _run([*inside, "addr", "add", f"{node.address}/{self.subnet.prefixlen}", "dev", NODE_IFACE])
            _run([*inside, "link", "set", NODE_IFACE, "up"])
            _run([*inside, "link", "set", "lo", "up"])

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """The requested subnet, or the first 10.77.X.0/24 that no interface or route overlaps."""
        used = []
        for cmd in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
            for m in re.finditer(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", _run(cmd).stdout):
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(m.group(1), strict=False))
        candidates = (
            [ipaddress.ip_network(self.requested_subnet)]
            if self.requested_subnet
            else [ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24") for x in range(256)]
        )
        for net in candidates:
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise ClusterError(f"no free subnet among {candidates[0]}..{candidates[-1]} (in use: {used})")

    def _write_hosts(self) -> None:
        with open(HOSTS, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            text = f.read()
            for line in text.splitlines():
                fields = line.split("#", 1)[0].split()
                taken = set(fields[1:]) & set(self.names)
                if taken:
                    raise ClusterError(
                        f"{HOSTS} already names {', '.join(sorted(taken))} ({line.strip()!r}): another "
                        "cluster is up, or left over; pick another prefix="
                    )
            lines = "".join(f"{n.address}\t{n.name}\t{self._marker}\n" for n in self.nodes)
            f.seek(0, os.SEEK_END)
            f.write(("" if not text or text.endswith("\n") else "\n") + lines)
            self._hosts_written = True

    @property
    def _marker(self) -> str:
        return f"{MARKER} {self.tag}"

    def _remove_hosts(self) -> None:
        if not self._hosts_written:
            return
        with open(HOSTS, "r+") as f:  # in place: /etc/hosts may be a bind mount
            fcntl.flock(f, fcntl.LOCK_EX)
            lines = f.read().splitlines(keepends=True)
            kept = [ln for ln in lines if not ln.rstrip("\n").endswith(self._marker)]
            f.seek(0)
            f.write("".join(kept))
            f.truncate()
        self._hosts_written = False

    def _write_conf(self) -> None:
        assert self.root is not None and self.subnet is not None
        for sub in ("state", "jobs"):
            (self.root / sub).mkdir(exist_ok=True)
        r = self.root
        node_lines = [
            f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} State=UNKNOWN"
            for n in self.nodes
        ]
        lines = [
            # slurmctld is reached on the bridge; a node that comes back (power_on) returns to
            # service by itself.
            *self._daemon_conf(f"nremu{self.tag}", f"{self.node}({self.bridge_address})"),
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            # The nodes share this machine's cores: take CPUs/RealMemory from here, not from probing.
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "MinJobAge=600",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            *node_lines,
            f"PartitionName=emu Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP "
            f"OverSubscribe=FORCE:{self.max_oversubscribe}",
        ]
        # No cgroup.conf on purpose: with these plugins slurmd starts without one.
        self.conf.write_text("\n".join(lines) + "\n")

    def _write_agent(self) -> None:
        assert self.root is not None
        cases = "".join(
            f"  {n.name}) ns={shlex.quote(n.netns_path)}; pin={shlex.quote(' '.join(self._pinned(n)))} ;;\n"
            for n in self.nodes
        )
        script = f"""#!/bin/sh
# ssh stand-in for mpirun on the emulated cluster: $0 [ssh options] NODE COMMAND...
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
node=$1; shift
case "$node" in
{cases}  *) echo "$0: no emulated node $node" >&2; exit 255 ;;
esac
pid=$(cat {shlex.quote(str(self.root))}/slurmd-"$node".pid 2>/dev/null)
if [ -z "$pid" ] || [ "$(stat -L -c %d:%i /proc/"$pid"/ns/net 2>/dev/null)" != "$(stat -L -c %d:%i "$ns")" ]; then
  echo "$0: $node: no route to host (powered off)" >&2; exit 255
fi
exec $pin nsenter --net="$ns" --uts=/proc/"$pid"/ns/uts --mount=/proc/"$pid"/ns/mnt --wd=/ sh -c "$*"
"""
        self.ssh_agent.write_text(script)
        self.ssh_agent.chmod(0o755)

    def _start_slurmd(self, node: Node, timeout_s: float = 60) -> None:
        assert self.root is not None
        pid_file = self.root / f"slurmd-{node.name}.pid"
        pid_file.unlink(missing_ok=True)
        boot = (
            f"hostname {shlex.quote(node.name)}; mount -t tmpfs tmpfs /dev/shm; "
            f"exec {shlex.quote(_sbin('slurmd'))} -D -N {shlex.quote(node.name)} -f {shlex.quote(str(self.conf))}"
        )
        cmd = [*self._pinned(node), "nsenter", f"--net={node.netns_path}", "unshare", "--uts", "--mount"]
        cmd += ["--propagation", "private", "sh", "-c", boot]
        with open(self.root / f"slurmd-{node.name}.stdio", "a") as out:
            proc = subprocess.Popen(
                cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        self._slurmd[node.name] = proc
        # taskset, nsenter, unshare and sh each exec the next one: the Popen's pid is slurmd's.
        deadline = time.monotonic() + timeout_s
        while _read_pid(pid_file) != proc.pid:
            if proc.poll() is not None:
                raise ClusterError(
                    f"slurmd of {node.name} exited ({proc.returncode}) before writing its pid file:\n"
                    + self.logs(f"slurmd-{node.name}")
                    + "\n"
                    + _tail(self.root / f"slurmd-{node.name}.stdio")
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"slurmd of {node.name} wrote no pid file in {timeout_s}s:\n"
                    + self.logs(f"slurmd-{node.name}")
                )
            time.sleep(0.1)

    def stop(self, timeout_s: float = 15) -> None:
        """Tear everything down; safe to call twice, and after a failed :meth:`start`."""
        # 1. Every process of every node (slurmd, job steps, prted, ranks): SIGKILL, no grace.
        for node in list(self._netns):
            with contextlib.suppress(ClusterError):
                self._kill_all(node, timeout_s)
        self._frozen.clear()
        for proc in self._slurmd.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
        self._slurmd.clear()
        # 2. slurmctld and munged (by pid file, checked), and the scratch folder.
        root = self.root
        for name, pid_file in reversed(self.started):
            pid = _read_pid(pid_file)
            if pid and self._is_ours(pid, name):
                _terminate(pid, timeout_s)
        self.started.clear()
        # 3. Links, bridge, namespaces, /etc/hosts lines.
        for veth in list(self._veths):
            _run(["ip", "link", "del", veth], check=False)
            self._veths.remove(veth)
        for node in list(self._netns):
            _run(["ip", "netns", "del", node.netns], check=False)
            if not Path(node.netns_path).exists():
                self._netns.remove(node)
        if self._bridge_up:
            _run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_up = False
        self._remove_hosts()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
            self.root = None

    # -- nodes -----------------------------------------------------------------------------------
    def pids(self, node: str | Node) -> list[int]:
        """Every process now running on ``node`` (in its network namespace)."""
        return _pids_in_netns(self._netns_ids.get(self.get_node(node).name))

    def is_on_node(self, node: str | Node, pid: int) -> bool:
        ns_id = self._netns_ids.get(self.get_node(node).name)
        return ns_id is not None and _ns_inode(f"/proc/{pid}/ns/net") == ns_id

    def signal(self, node: str | Node, pid: int, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to ``pid`` if it runs on ``node``; False if it does not (or no longer)."""
        if not self.is_on_node(node, pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _signal_all(self, node: str | Node, sig: int) -> list[int]:
        done = [pid for pid in self.pids(node) if self.signal(node, pid, sig)]
        return done

    def _kill_all(self, node: Node, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._signal_all(node, signal.SIGKILL)
            proc = self._slurmd.get(node.name)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
            left = [p for p in self.pids(node) if not _is_zombie(p)]
            if not left:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{node.name}: processes survive SIGKILL for {timeout_s}s: {left}")
            time.sleep(0.1)

    def power_off(self, node: str | Node, timeout_s: float = 15, drop_link: bool = False) -> list[int]:
        """SIGKILL every process of ``node`` (slurmd, slurmstepd, prted, ranks); its ``/dev/shm``
        goes with its last process. Returns the pids it found. ``drop_link``: the link goes down
        first, as with a real power loss, so no peer gets a connection reset from the dying
        processes: they learn of it only from silence."""
        return self.power_off_together([node], timeout_s, drop_link)

    def power_off_together(
        self, nodes: list[str | Node], timeout_s: float = 15, drop_link: bool = False
    ) -> list[int]:
        """Power loss of several nodes at one moment (a rack's PDU): every process of every node gets
        its SIGKILL in one pass before any node is waited for, so no node outlives another by the
        seconds a runtime needs to see the first one go. Returns the pids it found."""
        ns = [self.get_node(node) for node in nodes]
        if drop_link:
            for n in ns:
                self.cut_link(n)
                self._dark.add(n.name)
        found = [pid for n in ns for pid in self._signal_all(n, signal.SIGKILL)]
        for n in ns:
            self._kill_all(n, timeout_s)
            self._frozen.discard(n.name)
        return found

    def power_on(self, node: str | Node, wait_idle_s: float | None = 120) -> None:
        """Boot ``node`` again: fresh namespaces (hostname, empty ``/dev/shm``) and slurmd. With
        ReturnToService=2 slurmctld takes it back once it registers; ``wait_idle_s`` waits for that."""
        n = self.get_node(node)
        if self.pids(n):
            raise ClusterError(f"{n.name} is not off: {self.pids(n)}")
        if n.name in self._dark:
            self.restore_link(n)
            self._dark.discard(n.name)
        self._start_slurmd(n)
        if wait_idle_s:
            self.wait_nodes_idle([n.name], timeout_s=wait_idle_s)

    def is_on(self, node: str | Node) -> bool:
        proc = self._slurmd.get(self.get_node(node).name)
        return proc is not None and proc.poll() is None

    def cut_link(self, node: str | Node) -> None:
        """Take the node's interface down: everything on it keeps running, nothing reaches it."""
        n = self.get_node(node)
        _run(["nsenter", f"--net={n.netns_path}", "ip", "link", "set", NODE_IFACE, "down"])

    def restore_link(self, node: str | Node) -> None:
        n = self.get_node(node)
        _run(["nsenter", f"--net={n.netns_path}", "ip", "link", "set", NODE_IFACE, "up"])

    def freeze(self, node: str | Node) -> list[int]:
        """SIGSTOP every process of the node (a hung node: connections stay open, nothing answers)."""
        n = self.get_node(node)
        self._frozen.add(n.name)
        return self._signal_all(n, signal.SIGSTOP)

    def thaw(self, node: str | Node) -> list[int]:
        n = self.get_node(node)
        self._frozen.discard(n.name)
        return self._signal_all(n, signal.SIGCONT)

    def _enter(self, node: str | Node, cwd: str | os.PathLike | None) -> list[str]:
        n = self.get_node(node)
        proc = self._slurmd.get(n.name)
        if proc is None or proc.poll() is not None or not self.is_on_node(n, proc.pid):
            raise ClusterError(f"{n.name} is powered off")
        ns = f"/proc/{proc.pid}/ns"
        cmd = ["nsenter", f"--net={n.netns_path}", f"--uts={ns}/uts", f"--mount={ns}/mnt"]
        return [*cmd, f"--wd={os.fspath(cwd) if cwd else os.getcwd()}"]

    def run_on(
        self,
        node: str | Node,
        cmd: Sequence[str],
        timeout: float = 60,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` on ``node`` (its network, hostname and ``/dev/shm``), with a hard timeout."""
        full = [*self._enter(node, cwd), *cmd]
        proc = subprocess.Popen(
            full,
            env=env or self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise ClusterError(
                f"on {self.get_node(node).name}, timed out after {timeout}s: {shlex.join(cmd)}\n{out}{err}"
            ) from None
        result = subprocess.CompletedProcess(full, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise ClusterError(
                f"on {self.get_node(node).name}: {shlex.join(cmd)} failed ({proc.returncode}):\n{out}{err}"
            )
        return result

    def spawn_on(self, node: str | Node, cmd: Sequence[str], **popen) -> subprocess.Popen:
        """Start ``cmd`` on ``node`` in the background (its own session); it dies with the node."""
        cwd = popen.pop("cwd", None)
        popen.setdefault("env", self.env)
        popen.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen([*self._enter(node, cwd), *cmd], start_new_session=True, **popen)

    # -- Slurm -----------------------------------------------------------------------------------
    def sinfo(self) -> str:
        return self.run("sinfo", "-N", "-o", "%N %t %E", timeout=30).stdout

    def node_states(self) -> dict[str, str]:
        """``sinfo``'s short state of each node: idle, alloc, mix, down*, idle*, drain, ..."""
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=30)
        return dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)

    def node_info(self, node: str | Node) -> dict[str, str]:
        return _key_values(self.run("scontrol", "-o", "show", "node", self.get_node(node).name).stdout)

    def wait_nodes_idle(self, nodes: Sequence[str] | None = None, timeout_s: float = 120) -> None:
        """Poll until every node of ``nodes`` (default: all) is idle and responding."""
        self.wait_nodes(lambda s: s == "idle", nodes, timeout_s, "idle")

    def wait_nodes(self, accept, nodes: Sequence[str] | None, timeout_s: float, what: str) -> dict[str, str]:
        """Poll ``node_states()`` until ``accept(state)`` holds for every node of ``nodes``."""
        wanted = list(nodes or self.names)
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                states = self.node_states()
            if all(accept(states.get(n, "")) for n in wanted):
                return states
            if time.monotonic() > deadline:
                late = [n for n in wanted if not accept(states.get(n, ""))]
                details = "\n".join(
                    f"{n}: {states.get(n, '?')} {self.node_info(n).get('Reason', '')}" for n in late
                )
                raise ClusterError(
                    f"nodes not {what} after {timeout_s}s: {', '.join(late)}\n{details}\n"
                    + self.logs("slurmctld", *[f"slurmd-{n}" for n in late])
                )
            time.sleep(0.5)

    def sbatch(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
        """``sbatch --parsable ARGS`` with ``mpi_env`` (which the job inherits); returns the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=env or self.mpi_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise ClusterError(f"sbatch {shlex.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, NodeList, ExitCode, Reason, ...)."""
        return _key_values(self.run("scontrol", "-o", "show", "job", job_id).stdout)

    def hostnames(self, nodelist: str) -> list[str]:
        """A Slurm node list (``node[1-3]``) spelled out; ``[]`` for an empty one."""
        if not nodelist or nodelist in ("(null)", "None"):
            return []
        return self.run("scontrol", "show", "hostnames", nodelist).stdout.split()

    def logs(self, *names: str) -> str:
        """Tails of the daemons' logs: ``slurmctld``, ``slurmd-<node>``, ``munged`` (default: all)."""
        assert self.root is not None
        return super().logs(*names)


def _key_values(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", text))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def leftovers(tag: str | None = None) -> dict[str, list[str]]:
    """What clusters of this module left behind (or only cluster ``tag``'s): namespaces, links,
    ``/etc/hosts`` lines, daemons. A cluster that was stopped leaves nothing; one whose owner was
    killed (SIGKILL of pytest) leaves everything, see :func:`remove_leftovers`."""
    pattern = tag or "[0-9a-f]{4}"
    netns = [
        line.split()[0]
        for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
        if re.fullmatch(rf"nr-{pattern}-\S+", line.split()[0] if line.split() else "")
    ]
    links = re.findall(
        rf"^\d+: (nr(?:br{pattern}|v{pattern}n\d+))[@:]", _run(["ip", "-o", "link"]).stdout, re.M
    )
    hosts = [ln for ln in HOSTS.read_text().splitlines() if re.search(rf"{re.escape(MARKER)} {pattern}$", ln)]
    daemons = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            cmdline = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if re.search(rf"/nr-emu-{pattern}-\w+/", cmdline):
                daemons.append(f"{entry.parent.name} {cmdline.strip()}")
    return {"netns": netns, "links": links, "hosts": hosts, "daemons": daemons}


def remove_leftovers(tag: str) -> None:
    """Remove what cluster ``tag`` (the 4 hex digits in its names) left behind when its owner died:
    SIGKILL of the processes in its namespaces and of its daemons (found by its scratch folder on
    their command line), then its links, namespaces and ``/etc/hosts`` lines."""
    if not re.fullmatch(r"[0-9a-f]{4}", tag):
        raise ValueError(f"not a cluster tag: {tag!r}")
    found = leftovers(tag)
    for ns in found["netns"]:
        ns_id = _ns_inode(str(NETNS_DIR / ns))
        for pid in _pids_in_netns(ns_id):
            if _ns_inode(f"/proc/{pid}/ns/net") == ns_id:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for line in found["daemons"]:
        pid = int(line.split()[0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for link in sorted(found["links"], key=lambda name: name.startswith(f"nrbr{tag}")):
        _run(["ip", "link", "del", link], check=False)
    for ns in found["netns"]:
        _run(["ip", "netns", "del", ns], check=False)
    cluster = EmulatedCluster()
    cluster.tag, cluster._hosts_written = tag, True
    cluster._remove_hosts()
    for root in Path(tempfile.gettempdir()).glob(f"nr-emu-{tag}-*"):
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def emulated_cluster(**kwargs) -> Iterator[EmulatedCluster]:
    """A started :class:`EmulatedCluster` (keyword arguments as its constructor's), always torn
    down on the way out."""
    cluster = EmulatedCluster(**kwargs)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def cluster_fixture(scope: str = "module", **kwargs):
    """A pytest fixture yielding a started cluster, torn down after its scope; skips the test when
    the machine cannot host one (not root, no Slurm). In a test module::

        emulated = cluster_fixture(n_nodes=4, cpus_per_node=2)
    """

    @pytest.fixture(scope=scope)
    def fixture() -> Iterator[EmulatedCluster]:
        reason = unavailable_reason()
        if reason:
            pytest.skip(f"no emulated cluster here: {reason}")
        with emulated_cluster(**kwargs) as cluster:
            yield cluster

    return fixture


if __name__ == "__main__":
    with emulated_cluster() as c:
        print(f"export SLURM_CONF={c.conf}")
        for key in ("PRTE_MCA_prte_if_include", "OMPI_MCA_btl_tcp_if_include"):
            print(f"export {key}={c.mpi_env[key]}")
        print("export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
        for n in c.nodes:
            print(f"# {n.name} {n.address}: nsenter --net={n.netns_path} ... (netns {n.netns})")
        print(c.sinfo(), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
