"""What a config will cost, per rank, before anything is launched (``train --dry-run``).

Memory per GPU is estimated for the heaviest pipeline stage:
- parameters in the model dtype; an fp32 master copy when that dtype is not fp32;
- the fp32 gradient buffer (plus the transient model-dtype gradient of one parameter, ignored);
- AdamW state: two fp32 moments;
- in the fault-tolerant mode, the bucket snapshots: one more fp32 copy of the gradients at most;
- activations kept for backward: per layer and micro-batch about ``s*b*h*(10 + 24/tp)`` bytes in
  16-bit (Korthikanti et al., attention scores not materialised thanks to fused SDPA), doubled for
  fp32, times the micro-batches in flight (``min(pp - stage, G)`` for 1F1B, ``G`` for AFAB), plus
  the fp32 logits of one micro-batch on the last stage.
It is an estimate (allocator slack, communication buffers and CUDA context are not counted), made to
catch layouts that cannot fit, not to replace a profile.

In forward-recovery mode the plan also says what the node-memory snapshots (``recover.snapshot``)
take in the node's shared memory, outside the GPU: two slots of the rank's state (its parameters,
fp32 masters and AdamW moments, as above) per rank, and per node that times the ranks per node
when the launch tells it (Slurm's ``SLURM_NTASKS_PER_NODE`` or ``SLURM_GPUS_ON_NODE``), else for 4
and 8 ranks per node; and the folder they live in. Without ``recover.snapshot.max_mb`` each rank
caps its slots itself at its first snapshot: half of the folder's room over the two slots of every
rank of its node. The plan says what that cap would be with the folder's free space on the host the
dry run runs on (the nodes' may differ: it is decided at run time, on each node).

The plan opens with the ``note:`` lines of the fields accepted although they run differently here
(:func:`~nanotron_recover.config.validate.config_notes`), and says which steps the profiler records
and where a benchmark row goes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .config import Config
from .config.validate import config_notes
from .models.llama import count_parameters, stage_layers

GIB = 1024**3


@dataclass(frozen=True)
class StageEstimate:
    pp_rank: int
    layers: int
    parameters: int
    param_bytes: int
    master_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    snapshot_bytes: int = 0  # recover mode: bucket snapshots, up to one more fp32 gradient copy

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.master_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.snapshot_bytes
        )


def estimate_hsdp_rank(cfg: Config) -> StageEstimate:
    """The heaviest HSDP rank: its shard of parameters, gradients and AdamW state (the sharded fp32
    parameters are the masters), the transiently gathered weights, one micro-batch of activations
    (FSDP computes micro-batches one at a time), and the recovery snapshot of its gradient shard."""
    from .engines.hsdp import hsdp_memory_per_rank

    m, t = cfg.model.model_config, cfg.tokens
    mem = hsdp_memory_per_rank(m, cfg.parallelism.dp_shard, cfg.model.dtype, recover=cfg.recover.forward)
    width = 4 if cfg.model.dtype == "float32" else 2
    s, b, h = t.sequence_length, t.micro_batch_size, m.hidden_size
    acts = s * b * h * 34 * (width / 2) * m.num_hidden_layers + s * b * m.vocab_size * 4 * 2
    return StageEstimate(
        pp_rank=0,
        layers=m.num_hidden_layers,
        parameters=mem.shard_parameters,
        param_bytes=mem.param_bytes + mem.unsharded_bytes + mem.accumulation_bytes,
        master_bytes=0,
        grad_bytes=mem.grad_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        activation_bytes=int(acts),
        snapshot_bytes=mem.snapshot_bytes,
    )


def estimate_stage(cfg: Config, pp_rank: int) -> StageEstimate:
    m, p, t = cfg.model.model_config, cfg.parallelism, cfg.tokens
    h, i, v, d = m.hidden_size, m.intermediate_size, m.vocab_size, m.head_dim
    layers = len(stage_layers(m.num_hidden_layers, p.pp, pp_rank))
    per_layer = (h * m.num_attention_heads * d * 2 + h * m.kv_heads * d * 2 + 3 * h * i) // p.tp + 2 * h
    params = layers * per_layer
    if pp_rank == 0:
        params += v * h // p.tp
    if pp_rank == p.pp - 1:
        params += h + (v * h // p.tp if (not m.tie_word_embeddings or p.pp > 1) else 0)
    width = 4 if cfg.model.dtype == "float32" else 2
    s, b = t.sequence_length, t.micro_batch_size
    act_per_layer = s * b * h * (10 + 24 / p.tp) * (width / 2)
    in_flight = (
        t.batch_accumulation_per_replica
        if p.pp_engine == "afab"
        else min(p.pp - pp_rank, t.batch_accumulation_per_replica)
    )
    acts = act_per_layer * layers * in_flight
    if pp_rank == p.pp - 1:
        acts += s * b * (v // p.tp) * 4 * 2  # fp32 logits and their softmax
    return StageEstimate(
        pp_rank=pp_rank,
        layers=layers,
        parameters=params,
        param_bytes=params * width,
        master_bytes=0 if width == 4 else params * 4,
        grad_bytes=params * 4,
        optimizer_bytes=params * 8,
        activation_bytes=int(acts),
        snapshot_bytes=params * 4 if cfg.recover.forward else 0,
    )


SNAPSHOT_SLOTS = 2  # a snapshot is written into the older of two slots (data_parallel/forward/snapshots.py)
# Without recover.snapshot.max_mb the snapshots of a node take at most this share of the folder's
# room (snapshots.DEFAULT_SHARE, which a rank applies at its first snapshot).
SNAPSHOT_DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class NodeSnapshotEstimate:
    """What ``recover.snapshot`` takes in node memory (``dir``): ``slots`` copies of the heaviest
    rank's state per rank, and per node that times ``ranks_per_node`` (None: not known here)."""

    state_bytes: int  # one slot: parameters, fp32 masters, AdamW moments of the heaviest rank
    slots: int
    dir: str
    ranks_per_node: int | None
    ranks_per_node_from: str | None  # where ranks_per_node was read
    max_bytes: int | None  # recover.snapshot.max_mb
    free_bytes: int | None = None  # free space of dir's file system on this host (None: unknown)

    @property
    def per_rank_bytes(self) -> int:
        return self.slots * self.state_bytes

    def per_node_bytes(self, ranks: int) -> int:
        return ranks * self.per_rank_bytes

    def default_cap(self, ranks: int) -> int | None:
        """The slot cap a rank would apply without ``max_mb`` with ``ranks`` ranks on its node and
        this host's free space (None: not known here)."""
        if self.free_bytes is None:
            return None
        return int(SNAPSHOT_DEFAULT_SHARE * self.free_bytes) // (self.slots * max(ranks, 1))


