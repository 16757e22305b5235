"""benchmarks/chaos_cluster.py: a segment's time limit."""

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCHMARKS))  # its own imports (common) are siblings
    try:
        return importlib.import_module("chaos_cluster")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_a_segment_has_time_for_its_steps_whatever_budget_is_left():
    m = _module()
    # The default budget (1800 s) left a 135,000-step campaign 2,400 s: it was ended at step 47,391.
    assert m.segment_timeout_s(1800.0, 135_000) >= 135_000 * m.SLOW_STEP_S
    # A budget larger than the steps need still counts, and a short campaign gets 10 minutes.
    assert m.segment_timeout_s(20_000.0, 600) == 20_600.0
    assert m.segment_timeout_s(-700.0, 0) == 600.0
