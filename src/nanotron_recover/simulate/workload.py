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
node), and the optimizer streams about 36 bytes per parameter of the rank through device memory (fp32
master, gradient, two moments read and written; the bf16 copy written). When ``shared_cores`` is
set (a CPU machine) and more ranks than cores are busy, everything runs ``ranks / cores`` times
slower: the ranks time-share the cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config
from ..estimate import plan_summary
from ..models.llama import count_parameters
from .constants import Profile

OPTIMIZER_BYTES_PER_PARAM = 36


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

    def reduce_s(self, replicas: int, forward: bool) -> float:
        """The end-of-step cross-replica sum over ``replicas`` replicas, plus the optimizer step."""
        ring = 2 * (replicas - 1) / replicas * self.grad_bytes_per_rank / self.dp_bw if replicas > 1 else 0.0
        latency = self.dp_latency_ft_s if forward else self.dp_latency_plain_s
        return (ring + latency + self.optimizer_s) * self.contention(replicas)

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
    )
