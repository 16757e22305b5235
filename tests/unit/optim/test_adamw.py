"""optim/adamw.py: torch's AdamW, bit for bit, without importing torch's compiler."""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.optim.adamw import AdamW
from tests.helpers.python_probe import probe_stdout


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 5, 7)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_steps_are_bitwise_torchs_adamw(weight_decay: float):
    ours, theirs = _params(0), _params(0)
    kwargs = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
    a, b = AdamW(ours, lr=1e-3, **kwargs), torch.optim.AdamW(theirs, lr=1e-3, **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(25):
        lr = 3e-3 * (step + 1) / 25  # the schedule sets each group's lr before every step
        for opt in (a, b):
            for group in opt.param_groups:
                group["lr"] = lr
        for p, q in zip(ours, theirs, strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key
            assert a.state[p][key].dtype == b.state[q][key].dtype
    # The same state dict as torch's: what checkpoints, snapshots and the state transfer see.
    mine, torchs = a.state_dict(), b.state_dict()
    assert mine["param_groups"] == torchs["param_groups"]
    restored = AdamW(_params(2), lr=1e-3, **kwargs)
    restored.load_state_dict(torchs)
    assert torch.equal(
        restored.state[restored.param_groups[0]["params"][0]]["exp_avg_sq"], b.state[theirs[0]]["exp_avg_sq"]
    )


def test_cases_it_does_not_write_out_are_torchs_own_step():
    """amsgrad (and foreach, fused, a tensor lr...) go through torch's step: still torch's numbers."""
    ours, theirs = _params(3), _params(3)
    a = AdamW(ours, lr=1e-2, amsgrad=True, foreach=False)
    b = torch.optim.AdamW(theirs, lr=1e-2, amsgrad=True, foreach=False)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.ones_like(p)
            q.grad = torch.ones_like(q)
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


def test_building_and_stepping_never_imports_torchs_compiler():
    """The reason for the class: ``torch._dynamo`` costs 1.6 s of CPU per rank to import."""
    probe = (
        "import sys, torch\n"
        "from nanotron_recover.optim.adamw import AdamW\n"
        "p = torch.nn.Parameter(torch.ones(4))\n"
        "opt = AdamW([p], lr=1e-3, weight_decay=0.1, foreach=False)\n"
        "for _ in range(2):\n"
        "    p.grad = torch.ones(4)\n"
        "    opt.step()\n"
        "opt.zero_grad()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "print('dynamo', 'torch._dynamo' in sys.modules)\n"
    )
    out = probe_stdout(probe)
    assert "dynamo False" in out, out
