"""``ft/processes.py``: a launch's node-mates found in /proc, and process tables merged."""

from __future__ import annotations

import os
import subprocess
import sys

from nanotron_recover.ft.processes import ProcessInfo, fill_in, launch_mates


def _info(rank: int, pid: int, host: str = "h") -> ProcessInfo:
    return ProcessInfo(rank=rank, host=host, pid=pid, start_ticks=None)


def test_fill_in_takes_each_members_own_entry_and_what_others_knew():
    table = [_info(0, 10), _info(1, 0, ""), _info(2, 0, ""), _info(3, 0, "")]
    own = [_info(0, 11), _info(3, 13)]  # members report themselves (0 now another process)
    shared = [[_info(1, 21), _info(2, 0, "")], [_info(1, 99), _info(2, 22)]]
    fill_in(table, own, shared)
    assert [p.pid for p in table] == [11, 21, 22, 13]  # the first that knew rank 1 wins


def test_launch_mates_finds_this_launchs_processes_on_this_host(monkeypatch):
    nspace = f"test-nspace-{os.getpid()}"
    env = {**os.environ, "PMIX_NAMESPACE": nspace, "PMIX_RANK": "5"}
    other = {**os.environ, "PMIX_NAMESPACE": nspace + "-other", "PMIX_RANK": "6"}
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    mate, stranger = subprocess.Popen(sleep, env=env), subprocess.Popen(sleep, env=other)
    try:
        monkeypatch.setenv("PMIX_NAMESPACE", nspace)
        found = launch_mates()
        assert found[5].pid == mate.pid and found[5].pmix_rank == 5, found
        assert all(p.pid != stranger.pid for p in found.values()), found
        monkeypatch.delenv("PMIX_NAMESPACE")
        assert launch_mates() == {}  # outside a launch: nobody
    finally:
        for p in (mate, stranger):
            p.kill()
            p.wait()
