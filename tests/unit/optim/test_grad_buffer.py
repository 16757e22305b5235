"""nanotron_recover.optim.GradBuffer: fp32 accumulation of every backward into one flat buffer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nanotron_recover.config import LlamaConfig
from nanotron_recover.models.llama import LlamaStage
from nanotron_recover.optim import GradBuffer


def tiny_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2, bias=False), nn.LayerNorm(2)).to(dtype)


def batches(n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)) for _ in range(n)
    ]


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    ((model(x) - y).float().pow(2).mean()).backward()


def per_batch_grads(model: nn.Module, data) -> list[dict[str, torch.Tensor]]:
    """Each batch's gradients, computed without any hook."""
    out = []
    for x, y in data:
        model.zero_grad(set_to_none=True)
        backward(model, x, y)
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return out


def test_two_backwards_accumulate_the_sum_of_both_gradients():
    model = tiny_net()
    reference = copy.deepcopy(model)
    data = batches(2)
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))

    for x, y in data:
        backward(model, x, y)
    for x, y in data:  # plain autograd accumulation into .grad
        backward(reference, x, y)

    for name, p in reference.named_parameters():
        assert torch.equal(buf.views[name], p.grad), name
    assert buf.flat.abs().sum() > 0


def test_param_grad_stays_none():
    model = tiny_net()
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))
    for x, y in batches(2):
        backward(model, x, y)
        assert all(p.grad is None for p in model.parameters())
    assert buf.flat.count_nonzero() > 0


def test_views_are_disjoint_and_cover_the_buffer_in_parameter_order():
    model = tiny_net()
    named = list(model.named_parameters())
    buf = GradBuffer(named, torch.device("cpu"))

    assert buf.names == [n for n, _ in named] == ["0.weight", "0.bias", "2.weight", "3.weight", "3.bias"]
    assert buf.flat.dtype == torch.float32
    assert buf.flat.numel() == sum(p.numel() for _, p in named) == 15 + 5 + 10 + 2 + 2
    expected_start = 0
    for name, p in named:
        start, end = buf.offsets[name]
        assert start == expected_start and end == start + p.numel()
        view = buf.views[name]
        assert view.shape == p.shape and view.dtype == torch.float32
        assert view.data_ptr() == buf.flat.data_ptr() + start * buf.flat.element_size()
        expected_start = end
    assert expected_start == buf.flat.numel()

    # Writing through every view touches every element exactly once.
    for i, name in enumerate(buf.names):
        buf.views[name].add_(i + 1)
    counts = torch.cat([torch.full((p.numel(),), float(i + 1)) for i, (_, p) in enumerate(named)])
    assert torch.equal(buf.flat, counts)


def test_bf16_parameters_accumulate_in_fp32():
    model = tiny_net(torch.bfloat16)
    reference = copy.deepcopy(model)
    data = batches(3, torch.bfloat16)
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))

    for x, y in data:
        backward(model, x, y)
    grads = per_batch_grads(reference, data)

    for name, p in model.named_parameters():
        assert p.grad is None
        assert all(g[name].dtype == torch.bfloat16 for g in grads)
        fp32_sum = grads[0][name].float() + grads[1][name].float() + grads[2][name].float()
        assert torch.equal(buf.views[name], fp32_sum), name


def test_bf16_accumulation_keeps_bits_that_bf16_would_round_away():
    w = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    buf = GradBuffer([("w", w)], torch.device("cpu"))
    (w * 1.0).sum().backward()
    (w * 2.0**-9).sum().backward()  # 1 + 2**-9 is not a bf16 number: bf16 would round it to 1
    assert torch.tensor(1 + 2.0**-9, dtype=torch.bfloat16).item() == 1.0
    assert buf.flat.item() == 1 + 2.0**-9


def test_zero_resets_the_buffer_and_keeps_the_views():
    model = tiny_net()
    reference = copy.deepcopy(model)
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))
    first, second = batches(2)
    backward(model, *first)
    flat_ptr = buf.flat.data_ptr()

    buf.zero_()
    assert buf.flat.count_nonzero() == 0
    assert buf.flat.data_ptr() == flat_ptr

    backward(model, *second)
    expected = per_batch_grads(reference, [second])[0]
    for name, g in expected.items():
        assert torch.equal(buf.views[name], g), name


