"""Steady-state workload plan of one optimizer step across data-parallel replicas.

Protocol
--------
Step ``t`` consumes the global micro-batch ids ``t*B .. t*B+B-1``, each exactly
once, whatever fails. ``B = W_init * G_init`` is fixed for the whole run.
Replicas keep the index they had at launch (``0..W_init-1``); a dead replica
never comes back, so the alive set only shrinks.

At the start of a step, for the ``W`` alive replicas in ascending order:

* ``G = ceil(B / W)`` micro-batches per replica (gradient accumulation steps);
* the first ``floor(B / G)`` replicas are **Majors**, each computing ``G``
  consecutive ids;
* if ``R = B - floor(B / G) * G > 0`` the next replica is the **Minor**, computing
  the last ``R`` ids;
* every other alive replica is a **Spare**. With ``spares="shadow"`` spare ``k``
  (counting spares from 0) shadows Major ``k mod n_majors``: it computes the same
  ids but its buffer is summed as zeros, so that if the Major dies before the
  commit the spare can be promoted and nothing is recomputed. With
  ``spares="zero"`` (the paper's spares) a spare computes the same work and
  contributes zeros too, but is not a shadow: a dead Major's ids are recomputed
  by the survivors, and the spare only takes a role at the next step's plan.
  With ``spares="off"`` spares compute nothing (they save energy but cannot cover).

That is the **static world** policy (``policy="static_world"``, the default): every
step sums the same ``B`` ids, whatever fails. The **adaptive world** policy
(``policy="adaptive_world"``, what elastic trainers such as torchft do, kept for the
ablation) instead gives replica ``r`` of the ``W0`` launched ones the fixed ids
``t*B + r*G0 .. t*B + (r+1)*G0 - 1`` (``G0 = B / W0``): the ids of dead replicas are
dropped, a replica that dies mid-step loses its ids for that step, and the sum is
divided by the number of ids actually summed (:attr:`StepPlan.divisor`), so the
batch shrinks with the world and the loss curve departs from the fault-free one.

Gradients are accumulated locally and reduced only at the end of the step (a
torn reduction is redone from snapshots), so a replica that fails at any time
before the commit loses *all* of its contribution for the step, and one that
fails after the commit (during the optimizer step) loses nothing: the next
step's plan (:func:`steady_plan` for the replicas still alive) simply leaves it out.

What each replica computes and whether it is summed is part of the plan, so
coverage is checkable: at commit the ids summed by the alive replicas must be
exactly ``range(t*B, t*B+B)``, once each (:func:`check_coverage`), and the sum is
always divided by ``B`` (:attr:`StepPlan.divisor`), never by the survivors.
Mid-step repairs (``policy.repair``) return a new ``StepPlan`` of the same step.

Everything here is a pure function of its arguments: the same (step, B, alive,
spares mode) gives an equal plan on every rank, with no communication.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Literal

from .errors import CoverageError, NoReplicasLeft

SparesMode = Literal["shadow", "zero", "off"]
SPARES_MODES: tuple[str, ...] = ("shadow", "zero", "off")
WorldPolicy = Literal["static_world", "adaptive_world"]
WORLD_POLICIES: tuple[str, ...] = ("static_world", "adaptive_world")


class Role(Enum):
    """What a replica was planned to do at the start of the step."""

    MAJOR = "major"
    MINOR = "minor"
    SPARE = "spare"


@dataclass(frozen=True)
class Assignment:
    """One replica's work in a step.

    ``ids`` is the base work (a Major's or Minor's own ids, a shadowing Spare's
    copy of its Major's ids); ``extra_ids`` are ids handed over by repairs and are
    always summed. ``contributes`` says whether the base ``ids`` are summed: true
    for Majors and Minors, false for Spares until they are promoted.
    """

    replica: int
    role: Role
    ids: tuple[int, ...]
    shadow_of: int | None = None  # the Major whose ids a Spare mirrors (kept after that Major dies)
    contributes: bool = True
    extra_ids: tuple[int, ...] = ()
    # A Spare that can replace a dead Major's contribution (spares="shadow"); "zero" spares cannot.
    promotable: bool = True

    @property
    def promoted(self) -> bool:
        """A Spare whose shadow buffer now replaces a dead replica's contribution."""
        return self.role is Role.SPARE and self.contributes

    @property
    def computed_ids(self) -> tuple[int, ...]:
        """Every id this replica runs forward/backward on this step, base work first."""
        return self.ids + self.extra_ids

    @property
    def contributed_ids(self) -> tuple[int, ...]:
        """The ids whose gradients this replica's buffer adds to the reduction."""
        return (self.ids if self.contributes else ()) + self.extra_ids

    @property
    def microbatches(self) -> int:
        """Micro-batches this replica computes this step (its compute cost)."""
        return len(self.ids) + len(self.extra_ids)


@dataclass(frozen=True)
class StepPlan:
    """Who computes and who contributes which micro-batch ids in one step.

    ``assignments`` holds exactly the alive replicas. ``g`` is the steady-state
    ``G`` the step started with; ``g_ext_total`` is the sum of the ``G_ext`` of the
    repairs applied so far in this step, so ``max_microbatches = g + g_ext_total``
    bounds every replica's micro-batch count (see ``policy.repair``).
    """

    step: int
    B: int
    alive: tuple[int, ...]
    g: int
    spares: SparesMode
    assignments: Mapping[int, Assignment]
    g_ext_total: int = 0
    policy: WorldPolicy = "static_world"

    def __post_init__(self) -> None:
        # Normalise so that equal plans compare (and hash) equal however they were built,
        # and freeze the mapping so a plan shared between components cannot be mutated.
        alive = tuple(sorted(self.alive))
        if set(self.assignments) != set(alive) or len(set(alive)) != len(alive):
            raise ValueError(
                f"assignments {sorted(self.assignments)} must be exactly the alive replicas {list(alive)}"
            )
        object.__setattr__(self, "alive", alive)
        object.__setattr__(self, "assignments", MappingProxyType({r: self.assignments[r] for r in alive}))

    def __hash__(self) -> int:
        return hash(
            (
                self.step,
                self.B,
                self.alive,
                self.g,
                self.spares,
                tuple(self.assignments.items()),
                self.g_ext_total,
                self.policy,
            )
        )

    @property
    def divisor(self) -> int:
        """What the summed gradient is divided by: always ``B`` in the static world, never the
        survivor count; in the adaptive world the number of ids summed."""
        if self.policy == "adaptive_world":
            return len(self.contributed_ids())
        return self.B

    @property
    def max_microbatches(self) -> int:
        """Bound on any replica's micro-batches this step: ``g + g_ext_total``."""
        return self.g + self.g_ext_total

    @property
    def id_range(self) -> range:
        """The micro-batch ids this step must consume: ``range(step*B, step*B+B)``."""
        return range(self.step * self.B, (self.step + 1) * self.B)

    def ids_of(self, replica: int) -> tuple[int, ...]:
        """Every id ``replica`` computes this step (base work, then extra work from repairs)."""
        return self._get(replica).computed_ids

    def contributed_by(self, replica: int) -> tuple[int, ...]:
        """The ids whose gradients ``replica`` adds to the reduction (empty for an unpromoted Spare)."""
        return self._get(replica).contributed_ids

    def microbatches_of(self, replica: int) -> int:
        """How many micro-batches ``replica`` computes this step."""
        return self._get(replica).microbatches

    def contributed_ids(self) -> tuple[int, ...]:
        """Sorted multiset of the ids summed at commit; duplicates are kept so errors stay visible."""
        return tuple(sorted(i for a in self.assignments.values() for i in a.contributed_ids))

    def replicas_with(self, role: Role) -> tuple[int, ...]:
        """The alive replicas planned with ``role``, ascending."""
        return tuple(r for r, a in self.assignments.items() if a.role is role)

    def _get(self, replica: int) -> Assignment:
        try:
            return self.assignments[replica]
        except KeyError:
            raise KeyError(f"replica {replica} is not alive in step {self.step}") from None


def steady_plan(step: int, B: int, alive: Iterable[int], spares: SparesMode = "shadow") -> StepPlan:
    """The start-of-step plan for ``alive`` replicas; raises ``NoReplicasLeft`` if none is alive."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if B < 1:
        raise ValueError(f"B (micro-batches per step) must be >= 1, got {B}")
    if spares not in SPARES_MODES:
        raise ValueError(f"spares must be one of {SPARES_MODES}, got {spares!r}")
    replicas = sorted(alive)
    if len(set(replicas)) != len(replicas):
        raise ValueError(f"alive replicas must be distinct, got {replicas}")
    if replicas and replicas[0] < 0:
        raise ValueError(f"replica ids must be >= 0, got {replicas}")
    if not replicas:
        raise NoReplicasLeft(f"step {step}: no replica is alive")

    W = len(replicas)
    G = -(-B // W)  # ceil(B / W)
    n_major = B // G  # >= 1 because G <= B
    R = B - n_major * G
    first = step * B
    assignments: dict[int, Assignment] = {}
    majors = replicas[:n_major]
    for k, r in enumerate(majors):
        assignments[r] = Assignment(r, Role.MAJOR, tuple(range(first + k * G, first + (k + 1) * G)))
    rest = replicas[n_major:]
    if R > 0:
        # G = ceil(B/W) guarantees ceil(B/G) <= W, so there is always a replica left for the Minor.
        r = rest[0]
        assignments[r] = Assignment(r, Role.MINOR, tuple(range(first + n_major * G, first + B)))
        rest = rest[1:]
    for k, r in enumerate(rest):
        if spares == "off":
            assignments[r] = Assignment(r, Role.SPARE, (), contributes=False)
            continue
        major = majors[k % n_major]  # round-robin so coverage is spread over as many Majors as possible
        assignments[r] = Assignment(
            r,
            Role.SPARE,
            assignments[major].ids,
            shadow_of=major if spares == "shadow" else None,
            contributes=False,
            promotable=spares == "shadow",
        )
    return StepPlan(step=step, B=B, alive=tuple(replicas), g=G, spares=spares, assignments=assignments)


def adaptive_plan(step: int, B: int, initial_replicas: int, alive: Iterable[int]) -> StepPlan:
    """The adaptive world's plan: each alive replica computes its own fixed ``G0`` ids, no spares."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if initial_replicas < 1 or B % initial_replicas:
        raise ValueError(f"B={B} must be a positive multiple of the {initial_replicas} initial replicas")
    replicas = sorted(alive)
    if len(set(replicas)) != len(replicas):
        raise ValueError(f"alive replicas must be distinct, got {replicas}")
    if not replicas:
        raise NoReplicasLeft(f"step {step}: no replica is alive")
    if replicas[0] < 0 or replicas[-1] >= initial_replicas:
        raise ValueError(f"replica ids must be in 0..{initial_replicas - 1}, got {replicas}")
    g0 = B // initial_replicas
    first = step * B
    assignments = {
        r: Assignment(r, Role.MAJOR, tuple(range(first + r * g0, first + (r + 1) * g0))) for r in replicas
    }
    return StepPlan(
        step=step,
        B=B,
        alive=tuple(replicas),
        g=g0,
        spares="off",
        assignments=assignments,
        policy="adaptive_world",
    )


def check_coverage(plan: StepPlan) -> None:
    """Raise ``CoverageError`` unless the ids summed at commit are exactly the step's range, once each
    (the adaptive world: ids of the step's range, once each, at least one)."""
    counts = Counter(plan.contributed_ids())
    expected = plan.id_range
    if plan.policy == "adaptive_world":
        missing = [] if counts else [expected.start]
    else:
        missing = [i for i in expected if i not in counts]
    duplicated = sorted(i for i, n in counts.items() if n > 1)
    stray = sorted(i for i in counts if i not in expected)
    if missing or duplicated or stray:
        problems = []
        if missing:
            problems.append(f"missing ids {_show(missing)}")
        if duplicated:
            problems.append(f"duplicated ids {_show(duplicated)}")
        if stray:
            problems.append(f"ids outside the step {_show(stray)}")
        raise CoverageError(
            f"step {plan.step} must sum ids {expected.start}..{expected.stop - 1} once each: "
            + "; ".join(problems)
        )


def _show(ids: Sequence[int], limit: int = 16) -> str:
    # Keep error messages readable when a whole range is wrong.
    if len(ids) <= limit:
        return str(list(ids))
    return f"{list(ids[:limit])} ... ({len(ids)} in all)"
