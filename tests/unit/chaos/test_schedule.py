"""The chaos schedule is a pure, seeded draw: same seed, same schedule; it survives a JSON round
trip for --replay; unknown kinds and impossible arguments are refused in one line naming them."""

from __future__ import annotations

import json

import pytest

from nanotron_recover.chaos.kinds import KINDS, LOCAL_KINDS, NODE_KINDS, parse_kinds
from nanotron_recover.chaos.schedule import (
    Schedule,
    ScheduleError,
    draw_schedule,
    load_schedule,
    schedule_from_dict,
)
from nanotron_recover.errors import InputError

ARGS = {"dp": 4, "replica_size": 2, "first_step": 5, "last_step": 200, "min_gap": 20}


def draw(seed: int = 7, n: int = 8, kinds=LOCAL_KINDS, **kw) -> Schedule:
    return draw_schedule(seed, n, list(kinds), **{**ARGS, **kw})


def test_same_seed_same_schedule_other_seed_other_schedule():
    assert draw(7) == draw(7)
    assert draw(7).to_json() == draw(7).to_json()
    assert draw(7) != draw(8)


def test_replay_round_trip(tmp_path):
    schedule = draw(11)
    path = schedule.write(tmp_path / "chaos_schedule.json")
    assert load_schedule(path) == schedule
    assert schedule_from_dict(json.loads(path.read_text())) == schedule


def test_faults_spaced_within_the_step_range():
    for seed in range(30):
        schedule = draw(seed, n=9)
        steps = [f.step for f in schedule.faults]
        assert all(ARGS["first_step"] <= s <= ARGS["last_step"] for s in steps)
        assert all(b - a >= ARGS["min_gap"] for a, b in zip(steps, steps[1:], strict=False))
        assert all(0 <= f.delay < 1 for f in schedule.faults)


def test_every_kind_is_sent_when_there_are_enough_faults():
    kinds = ["kill", "freeze", "kill_during_rejoin"]
    for seed in range(10):
        schedule = draw(seed, n=3, kinds=kinds)
        assert sorted(f.kind for f in schedule.faults) == sorted(kinds)


def test_victims_are_distinct_replicas_inside_the_grid():
    for seed in range(20):
        for f in draw(seed, n=9).faults:
            info = KINDS[f.kind]
            assert len(f.victims) == info.victims
            assert len({v.replica for v in f.victims}) == len(f.victims)
            assert all(0 <= v.replica < 4 and 0 <= v.local_rank < 2 for v in f.victims)
            assert (f.role in info.roles) if info.roles else f.role is None


def test_unknown_kind_is_named():
    with pytest.raises(ScheduleError, match=r"unknown fault kind 'kil'.*kill, freeze"):
        draw(kinds=["kill", "kil"])
    with pytest.raises(ValueError, match="unknown fault kind 'nope'"):
        parse_kinds("kill,nope")
    assert issubclass(ScheduleError, InputError)  # the command line says it in one line, exit 2


def test_two_replica_kinds_need_a_third_replica():
    with pytest.raises(ScheduleError, match="kill_two strikes 2 replica.*dp=2"):
        draw(kinds=["kill_two"], dp=2)
    draw(kinds=["kill"], dp=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n": -1}, "number of faults must be >= 0"),
        ({"min_gap": 0}, "min_gap must be >= 1"),
        ({"first_step": 0}, "first_step must be >= 1"),
        ({"last_step": 3}, "last_step must be >= 5"),
        ({"n": 20}, "20 faults at least 20 steps apart do not fit in steps 5..200"),
        ({"kinds": []}, "no fault kind given"),
        ({"dp": 0}, "dp must be >= 1"),
    ],
)
def test_bad_inputs_are_refused(changes, message):
    n = changes.pop("n", 3)
    kinds = changes.pop("kinds", ["kill"])
    with pytest.raises(ScheduleError, match=message):
        draw(n=n, kinds=kinds, **changes)


def test_zero_faults_is_an_empty_schedule():
    assert draw(n=0).faults == ()


def test_node_kinds_are_in_the_vocabulary():
    assert set(NODE_KINDS) == {"node_power_off", "link_cut", "node_freeze"}
    assert not set(NODE_KINDS) & set(LOCAL_KINDS)
    assert all(f.kind in NODE_KINDS for f in draw(n=3, kinds=NODE_KINDS).faults)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="other"), "not a chaos schedule"),
        (lambda d: d["faults"][0].update(kind="boom"), "kind 'boom' is not among"),
        (lambda d: d["faults"][0].update(delay=1.5), r"delay must be in \[0, 1\)"),
        (lambda d: d["faults"][0]["victims"][0].update(replica=9), "outside 4 replicas"),
        (lambda d: d.pop("dp"), "malformed chaos schedule"),
    ],
)
def test_a_damaged_replay_file_is_refused(tmp_path, edit, message):
    data = draw(n=3, kinds=["kill", "freeze"]).to_dict()
    edit(data)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message):
        load_schedule(path)
    path.write_text("{")
    with pytest.raises(ScheduleError, match="is not JSON"):
        load_schedule(path)
