"""The discrete-event model of a run: forward recovery, forward recovery with re-join, and
checkpoint-restart every ``N`` steps, under one fault schedule.

Time advances from event to event (a step's compute ends, a fault strikes, the failure surfaces, a
repair commits, a checkpoint is saved or published, a job is relaunched); every event is kept in
:attr:`Run.events`. Step costs come from :class:`~.workload.Workload`, recovery costs from the
profile (:mod:`.constants`).

**Fault schedules.** By step (``every k steps until n replicas are lost``, like
``benchmarks/faults.py``): fault ``i`` strikes replica ``W0 - i`` in step ``i*k``, at fraction ``at``
of that step's compute (``phase="compute"``; 0: the forward pass of the first micro-batch) or of
its cross-replica reduction (``phase="reduce"``: ``at`` of the buckets are reduced), once; a relaunched job that
recomputes the step does not meet it again. By time (``MTBF`` per device, seeded): faults arrive as
a Poisson process at rate ``devices / MTBF`` over the whole allocation, each on a random device; a
fault on a device of a replica that forward recovery already dropped does not happen (thinning: the
live rate is ``alive devices / MTBF``). A timed fault can strike during a step, a repair, a re-join
or a restart.

**Forward recovery** (one step, ``W`` replicas alive). The policy's start-of-step plan gives the
longest replica ``ceil(B / W)`` micro-batches (:func:`~nanotron_recover.policy.steady_plan`). A fault
at ``t_f`` in the step loses the victim's whole contribution; the survivors keep computing and the
failure surfaces at ``max(t_f + detect, end of their compute)``, ``detect`` being
``detect_crash_s`` for a crash and the config's heartbeat timeout for a hang. Then

    repair   = repair_base_s + repair_per_log2_rank_s * log2(ranks)      (ULFM revoke/shrink/agree)
    redo     = compute_s(max extra micro-batches of a survivor)           (policy.repair's G_ext)
    restore  = the torn buckets' snapshots copied back (a fault inside the reduction: the buckets
               reduced or in flight when it struck; none for a fault in compute)
    reduce   = t_reduce(W - 1), redone whole: the buckets reduced before the failure are stale

and the step commits after them. The extra micro-batches are exactly what
:func:`~nanotron_recover.policy.repair` gives the survivors (a spare promoted costs none, a policy
boundary ``ceil(|L| / W_cur)``); a fault during the redo repairs the repaired plan again. Later steps
run with ``W - 1`` replicas: each takes ``compute_s(ceil(B / (W - 1)))``, so throughput falls by the
ratio ``ceil(B / W) / ceil(B / (W - 1))`` of the longest replica (plus the reduction's change): that
is the whole cost of a lost replica. Below ``min_replicas`` the job saves the last committed step,
stops and is relaunched at full width (like a restart, without recompute).

**Re-join** (``recover.rejoin.mode: spawn``): at the first step boundary ``after_steps`` steps after a
loss, the lost replicas come back together in one join that stalls the job for
``spawn_s + state_bytes_per_rank / state_transfer_bw + rebuild_s + repair``; up to ``max_spawns``
joins, ``max_failures_per_replica`` losses per replica.

**Checkpoint-restart every N** (always ``W0`` replicas: every relaunch gets replacement hardware).
After step ``k*N`` a save blocks ``save_fixed_s + state_bytes / stage_bw`` and is written in the
background in ``state_bytes / fs_write_bw``; the next save waits for it, and it can be resumed from
only once written. A fault at ``t_f`` costs

    detect + relaunch_s + start(ranks) + load + recompute,
    load = W0 * checkpoint_bytes / fs_read_bw_aggregate   (every replica reads the checkpoint),

where ``recompute`` re-runs every step since the last published checkpoint (``step - 1 - c``
whole steps plus the partial failed step). A timed fault during the relaunch starts it over.
The stall of a fault is the time from the fault to the failed step being committed again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ..failures import Kind, Phase
from ..policy import repair, steady_plan
from .constants import Profile
from .workload import Workload

FORWARD = "forward"
REJOIN = "forward+rejoin"
CKPT = "ckpt-restart"
MODES = (FORWARD, REJOIN, CKPT)
FAULT_PHASES = (Phase.COMPUTE, Phase.REDUCE)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: by step (``step``) or by wall time (``time_s``)."""

    step: int | None = None
    time_s: float | None = None
    at: float = 0.0  # by step: where in the phase it strikes (compute: 0 = first micro-batch)
    phase: str = Phase.COMPUTE  # by step: compute, or reduce (the cross-replica reduction)
    replica: int | None = None  # by step: the victim; None: the highest replica alive
    device: int | None = None  # by time: the device that fails (its replica is the victim)
    kind: str = Kind.CRASH  # crash (detected by the runtime) or hang (by the heartbeat timeout)


