"""The relaunch's host plan: which hosts answer (probed at once), and the mpirun line restricted to
them, with the job's slots per node and, when they hold fewer, fewer whole replicas."""

from __future__ import annotations

import threading

import pytest

from nanotron_recover import hosts as hosts_module
from nanotron_recover.hosts import (
    HostPlan,
    ranks_of,
    relaunch_command,
    relaunch_ranks,
    slots_per_host,
)

JOB = ["/venv/bin/mpirun", "--with-ft", "ulfm", "--map-by", "ppr:2:node:NOOVERSUBSCRIBE", "--bind-to", "none"]
JOB += ["--output", "tag", "-n", "6", "python", "-m", "nanotron_recover.cli", "train", "--set", "a=1"]


def test_slots_and_ranks_are_read_from_the_mpirun_line():
    assert slots_per_host(JOB) == 2 and ranks_of(JOB) == 6
    assert slots_per_host(["mpirun", "-n", "4", "prog"]) == 1
    assert ranks_of(["mpirun", "prog"]) is None


@pytest.mark.parametrize(
    ("hosts", "replica_size", "ranks"),
    [
        (["a", "b", "c", "d"], 2, 6),  # a spare: the old width
        (["a", "b", "c"], 2, 6),
        (["a", "c"], 2, 4),  # a node lost, no spare: two replicas of two ranks fit
        (["a", "c"], 3, 3),  # one replica of three ranks fits in four slots
        (["a"], 3, 0),  # none fits
    ],
)
def test_a_relaunch_runs_the_whole_replicas_that_fit(hosts, replica_size, ranks):
    assert relaunch_ranks(JOB, hosts, replica_size) == ranks


def test_the_relaunch_line_names_the_hosts_with_their_slots_and_the_new_width():
    cmd = relaunch_command(JOB, ["a", "c"], ranks=4)
    assert cmd[:6] == ["/venv/bin/mpirun", "--host", "a:2,c:2", "--prtemca", "plm_slurm_args", "--overlap"]
    assert cmd[6:] == [*JOB[1:9], "-n", "4", *JOB[11:]]
    # A second relaunch replaces the first one's hosts and width; the program is untouched.
    again = relaunch_command(cmd, ["c"], ranks=2)
    assert again.count("--host") == 1 and again[2] == "c:2" and again.count("plm_slurm_args") == 1
    assert again[again.index("-n") + 1] == "2" and again[-6:] == JOB[-6:]
    assert relaunch_command(JOB, ["a", "b", "c"])[-len(JOB) + 1 :] == JOB[1:]


def test_a_command_that_is_not_mpirun_is_relaunched_as_it_was():
    assert relaunch_command(["python", "train.py", "-n", "2"], ["a"], ranks=1) == [
        "python",
        "train.py",
        "-n",
        "2",
    ]


def test_hosts_marked_down_are_not_probed_and_the_others_are_probed_at_once(monkeypatch):
    plan = HostPlan(["a", "b", "c", "d"])
    monkeypatch.setattr(plan, "_states", lambda: {"a": "alloc", "b": "down*", "c": "idle*", "d": "mix"})
    probed: list[str] = []
    both_waiting = threading.Barrier(2, timeout=10)

    def probe(host: str) -> bool:
        probed.append(host)
        both_waiting.wait()  # breaks (and fails the test) unless the two probes run together
        return host == "a"

    monkeypatch.setattr(HostPlan, "_probe", staticmethod(probe))
    assert plan.answering() == ["a"]
    assert sorted(probed) == ["a", "d"]


def test_no_host_left_means_no_probe(monkeypatch):
    plan = HostPlan(["a"])
    monkeypatch.setattr(plan, "_states", lambda: {"a": "down"})
    monkeypatch.setattr(HostPlan, "_probe", staticmethod(lambda host: pytest.fail("probed")))
    assert plan.answering() == []
    assert hosts_module.PROBE_TIMEOUT_S > 0


def test_a_host_that_does_not_answer_is_not_waited_for_long(monkeypatch):
    """The live hosts answer at once; a lost one would hang until its own timeout, but the probe
    stops waiting for it a few answer-times later and counts it lost."""
    plan = HostPlan(["a", "b", "lost"])
    monkeypatch.setattr(plan, "_states", lambda: {})
    monkeypatch.setattr(hosts_module, "PROBE_MIN_S", 0.2)
    released = threading.Event()

    def probe(host: str) -> bool:
        if host == "lost":
            released.wait(timeout=30)  # a probe of a dead node: no answer until released
            return False
        return True

    monkeypatch.setattr(HostPlan, "_probe", staticmethod(probe))
    try:
        assert plan.answering() == ["a", "b"]
        assert not released.is_set()  # returned while the lost host's probe was still waiting
    finally:
        released.set()
