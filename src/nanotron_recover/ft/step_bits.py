"""The value a rank contributes to the step agree (:meth:`.comm.FaultTolerantComm.agree`), and what
the agreed value says.

The agree is a bitwise AND, so a single rank that clears ``NO_RECOVERY`` (the entry agree of a
recovering rank contributes 0) pulls everyone in, and a single rank that clears a stop bit stops
everyone. Stop requests are small non-negative ints whose bits live above ``_STOP_SHIFT``, stored
inverted. What kind of global agree this is, for parked ranks (which contribute all ones and only
follow): each kind but ``"step"`` is one bit that the active ranks clear.
"""

from __future__ import annotations

_FLAG = 0x1
NO_RECOVERY = 0x2
_STOP_SHIFT = 2
_STOP_BITS = 0xFF
_KIND_SHIFT = 10
AGREE_KINDS = ("join", "finish", "stop")
_KIND_MASK = (1 << len(AGREE_KINDS)) - 1


def encode_step(flag: bool, stop: int, kind: str) -> int:
    """An active rank's contribution: its commit ``flag``, its ``stop`` bits (0..255), the agree's
    ``kind`` (``"step"`` or one of :data:`AGREE_KINDS`)."""
    if not 0 <= stop <= _STOP_BITS:
        raise ValueError(f"stop bits must be in 0..{_STOP_BITS}, got {stop}")
    kind_bits = _KIND_MASK & ~(1 << AGREE_KINDS.index(kind)) if kind != "step" else _KIND_MASK
    return (
        (_FLAG if flag else 0)
        | NO_RECOVERY
        | ((_STOP_BITS & ~stop) << _STOP_SHIFT)
        | (kind_bits << _KIND_SHIFT)
    )


def decode_step(value: int) -> tuple[bool, int]:
    """``(flag, stop bits)`` of an agreed value: the AND of the flags, the OR of the stops."""
    return bool(value & _FLAG), _STOP_BITS & ~(value >> _STOP_SHIFT)


def encode_follow(stop: int) -> int:
    """A parked rank's contribution: all ones but the ``stop`` it requested before it parked."""
    return _FLAG | NO_RECOVERY | ((_STOP_BITS & ~stop) << _STOP_SHIFT) | (_KIND_MASK << _KIND_SHIFT)


def decode_follow(value: int) -> tuple[int, str]:
    """``(stop bits, kind)`` of an agreed value, as a parked rank reads it."""
    kinds = ~(value >> _KIND_SHIFT) & _KIND_MASK
    kind = next((k for i, k in enumerate(AGREE_KINDS) if kinds & (1 << i)), "step")
    return _STOP_BITS & ~(value >> _STOP_SHIFT), kind


__all__ = ["AGREE_KINDS", "NO_RECOVERY", "decode_follow", "decode_step", "encode_follow", "encode_step"]