def every_k_steps(
    k: int,
    until: int,
    replicas: int,
    at: float = 0.0,
    kind: str = Kind.CRASH,
    phase: str = Phase.COMPUTE,
) -> list[Fault]:
    """Replica ``W0 - i`` fails in step ``i * k`` for ``i = 1..until`` (benchmarks/faults.py's rule)."""
    if k < 1 or until < 0 or until >= replicas:
        raise ValueError(f"every {k} steps until {until} of {replicas} replicas are lost: not possible")
    if phase not in FAULT_PHASES:
        raise ValueError(f"a fault's phase is one of {FAULT_PHASES}, got {phase!r}")
    return [
        Fault(step=i * k, at=at, replica=replicas - i, kind=kind, phase=phase) for i in range(1, until + 1)
    ]


def mtbf_faults(
    mtbf_hours: float,
    devices: int,
    horizon_s: float,
    seed: int,
    kind: str = Kind.CRASH,
    limit: int | None = None,
) -> list[Fault]:
    """Poisson faults at rate ``devices / MTBF`` until ``horizon_s``, each on a random device."""
    rng = random.Random(seed)
    rate = devices / (mtbf_hours * 3600.0)
    faults: list[Fault] = []
    t = 0.0
    while limit is None or len(faults) < limit:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        faults.append(Fault(time_s=t, device=rng.randrange(devices), kind=kind))
    return faults


@dataclass
class Event:
    time_s: float
    kind: str  # start, commit, fault, surfaced, repaired, save, published, restart, join, stop, end
    step: int
    detail: dict = field(default_factory=dict)


@dataclass
class FaultOutcome:
    """What one fault cost."""

    time_s: float
    step: int
    kind: str
    replica: int
    # Time lost: forward, the step's extra time over the same step without the fault; ckpt, the fault
    # to the failed step's re-commit minus what was left of that step (it had to run anyway).
    stall_s: float = 0.0
    stall_first_s: float = 0.0  # ckpt: the fault to the failed step's first re-commit
    stall_last_s: float = 0.0  # ckpt: ... to its *last* commit (restart.py's stall_s, faults.py reads it)
    recomputed_steps: int = 0
    extra_microbatches: int = 0  # forward: the most any survivor redid (G_ext)
    stale_buckets: int = 0  # forward: torn buckets restored from their snapshots
    action: str = ""
    recovered: bool = True  # false: the run ended (its wall-time budget) before the fault was repaired


