"""Incidents (``data_parallel/forward/incidents.py``) on the fake communicator: who logs, and the
kind, phase and detection time a failure record gives."""

from __future__ import annotations

import pytest

from tests.helpers.fake_comm import OTHERS_SURFACED_S, RECORD_LAG_S, Fault
from tests.helpers.forward_replica import Replica


def test_lowest_survivor_logs_when_the_logging_replica_is_lost(tmp_path):
    job = Replica(tmp_path, W=4, G=2, me=1, faults=[Fault(1, "allreduce", 2, (0,))])
    assert not job.fr.is_logger()
    reduced = job.step(1)
    job.assert_full_batch(1, reduced)
    # Replica 0's ids 0, 1 go to the survivors 1, 2 (one each): id 0 to us.
    assert job.engine.batches == [[2, 3], [0]]
    assert job.fr.is_logger()
    (incident,) = job.incidents
    assert incident["failed_replicas"] == [0] and incident["lost_ids"] == [0, 1]


def test_failure_record_gives_kind_phase_and_detection_time(tmp_path):
    record = {"kind": "hang", "phase": "compute", "message": "watchdog: phase 'compute' hung"}
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, "allreduce", 3, (2,), record)])
    job.assert_full_batch(1, job.step(1))
    (incident,) = job.incidents
    assert incident["kind"] == "hang" and incident["phase"] == "compute"
    # From the failure (the record's time) to the earliest survivor seeing it.
    assert incident["detect_method"] == "record"
    assert incident["detect_s"] == pytest.approx(RECORD_LAG_S - OTHERS_SURFACED_S, abs=0.05)
