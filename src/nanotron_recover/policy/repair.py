"""In-step repair: who redoes the work of replicas that die before the step commits.

Protocol
--------
When the fault-tolerant layer reports that some replicas failed during step ``t``
(before the commit ``Agree``), every survivor calls :func:`repair` with the
current plan and the failed replicas and gets the same new plan of the same
step, with no communication. A failed replica loses its whole contribution,
base ids and extra ids alike, whenever it failed: gradients are accumulated
locally and only reduced at the end, and a torn reduction is redone from
snapshots without the dead replica's buffer.

For each failed replica that contributed, in ascending replica order:

1. **Promote a spare.** If an alive, unpromoted Spare computes the same ids as
   the lost base contribution (it shadows that Major, or the dead replica was
   itself a promoted Spare of the same Major), the lowest such Spare is promoted:
   its buffer is summed instead of zeros. No micro-batch is recomputed.
2. **Policy boundary.** Ids nobody covers (base ids without a shadow, a Minor's
   ids, and every extra id, since extra work is never shadowed) are pooled into
   ``L`` (sorted) and redistributed over the ``W_cur`` survivors:
   ``G_ext = ceil(|L| / W_cur)``, and survivors in ascending order take
   consecutive chunks of ``G_ext`` ids of ``L`` (the last chunk may be shorter,
   trailing survivors may get none). Extra ids are always summed, also by a Spare
   whose shadow work stays zeros.

A step can mix both (:attr:`Action.MIXED`). In the adaptive world (``plan.policy``) there
are no spares and nothing is redistributed: the lost ids are dropped for the step
(:attr:`Action.DROP`) and the divisor becomes the number of ids still summed. If a replica dies while doing
recovery work, call :func:`repair` again on the repaired plan: its base and extra
ids are lost and the same rules apply to the new state.

Bounds. After one repair of a steady plan, no replica computes more than
``G + G_ext`` micro-batches. Repairs cascade additively: each repair gives any
survivor at most its own ``G_ext`` extra ids, so after ``k`` repairs in a step no
replica computes more than ``G + G_ext_1 + ... + G_ext_k``, which the plan keeps
as ``max_microbatches = g + g_ext_total``.

Coverage. Each lost id goes either to exactly one promoted Spare or to exactly
one survivor's extra ids, so if the plan summed ``range(t*B, t*B+B)`` once each
before the repair, it still does after it; the divisor stays ``B``. If no replica
survives, :class:`NoReplicasLeft` is raised. The next step starts again from
``steady_plan`` (the steady state for the survivors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType

from .errors import NoReplicasLeft
from .plan import Assignment, Role, StepPlan


class Action(str, Enum):
    """What a repair did; a ``str`` so it logs and serialises as its value."""

    NONE = "none"  # only replicas that contributed nothing (unpromoted, idle Spares) failed
    PROMOTE_SPARE = "promote_spare"  # every lost id was covered by promoting Spares
    POLICY_BOUNDARY = "policy_boundary"  # every lost id was redistributed to survivors
    MIXED = "mixed"  # some ids covered by promotion, the rest redistributed
    DROP = "drop"  # adaptive world: the lost ids are not summed this step


@dataclass(frozen=True)
class Repair:
    """The outcome of one :func:`repair` call.

    ``lost_ids`` are every id whose contribution died with ``failed``;
    ``promoted`` maps a failed replica to the Spare now contributing its base ids;
    ``extra`` maps a survivor to the ids this repair added to its work (only
    survivors that got some); ``g_ext`` is ``ceil(|L| / W_cur)`` for the
    redistributed ids ``L`` (0 when nothing was redistributed).
    """

    plan: StepPlan
    failed: tuple[int, ...]
    action: Action
    lost_ids: tuple[int, ...]
    promoted: Mapping[int, int]
    extra: Mapping[int, tuple[int, ...]]
    g_ext: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "promoted", MappingProxyType(dict(sorted(self.promoted.items()))))
        object.__setattr__(self, "extra", MappingProxyType(dict(sorted(self.extra.items()))))

    def __hash__(self) -> int:
        return hash(
            (
                self.plan,
                self.failed,
                self.action,
                self.lost_ids,
                tuple(self.promoted.items()),
                tuple(self.extra.items()),
                self.g_ext,
            )
        )

    @property
    def redistributed_ids(self) -> tuple[int, ...]:
        """The lost ids no Spare covered (``L``), sorted."""
        return tuple(sorted(i for ids in self.extra.values() for i in ids))


def repair(plan: StepPlan, failed: Iterable[int]) -> Repair:
    """Repair ``plan`` after ``failed`` replicas died before the commit; same step, coverage kept."""
    gone = set(failed)
    unknown = sorted(gone - set(plan.alive))
    if unknown:
        raise ValueError(
            f"step {plan.step}: failed replicas {unknown} are not alive in the plan {list(plan.alive)}"
        )
    survivors = tuple(r for r in plan.alive if r not in gone)
    if not survivors:
        raise NoReplicasLeft(f"step {plan.step}: every replica failed (last ones: {sorted(gone)})")
    if plan.policy == "adaptive_world":
        return _drop(plan, gone, survivors)

    assignments: dict[int, Assignment] = {r: plan.assignments[r] for r in survivors}
    lost: list[int] = []
    uncovered: list[int] = []
    promoted: dict[int, int] = {}
    for r in sorted(gone):
        dead = plan.assignments[r]
        lost.extend(dead.contributed_ids)
        uncovered.extend(dead.extra_ids)  # extra work is assigned mid-step, nobody shadows it
        if not (dead.contributes and dead.ids):
            continue
        spare = _shadow_of_ids(assignments, dead.ids)
        if spare is None:
            uncovered.extend(dead.ids)
        else:
            assignments[spare] = replace(assignments[spare], contributes=True)
            promoted[r] = spare

    L = sorted(uncovered)
    g_ext = -(-len(L) // len(survivors)) if L else 0  # ceil(|L| / W_cur)
    extra: dict[int, tuple[int, ...]] = {}
    # g_ext >= |L| / W_cur, so there are at most W_cur chunks: one per survivor is enough.
    for n, start in enumerate(range(0, len(L), g_ext or 1)):
        r = survivors[n]
        chunk = tuple(L[start : start + g_ext])
        extra[r] = chunk
        # New extra work goes after what the replica already had, in the order it will run.
        assignments[r] = replace(assignments[r], extra_ids=assignments[r].extra_ids + chunk)

    new_plan = replace(plan, alive=survivors, assignments=assignments, g_ext_total=plan.g_ext_total + g_ext)
    return Repair(
        plan=new_plan,
        failed=tuple(sorted(gone)),
        action=_action(bool(promoted), bool(L)),
        lost_ids=tuple(sorted(lost)),
        promoted=promoted,
        extra=extra,
        g_ext=g_ext,
    )


def _shadow_of_ids(assignments: Mapping[int, Assignment], ids: tuple[int, ...]) -> int | None:
    # The lowest alive unpromoted Spare that computes exactly these ids, so every rank picks the same one.
    # An alive Spare "will finish" its shadow work by definition: if it dies too, that is another failure.
    for r in sorted(assignments):
        a = assignments[r]
        if a.role is Role.SPARE and a.promotable and not a.contributes and a.ids == ids:
            return r
    return None


def _drop(plan: StepPlan, gone: set[int], survivors: tuple[int, ...]) -> Repair:
    """The adaptive world's repair: the dead replicas' ids are not summed this step, nobody redoes them."""
    lost = sorted(i for r in gone for i in plan.assignments[r].contributed_ids)
    assignments = {r: plan.assignments[r] for r in survivors}
    return Repair(
        plan=replace(plan, alive=survivors, assignments=assignments),
        failed=tuple(sorted(gone)),
        action=Action.DROP if lost else Action.NONE,
        lost_ids=tuple(lost),
        promoted={},
        extra={},
        g_ext=0,
    )


def _action(promoted: bool, redistributed: bool) -> Action:
    if promoted and redistributed:
        return Action.MIXED
    if promoted:
        return Action.PROMOTE_SPARE
    if redistributed:
        return Action.POLICY_BOUNDARY
    return Action.NONE
