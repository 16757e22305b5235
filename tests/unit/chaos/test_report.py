"""How the campaign report names what the job did: a relaunch of any kind (a regrow included) is
the supervisor's, not a rank's failure; and how it counts the time at full width."""

from __future__ import annotations

import pytest

from nanotron_recover.chaos.report import (
    JOB_KINDS,
    RELAUNCH_KINDS,
    _describe_incident,
    full_width_share,
    markdown,
)


def test_a_regrow_is_a_relaunch_not_a_rank_failure():
    assert set(RELAUNCH_KINDS) == {"node_lost", "job_lost", "stalled", "regrow"}
    assert "regrow" in JOB_KINDS
    regrow = {"kind": "regrow", "generation": 4, "state_from": "snapshot", "step": 65}
    assert _describe_incident(regrow) == "regrow -> generation 4 from snapshot @65"


def test_full_width_counts_only_the_time_between_two_full_commits():
    metrics = [
        {"step": 1, "time": 0.0, "replicas": 3},
        {"step": 2, "time": 1.0, "replicas": 3},  # 1 s at full width
        {"step": 3, "time": 4.0, "replicas": 2},  # a repair, then a narrower step
        {"step": 4, "time": 9.0, "replicas": 3},  # a re-join's wait: not yet at full width
        {"step": 5, "time": 10.0, "replicas": 3},  # 1 s at full width
    ]
    assert full_width_share(metrics, 3) == pytest.approx(2 / 10)
    assert full_width_share(metrics[:1], 3) is None


def test_a_stall_and_the_relaunch_after_it_count_for_their_seconds():
    metrics = [
        {"step": 1, "time": 0.0, "replicas": 3},
        {"step": 2, "time": 1.0, "replicas": 3},
        {"step": 3, "time": 2.0, "replicas": 3},
        # no commit for 45 s, then a relaunch that redoes step 3 and commits it at full width
        {"step": 3, "time": 56.0, "replicas": 3},
        {"step": 4, "time": 57.0, "replicas": 3},
    ]
    assert full_width_share(metrics, 3, {3}) == pytest.approx(3 / 57)
    # Named as relaunched or not, the 54 s without a commit trained nothing: never full width
    # (with step 4 named, its own second is cut as a relaunch's first commit too).
    assert full_width_share(metrics, 3, {4}) == pytest.approx(2 / 57)
    assert full_width_share(metrics, 3) == pytest.approx(3 / 57)


def test_a_stall_with_every_replica_still_in_the_job_is_not_full_width():
    # A cut-off process nobody watches: the others wait for it in the reduction, no replica is
    # shrunk away, and the step commits at full width once the link is back, 26 s later.
    metrics = [{"step": s, "time": 0.3 * (s - 1), "replicas": 3} for s in range(1, 11)]
    metrics += [{"step": s, "time": 26.0 + 0.3 * (s - 11), "replicas": 3} for s in range(11, 21)]
    total = metrics[-1]["time"]
    assert full_width_share(metrics, 3) == pytest.approx(18 * 0.3 / total)
    # A step a few times slower than the median (a save, a busy machine) still trains.
    metrics[5]["time"] += 1.0
    for r in metrics[6:]:
        r["time"] += 1.0
    assert full_width_share(metrics, 3) == pytest.approx((18 * 0.3 + 1.0) / (total + 1.0))


def _judged(incidents: list[dict], commits: list[tuple[int, float, int]], sent: list[dict]) -> dict:
    """``judge`` over a run that is only records: incidents, commits (step, time, replicas) and
    the faults sent, each with the incidents recorded before it."""
    from types import SimpleNamespace

    from nanotron_recover.chaos.report import judge
    from nanotron_recover.chaos.schedule import Schedule
    from nanotron_recover.chaos.watch import Commit

    records = [{"step": s, "time": t, "replicas": r} for s, t, r in commits]
    watch = SimpleNamespace(
        incidents=incidents,
        metrics=SimpleNamespace(records=records),
        commits=[Commit(s, t, r, t) for s, t, r in commits],
        generation=0,
        outcome=None,
    )
    run = SimpleNamespace(
        watch=watch,
        sent=sent,
        unsent=[],
        launch_cmd=["x"],
        started_at=0.0,
        ended_at=100.0,
        exit_code=0,
        hang=None,
        left_behind=[],
    )
    return judge(
        run=run,
        schedule=Schedule(0, ("kill",), 3, 1, 1, 60, 1),
        run_dir=None,
        ref_dir=None,
        dp=3,
        replica_size=1,
        steps=60,
        exact=False,
        replay_cmd="-",
    )


def _sent(index: int, kind: str, incidents_before: int, rank: int, sent_at: float) -> dict:
    """A fault as the runner records it once sent: a SIGKILL to ``rank`` (its own replica)."""
    signals = [{"rank": rank, "replica": rank, "pid": 7 + index, "sig": 9, "sent": True}]
    return {
        "index": index,
        "kind": kind,
        "scheduled_step": int(sent_at),
        "incidents_before": incidents_before,
        "signals": signals,
        "sent_at": sent_at,
    }


