"""Errors raised by the workload policy.

The policy is pure, so it reports impossible situations by raising; the trainer
decides what to do (abort the job, log an incident). All of them derive from
:class:`PolicyError` so a caller can catch the family at once.
"""

from __future__ import annotations


class PolicyError(Exception):
    """Base class of every error the workload policy raises."""


class CoverageError(PolicyError):
    """The ids a plan would sum at commit are not exactly the step's id range, once each."""


class NoReplicasLeft(PolicyError):
    """No replica is alive: nobody is left to compute the step, so training cannot go on."""
