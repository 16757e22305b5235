"""Fail-stop: turn any local trouble into a process death the survivors can see.

Forward recovery only works if every fault ends up as a *detected process
failure*. Two things here make sure of that:

1. :func:`fail_stop` kills the calling process with ``SIGKILL`` to itself.
   Why not ``sys.exit(1)``: with Open MPI 5.0.11 + ULFM a rank that exits with a
   non-zero status is not reported to the survivors, which then block forever
   in their next collective; a SIGKILLed rank is reported within tens of ms
   (docs/architecture.md, "How each kind of fault ends", paragraph "Leaving"). SIGKILL also
   skips ``atexit`` handlers, ``MPI_Finalize`` and torch's destructors, none of which can be
   trusted in a broken world. Before dying it prints the reason and flushes stdio so the
   incident is in the logs.
2. :class:`Watchdog` turns a *local* hang into that same fail-stop. The training
   loop wraps each phase that only this replica takes part in (compute, gate,
   optimizer, its own reductions, checkpoint save) in
   ``with watchdog.phase("compute", deadline_s):``. A daemon thread sleeps until
   the earliest open deadline; if a phase is still open when its deadline passes,
   the thread prints which phase hung and for how long, then calls
   :func:`fail_stop`. A hang inside this replica (a stuck kernel, a save that
   never ends) therefore becomes a visible failure, and the other replicas
   recover from it as from any crash. Waits on *other* replicas are never
   guarded here: a frozen rank elsewhere is the heartbeat detector's business,
   and a watchdog firing there would kill a healthy replica for someone else's
   hang.

A deadline of ``None`` or ``0`` disables the check for that phase, so the same
code runs with the watchdog off.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn


def fail_stop(reason: str) -> NoReturn:
    """Print ``reason``, flush stdio, and SIGKILL this process. Never returns."""
    try:
        print(f"[fail-stop pid={os.getpid()}] {reason}", file=sys.stderr)
    except Exception:
        pass  # a closed stderr must not prevent the kill
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
    # SIGKILL to oneself is delivered before kill() returns on Linux; this loop only
    # satisfies NoReturn on exotic platforms and still never exits with a status.
    while True:  # pragma: no cover
        time.sleep(1.0)


@dataclass
class _OpenPhase:
    name: str
    deadline_s: float
    started: float
    expires: float


class Watchdog:
    """A per-process hang detector: phases that outlive their deadline cause :func:`fail_stop`.

    Thread-safe; phases may nest or be opened from several threads. The monitor
    thread is a daemon started lazily on the first enabled phase.
    """

    def __init__(
        self,
        *,
        on_expire: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # on_expire exists for logging hooks; it runs before fail_stop and cannot veto it.
        self._on_expire = on_expire
        self._clock = clock
        self._cond = threading.Condition()
        self._open: dict[int, _OpenPhase] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @contextlib.contextmanager
    def phase(self, name: str, deadline_s: float | None) -> Iterator[None]:
        """Guard the body with a deadline in seconds; ``None``/``0`` disables the guard."""
        if not deadline_s or deadline_s <= 0:
            yield
            return
        token = self._enter(name, float(deadline_s))
        try:
            yield
        finally:
            self._exit(token)

    @property
    def open_phases(self) -> list[str]:
        """Names of the phases currently guarded (for logs and tests)."""
        with self._cond:
            return [p.name for p in self._open.values()]

    def stop(self) -> None:
        """Stop monitoring (open phases are no longer enforced). Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _enter(self, name: str, deadline_s: float) -> int:
        now = self._clock()
        with self._cond:
            if self._stopped:
                raise RuntimeError("watchdog was stopped")
            token = next(self._ids)
            self._open[token] = _OpenPhase(name, deadline_s, now, now + deadline_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ft-watchdog", daemon=True)
                self._thread.start()
            # Wake the monitor: the new phase may expire before the one it sleeps on.
            self._cond.notify_all()
        return token

    def _exit(self, token: int) -> None:
        with self._cond:
            self._open.pop(token, None)
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if not self._open:
                    self._cond.wait()
                    continue
                first = min(self._open.values(), key=lambda p: p.expires)
                now = self._clock()
                if now < first.expires:
                    self._cond.wait(timeout=first.expires - now)
                    continue
                # Expired while still open: the phase hung. Report and die while holding
                # the lock so the phase cannot be closed between the check and the kill.
                reason = (
                    f"watchdog: phase {first.name!r} hung: open for {now - first.started:.3f}s, "
                    f"deadline {first.deadline_s:.3f}s"
                )
                if self._on_expire is not None:
                    try:
                        self._on_expire(reason)
                    except Exception:
                        pass  # a broken logging hook must not keep a hung process alive
                fail_stop(reason)
