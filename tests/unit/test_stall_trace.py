"""A rank that commits nothing for its bound writes its stacks once; one that commits, or is
disarmed, writes nothing. Run in child processes: the countdown is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from nanotron_recover.stall_trace import MIN_TRACE_S, trace_after_s


def test_the_dump_comes_before_the_supervisor_ends_the_job():
    assert trace_after_s(SimpleNamespace(commit_timeout_s=45.0, heartbeat_timeout_s=5.0)) == pytest.approx(
        30.0
    )
    assert trace_after_s(SimpleNamespace(commit_timeout_s=0, heartbeat_timeout_s=5.0)) is None
    derived = SimpleNamespace(commit_timeout_s=None, heartbeat_timeout_s=2.0)
    assert trace_after_s(derived) == MIN_TRACE_S
    assert trace_after_s(SimpleNamespace(commit_timeout_s=None, heartbeat_timeout_s=10.0)) == 60.0
    plain = SimpleNamespace(enabled=False, mode="forward", commit_timeout_s=45.0, heartbeat_timeout_s=5.0)
    assert trace_after_s(plain) is None
    restarts = SimpleNamespace(
        enabled=True, mode="checkpoint_restart", commit_timeout_s=45.0, heartbeat_timeout_s=5.0
    )
    assert trace_after_s(restarts) is None


def run_child(body: str) -> subprocess.CompletedProcess:
    code = "import time\nfrom nanotron_recover import stall_trace\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_rank_stuck_past_its_bound_writes_where_it_is():
    out = run_child(
        """
        def stuck_in_a_collective():
            time.sleep(2.0)

        stall_trace.arm(0.3)
        stuck_in_a_collective()
        """
    )
    assert out.returncode == 0, out.stderr
    assert "stuck_in_a_collective" in out.stderr
    assert out.stderr.count("most recent call first") >= 1


def test_a_rank_that_commits_or_is_disarmed_writes_nothing():
    out = run_child(
        """
        for _ in range(10):  # a commit every 0.1 s re-arms a 2 s countdown
            stall_trace.arm(2.0)
            time.sleep(0.1)
        stall_trace.disarm()  # parked
        time.sleep(2.5)
        stall_trace.arm(None)  # the commit deadline is off
        time.sleep(0.5)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "most recent call first" not in out.stderr, out.stderr
