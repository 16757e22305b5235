"""The relaunch's host plan: which hosts answer (probed in parallel, measured, retried, bounded),
and the launcher's line restricted to them, the last rank table's hosts first, with the job's
slots per node and, when they hold fewer, fewer whole replicas."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nanotron_recover import host_probe
from nanotron_recover import hosts as hosts_module
from nanotron_recover.host_probe import ProbeRun, probe_hosts, run_bounded
from nanotron_recover.hosts import (
    HostPlan,
    dead_state,
    holders_first,
    launcher_at,
    rank_table_hosts,
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
        if len(probed) <= 2:
            both_waiting.wait()  # breaks (and fails the test) unless the two probes run together
        return host == "a"

    monkeypatch.setattr(HostPlan, "_probe", staticmethod(probe))
    assert plan.answering() == ["a"]
    assert sorted(probed) == ["a", "d", "d"]  # d failed, was probed once more, and is lost


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


# -- the launcher's line ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix",
    [
        ["mpiexec"],
        ["prterun"],
        ["orterun"],
        ["/opt/ompi/bin/mpiexec"],
        ["mpirun.openmpi"],
        ["env", "OMP_NUM_THREADS=1", "X=a=b", "mpiexec"],
        ["timeout", "600", "mpirun"],
        [
            "timeout",
            "-s",
            "KILL",
            "-k",
            "5",
            "10m",
            "/usr/bin/env",
            "-u",
            "X",
            "A=1",
            "/opt/ompi/bin/prterun",
        ],
    ],
)
def test_every_open_mpi_launcher_is_restricted_to_the_answering_hosts(prefix):
    """By basename, also behind ``env VAR=...`` and ``timeout N``: the wrappers stay as they were."""
    job = [*prefix, "-n", "4", "--map-by", "ppr:2:node", "python", "train.py"]
    at = len(prefix) - 1
    assert launcher_at(job) == at
    out = relaunch_command(job, ["a", "c"], ranks=2)
    assert out[: at + 1] == prefix
    assert out[at + 1 : at + 6] == ["--host", "a:2,c:2", "--prtemca", "plm_slurm_args", "--overlap"]
    assert out[at + 6 :] == ["-n", "2", "--map-by", "ppr:2:node", "python", "train.py"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["python", "train.py"],
        ["srun", "-n", "2", "prog"],
        ["env", "-S", "mpirun -n 2", "prog"],  # a split string: not parsed
        ["timeout", "mpirun", "-n", "2"],  # no duration: not timeout's line
        ["nice", "mpirun", "-n", "2"],
        ["mpiexec.hydra", "-n", "2", "prog"],  # MPICH's
        ["env", "A=1"],
    ],
)
def test_a_command_without_an_open_mpi_launcher_is_not_rewritten(cmd):
    assert launcher_at(cmd) is None
    assert relaunch_command(cmd, ["a"], ranks=1) == cmd


def test_the_jobs_own_host_list_does_not_survive_a_relaunch():
    job = ["mpirun", "-H", "a,b,c", "--host=a,b,c", "-host", "a,b,c", "-n", "3", "prog"]
    assert relaunch_command(job, ["a", "c"]) == [
        "mpirun",
        *["--host", "a:1,c:1", "--prtemca", "plm_slurm_args", "--overlap"],
        *["-n", "3", "prog"],
    ]


# -- the probe ----------------------------------------------------------------------------------
def plan_of(monkeypatch, hosts: list[str], probe, states: dict[str, str] | None = None) -> HostPlan:
    plan = HostPlan(hosts)
    monkeypatch.setattr(plan, "_states", lambda: dict(states or {}))
    monkeypatch.setattr(HostPlan, "_probe", staticmethod(probe))
    return plan


def timed(fn):
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


def test_512_hosts_are_probed_in_parallel_well_under_the_cap(monkeypatch):
    """512 hosts answering in 0.2 s each (102 s one after the other): every host answers, with as
    many probes in flight as the probe allows (64: about 1.6 s on an idle machine, printed; no
    time is asserted, a busy machine stretches it)."""
    lock = threading.Lock()
    running, most = [0], [0]

    def probe(host: str) -> bool:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return True

    plan = plan_of(monkeypatch, [f"n{i:03d}" for i in range(512)], probe)
    answer, took = timed(plan.answering)
    print(f"512 hosts x 0.2 s: probe {took:.2f} s, {most[0]} in flight at most")
    assert answer == plan.hosts
    assert most[0] == host_probe.PROBE_WORKERS  # bounded, and used: the hosts are probed in parallel


def test_the_probe_waits_for_answers_but_not_for_a_silent_host(monkeypatch):
    """Every host answers: the probe returns with all of them. One host silent besides: it is
    tried 1 + PROBE_RETRIES times (each try given PROBE_SLACK times the slowest answer) and counted
    lost while its tries are still silent, not when they would end. Checked by what happened, not
    by how long it took (a busy machine stretches every answer, and the probe's windows with them)."""
    calls: dict[str, int] = {}
    silent_ended = threading.Event()

    def probe(host: str) -> bool:
        calls[host] = calls.get(host, 0) + 1
        if host == "lost":
            time.sleep(8)  # a powered-off node: no answer
            silent_ended.set()
            return False
        time.sleep(0.05)
        return True

    plan = plan_of(monkeypatch, ["a", "b", "c"], probe)
    (answer, probe_s), _ = timed(ProbeRun(plan, log=pytest.fail).answer)
    assert answer == ["a", "b", "c"] and probe_s >= 0.05  # it waited for the answers

    calls.clear()
    plan = plan_of(monkeypatch, ["a", "b", "lost", "c"], probe)
    (answer, probe_s), _ = timed(ProbeRun(plan, log=pytest.fail).answer)
    print(f"3 hosts x 0.05 s and a silent one: probe_s {probe_s:.3f} s")
    assert answer == ["a", "b", "c"]
    assert calls["lost"] == 1 + host_probe.PROBE_RETRIES and not silent_ended.is_set(), calls


def test_a_host_that_fails_once_is_retried_and_one_that_fails_twice_is_lost(monkeypatch):
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def probe(host: str) -> bool:
        with lock:
            calls[host] = calls.get(host, 0) + 1
            n = calls[host]
        time.sleep(0.02)
        return host == "ok" or (host == "flaky" and n == 2)

    plan = plan_of(monkeypatch, ["ok", "flaky", "bad"], probe)
    assert plan.answering() == ["ok", "flaky"]
    assert calls == {"ok": 1, "flaky": 2, "bad": 2}


def test_a_slow_host_whose_first_try_answers_late_still_answers(monkeypatch):
    """``slow`` is silent past 4x the others' answer: it is probed again, and the first try's
    late answer counts."""
    calls: list[str] = []

    def probe(host: str) -> bool:
        calls.append(host)
        if host == "slow" and calls.count("slow") == 1:
            time.sleep(0.4)  # past 4 x 0.08 s: retried; answers before the retry's own window ends
            return True
        if host == "slow":
            time.sleep(3)
            return False
        time.sleep(0.08)
        return True

    plan = plan_of(monkeypatch, ["a", "slow", "b"], probe)
    answer, took = timed(plan.answering)
    assert answer == ["a", "slow", "b"] and calls.count("slow") == 2 and took < 1.5


def test_draining_nodes_still_hold_the_job_drained_down_and_failed_ones_do_not(monkeypatch):
    """sinfo's ``drng`` (DRAINING: the node runs the jobs it holds, takes no new ones) is probed;
    ``drain`` (DRAINED), ``down``, ``fail``, not responding (``*``) and powered off (``~``) are not."""
    states = {"a": "drng", "b": "drain", "c": "mix-", "d": "down*", "e": "fail", "f": "drng*"}
    states |= {"g": "idle~", "h": "alloc", "i": "maint", "j": "failg", "k": "alloc$"}
    probed: list[str] = []

    def probe(host: str) -> bool:
        probed.append(host)
        return True

    plan = plan_of(monkeypatch, sorted(states), probe, states)
    assert plan.answering() == ["a", "c", "h", "i", "k"]
    assert sorted(probed) == ["a", "c", "h", "i", "k"]
    assert not dead_state("") and not dead_state("DRNG") and dead_state("DRAIN") and dead_state("down")


def test_a_probe_that_raises_counts_as_no_host_known_lost(monkeypatch):
    def probe(host: str) -> bool:
        if host == "b":
            raise RuntimeError("srun output not understood")
        return True

    plan = plan_of(monkeypatch, ["a", "b", "c"], probe)
    with pytest.raises(RuntimeError):
        plan.answering()
    lines: list[str] = []
    answer, _ = ProbeRun(plan, lines.append).answer()
    assert answer == ["a", "b", "c"]
    assert lines == [
        "probing the hosts failed (RuntimeError: srun output not understood): no host counted lost"
    ]


def test_a_probe_that_does_not_end_counts_as_no_host_known_lost(monkeypatch):
    release = threading.Event()
    plan = plan_of(monkeypatch, ["a", "b"], lambda host: True)
    monkeypatch.setattr(plan, "answering", lambda: release.wait(10) and [])
    lines: list[str] = []
    try:
        (answer, probe_s), took = timed(lambda: ProbeRun(plan, lines.append).answer(limit_s=0.2))
    finally:
        release.set()
    assert answer == ["a", "b"] and took < 2.0 and probe_s >= 0.2
    assert lines == ["probing the hosts did not end within 0.2s: no host counted lost"]


def test_probes_are_bounded_by_the_cap(monkeypatch):
    """No host answers and every try hangs: the probe gives up at its cap."""
    (answer, took) = timed(lambda: probe_hosts(["a", "b"], lambda h: time.sleep(3) or True, cap_s=0.3))
    assert answer == [] and took < 1.5


def test_a_command_is_run_with_a_bound():
    assert run_bounded(["sh", "-c", "echo hi"], 10) == (0, "hi\n")
    assert run_bounded(["/nonexistent/command"], 10) == (None, "")
    result, took = timed(lambda: run_bounded(["sleep", "30"], 0.2))
    assert result == (None, "") and took < 3.0


def test_the_hosts_of_the_last_rank_table_come_first(tmp_path):
    table = [
        {"rank": 2, "host": "f"},
        {"rank": 0, "host": "d"},
        {"rank": 1, "host": "d"},
        {"rank": 3, "host": "b"},
    ]
    (tmp_path / "ranks.json").write_text(json.dumps(table))
    holders = rank_table_hosts(tmp_path)
    assert holders == ["d", "f", "b"]  # by first rank, each once
    # A lost holder (e) is left out; the other answering hosts follow in their own order.
    assert holders_first(["a", "b", "c", "d", "f"], holders + ["e"]) == ["d", "f", "b", "a", "c"]
    assert holders_first(["a", "b"], []) == ["a", "b"]


def test_no_rank_table_means_the_allocation_order(tmp_path):
    assert rank_table_hosts(tmp_path) == []
    (tmp_path / "ranks.json").write_text("{not json")
    assert rank_table_hosts(tmp_path) == []
    (tmp_path / "ranks.json").write_text(json.dumps([{"host": "a"}]))  # no rank
    assert rank_table_hosts(tmp_path) == []
