"""Mid-step repair: spare promotion, policy boundary, cascades, and the invariants behind them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nanotron_recover.policy import (
    Action,
    NoReplicasLeft,
    Repair,
    Role,
    StepPlan,
    check_coverage,
    repair,
    steady_plan,
)


def _extras(plan: StepPlan) -> dict[int, tuple[int, ...]]:
    return {r: a.extra_ids for r, a in plan.assignments.items() if a.extra_ids}


# ---------------------------------------------------------------- unit


def test_killing_shadowed_major_promotes_spare_at_no_cost() -> None:
    plan = steady_plan(0, 9, range(4))  # G=3: Majors 0,1,2; Spare 3 shadows 0
    fixed = repair(plan, [0])
    assert fixed.action is Action.PROMOTE_SPARE
    assert fixed.promoted == {0: 3}
    assert fixed.extra == {} and fixed.g_ext == 0
    assert fixed.lost_ids == (0, 1, 2) and fixed.redistributed_ids == ()
    new = fixed.plan
    assert new.alive == (1, 2, 3)
    assert new.assignments[3].promoted and new.contributed_by(3) == (0, 1, 2)
    # Zero extra micro-batches for anyone.
    assert {r: new.microbatches_of(r) for r in new.alive} == {1: 3, 2: 3, 3: 3}
    assert new.contributed_ids() == tuple(range(9)) and new.divisor == 9
    check_coverage(new)


def test_killing_unshadowed_major_is_a_policy_boundary() -> None:
    plan = steady_plan(0, 8, range(3))  # Majors 0:(0,1,2) 1:(3,4,5), Minor 2:(6,7)
    fixed = repair(plan, [0])
    assert fixed.action is Action.POLICY_BOUNDARY
    assert fixed.g_ext == 2  # ceil(3 / 2)
    assert fixed.extra == {1: (0, 1), 2: (2,)}
    assert fixed.plan.microbatches_of(1) == 5 == plan.g + fixed.g_ext
    assert fixed.plan.g_ext_total == 2
    check_coverage(fixed.plan)


def test_killing_the_minor() -> None:
    plan = steady_plan(1, 8, range(3))  # Minor 2 has ids 14, 15
    fixed = repair(plan, [2])
    assert fixed.action is Action.POLICY_BOUNDARY
    assert fixed.lost_ids == (14, 15) and fixed.g_ext == 1
    assert fixed.extra == {0: (14,), 1: (15,)}
    check_coverage(fixed.plan)


def test_killing_two_in_one_step() -> None:
    plan = steady_plan(0, 8, range(4))
    fixed = repair(plan, {3, 1})
    assert fixed.failed == (1, 3)
    assert fixed.lost_ids == (2, 3, 6, 7) and fixed.g_ext == 2
    assert fixed.extra == {0: (2, 3), 2: (6, 7)}
    assert fixed.plan.alive == (0, 2)
    check_coverage(fixed.plan)


def test_mixed_promotion_and_redistribution() -> None:
    plan = steady_plan(0, 9, range(4))
    fixed = repair(plan, [0, 1])
    assert fixed.action is Action.MIXED
    assert fixed.promoted == {0: 3}
    assert fixed.redistributed_ids == (3, 4, 5) and fixed.g_ext == 2
    assert fixed.extra == {2: (3, 4), 3: (5,)}
    assert fixed.plan.contributed_by(3) == (0, 1, 2, 5)
    check_coverage(fixed.plan)


def test_major_and_its_spare_dying_together_is_a_boundary() -> None:
    fixed = repair(steady_plan(0, 9, range(4)), [0, 3])
    assert fixed.action is Action.POLICY_BOUNDARY and fixed.promoted == {}
    assert fixed.g_ext == 2 and fixed.extra == {1: (0, 1), 2: (2,)}
    check_coverage(fixed.plan)


def test_spare_death_loses_nothing() -> None:
    plan = steady_plan(0, 9, range(4))
    fixed = repair(plan, [3])
    assert fixed.action is Action.NONE and fixed.lost_ids == () and fixed.g_ext == 0
    assert fixed.plan.alive == (0, 1, 2)
    check_coverage(fixed.plan)


def test_no_failure_is_a_no_op() -> None:
    plan = steady_plan(0, 9, range(4))
    fixed = repair(plan, [])
    assert fixed.action is Action.NONE and fixed.plan == plan


def test_promoted_spare_dies_then_the_next_spare_is_promoted() -> None:
    plan = steady_plan(0, 2, range(5))  # Majors 0:(0,) 1:(1,); Spares 2->0, 3->1, 4->0
    first = repair(plan, [0])
    assert first.promoted == {0: 2}
    second = repair(first.plan, [2])
    assert second.action is Action.PROMOTE_SPARE and second.promoted == {2: 4}
    third = repair(second.plan, [4])
    assert third.action is Action.POLICY_BOUNDARY and third.extra == {1: (0,)}
    for step in (first, second, third):
        check_coverage(step.plan)


def test_failure_during_recovery_loses_original_and_extra_ids() -> None:
    plan = steady_plan(0, 8, range(4))
    first = repair(plan, [3])  # ids 6, 7 -> replicas 0 and 1
    assert first.extra == {0: (6,), 1: (7,)}
    second = repair(first.plan, [0])  # replica 0 dies while doing id 6
    assert second.lost_ids == (0, 1, 6)
    assert second.g_ext == 2 and second.extra == {1: (0, 1), 2: (6,)}
    # Replica 1: base 2 + first repair 1 + second repair 2 = G + G_ext_1 + G_ext_2, the cascade bound.
    assert second.plan.ids_of(1) == (2, 3, 7, 0, 1)
    assert second.plan.microbatches_of(1) == 5 == second.plan.max_microbatches
    check_coverage(second.plan)


def test_cascade_bound_is_additive() -> None:
    plan = steady_plan(0, 8, range(3))  # G=3
    first = repair(plan, [0])  # L = 0,1,2 over 2 survivors: G_ext 2 -> 1:(0,1) 2:(2,)
    second = repair(first.plan, [2])  # L = 6,7,2 over 1 survivor: G_ext 3
    assert (first.g_ext, second.g_ext) == (2, 3)
    assert second.plan.g_ext_total == 5 and second.plan.max_microbatches == 8
    assert second.plan.microbatches_of(1) == 8  # replica 1 now does the whole step alone
    check_coverage(second.plan)


def test_spares_off_boundary_uses_idle_spare_for_extras_only() -> None:
    plan = steady_plan(0, 9, range(4), spares="off")
    fixed = repair(plan, [0])
    assert fixed.action is Action.POLICY_BOUNDARY and fixed.g_ext == 1
    assert fixed.extra == {1: (0,), 2: (1,), 3: (2,)}
    spare = fixed.plan.assignments[3]
    assert spare.role is Role.SPARE and not spare.contributes and spare.contributed_ids == (2,)
    check_coverage(fixed.plan)


def test_shadowing_spare_with_extras_contributes_extras_only() -> None:
    plan = steady_plan(0, 9, range(4))
    fixed = repair(plan, [1])  # ids 3,4,5 over 3 survivors, Spare 3 still shadows Major 0
    assert fixed.extra == {0: (3,), 2: (4,), 3: (5,)}
    assert fixed.plan.contributed_by(3) == (5,) and fixed.plan.microbatches_of(3) == 4
    check_coverage(fixed.plan)


def test_killing_everyone_raises() -> None:
    plan = steady_plan(0, 8, range(4))
    with pytest.raises(NoReplicasLeft, match="every replica failed"):
        repair(plan, range(4))
    last = repair(repair(plan, [0, 1]).plan, [2]).plan
    with pytest.raises(NoReplicasLeft):
        repair(last, [3])


def test_unknown_or_already_dead_replica_is_rejected() -> None:
    plan = repair(steady_plan(0, 8, range(4)), [1]).plan
    with pytest.raises(ValueError, match=r"\[1\] are not alive"):
        repair(plan, [1])
    with pytest.raises(ValueError, match="not alive"):
        repair(plan, [9])


def test_action_and_repair_are_loggable_and_hashable() -> None:
    fixed = repair(steady_plan(0, 9, range(4)), [0, 1])
    assert fixed.action == "mixed" and fixed.action.value == "mixed"
    assert hash(fixed) == hash(repair(steady_plan(0, 9, range(4)), (1, 0)))


# ---------------------------------------------------------------- properties


def _assert_exact_coverage(plan: StepPlan) -> None:
    # Independent of check_coverage: count the contributions directly.
    summed = Counter(i for a in plan.assignments.values() for i in a.contributed_ids)
    assert summed == Counter(plan.id_range)
    assert plan.contributed_ids() == tuple(plan.id_range)
    check_coverage(plan)
    assert plan.divisor == plan.B


def _assert_repair_rules(before: StepPlan, failed: set[int], fixed: Repair) -> None:
    after = fixed.plan
    survivors = tuple(r for r in before.alive if r not in failed)
    assert after.alive == survivors and after.step == before.step and after.g == before.g
    # Lost = everything the failed replicas contributed, base and extra.
    lost = sorted(i for r in failed for i in before.contributed_by(r))
    assert list(fixed.lost_ids) == lost
    # Promotions: a failed contributor's base ids go to an alive, previously unpromoted Spare computing them.
    promoted_ids: list[int] = []
    for dead, spare in fixed.promoted.items():
        old = before.assignments[spare]
        assert dead in failed and spare in survivors
        assert old.role is Role.SPARE and not old.contributes
        assert old.ids == before.assignments[dead].ids and before.assignments[dead].contributes
        assert after.assignments[spare].promoted
        promoted_ids.extend(old.ids)
    # The rest is redistributed: G_ext = ceil(|L| / W_cur), consecutive chunks, ascending replicas.
    L = fixed.redistributed_ids
    assert sorted(promoted_ids + list(L)) == lost
    assert fixed.g_ext == -(-len(L) // len(survivors))
    chunks = [fixed.extra[r] for r in survivors if r in fixed.extra]
    assert [r for r in survivors if r in fixed.extra] == list(survivors[: len(chunks)])
    assert tuple(i for c in chunks for i in c) == L
    assert all(len(c) == fixed.g_ext for c in chunks[:-1]) and all(0 < len(c) <= fixed.g_ext for c in chunks)
    # Nothing else changed for survivors but promotion and appended extras.
    for r in survivors:
        old, new = before.assignments[r], after.assignments[r]
        assert new.ids == old.ids and new.role is old.role and new.shadow_of == old.shadow_of
        assert new.extra_ids == old.extra_ids + fixed.extra.get(r, ())
        assert new.contributes == (old.contributes or r in fixed.promoted.values())
    # Action names what happened.
    expected = {
        (False, False): Action.NONE,
        (True, False): Action.PROMOTE_SPARE,
        (False, True): Action.POLICY_BOUNDARY,
        (True, True): Action.MIXED,
    }[(bool(fixed.promoted), bool(L))]
    assert fixed.action is expected
    # Bounds: additive over the step's repairs, and G + G_ext for a single repair of a steady plan.
    assert after.g_ext_total == before.g_ext_total + fixed.g_ext
    for r in survivors:
        assert after.microbatches_of(r) <= after.max_microbatches == after.g + after.g_ext_total
        if before.g_ext_total == 0:
            assert after.microbatches_of(r) <= before.g + fixed.g_ext
    # Deterministic: the same inputs in any order give an equal repair.
    assert repair(before, sorted(failed, reverse=True)) == fixed


@st.composite
def _run(draw: st.DrawFn) -> tuple[int, int, int, str]:
    return (
        draw(st.integers(0, 1000)),  # first step
        draw(st.integers(1, 200) | st.integers(1, 40)),  # B; small B relative to W_init gives more Spares
        draw(st.integers(1, 32)),  # W_init
        draw(st.sampled_from(["shadow", "off"])),
    )


def _draw_failures(data: st.DataObject, alive: tuple[int, ...], label: str) -> set[int]:
    # Bias toward small sets: single failures and small bursts are the common case, all-die is still drawn.
    size = data.draw(st.integers(0, len(alive)) | st.integers(0, min(2, len(alive))), label=f"{label} size")
    return set(data.draw(st.permutations(alive), label=label)[:size])


@settings(max_examples=500, deadline=None)
@given(run=_run(), data=st.data())
def test_repairs_within_a_step_keep_exact_coverage(
    run: tuple[int, int, int, str], data: st.DataObject
) -> None:
    step, B, w_init, spares = run
    plan = steady_plan(step, B, range(w_init), spares)  # type: ignore[arg-type]
    _assert_exact_coverage(plan)
    for round_ in range(data.draw(st.integers(1, 6), label="rounds")):
        failed = _draw_failures(data, plan.alive, f"round {round_}")
        if len(failed) == len(plan.alive):
            with pytest.raises(NoReplicasLeft):
                repair(plan, failed)
            return
        fixed = repair(plan, failed)
        _assert_repair_rules(plan, failed, fixed)
        _assert_exact_coverage(fixed.plan)
        event(f"{fixed.action.value}{' (cascade)' if plan.g_ext_total else ''}")
        plan = fixed.plan


@settings(max_examples=300, deadline=None)
@given(run=_run(), data=st.data())
def test_sequences_of_steps(run: tuple[int, int, int, str], data: st.DataObject) -> None:
    step, B, w_init, spares = run
    plan = steady_plan(step, B, range(w_init), spares)  # type: ignore[arg-type]
    dead: set[int] = set()
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        assert plan.g == -(-B // len(plan.alive)) and plan.g_ext_total == 0
        assert set(plan.alive) == set(range(w_init)) - dead
        for round_ in range(data.draw(st.integers(0, 3), label="rounds")):
            failed = _draw_failures(data, plan.alive, f"step {plan.step} round {round_}")
            if len(failed) == len(plan.alive):
                with pytest.raises(NoReplicasLeft):
                    repair(plan, failed)
                return
            fixed = repair(plan, failed)
            _assert_repair_rules(plan, failed, fixed)
            dead |= failed
            plan = fixed.plan
        _assert_exact_coverage(plan)
        # Replicas lost after the commit (during the optimizer step) cost this step nothing.
        after_commit = _draw_failures(data, plan.alive, "after commit")
        left = [r for r in plan.alive if r not in after_commit]
        if not left:
            with pytest.raises(NoReplicasLeft):
                steady_plan(plan.step + 1, B, left, spares)  # type: ignore[arg-type]
            return
        dead |= after_commit
        following = steady_plan(plan.step + 1, B, left, spares)  # type: ignore[arg-type]
        assert following.step == plan.step + 1 and following.id_range.start == plan.id_range.stop
        assert set(following.alive) == set(range(w_init)) - dead
        _assert_exact_coverage(following)
        plan = following


def test_zero_spare_is_not_promoted_the_lost_ids_are_recomputed() -> None:
    plan = steady_plan(0, 9, range(4), spares="zero")  # spare 3 computes Major 0's ids, as zeros
    rep = repair(plan, [0])
    assert rep.action is Action.POLICY_BOUNDARY and rep.promoted == {}
    assert rep.redistributed_ids == plan.ids_of(0)
    assert not rep.plan.assignments[3].contributes
    check_coverage(rep.plan)


def test_adaptive_world_drops_the_lost_ids() -> None:
    from nanotron_recover.policy import adaptive_plan

    plan = adaptive_plan(0, 8, 4, range(4))
    rep = repair(plan, [1, 3])
    assert rep.action is Action.DROP and rep.lost_ids == (2, 3, 6, 7)
    assert rep.extra == {} and rep.g_ext == 0
    assert rep.plan.contributed_ids() == (0, 1, 4, 5) and rep.plan.divisor == 4
    check_coverage(rep.plan)