@dataclass
class Run:
    """One simulated run: every event, commit and fault, and the replicas alive over time."""

    mode: str
    interval: int  # checkpoint interval in steps (0: none)
    tokens_per_step: int
    initial_ranks: int
    events: list[Event] = field(default_factory=list)
    faults: list[FaultOutcome] = field(default_factory=list)
    joins: list[tuple[float, float, int]] = field(default_factory=list)  # (time, stall, replicas back)
    step_s: dict[int, float] = field(default_factory=dict)  # duration of each step's last run
    replicas: list[tuple[float, int]] = field(default_factory=list)
    progress: list[tuple[float, int]] = field(default_factory=list)  # (time, committed step that stands)
    wall_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.interval}" if self.interval else self.mode

    def commits(self) -> list[tuple[float, int]]:
        return [(e.time_s, e.step) for e in self.events if e.kind == "commit"]

    def steps_at(self, t: float) -> int:
        """The committed step that stands at wall time ``t`` (a restart falls back to its checkpoint)."""
        standing = 0
        for time_s, step in self.progress:
            if time_s > t:
                break
            standing = step
        return standing

    def tokens_at(self, t: float) -> int:
        return self.steps_at(t) * self.tokens_per_step

    def device_s_at(self, t: float, width: int) -> float:
        """Device-seconds the job has held by wall time ``t`` (alive replicas x ``width``)."""
        used = 0.0
        points = self.replicas + [(math.inf, 0)]
        for (t0, w), (t1, _) in zip(points, points[1:], strict=False):
            if t0 >= t:
                break
            used += w * width * (min(t1, t) - t0)
        return used

    def time_at_device_s(self, device_s: float, width: int) -> float:
        """When the devices the job holds (alive replicas x ``width``) have used ``device_s`` device-
        seconds: forward recovery releases a lost replica's devices, checkpoint-restart holds all."""
        used = 0.0
        points = self.replicas + [(math.inf, self.replicas[-1][1])]
        for (t, w), (t_next, _) in zip(points, points[1:], strict=False):
            rate = w * width
            if rate > 0 and used + rate * (t_next - t) >= device_s:
                return t + (device_s - used) / rate
            used += rate * (t_next - t)
        return math.inf

    @property
    def total_stall_s(self) -> float:
        return sum(f.stall_s for f in self.faults) + sum(s for _, s, _ in self.joins)


