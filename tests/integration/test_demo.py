"""The README's main job, end to end with fewer steps: plain and fault-tolerant runs agree."""

from __future__ import annotations

import pytest

from nanotron_recover.logging import read_incidents, read_metrics
from tests.helpers.mpirun_utils import check, run_cli

pytestmark = pytest.mark.mpi


def test_demo_runs_end_to_end(tmp_path):
    result = check(run_cli(["demo", "--out", str(tmp_path), "--steps", "6"], timeout=600))
    assert "agree" in result.stdout, result.stdout[-2000:]
    plain, recover = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "recover")
    assert [r["ids_digest"] for r in plain] == [r["ids_digest"] for r in recover]
    assert recover[-1]["replicas"] == 2, "the demo kills two of four replicas"
    assert [i["phase"] for i in read_incidents(tmp_path / "recover")] == ["forward", "reduce"]
    png = (tmp_path / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
