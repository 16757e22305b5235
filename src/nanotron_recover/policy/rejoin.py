"""When a lost replica comes back: the re-join policy, a pure function of state every member holds.

A replica lost in step ``s`` is brought back at the first step boundary ``t`` (after step ``t``
committed) with ``t - s >= after_steps``, while the run has steps left (``t < last_step``), the run
has spawn attempts left (``max_spawns``) and the replica has not been lost
``max_failures_per_replica`` times (then it is given up, once, with an incident). Every due replica
comes back in the same join. A join that failed because a member died is retried after
``after_steps`` again (a fault is transient); one whose spawn could not start (no free slot, no such
host) waits twice as long after each such failure, since what it lacks rarely comes back soon.

The book is updated alike on every member of the job -- survivors and parked ranks take part in
the same recoveries and joins, and a spawned process receives the book in the join's header -- so
every member computes the same decision with no message. The step contract does not change: the
next step plans its ``B`` ids over the replicas alive then (``policy.plan``), so a re-join changes
who computes which ids, never which ids a step sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RejoinBook:
    """What the re-join policy remembers: when and how often each replica was lost, spawns used."""

    lost_at: dict[int, int] = field(default_factory=dict)  # replica -> step it was lost (or a join failed)
    losses: dict[int, int] = field(default_factory=dict)  # replica -> times lost
    spawns: int = 0  # spawn attempts so far, failed ones included
    given_up: list[int] = field(default_factory=list)  # replicas that will not be re-spawned
    spawn_failures: dict[int, int] = field(default_factory=dict)  # replica -> spawns that could not start

    def lost(self, replicas: tuple[int, ...] | list[int], step: int) -> None:
        for r in replicas:
            self.lost_at[r] = step
            self.losses[r] = self.losses.get(r, 0) + 1

    def attempted(self, replicas: list[int], step: int, joined: bool, spawn_failed: bool = False) -> None:
        """A join of ``replicas`` was tried after ``step``; a failed one waits again (see module)."""
        self.spawns += 1
        for r in replicas:
            if joined:
                self.lost_at.pop(r, None)
                self.spawn_failures.pop(r, None)
            else:
                self.lost_at[r] = step
                if spawn_failed:
                    self.spawn_failures[r] = self.spawn_failures.get(r, 0) + 1

    def wait_steps(self, replica: int, after_steps: int) -> int:
        failures = self.spawn_failures.get(replica, 0)
        return after_steps if not failures else max(after_steps, 1) * 2 ** min(failures, 8)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lost_at": dict(self.lost_at),
            "losses": dict(self.losses),
            "spawns": self.spawns,
            "given_up": list(self.given_up),
            "spawn_failures": dict(self.spawn_failures),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RejoinBook:
        return cls(
            lost_at={int(k): int(v) for k, v in d["lost_at"].items()},
            losses={int(k): int(v) for k, v in d["losses"].items()},
            spawns=int(d["spawns"]),
            given_up=[int(r) for r in d["given_up"]],
            spawn_failures={int(k): int(v) for k, v in d["spawn_failures"].items()},
        )


@dataclass(frozen=True)
class RejoinDecision:
    replicas: tuple[int, ...]  # to bring back now
    give_up: tuple[int, ...]  # newly past max_failures_per_replica (say so once)
    out_of_spawns: bool = False  # replicas are waiting, but max_spawns is used up


def due_replicas(
    book: RejoinBook,
    step: int,
    last_step: int,
    alive: list[int],
    *,
    after_steps: int,
    max_spawns: int,
    max_failures_per_replica: int,
) -> RejoinDecision:
    """The replicas to re-join at the boundary after ``step`` (see module docstring)."""
    waiting = sorted(r for r in book.lost_at if r not in alive and r not in book.given_up)
    give_up = tuple(r for r in waiting if book.losses.get(r, 0) >= max_failures_per_replica)
    candidates = [r for r in waiting if r not in give_up]
    if step >= last_step or not candidates:
        return RejoinDecision((), give_up)
    if book.spawns >= max_spawns:
        return RejoinDecision((), give_up, out_of_spawns=True)
    due = tuple(r for r in candidates if step - book.lost_at[r] >= book.wait_steps(r, after_steps))
    return RejoinDecision(due, give_up)
