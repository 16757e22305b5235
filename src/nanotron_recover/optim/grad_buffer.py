"""FP32 gradient accumulation into one contiguous buffer, or exact fixed-point accumulation.

Every micro-batch's gradient is added, in fp32, into a view of a single flat buffer as soon as
autograd has produced it (a post-accumulate-grad hook), and the parameter's own ``.grad`` is dropped.
Why one buffer: the data-parallel reduction (and, in the fault-tolerant mode, the bucketed
reduction with its snapshots) works on plain contiguous slices instead of hundreds of tensors, and
bf16 parameters still accumulate their gradients in fp32 over many micro-batches.
The layout is fixed: parameters in ``named_parameters()`` order.

**Exact mode** (``fraction_bits`` set, ``recover.exact``). A float sum depends on its order: when a
survivor computes a lost micro-batch, or the reduction runs over fewer replicas, the same gradients
are added in another order and the result differs in the last bits. Here each micro-batch's
gradient ``g`` is rounded once to the integer ``q = round(g * 2^bits)`` (computed in fp32, where
the scaling and the rounding are exact, then stored as int64) and the integers are summed: integer addition is associative, so the summed ``q`` of a step is a
function of the set of micro-batch ids alone, whoever computed them and in whatever order, within
this buffer and across replicas (an int64 MPI or gloo SUM). :attr:`fixed` is what crosses replicas;
:meth:`materialize` turns the sum back into the fp32 :attr:`flat` (``q * 2^-bits``) for clipping
and the optimizer. Costs: each micro-batch's gradient loses what lies below ``2^-bits`` (half a
unit of rounding each, so at most ``B * 2^-(bits+1)`` per element in a step of ``B`` micro-batches:
an absolute error, whatever the element's size); an int64 buffer beside the fp32 one (3x the
gradient memory), a float64 temporary in :meth:`materialize`, twice the reduction's bytes, and on
a GPU one host synchronisation per parameter and micro-batch for the range check. A
micro-batch gradient element whose ``|q|`` could overflow the sum of ``max_terms`` such terms, or
that is not finite, raises :class:`ExactOverflow`.
"""

from __future__ import annotations

import torch
from torch import nn


class ExactOverflow(ArithmeticError):
    """A micro-batch gradient that fixed-point accumulation cannot represent (too large, or not finite)."""


class GradBuffer:
    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        device: torch.device,
        *,
        fraction_bits: int | None = None,
        max_terms: int = 1,
    ):
        self.names = [n for n, _ in named_params]
        total = sum(p.numel() for _, p in named_params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.fraction_bits = fraction_bits
        self.fixed: torch.Tensor | None = None
        if fraction_bits is not None:
            self.fixed = torch.zeros(total, dtype=torch.int64, device=device)
            self._scale = float(2**fraction_bits)
            # |q| of one term below this: max_terms of them sum without overflowing int64.
            self._limit = float(2**62 // max(max_terms, 1))
        self.views: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        self._hooks = []
        for name, param in named_params:
            n = param.numel()
            view = self.flat[offset : offset + n].view_as(param)
            self.views[name], self.offsets[name] = view, (offset, offset + n)
            if self.fixed is not None:
                fixed_view = self.fixed[offset : offset + n].view_as(param)
                hook = self._make_exact_hook(name, fixed_view)
            else:
                hook = self._make_hook(view)
            offset += n
            self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    @property
    def reduced(self) -> torch.Tensor:
        """The buffer that crosses replicas: the int64 sum in exact mode, else the fp32 one."""
        return self.fixed if self.fixed is not None else self.flat

    @staticmethod
    def _make_hook(view: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            view.add_(param.grad)
            param.grad = None

        return hook

    def _make_exact_hook(self, name: str, view: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            # In fp32: scaling by a power of two and rounding to an integer are both exact there, and
            # so is turning an integral float into int64; float64 would give the same integers slower.
            q = param.grad.float() * self._scale
            lo, hi = torch.aminmax(q)
            # float() reads both on the host: on a GPU, one synchronisation per parameter and micro-batch.
            if not (-self._limit < float(lo) and float(hi) < self._limit):  # also catches NaN and inf
                largest = max(abs(float(lo)), abs(float(hi)))
                raise ExactOverflow(
                    f"recover.exact: a gradient element of {name} is {largest / self._scale:.3g}, which "
                    f"{self.fraction_bits} fraction bits cannot sum exactly over the step's micro-batches; "
                    "lower recover.exact_fraction_bits (or find why the gradient is not finite)"
                )
            view.add_(q.round_().to(torch.int64))
            param.grad = None

        return hook

    def materialize(self) -> None:
        """Exact mode: the fp32 gradient of the summed fixed-point one (a no-op otherwise).

        Goes through one float64 temporary the size of the buffer (8 bytes per parameter), where
        an int64 sum below 2^53 and its scaling by a power of two are exact; the copy into fp32
        then rounds once, as a float sum would be rounded.
        """
        if self.fixed is not None:
            self.flat.copy_(self.fixed.to(torch.float64).div_(self._scale))

    def zero_(self) -> None:
        self.flat.zero_()
        if self.fixed is not None:
            self.fixed.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
