"""Running real multi-process jobs from tests: mpirun with a hard timeout, killing only our own.

The command is started in a new session (its own process group). On timeout, it and every process
descended from it get SIGKILL: ``launch`` starts mpirun in a session of its own, which a kill of
the group alone would leave running (holding the output pipe open). Nothing else on the machine is
touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanotron_recover.launcher import mpirun_command
from nanotron_recover.outcome import read_outcome
from nanotron_recover.session_dirs import fresh_session

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path | None = None  # a ``train`` run's folder: :func:`check` reads its outcome too

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def single_rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra or {})
    return env


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (read from /proc before anything is killed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process descended from it, whatever its session."""
    below = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for target in below:
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def start_mpirun(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start an ``mpirun`` command in a session of its own (so a hung job is killed as a whole:
    mpirun, its daemons, the ranks) with stdout and stderr together, started fresh: a stale session
    folder of its pid, left by a killed mpirun, would stop it with exit 213 (``session_dirs.py``)."""
    return subprocess.Popen(
        fresh_session(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        text=True,
    )


def wait_mpirun(
    proc: subprocess.Popen[str], timeout_s: float, describe: Callable[[], str] = lambda: ""
) -> str:
    """The output of an ``mpirun`` started by :func:`start_mpirun` once it ends. Past ``timeout_s``
    the job is killed as a whole (the ranks too: one deadlocked inside Open MPI outlives its daemon)
    and the test fails, with ``describe()`` and the end of the output."""
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        log, _ = proc.communicate()
        pytest.fail(f"mpirun timed out after {timeout_s}s{describe()}:\n{log[-4000:]}")
    return log


def run_process(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Completed:
    proc = subprocess.Popen(
        fresh_session(cmd),  # as the supervisor starts mpirun (session_dirs.py)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or single_rank_env(),
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    return Completed(proc.returncode, out, err)


def run_cli(
    args: list[str], nproc: int = 1, timeout: float = 300, env: dict[str, str] | None = None
) -> Completed:
    """``nanotron-recover ARGS`` as one process, or under mpirun with ``nproc`` ranks."""
    program = [sys.executable, "-m", "nanotron_recover.cli", *args]
    cmd = program if nproc == 1 else mpirun_command(nproc, program)
    result = run_process(cmd, timeout, env=env)
    result.run_dir = train_run_dir(args)
    return result


def train_run_dir(args: list[str]) -> Path | None:
    """The ``--run-dir`` of a ``train`` command that writes an outcome (not a dry run)."""
    if not args or args[0] != "train" or "--dry-run" in args:
        return None
    for i, a in enumerate(args):
        if a == "--run-dir" and i + 1 < len(args):
            return Path(args[i + 1])
        if a.startswith("--run-dir="):
            return Path(a.split("=", 1)[1])
    return None


def check(result: Completed) -> Completed:
    """Exit 0, and for a ``train`` run its own outcome record says so too: with ULFM, ``mpirun``
    exits 0 when every rank died by a signal (a rank's watchdog SIGKILLs it), so its status alone
    does not say that every step was committed (the launcher reads the record for the same
    reason, ``outcome.py``)."""
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"exit {result.returncode}\n{output}"
    if result.run_dir is not None:
        outcome = read_outcome(result.run_dir)
        assert outcome is not None, f"exit 0, but the run wrote no outcome (its ranks died)\n{output}"
        assert outcome["exit_code"] == 0, f"exit 0, but the run's outcome says {outcome}\n{output}"
        if outcome["status"] == "completed":
            assert outcome["last_step"] == outcome["target_step"], f"completed short: {outcome}\n{output}"
    return result


def layout(tp: int, pp: int, dp: int, g: int, engine: str = "1f1b") -> list[str]:
    """``--set`` overrides for a (tp, pp, dp) layout with ``g`` accumulation steps per replica."""
    return [
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.dp={dp}",
        f"tokens.batch_accumulation_per_replica={g}",
        f"parallelism.pp_engine={engine}",
    ]


class BackgroundJob:
    """``nanotron-recover ARGS`` running in the background (its own session), so a test can signal
    its ranks from outside while it runs."""

    def __init__(self, run_dir: Path, args: list[str]):
        self.run_dir = run_dir
        program = [sys.executable, "-m", "nanotron_recover.cli", *args]
        self.proc = subprocess.Popen(
            program,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=single_rank_env(),
            cwd=REPO,
            start_new_session=True,
        )

    def wait_until(self, condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before {what}:\n{self.proc.stdout.read()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.002)

    def committed(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        try:
            return json.loads(lines[-1])["step"] if lines else 0
        except ValueError:
            return 0  # a line being written

    def pid(self, rank: int) -> int:
        self.wait_until(lambda: (self.run_dir / "ranks.json").exists(), "the rank table")
        table = json.loads((self.run_dir / "ranks.json").read_text())
        return next(r["pid"] for r in table if r["rank"] == rank)

    def kill(self) -> None:
        kill_tree(self.proc.pid)

    def finish(self, timeout: float = 240.0) -> Completed:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"job timed out:\n{out[-4000:]}") from None
        return Completed(self.proc.returncode, out, "")


def process_exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def rank_results(out: Path, returncode: int | None, log: str) -> dict[int, dict]:
    """The ``rank<r>.json`` records an MPI worker wrote in ``out``, by rank; at least one."""
    results = {}
    for f in out.glob("rank*.json"):
        d = json.loads(f.read_text())
        results[d["rank"]] = d
    assert results, f"no result files; mpirun rc={returncode}\n{log[-4000:]}"
    return results
