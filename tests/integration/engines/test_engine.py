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

Last, the 3D engine's live state transfer (``ThreeDEngine.export_state``/``import_state``, what a
re-joining replica's rank receives from the rank at its coordinate of a healthy replica): a donor
trains, a freshly built engine (other seed) imports the donor's state after it went through raw
bytes, as over MPI, and both then take the same steps: losses, gradient norms, every parameter and
the parameter digest must be equal with ``==``. At tp=1, pp=1 in this process (fp32 and bf16,
fresh and already-trained receivers, a donor before its first step), and at tp=2 and at pp=2 with
tied embeddings in a two-rank gloo world.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nanotron_recover.config import (
    Config,
    GeneralArgs,
    LlamaConfig,
    LRSchedulerArgs,
    ModelArgs,
    OptimizerArgs,
    ParallelismArgs,
    TokensArgs,
)
from nanotron_recover.engines.state import EngineState, dtype_from_name, dtype_name
from nanotron_recover.engines.three_d import ThreeDEngine
from nanotron_recover.models.llama import LlamaStage
from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.pipeline_parallel import build_engine
from nanotron_recover.parallel.world import World
from tests.helpers.gloo_world import run_world

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


# -- live state transfer: ThreeDEngine.export_state / import_state -------------------------------------

STATE_OPT = OptimizerArgs(
    learning_rate_scheduler=LRSchedulerArgs(learning_rate=3e-3),
    weight_decay=0.1,
    clip_grad=0.5,  # below these steps' gradient norms: the clipping scale is part of what must match
)
STATE_LRS = [3e-3, 2e-3, 1e-3, 1e-3, 5e-4]
STATE_M = 3  # micro-batches per step
CPU_WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _state_config(seed: int, dtype: str = "float32", tp: int = 1, pp: int = 1, tie: bool = False) -> Config:
    return Config(
        model=ModelArgs(model_config=_config(tie), dtype=dtype),
        parallelism=ParallelismArgs(tp=tp, pp=pp),
        tokens=TokensArgs(sequence_length=SEQ, micro_batch_size=MICRO_BATCH),
        optimizer=STATE_OPT,
        general=GeneralArgs(seed=seed),
    )


def _local_engine(seed: int, dtype: str = "float32") -> ThreeDEngine:
    """A tp=1, pp=1 engine in this process: no torch.distributed world needed."""
    return ThreeDEngine(_state_config(seed, dtype), CPU_WORLD, ParallelContext(1, 1, 1))


def _train_step(engine: ThreeDEngine, k: int) -> tuple[list[float], float]:
    losses = engine.train_batch(_microbatches(STATE_M, 10 + k), 1.0 / STATE_M)
    return losses, engine.optimizer_step(STATE_LRS[k])


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


def assert_states_equal(got: EngineState, want: EngineState) -> None:
    """Bitwise: same names, order, shapes, dtypes and bytes, and the same meta."""
    assert got.layout() == want.layout()
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    assert got.meta == want.meta


def _params(engine: ThreeDEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.stage.named_parameters()}


