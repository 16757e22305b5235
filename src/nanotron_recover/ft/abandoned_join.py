"""A process spawned by a re-join that the members gave up dies, even inside ``MPI_Init``.

The members of a re-join leave it when a stage fails (:class:`~.world.JoinFailed`, e.g. a member
died during the spawn) and train on at their width. A process they spawned for that join is then
useless, and it may be stuck where nothing reaches it: in ``MPI_Init``, connecting to parents that
left (or died), which never returns. Such a process is not in the job's rank table and no revoke
reaches it, yet Open MPI's ``mpirun`` waits for it before it exits. Found by the chaos campaign on
the emulated cluster: a member killed during a spawn, then every rank killed 70 steps later;
``mpirun`` did not end, and the supervisor relaunched only once every rank had been silent for a
heartbeat timeout (13.5 s to the next commit, against 5-7 s for the same fault without the earlier
torn spawn). ``py-spy`` showed the leftover in ``mpi4py.MPI``'s import, i.e. ``MPI_Init``.

A thread of that process cannot end it: mpi4py runs ``MPI_Init`` with the GIL held (measured: a
heartbeat thread did not run for the 4 s an ``MPI_Init`` waited for a late peer). So:

- The spawn command names the join (:data:`ENV`: ``<generation>-<epoch>-<step>``, alike on every
  member) in the spawned process's environment.
- Before its imports the spawned process starts a *watcher*: this file run as a script, with the
  standard library only, whose stdin is a pipe from the spawned process. Every heartbeat period
  it looks for the join's marker file; once the marker exists it SIGKILLs the spawned process.
  It exits on end of file: when the spawned process got through its merge with the members (it
  then closes the pipe, and the join's own deadlines cover it) or died.
- A member that leaves a join because a stage failed writes the marker (:func:`abandon`).

Joins are named by the launch's generation (its relaunch count), its world epoch and its step, so
the marker of one join never names another.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# The join a spawned process belongs to, set in the spawn command's environment.
ENV = "NANOTRON_RECOVER_JOIN_ID"


def join_id(generation: int, epoch: int, step: int) -> str:
    return f"{int(generation)}-{int(epoch)}-{int(step)}"


def marker(run_dir: str | os.PathLike, join: str) -> Path:
    return Path(run_dir) / "joins" / f"{join}.abandoned"


def abandon(run_dir: str | os.PathLike, join: str) -> bool:
    """Say that the members left ``join``: its spawned processes die. False if it could not be
    written (the processes then die at the join's deadlines, as before)."""
    path = marker(run_dir, join)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        return False
    return True


class Watcher:
    """The watcher of this process (see the module docstring); :meth:`release` ends it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def release(self) -> None:
        """This process is past the point where the marker matters: end the watcher."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_watcher(run_dir: str | os.PathLike, join: str, period_s: float) -> Watcher | None:
    """Start the watcher of this process for ``join``; None if it could not start (the process
    then lives on as before)."""
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-S",
                os.path.abspath(__file__),
                str(marker(run_dir, join)),
                str(os.getpid()),
                str(period_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # no copy of the runtime's output pipes outlives this process
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        return None
    return Watcher(proc)


def watch(marker_path: Path, pid: int, period_s: float, stdin_fd: int = 0) -> None:
    """The watcher's loop: SIGKILL ``pid`` once ``marker_path`` exists; return then, or on end of
    file on ``stdin_fd`` (the process released its watcher, or died)."""
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], period_s)
        if readable and not os.read(stdin_fd, 4096):
            return
        if marker_path.exists():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def main(argv: list[str]) -> int:
    marker_path, pid, period_s = Path(argv[0]), int(argv[1]), float(argv[2])
    watch(marker_path, pid, period_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
