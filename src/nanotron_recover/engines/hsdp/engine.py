"""HSDP inside one replica: FSDP2 (``fully_shard``) over the replica's ranks, summed across replicas
by the caller.

The replica's ``shard`` ranks hold disjoint dim-0 shards of every parameter, of its gradient and of
the AdamW state; each decoder layer is one FSDP unit (all-gathered for its forward and backward,
freed after), the embedding, final norm and output head form the root unit. Across replicas nothing
here communicates: after :meth:`HSDPEngine.train_batch` the fp32 tensor :attr:`HSDPEngine.grads_flat`
holds this rank's shard of the replica's gradient, the caller sums it in place across replicas
(bucketed, snapshotted, over the fault-tolerant communicator: shard rank ``r`` of every replica
holds the same slice of the model, so the replicas' shard-``r`` ranks reduce with each other) and
then calls :meth:`HSDPEngine.optimizer_step`.

The math is the 3D engine's: micro-batch ``m``'s mean token loss is scaled by ``loss_scale`` (1/B)
and the gradient is the SUM over micro-batches, never a mean over ranks. FSDP2 averages over the
shard group by default (``ReduceOp.AVG``, or ``PREMUL_SUM(1/factor)`` once a divide factor is set,
which gloo refuses); every FSDP unit here is set to ``gradient_divide_factor = 1`` with
``force_sum_reduction_for_comms``, which makes the reduce-scatter a plain ``ReduceOp.SUM`` with no
pre- or post-division, on gloo and NCCL alike.

How the gradient shard reaches ``grads_flat``: every sharded parameter is given, once, a ``.grad``
DTensor whose local tensor is a view of ``grads_flat``. FSDP accumulates a reduce-scattered shard
into an existing sharded gradient in place (``grad._local_tensor += shard``), so the reduction of
every backward lands directly in the buffer: no copy in or out, and a caller that restores the
buffer from a snapshot and runs more micro-batches keeps accumulating into it.

Parameters: the sharded parameters are fp32 and are the AdamW master weights (a plain
``torch.optim.AdamW`` runs on their local shards, which is elementwise and so equal to AdamW on full
tensors). For a 16-bit model dtype FSDP's mixed precision all-gathers them cast to that dtype for
forward and backward (``param_dtype``) and reduce-scatters the gradients in fp32 (``reduce_dtype``):
the same rounded weights and fp32 gradient accumulation as the 3D engine's model-dtype parameters
with fp32 masters.

Micro-batches: :meth:`HSDPEngine.train_batch` takes the replica's list (the same on every shard
rank, like every rank of a 3D replica gets the same list) and runs micro-batch ``j`` on shard rank
``j % shard``. FSDP's collectives need every rank to run the same number of forward/backward passes,
so when ``shard`` does not divide the count the ranks short of one run a pass scaled by zero, which
adds exact zeros.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...config import LlamaConfig, OptimizerArgs
from ...models.llama import LlamaStage, RotaryEmbedding, init_std, name_seed
from ...optim.optimizer import build_adamw

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")
# all_gather_into_tensor was renamed all_gather_single (the old name warns from torch 2.13 on).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dim0_block(length: int, shard: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the rows FSDP gives ``rank`` of a dim of ``length`` split ``shard`` ways
    (``torch.chunk``: blocks of ``ceil(length / shard)``, the last ones shorter or empty)."""
    rows = -(-length // shard)
    start = min(rank * rows, length)
    return start, min(start + rows, length)


def init_full_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full fp32 tensor ``LlamaStage.init_weights`` draws for the canonical tensor ``name``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32)
    full = torch.empty(shape, dtype=torch.float32)
    return full.normal_(0.0, std, generator=torch.Generator().manual_seed(name_seed(seed, name)))


