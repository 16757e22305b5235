"""A chaos campaign's schedule: which fault, at which step, with which sub-step delay, on whom.

:func:`draw_schedule` is pure: the same seed and arguments give the same schedule, on any machine,
so a campaign that found a defect can be run again with ``--seed`` or, exactly as it was sent, with
``--replay chaos_schedule.json`` (:meth:`Schedule.to_json` / :func:`load_schedule`).

How it draws, from one ``random.Random(seed)``:

- kinds: every requested kind once, in a shuffled order, while faults remain (so a campaign of at
  least as many faults as kinds sends each kind), then uniformly;
- steps: ``n`` steps in ``[first_step, last_step]``, at least ``min_gap`` apart, so each fault's
  repair (and a re-join) has room before the next one. A step is the *earliest* step the fault is
  sent in: the runner waits until step ``step - 1`` has committed, then ``delay`` x the step time
  (``delay`` in [0, 1)), and it may send later (the job is not back at full width yet);
- targets: distinct replicas (as many as the kind strikes) and a local rank inside each replica.
  They name a place in the job's grid, not a process: the runner looks up the process at that place
  when it sends the fault, taking the next alive replica when the drawn one is down.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from .kinds import KINDS, kind_info

FORMAT = "nanotron-recover chaos schedule 1"


class ScheduleError(InputError):
    """Arguments no schedule can be drawn from, or a schedule file that cannot be replayed."""


@dataclass(frozen=True)
class Victim:
    """A place in the grid: replica ``replica``, rank ``local_rank`` inside it."""

    replica: int
    local_rank: int = 0

    def rank(self, replica_size: int) -> int:
        """The logical (MPI) rank of this place: ``replica * replica_size + local_rank``."""
        return self.replica * replica_size + self.local_rank


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    step: int  # the earliest step during which it is sent
    delay: float  # fraction of a step after step - 1 committed, in [0, 1)
    victims: tuple[Victim, ...]  # empty for kill_all
    role: str | None = None  # kill_during_rejoin: "spawned" or "member"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["victims"] = [asdict(v) for v in self.victims]
        return d


@dataclass(frozen=True)
class Schedule:
    seed: int
    kinds: tuple[str, ...]
    dp: int
    replica_size: int
    first_step: int
    last_step: int
    min_gap: int
    faults: tuple[PlannedFault, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "seed": self.seed,
            "kinds": list(self.kinds),
            "dp": self.dp,
            "replica_size": self.replica_size,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "min_gap": self.min_gap,
            "faults": [f.as_dict() for f in self.faults],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ScheduleError(f"{name} must be >= {low}, got {value}")
    return value


def check_kinds(kinds: list[str] | tuple[str, ...], dp: int) -> tuple[str, ...]:
    """The kinds, each known and possible with ``dp`` replicas (a kind that strikes two replicas
    needs a third to go on); a :class:`ScheduleError` naming the first that is not."""
    if not kinds:
        raise ScheduleError(f"no fault kind given: choose from {', '.join(KINDS)}")
    for name in kinds:
        try:
            info = kind_info(name)
        except ValueError as e:
            raise ScheduleError(str(e)) from None
        if info.victims >= dp:
            raise ScheduleError(
                f"fault kind {name} strikes {info.victims} replica(s) and needs one more to go on: "
                f"parallelism.dp={dp} is too small (use dp >= {info.victims + 1} or drop {name})"
            )
    return tuple(dict.fromkeys(kinds))


def draw_schedule(
    seed: int,
    n_faults: int,
    kinds: list[str] | tuple[str, ...],
    *,
    dp: int,
    replica_size: int = 1,
    first_step: int,
    last_step: int,
    min_gap: int = 1,
) -> Schedule:
    """Draw ``n_faults`` faults of ``kinds`` in steps ``first_step..last_step``, at least ``min_gap``
    steps apart, on a job of ``dp`` replicas of ``replica_size`` ranks (pure; see the module)."""
    _check_int("seed", seed, -(2**63))
    _check_int("the number of faults", n_faults, 0)
    _check_int("dp", dp, 1)
    _check_int("replica_size", replica_size, 1)
    _check_int("first_step", first_step, 1)
    _check_int("min_gap", min_gap, 1)
    _check_int("last_step", last_step, first_step)
    kinds = check_kinds(list(kinds), dp)
    room = last_step - first_step - (n_faults - 1) * min_gap if n_faults else 0
    if room < 0:
        raise ScheduleError(
            f"{n_faults} faults at least {min_gap} steps apart do not fit in steps {first_step}..{last_step}: "
            "raise tokens.train_steps, or lower --faults or --min-gap"
        )
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    drawn = [order[i] if i < len(order) else rng.choice(kinds) for i in range(n_faults)]
    offsets = sorted(rng.randint(0, room) for _ in range(n_faults))
    faults = []
    for i, kind in enumerate(drawn):
        info = KINDS[kind]
        replicas = rng.sample(range(dp), info.victims) if info.victims else []
        victims = tuple(Victim(r, rng.randrange(replica_size)) for r in replicas)
        role = rng.choice(info.roles) if info.roles else None
        step = first_step + offsets[i] + i * min_gap
        delay = round(rng.random() * 0.9, 3)
        faults.append(PlannedFault(i, kind, step, delay, victims, role))
    return Schedule(seed, kinds, dp, replica_size, first_step, last_step, min_gap, tuple(faults))


def schedule_from_dict(data: dict[str, Any]) -> Schedule:
    """The schedule a :meth:`Schedule.to_dict` wrote, checked as a drawn one is."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ScheduleError(f'not a chaos schedule (expected "format": "{FORMAT}")')
    try:
        dp, size = _check_int("dp", data["dp"], 1), _check_int("replica_size", data["replica_size"], 1)
        kinds = check_kinds(list(data["kinds"]), dp)
        faults = []
        previous = 0
        for i, f in enumerate(data["faults"]):
            kind = f["kind"]
            if kind not in kinds:
                raise ScheduleError(
                    f"faults[{i}]: kind {kind!r} is not among the schedule's kinds {list(kinds)}"
                )
            step = _check_int(f"faults[{i}].step", f["step"], max(1, previous))
            previous = step
            delay = float(f["delay"])
            if not 0 <= delay < 1:
                raise ScheduleError(f"faults[{i}].delay must be in [0, 1), got {delay}")
            victims = tuple(Victim(int(v["replica"]), int(v.get("local_rank", 0))) for v in f["victims"])
            for v in victims:
                if not (0 <= v.replica < dp and 0 <= v.local_rank < size):
                    raise ScheduleError(f"faults[{i}]: victim {v} outside {dp} replicas of {size} ranks")
            if len(victims) != KINDS[kind].victims:
                raise ScheduleError(f"faults[{i}]: kind {kind} needs {KINDS[kind].victims} victim(s)")
            role = f.get("role")
            if KINDS[kind].roles and role not in KINDS[kind].roles:
                raise ScheduleError(f"faults[{i}]: role must be one of {KINDS[kind].roles}, got {role!r}")
            faults.append(PlannedFault(i, kind, step, delay, victims, role))
        return Schedule(
            int(data["seed"]),
            kinds,
            dp,
            size,
            int(data["first_step"]),
            int(data["last_step"]),
            int(data["min_gap"]),
            tuple(faults),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ScheduleError):
            raise
        raise ScheduleError(f"malformed chaos schedule: {type(e).__name__}: {e}") from None


def load_schedule(path: str | Path) -> Schedule:
    """Read ``chaos_schedule.json`` (or a campaign's ``chaos.json``, which holds it) for ``--replay``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ScheduleError(f"cannot read schedule {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ScheduleError(f"schedule {path} is not JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("schedule"), dict):
        data = data["schedule"]  # a chaos.json
    return schedule_from_dict(data)
