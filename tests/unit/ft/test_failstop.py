"""fail_stop and the Watchdog: hangs and fatal conditions must end in SIGKILL.

docs/architecture.md, "How each kind of fault ends", paragraph "Leaving".
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

from nanotron_recover.ft.failstop import Watchdog

TIMEOUT_S = 30.0


def run_py(code: str) -> subprocess.CompletedProcess[str]:
    # A plain subprocess (no mpirun): its returncode is -SIGKILL iff it killed itself.
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_fail_stop_is_sigkill_after_flush() -> None:
    p = run_py(
        """
        import sys
        from nanotron_recover.ft.failstop import fail_stop
        print("buffered line", end="")  # not newline-terminated: only an explicit flush writes it
        fail_stop("test reason")
        print("unreachable")
        """
    )
    assert p.returncode == -signal.SIGKILL
    assert p.stdout == "buffered line"
    assert "test reason" in p.stderr


def test_watchdog_kills_hung_phase() -> None:
    # Killed (-9) rather than exiting 0 after the 20 s sleep: the watchdog fired.
    p = run_py(
        """
        import time
        from nanotron_recover.ft.failstop import Watchdog
        wd = Watchdog()
        with wd.phase("backward", 0.3):
            time.sleep(20)
        print("survived")
        """
    )
    assert p.returncode == -signal.SIGKILL
    assert "survived" not in p.stdout
    assert "phase 'backward' hung" in p.stderr


def test_watchdog_spares_phases_that_finish() -> None:
    p = run_py(
        """
        import time
        from nanotron_recover.ft.failstop import Watchdog
        wd = Watchdog()
        for i in range(3):
            with wd.phase(f"forward {i}", 1.0):
                time.sleep(0.05)
        with wd.phase("disabled-none", None):
            time.sleep(0.4)
        with wd.phase("disabled-zero", 0):
            time.sleep(0.4)
        time.sleep(1.5)  # past every deadline above: closed phases must not fire
        print("ok")
        """
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_watchdog_nested_inner_deadline_fires_first() -> None:
    p = run_py(
        """
        import time
        from nanotron_recover.ft.failstop import Watchdog
        wd = Watchdog()
        with wd.phase("step", 30.0):
            with wd.phase("reduce", 0.2):
                time.sleep(20)
        """
    )
    assert p.returncode == -signal.SIGKILL
    assert "phase 'reduce' hung" in p.stderr


def test_watchdog_bookkeeping_in_process() -> None:
    wd = Watchdog()
    with wd.phase("off", None):
        assert wd.open_phases == []
        assert wd._thread is None  # disabled phases never start the monitor thread
    seen: list[list[str]] = []

    def worker() -> None:
        with wd.phase("other-thread", 60.0):
            seen.append(wd.open_phases)

    with wd.phase("outer", 60.0):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert sorted(seen[0]) == ["other-thread", "outer"]
        assert wd.open_phases == ["outer"]
    assert wd.open_phases == []
    wd.stop()
    assert wd._thread is not None and not wd._thread.is_alive()