def test_a_relaunch_after_the_job_was_back_at_full_width_is_no_reaction_to_the_fault():
    """The fault's own relaunch is its reaction; one after the job was whole again, or before any
    fault, is a job lost with every replica healthy, and is counted as such."""
    kill, power_off = (
        _sent(0, "kill", 1, rank=1, sent_at=10.5),
        _sent(1, "node_power_off", 4, rank=2, sent_at=40.5),
    )
    incidents = [
        {"kind": "job_lost", "step": 5},  # before any fault
        {"kind": "crash", "step": 11, "failed_ranks": [1]},
        {"kind": "rejoin", "step": 12, "status": "joined"},
        {"kind": "job_lost", "step": 30},  # the job had been whole since step 13
        {"kind": "node_lost", "step": 41},  # the power-off's own reaction
    ]
    commits = [(s, float(s), 2 if s in (11, 12) else 3) for s in range(1, 61)]
    record = _judged(incidents, commits, [kill, power_off])
    assert [(u["step"], u["after_fault"]) for u in record["relaunches_at_full_width"]] == [(5, None), (30, 0)]
    assert record["totals"]["relaunches_at_full_width"] == 2
    assert record["totals"]["relaunches"] == 3


def test_time_below_full_width_is_split_between_the_faults_windows_and_the_rest():
    """A fault's window runs from the fault to the next commit at full width; a stall with every
    replica in the job outside every window is named, with its commit times, as unexplained."""
    from nanotron_recover.chaos.report import below_full_width

    commits = [(s, float(s), 3) for s in range(1, 11)]  # 1 s steps at full width
    commits += [(11, 14.0, 2), (12, 15.0, 2), (13, 18.0, 3)]  # a kill at 10.5: back at 18 s
    commits += [(s, float(s) + 5.0, 3) for s in range(14, 30)]
    commits += [(30, 50.0, 3)]  # a 16 s stall with every replica in, no fault
    commits += [(s, float(s) + 20.0, 3) for s in range(31, 40)]
    metrics = [{"step": s, "time": t, "replicas": r} for s, t, r in commits]
    split = below_full_width(metrics, 3, frozenset(), [(10.5, 18.0)])
    # 10->14, 14->15, 15->18: 8 s below full width, 7.5 s of them after the fault was sent
    assert split["in_fault_windows_s"] == pytest.approx(7.5)
    assert split["outside_s"] == pytest.approx(0.5 + 16.0)
    assert split["outside_gaps"] == 2
    assert split["longest_outside"][0] == {"from": 34.0, "to": 50.0, "outside_s": pytest.approx(16.0)}
    # Two overlapping windows count their seconds once.
    twice = below_full_width(metrics, 3, frozenset(), [(10.5, 18.0), (12.0, 16.0)])
    assert twice["in_fault_windows_s"] == pytest.approx(7.5)
    # Together with the time at full width, the split accounts for the whole run.
    total = metrics[-1]["time"] - metrics[0]["time"]
    share = full_width_share(metrics, 3)
    assert share * total + split["in_fault_windows_s"] + split["outside_s"] == pytest.approx(total)


def test_the_judged_record_carries_the_split_with_each_fault_up_to_its_full_width_commit():
    kill = _sent(0, "kill", 0, rank=1, sent_at=10.5)
    incidents = [
        {"kind": "crash", "step": 11, "failed_ranks": [1]},
        {"kind": "rejoin", "step": 12, "status": "joined"},
    ]
    commits = [(s, float(s), 2 if s in (11, 12) else 3) for s in range(1, 31)]
    commits[20] = (21, 40.0, 3)  # a stall of 19 s at steps 20->21, long after the fault
    commits[21:] = [(s, float(s) + 19.0, 3) for s in range(22, 31)]
    record = _judged(incidents, commits, [kill])
    below = record["totals"]["below_full_width"]
    assert below["in_fault_windows_s"] == pytest.approx(2.5)  # 10.5 -> 13, the first full commit
    assert below["outside_s"] == pytest.approx(0.5 + 20.0)
    assert "outside them | 2.5 / 20.5 s (2 gaps) |" in markdown(record)


def test_a_fault_that_struck_as_a_step_committed_is_back_at_full_width_only_after_its_reaction():
    """The kill lands after the step's reduction: that step commits at full width 1 ms later, and
    the crash and the relaunch come with the next step. The fault's time below full width runs to
    the relaunch's commit, and that relaunch is the fault's reaction, not one at full width."""
    kill = _sent(0, "kill_during_rejoin", 0, rank=1, sent_at=9.999)
    incidents = [{"kind": "crash", "step": 11, "failed_ranks": [1]}, {"kind": "job_lost", "step": 13}]
    commits = [(s, float(s), 3) for s in range(1, 11)]
    commits += [(11, 11.0, 2), (12, 12.0, 2), (13, 20.0, 3)]  # the relaunch's first commit
    commits += [(s, float(s) + 7.0, 3) for s in range(14, 30)]
    record = _judged(incidents, commits, [kill])
    assert record["faults"][0]["to_full_width_s"] == pytest.approx(20.0 - 9.999)
    assert record["relaunches_at_full_width"] == []
    below = record["totals"]["below_full_width"]
    assert below["in_fault_windows_s"] == pytest.approx(10.0)  # 10 -> 20: all of it after the fault
    assert below["outside_s"] == pytest.approx(0.0)
