"""One step as a transaction: plan, compute, gate, reduce, agree; repaired in place when a replica
is lost, committed only on a world without new failures.

On every rank, step ``s`` runs:

1. *Plan.* ``steady_plan`` assigns the step's ``B`` ids to the alive replicas: Majors take
   ``G = ceil(B/W)`` each, a Minor the remainder, Spares shadow a Major (or idle).
2. *Compute.* The replica runs its ids; gradients accumulate in the local buffer. No cross-replica
   traffic. A Spare moves its shadow gradients aside: it contributes zeros unless promoted.
3. *Gate.* A barrier in the replica's torch world: if a member of this replica died, every other
   member learns it here (or earlier, from a broken gloo/NCCL call or the failure watch) and
   leaves or parks, so a replica is always whole or gone.
4. *Reduce.* The gradient buffer plus the bookkeeping vector (per id: how many replicas
   contributed it and its loss; per replica: when it last saw a failure) is summed over the DP
   communicator in snapshotted, epoch-tagged buckets (``buckets.py``).
5. *Agree* on the global communicator: the commit point. It returns only if no rank failed, and
   carries stop requests (``stops.py``).

A failure anywhere in 2-5 surfaces on the survivors as ``WorldChanged``, after the communicator has
shrunk. They *repair* the plan (a Spare shadowing a lost Major is promoted; the other lost ids are
spread over the survivors, ``G_ext = ceil(|L|/W)`` extra micro-batches each at most), restore every
stale bucket from its snapshot, compute the extra micro-batches and run 3-5 again in the new epoch,
as often as failures strike. At commit the bookkeeping must show every id exactly once: the summed
gradient is the fault-free run's, divided by the same ``B``.

Deadlines. Waits on other replicas (reduce, agree, recovery) have none: a frozen rank elsewhere is
ULFM's heartbeat detector's to find, and killing ourselves for it would take a healthy replica down
with it. What only this replica can see (compute, gate, the loss reduction; the trainer's optimizer
and saves) runs in :meth:`StepTransaction.local_phase`, under the watchdog.

An exception while computing makes the replica leave with a record that says what it was: the
survivors redo its ids, unless another replica already met the same exception on them
(``deterministic``: the job stops, see ``stops.py``).
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from ...errors import StopRun
from ...failures import RETRYABLE_KINDS, UNREPAIRABLE_KINDS, Kind, Phase, classify, is_peer_error, signature
from ...ft.gate import StoreGate
from ...ft.world import AllReplicasFailed, WorldChanged
from ...parallel.world import World
from ...policy import CoverageError, StepPlan, adaptive_plan, check_coverage, repair, steady_plan
from ..protocol import Parked, ReducedStep
from .buckets import BucketedReduction
from .incidents import Incident, Incidents
from .members import Members
from .rank_state import RankState
from .rejoin import Rejoin
from .stops import Stops


@dataclass
class StepState:
    plan: StepPlan
    computed: dict[int, float] = field(default_factory=dict)  # id -> loss (0 off the last stage)
    shadow: torch.Tensor | None = None
    incidents: list[Incident] = field(default_factory=list)
    g_ext: int = 0


class StepTransaction:
    def __init__(
        self, state: RankState, members: Members, incidents: Incidents, stops: Stops, rejoin: Rejoin
    ):
        self.s, self.members, self.incidents, self.stops, self.rejoin = (
            state,
            members,
            incidents,
            stops,
            rejoin,
        )
        self.reduction: BucketedReduction | None = None
        self.store_gate: StoreGate | None = None  # the gate off gloo, one per torch world
        self.computing: tuple[int, ...] = ()
        self.current_id: int | None = None
        self.carried: list[Incident] = []  # repaired before the next step began: written with it
        # A failure met in the commit agree of a step other survivors committed: this rank commits
        # it too, and repairs the next step as they do (see ``_committed_elsewhere``).
        self.behind: WorldChanged | None = None

    def attach(self) -> None:
        """Buckets over the engine's gradient buffer and the bookkeeping vector (after attach)."""
        s = self.s
        s.bookkeeping = torch.zeros(2 * s.B + 2 * s.W, dtype=torch.float64)
        grads = s.parts.engine.grads_flat  # fp32, or int64 in exact mode: buckets keep their size in bytes
        numel = max(1, int(s.args.bucket_size_mb * 2**20) // grads.element_size())
        self.reduction = BucketedReduction([grads, s.bookkeeping], numel)
        s.parts.engine.event_hook = self._engine_event

    @contextlib.contextmanager
    def local_phase(self, name: str) -> Iterator[None]:
        """A phase only this replica takes part in: under the watchdog's deadline."""
        s = self.s
        previous, s.phase = s.phase, name
        try:
            with s.watchdog.phase(name, s.args.watchdog_timeout_s):
                yield
        except Exception as error:
            if s.rejoin_on and is_peer_error(error):
                self.rejoin.park_now(f"{signature(error)} during {name}")
            raise
        finally:
            s.phase = previous

    # -- the step ------------------------------------------------------------------------------
    def run(self, step: int) -> ReducedStep:
        s = self.s
        s.step = step
        s.ftc.last_commit = step - 1
        behind, self.behind = self.behind, None
        alive = s.ftc.alive_replicas
        if behind is not None:
            # The others started this step in the world before the failure: plan in it, then
            # repair below exactly as they repair it.
            alive = sorted({*alive, *behind.result.failed_replicas})
        s.injector.begin_step(step, alive)
        # The policy counts steps from 0: its step t holds ids t*B .. t*B+B-1.
        if s.args.policy == "adaptive_world":
            state = StepState(plan=adaptive_plan(step - 1, s.B, s.W, alive))
        else:
            state = StepState(plan=steady_plan(step - 1, s.B, alive, s.args.spares))
        state.incidents.extend(self.carried)  # failures before the step (the job's start)
        self.carried.clear()
        self.reduction.reset()
        s.last_failure_view = (0.0, 0.0)
        mine = state.plan.assignments[s.ftc.replica]
        times = s.parts.times
        with times.phase("compute"):
            self._compute(step, mine.ids, state)
            if not mine.contributes:
                state.shadow = s.parts.engine.grads_flat.clone()  # a Spare's gradients count only if promoted
                s.parts.engine.grads_flat.zero_()
        if behind is not None:
            mark = times.now()
            self.rejoin.note_failure(step, behind.result)
            self._repair(step, state, behind)
            times.add("recovery", mark)
        while True:
            with times.phase("gate"):
                self._gate()
            self._fill_bookkeeping(state, first_id=(step - 1) * s.B)
            mark = times.now()
            try:
                # No deadline: the only waits here are on other replicas (see module docstring).
                s.phase = Phase.REDUCE
                nbytes = self.reduction.reduce(
                    s.ftc, s.ftc.epoch, before_bucket=lambda b: s.injector.maybe_fail(Phase.REDUCE, b)
                )
                mark = times.add("reduce", mark, nbytes)
                s.phase = Phase.AGREE
                s.injector.maybe_fail(Phase.AGREE, 0)
                _, stop = s.ftc.agree(True, stop=self.stops.bits())
                times.add("agree", mark)
                break
            except WorldChanged as changed:
                if self._committed_elsewhere(step, changed):
                    stop = 0
                    times.add("agree", mark)
                    break
                self.rejoin.note_failure(step, changed.result)
                if changed.result.parked:
                    raise Parked(f"replica {s.ftc.replica} failed in step {step}") from None
                self._repair(step, state, changed)
                times.add("recovery", mark)  # the failed collective, the repair, the redone ids
            except AllReplicasFailed as gone:
                raise Stops.no_replica_left(step - 1, gone) from None
        committed = time.perf_counter()
        if stop:
            self.incidents.write(state.incidents, committed)
            self.incidents.flush_rejoins()  # a failed re-join may be why the job stops
            raise self.stops.agreed(stop, step - 1)
        s.ftc.last_commit = step
        summed = self._summed_ids(step, state)
        loss_sum = torch.tensor(
            [s.bookkeeping[s.B : 2 * s.B].sum().item()], dtype=torch.float64, device=s.parts.world.device
        )
        if s.parts.world.size > 1:
            with self.local_phase(Phase.LOSS):
                dist.all_reduce(loss_sum)  # only the last stage's tp rank 0 holds losses
        self.incidents.write(state.incidents, committed)
        self.incidents.flush_rejoins()
        extra = {"world_epoch": s.ftc.epoch, "g_cur": state.plan.g, "g_ext": state.g_ext}
        return ReducedStep(
            loss=loss_sum.item() / len(summed), ids=summed, replicas=len(s.ftc.alive_replicas), extra=extra
        )

    def _summed_ids(self, step: int, state: StepState) -> list[int]:
        """The commit check: the ids the reduced gradient holds, each exactly once (the adaptive
        world drops a lost replica's ids and averages over the ids it summed)."""
        s = self.s
        first_id = (step - 1) * s.B
        counts = s.bookkeeping[: s.B]
        summed = [first_id + i for i, c in enumerate(counts.tolist()) if c == 1.0]
        if state.plan.policy == "adaptive_world":
            if summed != sorted(state.plan.contributed_ids()) or not torch.all((counts == 0) | (counts == 1)):
                raise CoverageError(f"step {step}: the ids summed differ from the adaptive plan's")
        elif len(summed) != s.B:
            bad = [first_id + i for i, c in enumerate(counts.tolist()) if c != 1.0]
            raise CoverageError(f"step {step}: ids {bad[:10]} were not summed exactly once")
        if len(summed) != s.B:
            # Micro-batch gradients were scaled by 1/B as they were computed.
            s.parts.engine.grads_flat.mul_(s.B / len(summed))
        return summed

    # -- compute -------------------------------------------------------------------------------
    def _engine_event(self, kind: str, index: int) -> None:
        s = self.s
        if kind == Phase.FORWARD and index < len(self.computing):
            self.current_id = self.computing[index]
        if not s.in_recovery:
            s.injector.maybe_fail(kind, index)
        elif kind == Phase.FORWARD:
            s.injector.maybe_fail(Phase.RECOVERY, index)
        if kind == Phase.FORWARD and self.current_id is not None:
            s.injector.maybe_raise(self.current_id)
        if kind == Phase.BACKWARD and s.restore_handle is not None:
            # Asynchronous restore: gradients may accumulate only once the buffer is restored.
            self._wait_restore()

    def _wait_restore(self) -> None:
        if self.s.restore_handle is not None:
            self.s.restore_handle.wait()
            self.s.restore_handle = None

    def _compute(self, step: int, ids: tuple[int, ...], state: StepState) -> None:
        if not ids:
            return
        s = self.s
        source = s.parts.data(step)
        phase = Phase.RECOVERY if s.in_recovery else Phase.COMPUTE
        self.computing = ids
        try:
            with self.local_phase(phase):
                losses = s.parts.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / s.B)
        except Exception as error:
            s.phase = phase
            self._compute_failed(step, error)
        finally:
            self.computing, self.current_id = (), None
        keep_loss = s.parts.engine.holds_loss  # count each micro-batch's loss on one rank of the replica
        for k, i in enumerate(ids):
            state.computed[i] = losses[k] if keep_loss else 0.0

    def _compute_failed(self, step: int, error: BaseException) -> NoReturn:
        """An exception while computing: this replica's torch world can no longer be trusted, so the
        replica leaves; the record tells the survivors whether to repair forward or stop."""
        s = self.s
        kind, sig = classify(error)
        ids = [self.current_id] if self.current_id is not None else list(self.computing)
        message = f"{sig} (micro-batch {ids} of step {step})"
        earlier = self.incidents.met_elsewhere(sig, ids) if kind in RETRYABLE_KINDS else None
        if earlier is not None:
            kind = Kind.DETERMINISTIC
            message = (
                f"deterministic error: micro-batch {ids} of step {step} failed in replica "
                f"{earlier['replica']} and again in replica {s.ftc.replica}: {sig}"
            )
        if kind == Kind.PEER_ERROR:
            print(f"[nanotron-recover] rank {s.ftc.rank}: {sig}", file=sys.stderr, flush=True)
            if s.rejoin_on:
                self.rejoin.park_now(message)
        else:
            traceback.print_exception(error)
        if kind in UNREPAIRABLE_KINDS and s.ftc.alive_replicas == [s.ftc.replica] and s.ftc.local_rank == 0:
            # No other replica is left to stop the job: say it and record it here.
            self.stops.end_with(s.last_step, StopRun(kind, message))
        self.members.leave(kind, message, ids=ids, error=sig)

    def _gate(self) -> None:
        s = self.s
        s.injector.maybe_fail(Phase.GATE, 0)
        world = s.parts.world
        if world.size == 1:
            return
        try:
            with self.local_phase(Phase.GATE):
                if world.backend == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=s.args.gate_timeout_s))
                else:
                    # NCCL has no monitored barrier: the same gate, with its timeout, through the
                    # replica's store (ft/gate.py).
                    self._store_gate(world)(s.args.gate_timeout_s)
        except Exception as e:
            why = f"replica-consistency gate failed: {' '.join(str(e).split())[:300]}"
            if s.rejoin_on:
                self.rejoin.park_now(why)
            self.members.leave(Kind.PEER_ERROR, why)

    def _store_gate(self, world: World) -> StoreGate:
        """The store gate of ``world`` (a new world, after a re-join, starts its gates afresh)."""
        if world.store is None:
            raise RuntimeError("the replica's world has no store for its gate")
        if self.store_gate is None or self.store_gate.store is not world.store:
            self.store_gate = StoreGate(world.store, world.rank, world.size)
        return self.store_gate

    def _fill_bookkeeping(self, state: StepState, first_id: int) -> None:
        s, book = self.s, self.s.bookkeeping
        book.zero_()
        for i in state.plan.contributed_by(s.ftc.replica):
            if i not in state.computed:
                raise CoverageError(f"replica {s.ftc.replica} contributes id {i} it never computed")
            book[i - first_id] += 1.0
            book[s.B + i - first_id] += state.computed[i]
        began, surfaced = s.last_failure_view
        book[2 * s.B + s.ftc.replica] = began
        book[2 * s.B + s.W + s.ftc.replica] = surfaced

    # -- in-step repair ------------------------------------------------------------------------
    def _committed_elsewhere(self, step: int, changed: WorldChanged) -> bool:
        """Whether the failure that interrupted this step's commit agree came after another
        survivor returned from it: that survivor committed ``step`` and went on to the next one.
        This rank then commits ``step`` too, with the sums it holds (its reduction was complete:
        it was in the agree), and starts the next step where the others are: planned in the world
        before the failure, repaired as they repair it (:meth:`run`). Redoing ``step`` instead
        would leave it one step behind them for good, summing its gradients with theirs."""
        s, result = self.s, changed.result
        if s.phase != Phase.AGREE or result.parked or result.newest_commit < step:
            return False
        if s.ftc.last_commit != step - 1:
            return False
        self.behind = changed
        return True

    def _repair(self, step: int, state: StepState, changed: WorldChanged) -> None:
        s, result = self.s, changed.result
        s.last_failure_view = (result.detected_at - result.detect_s, result.detected_at)
        if not result.failed_replicas:
            # Only parked ranks failed: no contribution is lost, but the world (epoch) changed.
            s.restore_handle = self.reduction.restore(s.ftc.epoch, asynchronous=False)
            self._wait_restore()
            return
        rep = repair(state.plan, result.failed_replicas)
        check_coverage(rep.plan)  # a bad repair is caught before any extra micro-batch is computed
        state.plan = rep.plan
        state.g_ext += rep.g_ext
        incident, records = self.incidents.of_recovery(
            step, result, rep.action.value, list(rep.lost_ids), len(rep.redistributed_ids)
        )
        state.incidents.append(incident)
        self.members.fence(result.failed_ranks)
        self.stops.after_failure(step - 1, records, state.incidents)
        asynchronous = s.args.restore == "async" and s.parts.world.device.type == "cuda"
        s.restore_handle = self.reduction.restore(s.ftc.epoch, asynchronous=asynchronous)
        me = s.ftc.replica
        if me in rep.promoted.values() and state.shadow is not None:
            # The side stream may still be copying snapshots into this memory: wait first.
            self._wait_restore()
            s.parts.engine.grads_flat.add_(state.shadow)  # promoted: the shadow gradients now count
            state.shadow = None
        extra_ids = rep.extra.get(me, ())
        if not extra_ids:
            s.injector.maybe_fail(Phase.RECOVERY, 0)
        started = time.perf_counter()
        s.in_recovery = True
        try:
            self._compute(step, extra_ids, state)
        finally:
            s.in_recovery = False
        self._wait_restore()
        spent = time.perf_counter() - started
        for inc in state.incidents:
            inc.compute_s += spent
