"""Steady-state plan: roles, ids, shadows, coverage, determinism."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.policy import (
    Assignment,
    CoverageError,
    NoReplicasLeft,
    Role,
    StepPlan,
    check_coverage,
    steady_plan,
)


def _ids(plan: StepPlan) -> dict[int, tuple[int, ...]]:
    return {r: plan.ids_of(r) for r in plan.alive}


def _roles(plan: StepPlan) -> dict[int, Role]:
    return {r: a.role for r, a in plan.assignments.items()}


# ---------------------------------------------------------------- unit: B=8


def test_b8_w4_four_majors_of_two() -> None:
    plan = steady_plan(0, 8, range(4))
    assert plan.g == 2
    assert _ids(plan) == {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}
    assert set(_roles(plan).values()) == {Role.MAJOR}
    assert plan.contributed_ids() == tuple(range(8))
    assert plan.divisor == 8
    check_coverage(plan)


def test_b8_w3_two_majors_and_a_minor() -> None:
    plan = steady_plan(0, 8, range(3))
    assert plan.g == 3
    assert _roles(plan) == {0: Role.MAJOR, 1: Role.MAJOR, 2: Role.MINOR}
    assert _ids(plan) == {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}
    assert plan.replicas_with(Role.MINOR) == (2,)
    check_coverage(plan)


def test_b8_w2_and_w1() -> None:
    plan = steady_plan(0, 8, [0, 1])
    assert plan.g == 4
    assert _ids(plan) == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    plan = steady_plan(0, 8, [5])
    assert plan.g == 8
    assert _ids(plan) == {5: tuple(range(8))}
    assert plan.divisor == 8
    check_coverage(plan)


def test_step_offsets_ids() -> None:
    plan = steady_plan(5, 8, range(4))
    assert plan.id_range == range(40, 48)
    assert _ids(plan) == {0: (40, 41), 1: (42, 43), 2: (44, 45), 3: (46, 47)}
    check_coverage(plan)


# ---------------------------------------------------------------- unit: spares


def test_b9_w4_one_spare_shadows_first_major() -> None:
    plan = steady_plan(0, 9, range(4))
    assert plan.g == 3
    assert _roles(plan) == {0: Role.MAJOR, 1: Role.MAJOR, 2: Role.MAJOR, 3: Role.SPARE}
    spare = plan.assignments[3]
    assert spare.shadow_of == 0
    assert spare.ids == (0, 1, 2)
    assert not spare.contributes and not spare.promoted
    assert plan.contributed_by(3) == ()
    assert plan.microbatches_of(3) == 3
    assert plan.contributed_ids() == tuple(range(9))
    check_coverage(plan)


def test_spares_round_robin_over_majors() -> None:
    # B=5, W=8: G=1, five Majors, three Spares shadowing Majors 0, 1, 2.
    plan = steady_plan(0, 5, range(8))
    assert plan.g == 1
    assert plan.replicas_with(Role.SPARE) == (5, 6, 7)
    assert [plan.assignments[r].shadow_of for r in (5, 6, 7)] == [0, 1, 2]
    # B=2, W=5: two Spares on Major 0.
    plan = steady_plan(0, 2, range(5))
    assert [plan.assignments[r].shadow_of for r in (2, 3, 4)] == [0, 1, 0]
    check_coverage(plan)


def test_minor_and_spare_together() -> None:
    # B=10, W=4: G=3, 3 Majors, Minor with 1 id, no Spare; B=10, W=5: G=2, 5 Majors.
    plan = steady_plan(0, 10, range(4))
    assert _roles(plan) == {0: Role.MAJOR, 1: Role.MAJOR, 2: Role.MAJOR, 3: Role.MINOR}
    assert plan.ids_of(3) == (9,)
    # B=7, W=6: G=2, 3 Majors, Minor with 1 id, 2 Spares.
    plan = steady_plan(0, 7, range(6))
    assert _roles(plan) == {
        0: Role.MAJOR,
        1: Role.MAJOR,
        2: Role.MAJOR,
        3: Role.MINOR,
        4: Role.SPARE,
        5: Role.SPARE,
    }
    assert plan.ids_of(4) == (0, 1) and plan.ids_of(5) == (2, 3)
    check_coverage(plan)


def test_spares_off_compute_nothing() -> None:
    plan = steady_plan(0, 9, range(4), spares="off")
    spare = plan.assignments[3]
    assert spare.role is Role.SPARE
    assert spare.ids == () and spare.shadow_of is None and not spare.contributes
    assert plan.microbatches_of(3) == 0
    check_coverage(plan)


def test_non_contiguous_alive_in_any_order() -> None:
    plan = steady_plan(2, 6, [7, 1, 4])
    assert plan.alive == (1, 4, 7)
    assert _ids(plan) == {1: (12, 13), 4: (14, 15), 7: (16, 17)}
    assert plan == steady_plan(2, 6, (1, 4, 7))


# ---------------------------------------------------------------- unit: errors and helpers


def test_invalid_inputs() -> None:
    with pytest.raises(NoReplicasLeft):
        steady_plan(0, 8, [])
    with pytest.raises(ValueError, match="distinct"):
        steady_plan(0, 8, [1, 1])
    with pytest.raises(ValueError, match="B"):
        steady_plan(0, 0, [0])
    with pytest.raises(ValueError, match="step"):
        steady_plan(-1, 8, [0])
    with pytest.raises(ValueError, match="spares"):
        steady_plan(0, 8, [0], spares="hot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        steady_plan(0, 8, [-1, 0])
    with pytest.raises(KeyError, match="not alive"):
        steady_plan(0, 8, [0]).ids_of(3)
    with pytest.raises(ValueError, match="alive"):
        StepPlan(0, 1, (0, 1), 1, "shadow", {0: Assignment(0, Role.MAJOR, (0,))})


def test_check_coverage_names_missing_duplicated_and_stray_ids() -> None:
    plan = steady_plan(1, 4, range(2))  # ids 4..7
    broken = replace(
        plan,
        assignments={
            0: Assignment(0, Role.MAJOR, (4, 5), extra_ids=(5, 9)),
            1: Assignment(1, Role.MAJOR, (6,)),
        },
    )
    with pytest.raises(CoverageError) as err:
        check_coverage(broken)
    message = str(err.value)
    assert "missing ids [7]" in message
    assert "duplicated ids [5]" in message
    assert "outside the step [9]" in message
    # A spare promoted without its Major dying duplicates the Major's ids.
    plan = steady_plan(0, 9, range(4))
    doubled = replace(
        plan, assignments={**plan.assignments, 3: replace(plan.assignments[3], contributes=True)}
    )
    with pytest.raises(CoverageError, match=r"duplicated ids \[0, 1, 2\]"):
        check_coverage(doubled)


def test_check_coverage_truncates_long_lists() -> None:
    plan = steady_plan(0, 100, range(2))
    empty = replace(plan, assignments={r: replace(a, contributes=False) for r, a in plan.assignments.items()})
    with pytest.raises(CoverageError, match=r"\(100 in all\)"):
        check_coverage(empty)


def test_plans_are_frozen_and_hashable() -> None:
    plan = steady_plan(0, 9, range(4))
    assert hash(plan) == hash(steady_plan(0, 9, [3, 2, 1, 0]))
    with pytest.raises(TypeError):
        plan.assignments[0] = plan.assignments[1]  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.g = 4  # type: ignore[misc]


# ---------------------------------------------------------------- properties

alive_sets = st.integers(1, 32).flatmap(
    lambda w_init: st.sets(st.integers(0, w_init - 1), min_size=1, max_size=w_init)
)


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(0, 10_000),
    B=st.integers(1, 200),
    alive=alive_sets,
    spares=st.sampled_from(["shadow", "off"]),
)
def test_steady_plan_properties(step: int, B: int, alive: set[int], spares: str) -> None:
    plan = steady_plan(step, B, sorted(alive, reverse=True), spares)  # type: ignore[arg-type]
    W = len(alive)
    G = -(-B // W)
    # G = ceil(B / W), floor(B/G) Majors, a Minor iff there is a remainder, the rest Spares.
    assert plan.g == G and plan.alive == tuple(sorted(alive))
    roles = Counter(a.role for a in plan.assignments.values())
    assert roles[Role.MAJOR] == B // G
    assert roles[Role.MINOR] == (1 if B % G else 0)
    assert roles[Role.SPARE] == W - B // G - roles[Role.MINOR]
    # Exact coverage, checked independently of check_coverage, and divisor B.
    summed = Counter(i for r in plan.alive for i in plan.contributed_by(r))
    assert summed == Counter(range(step * B, step * B + B))
    check_coverage(plan)
    assert plan.divisor == B and plan.g_ext_total == 0
    # Ids go to replicas in ascending order; nobody computes more than G.
    order = [i for r in plan.alive for i in plan.contributed_by(r)]
    assert order == sorted(order)
    for r, a in plan.assignments.items():
        assert plan.microbatches_of(r) <= G == plan.max_microbatches
        if a.role is Role.SPARE:
            assert not a.contributes and a.extra_ids == ()
            if spares == "shadow":
                assert plan.assignments[a.shadow_of].role is Role.MAJOR
                assert a.ids == plan.ids_of(a.shadow_of)
            else:
                assert a.ids == () and a.shadow_of is None
    # Round-robin: shadow counts of any two Majors differ by at most one.
    if spares == "shadow" and roles[Role.SPARE]:
        per_major = Counter(a.shadow_of for a in plan.assignments.values() if a.role is Role.SPARE)
        counts = [per_major.get(m, 0) for m in plan.replicas_with(Role.MAJOR)]
        assert max(counts) - min(counts) <= 1
    # Deterministic: a pure function of (step, B, alive, spares).
    assert plan == steady_plan(step, B, sorted(alive), spares)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the ablation's variants


def test_zero_spares_compute_like_shadows_but_are_not_shadows() -> None:
    plan = steady_plan(0, 9, range(4), spares="zero")
    spare = plan.assignments[3]
    assert spare.role is Role.SPARE and spare.ids == plan.ids_of(0), "the same work as a shadow"
    assert spare.shadow_of is None and not spare.promotable and not spare.contributes
    check_coverage(plan)


def test_adaptive_plan_gives_each_replica_its_own_ids_and_drops_the_dead_ones() -> None:
    from nanotron_recover.policy import adaptive_plan

    plan = adaptive_plan(2, 8, 4, [0, 2, 3])  # replica 1 is gone: its ids 18, 19 are not computed
    assert _ids(plan) == {0: (16, 17), 2: (20, 21), 3: (22, 23)}
    assert set(_roles(plan).values()) == {Role.MAJOR} and plan.g == 2
    assert plan.divisor == 6, "the adaptive world averages over what is summed"
    assert steady_plan(2, 8, [0, 2, 3]).divisor == 8, "the static world always divides by B"
    check_coverage(plan)
    with pytest.raises(ValueError, match="must be in 0..3"):
        adaptive_plan(0, 8, 4, [4])
    with pytest.raises(ValueError, match="multiple of the 3 initial replicas"):
        adaptive_plan(0, 8, 3, [0])
    with pytest.raises(NoReplicasLeft):
        adaptive_plan(0, 8, 4, [])
    duplicated = replace(
        plan, assignments={**plan.assignments, 3: replace(plan.assignments[3], ids=(16, 17))}
    )
    with pytest.raises(CoverageError, match="duplicated ids"):
        check_coverage(duplicated)