def _continue_both(a: ThreeDEngine, b: ThreeDEngine, steps: range) -> None:
    """The donor and the receiver take the same steps; everything must be equal with ``==``."""
    for k in steps:
        losses_a, norm_a = _train_step(a, k)
        losses_b, norm_b = _train_step(b, k)
        assert losses_a == losses_b, f"step {k}"
        assert norm_a == norm_b, f"step {k}"
    pa, pb = _params(a), _params(b)
    for name, value in pa.items():
        assert torch.equal(pb[name], value), name
    assert a.parameter_digest() == b.parameter_digest()
    assert_states_equal(b.export_state(), a.export_state())


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        dtype_from_name("Tensor")  # a torch attribute, but no dtype: never looked up
    with pytest.raises(ValueError):
        dtype_name(torch.complex64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_d_state_layout_round_trips_through_empty_like(dtype: str) -> None:
    engine = _local_engine(SEED, dtype)
    _train_step(engine, 0)
    state = engine.export_state()
    names = [n for n, _ in engine.stage.named_parameters()]
    kinds = ["param", "exp_avg", "exp_avg_sq"] + (["master"] if dtype == "bfloat16" else [])
    assert sorted(state.tensors) == sorted(f"{k}/{n}" for k in kinds for n in names)
    for name, t in state.tensors.items():
        assert t.device.type == "cpu" and t.is_contiguous(), name
        assert t.dtype == (getattr(torch, dtype) if name.startswith("param/") else torch.float32), name
    assert state.meta["engine"] == "3d" and state.meta["coordinate"] == "pp0_tp0"
    assert state.meta["optimizer"]["steps"] == dict.fromkeys(names, 1.0)
    assert isinstance(state.meta["rng"]["cpu"], bytes)
    # A layout that went through pickle or JSON (shapes as lists) allocates the same buffers.
    for layout in (state.layout(), [[n, list(s), d] for n, s, d in state.layout()]):
        empty = EngineState.empty_like(layout, state.meta)
        assert empty.layout() == state.layout() and empty.nbytes() == state.nbytes()
        assert all(t.is_contiguous() for t in empty.tensors.values())
    assert_states_equal(through_bytes(state), state)


@pytest.mark.parametrize("receiver", ["fresh", "trained"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_d_import_continues_bitwise(dtype: str, receiver: str) -> None:
    donor = _local_engine(SEED, dtype)
    for k in range(2):
        _train_step(donor, k)
    joiner = _local_engine(SEED + 1, dtype)  # another init
    if receiver == "trained":
        # Optimizer state of its own (overwritten in place) and a gradient left in the buffer.
        _train_step(joiner, 4)
        joiner.train_batch(_microbatches(1, 20), 1.0)
        assert joiner.grads.flat.abs().sum() > 0
    assert joiner.parameter_digest() != donor.parameter_digest()
    params = {n: (id(p), p.data_ptr()) for n, p in joiner.stage.named_parameters()}
    masters = {n: (id(m), m.data_ptr()) for n, m in joiner.optimizer.master.items()}
    moments = {id(t) for st in joiner.optimizer.torch_opt.state.values() for t in st.values()}
    flat = joiner.grads.flat.data_ptr()

    joiner.import_state(through_bytes(donor.export_state()))

    # In place: the gradient buffer's hooks and the optimizer's references still hold.
    assert {n: (id(p), p.data_ptr()) for n, p in joiner.stage.named_parameters()} == params
    assert {n: (id(m), m.data_ptr()) for n, m in joiner.optimizer.master.items()} == masters
    now = {id(t) for st in joiner.optimizer.torch_opt.state.values() for t in st.values()}
    assert now == moments or receiver == "fresh"
    assert joiner.grads.flat.data_ptr() == flat and not joiner.grads.flat.any()
    assert joiner.optimizer.step_count() == donor.optimizer.step_count() == 2
    assert_states_equal(joiner.export_state(), donor.export_state())
    _continue_both(donor, joiner, range(2, 4))


def test_three_d_import_of_a_state_before_the_first_step() -> None:
    """A donor without AdamW state yet: zero moments travel, and the receiver drops its own state,
    so that AdamW initialises it on the next step exactly as on the donor."""
    donor, joiner = _local_engine(SEED), _local_engine(SEED + 1)
    _train_step(joiner, 4)
    state = donor.export_state()
    assert set(state.meta["optimizer"]["steps"].values()) == {None}
    joiner.import_state(through_bytes(state))
    assert not joiner.optimizer.torch_opt.state
    _continue_both(donor, joiner, range(2))


def test_three_d_import_restores_the_rng_state() -> None:
    engine = _local_engine(SEED)
    state = engine.export_state()
    want = torch.rand(4)
    torch.manual_seed(1234)
    engine.import_state(through_bytes(state))
    assert torch.equal(torch.rand(4), want)


def test_three_d_export_is_a_copy() -> None:
    engine = _local_engine(SEED)
    _train_step(engine, 0)
    state = engine.export_state()
    kept = {n: t.clone() for n, t in state.tensors.items()}
    _train_step(engine, 1)  # the donor goes on training: the exported state must not move
    for name, t in kept.items():
        assert torch.equal(state.tensors[name], t), name
    assert not torch.equal(state.tensors["param/lm_head.weight"], engine.stage.lm_head.weight.detach())


def test_three_d_import_refuses_another_coordinate_or_layout() -> None:
    donor, joiner = _local_engine(SEED), _local_engine(SEED + 1)
    _train_step(donor, 0)
    before = joiner.export_state()
    good = donor.export_state()
    other_coordinate = EngineState(dict(good.tensors), {**good.meta, "coordinate": "pp0_tp1"})
    missing = EngineState(dict(list(good.tensors.items())[1:]), good.meta)
    misshapen = EngineState({**good.tensors, "param/model.norm.weight": torch.ones(3)}, good.meta)
    bf16 = _local_engine(SEED, "bfloat16").export_state()
    for bad in (other_coordinate, missing, misshapen, bf16):
        with pytest.raises(ValueError):
            joiner.import_state(bad)
    # Nothing changed (checked before the first copy), RNG state included.
    after = joiner.export_state()
    assert_states_equal(EngineState(after.tensors, {**after.meta, "rng": before.meta["rng"]}), before)


def _transfer_worker(rank: int, world_size: int) -> dict[str, Any]:
    """tp=2 (pp=1), then pp=2 (tp=1) with a tied head copy on the last stage: a donor and a joiner
    engine side by side in one world, each rank importing the state of its own coordinate."""
    out: dict[str, Any] = {}
    world = World(rank=rank, size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    for name, tp, pp, tie, dtype in (("tp2", 2, 1, False, "bfloat16"), ("pp2", 1, 2, True, "float32")):
        ctx = ParallelContext.create(tp, pp, 1, torch.device("cpu"))
        donor = ThreeDEngine(_state_config(SEED, dtype, tp=tp, pp=pp, tie=tie), world, ctx)
        joiner = ThreeDEngine(_state_config(SEED + 1, dtype, tp=tp, pp=pp, tie=tie), world, ctx)
        for k in range(2):
            _train_step(donor, k)
        state = donor.export_state()
        # The other coordinate's state: the same names (and at tp=2 the same shapes), refused.
        states: list[Any] = [None] * world_size
        dist.all_gather_object(states, state)
        try:
            joiner.import_state(states[1 - rank])
            refused = False
        except ValueError:
            refused = True
        joiner.import_state(through_bytes(state))
        imported = joiner.export_state()
        runs = {"donor": [], "joiner": []}
        for k in range(2, 4):
            for who, engine in (("donor", donor), ("joiner", joiner)):
                runs[who].append(_train_step(engine, k))
        out[name] = {
            "refused": refused,
            "same_layout_as_other_rank": states[0].layout() == states[1].layout(),
            "imported_equal": _states_bitwise_equal(imported, state),
            "runs": runs,
            "digests": (donor.parameter_digest(), joiner.parameter_digest()),
            "params": (_params(donor), _params(joiner)),
            "names": sorted(state.tensors),
        }
        donor.close()
        joiner.close()
    return out


def _states_bitwise_equal(a: EngineState, b: EngineState) -> bool:
    try:
        assert_states_equal(a, b)
    except AssertionError:
        return False
    return True


def test_three_d_import_continues_bitwise_at_tp2_and_pp2(tmp_path: Path) -> None:
    ranks = run_world(_transfer_worker, 2, tmp_path, timeout_s=60)
    for rank, out in enumerate(ranks):
        for name, got in out.items():
            where = f"{name}, rank {rank}"
            assert got["refused"], f"{where}: the other coordinate's state was accepted"
            assert got["imported_equal"], where
            assert got["runs"]["donor"] == got["runs"]["joiner"], where
            assert got["digests"][0] == got["digests"][1], where
            donor, joiner = got["params"]
            for param, value in donor.items():
                assert torch.equal(joiner[param], value), f"{where}: {param}"
    assert ranks[0]["tp2"]["same_layout_as_other_rank"], (
        "tp shards have one shape: only meta tells them apart"
    )
    assert any(n.startswith("master/") for n in ranks[0]["tp2"]["names"])  # bf16
    # The last stage's tied head copy travels with its stage.
    assert "param/lm_head.weight" in ranks[1]["pp2"]["names"]
    assert "param/lm_head.weight" not in ranks[0]["pp2"]["names"]
