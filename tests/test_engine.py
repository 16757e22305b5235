"""Pipeline schedules (AFAB and 1F1B) at pp=2 against the same model on one process.

A pipeline engine must leave exactly the gradient of ``sum_i loss_scale * loss(mb_i)`` in the
parameters and return the per-micro-batch losses, whatever the schedule and whatever ``M`` (the
fault-tolerant mode changes it from step to step, and it need not be a multiple of pp). Here a gloo
world of two ranks runs a 2-layer ``LlamaStage`` split over two stages for M in {1, 2, 5}; the
reference is the unsplit model (pp=1) running the same micro-batches in the test process with the
same ``loss_scale``. Losses and every parameter's gradient must agree.

The ``event_hook`` (where the fault-tolerant mode injects faults and syncs restores) must see
``("forward", i)`` and ``("backward", i)`` exactly once for every micro-batch, in the schedule's
documented order: AFAB runs all forwards then all backwards; 1F1B on stage ``s`` runs
``pp - s - 1`` warm-up forwards, alternates, then drains, so it never holds more than ``pp - s``
micro-batches of activations.

Also covered: one engine reused for two batches of different sizes (gradients accumulate, no state
leaks from one call into the next), tied embeddings split across the stages (the two copies'
gradients sum to the tied gradient of the single-process model), and ``forward_only`` logits.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from gloo_world import run_world

from nanotron_recover.config import LlamaConfig
from nanotron_recover.models.llama import LlamaStage
from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.pipeline_parallel import build_engine

pytestmark = pytest.mark.mpi

PP = 2
MICRO_BATCH, SEQ, VOCAB = 2, 8, 64
LOSS_SCALE = 0.37
SEED, STD = 11, 0.2
ENGINES = ("afab", "1f1b")
SIZES = (1, 2, 5)
REUSED = (2, 5)  # one engine, two consecutive batches
TIED_M = 3


def _config(tie: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


def _microbatches(m: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + m)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(m)]


def _stage(tie: bool, **layout: Any) -> LlamaStage:
    stage = LlamaStage(_config(tie), **layout)
    stage.init_weights(std=STD, seed=SEED)
    return stage


def _run(ctx: ParallelContext, engine: str, batches: list[list[torch.Tensor]], tie: bool) -> dict[str, Any]:
    stage = _stage(tie, tp_group=ctx.tp_group, pp=PP, pp_rank=ctx.pp_rank)
    eng = build_engine(engine, stage, ctx, MICRO_BATCH, SEQ)
    events: list[tuple[str, int]] = []
    eng.event_hook = lambda kind, i: events.append((kind, i))
    losses = []
    for microbatches in batches:
        losses.append([loss.clone() for loss in eng.train_batch(microbatches, LOSS_SCALE)])
    return {
        "losses": losses,
        "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
        "events": events,
        "left": (len(eng._inputs), len(eng._outputs), len(eng.p2p._pending)),
    }


def _engine_worker(rank: int, world_size: int) -> dict[str, Any]:
    ctx = ParallelContext.create(1, PP, 1, torch.device("cpu"))
    runs: dict[str, Any] = {}
    for engine in ENGINES:
        for m in SIZES:
            runs[f"{engine}-M{m}"] = _run(ctx, engine, [_microbatches(m, 0)], tie=False)
        runs[f"{engine}-reused"] = _run(ctx, engine, [_microbatches(m, 1) for m in REUSED], tie=False)
    runs["tied"] = _run(ctx, "1f1b", [_microbatches(TIED_M, 2)], tie=True)

    stage = _stage(False, tp_group=ctx.tp_group, pp=PP, pp_rank=ctx.pp_rank)
    eng = build_engine("1f1b", stage, ctx, MICRO_BATCH, SEQ)
    runs["forward_only"] = eng.forward_only([mb[:, :-1] for mb in _microbatches(3, 3)])
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_engine_worker, PP, tmp_path_factory.mktemp("engine"), timeout_s=120)


def _reference(batches: list[list[torch.Tensor]], tie: bool) -> tuple[list[list[torch.Tensor]], dict]:
    """Per-batch losses and accumulated gradients of the unsplit model, one micro-batch at a time."""
    stage = _stage(tie)
    losses = []
    for microbatches in batches:
        losses.append([])
        for mb in microbatches:
            loss = stage.loss(stage(mb[:, :-1]), mb[:, 1:])
            losses[-1].append(loss.detach())
            (loss * LOSS_SCALE).backward()
    return losses, {n: p.grad for n, p in stage.named_parameters()}


def _assert_same(got: dict[str, Any], losses: list[list[torch.Tensor]], grads: dict) -> None:
    first, last = got
    assert first["losses"] == [[] for _ in losses], "only the last stage returns losses"
    for b, (g, w) in enumerate(zip(last["losses"], losses, strict=True)):
        assert len(g) == len(w), f"batch {b}: {len(g)} losses for {len(w)} micro-batches"
        torch.testing.assert_close(torch.stack(g), torch.stack(w), atol=1e-6, rtol=1e-6)
    assert not set(first["grads"]) & set(last["grads"]), "a parameter lives on both stages"
    assert set(first["grads"]) | set(last["grads"]) == set(grads)
    for name, grad in {**first["grads"], **last["grads"]}.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, grads[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for stage in got:
        assert stage["left"] == (0, 0, 0), "activations or pending sends left after the batch"


def _expected_order(engine: str, m: int, pp_rank: int) -> list[tuple[str, int]]:
    """The documented schedule, written out independently of the engine's loops."""
    if engine == "afab":
        return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]
    warmup = min(PP - pp_rank - 1, m)
    order = [("forward", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    return order + [("backward", i) for i in range(m - warmup, m)]


def _max_in_flight(events: list[tuple[str, int]]) -> int:
    alive, most = 0, 0
    for kind, _ in events:
        alive += 1 if kind == "forward" else -1
        most = max(most, alive)
    return most


@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_gradients_and_losses_match_one_process(ranks: list[dict[str, Any]], engine: str, m: int) -> None:
    losses, grads = _reference([_microbatches(m, 0)], tie=False)
    _assert_same([r[f"{engine}-M{m}"] for r in ranks], losses, grads)


@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_event_hook_sees_every_microbatch_once_in_schedule_order(
    ranks: list[dict[str, Any]], engine: str, m: int
) -> None:
    every = Counter([("forward", i) for i in range(m)] + [("backward", i) for i in range(m)])
    for pp_rank, r in enumerate(ranks):
        events = r[f"{engine}-M{m}"]["events"]
        assert Counter(events) == every, f"stage {pp_rank}: {events}"
        assert events == _expected_order(engine, m, pp_rank), f"stage {pp_rank}"
        bound = m if engine == "afab" else min(m, PP - pp_rank)
        assert _max_in_flight(events) == bound, f"stage {pp_rank}: {events}"


@pytest.mark.parametrize("engine", ENGINES)
def test_one_engine_runs_batches_of_different_sizes(ranks: list[dict[str, Any]], engine: str) -> None:
    batches = [_microbatches(m, 1) for m in REUSED]
    losses, grads = _reference(batches, tie=False)
    _assert_same([r[f"{engine}-reused"] for r in ranks], losses, grads)
    for pp_rank, r in enumerate(ranks):
        events = r[f"{engine}-reused"]["events"]
        first = _expected_order(engine, REUSED[0], pp_rank)
        assert events == first + _expected_order(engine, REUSED[1], pp_rank), f"stage {pp_rank}"


def test_tied_embedding_copies_sum_to_the_tied_gradient(ranks: list[dict[str, Any]]) -> None:
    losses, grads = _reference([_microbatches(TIED_M, 2)], tie=True)
    first, last = (r["tied"] for r in ranks)
    torch.testing.assert_close(torch.stack(last["losses"][0]), torch.stack(losses[0]), atol=1e-6, rtol=1e-6)
    assert "lm_head.weight" not in grads, "one process: the head is the embedding"
    embed, head = first["grads"].pop("model.embed_tokens.weight"), last["grads"].pop("lm_head.weight")
    # Each copy alone is only part of the gradient; the tied all-reduce adds them.
    assert not torch.allclose(embed, grads["model.embed_tokens.weight"], atol=1e-4)
    torch.testing.assert_close(embed + head, grads["model.embed_tokens.weight"], atol=1e-6, rtol=1e-5)
    for name, grad in {**first["grads"], **last["grads"]}.items():
        torch.testing.assert_close(grad, grads[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_forward_only_gives_the_logits_of_one_process(ranks: list[dict[str, Any]]) -> None:
    stage = _stage(False)
    with torch.no_grad():
        want = [stage(mb[:, :-1]) for mb in _microbatches(3, 3)]
    assert ranks[0]["forward_only"] == []
    got = ranks[1]["forward_only"]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
