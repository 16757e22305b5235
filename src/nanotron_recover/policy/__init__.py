"""Workload policy: which replica computes and contributes which micro-batch ids, pure functions only.

``steady_plan`` gives the start-of-step plan (``adaptive_plan`` the ablation's adaptive world), ``repair`` the plan after replicas
fail mid-step (the next step is again a ``steady_plan`` of the survivors) and ``check_coverage``
verifies that a plan sums the step's ids exactly once. See ``plan`` and
``repair`` for the protocol.
"""

from .errors import CoverageError, NoReplicasLeft, PolicyError
from .plan import (
    SPARES_MODES,
    WORLD_POLICIES,
    Assignment,
    Role,
    SparesMode,
    StepPlan,
    WorldPolicy,
    adaptive_plan,
    check_coverage,
    steady_plan,
)
from .repair import Action, Repair, repair

__all__ = [
    "SPARES_MODES",
    "WORLD_POLICIES",
    "Action",
    "Assignment",
    "CoverageError",
    "NoReplicasLeft",
    "PolicyError",
    "Repair",
    "Role",
    "SparesMode",
    "StepPlan",
    "WorldPolicy",
    "adaptive_plan",
    "check_coverage",
    "repair",
    "steady_plan",
]