class HSDPEngine:
    """One replica's FSDP2-sharded LLaMA with its AdamW, exposing the gradient shard as one buffer.

    Collective over ``group`` (default: the whole torch world, which in the fault-tolerant mode is
    the replica): every method that touches the model or its state is called by every shard rank.
    """

    def __init__(
        self,
        model_cfg: LlamaConfig,
        optimizer_cfg: OptimizerArgs,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        init_std: float | None = 0.02,
        depth_scaled_init: bool = False,
        seed: int = 42,
        reduce_every_microbatch: bool = True,
    ):
        self.cfg, self.optimizer_cfg = model_cfg, optimizer_cfg
        self.group = group if group is not None else dist.group.WORLD
        self.shard, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.device, self.dtype = torch.device(device), dtype
        # Micro-batches reduce-scatter one by one (gradients stay sharded: 1/shard of the memory), or
        # accumulate unsharded and reduce-scatter once after the last (full-size unsharded weights
        # and fp32 gradients kept between micro-batches, one reduce-scatter per step).
        self.reduce_every_microbatch = reduce_every_microbatch
        # Called as hook("forward"|"backward", j) before micro-batch j (index in the replica's list)
        # goes that way on the rank that computes it, like PipelineEngine.event_hook.
        self.event_hook: Callable[[str, int], None] | None = None

        # Built on the meta device and sharded before any memory is allocated: no rank ever holds
        # the whole model. fp32 always: the sharded parameters are the optimizer's master weights.
        stage = LlamaStage(model_cfg, dtype=torch.float32, device="meta")
        self.specs = stage.specs
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        policy = (
            MixedPrecisionPolicy()
            if dtype == torch.float32
            else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        )
        for layer in stage.model.layers.values():
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        fully_shard(stage, mesh=self.mesh, mp_policy=policy)
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                # A SUM over the shard ranks: no division, no AVG/PREMUL_SUM (gloo has neither).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        stage.to_empty(device=self.device)
        # The rotary tables are a non-persistent buffer: to_empty left them uninitialised.
        stage.rope = RotaryEmbedding(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_interleaved).to(
            self.device
        )
        self.model = stage
        self.params: dict[str, torch.nn.Parameter] = dict(stage.named_parameters())
        if set(self.params) != set(self.specs):
            raise RuntimeError("the sharded model's parameters do not match its specs")
        self.names = list(self.params)

        # This rank's fp32 shards, as plain tensors sharing the parameters' storage (the masters).
        self.masters: dict[str, torch.Tensor] = {n: self._local(p) for n, p in self.params.items()}
        for name, master in self.masters.items():
            start, stop = self._block(name)
            if master.shape[0] != stop - start:
                raise RuntimeError(
                    f"{name}: FSDP's shard has {master.shape[0]} rows, expected {stop - start}"
                )
        numel = sum(m.numel() for m in self.masters.values())
        self.grads_flat = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self.grad_views: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        self._grads: dict[str, DTensor] = {}
        offset = 0
        for name, param in self.params.items():
            n = self.masters[name].numel()
            view = self.grads_flat[offset : offset + n].view(self.masters[name].shape)
            self.grad_views[name], self.offsets[name] = view, (offset, offset + n)
            offset += n
            grad = DTensor.from_local(
                view, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
            if grad.to_local().data_ptr() != view.data_ptr() and n > 0:
                raise RuntimeError(f"the sharded gradient of {name} does not alias grads_flat")
            param.grad = grad
            self._grads[name] = grad

        self.torch_opt = build_adamw(list(self.masters.values()), optimizer_cfg)
        if init_std is not None:
            self.init_weights(init_std, seed, depth_scaled_init)

    # -- layout ------------------------------------------------------------------------------
    @staticmethod
    def _local(param: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return param.to_local().detach()

    def _block(self, name: str) -> tuple[int, int]:
        return dim0_block(self.specs[name].full_shape[0], self.shard, self.rank)

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full canonical tensor ``name``."""
        shape = self.specs[name].full_shape
        if tuple(full.shape) != shape:
            raise ValueError(f"{name}: got shape {list(full.shape)}, expected {list(shape)}")
        start, stop = self._block(name)
        return full[start:stop]

    def _check_storage(self) -> None:
        """The masters and gradients must still be the parameters' storage and ``grads_flat``."""
        for name, param in self.params.items():
            if param.grad is not self._grads[name]:
                raise RuntimeError(f"the gradient of {name} was replaced: it no longer lives in grads_flat")
            if self.masters[name].numel() and self._local(param).data_ptr() != self.masters[name].data_ptr():
                raise RuntimeError(f"the sharded storage of {name} moved")

    # -- init ----------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float, seed: int, depth_scaled: bool = False) -> None:
        """The same model as ``LlamaStage.init_weights(std, seed, depth_scaled)`` on any tp/pp layout
        (weights in the model dtype, masters equal to them, as the 3D engine's masters start)."""
        for name, spec in self.specs.items():
            sigma = init_std(spec.canonical_name, std, self.cfg.num_hidden_layers, depth_scaled)
            full = init_full_tensor(spec.canonical_name, spec.full_shape, sigma, seed)
            self.masters[name].copy_(self.local_slice(name, full.to(self.dtype).float()))

    # -- training --------------------------------------------------------------------------------
    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]:
        """Forward and backward of the replica's ``microbatches`` (``[mbs, seq + 1]`` token ids,
        the same list on every shard rank), this rank computing ``microbatches[rank::shard]``.
        ``loss_scale * loss(mb)`` gradients are summed over the replica into ``grads_flat`` (added to
        what it holds). Returns every micro-batch's mean token loss, in order, on every rank."""
        n = len(microbatches)
        if n == 0:
            return []
        self._check_storage()
        rounds = -(-n // self.shard)
        local = torch.zeros(rounds, dtype=torch.float32, device=self.device)
        for k in range(rounds):
            j = k * self.shard + self.rank
            real = j < n
            mb = microbatches[j] if real else microbatches[-1]
            if not self.reduce_every_microbatch:
                last = k == rounds - 1
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            if real and self.event_hook is not None:
                self.event_hook("forward", j)
            loss = self.model.loss(self.model(mb[:, :-1].to(self.device)), mb[:, 1:].to(self.device))
            if real:
                local[k] = loss.detach()
            if real and self.event_hook is not None:
                self.event_hook("backward", j)
            (loss * (loss_scale if real else 0.0)).backward()
        gathered = torch.empty(self.shard * rounds, dtype=torch.float32, device=self.device)
        _all_gather_single(gathered, local, group=self.group)
        per_rank = gathered.view(self.shard, rounds).cpu()
        return [float(per_rank[j % self.shard, j // self.shard]) for j in range(n)]

    def zero_grad(self) -> None:
        self.grads_flat.zero_()

    @torch.no_grad()
    def grad_norm(self) -> float:
        """L2 norm of the full model's gradient (every element lives on exactly one shard rank)."""
        local = torch.linalg.vector_norm(self.grads_flat).square().reshape(1)
        if self.shard > 1:
            dist.all_reduce(local, group=self.group)
        return math.sqrt(local.item())

    @torch.no_grad()
    def optimizer_step(self, lr: float) -> float:
        """Clip (``clip_grad`` over the full model) and AdamW on the shards, from ``grads_flat``
        (call once it holds the gradient summed over replicas). Returns the norm before clipping.
        Does not zero the gradient: :meth:`zero_grad`."""
        self._check_storage()
        norm = self.grad_norm()
        max_norm = self.optimizer_cfg.clip_grad
        if max_norm is not None and max_norm > 0 and norm > max_norm:
            self.grads_flat.mul_(max_norm / (norm + 1e-6))
        for group in self.torch_opt.param_groups:
            group["lr"] = lr
        for name, m in self.masters.items():
            m.grad = self.grad_views[name]
        self.torch_opt.step()
        for m in self.masters.values():
            m.grad = None
        return norm

    def step_count(self) -> int:
        for st in self.torch_opt.state.values():
            return int(st["step"])
        return 0

    # -- full tensors, for checkpoints and digests ----------------------------------------------
    def _gather(self, name: str, local: torch.Tensor, dst: int | None) -> torch.Tensor | None:
        """The full tensor from every rank's dim-0 block: on every rank (``dst=None``) or on group
        rank ``dst`` only (None elsewhere). Moved to CPU."""
        shape = self.specs[name].full_shape
        rows = -(-shape[0] // self.shard)
        padded = local.new_zeros((rows, *shape[1:]))
        padded[: local.shape[0]] = local
        if dst is None:
            out = local.new_empty((self.shard * rows, *shape[1:]))
            _all_gather_single(out, padded, group=self.group)
            return out[: shape[0]].cpu()
        parts = [torch.empty_like(padded) for _ in range(self.shard)] if self.rank == dst else None
        dist.gather(padded, parts, group=self.group, group_dst=dst)
        return torch.cat(parts)[: shape[0]].cpu() if parts is not None else None

    @torch.no_grad()
    def full_state(self, optimizer: bool = True, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Full canonical tensors, named as in a checkpoint's files: ``<name>`` for the weights (model
        dtype), ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` (fp32; zeros before the first step, which
        AdamW treats exactly like no state), and ``master/<name>`` (fp32) when the model dtype is not
        fp32. On every rank, or on group rank ``dst`` only (an empty dict elsewhere). Collective."""
        out: dict[str, torch.Tensor] = {}
        for name in self.names:
            master = self.masters[name]
            entries = [("", master)]
            if optimizer:
                st = self.torch_opt.state.get(master, {})
                entries += [
                    (f"{key}/", st[key] if key in st else torch.zeros_like(master)) for key in OPTIMIZER_KEYS
                ]
            for prefix, local in entries:
                full = self._gather(name, local, dst)
                if full is None:
                    continue
                if prefix:
                    out[f"{prefix}{name}"] = full
                else:
                    out[name] = full.to(self.dtype)
                    if optimizer and self.dtype != torch.float32:
                        out[f"master/{name}"] = full
        return out

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor], step: int | None = None) -> None:
        """Inverse of :meth:`full_state` (any rank's copy; every rank passes the full tensors). Masters
        come from ``master/<name>`` when present, else from the weights rounded to the model dtype;
        optimizer state is loaded when ``exp_avg/<name>`` is present, with ``step`` (required then)."""
        has_opt = any(f"exp_avg/{n}" in state for n in self.names)
        if has_opt and step is None:
            raise ValueError("loading optimizer state needs the step count")
        # Everything is checked before anything changes.
        for name in self.names:
            keys = [name, *(f"{k}/{name}" for k in OPTIMIZER_KEYS if has_opt)]
            if f"master/{name}" in state:
                keys.append(f"master/{name}")
            for key in keys:
                if key not in state:
                    raise KeyError(f"full state has no tensor {key!r}")
                if tuple(state[key].shape) != self.specs[name].full_shape:
                    raise ValueError(
                        f"{key}: got shape {list(state[key].shape)}, expected {list(self.specs[name].full_shape)}"
                    )
        for name in self.names:
            master = self.masters[name]
            full = state.get(f"master/{name}")
            if full is None:
                full = state[name].to(self.dtype)
            master.copy_(self.local_slice(name, full.float()))
            if has_opt:
                self.torch_opt.state[master] = {
                    "step": torch.tensor(float(step)),
                    **{
                        key: self.local_slice(name, state[f"{key}/{name}"]).to(
                            self.device, torch.float32, copy=True
                        )
                        for key in OPTIMIZER_KEYS
                    },
                }

    @torch.no_grad()
    def parameter_digest(self) -> str:
        """sha256 of the full model (names sorted, weights in the model dtype, as fp32 bytes): the
        digest ``DistributedTrainer.write_parameter_digest`` writes for a tp=1, pp=1 layout, so replicas
        (and layouts) holding the same model agree. Collective."""
        digest = hashlib.sha256()
        for name in sorted(self.names):
            full = self._gather(name, self.masters[name], None)
            digest.update(name.encode())
            digest.update(full.to(self.dtype).float().contiguous().numpy().tobytes())
        return digest.hexdigest()
