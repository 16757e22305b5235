"""One rank's live training state, as a donor rank hands it to a joiner at the same (pp, tp) coordinate.

A re-join brings a replica back by giving each of its ranks the state of the rank at the same
coordinate of a healthy replica (``data_parallel/forward/state_transfer.py``). For the joiner to continue
*bitwise* like its donor it needs everything that determines the next optimizer steps on that rank:
the weights, the fp32 master weights, the AdamW moments and step counts, the optimizer's
hyper-parameters and the RNG states. Everything else is a function of the committed step (data
position, learning rate) or of the config (the model's structure) and is not sent.

:class:`EngineState` is that state in a shape a transport can move without knowing anything about
the engines: an ordered dict of CPU tensors, moved as raw bytes, plus a small picklable ``meta``.
The receiver allocates its buffers from :meth:`EngineState.layout` (names, shapes and dtype names),
which is the same on every replica at one coordinate, so the layout and the meta go first and the
bytes follow straight into their final tensors.

The helpers at the bottom hold what both engines share: they run plain ``torch.optim.AdamW`` over
fp32 master tensors keyed by parameter name (the 3D engine's ``MasterOptimizer.master``, the HSDP
engine's local shards), so exporting and importing the optimizer is one piece of code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# dtypes a state may hold, by the name that travels in a layout (``str(dtype)`` without "torch.").
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Layout = list[tuple[str, tuple[int, ...], str]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how a dtype travels in a layout (plain, picklable text)."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot travel in an engine state")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; only the dtypes of :data:`_DTYPES` (a layout comes from
    another process: nothing else is looked up on the ``torch`` module)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r} in an engine state layout") from None


@dataclass
class EngineState:
    """One rank's training state, as sent from a donor rank to a joiner at the same (pp, tp) coordinate."""

    # Ordered; CPU, contiguous; names and shapes identical on every replica at this coordinate.
    tensors: dict[str, torch.Tensor]
    # Small picklable things: optimizer step counts, scalar hyper-state, RNG states.
    meta: dict[str, Any]

    def nbytes(self) -> int:
        """Bytes of tensor data: what crosses the wire after the layout and the meta."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layout(self) -> Layout:
        """``(name, shape, dtype name)`` of every tensor, in order: what a receiver needs to allocate
        its buffers before the bytes arrive (:meth:`empty_like`)."""
        return [(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in self.tensors.items()]

    @staticmethod
    def empty_like(layout: Iterable[Sequence[Any]], meta: dict[str, Any]) -> EngineState:
        """Receive buffers (``torch.empty``, CPU, contiguous) for a state of ``layout``, with ``meta``.

        ``layout`` may have been through pickle or JSON (shapes as lists): it is normalised."""
        tensors: dict[str, torch.Tensor] = {}
        for name, shape, dtype in layout:
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice in the layout")
            tensors[str(name)] = torch.empty(tuple(int(s) for s in shape), dtype=dtype_from_name(dtype))
        return EngineState(tensors, dict(meta))


def check_layout(got: Layout, want: Layout) -> None:
    """Raise ``ValueError`` naming the first differences between a received layout and this rank's.

    Why it matters: the bytes of a tensor are copied blindly, so a state from another coordinate or
    another model must be refused before anything changes, not half-loaded."""
    if [tuple(e) for e in got] == [tuple(e) for e in want]:
        return
    got_by_name = {name: (tuple(shape), dtype) for name, shape, dtype in got}
    want_by_name = {name: (tuple(shape), dtype) for name, shape, dtype in want}
    problems = [f"missing {name!r}" for name in want_by_name if name not in got_by_name]
    problems += [f"unexpected {name!r}" for name in got_by_name if name not in want_by_name]
    problems += [
        f"{name!r}: got {got_by_name[name]}, expected {spec}"
        for name, spec in want_by_name.items()
        if name in got_by_name and got_by_name[name] != spec
    ]
    if not problems:
        problems = ["the tensors come in another order"]
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise ValueError("engine state does not fit this rank: " + "; ".join(problems[:5]) + more)


def exported(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """What an export holds of live tensor ``t``: a :func:`cpu_copy`, or with ``copy=False`` the
    live tensor itself (detached), valid only until the state next changes."""
    return cpu_copy(t) if copy else t.detach()


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t``: never a view of the live tensor, so the exported state stays
    what it was when the donor goes on training (and the donor's state is never touched by a send)."""
    out = torch.empty(tuple(t.shape), dtype=t.dtype)
    out.copy_(t.detach())
    return out


