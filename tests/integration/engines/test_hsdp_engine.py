"""HSDPEngine (FSDP2 over one replica's ranks) against the single-process model.

One gloo world of two shard ranks (spawned once for the module) runs every scenario and leaves its
results in files; the tests compare them with a single-process ``LlamaStage`` trained through the
project's GradBuffer, clip_grad_norm_ and MasterOptimizer on the same micro-batches:

- the reduce-scatter is a SUM over the shard ranks (FSDP2 averages by default): the gradient shard
  equals the slice of the single-process gradient;
- three optimizer steps give the same losses, gradient norms, weights and AdamW state, in fp32 (one
  reduce-scatter per micro-batch, or one per step) and bf16, with uneven shards, tied embeddings and
  a micro-batch count the shard count does not divide;
- full states round-trip between engines, a tp=1 stage, and checkpoints of both;
- two engines standing for two replicas, their gradient shards summed, equal one engine over all
  the micro-batches;
- live state transfer through the ``ModelEngine`` wrapper (``HSDPModelEngine.export_state`` /
  ``import_state``, what a re-joining replica's shard rank receives from the same shard rank of a
  healthy replica): a freshly built engine imports a trained one's local shards (after a trip
  through raw bytes, as over MPI) and the two then take the same steps with ``==`` losses, norms,
  digests and full states; fp32, and bf16 with tied embeddings and uneven shards.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanotron_recover.checkpoint import CheckpointReader, save_checkpoint
from nanotron_recover.config import (
    Config,
    GeneralArgs,
    LlamaConfig,
    LRSchedulerArgs,
    ModelArgs,
    OptimizerArgs,
    ParallelismArgs,
)
from nanotron_recover.config.schema import OptimizerFactory
from nanotron_recover.engines.hsdp import (
    HSDPEngine,
    HSDPModelEngine,
    dim0_block,
    hsdp_memory_per_rank,
    load_hsdp_checkpoint,
    load_stage_full_state,
    save_hsdp_checkpoint,
    stage_full_state,
)
from nanotron_recover.engines.state import EngineState
from nanotron_recover.models.llama import LlamaStage, count_parameters
from nanotron_recover.optim import GradBuffer, MasterOptimizer, clip_grad_norm_
from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.world import World
from tests.helpers.gloo_world import run_world

pytestmark = pytest.mark.mpi  # spawns gloo worlds

SHARD = 2
SEED = 7
CFG = LlamaConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=32,
)
# Tied embeddings, and a vocabulary that two ranks split unevenly (64 + 63 rows).
TIED = LlamaConfig(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=127,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
OPT = OptimizerArgs(
    optimizer_factory=OptimizerFactory(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
    learning_rate_scheduler=LRSchedulerArgs(learning_rate=3e-3),
    weight_decay=0.1,
    clip_grad=0.5,  # below the gradient norms of these steps: clipping is exercised
)
LRS = [3e-3, 2e-3, 1e-3, 1e-3]
MBS, SEQ = 2, 16
B = 4  # micro-batches per step


def microbatches(step: int, n: int = B, vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, vocab, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def model_config(dtype: str = "float32", mcfg: LlamaConfig = CFG) -> Config:
    return Config(model=ModelArgs(model_config=mcfg, dtype=dtype))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny single-process references run far faster on one thread, above all on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the single-process reference --------------------------------------------------------------------


class Reference:
    """A tp=1, pp=1 stage trained like the 3D trainer's replica: GradBuffer, clipping, MasterOptimizer."""

    def __init__(self, mcfg: LlamaConfig = CFG, dtype: torch.dtype = torch.float32):
        self.stage = LlamaStage(mcfg, dtype=dtype)
        self.stage.init_weights(0.02, SEED)
        named = list(self.stage.named_parameters())
        self.grads = GradBuffer(named, torch.device("cpu"))
        self.opt = MasterOptimizer(named, self.grads, OPT)
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.first_grads: dict[str, torch.Tensor] = {}

    def step(self, k: int, mbs: list[torch.Tensor]) -> None:
        for mb in mbs:
            loss = self.stage.loss(self.stage(mb[:, :-1]), mb[:, 1:])
            self.losses.append(loss.item())
            (loss * (1.0 / len(mbs))).backward()
        if not self.first_grads:
            self.first_grads = {n: v.clone() for n, v in self.grads.views.items()}
        self.norms.append(clip_grad_norm_(self.grads, self.stage.specs, OPT.clip_grad, 0, None))
        self.opt.step(LRS[k])
        self.grads.zero_()

    def state(self) -> dict[str, torch.Tensor]:
        return stage_full_state(self.stage, self.opt)


