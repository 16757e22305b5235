"""LLaMA for causal LM, one pipeline stage at a time, with explicit tensor parallelism.

The architecture is Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary embeddings, grouped-query
attention through ``scaled_dot_product_attention``, SwiGLU MLP, tied or untied output head) and the
parameter names are its names, so conversion is only resharding. A ``LlamaStage`` holds the layers
of one pipeline stage: the first also owns the token embedding, the last the final norm, the output
head and the loss.

Tensor parallelism (Megatron style): q/k/v and gate/up are column-parallel (each rank owns whole
attention heads and a slice of the MLP), o_proj and down_proj are row-parallel, the embedding and
the output head are split by vocabulary and the loss is a vocab-parallel cross-entropy.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import LlamaConfig
from ..parallel.sharding import ParamSpec, shard
from ..parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
    vocab_parallel_cross_entropy,
)


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Contiguous layers of stage ``pp_rank``; earlier stages take the remainder because the last
    stage also carries the output head and the loss."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``0..seq-1`` (HF's half-split layout, or interleaved pairs)."""

    def __init__(self, head_dim: int, theta: float, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        if not self.interleaved:
            freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape [batch, heads, seq, head_dim]."""
        if self.interleaved:
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup | None, tp: int, **factory):
        super().__init__()
        self.group = group
        d = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads // tp, cfg.kv_heads // tp, d
        h = cfg.hidden_size
        self.q_proj = ColumnParallelLinear(h, cfg.num_attention_heads * d, group, copy_input=False, **factory)
        self.k_proj = ColumnParallelLinear(h, cfg.kv_heads * d, group, copy_input=False, **factory)
        self.v_proj = ColumnParallelLinear(h, cfg.kv_heads * d, group, copy_input=False, **factory)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, group, **factory)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = x.shape
        x = copy_to_tp(x, self.group)  # once for q, k and v: one gradient all-reduce, not three
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup | None, **factory):
        super().__init__()
        self.group = group
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(h, i, group, copy_input=False, **factory)
        self.up_proj = ColumnParallelLinear(h, i, group, copy_input=False, **factory)
        self.down_proj = RowParallelLinear(i, h, group, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup | None, tp: int, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.self_attn = Attention(cfg, group, tp, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.mlp = MLP(cfg, group, **factory)

    def forward(self, x, rope, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """The part of ``LlamaForCausalLM`` that lives on one (pp, tp) rank."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        pp: int = 1,
        pp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.cfg, self.tp_group, self.pp, self.pp_rank = cfg, tp_group, pp, pp_rank
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.layer_ids = stage_layers(cfg.num_hidden_layers, pp, pp_rank)
        factory = {"dtype": dtype, "device": device}

        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, tp_group, **factory
            )
        self.model.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, tp_group, self.tp, **factory) for i in self.layer_ids}
        )
        if self.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp_group, **factory)
            if cfg.tie_word_embeddings and self.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_interleaved).to(device)
        self.specs = self._param_specs()

    # -- parameter bookkeeping -------------------------------------------------------------
    def _param_specs(self) -> dict[str, ParamSpec]:
        specs = {}
        for mod_name, module in self.named_modules():
            for p_name, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if name not in dict(self.named_parameters()):
                    continue  # the tied head of a single-stage model is the embedding itself
                dim = getattr(module, "tp_shard_dim", None)
                full = list(param.shape)
                if dim is not None:
                    full[dim] *= self.tp
                tied_copy = name == "lm_head.weight" and self.cfg.tie_word_embeddings
                specs[name] = ParamSpec(
                    full_shape=tuple(full),
                    shard_dim=dim,
                    canonical_name="model.embed_tokens.weight" if tied_copy else name,
                    tp_replicated=dim is None,
                    is_tied_copy=tied_copy,
                )
        return specs

    @torch.no_grad()
    def init_weights(self, std: float, seed: int, depth_scaled: bool = False) -> None:
        """Layout-independent init: each full tensor is drawn from a generator seeded by (seed, name)
        and sliced, so every tp/pp layout starts from exactly the same model (``depth_scaled``: the
        output projections with the std of :func:`init_std`)."""
        params = dict(self.named_parameters())
        for name, spec in self.specs.items():
            param = params[name]
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            full = torch.empty(spec.full_shape, dtype=torch.float32)
            sigma = init_std(spec.canonical_name, std, self.cfg.num_hidden_layers, depth_scaled)
            full.normal_(
                0.0, sigma, generator=torch.Generator().manual_seed(name_seed(seed, spec.canonical_name))
            )
            param.copy_(shard(full, spec, self.tp_rank, self.tp))

    # -- compute ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states, or vocab-sharded logits (last)."""
        h = self.model.embed_tokens(x) if self.is_first else x
        cos, sin = self.rope(h.shape[1], h.dtype)
        for layer in self.model.layers.values():
            h = layer(h, self.rope, cos, sin)
        if self.is_last:
            h = self.lm_head(self.model.norm(h))
        return h

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of one micro-batch (fp32)."""
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group).mean()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(logits, self.tp_group)


# Row-parallel output projections: what Nanotron's NUM_LAYERS init scaling shrinks with depth.
_DEPTH_SCALED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def init_std(name: str, std: float, num_layers: int, depth_scaled: bool) -> float:
    """The std the canonical tensor ``name`` is drawn with: ``std``, or for the output projections
    with Nanotron's ``scaling_method: NUM_LAYERS`` (its default) ``std / sqrt(2 * num_layers)``, so
    the residual stream's variance does not grow with depth."""
    if depth_scaled and name.endswith(_DEPTH_SCALED):
        return std / (2 * num_layers) ** 0.5
    return std


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def count_parameters(cfg: LlamaConfig) -> int:
    """Parameters of the full model (tied head counted once)."""
    h, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    d = cfg.head_dim
    attn = h * cfg.num_attention_heads * d * 2 + h * cfg.kv_heads * d * 2
    per_layer = attn + 3 * h * i + 2 * h
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + L * per_layer + h + head
