"""What one step of a config costs on a hardware profile: FLOPs, traffic, bytes to save and move.

Per micro-batch of ``T = sequence_length * micro_batch_size`` tokens, a model of ``P`` parameters
and ``L`` layers of width ``h`` costs

    F = 6 * P * T + 12 * L * h * s * T        FLOPs, forward + backward

(6PT: every weight is used once per token in a multiply-add forward and twice backward; the second
term is attention's ``QK^T`` and ``AV``, ``4*L*h*s`` per token forward, times 3 with backward; no
activation recomputation, ``recompute_layer`` is false). ``P`` is
:func:`~nanotron_recover.models.llama.count_parameters` of the config, the per-rank bytes come from
:func:`~nanotron_recover.estimate.plan_summary` (the heaviest pipeline stage).

One replica is ``tp * pp`` devices (``dp_shard`` for HSDP). One micro-batch through one pipeline
stage takes

    t_stage = F / (pp * tp * peak_flops * mfu)
              + (L / pp) * 4 * a * 2 * (tp - 1) / tp / (bw_tp * link_efficiency)    TP all-reduces
              + 2 * a / (bw_pp * link_efficiency)                                  PP send/receive

with ``a = T * h * dtype_bytes`` the activation of one micro-batch (two TP all-reduces forward and
two backward per layer; no async TP), ``bw_tp``/``bw_pp`` the intra-node link when the group fits
in a node and a node's network share (``inter_node_bw / devices_per_node``) otherwise. A replica
that computes ``n`` micro-batches in a step (1F1B or AFAB) takes ``(n + pp - 1) * t_stage``.
Cross-replica, the fp32 gradient slice of a rank, ``g`` bytes, is summed once at the end of the step
(gradients are accumulated locally, no overlap with backward):

    t_reduce(W) = 2 * (W - 1) / W * g / (bw_dp * link_efficiency) + dp_latency_{ft,plain}_s

with ``bw_dp`` a node's network share per device (the intra-node link when the whole job is on one
node): that is the *plain* path (checkpoint-restart: NCCL on the device, gloo on a CPU). The
*forward-recovery* path is what ``data_parallel/forward/buckets.py`` does, modelled by
:class:`FtReduction`: the gradient buffer (and the bookkeeping vector) cut into buckets of
``recover.bucket_size_mb``, each bucket of ``b`` bytes taking

    snapshot  b / host_memcpy_bw (a host copy; none when staged: the staging copy is S(b))
    d2h       b / copy_bw                      (grad_staging; pinned or pageable)
    allreduce 2 * (W - 1) / W * b / mpi_bw + 2 * (W - 1) * mpi_latency     ring over the network
              + (W - 1) / W * b / cpu_sum_bw                                  MPI_SUM on one core
              + b / host_memcpy_bw             (staged: out of place, MPI copies the input first)
    h2d       b / copy_bw                      (grad_staging: copied back)

with ``mpi_bw``/``mpi_latency`` those of the transport (btl/uct or btl/tcp), plus
``dp_latency_ft_s`` per step (gate, agree). With ``reduce_pipeline_depth = d`` stages running at
once, bucket ``i`` costs ``max(its longest stage, its sum / d)`` and the first one its whole sum
(``d = 1``: every stage of every bucket one after the other; the code's staged pipeline overlaps
its three stages, ``d = 3``: the device->host copies, the reductions and the copies back run on
two copy engines and the CPU at once). A torn reduction's restore copies the stale buckets' S(b)
back: host to device when staged, a host copy otherwise. And the optimizer streams about 36 bytes per parameter of the rank through device memory (fp32
master, gradient, two moments read and written; the bf16 copy written). When ``shared_cores`` is
set (a CPU machine) and more ranks than cores are busy, everything runs ``ranks / cores`` times
slower: the ranks time-share the cores.

Forward recovery also writes a node-memory snapshot after every ``recover.snapshot.interval``-th
committed step (``data_parallel/forward/snapshots.py``): the rank's state, ``S`` bytes (parameters,
fp32 masters, AdamW moments: :func:`~nanotron_recover.estimate.node_state_bytes`), copied in

    t_copy = S / snapshot_bw

which the next optimizer step waits for. With ``snapshot_overlap`` the copy runs beside the next
step (on a GPU a side stream and a thread) and a step pays only what outlasts its compute and
reduction, ``max(0, t_copy - compute - reduction)``; without, it pays ``t_copy`` (times the
contention when ranks share cores). Either is divided by the interval: the cost per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config
from ..estimate import node_state_bytes, plan_summary
from ..models.llama import count_parameters
from .constants import Profile

OPTIMIZER_BYTES_PER_PARAM = 36
BOOKKEEPING_BYTES_PER_ENTRY = 8  # float64: per id a count and a loss, per replica two failure times


@dataclass(frozen=True)
class FtReduction:
    """The forward-recovery reduction of one rank, bucket by bucket (see the module docstring)."""

    buckets: tuple[int, ...]  # bytes of each bucket, in order (gradients, then bookkeeping)
    snapshot_bw: float  # bytes/s of taking a bucket's snapshot; 0: free (the staging copy is S(b))
    copy_bw: float  # device<->host, each way; 0: no staging (gradients in host memory)
    net_bw: float  # one rank's share of the MPI transport
    net_latency_s: float  # one MPI message
    sum_bw: float  # MPI_SUM on one core, bytes of the result
    depth: int = 1  # stages running at once
    out_of_place_bw: float = 0.0  # the host copy an out-of-place reduction makes first; 0: in place

    @classmethod
    def on(cls, profile: Profile, grad_bytes: int, book_bytes: int, bucket_bytes: int) -> FtReduction:
        """The reduction of ``grad_bytes`` of gradients and ``book_bytes`` of bookkeeping, cut into
        ``bucket_bytes`` buckets, with ``profile``'s staging, copy, transport and CPU constants."""
        v = profile.v
        staging = v("grad_staging") > 0
        rdma = v("mpi_transport_rdma") > 0
        pinned = v("staging_pinned") > 0
        return cls(
            buckets=split_buckets(grad_bytes, bucket_bytes) + split_buckets(book_bytes, bucket_bytes),
            snapshot_bw=0.0 if staging else v("host_memcpy_bw"),
            copy_bw=(v("copy_bw_pinned") if pinned else v("copy_bw_pageable")) if staging else 0.0,
            net_bw=v("mpi_bw_rdma") if rdma else v("mpi_bw_tcp"),
            net_latency_s=v("mpi_latency_rdma_s") if rdma else v("mpi_latency_tcp_s"),
            sum_bw=v("cpu_sum_bw"),
            depth=max(int(v("reduce_pipeline_depth")), 1),
            out_of_place_bw=v("host_memcpy_bw") if staging else 0.0,
        )

    def stages(self, nbytes: int, replicas: int) -> dict[str, float]:
        """The four stages of one bucket of ``nbytes`` over ``replicas`` replicas, in seconds."""
        w = replicas
        copy = nbytes / self.copy_bw if self.copy_bw > 0 else 0.0
        if w > 1:
            net = 2 * (w - 1) / w * nbytes / self.net_bw + 2 * (w - 1) * self.net_latency_s
            cpu_sum = (w - 1) / w * nbytes / self.sum_bw
            if self.out_of_place_bw > 0:
                cpu_sum += nbytes / self.out_of_place_bw
        else:
            net = cpu_sum = 0.0
        return {
            "snapshot": nbytes / self.snapshot_bw if self.snapshot_bw > 0 else 0.0,
            "d2h": copy,
            "network": net,
            "cpu_sum": cpu_sum,
            "h2d": copy,
        }

    def terms(self, replicas: int) -> dict[str, float]:
        """Each stage summed over the buckets (what a depth-1 reduction spends in it), in seconds."""
        out = dict.fromkeys(("snapshot", "d2h", "network", "cpu_sum", "h2d"), 0.0)
        for b in self.buckets:
            for k, v in self.stages(b, replicas).items():
                out[k] += v
        return out

    def time_s(self, replicas: int) -> float:
        """The whole reduction: the first bucket's stages in full, then each bucket's bottleneck."""
        total = 0.0
        for i, b in enumerate(self.buckets):
            st = self.stages(b, replicas)
            # The all-reduce is one stage (its network and its sum run in the same MPI call).
            parts = [st["snapshot"], st["d2h"], st["network"] + st["cpu_sum"], st["h2d"]]
            whole = sum(parts)
            total += whole if i == 0 else max(max(parts), whole / max(self.depth, 1))
        return total

    def restore_s(self, stale: int) -> float:
        """Copying ``stale`` buckets' snapshots back (a torn reduction), the largest buckets first:
        host to device when the snapshots are the staging buffers."""
        bw = self.copy_bw if self.snapshot_bw == 0 else self.snapshot_bw
        return sum(sorted(self.buckets, reverse=True)[:stale]) / bw


