"""How the campaign report names what the job did: a relaunch of any kind (a regrow included) is
the supervisor's, not a rank's failure."""

from __future__ import annotations

from nanotron_recover.chaos.report import JOB_KINDS, RELAUNCH_KINDS, _describe_incident


def test_a_regrow_is_a_relaunch_not_a_rank_failure():
    assert set(RELAUNCH_KINDS) == {"node_lost", "job_lost", "stalled", "regrow"}
    assert "regrow" in JOB_KINDS
    regrow = {"kind": "regrow", "generation": 4, "state_from": "snapshot", "step": 65}
    assert _describe_incident(regrow) == "regrow -> generation 4 from snapshot @65"
