"""Fixtures of the forward-recovery unit tests."""

from __future__ import annotations

import pytest

from nanotron_recover.data_parallel.forward import stops
from tests.helpers.forward_replica import Exited


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os._exit`` raises :class:`Exited` instead of ending the test process."""

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(stops.os, "_exit", fake_exit)