def split_buckets(nbytes: int, bucket_bytes: int) -> tuple[int, ...]:
    """``nbytes`` cut into buckets of ``bucket_bytes`` (the last one shorter), as buckets.py cuts it."""
    if nbytes <= 0:
        return ()
    full, rest = divmod(nbytes, bucket_bytes)
    return (bucket_bytes,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class Workload:
    """A config's step on a profile; times are for one rank with a device (or core) of its own."""

    replicas: int  # W at launch (dp)
    width: int  # ranks per replica (tp * pp, or dp_shard)
    pp: int
    B: int  # micro-batches per step, constant for the run
    tokens_per_step: int
    parameters: int
    flops_per_microbatch: float
    stage_s: float  # one micro-batch through one pipeline stage (compute + TP + PP traffic)
    grad_bytes_per_rank: int
    state_bytes_per_rank: int  # parameters + fp32 master + AdamW moments: saved, loaded, or sent
    optimizer_s: float
    shared_cores: int
    dp_bw: float  # bytes/s of one rank's share of the cross-replica link, efficiency included
    dp_latency_ft_s: float
    dp_latency_plain_s: float
    spares: str
    min_replicas: int
    heartbeat_timeout_s: float
    rejoin_after_steps: int = 1
    rejoin_max_spawns: int = 16
    rejoin_max_failures: int = 3
    ft: FtReduction | None = None  # None: the forward path is the ring formula (tests' round numbers)
    snapshot_bytes_per_rank: int = 0  # a node-memory snapshot of the heaviest rank
    snapshot_interval: int = 0  # recover.snapshot.interval (0: no snapshots)
    snapshot_bw: float = 0.0  # bytes/s of the snapshot's copy (0: free)
    snapshot_overlap: bool = True  # the copy runs beside the next step

    @property
    def ranks(self) -> int:
        return self.replicas * self.width

    def contention(self, replicas: int) -> float:
        """How much slower every rank runs when ``replicas`` replicas share ``shared_cores``."""
        if self.shared_cores <= 0:
            return 1.0
        return max(1.0, replicas * self.width / self.shared_cores)

    def compute_s(self, microbatches: int, replicas: int) -> float:
        """A replica computing ``microbatches`` micro-batches while ``replicas`` replicas run."""
        if microbatches <= 0:
            return 0.0
        return (microbatches + self.pp - 1) * self.stage_s * self.contention(replicas)

    def _ring_s(self, replicas: int, forward: bool) -> float:
        if forward and self.ft is not None:
            return self.ft.time_s(replicas)
        if replicas > 1:
            return 2 * (replicas - 1) / replicas * self.grad_bytes_per_rank / self.dp_bw
        return 0.0

    def reduce_s(self, replicas: int, forward: bool) -> float:
        """The end-of-step cross-replica sum over ``replicas`` replicas, plus the optimizer step;
        forward recovery also the wait for the node-memory snapshot's copy (:meth:`snapshot_s`)."""
        latency = self.dp_latency_ft_s if forward else self.dp_latency_plain_s
        reduce = (self._ring_s(replicas, forward) + latency + self.optimizer_s) * self.contention(replicas)
        return reduce + (self.snapshot_s(replicas) if forward else 0.0)

    @property
    def snapshot_copy_s(self) -> float:
        """One node-memory snapshot's copy, ``S / snapshot_bw`` (0 without snapshots)."""
        if self.snapshot_interval <= 0 or self.snapshot_bw <= 0:
            return 0.0
        return self.snapshot_bytes_per_rank / self.snapshot_bw

    def snapshot_s(self, replicas: int) -> float:
        """What the node-memory snapshots add to a forward-recovery step with ``replicas``
        replicas, per step: the copy, or what of it outlasts the next step's compute and reduction
        when it overlaps them, over ``snapshot_interval`` steps."""
        copy = self.snapshot_copy_s
        if copy <= 0:
            return 0.0
        if self.snapshot_overlap:
            window = self.compute_s(math.ceil(self.B / replicas), replicas) + (
                self._ring_s(replicas, True) + self.dp_latency_ft_s
            ) * self.contention(replicas)
            exposed = max(0.0, copy - window)
        else:
            exposed = copy * self.contention(replicas)
        return exposed / self.snapshot_interval

    def restore_s(self, stale: int, replicas: int) -> float:
        """Forward recovery: restoring ``stale`` torn buckets from their snapshots."""
        if self.ft is None or stale <= 0:
            return 0.0
        return self.ft.restore_s(stale) * self.contention(replicas)

    @property
    def buckets(self) -> int:
        return len(self.ft.buckets) if self.ft is not None else 1

    def step_s(self, replicas: int, forward: bool) -> float:
        """A fault-free step with ``replicas`` replicas: the longest replica computes ceil(B/W)."""
        return self.compute_s(math.ceil(self.B / replicas), replicas) + self.reduce_s(replicas, forward)


def microbatch_flops(cfg: Config) -> float:
    """``6 * P * T + 12 * L * h * s * T`` for one micro-batch (forward + backward)."""
    m, t = cfg.model.model_config, cfg.tokens
    tokens = t.sequence_length * t.micro_batch_size
    attention = 12 * m.num_hidden_layers * m.hidden_size * t.sequence_length * tokens
    return 6.0 * count_parameters(m) * tokens + attention


def build_workload(cfg: Config, profile: Profile) -> Workload:
    """The :class:`Workload` of ``cfg`` on ``profile``."""
    p, m, t = cfg.parallelism, cfg.model.model_config, cfg.tokens
    v = profile.v
    hsdp = p.dp_shard > 1
    width = p.dp_shard if hsdp else p.tp * p.pp
    pp = 1 if hsdp else p.pp
    tp = p.dp_shard if hsdp else p.tp
    flops = microbatch_flops(cfg)
    per_node = max(int(v("devices_per_node")), 1)
    eff = v("link_efficiency")
    node_share = v("inter_node_bw") / per_node * eff
    intra = v("intra_node_bw") * eff
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    act = t.sequence_length * t.micro_batch_size * m.hidden_size * dtype_bytes
    stage = flops / (pp * tp * v("peak_flops") * v("mfu")) if v("mfu") > 0 else 0.0
    if tp > 1 and not hsdp:
        tp_bw = intra if tp <= per_node else node_share
        stage += (m.num_hidden_layers / pp) * 4 * act * 2 * (tp - 1) / tp / tp_bw
    if pp > 1:
        pp_bw = intra if tp * pp <= per_node else node_share
        stage += 2 * act / pp_bw
    worst = plan_summary(cfg)["worst_stage"]
    grad_elem = 4  # fp32 gradients (int64 in exact mode: the same bytes per bucket)
    bucket_bytes = max(1, int(cfg.recover.bucket_size_mb * 2**20) // grad_elem) * grad_elem
    book = (2 * cfg.microbatches_per_step + 2 * p.dp) * BOOKKEEPING_BYTES_PER_ENTRY
    ft = FtReduction.on(profile, worst.grad_bytes, book, bucket_bytes)
    state = worst.param_bytes + worst.master_bytes + worst.optimizer_bytes
    return Workload(
        replicas=p.dp,
        width=width,
        pp=pp,
        B=cfg.microbatches_per_step,
        tokens_per_step=cfg.tokens_per_step,
        parameters=count_parameters(m),
        flops_per_microbatch=flops,
        stage_s=stage,
        grad_bytes_per_rank=worst.grad_bytes,
        state_bytes_per_rank=state,
        optimizer_s=worst.parameters * OPTIMIZER_BYTES_PER_PARAM / v("hbm_bw"),
        shared_cores=int(v("shared_cores")),
        dp_bw=intra if p.dp * width <= per_node else node_share,
        dp_latency_ft_s=v("dp_latency_ft_s"),
        dp_latency_plain_s=v("dp_latency_plain_s"),
        spares=cfg.recover.spares,
        min_replicas=cfg.recover.min_replicas,
        heartbeat_timeout_s=cfg.recover.heartbeat_timeout_s,
        rejoin_after_steps=cfg.recover.rejoin.after_steps,
        rejoin_max_spawns=cfg.recover.rejoin.max_spawns,
        rejoin_max_failures=cfg.recover.rejoin.max_failures_per_replica,
        ft=ft,
        snapshot_bytes_per_rank=node_state_bytes(worst, cfg),
        snapshot_interval=cfg.recover.snapshot.interval,  # the forward runs are modelled with it
        snapshot_bw=v("snapshot_bw"),
        snapshot_overlap=v("snapshot_overlap") > 0,
    )
