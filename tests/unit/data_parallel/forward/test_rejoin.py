"""When a lost replica comes back by a relaunch instead of a spawn (``data_parallel/forward/rejoin.py``):
a launch across hosts whose runtime runs without the PRRTE fix (``ft/prrte_fix.py``) spawns at most
``recover.rejoin.spawns_across_hosts`` times; with the fix it spawns as often as it needs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanotron_recover.data_parallel.forward.rejoin import Rejoin
from nanotron_recover.outcome import RELAUNCHES_LEFT_ENV, SUPERVISED_ENV


def rejoin(*, spawn_fix: bool, spawns: int, hosts: list[str], limit: int = 1) -> tuple[Rejoin, list]:
    """A :class:`Rejoin` with just what the decision reads: the launch's processes, the book's
    spawn count, the config and where a stop request goes."""
    r = Rejoin.__new__(Rejoin)
    r.s = SimpleNamespace(
        ftc=SimpleNamespace(processes=[SimpleNamespace(host=h) for h in hosts]),
        args=SimpleNamespace(
            rejoin=SimpleNamespace(spawns_across_hosts=limit, regrow_by_relaunch=True),
            snapshot=SimpleNamespace(interval=1),
        ),
    )
    r.book = SimpleNamespace(spawns=spawns)
    r.spawn_fix = spawn_fix
    requested: list = []
    r.stops = SimpleNamespace(request=requested.append)
    return r, requested


@pytest.fixture(autouse=True)
def supervised(monkeypatch):
    monkeypatch.setenv(SUPERVISED_ENV, "1")
    monkeypatch.setenv(RELAUNCHES_LEFT_ENV, "3")


def test_without_the_fix_a_launch_across_hosts_regrows_after_its_spawns():
    r, requested = rejoin(spawn_fix=False, spawns=0, hosts=["n1", "n2", "n3"])
    assert not r._regrow_instead_of_spawn((1,), 5) and requested == []
    r, requested = rejoin(spawn_fix=False, spawns=1, hosts=["n1", "n2", "n3"])
    assert r._regrow_instead_of_spawn((1,), 9)
    (stop,) = requested
    assert stop.kind == "regrow" and "spawns_across_hosts" in stop.message, stop


def test_with_the_fix_it_spawns_again():
    r, requested = rejoin(spawn_fix=True, spawns=5, hosts=["n1", "n2", "n3"])
    assert not r._regrow_instead_of_spawn((1,), 9) and requested == []


def test_on_one_host_it_always_spawns():
    r, requested = rejoin(spawn_fix=False, spawns=5, hosts=["n1", "n1"])
    assert not r._regrow_instead_of_spawn((1,), 9) and requested == []
