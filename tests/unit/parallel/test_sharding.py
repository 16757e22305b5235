"""Parameter specs and shards: the bookkeeping that makes weights portable between layouts.

Init, checkpoints and Hugging Face conversion all reassemble or re-split weights through
``ParamSpec`` + ``shard``/``unshard``. The properties checked here, in one process:

- ``shard`` gives rank ``r`` of ``n`` the contiguous block ``[r*k, (r+1)*k)`` along the split
  dimension (the layout the tensor-parallel layers compute with), replicated tensors are whole on
  every rank, and ``unshard`` over all ranks gives back the full tensor, for both split dimensions
  and several tp sizes;
- every parameter of a ``LlamaStage`` has the spec of the Megatron layout: column-parallel weights,
  the embedding and the output head split on dim 0, o_proj/down_proj on dim 1, norms replicated;
  the full shapes are the Hugging Face shapes;
- a tied output head on the last stage of a pipeline is a copy stored under the embedding's name;
  on a single stage it is the embedding itself and has no spec of its own;
- ``stage_layers`` partitions the layers contiguously, earlier stages taking the remainder;
- ``init_weights`` is layout-independent over pipeline stages: the stages of pp=2 and pp=3 hold
  exactly the tensors of the pp=1 model (the tp=2 case is in tests/integration/parallel/tensor_parallel/test_layers.py, which needs a
  gloo world).
"""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.config import LlamaConfig
from nanotron_recover.models.llama import LlamaStage, stage_layers
from nanotron_recover.parallel.sharding import ParamSpec, shard, unshard

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 32, 64, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS


def _config(layers: int = 2, tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_is_the_contiguous_block_and_unshard_inverts_it(tp: int, dim: int) -> None:
    full = torch.arange(8 * 12, dtype=torch.float32).view(8, 12)
    spec = ParamSpec(full_shape=(8, 12), shard_dim=dim, canonical_name="w")
    size = full.shape[dim] // tp
    parts = [shard(full, spec, r, tp) for r in range(tp)]
    for r, part in enumerate(parts):
        index = [slice(None), slice(None)]
        index[dim] = slice(r * size, (r + 1) * size)
        assert torch.equal(part, full[tuple(index)]), (r, part)
    assert torch.equal(unshard(parts, spec), full)


def test_replicated_tensor_is_whole_on_every_rank() -> None:
    full = torch.randn(5)
    spec = ParamSpec(full_shape=(5,), shard_dim=None, canonical_name="norm", tp_replicated=True)
    parts = [shard(full, spec, r, 4) for r in range(4)]
    assert all(torch.equal(p, full) for p in parts)
    assert torch.equal(unshard(parts, spec), full)


def _want_split(name: str) -> int | None:
    leaf = name.split(".")[-2]
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        return 0
    if leaf in ("o_proj", "down_proj"):
        return 1
    assert leaf in ("input_layernorm", "post_attention_layernorm", "norm"), name
    return None


def _hf_shape(name: str) -> tuple[int, ...]:
    leaf = name.split(".")[-2]
    return {
        "q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "gate_proj": (FFN, HIDDEN),
        "up_proj": (FFN, HIDDEN),
        "down_proj": (HIDDEN, FFN),
        "embed_tokens": (VOCAB, HIDDEN),
        "lm_head": (VOCAB, HIDDEN),
    }.get(leaf, (HIDDEN,))


def test_every_parameter_has_the_megatron_spec() -> None:
    stage = LlamaStage(_config())
    params = dict(stage.named_parameters())
    assert set(stage.specs) == set(params)
    assert "lm_head.weight" in params and "model.layers.1.mlp.down_proj.weight" in params
    for name, spec in stage.specs.items():
        assert spec.shard_dim == _want_split(name), name
        assert spec.full_shape == _hf_shape(name) == tuple(params[name].shape), name
        assert spec.canonical_name == name
        assert spec.tp_replicated == (spec.shard_dim is None), name
        assert not spec.is_tied_copy


def test_tied_head_is_the_embedding_on_one_stage_and_a_named_copy_across_stages() -> None:
    single = LlamaStage(_config(tie=True))
    assert "lm_head.weight" not in single.specs
    assert single.lm_head.weight is single.model.embed_tokens.weight

    first = LlamaStage(_config(tie=True), pp=2, pp_rank=0)
    last = LlamaStage(_config(tie=True), pp=2, pp_rank=1)
    assert "lm_head.weight" not in first.specs and "model.embed_tokens.weight" in first.specs
    head = last.specs["lm_head.weight"]
    assert head.canonical_name == "model.embed_tokens.weight"
    assert head.is_tied_copy and head.shard_dim == 0 and head.full_shape == (VOCAB, HIDDEN)
    assert not any(s.is_tied_copy for n, s in last.specs.items() if n != "lm_head.weight")


@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (2, 1, [[0, 1]]),
        (2, 2, [[0], [1]]),
        (5, 2, [[0, 1, 2], [3, 4]]),
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (2, 3, [[0], [1], []]),
    ],
)
def test_stage_layers_partition(layers: int, pp: int, want: list[list[int]]) -> None:
    assert [list(stage_layers(layers, pp, r)) for r in range(pp)] == want


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("pp", [2, 3])
def test_init_is_the_same_model_on_every_pipeline_layout(pp: int, tie: bool) -> None:
    cfg = _config(layers=3, tie=tie)
    whole = LlamaStage(cfg)
    whole.init_weights(std=0.02, seed=5)
    want = {name: p.detach() for name, p in whole.named_parameters()}
    seen: set[str] = set()
    for pp_rank in range(pp):
        stage = LlamaStage(cfg, pp=pp, pp_rank=pp_rank)
        stage.init_weights(std=0.02, seed=5)
        for name, param in stage.named_parameters():
            canonical = stage.specs[name].canonical_name
            assert torch.equal(param, want[canonical]), (pp_rank, name)
            seen.add(canonical)
    assert seen == set(want)
    assert want["model.layers.0.self_attn.q_proj.weight"].std() > 0.01  # drawn, not left empty
    assert torch.equal(want["model.norm.weight"], torch.ones(HIDDEN))


def test_init_depends_on_the_seed_and_the_name() -> None:
    a, b = LlamaStage(_config()), LlamaStage(_config())
    a.init_weights(std=0.02, seed=5)
    b.init_weights(std=0.02, seed=6)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    layer0, layer1 = a.model.layers["0"].mlp.up_proj.weight, a.model.layers["1"].mlp.up_proj.weight
    assert not torch.equal(layer0, layer1)


def test_num_layers_init_scaling_shrinks_only_the_output_projections() -> None:
    """Nanotron's default scaling_method NUM_LAYERS: o_proj and down_proj are drawn with
    std / sqrt(2 * layers), every other weight with std; the same draws otherwise."""
    cfg = _config(layers=3)
    plain, scaled = LlamaStage(cfg), LlamaStage(cfg)
    plain.init_weights(std=0.02, seed=5)
    scaled.init_weights(std=0.02, seed=5, depth_scaled=True)
    factor = (2 * 3) ** 0.5
    for (name, a), (_, b) in zip(plain.named_parameters(), scaled.named_parameters(), strict=True):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.allclose(b, a / factor), name
        else:
            assert torch.equal(a, b), name
