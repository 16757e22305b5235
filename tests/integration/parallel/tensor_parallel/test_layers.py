"""Tensor-parallel layers at tp=2 against single-process torch modules with the full weights.

Column-parallel and row-parallel linears, the vocab-parallel embedding and the tp collectives are
the only places where tensor parallelism changes the arithmetic, so each is compared directly with
``nn.Linear`` / ``nn.Embedding`` holding the full weight, which is split with the project's own
``shard`` (the function init, checkpoints and conversion use): the output, the input gradient and
the weight gradient of every rank must match (1e-6, float64). A layer that forgot the all-reduce of
the input gradient (Megatron's f), summed where it should copy (g), looked up ids outside its
vocabulary slice, or sharded along the other dimension fails here.

The same world then runs the whole ``LlamaStage`` (GQA: 4 query heads, 2 key/value heads, so one
key/value head per rank) at tp=2 against the same model at tp=1: the initial weights must be exactly
the tp=1 weights sharded, and logits, loss and every gradient (unsharded) must agree. All of it runs in one gloo world of two ranks on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanotron_recover.config import LlamaConfig
from nanotron_recover.models.llama import LlamaStage
from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.sharding import ParamSpec, shard
from nanotron_recover.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
)
from tests.helpers.gloo_world import run_world

pytestmark = pytest.mark.mpi

TP = 2
HIDDEN, FFN, VOCAB = 32, 48, 64
BATCH, SEQ = 2, 5
DTYPE = torch.float64
ATOL = 1e-6
# Both ends of the vocabulary and both sides of the tp=2 boundary (31 | 32), one id twice.
EDGE_IDS = [0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1, 0]

MODEL = LlamaConfig(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)
MODEL_SEQ = 8


def _data() -> dict[str, torch.Tensor]:
    """The full weights, inputs and upstream gradients every rank and the reference share."""
    g = torch.Generator().manual_seed(1234)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 3), generator=g)
    ids[0, : len(EDGE_IDS)] = torch.tensor(EDGE_IDS)
    return {
        "w_col": randn(FFN, HIDDEN),  # [out, in]
        "w_row": randn(HIDDEN, FFN),
        "emb": randn(VOCAB, HIDDEN),
        "x": randn(BATCH, SEQ, HIDDEN),
        "x_wide": randn(BATCH, SEQ, FFN),
        "g_wide": randn(BATCH, SEQ, FFN),
        "g": randn(BATCH, SEQ, HIDDEN),
        "ids": ids,
        "g_emb": randn(BATCH, SEQ + 3, HIDDEN),
        "model_ids": torch.randint(0, VOCAB, (BATCH, MODEL_SEQ + 1), generator=g),
    }


def _spec(full: torch.Tensor, dim: int | None) -> ParamSpec:
    return ParamSpec(full_shape=tuple(full.shape), shard_dim=dim, canonical_name="w")


def _my_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's block of the last dimension (how column-parallel outputs are split)."""
    return shard(t, _spec(t, t.dim() - 1), rank, TP).clone()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _layers_worker(rank: int, world_size: int) -> dict[str, Any]:
    ctx = ParallelContext.create(TP, 1, 1, torch.device("cpu"))
    group = ctx.tp_group
    d = _data()
    got: dict[str, Any] = {}

    # Column-parallel: replicated input, this rank's slice of the output features.
    col = ColumnParallelLinear(HIDDEN, FFN, group, dtype=DTYPE)
    with torch.no_grad():
        col.weight.copy_(shard(d["w_col"], _spec(d["w_col"], col.tp_shard_dim), ctx.tp_rank, TP))
    x = _leaf(d["x"])
    y = col(x)
    y.backward(_my_slice(d["g_wide"], ctx.tp_rank))
    got["column"] = (y.detach(), x.grad, col.weight.grad)

    # Row-parallel: this rank's slice of the input features, the full (summed) output.
    row = RowParallelLinear(FFN, HIDDEN, group, dtype=DTYPE)
    with torch.no_grad():
        row.weight.copy_(shard(d["w_row"], _spec(d["w_row"], row.tp_shard_dim), ctx.tp_rank, TP))
    xs = _leaf(_my_slice(d["x_wide"], ctx.tp_rank))
    y = row(xs)
    y.backward(d["g"])
    got["row"] = (y.detach(), xs.grad, row.weight.grad)

    # The Megatron pair as the model uses it: one explicit copy_to_tp, column (no copy), row.
    col.weight.grad, row.weight.grad = None, None
    col.copy_input = False
    x = _leaf(d["x"])
    y = row(F.silu(col(copy_to_tp(x, group))))
    y.backward(d["g"])
    got["pair"] = (y.detach(), x.grad, col.weight.grad, row.weight.grad)

    # Vocab-parallel embedding.
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group, dtype=DTYPE)
    with torch.no_grad():
        emb.weight.copy_(shard(d["emb"], _spec(d["emb"], emb.tp_shard_dim), ctx.tp_rank, TP))
    y = emb(d["ids"])
    y.backward(d["g_emb"])
    got["embedding"] = (y.detach(), emb.weight.grad, (emb.vocab_start, emb.vocab_end))

    # gather_from_tp: concatenation forward, this rank's slice of the gradient backward.
    part = _leaf(_my_slice(d["x_wide"], ctx.tp_rank))
    full = gather_from_tp(part, group)
    full.backward(d["g_wide"])
    got["gather"] = (full.detach(), part.grad)

    # Shapes that do not split evenly are refused by name.
    errors = []
    for build in (
        lambda: ColumnParallelLinear(HIDDEN, FFN + 1, group),
        lambda: RowParallelLinear(FFN + 1, HIDDEN, group),
        lambda: VocabParallelEmbedding(VOCAB + 1, HIDDEN, group),
    ):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    got["errors"] = errors

    # The whole model at tp=2.
    stage = LlamaStage(MODEL, tp_group=group)
    stage.init_weights(std=0.2, seed=7)
    ids = d["model_ids"]
    logits = stage(ids[:, :-1])
    loss = stage.loss(logits, ids[:, 1:])
    loss.backward()
    got["model"] = {
        "logits": stage.full_logits(logits).detach(),
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in stage.named_parameters()},
        "params": {n: p.detach() for n, p in stage.named_parameters()},
        "specs": stage.specs,
    }
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_layers_worker, TP, tmp_path_factory.mktemp("layers"))


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL, rtol: float = 0.0) -> None:
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _reference_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_column_parallel_linear_matches_nn_linear(ranks: list[dict[str, Any]]) -> None:
    d = _data()
    ref = _reference_linear(d["w_col"])
    x = _leaf(d["x"])
    y = ref(x)
    y.backward(d["g_wide"])
    for rank, got in enumerate(ranks):
        out, x_grad, w_grad = got["column"]
        _close(out, _my_slice(y.detach(), rank), f"rank {rank} output")
        # Full input gradient on every rank: the partial products were all-reduced.
        _close(x_grad, x.grad, f"rank {rank} input grad")
        _close(w_grad, shard(ref.weight.grad, _spec(ref.weight, 0), rank, TP), f"rank {rank} weight grad")


