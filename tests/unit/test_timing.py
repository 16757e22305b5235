"""PhaseTimes: seconds per phase of a step's window, and the fields of its metrics record."""

from __future__ import annotations

import itertools

import pytest

from nanotron_recover.timing import PHASES, PhaseTimes


def ticking() -> PhaseTimes:
    """A clock that advances by one second at every reading."""
    return PhaseTimes(clock=itertools.count().__next__)


def test_phases_accumulate_where_they_are_measured():
    times = ticking()  # started at 0
    with times.phase("compute"):  # 1 -> 2
        pass
    mark = times.now()  # 3
    mark = times.add("reduce", mark, nbytes=8 * 10**9)  # 3 -> 4
    times.add("agree", mark)  # 4 -> 5
    with times.phase("compute"):  # 6 -> 7
        pass
    record = times.record()  # wall: 0 -> 8
    assert record["compute_s"] == 2 and record["reduce_s"] == 1 and record["agree_s"] == 1
    assert record["reduce_bytes"] == 8 * 10**9 and record["reduce_gbps"] == 8.0
    assert record["wall_s"] == 8
    assert {f"{p}_s" for p in PHASES} | {"reduce_bytes", "reduce_gbps", "wall_s"} == set(record)
    assert sum(record[f"{p}_s"] for p in PHASES) <= record["wall_s"]


def test_a_phase_that_raises_still_counts():
    times = ticking()
    with pytest.raises(RuntimeError), times.phase("recovery"):
        raise RuntimeError("failed collective")
    assert times.record()["recovery_s"] == 1


def test_start_opens_a_new_window():
    times = ticking()
    with times.phase("optimizer"):
        pass
    times.add("reduce", times.now(), nbytes=4)
    times.start()
    record = times.record()
    assert all(record[f"{p}_s"] == 0 for p in PHASES)
    assert record["reduce_bytes"] == 0 and record["reduce_gbps"] == 0.0 and record["wall_s"] == 1


def test_an_unknown_phase_is_refused():
    with pytest.raises(KeyError, match="unknown phase 'backward'"):
        ticking().add("backward", 0.0)
