"""How the campaign report names what the job did: a relaunch of any kind (a regrow included) is
the supervisor's, not a rank's failure; and how it counts the time at full width."""

from __future__ import annotations

import pytest

from nanotron_recover.chaos.report import JOB_KINDS, RELAUNCH_KINDS, _describe_incident, full_width_share


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
