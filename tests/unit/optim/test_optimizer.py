"""nanotron_recover.optim: MasterOptimizer (AdamW on fp32 masters) and clip_grad_norm_."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from nanotron_recover.config import LRSchedulerArgs, OptimizerArgs
from nanotron_recover.config.schema import OptimizerFactory
from nanotron_recover.optim import GradBuffer, MasterOptimizer, clip_grad_norm_
from nanotron_recover.parallel.sharding import ParamSpec

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
LRS = [1e-2, 3e-3, 5e-4, 2e-3]


def optimizer_args() -> OptimizerArgs:
    return OptimizerArgs(
        optimizer_factory=OptimizerFactory(adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS),
        learning_rate_scheduler=LRSchedulerArgs(learning_rate=LRS[0]),
        weight_decay=WD,
    )


def tiny_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3, bias=False), nn.LayerNorm(3)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)


def backward(model: nn.Module, step: int, dtype: torch.dtype = torch.float32) -> None:
    x, y = batch(step, dtype)
    ((model(x) - y).float().pow(2).mean()).backward()


class Trained:
    """A model, its gradient buffer and its MasterOptimizer."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.named = list(model.named_parameters())
        self.grads = GradBuffer(self.named, torch.device("cpu"))
        self.opt = MasterOptimizer(self.named, self.grads, optimizer_args())

    def step(self, step: int, dtype: torch.dtype = torch.float32) -> None:
        backward(self.model, step, dtype)
        self.opt.step(LRS[step])
        self.grads.zero_()


# -- AdamW equivalence -------------------------------------------------------------------------------
def test_fp32_step_matches_torch_adamw_bitwise():
    ours = Trained(tiny_net())
    ref_model = copy.deepcopy(ours.model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD)
    before = {n: p.detach().clone() for n, p in ours.named}

    for step in range(3):
        ours.step(step)
        backward(ref_model, step)
        for group in ref_opt.param_groups:
            group["lr"] = LRS[step]
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for (name, p), ref in zip(ours.named, ref_model.parameters(), strict=True):
            assert torch.equal(p, ref), (step, name)
            assert p.grad is None

    assert all(not torch.equal(p, before[n]) for n, p in ours.named)
    assert ours.opt.step_count() == 3
    # fp32 parameters are their own masters: updated in place, no copy.
    assert all(ours.opt.master[n] is p for n, p in ours.named)


def test_bf16_model_keeps_fp32_masters_and_rounds_them_into_the_model():
    ours = Trained(tiny_net(torch.bfloat16))
    # The masters must follow AdamW exactly as an fp32 model started from the bf16 values would.
    ref = {n: p.detach().float().clone().requires_grad_() for n, p in ours.named}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD)

    for step in range(3):
        backward(ours.model, step, torch.bfloat16)
        for n in ref:
            ref[n].grad = ours.grads.views[n].clone()
        ours.opt.step(LRS[step])
        ours.grads.zero_()
        for group in ref_opt.param_groups:
            group["lr"] = LRS[step]
        ref_opt.step()

        for name, p in ours.named:
            master = ours.opt.master[name]
            assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
            assert master is not p
            assert torch.equal(master, ref[name]), (step, name)
            assert torch.equal(p, master.to(torch.bfloat16)), (step, name)

    # The master holds bits the bf16 model cannot: otherwise small updates would be lost.
    assert any(not torch.equal(ours.opt.master[n], p.float()) for n, p in ours.named)


# -- state round trip -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_round_trip_gives_identical_next_steps(dtype: torch.dtype):
    a = Trained(tiny_net(dtype))
    for step in range(2):
        a.step(step, dtype)
    saved = {n: {k: v.clone() for k, v in entry.items()} for n, entry in a.opt.state_tensors().items()}
    count = a.opt.step_count()
    assert count == 2

    b = Trained(copy.deepcopy(a.model))
    b.opt.load_state_tensors(saved, count)
    assert b.opt.step_count() == 2

    for step in (2, 3):
        a.step(step, dtype)
        b.step(step, dtype)
        for (name, pa), (_, pb) in zip(a.named, b.named, strict=True):
            assert torch.equal(pa, pb), (step, name)
            assert torch.equal(a.opt.master[name], b.opt.master[name]), (step, name)
    for name, entry in a.opt.state_tensors().items():
        other = b.opt.state_tensors()[name]
        assert entry.keys() == other.keys()
        assert all(torch.equal(entry[k], other[k]) for k in entry), name


def test_state_round_trip_without_the_step_count_would_differ():
    # The bias correction depends on the step: loading the moments at another step must not match.
    a = Trained(tiny_net())
    for step in range(2):
        a.step(step)
    saved = {n: {k: v.clone() for k, v in entry.items()} for n, entry in a.opt.state_tensors().items()}
    b = Trained(copy.deepcopy(a.model))
    b.opt.load_state_tensors(saved, 5)
    a.step(2)
    b.step(2)
    assert any(not torch.equal(pa, pb) for (_, pa), (_, pb) in zip(a.named, b.named, strict=True))