def test_row_parallel_linear_matches_nn_linear(ranks: list[dict[str, Any]]) -> None:
    d = _data()
    ref = _reference_linear(d["w_row"])
    x = _leaf(d["x_wide"])
    y = ref(x)
    y.backward(d["g"])
    for rank, got in enumerate(ranks):
        out, x_grad, w_grad = got["row"]
        _close(out, y.detach(), f"rank {rank} output")  # the full output, summed over ranks
        _close(x_grad, _my_slice(x.grad, rank), f"rank {rank} input grad")
        _close(w_grad, shard(ref.weight.grad, _spec(ref.weight, 1), rank, TP), f"rank {rank} weight grad")


def test_column_then_row_matches_two_nn_linears(ranks: list[dict[str, Any]]) -> None:
    d = _data()
    up, down = _reference_linear(d["w_col"]), _reference_linear(d["w_row"])
    x = _leaf(d["x"])
    y = down(F.silu(up(x)))
    y.backward(d["g"])
    for rank, got in enumerate(ranks):
        out, x_grad, up_grad, down_grad = got["pair"]
        _close(out, y.detach(), f"rank {rank} output")
        _close(x_grad, x.grad, f"rank {rank} input grad")
        _close(up_grad, shard(up.weight.grad, _spec(up.weight, 0), rank, TP), f"rank {rank} column grad")
        _close(down_grad, shard(down.weight.grad, _spec(down.weight, 1), rank, TP), f"rank {rank} row grad")


