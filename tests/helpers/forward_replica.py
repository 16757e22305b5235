"""One replica of forward recovery in one process, without MPI jobs or torch.distributed.

This process is one replica of ``tp = pp = 1`` (its torch world has size 1, so the replica gate is
a no-op); ``tests/helpers/fake_comm.py`` plays the other replicas and the fault-tolerant communicator,
including failures that surface as ``WorldChanged`` at a chosen reduction or agree. The model
engine is a fake too: micro-batch ``i`` adds ``grad_of(i) / B`` to the gradient buffer and has the
loss ``loss_of(i)``. Gradients are small integers, losses multiples of 1/4 and ``B`` a power of two,
so every sum here is exact whatever its order, and is compared bit for bit with the full batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from nanotron_recover.config import load_config
from nanotron_recover.data_parallel.forward import ForwardRecovery
from nanotron_recover.data_parallel.protocol import ReducedStep, ReplicaParts
from nanotron_recover.engines.state import EngineState
from nanotron_recover.errors import StopRun
from nanotron_recover.ft.faults import FaultInjector
from nanotron_recover.parallel.world import World
from tests.helpers.fake_comm import FakeComm, Fault

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
N = 20  # gradient elements
BUCKET = 8  # elements per bucket: gradients in 3 buckets (8, 8, 4), the bookkeeping in 2B+2W / 8


def grad_of(i: int) -> torch.Tensor:
    """The gradient of micro-batch ``i`` before the 1/B loss scale: small integers, fixed by ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(-8, 9, (N,), generator=g).to(torch.float64)


def loss_of(i: int) -> float:
    return 1.0 + 0.25 * i


class Source:
    """The micro-batch source of one step: micro-batch ``i`` is a tensor that carries ``i``."""

    def __init__(self, step: int, B: int) -> None:
        self.ids = range((step - 1) * B, step * B)

    def get(self, i: int) -> torch.Tensor:
        assert i in self.ids, f"micro-batch {i} is not in this step ({self.ids})"
        return torch.tensor([i])


class Engine:
    holds_loss = True
    digest_name = "pp0_tp0"

    def __init__(self) -> None:
        self.grads_flat = torch.zeros(N, dtype=torch.float32)
        self.event_hook = None
        self.batches: list[list[int]] = []  # the ids of each train_batch call

    def export_state(self) -> EngineState:
        return EngineState({"grads": self.grads_flat.clone()}, {})

    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]:
        ids = [int(mb[0]) for mb in microbatches]
        self.batches.append(ids)
        for k, i in enumerate(ids):
            self.event_hook("forward", k)
            self.event_hook("backward", k)
            self.grads_flat.add_(grad_of(i).to(torch.float32), alpha=loss_scale)
        return [loss_of(i) for i in ids]


class Exited(BaseException):
    """What ``os._exit`` raises in these tests."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Replica:
    """One ForwardRecovery wired to the fake engine, the fake data and the fake communicator."""

    def __init__(
        self,
        run_dir: Path,
        *,
        W: int,
        G: int,
        me: int,
        faults: Sequence[Fault] = (),
        sets: Sequence[str] = (),
    ) -> None:
        self.run_dir, self.B, self.W = run_dir, W * G, W
        cfg = load_config(
            CONFIG,
            [
                "recover.enabled=true",
                f"parallelism.dp={W}",
                f"tokens.batch_accumulation_per_replica={G}",
                "recover.watchdog_timeout_s=null",
                f"recover.bucket_size_mb={BUCKET * 4 / 2**20}",
                f"recover.snapshot.dir={run_dir / 'shm'}",
                *sets,
            ],
        )
        self.fr = fr = ForwardRecovery(cfg, run_dir)
        self.comm = FakeComm(
            W=W,
            me=me,
            B=self.B,
            grad_of=grad_of,
            loss_of=loss_of,
            spares=cfg.recover.spares,
            faults=faults,
            run_dir=run_dir,
        )
        # What setup_world would set up, minus MPI and the replica's torch world.
        fr.s.ftc = self.comm
        fr.s.my_replica_ranks = {me}
        fr.s.injector = FaultInjector(cfg.recover, me, me, run_dir)
        self.engine = Engine()
        self.saves: list[tuple[int, bool]] = []
        self.incidents: list[dict] = []
        self.lines: list[str] = []
        self.outcomes: list[tuple[str, int, StopRun | None]] = []
        fr.attach(
            ReplicaParts(
                engine=self.engine,
                data=lambda step: Source(step, self.B),
                save=self._save,
                log_incident=self.incidents.append,
                write_line=self.lines.append,
                write_outcome=self._write_outcome,
                world=World(rank=0, size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"),
                ctx=SimpleNamespace(),
                B=self.B,
                G=G,
                target_step=lambda: 1000,
            )
        )
        self.comm.bind(self.engine.grads_flat, fr.s.bookkeeping)

    def _save(self, step: int, synchronous: bool) -> Path:
        self.saves.append((step, synchronous))
        return self.run_dir / "checkpoints" / str(step)

    def _write_outcome(self, status: str, last_step: int, stop: StopRun | None) -> bool:
        self.outcomes.append((status, last_step, stop))
        return True

    def step(self, step: int) -> ReducedStep:
        """One step, from a zeroed buffer (the optimizer zeroes the summed gradients after a step)."""
        self.engine.grads_flat.zero_()
        self.engine.batches = []
        self.comm.begin_step(step)
        return self.fr.reduced_gradients(step)

    def step_ids(self, step: int) -> list[int]:
        return list(range((step - 1) * self.B, step * self.B))

    def full_batch_gradient(self, step: int) -> torch.Tensor:
        return (sum(grad_of(i) for i in self.step_ids(step)) / self.B).to(torch.float32)

    def assert_full_batch(self, step: int, reduced: ReducedStep) -> None:
        """The step's summed gradient and loss are exactly those of the fault-free full batch."""
        got = self.engine.grads_flat
        want = self.full_batch_gradient(step)
        assert torch.equal(got, want), f"step {step}: gradient differs by {(got - want).abs().max()}"
        assert reduced.ids == self.step_ids(step)
        assert reduced.loss == sum(loss_of(i) for i in self.step_ids(step)) / self.B
        assert reduced.replicas == len(self.comm.alive_replicas)


def bucket_calls(job: Replica) -> tuple[int, int]:
    """(gradient buckets, bookkeeping buckets): allreduce_ calls per full reduction."""
    grads = -(-N // BUCKET)
    return grads, -(-(2 * job.B + 2 * job.W) // BUCKET)