def test_state_tensors_contents():
    fp32, bf16 = Trained(tiny_net()), Trained(tiny_net(torch.bfloat16))
    assert all(entry == {} for entry in fp32.opt.state_tensors().values())
    assert all(set(entry) == {"master"} for entry in bf16.opt.state_tensors().values())
    assert fp32.opt.step_count() == 0

    fp32.step(0)
    bf16.step(0, torch.bfloat16)
    for name, p in fp32.named:
        entry = fp32.opt.state_tensors()[name]
        assert set(entry) == {"exp_avg", "exp_avg_sq"}
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg"].dtype == torch.float32
    for name, p in bf16.named:
        entry = bf16.opt.state_tensors()[name]
        assert set(entry) == {"exp_avg", "exp_avg_sq", "master"}
        assert entry["master"].dtype == torch.float32 and entry["master"].shape == p.shape
        assert entry["exp_avg_sq"].dtype == torch.float32


# -- gradient clipping ---------------------------------------------------------------------------------
def buffer_with(values: dict[str, list[float]]) -> GradBuffer:
    named = [(n, nn.Parameter(torch.zeros(len(v)))) for n, v in values.items()]
    buf = GradBuffer(named, torch.device("cpu"))
    for n, v in values.items():
        buf.views[n].copy_(torch.tensor(v))
    return buf


def specs_for(values: dict[str, list[float]], replicated=(), tied=()) -> dict[str, ParamSpec]:
    return {
        n: ParamSpec(
            full_shape=(len(v),),
            shard_dim=None if n in replicated else 0,
            canonical_name=n,
            tp_replicated=n in replicated,
            is_tied_copy=n in tied,
        )
        for n, v in values.items()
    }


VALUES = {"w": [3.0, 4.0], "norm": [12.0], "head": [0.0, 84.0]}  # squares: 25, 144, 7056


def test_clip_scales_the_buffer_down_to_max_norm():
    buf = buffer_with({"w": [3.0, 4.0], "b": [12.0]})
    before = buf.flat.clone()
    norm = clip_grad_norm_(buf, specs_for({"w": [0, 0], "b": [0]}), 1.0, tp_rank=0, mp_group=None)
    assert norm == 13.0
    assert buf.flat.norm().item() == pytest.approx(1.0, rel=1e-6)
    assert torch.allclose(buf.flat, before / 13.0, rtol=1e-6)
    assert torch.equal(buf.views["w"], buf.flat[:2])


@pytest.mark.parametrize("max_norm", [13.0, 13.5, 1e6, None, 0.0])
def test_clip_leaves_the_buffer_alone_at_or_below_max_norm(max_norm: float | None):
    buf = buffer_with({"w": [3.0, 4.0], "b": [12.0]})
    before = buf.flat.clone()
    norm = clip_grad_norm_(buf, specs_for({"w": [0, 0], "b": [0]}), max_norm, tp_rank=0, mp_group=None)
    assert norm == 13.0
    assert torch.equal(buf.flat, before)


def test_clip_of_a_real_model_gradient_matches_torch():
    model = tiny_net()
    reference = copy.deepcopy(model)
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))
    backward(model, 0)
    backward(reference, 0)
    specs = {n: ParamSpec(tuple(p.shape), None, n) for n, p in model.named_parameters()}
    max_norm = 0.25 * buf.flat.norm().item()

    norm = clip_grad_norm_(buf, specs, max_norm, tp_rank=0, mp_group=None)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)

    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    assert buf.flat.norm().item() == pytest.approx(max_norm, rel=1e-5)
    for name, p in reference.named_parameters():
        assert torch.allclose(buf.views[name], p.grad, rtol=1e-6, atol=1e-9), name


def test_tp_replicated_parameters_count_only_on_tp_rank_0():
    specs = specs_for(VALUES, replicated={"norm"})
    assert clip_grad_norm_(buffer_with(VALUES), specs, None, tp_rank=0, mp_group=None) == math.sqrt(
        25 + 144 + 7056
    )
    assert clip_grad_norm_(buffer_with(VALUES), specs, None, tp_rank=1, mp_group=None) == math.sqrt(25 + 7056)
    assert clip_grad_norm_(buffer_with(VALUES), specs, None, tp_rank=3, mp_group=None) == math.sqrt(25 + 7056)


def test_tied_copy_never_counts():
    specs = specs_for(VALUES, replicated={"norm"}, tied={"head"})
    assert clip_grad_norm_(buffer_with(VALUES), specs, None, tp_rank=0, mp_group=None) == 13.0
    assert clip_grad_norm_(buffer_with(VALUES), specs, None, tp_rank=1, mp_group=None) == 5.0


def test_skipped_parameters_are_still_clipped():
    buf = buffer_with(VALUES)
    norm = clip_grad_norm_(buf, specs_for(VALUES, replicated={"norm"}), 1.0, tp_rank=1, mp_group=None)
    assert norm == math.sqrt(25 + 7056)
    scale = 1.0 / norm
    assert buf.views["norm"].item() == pytest.approx(12.0 * scale, rel=1e-6)
    assert buf.views["head"].tolist() == pytest.approx([0.0, 84.0 * scale], rel=1e-6)