def test_vocab_parallel_embedding_matches_nn_embedding(ranks: list[dict[str, Any]]) -> None:
    d = _data()
    ref = nn.Embedding(VOCAB, HIDDEN, dtype=DTYPE)
    with torch.no_grad():
        ref.weight.copy_(d["emb"])
    y = ref(d["ids"])
    y.backward(d["g_emb"])
    assert ref.weight.grad[0].abs().sum() > 0 and ref.weight.grad[VOCAB - 1].abs().sum() > 0
    for rank, got in enumerate(ranks):
        out, w_grad, vocab_range = got["embedding"]
        assert vocab_range == (rank * VOCAB // TP, (rank + 1) * VOCAB // TP)
        _close(out, y.detach(), f"rank {rank} output")
        # Rows of this rank only; ids owned by the peer contribute nothing here.
        _close(w_grad, shard(ref.weight.grad, _spec(ref.weight, 0), rank, TP), f"rank {rank} weight grad")


def test_gather_from_tp_concatenates_and_slices_the_gradient(ranks: list[dict[str, Any]]) -> None:
    d = _data()
    for rank, got in enumerate(ranks):
        full, grad = got["gather"]
        _close(full, d["x_wide"], f"rank {rank} gathered")
        _close(grad, _my_slice(d["g_wide"], rank), f"rank {rank} grad")


def test_indivisible_shapes_are_refused(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert got["errors"] == [
            f"out_features={FFN + 1} is not divisible by tensor-parallel size {TP}",
            f"in_features={FFN + 1} is not divisible by tensor-parallel size {TP}",
            f"vocab_size={VOCAB + 1} is not divisible by tensor-parallel size {TP}",
        ]


def test_llama_stage_tp2_init_is_the_shard_of_tp1(ranks: list[dict[str, Any]]) -> None:
    ref = LlamaStage(MODEL)
    ref.init_weights(std=0.2, seed=7)
    want = dict(ref.named_parameters())
    for rank, got in enumerate(ranks):
        model = got["model"]
        assert sorted(model["params"]) == sorted(want)
        for name, param in model["params"].items():
            assert torch.equal(param, shard(want[name].detach(), model["specs"][name], rank, TP)), name


def test_llama_stage_tp2_matches_tp1(ranks: list[dict[str, Any]]) -> None:
    ref = LlamaStage(MODEL)
    ref.init_weights(std=0.2, seed=7)
    ids = _data()["model_ids"]
    logits = ref(ids[:, :-1])
    loss = ref.loss(logits, ids[:, 1:])
    loss.backward()
    assert logits.std() > 0.5, "logits too flat for the comparison to mean anything"
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for rank, got in enumerate(ranks):
        model = got["model"]
        # float32 model; tp=2 only changes the order of the sums.
        _close(model["logits"], logits.detach(), f"rank {rank} logits", atol=1e-5, rtol=1e-5)
        _close(model["loss"], loss.detach(), f"rank {rank} loss", atol=1e-6, rtol=1e-6)
        assert sorted(model["grads"]) == sorted(grads)
        for name, grad in model["grads"].items():
            spec = model["specs"][name]
            assert spec.full_shape == tuple(grads[name].shape), name
            _close(grad, shard(grads[name], spec, rank, TP), f"rank {rank} {name}", atol=1e-5, rtol=1e-4)
