"""Vocab-parallel cross-entropy against ``torch.nn.functional.cross_entropy`` on the full logits.

At tp=2 each rank holds half of the vocabulary of every row; the per-token loss (three
all-reduces: max, sum of exponentials, target logit) and the local gradient (softmax minus one-hot,
restricted to the slice) must equal what ``F.cross_entropy`` gives on the gathered logits, for:

- random logits with targets on both ends of the vocabulary and on both sides of the shard
  boundary (31 | 32), backward with a different upstream gradient per token;
- logits with peaks of +100 that alternate between the two shards: ``exp`` overflows in float32
  without the global max, and a rank-local max gives a wrong sum, so both mistakes fail here;
- bfloat16 logits: the loss is float32 and the gradient comes back in bfloat16;
- the ``.mean()`` the model's loss uses.

Labels are always real token ids: the loss has no ignore index (micro-batches are unpadded token
windows), so none is tested. The tp=1 path (no group) is checked in the test process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.sharding import ParamSpec, shard
from nanotron_recover.parallel.tensor_parallel import vocab_parallel_cross_entropy
from tests.helpers.gloo_world import run_world

TP = 2
BATCH, SEQ, VOCAB = 3, 4, 64
EDGE_TARGETS = [0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1]
CASES = ("random", "peaks", "bf16", "mean")


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(full logits, targets, upstream gradient per token or None for ``.mean()``)."""
    g = torch.Generator().manual_seed(CASES.index(name))
    logits = 3 * torch.randn(BATCH, SEQ, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    target[0] = torch.tensor(EDGE_TARGETS)
    upstream = torch.rand(BATCH, SEQ, generator=g) + 0.5
    if name == "peaks":
        for token in range(BATCH * SEQ):
            # Peak column alternates between the first and the second half of the vocabulary.
            peak = (token * 13) % (VOCAB // 2) + (VOCAB // 2) * (token % 2)
            logits.view(-1, VOCAB)[token, peak] += 100.0
        target[1] = logits[1].argmax(-1)  # some targets on the peak (loss ~0), the rest far off
    if name == "bf16":
        logits = logits.bfloat16()
    return logits, target, None if name == "mean" else upstream


def _local(logits: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    spec = ParamSpec(full_shape=tuple(logits.shape), shard_dim=logits.dim() - 1, canonical_name="logits")
    return shard(logits, spec, rank, tp).clone().requires_grad_()


def _parallel(logits: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor | None, rank: int, group):
    local = _local(logits, rank, TP if group is not None else 1)
    loss = vocab_parallel_cross_entropy(local, target, group)
    if upstream is None:
        loss = loss.mean()
        loss.backward()
    else:
        loss.backward(upstream)
    return loss.detach(), local.grad


def _reference(logits: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor | None):
    full = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none").view(target.shape)
    if upstream is None:
        loss = loss.mean()
        loss.backward()
    else:
        loss.backward(upstream)
    return loss.detach(), full.grad


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    ctx = ParallelContext.create(TP, 1, 1, torch.device("cpu"))
    return {name: _parallel(*_case(name), ctx.tp_rank, ctx.tp_group) for name in CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_worker, TP, tmp_path_factory.mktemp("cross_entropy"))


TOLERANCE = {
    "random": {"atol": 1e-6, "rtol": 1e-6},
    "peaks": {"atol": 1e-6, "rtol": 1e-6},
    "mean": {"atol": 1e-6, "rtol": 1e-6},
    "bf16": {"atol": 1e-2, "rtol": 1e-2},  # the gradient is rounded to bfloat16
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", CASES)
def test_tp2_loss_and_gradient_match_f_cross_entropy(ranks: list[dict[str, Any]], name: str) -> None:
    logits, target, upstream = _case(name)
    want_loss, want_grad = _reference(logits, target, upstream)
    assert torch.isfinite(want_loss).all()
    for rank, got in enumerate(ranks):
        loss, grad = got[name]
        assert loss.dtype == torch.float32 and grad.dtype == logits.dtype
        assert loss.shape == want_loss.shape
        torch.testing.assert_close(
            loss, want_loss, atol=1e-6, rtol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}"
        )
        torch.testing.assert_close(
            grad.float(),
            shard(want_grad, ParamSpec(tuple(want_grad.shape), 2, "g"), rank, TP),
            **TOLERANCE[name],
            msg=lambda m, r=rank: f"rank {r} grad: {m}",
        )


def test_peaks_really_are_split_across_the_shards() -> None:
    # The "peaks" case only proves the global max if the row maxima live on both ranks.
    logits, target, _ = _case("peaks")
    owners = (logits.argmax(-1) // (VOCAB // TP)).flatten().tolist()
    assert set(owners) == {0, 1}
    assert (logits.max(-1).values > 88).all(), "exp must overflow float32 without the max shift"
    assert (target[1] == logits[1].argmax(-1)).all() and set(target[0].tolist()) == set(EDGE_TARGETS)


@pytest.mark.parametrize("name", CASES)
def test_tp1_matches_f_cross_entropy(name: str) -> None:
    logits, target, upstream = _case(name)
    loss, grad = _parallel(logits, target, upstream, 0, None)
    want_loss, want_grad = _reference(logits, target, upstream)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.float(), want_grad, **TOLERANCE[name])