class _Clock:
    """Shared helpers of the three modes."""

    def __init__(self, wl: Workload, prof: Profile, faults: list[Fault], run: Run):
        self.wl, self.prof, self.run = wl, prof, run
        self.by_step = {f.step: f for f in faults if f.step is not None}
        self.timed = sorted((f for f in faults if f.time_s is not None), key=lambda f: f.time_s or 0.0)
        self.fired_steps: set[int] = set()

    def event(self, t: float, kind: str, step: int, **detail: object) -> None:
        self.run.events.append(Event(t, kind, step, dict(detail)))

    def detect_s(self, fault: Fault) -> float:
        return self.wl.heartbeat_timeout_s if fault.kind == Kind.HANG else self.prof.v("detect_crash_s")

    def repair_s(self, ranks: int) -> float:
        v = self.prof.v
        return v("repair_base_s") + v("repair_per_log2_rank_s") * math.log2(max(ranks, 1))

    def start_s(self, ranks: int, forward: bool) -> float:
        v = self.prof.v
        base = v("start_base_s") + v("start_per_log2_rank_s") * math.log2(max(ranks, 1))
        extra = 0.0 if forward else v("start_plain_extra_s")
        return base * self.wl.contention(ranks // self.wl.width) + extra

    def save_block_s(self) -> float:
        return self.prof.v("save_fixed_s") + self.wl.state_bytes_per_rank / self.prof.v("stage_bw")

    def write_s(self) -> float:
        return self.wl.state_bytes_per_rank / self.prof.v("fs_write_bw")

    def load_s(self) -> float:
        total = self.wl.replicas * self.wl.width * self.wl.state_bytes_per_rank
        return total / self.prof.v("fs_read_bw_aggregate")

    def restart_s(self, forward: bool = False) -> float:
        """Relaunch, start-up and checkpoint load of a full-width job (detection not included)."""
        return self.prof.v("relaunch_s") + self.start_s(self.wl.ranks, forward=forward) + self.load_s()

    def next_timed(self, before: float) -> Fault | None:
        """Pop the next timed fault strictly before ``before`` (None if there is none)."""
        if self.timed and (self.timed[0].time_s or 0.0) < before:
            return self.timed.pop(0)
        return None

    def step_fault(self, step: int) -> Fault | None:
        f = self.by_step.get(step)
        if f is None or step in self.fired_steps:
            return None
        return f


def _victim(fault: Fault, wl: Workload, alive: list[int]) -> int:
    """The replica a fault strikes: its device's, the named one, or the highest alive."""
    if fault.device is not None:
        return fault.device // wl.width
    if fault.replica is not None:
        return fault.replica
    return alive[-1]


def _forward(
    wl: Workload, prof: Profile, faults: list[Fault], steps: int, interval: int, until_s: float, rejoin: bool
) -> Run:
    run = Run(REJOIN if rejoin else FORWARD, interval, wl.tokens_per_step, wl.ranks)
    c = _Clock(wl, prof, faults, run)
    alive = list(range(wl.replicas))
    t = prof.v("launcher_s") + c.start_s(wl.ranks, forward=True)
    c.event(0.0, "start", 0)
    run.replicas.append((0.0, len(alive)))
    run.progress.append((0.0, 0))
    lost_in: dict[int, int] = {}  # replica -> step it was lost in, awaiting re-join
    losses: dict[int, int] = {}
    spawns = 0
    save_ready = 0.0  # when the background write of the last save ends
    step = 1
    while step <= steps and t < until_s:
        if rejoin and lost_in and step > 1:
            due = sorted(
                r
                for r, s in lost_in.items()
                if step - 1 - s >= wl.rejoin_after_steps and losses[r] < wl.rejoin_max_failures
            )
            if due and spawns < wl.rejoin_max_spawns and step - 1 < steps:
                spawns += 1
                ranks = (len(alive) + len(due)) * wl.width
                stall = (
                    prof.v("spawn_s")
                    + wl.state_bytes_per_rank / prof.v("state_transfer_bw")
                    + prof.v("rebuild_s")
                    + c.repair_s(ranks)
                )
                t += stall
                alive = sorted(alive + due)
                for r in due:
                    del lost_in[r]
                run.joins.append((t, stall, len(due)))
                c.event(t, "join", step - 1, replicas=due, stall_s=stall)
                run.replicas.append((t, len(alive)))
        t0 = t
        w0 = len(alive)
        compute_end = t0 + wl.compute_s(math.ceil(wl.B / w0), w0)
        baseline = (compute_end - t0) + wl.reduce_s(w0, forward=True)
        plan = None
        outcomes: list[FaultOutcome] = []
        stopped = False
        while True:
            reduce_end = compute_end + wl.reduce_s(len(alive), forward=True)
            sf = c.step_fault(step)
            fault: Fault | None = None
            tf = 0.0
            if sf is not None:
                if sf.phase == Phase.REDUCE:
                    fault, tf = sf, compute_end + sf.at * (reduce_end - compute_end)
                else:
                    fault, tf = sf, t0 + sf.at * (compute_end - t0)
                c.fired_steps.add(step)
            else:
                fault = c.next_timed(reduce_end)
                if fault is not None:
                    tf = max(fault.time_s or 0.0, t0)
            if fault is None:
                break
            victim = _victim(fault, wl, alive)
            if victim not in alive:
                continue  # its replica is already gone: the device is not in the job any more
            if plan is None:
                plan = steady_plan(step - 1, wl.B, alive, wl.spares)  # type: ignore[arg-type]
            surfaced = max(tf + c.detect_s(fault), compute_end)
            # Struck inside the reduction: the buckets reduced and the one in flight are torn.
            stale = 0
            if tf > compute_end and reduce_end > compute_end:
                done = (tf - compute_end) / (reduce_end - compute_end)
                stale = min(wl.buckets, math.floor(done * wl.buckets + 1e-9) + 1)
            # Faults known by then surface together: one repair round for all of them.
            batch = [(fault, tf, victim)]
            while c.timed and (c.timed[0].time_s or 0.0) + c.detect_s(c.timed[0]) <= surfaced:
                more = c.timed.pop(0)
                v = _victim(more, wl, alive)
                if v in alive and v not in [b[2] for b in batch]:
                    batch.append((more, max(more.time_s or 0.0, t0), v))
            ranks_before = len(alive) * wl.width
            new: list[FaultOutcome] = []
            for f, when, v in batch:
                c.event(when, "fault", step, replica=v, fault_kind=f.kind)
                alive.remove(v)
                losses[v] = losses.get(v, 0) + 1
                run.replicas.append((when, len(alive)))
                new.append(FaultOutcome(when, step, f.kind, v))
            c.event(surfaced, "surfaced", step)
            outcomes.extend(new)
            run.faults.extend(new)
            if len(alive) < max(wl.min_replicas, 1):
                stopped = True
                t = surfaced
                break
            rep = repair(plan, [v for _, _, v in batch])
            plan = rep.plan
            extra = max((len(ids) for ids in rep.extra.values()), default=0)
            for out in new:
                out.extra_microbatches, out.action = extra, rep.action.value
                out.stale_buckets = stale
            repaired = surfaced + c.repair_s(ranks_before)
            c.event(repaired, "repaired", step, g_ext=rep.g_ext, action=rep.action.value, stale=stale)
            compute_end = repaired + wl.restore_s(stale, len(alive)) + wl.compute_s(extra, len(alive))
            if rejoin:
                for _, _, v in batch:
                    lost_in[v] = step
        if stopped:
            # Too few replicas: save the last committed step synchronously, stop, relaunch at full width.
            down = c.save_block_s() + c.write_s() + prof.v("exit_ft_s") + c.restart_s(forward=True)
            for out in outcomes:
                out.stall_s = down / len(outcomes)
            t += down
            c.event(t, "restart", step - 1, reason="min_replicas")
            alive = list(range(wl.replicas))
            lost_in.clear()
            run.replicas.append((t, len(alive)))
            continue  # the interrupted step runs again, whole, at full width
        t = compute_end + wl.reduce_s(len(alive), forward=True)
        for out in outcomes:
            out.stall_s = ((t - t0) - baseline) / len(outcomes)
        run.step_s[step] = t - t0
        c.event(t, "commit", step, replicas=len(alive))
        run.progress.append((t, step))
        if interval and step % interval == 0:
            t = max(t, save_ready) + c.save_block_s()
            save_ready = t + c.write_s()
            c.event(t, Phase.SAVE, step)
        step += 1
    run.wall_s = t + prof.v("exit_ft_s")
    c.event(run.wall_s, "end", step - 1)
    return run


def _checkpoint_restart(
    wl: Workload, prof: Profile, faults: list[Fault], steps: int, interval: int, until_s: float
) -> Run:
    run = Run(CKPT, interval, wl.tokens_per_step, wl.ranks)
    c = _Clock(wl, prof, faults, run)
    w = wl.replicas
    t = prof.v("launcher_s") + c.start_s(wl.ranks, forward=False)
    c.event(0.0, "start", 0)
    run.replicas.append((0.0, w))
    run.progress.append((0.0, 0))
    compute = wl.compute_s(math.ceil(wl.B / w), w)
    duration = wl.step_s(w, forward=False)
    saves: list[tuple[float, int]] = []  # (published at, step)
    save_ready = 0.0
    waiting: list[FaultOutcome] = []  # faults whose failed step is not committed again yet
    left: dict[int, float] = {}  # what was left of the failed step when the fault struck
    step = 1
    while step <= steps and t < until_s:
        t0 = t
        sf = c.step_fault(step)
        fault: Fault | None = None
        tf = 0.0
        if sf is not None:
            into = compute + sf.at * (duration - compute) if sf.phase == Phase.REDUCE else sf.at * compute
            fault, tf = sf, t0 + into
            c.fired_steps.add(step)
        else:
            fault = c.next_timed(t0 + duration)
            if fault is not None:
                tf = max(fault.time_s or 0.0, t0)
        if fault is not None:
            victim = fault.replica if fault.replica is not None else (fault.device or 0) // wl.width
            out = FaultOutcome(tf, step, fault.kind, victim)
            run.faults.append(out)
            waiting.append(out)
            left[id(out)] = t0 + duration - tf
            c.event(tf, "fault", step, replica=victim, fault_kind=fault.kind)
            resume = max((s for ready, s in saves if ready <= tf), default=0)
            out.recomputed_steps = step - 1 - resume
            back = tf + c.detect_s(fault) + c.restart_s()
            # A timed fault while the job is down (its replacement fails too): start over.
            while (again := c.next_timed(back)) is not None:
                back = max(again.time_s or 0.0, tf) + c.detect_s(again) + c.restart_s()
            c.event(back, "restart", resume, failed_step=step)
            run.progress.append((tf, resume))
            save_ready = min(save_ready, tf)  # a write in flight died with the job
            saves = [(ready, s) for ready, s in saves if ready <= tf]
            t = back
            step = resume + 1
            continue
        t = t0 + duration
        run.step_s[step] = duration
        c.event(t, "commit", step, replicas=w)
        run.progress.append((t, step))
        for out in waiting:
            if out.step == step:
                out.stall_first_s = t - out.time_s
                out.stall_s = t - out.time_s - left[id(out)]
        waiting = [o for o in waiting if o.step != step]
        if interval and step % interval == 0:
            t = max(t, save_ready) + c.save_block_s()
            save_ready = t + c.write_s()
            saves.append((save_ready, step))
            c.event(t, Phase.SAVE, step)
        step += 1
    for out in waiting:  # the budget ended before the failed step was committed again: stalled so far
        out.stall_s = out.stall_first_s = max(min(t, until_s) - out.time_s, 0.0)
        out.recovered = False
    # faults.py reads the *last* commit of each failed step (a later fault's recompute commits it again)
    for out in run.faults:
        last = max((e.time_s for e in run.events if e.kind == "commit" and e.step == out.step), default=None)
        if last is not None:
            out.stall_last_s = last - out.time_s
    run.wall_s = t + prof.v("exit_plain_s")
    c.event(run.wall_s, "end", step - 1)
    return run


def simulate(
    wl: Workload,
    prof: Profile,
    mode: str,
    faults: list[Fault],
    steps: int,
    interval: int = 0,
    until_s: float = math.inf,
) -> Run:
    """Simulate ``steps`` steps (or until ``until_s`` of wall time) of ``mode`` under ``faults``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == CKPT:
        return _checkpoint_restart(wl, prof, faults, steps, interval, until_s)
    return _forward(wl, prof, faults, steps, interval, until_s, rejoin=mode == REJOIN)


def breakdown(wl: Workload, prof: Profile) -> dict[str, float]:
    """The model's unit costs at full width, in seconds: what one step, one forward repair and one
    restart are made of (for reports; :func:`simulate` composes the same terms)."""
    c = _Clock(wl, prof, [], Run(FORWARD, 0, wl.tokens_per_step, wl.ranks))
    w = wl.replicas
    first = repair(steady_plan(0, wl.B, range(w), wl.spares), [w - 1])  # type: ignore[arg-type]
    extra = max((len(ids) for ids in first.extra.values()), default=0)
    return {
        "step_s": wl.step_s(w, forward=True),
        "compute_s": wl.compute_s(math.ceil(wl.B / w), w),
        "microbatch_stage_s": wl.stage_s,
        "reduce_ft_s": wl.reduce_s(w, forward=True),
        "snapshot_bytes_per_rank": float(wl.snapshot_bytes_per_rank),
        "snapshot_copy_s": wl.snapshot_copy_s,
        "snapshot_s": wl.snapshot_s(w),
        "reduce_plain_s": wl.reduce_s(w, forward=False),
        "buckets": float(wl.buckets),
        "restore_all_s": wl.restore_s(wl.buckets, w),
        **{f"reduce_ft_{k}_s": v for k, v in (wl.ft.terms(w) if wl.ft else {}).items()},
        "detect_crash_s": prof.v("detect_crash_s"),
        "detect_hang_s": wl.heartbeat_timeout_s,
        "repair_s": c.repair_s(wl.ranks),
        "g_ext_first_fault": float(first.g_ext),
        "redo_first_fault_s": wl.compute_s(extra, w - 1),
        "start_s": prof.v("launcher_s") + c.start_s(wl.ranks, forward=True),
        "relaunch_s": prof.v("relaunch_s"),
        "restart_start_s": c.start_s(wl.ranks, forward=False),
        "load_s": c.load_s(),
        "restart_s": c.restart_s(),
        "save_block_s": c.save_block_s(),
        "save_write_s": c.write_s(),
        "state_bytes_per_rank": float(wl.state_bytes_per_rank),
        "join_s": prof.v("spawn_s")
        + wl.state_bytes_per_rank / prof.v("state_transfer_bw")
        + prof.v("rebuild_s")
        + c.repair_s(wl.ranks),
    }
