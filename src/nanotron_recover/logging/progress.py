"""A one-line live progress display for a terminal, silent everywhere else.

On a TTY each update rewrites one line in place (a carriage return, drawn through rich), e.g.::

    step 120/1000  loss 3.4812  12.4k tok/s  replicas 3/4  ETA 2m05s

When the stream is not a terminal (a log file, a pipe, ``mpirun``'s forwarding) it writes nothing
at all, so logs keep only the trainer's own lines. ``NANOTRON_RECOVER_PROGRESS=1`` (or ``0``)
forces it on (off) when ``enabled`` is not given, for a launcher whose ranks' output is a pipe
that ends at a terminal.

Two ways to feed it: ``update(record)`` with a trainer metrics record (step, loss, tokens_per_s,
replicas), or ``update(n, **fields)`` to advance ``n`` units and show any fields, for
preprocessing or benchmarks. ``write(text)`` prints a message line above the live one (and
prints it plainly when quiet: only the live line is suppressed).

The line is a ``rich`` text written by a ``rich`` console on the stream: plain characters and a
carriage return, with styles only when the stream is a real terminal (a file descriptor that is a
TTY), so what a test or a pipe forced on receives is the text itself.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.control import Control
from rich.segment import ControlType
from rich.text import Text

ENV_VAR = "NANOTRON_RECOVER_PROGRESS"


def _default_enabled(stream: TextIO) -> bool:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _real_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal device (not an object that only says so)."""
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def format_duration(seconds: float) -> str:
    """``45s``, ``2m05s``, ``3h07m``: short enough for one status line."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(per_s: float) -> str:
    """``950``, ``12.4k``, ``3.10M``."""
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f}k"
    return f"{per_s:.0f}"


def _format_field(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


class Progress:
    """Live ``done/total`` line with an ETA; see the module docstring."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        *,
        unit: str = "step",
        min_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _default_enabled(self.stream) if enabled is None else enabled
        self.unit = unit
        self.min_interval_s = min_interval_s
        self._clock = clock
        self.done = 0
        self.fields: dict[str, Any] = {}
        self._max_replicas = 0
        # The ETA is measured from the first update, not from construction: setup (model build,
        # a resumed run's checkpoint load) is not part of the per-step rate.
        self._t0: float | None = None
        self._done0 = 0
        self._last_draw = -float("inf")
        self._width = 0  # length of the line on screen, to blank what a shorter line leaves
        self._console = Console(
            file=self.stream,
            force_terminal=True,
            color_system="auto" if _real_terminal(self.stream) else None,
            highlight=False,
            markup=False,
            emoji=False,
            soft_wrap=True,  # never wrapped by rich: the line is cut to the terminal's width below
        )

    # -- feeding ---------------------------------------------------------------------------
    def update(self, record: Mapping[str, Any] | int = 1, /, **fields: Any) -> None:
        """``update(record)``: a metrics record, its ``step`` is the position. ``update(n, **fields)``:
        advance by ``n`` and show ``fields`` (``key value``) after the count."""
        if isinstance(record, Mapping):
            self._set_position(int(record["step"]))
            self.fields = self._record_fields(record)
        else:
            self._set_position(self.done + int(record))
            self.fields = {k: v for k, v in fields.items() if v is not None}
        self._maybe_draw(force=self.done >= self.total)

    def _set_position(self, done: int) -> None:
        now = self._clock()
        if self._t0 is None:
            # The first update ends one unit of work whose start we did not see: count from it.
            self._t0, self._done0 = now, done
        self.done = done

    def _record_fields(self, record: Mapping[str, Any]) -> dict[str, Any]:
        shown: dict[str, Any] = {}
        if isinstance(record.get("loss"), (int, float)):
            shown["loss"] = f"{record['loss']:.4f}"
        if isinstance(record.get("tokens_per_s"), (int, float)):
            shown["tok/s"] = format_rate(record["tokens_per_s"])
        replicas = record.get("replicas")
        if isinstance(replicas, int):
            self._max_replicas = max(self._max_replicas, replicas)
            shown["replicas"] = f"{replicas}/{self._max_replicas}"
        return shown

    # -- output ----------------------------------------------------------------------------
    def eta_s(self) -> float | None:
        """Seconds left at the mean rate since the first update; None until there is a rate."""
        if self._t0 is None or self.done <= self._done0:
            return None
        rate = (self.done - self._done0) / max(self._clock() - self._t0, 1e-9)
        return max(self.total - self.done, 0) / rate

    def line(self) -> str:
        """The status line as it would be drawn now."""
        parts = [f"{self.unit} {self.done}/{self.total}"]
        for key, value in self.fields.items():
            # Records arrive preformatted ("tok/s" reads better after its number).
            parts.append(f"{value} tok/s" if key == "tok/s" else _format_field(key, value))
        eta = self.eta_s()
        if eta is not None and self.done < self.total:
            parts.append(f"ETA {format_duration(eta)}")
        return "  ".join(parts)

    def _maybe_draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if not force and now - self._last_draw < self.min_interval_s:
            return  # a fast loop must not spend its time repainting the terminal
        self._last_draw = now
        self._draw(self.line())

    def _styled(self, text: str) -> Text:
        styled = Text(text)
        styled.stylize("bold", 0, len(text.split("  ", 1)[0]))  # the count
        eta = text.rfind("ETA ")
        if eta >= 0:
            styled.stylize("dim", eta)
        return styled

    def _draw(self, text: str) -> None:
        # A line longer than the terminal wraps, and a carriage return then only returns to its
        # last row: cut it to the terminal's width, and blank what a longer previous line left.
        columns = shutil.get_terminal_size(fallback=(120, 24)).columns
        line = self._styled(text)
        line.truncate(max(columns - 1, 10), overflow="crop")
        width = line.cell_len
        line.pad_right(max(self._width - width, 0))
        self._console.control(Control(ControlType.CARRIAGE_RETURN))
        self._console.print(line, end="")
        self.stream.flush()
        self._width = width

    def _blank(self) -> None:
        self._console.control(Control(ControlType.CARRIAGE_RETURN))
        self._console.print(" " * self._width, end="")
        self._console.control(Control(ControlType.CARRIAGE_RETURN))
        self.stream.flush()

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print ``text`` as a line of its own to ``file`` (default: this stream) above the live
        line. Unlike the live line it is printed when quiet too: a message matters in any log."""
        out = file if file is not None else self.stream
        if not self.enabled or not self._width:
            out.write(text + "\n")
            out.flush()
            return
        self._blank()
        out.write(text + "\n")
        out.flush()
        self._width = 0
        self._draw(self.line())

    def close(self) -> None:
        """Draw the final state and end the line; idempotent."""
        if self.enabled and self._width:
            self._draw(self.line())
            self._console.print()
            self.stream.flush()
        self._width = 0
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