def test_remove_hooks_restores_plain_autograd():
    model = tiny_net()
    buf = GradBuffer(list(model.named_parameters()), torch.device("cpu"))
    buf.remove_hooks()
    backward(model, *batches(1)[0])
    assert buf.flat.count_nonzero() == 0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_llama_stage_gradients_land_in_the_buffer(tied: bool):
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
    model = LlamaStage(cfg)
    model.init_weights(0.02, seed=3)
    reference = copy.deepcopy(model)
    named = list(model.named_parameters())
    buf = GradBuffer(named, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(2)]

    for m in (model, reference):
        for t in tokens:
            m.loss(m(t[:, :-1]), t[:, 1:]).backward()

    # A tied head shares the embedding's parameter: one view, gradient of both uses.
    assert len(buf.views) == len(named) == (len(list(reference.parameters())))
    assert ("lm_head.weight" in buf.views) is (not tied)
    for name, p in reference.named_parameters():
        assert torch.equal(buf.views[name], p.grad), name
    assert all(p.grad is None for _, p in named)


# -- exact mode (recover.exact): fixed-point int64 accumulation ----------------------------------
def exact_sum(order: list[int], data, bits: int = 40) -> GradBuffer:
    model = tiny_net()
    buf = GradBuffer(
        list(model.named_parameters()), torch.device("cpu"), fraction_bits=bits, max_terms=len(data)
    )
    for i in order:
        backward(model, *data[i])
    return buf


def test_exact_sum_does_not_depend_on_the_order_and_float_sums_do():
    data = batches(8)
    orders = [list(range(8)), list(reversed(range(8))), [3, 0, 7, 5, 1, 6, 2, 4]]
    fixed = [exact_sum(o, data).fixed for o in orders]
    assert fixed[0].dtype == torch.int64 and fixed[0].count_nonzero() > 0
    assert all(torch.equal(fixed[0], f) for f in fixed[1:])
    # The same gradients summed in fp32 in these orders differ in the last bits somewhere: what
    # exact mode exists to remove.
    grads = per_batch_grads(tiny_net(), data)
    name = "0.weight"
    float_sums = []
    for o in orders:
        acc = torch.zeros_like(grads[0][name])
        for i in o:
            acc += grads[i][name]
        float_sums.append(acc)
    assert any(not torch.equal(float_sums[0], s) for s in float_sums[1:])


def test_exact_sum_splits_like_a_reduction_across_replicas():
    """Two replicas' partial sums added as integers equal one replica summing everything."""
    data = batches(6)
    whole = exact_sum(list(range(6)), data).fixed
    a, b = exact_sum([0, 2, 4], data).fixed, exact_sum([5, 3, 1], data).fixed
    assert torch.equal(a + b, whole)


def test_materialize_is_within_the_rounding_bound_of_the_float_sum():
    data = batches(8)
    bits = 20  # coarse, so that the rounding is visible
    buf = exact_sum(list(range(8)), data, bits=bits)
    assert buf.flat.count_nonzero() == 0, "fp32 gradients appear only on materialize"
    buf.materialize()
    grads = per_batch_grads(tiny_net(), data)
    for name, view in buf.views.items():
        exact = sum(g[name].double() for g in grads)
        bound = len(data) * 2.0 ** -(bits + 1) + 1e-7 * exact.abs().max().item()  # + fp32 of the result
        assert (view.double() - exact).abs().max().item() <= bound, name
        assert view.dtype == torch.float32
    buf.zero_()
    assert buf.fixed.count_nonzero() == 0 and buf.flat.count_nonzero() == 0
    assert buf.reduced is buf.fixed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e9])
def test_exact_mode_refuses_what_it_cannot_sum(bad: float):
    w = nn.Parameter(torch.ones(2))
    GradBuffer([("w", w)], torch.device("cpu"), fraction_bits=40, max_terms=1024)
    with pytest.raises(ArithmeticError, match="recover.exact: a gradient element of w"):
        (w * torch.tensor([1.0, bad])).sum().backward()


def test_normal_mode_reduces_the_fp32_buffer():
    buf = GradBuffer(list(tiny_net().named_parameters()), torch.device("cpu"))
    assert buf.fixed is None and buf.reduced is buf.flat
