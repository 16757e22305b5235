"""Fault injection schedule (single process; the kills themselves are exercised by
tests/integration/data_parallel/forward/test_transaction.py, where ranks really SIGKILL themselves)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nanotron_recover.config import FaultSpec, RandomFaults, RecoverArgs
from nanotron_recover.ft.faults import FaultInjector, InjectedError, read_deaths
from nanotron_recover.ft.records import write_record


def test_explicit_faults_by_replica_and_rank(tmp_path):
    args = RecoverArgs(
        enabled=True,
        faults=[FaultSpec(step=3, replica=1, phase="backward", microbatch=2), FaultSpec(step=3, rank=5)],
    )
    inj = FaultInjector(args, rank=2, replica=1, run_dir=tmp_path)
    scheduled = inj.scheduled(3, [0, 1, 2])
    assert [(f.replica, f.rank, f.phase, f.microbatch) for f in scheduled] == [
        (1, None, "backward", 2),
        (None, 5, "forward", 0),
    ]
    assert inj.is_victim(scheduled[0]) and not inj.is_victim(scheduled[1])
    assert inj.scheduled(4, [0, 1, 2]) == []


def test_random_faults_are_deterministic_and_stop_at_the_floor(tmp_path):
    args = RecoverArgs(enabled=True, random_faults=RandomFaults(every_steps=2, seed=7, until_replicas=2))
    a = FaultInjector(args, 0, 0, tmp_path)
    b = FaultInjector(args, 9, 3, tmp_path)
    for step in range(1, 20):
        assert a.scheduled(step, [0, 1, 2, 3]) == b.scheduled(step, [0, 1, 2, 3]), "every rank agrees"
    assert a.scheduled(3, [0, 1, 2, 3]) == [], "only every 2 steps"
    victims = {a.scheduled(s, [0, 1, 2, 3])[0].replica for s in range(2, 60, 2)}
    assert victims <= {0, 1, 2, 3} and len(victims) > 1, "the victim varies with the step"
    assert a.scheduled(4, [1, 3]) == [], "never below until_replicas"


def test_victim_records_its_death_and_is_killed(tmp_path):
    """The victim writes its time of death, then dies by SIGKILL (-9), never by exit status."""
    code = (
        "from pathlib import Path\n"
        "from nanotron_recover.config import RecoverArgs, FaultSpec\n"
        "from nanotron_recover.ft.faults import FaultInjector\n"
        f"inj = FaultInjector(RecoverArgs(enabled=True, faults=[FaultSpec(step=2, replica=0, phase='gate')]), 4, 0, Path({str(tmp_path)!r}))\n"
        "inj.begin_step(1, [0, 1])\n"
        "inj.maybe_fail('gate')\n"
        "inj.begin_step(2, [0, 1])\n"
        "inj.maybe_fail('forward')\n"
        "print('alive', flush=True)\n"
        "inj.maybe_fail('gate')\n"
        "print('not reached', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9
    assert "alive" in proc.stdout and "not reached" not in proc.stdout
    deaths = read_deaths(tmp_path, [4, 5])
    assert len(deaths) == 1 and deaths[0]["rank"] == 4 and deaths[0]["phase"] == "gate"
    assert json.loads((tmp_path / "faults" / "step2_gate0_rank4.json").read_text())["step"] == 2


def test_a_fault_fires_once_per_run(tmp_path):
    """A relaunched job (checkpoint-restart) recomputes the step but must not die there again."""
    args = RecoverArgs(enabled=True, faults=[FaultSpec(step=2, replica=0, phase="forward")])
    inj = FaultInjector(args, 0, 0, tmp_path)
    inj.begin_step(2, [0, 1])
    # What the first incarnation left before its SIGKILL:
    write_record(tmp_path, "step2_forward0_rank0", {"rank": 0, "replica": 0, "step": 2, "kind": "crash"})
    inj.maybe_fail("forward", 0)  # returns: already fired


def test_injected_error_is_transient_or_persistent(tmp_path):
    """``kind: error`` raises in whoever computes the id: once, or every time with ``persistent``."""
    once = RecoverArgs(enabled=True, faults=[FaultSpec(step=3, kind="error", id=21)])
    inj = FaultInjector(once, 0, 0, tmp_path / "once")
    inj.begin_step(3, [0, 1])
    inj.maybe_raise(20)  # another id: nothing
    with pytest.raises(InjectedError, match="micro-batch 21"):
        inj.maybe_raise(21)
    other_replica = FaultInjector(once, 2, 1, tmp_path / "once")
    other_replica.begin_step(3, [0, 1])
    other_replica.maybe_raise(21)  # transient: already struck once in this run
    always = RecoverArgs(enabled=True, faults=[FaultSpec(step=3, kind="error", id=21, persistent=True)])
    for rank, replica in ((0, 0), (2, 1)):
        inj = FaultInjector(always, rank, replica, tmp_path / "always")
        inj.begin_step(3, [0, 1])
        with pytest.raises(InjectedError):
            inj.maybe_raise(21)
        inj.maybe_fail("forward", 0)  # an error fault never kills anyone by itself