def folder_free_bytes(folder: str) -> int | None:
    """Free space of the file system ``folder`` is on (its nearest existing parent's when it does not
    exist yet), on this host; None when nothing of it can be read."""
    path = os.path.abspath(folder)
    while True:
        try:
            vfs = os.statvfs(path)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            continue
        return vfs.f_bavail * vfs.f_frsize


def node_state_bytes(stage: StageEstimate, cfg: Config) -> int:
    """Bytes of one rank's exported state (``export_state``): its parameters in the model dtype
    and fp32 masters (for HSDP the fp32 shards, which are the masters) and two fp32 AdamW moments."""
    if cfg.parallelism.dp_shard > 1:
        return 4 * stage.parameters + stage.optimizer_bytes
    return stage.param_bytes + stage.master_bytes + stage.optimizer_bytes


def ranks_per_node_of(env: Mapping[str, str]) -> tuple[int, str] | None:
    """Ranks per node of the allocation the dry run runs in, and the variable it comes from."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        # "8", "8(x2)" (per node, repeated), "a100:8" (typed GPUs)
        match = re.fullmatch(r"(?:[\w-]+:)?(\d+)(?:\(x\d+\))?", env.get(name, "").split(",")[0])
        if match and int(match.group(1)) > 0:
            return int(match.group(1)), name
    return None


def node_snapshot_estimate(
    cfg: Config, stages: list[StageEstimate], env: Mapping[str, str] | None = None
) -> NodeSnapshotEstimate | None:
    """The node-memory snapshots of this config (None: off, or not in forward-recovery mode)."""
    n = cfg.recover.snapshot
    if not cfg.recover.forward or not n.interval:
        return None
    known = ranks_per_node_of(os.environ if env is None else env)
    ranks, source = known if known else (None, None)
    return NodeSnapshotEstimate(
        state_bytes=max(node_state_bytes(e, cfg) for e in stages),
        slots=SNAPSHOT_SLOTS,
        dir=n.dir,
        ranks_per_node=None if ranks is None else min(ranks, cfg.world_size),
        ranks_per_node_from=source,
        max_bytes=None if n.max_mb is None else int(n.max_mb * 2**20),
        free_bytes=folder_free_bytes(n.dir) if n.max_mb is None else None,
    )


def plan_summary(cfg: Config, env: Mapping[str, str] | None = None) -> dict:
    """Everything ``--dry-run`` prints, as a dict (also used by tests). ``env``: where the ranks
    per node are looked up (the process's environment by default)."""
    p = cfg.parallelism
    if p.dp_shard > 1:
        stages = [estimate_hsdp_rank(cfg)]
    else:
        stages = [estimate_stage(cfg, r) for r in range(p.pp)]
    worst = max(stages, key=lambda e: e.total_bytes)
    return {
        "world_size": cfg.world_size,
        "engine": "hsdp" if p.dp_shard > 1 else "3d",
        "dp_shard": p.dp_shard,
        "tp": p.tp,
        "pp": p.pp,
        "replicas": p.dp,
        "B": cfg.microbatches_per_step,
        "G": cfg.tokens.batch_accumulation_per_replica,
        "tokens_per_step": cfg.tokens_per_step,
        "parameters": count_parameters(cfg.model.model_config),
        "pp_engine": p.pp_engine,
        "recover": cfg.recover.enabled,
        "stages": stages,
        "worst_stage": worst,
        "node_snapshots": node_snapshot_estimate(cfg, stages, env),
        "snapshot_interval": cfg.recover.snapshot.interval if cfg.recover.forward else None,
        "notes": config_notes(cfg),
        "profiler": _profiler_plan(cfg),
        "benchmark_csv": str(cfg.general.benchmark_csv_path) if cfg.general.benchmark_csv_path else None,
    }


def _profiler_plan(cfg: Config) -> str | None:
    """What the profiler will record, in words (None: no profiler runs)."""
    from .logging.profiler import StepProfiler

    prof = cfg.profiler
    if prof is None or prof.profiler_export_path is None:
        return None
    steps = StepProfiler.recorded_steps(prof, cfg.tokens.train_steps)
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    return f"steps {shown} (of a run from step 1), one trace per rank and cycle under {prof.profiler_export_path}"


def format_plan(summary: dict) -> str:
    w: StageEstimate = summary["worst_stage"]
    if summary.get("engine") == "hsdp":
        grid = f"HSDP: FSDP2 over dp_shard={summary['dp_shard']} ranks x dp={summary['replicas']} replicas"
        where = "heaviest shard rank"
    else:
        grid = f"tp={summary['tp']} x pp={summary['pp']} x dp={summary['replicas']}"
        where = f"heaviest stage = pp rank {w.pp_rank}"
    lines = [
        *summary.get("notes", []),
        f"world size      {summary['world_size']}  ({grid})",
        f"replicas        {summary['replicas']}",
        f"B               {summary['B']} micro-batches per step (G={summary['G']} per replica)",
        f"tokens/step     {summary['tokens_per_step']:,}",
        f"parameters      {summary['parameters']:,} ({summary['parameters'] / 1e9:.2f}B)",
        f"pipeline        {summary['pp_engine']}, recover={'on' if summary['recover'] else 'off'}",
        f"memory per rank (estimate, {where}, {w.layers} layers, {w.parameters:,} parameters):",
        f"  parameters    {w.param_bytes / GIB:8.2f} GiB",
        f"  fp32 master   {w.master_bytes / GIB:8.2f} GiB",
        f"  fp32 grads    {w.grad_bytes / GIB:8.2f} GiB",
        f"  optimizer     {w.optimizer_bytes / GIB:8.2f} GiB",
        f"  activations   {w.activation_bytes / GIB:8.2f} GiB",
        f"  snapshots     {w.snapshot_bytes / GIB:8.2f} GiB",
        f"  total         {w.total_bytes / GIB:8.2f} GiB",
        *_node_snapshot_lines(summary),
    ]
    if summary.get("profiler"):
        lines.append(f"profiler        {summary['profiler']}")
    if summary.get("benchmark_csv"):
        lines.append(f"benchmark csv   {summary['benchmark_csv']} (a throughput row at the end of training)")
    return "\n".join(lines)


def _node_snapshot_lines(summary: dict) -> list[str]:
    """The node-memory snapshots, per rank and per node, and their folder (forward mode only)."""
    n: NodeSnapshotEstimate | None = summary.get("node_snapshots")
    if n is None:
        return (
            ["node memory     recover.snapshot off (interval 0)"]
            if summary.get("snapshot_interval") == 0
            else []
        )
    lines = [
        f"node memory (recover.snapshot in {n.dir}: {n.slots} slots of parameters, fp32 masters, AdamW moments):",
        f"  per rank      {n.per_rank_bytes / GIB:8.2f} GiB ({n.slots} x {n.state_bytes / GIB:.2f} GiB)",
    ]
    if n.ranks_per_node is not None:
        lines.append(
            f"  per node      {n.per_node_bytes(n.ranks_per_node) / GIB:8.2f} GiB "
            f"({n.ranks_per_node} ranks per node, {n.ranks_per_node_from})"
        )
    else:
        world = summary["world_size"]
        shown = sorted({r for r in (4, 8) if r < world} | ({world} if world <= 8 else set()))
        lines.append(
            f"  per node      {n.per_node_bytes(shown[0]) / GIB:8.2f} GiB with {shown[0]} ranks per node"
            + "".join(f", {n.per_node_bytes(r) / GIB:.2f} GiB with {r}" for r in shown[1:])
            + " (ranks per node not known here)"
        )
    if n.max_bytes is not None and n.state_bytes > n.max_bytes:
        lines.append(
            f"  over recover.snapshot.max_mb ({n.max_bytes / 2**20:.0f} MiB): the heaviest rank skips its snapshots"
        )
    if n.max_bytes is None:
        lines += _default_cap_lines(n, summary["world_size"])
    return lines


def _default_cap_lines(n: NodeSnapshotEstimate, world: int) -> list[str]:
    """The cap a rank applies without ``recover.snapshot.max_mb``, as far as this host can tell."""
    lines = [
        f"  default cap   recover.snapshot.max_mb unset: {SNAPSHOT_DEFAULT_SHARE:.0%} of the folder's free "
        f"space over {n.slots} slots x the ranks of a node, decided on each node at run time"
    ]
    if n.free_bytes is None:
        return lines
    ranks = [n.ranks_per_node] if n.ranks_per_node is not None else sorted({min(r, world) for r in (4, 8)})
    caps = [(r, n.default_cap(r) or 0) for r in ranks]
    shown = ", ".join(
        f"{cap / GIB:.2f} GiB a slot with {r} ranks per node"
        + (f" (the heaviest rank's {n.state_bytes / GIB:.2f} GiB skipped)" if n.state_bytes > cap else "")
        for r, cap in caps
    )
    lines.append(f"                with the {n.free_bytes / GIB:.2f} GiB free here: {shown}")
    return lines