def stage_digest(stage: LlamaStage) -> str:
    """What DistributedTrainer.write_parameter_digest computes for a tp=1, pp=1 rank."""
    digest = hashlib.sha256()
    for name, param in sorted(stage.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# -- the two-rank world ----------------------------------------------------------------------------------


def _train(engine: HSDPEngine, steps: range, n: int = B, vocab: int = 128) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for k in steps:
        losses += engine.train_batch(microbatches(k, n, vocab), 1.0 / n)
        norms.append(engine.optimizer_step(LRS[k]))
        engine.zero_grad()
    return losses, norms


def _scenarios(rank: int, tmp: Path) -> dict:
    out: dict = {"rank": rank}

    # fp32, one reduce-scatter per micro-batch; the first step's gradient shard before the optimizer.
    main = HSDPEngine(CFG, OPT, seed=SEED)
    out["grads_numel"] = main.grads_flat.numel()
    out["init_state"] = main.full_state(optimizer=False)
    out["init_digest"] = main.parameter_digest()
    first = main.train_batch(microbatches(0), 1.0 / B)
    out["first_grads"] = {n: v.clone() for n, v in main.grad_views.items()}
    norm0 = main.optimizer_step(LRS[0])
    main.zero_grad()
    losses, norms = _train(main, range(1, 3))
    out["fp32"] = {"losses": first + losses, "norms": [norm0, *norms], "state": main.full_state()}
    out["rank0_only"] = sorted(main.full_state(dst=0))
    save_hsdp_checkpoint(tmp / "hsdp_ck", 3, model_config(), main)

    # One reduce-scatter per step (gradients accumulated unsharded between micro-batches).
    acc = HSDPEngine(CFG, OPT, seed=SEED, reduce_every_microbatch=False)
    losses, norms = _train(acc, range(3))
    out["accumulate"] = {"losses": losses, "norms": norms, "state": acc.full_state()}

    # bf16 compute weights, fp32 masters and reduction.
    bf16 = HSDPEngine(CFG, OPT, seed=SEED, dtype=torch.bfloat16)
    losses, norms = _train(bf16, range(3))
    out["bf16"] = {"losses": losses, "norms": norms, "state": bf16.full_state()}

    # Tied embeddings, uneven shards; 3 micro-batches then 1 (fewer than the shard ranks).
    tied = HSDPEngine(TIED, OPT, seed=SEED)
    out["tied_numel"] = tied.grads_flat.numel()
    events: list[tuple[str, int]] = []
    tied.event_hook = lambda kind, i: events.append((kind, i))
    losses, norms = _train(tied, range(2), n=3, vocab=127)
    tied.event_hook = None
    more, more_norms = _train(tied, range(2, 3), n=1, vocab=127)
    out["tied"] = {"losses": losses + more, "norms": norms + more_norms, "state": tied.full_state()}
    out["events"] = events

    # Round trip: a fresh engine (another init) loads main's state; both take one more step.
    fresh = HSDPEngine(CFG, OPT, seed=SEED + 1)
    fresh.load_full_state(out["fp32"]["state"], step=3)
    out["reloaded"] = fresh.full_state()
    a, _ = _train(main, range(3, 4))
    b, _ = _train(fresh, range(3, 4))
    out["continued"] = {"main": a, "fresh": b, "digests": (main.parameter_digest(), fresh.parameter_digest())}
    out["continued_state"] = main.full_state()

    # A 3D checkpoint (tp=1) loads into an engine.
    from3d = HSDPEngine(CFG, OPT, init_std=None)
    load_hsdp_checkpoint(CheckpointReader(tmp / "ref_ck"), from3d)
    out["from_3d"] = from3d.full_state()

    # Two replicas over micro-batches 0-3 and 4-7, their shards summed (as the cross-replica
    # all-reduce would), against one engine over all eight.
    mbs = microbatches(10, 8)
    r1, r2, whole = (HSDPEngine(CFG, OPT, seed=SEED) for _ in range(3))
    l1, l2 = r1.train_batch(mbs[:4], 1 / 8), r2.train_batch(mbs[4:], 1 / 8)
    lw = whole.train_batch(mbs, 1 / 8)
    summed = r1.grads_flat + r2.grads_flat
    r1.grads_flat.copy_(summed)
    r2.grads_flat.copy_(summed)
    # Forward recovery on one engine: its own micro-batches reduced, the cross-replica sum torn by a
    # failure, the buffer restored from the snapshot, the lost replica's micro-batches run on top.
    rec = HSDPEngine(CFG, OPT, seed=SEED, reduce_every_microbatch=False)
    rec.train_batch(mbs[:4], 1 / 8)
    snapshot = rec.grads_flat.clone()
    rec.grads_flat.fill_(7.0)
    rec.grads_flat.copy_(snapshot)
    rec.train_batch(mbs[4:], 1 / 8)
    out["recovered"] = rec.grads_flat.clone()

    errors = []
    for bad in ({}, {**out["init_state"], "model.norm.weight": torch.ones(3)}):
        try:
            fresh.load_full_state(bad)
        except (KeyError, ValueError) as e:
            errors.append(type(e).__name__)
    out["load_errors"] = errors

    out["replicas"] = {
        "losses": (l1 + l2, lw),
        "grads": (summed.clone(), whole.grads_flat.clone()),
        "norms": (r1.optimizer_step(LRS[0]), r2.optimizer_step(LRS[0]), whole.optimizer_step(LRS[0])),
        "digests": (r1.parameter_digest(), r2.parameter_digest(), whole.parameter_digest()),
        "states": (r1.full_state(optimizer=False), whole.full_state(optimizer=False)),
    }
    return out


def _worker(rank: int, store: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=SHARD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        out = _scenarios(rank, Path(tmp))
        torch.save(out, Path(tmp) / f"rank{rank}.pt")
    except BaseException:
        Path(tmp, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hsdp")
    # The 3D side: three reference steps saved as a tp=1 checkpoint, for the engine to load.
    ref = Reference()
    for k in range(3):
        ref.step(k, microbatches(k))
    save_checkpoint(
        tmp / "ref_ck", 3, model_config(), ref.stage, ref.opt.state_tensors(), tp=1, pp=1, dp_rank=0
    )
    started = time.monotonic()
    ranks = mp.start_processes(
        _worker, args=(str(tmp / "store"), str(tmp)), nprocs=SHARD, join=False, start_method="spawn"
    )
    try:
        while not ranks.join(timeout=1):
            if time.monotonic() - started > 300:
                pytest.fail("the HSDP world did not finish within 300s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        stories = "\n".join(f.read_text() for f in sorted(tmp.glob("rank*.error")))
        pytest.fail(f"a rank failed:\n{stories}")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    results = {r: torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(SHARD)}
    results["tmp"] = tmp
    results["seconds"] = time.monotonic() - started
    return results


# -- checks ------------------------------------------------------------------------------------------------


def trained_reference(mcfg: LlamaConfig = CFG, dtype: torch.dtype = torch.float32, n: int = B) -> Reference:
    ref = Reference(mcfg, dtype)
    for k in range(3):
        ref.step(k, microbatches(k, n, mcfg.vocab_size))
    return ref


def assert_losses(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=rel)


def assert_states(got: dict, want: dict, weights_atol: float, state_atol: float) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        atol = state_atol if "/" in key and not key.startswith("master/") else weights_atol
        torch.testing.assert_close(got[key].float(), value.float(), rtol=0, atol=atol, msg=key)


def test_ranks_agree(world):
    for key in ("fp32", "accumulate", "bf16", "tied"):
        assert world[0][key]["losses"] == world[1][key]["losses"]
        assert world[0][key]["norms"] == world[1][key]["norms"]
    assert world[0]["continued"]["digests"] == world[1]["continued"]["digests"]
    assert world[0]["replicas"]["digests"] == world[1]["replicas"]["digests"]
    # full_state(dst=0): the tensors on group rank 0 only
    assert world[0]["rank0_only"] == sorted(world[0]["fp32"]["state"]) and world[1]["rank0_only"] == []


def test_initial_full_state_is_the_stage_bitwise(world):
    ref = Reference()
    params = dict(ref.stage.named_parameters())
    got = world[0]["init_state"]
    assert sorted(got) == sorted(params)
    for name, p in params.items():
        assert torch.equal(got[name], p.detach()), name
    # The digest of the full model is the one the trainer writes for a tp=1, pp=1 rank.
    assert world[0]["init_digest"] == world[1]["init_digest"] == stage_digest(ref.stage)


def test_gradient_shard_is_the_sum_over_microbatches_not_a_mean(world):
    """FSDP2 would divide by the shard group size: the shard must equal the single-process sum."""
    ref = Reference()
    ref.step(0, microbatches(0))
    for rank in range(SHARD):
        for name, full in ref.first_grads.items():
            start, stop = dim0_block(full.shape[0], SHARD, rank)
            torch.testing.assert_close(
                world[rank]["first_grads"][name], full[start:stop], rtol=1e-5, atol=1e-8
            )
    # the shards tile the model: each element on exactly one rank
    assert world[0]["grads_numel"] + world[1]["grads_numel"] == count_parameters(CFG)


@pytest.mark.parametrize("mode", ["fp32", "accumulate"])
def test_three_steps_match_single_process_fp32(world, mode):
    ref = trained_reference()
    got = world[0][mode]
    assert_losses(got["losses"], ref.losses)
    assert_losses(got["norms"], ref.norms)
    assert all(n > OPT.clip_grad for n in ref.norms)
    assert_states(got["state"], ref.state(), weights_atol=1e-6, state_atol=1e-7)


def test_three_steps_match_single_process_bf16(world):
    ref = trained_reference(dtype=torch.bfloat16)
    got = world[0]["bf16"]
    assert_losses(got["losses"], ref.losses)
    assert_losses(got["norms"], ref.norms)
    # bf16 weights may round one ulp apart (8e-3 near 1.0); the fp32 masters are close
    assert_states(got["state"], ref.state(), weights_atol=8e-3, state_atol=1e-7)
    for key, value in ref.state().items():
        if key.startswith("master/"):
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-6, msg=key)


def test_tied_uneven_shards_and_padding(world):
    """Vocabulary 127 split 64/63, a tied head, 3 micro-batches on 2 ranks, then 1."""
    ref = Reference(TIED)
    ref.step(0, microbatches(0, 3, 127))
    ref.step(1, microbatches(1, 3, 127))
    ref.step(2, microbatches(2, 1, 127))
    got = world[0]["tied"]
    assert_losses(got["losses"], ref.losses)
    assert_losses(got["norms"], ref.norms)
    assert_states(got["state"], ref.state(), weights_atol=1e-6, state_atol=1e-7)
    assert "lm_head.weight" not in got["state"]
    assert world[0]["tied_numel"] == count_parameters(TIED) - world[1]["tied_numel"]
    # micro-batch j runs on rank j % 2, its hooks in order, padding passes without hooks
    assert world[0]["events"] == [(k, j) for j in (0, 2, 0, 2) for k in ("forward", "backward")]
    assert world[1]["events"] == [(k, 1) for _ in range(2) for k in ("forward", "backward")]


def test_full_state_round_trips_through_engine_and_stage(world):
    state = world[0]["fp32"]["state"]
    reloaded = world[0]["reloaded"]
    assert sorted(reloaded) == sorted(state)
    for key, value in state.items():
        assert torch.equal(reloaded[key], value), key
    # Both engines then take the same step: the optimizer state came along.
    cont = world[0]["continued"]
    assert cont["main"] == cont["fresh"] and cont["digests"][0] == cont["digests"][1]

    # Into a tp=1 stage with its MasterOptimizer, and out again: identical tensors.
    stage = LlamaStage(CFG)
    named = list(stage.named_parameters())
    grads = GradBuffer(named, torch.device("cpu"))
    opt = MasterOptimizer(named, grads, OPT)
    load_stage_full_state(stage, state, opt, step=3)
    back = stage_full_state(stage, opt)
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    assert opt.step_count() == 3
    # ... and its next step is the engine's next step.
    ref_losses = []
    for mb in microbatches(3):
        loss = stage.loss(stage(mb[:, :-1]), mb[:, 1:])
        ref_losses.append(loss.item())
        (loss / B).backward()
    clip_grad_norm_(grads, stage.specs, OPT.clip_grad, 0, None)
    opt.step(LRS[3])
    assert_losses(cont["main"], ref_losses)
    assert_states(
        world[0]["continued_state"], stage_full_state(stage, opt), weights_atol=1e-6, state_atol=1e-7
    )


def test_checkpoints_load_across_hsdp_and_3d(world):
    tmp = world["tmp"]
    # HSDP -> 3D: the engine's checkpoint is a tp=1, pp=1 layout the reader reshards anywhere.
    reader = CheckpointReader(tmp / "hsdp_ck")
    reader.verify()
    assert reader.step == 3 and reader.meta["layout"]["tp"] == 1
    stage = LlamaStage(CFG)
    reader.load_model(stage)
    state = world[0]["fp32"]["state"]
    for name, p in stage.named_parameters():
        assert torch.equal(p.detach(), state[name]), name
    opt_state = reader.load_optimizer_state(stage)
    for name, entry in opt_state.items():
        for key, value in entry.items():
            assert torch.equal(value, state[f"{key}/{name}"]), (key, name)
    # 3D -> HSDP: the engine loaded the reference's checkpoint bitwise.
    ref = CheckpointReader(tmp / "ref_ck")
    got = world[0]["from_3d"]
    for name in ref.meta["tensors"]:
        assert torch.equal(got[name], ref.full(name)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{key}/{name}"], ref.full(name, "optimizer", key)), (key, name)


def test_two_replicas_summed_equal_one_engine_over_all_microbatches(world):
    for rank in range(SHARD):
        rep = world[rank]["replicas"]
        assert rep["losses"][0] == rep["losses"][1]
        summed, whole = rep["grads"]
        torch.testing.assert_close(summed, whole, rtol=1e-5, atol=1e-8)
        n1, n2, nw = rep["norms"]
        assert n1 == n2 and n1 == pytest.approx(nw, rel=1e-5)
        d1, d2, _ = rep["digests"]
        assert d1 == d2  # replicas with the same summed gradient stay bitwise identical
        mine, theirs = rep["states"]
        assert_states(mine, theirs, weights_atol=1e-6, state_atol=0)
        # restored from its snapshot, a buffer keeps accumulating: the recovery pattern
        torch.testing.assert_close(world[rank]["recovered"], whole, rtol=1e-5, atol=1e-8)


def test_load_full_state_rejects_missing_or_misshapen_tensors(world):
    assert world[0]["load_errors"] == world[1]["load_errors"] == ["KeyError", "ValueError"]


def test_stage_full_state_for_bf16_and_pipeline_stages(world):
    # bf16: weights, masters and moments into a bf16 stage with its MasterOptimizer, and back.
    state = world[0]["bf16"]["state"]
    stage = LlamaStage(CFG, dtype=torch.bfloat16)
    named = list(stage.named_parameters())
    opt = MasterOptimizer(named, GradBuffer(named, torch.device("cpu")), OPT)
    load_stage_full_state(stage, state, opt, step=3)
    back = stage_full_state(stage, opt)
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    # Weights only (no masters): the masters start from the loaded weights, as after a fresh load.
    weights = {k: v for k, v in state.items() if "/" not in k}
    stage2 = LlamaStage(CFG, dtype=torch.bfloat16)
    named2 = list(stage2.named_parameters())
    opt2 = MasterOptimizer(named2, GradBuffer(named2, torch.device("cpu")), OPT)
    load_stage_full_state(stage2, weights, opt2)
    for name, p in stage2.named_parameters():
        assert torch.equal(opt2.master[name], p.float()), name
    # pp=2 with tied embeddings: the last stage's head is a copy of the embedding.
    tied = world[0]["tied"]["state"]
    first, last = (LlamaStage(TIED, pp=2, pp_rank=r) for r in range(2))
    load_stage_full_state(first, tied)
    load_stage_full_state(last, tied)
    assert torch.equal(last.lm_head.weight, tied["model.embed_tokens.weight"])
    assert torch.equal(first.model.embed_tokens.weight, tied["model.embed_tokens.weight"])


def test_memory_estimate():
    p = count_parameters(CFG)
    one = hsdp_memory_per_rank(CFG, 1)
    assert one.parameters == one.shard_parameters == p
    assert one.param_bytes == one.grad_bytes == one.snapshot_bytes == 4 * p and one.optimizer_bytes == 8 * p
    two = hsdp_memory_per_rank(CFG, 2, "bfloat16", recover=False)
    assert two.shard_parameters * 2 == p  # every dim 0 of this model is even
    assert two.persistent_bytes == 16 * p // 2 and two.snapshot_bytes == 0
    # unsharded compute weights in bf16: root unit (embedding, head, norm) plus two layers (all of them)
    assert two.unsharded_bytes == 2 * p
    accumulate = hsdp_memory_per_rank(CFG, 2, torch.bfloat16, reduce_every_microbatch=False)
    assert accumulate.accumulation_bytes == (2 + 4) * p
    # uneven: rank 0 holds ceil(rows / shard) of every tensor, the largest share
    tied = hsdp_memory_per_rank(TIED, 2)
    assert tied.parameters == count_parameters(TIED)
    embedding = 127 * TIED.hidden_size
    assert tied.shard_parameters == 64 * TIED.hidden_size + (tied.parameters - embedding) // 2
    shares = [hsdp_memory_per_rank(CFG, s).persistent_bytes for s in (1, 2, 4, 8)]
    assert shares == [20 * p // s for s in (1, 2, 4, 8)]
    with pytest.raises(ValueError):
        hsdp_memory_per_rank(CFG, 0)


def test_memory_estimate_matches_engine_shards(world):
    assert world[0]["grads_numel"] == hsdp_memory_per_rank(CFG, SHARD).shard_parameters
    assert world[0]["tied_numel"] == hsdp_memory_per_rank(TIED, SHARD).shard_parameters


# -- live state transfer: HSDPModelEngine.export_state / import_state ---------------------------------


def through_bytes(state: EngineState) -> EngineState:
    """The state as a receiver rebuilds it from what crosses MPI: the layout and meta pickled, then
    every tensor's raw bytes (``tensor.view(torch.uint8)``) copied into ``empty_like`` buffers."""
    layout, meta = pickle.loads(pickle.dumps((state.layout(), state.meta)))
    got = EngineState.empty_like(layout, meta)
    sent = 0
    for name, t in state.tensors.items():
        if t.numel() == 0:
            continue  # nothing to send (state_transfer skips them too)
        wire = t.view(torch.uint8).reshape(-1).numpy().tobytes()
        sent += len(wire)
        got.tensors[name].view(torch.uint8).reshape(-1).copy_(
            torch.frombuffer(bytearray(wire), dtype=torch.uint8)
        )
    assert sent == state.nbytes() == got.nbytes()
    return got


def _bitwise(a: EngineState, b: EngineState) -> bool:
    return (
        a.layout() == b.layout()
        and a.meta == b.meta
        and all(
            torch.equal(a.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in b.tensors.items()
        )
    )


def _model_engine(rank: int, mcfg: LlamaConfig, dtype: str, seed: int) -> HSDPModelEngine:
    cfg = Config(
        model=ModelArgs(model_config=mcfg, dtype=dtype),
        parallelism=ParallelismArgs(dp_shard=SHARD),
        optimizer=OPT,
        general=GeneralArgs(seed=seed),
    )
    world = World(rank=rank, size=SHARD, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    return HSDPModelEngine(cfg, world, _TRANSFER_CTX[0])


_TRANSFER_CTX: list[ParallelContext] = []  # the shard ranks' context, made once per world


def _model_step(engine: HSDPModelEngine, k: int, vocab: int) -> tuple[list[float], float]:
    return engine.train_batch(microbatches(k, 3, vocab), 1.0 / 3), engine.optimizer_step(LRS[k])


def _transfer_worker(rank: int, world_size: int) -> dict:
    _TRANSFER_CTX[:] = [ParallelContext.create(world_size, 1, 1, torch.device("cpu"))]  # shard group
    out: dict = {}
    for name, mcfg, dtype, receiver in (
        ("fp32", CFG, "float32", "fresh"),
        ("bf16_tied", TIED, "bfloat16", "trained"),
    ):
        donor = _model_engine(rank, mcfg, dtype, SEED)
        joiner = _model_engine(rank, mcfg, dtype, SEED + 1)  # another init
        for k in range(2):
            _model_step(donor, k, mcfg.vocab_size)
        if receiver == "trained":
            # Optimizer state of its own (overwritten in place) and a gradient left in the buffer.
            _model_step(joiner, 3, mcfg.vocab_size)
            joiner.train_batch(microbatches(4, 2, mcfg.vocab_size), 1.0)
        before = {"digest": joiner.parameter_digest(), "grad": bool(joiner.grads_flat.any())}
        storage = {n: m.data_ptr() for n, m in joiner.engine.masters.items()}
        flat = joiner.grads_flat.data_ptr()
        state = donor.export_state()
        # The other shard rank's state: the same names, refused.
        states: list = [None] * world_size
        dist.all_gather_object(states, state)
        try:
            joiner.import_state(states[1 - rank])
            refused = False
        except ValueError:
            refused = True
        joiner.import_state(through_bytes(state))
        imported = joiner.export_state()
        after = {
            "grad_zero": not joiner.grads_flat.any(),
            "in_place": storage == {n: m.data_ptr() for n, m in joiner.engine.masters.items()}
            and joiner.grads_flat.data_ptr() == flat
            and joiner.grads_flat is joiner.engine.grads_flat,
            "steps": (donor.engine.step_count(), joiner.engine.step_count()),
        }
        runs: dict = {"donor": [], "joiner": []}
        for k in range(2, 4):
            for who, engine in (("donor", donor), ("joiner", joiner)):
                runs[who].append(_model_step(engine, k, mcfg.vocab_size))
        out[name] = {
            "before": before,
            "after": after,
            "refused": refused,
            "imported_equal": _bitwise(imported, state),
            "continued_equal": _bitwise(joiner.export_state(), donor.export_state()),
            "layout": state.layout(),
            "meta": {k: v for k, v in state.meta.items() if k != "rng"},
            "runs": runs,
            "digests": (donor.parameter_digest(), joiner.parameter_digest()),
            "full": (donor.engine.full_state(), joiner.engine.full_state()),
        }
    return out


@pytest.fixture(scope="module")
def transfer(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(_transfer_worker, SHARD, tmp_path_factory.mktemp("transfer"), timeout_s=120)


@pytest.mark.parametrize("case", ["fp32", "bf16_tied"])
def test_import_state_continues_bitwise(transfer, case):
    for rank in range(SHARD):
        got = transfer[rank][case]
        assert got["before"]["digest"] != got["digests"][0], "the joiner must start from another model"
        assert got["refused"], "the other shard rank's state was accepted"
        assert got["imported_equal"]
        assert got["after"]["in_place"] and got["after"]["grad_zero"]
        assert got["after"]["steps"] == (2, 2)
        assert got["runs"]["donor"] == got["runs"]["joiner"]
        assert got["digests"][0] == got["digests"][1]
        assert got["continued_equal"]
        donor, joiner = got["full"]
        assert sorted(donor) == sorted(joiner)
        for key, value in donor.items():
            assert torch.equal(joiner[key], value), key
    assert transfer[0]["bf16_tied"]["before"]["grad"], "the trained joiner had a gradient to drop"


def test_export_state_holds_local_shards(transfer):
    """``param/<name>`` is this rank's fp32 shard (the master), the moments beside it; no gathering."""
    for case, mcfg in (("fp32", CFG), ("bf16_tied", TIED)):
        specs = LlamaStage(mcfg, device="meta").specs
        for rank in range(SHARD):
            layout = transfer[rank][case]["layout"]
            assert {n.split("/", 1)[0] for n, _, _ in layout} == {"param", "exp_avg", "exp_avg_sq"}
            for name, shape, dtype in layout:
                full = specs[name.split("/", 1)[1]].full_shape
                start, stop = dim0_block(full[0], SHARD, rank)
                assert shape == (stop - start, *full[1:]) and dtype == "float32", name
            meta = transfer[rank][case]["meta"]
            assert meta["engine"] == "hsdp" and meta["coordinate"] == f"pp0_tp{rank}"
            assert set(meta["optimizer"]["steps"].values()) == {2.0}
    # Uneven shards: a vocabulary of 127 rows is 64 + 63.
    rows = [dict((n, s) for n, s, _ in transfer[r]["bf16_tied"]["layout"]) for r in range(SHARD)]
    assert rows[0]["param/model.embed_tokens.weight"][0] == 64
    assert rows[1]["param/model.embed_tokens.weight"][0] == 63