# -- RNG ----------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, bytes]:
    """torch's CPU generator state and, on a CUDA engine, the generator of ``device`` (the rank's,
    named: a node snapshot exports on a thread of its own, whose current device is device 0): as
    bytes (picklable, device-free). Nothing in training draws from them today (no dropout); they
    travel so that anything that does later still continues like the donor."""
    out = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return out


def set_rng_state(state: dict[str, bytes], device: torch.device) -> None:
    """Inverse of :func:`rng_state` (the CUDA state onto ``device``, when both sides have one)."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), device)


# -- AdamW over named fp32 masters --------------------------------------------------------------------


def _state_keys(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter tensors AdamW keeps, besides ``step``."""
    amsgrad = any(group.get("amsgrad", False) for group in opt.param_groups)
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")


def optimizer_layout(opt: torch.optim.Optimizer, masters: dict[str, torch.Tensor]) -> Layout:
    """Layout of the optimizer tensors :func:`export_optimizer` gives for these masters."""
    return [
        (f"{key}/{name}", tuple(m.shape), dtype_name(m.dtype))
        for key in _state_keys(opt)
        for name, m in masters.items()
    ]


def export_optimizer(
    opt: torch.optim.Optimizer, masters: dict[str, torch.Tensor], copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``{"<key>/<name>": CPU copy}`` of every moment of every master (the live moment with
    ``copy=False``, see :func:`exported`), and the meta: per-name step counts (None where AdamW has
    no state yet) and the param groups' hyper-parameters.

    A master without state yet (before the first step) exports zero moments, so the layout is the same
    whatever the step; its step is None, and the receiver drops its own state for it, which AdamW then
    initialises exactly as the donor's will be."""
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float | None] = {}
    for key in _state_keys(opt):
        for name, m in masters.items():
            st = opt.state.get(m, {})
            tensors[f"{key}/{name}"] = (
                exported(st[key], copy) if key in st else torch.zeros(tuple(m.shape), dtype=m.dtype)
            )
    for name, m in masters.items():
        st = opt.state.get(m, {})
        steps[name] = float(st["step"]) if "step" in st else None
    groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    return tensors, {"steps": steps, "param_groups": groups}


def check_optimizer_meta(
    opt: torch.optim.Optimizer, masters: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Refuse optimizer meta that does not describe these masters (before anything changes)."""
    steps = meta.get("steps")
    if not isinstance(steps, dict) or list(steps) != list(masters):
        raise ValueError("engine state: optimizer step counts are not those of this rank's parameters")
    if len(meta.get("param_groups", [])) != len(opt.param_groups):
        raise ValueError("engine state: another number of optimizer param groups")


@torch.no_grad()
def import_optimizer(
    opt: torch.optim.Optimizer,
    masters: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> None:
    """Load :func:`export_optimizer`'s output in place: existing moment and step tensors are
    overwritten (references to them stay valid); where AdamW has no state yet, it is built the way
    ``torch.optim.AdamW`` builds it, so the next step runs the same kernels as on the donor."""
    keys = _state_keys(opt)
    for group, hyper in zip(opt.param_groups, meta["param_groups"], strict=True):
        group.update({k: v for k, v in hyper.items() if k != "params"})
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    for name, m in masters.items():
        step = meta["steps"][name]
        if step is None:
            opt.state.pop(m, None)
            continue
        st = opt.state[m]  # a defaultdict: creates the entry
        for key in keys:
            if key in st:
                st[key].copy_(tensors[f"{key}/{name}"])
            else:
                st[key] = tensors[f"{key}/{name}"].to(m.device, m.dtype, copy=True)
        if "step" in st and isinstance(st["step"], torch.Tensor):
            st["step"].fill_(step)
        else:
            group = group_of[id(m)]
            on_device = group.get("fused") or group.get("capturable")
            # torch.optim.AdamW's own choice: a float32 device tensor when fused or capturable, else a
            # CPU scalar of the default float dtype's width.
            dtype = (
                torch.float32 if on_device or torch.get_default_dtype() != torch.float64 else torch.float64
            )
            st["step"] = torch.tensor(step, dtype=dtype, device=m.device if on_device else "cpu")


__all__ = [
    "EngineState",
    "Layout",
    "check_layout",
    "check_optimizer_meta",
    "cpu_copy",
    "dtype_from_name",
    "dtype_name",
    "export_optimizer",
    "import_optimizer",
    "optimizer_layout",
    "rng_state",
    "set_rng_state",
]
