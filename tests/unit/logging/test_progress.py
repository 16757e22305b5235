"""Progress: a live line on a (fake) TTY, silence on anything else."""

from __future__ import annotations

import io
import sys

import pytest

from nanotron_recover.logging.progress import ENV_VAR, Progress, format_duration, format_rate


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _no_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # shutil.get_terminal_size reads it first


def _record(step: int, loss: float, replicas: int) -> dict:
    return {"step": step, "loss": loss, "tokens_per_s": 12_400.0, "replicas": replicas, "ids_digest": "x"}


def _screen(raw: str) -> list[str]:
    """What a terminal shows: each \\r returns to column 0 and overwrites, \\n starts a new row."""
    rows, row = [], ""
    col = 0
    for ch in raw:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            rows.append(row.rstrip())
            row, col = "", 0
        else:
            row = row[:col] + ch + row[col + 1 :]
            col += 1
    if row.strip():
        rows.append(row.rstrip())
    return rows


def test_tty_live_line() -> None:
    out, clock = FakeTTY(), FakeClock()
    progress = Progress(10, stream=out, clock=clock, min_interval_s=0.0)
    assert progress.enabled
    progress.update(_record(1, 5.0, 4))
    clock.now += 2.0
    progress.update(_record(2, 4.5, 4))
    clock.now += 2.0
    progress.update(_record(3, 4.25, 3))
    # Two steps in 4 s since the first update: 7 left take 14 s.
    assert progress.line() == "step 3/10  loss 4.2500  12.4k tok/s  replicas 3/4  ETA 14s"
    raw = out.getvalue()
    assert "\n" not in raw and raw.count("\r") == 3
    assert _screen(raw) == ["step 3/10  loss 4.2500  12.4k tok/s  replicas 3/4  ETA 14s"]
    progress.write("[nanotron-recover] step 3: replicas [1] failed")
    clock.now += 2.0
    progress.update(_record(10, 4.0, 3))  # the last step draws even within min_interval_s
    progress.close()
    progress.close()
    assert _screen(out.getvalue()) == [
        "[nanotron-recover] step 3: replicas [1] failed",
        "step 10/10  loss 4.0000  12.4k tok/s  replicas 3/4",
    ]
    assert out.getvalue().endswith("\n")


def test_redraws_are_throttled() -> None:
    out, clock = FakeTTY(), FakeClock()
    progress = Progress(100, stream=out, clock=clock, min_interval_s=1.0)
    for step in range(1, 11):
        clock.now += 0.25
        progress.update(_record(step, 1.0, 2))
    assert out.getvalue().count("\r") == 3  # steps 1, 5 and 9
    progress.close()
    assert _screen(out.getvalue())[-1].startswith("step 10/100")


def test_not_a_tty_is_silent() -> None:
    out = io.StringIO()
    progress = Progress(5, stream=out, min_interval_s=0.0)
    assert not progress.enabled
    for step in range(1, 6):
        progress.update(_record(step, 1.0, 2))
    progress.close()
    assert out.getvalue() == ""
    progress.write("a message still gets through")
    assert out.getvalue() == "a message still gets through\n"


def test_enabled_overrides_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Progress(3, enabled=False, stream=FakeTTY()).enabled
    assert Progress(3, enabled=True, stream=io.StringIO()).enabled
    monkeypatch.setenv(ENV_VAR, "1")
    assert Progress(3, stream=io.StringIO()).enabled
    monkeypatch.setenv(ENV_VAR, "0")
    assert not Progress(3, stream=FakeTTY()).enabled
    monkeypatch.delenv(ENV_VAR)
    assert Progress(3).stream is sys.stderr


def test_generic_counter() -> None:
    out, clock = FakeTTY(), FakeClock()
    with Progress(1000, stream=out, unit="docs", clock=clock, min_interval_s=0.0) as progress:
        progress.update(100, tokens=51_200)
        clock.now += 10.0
        progress.update(300, tokens=204_800, rate=1.23456)
        assert progress.line() == "docs 400/1000  tokens 204800  rate 1.235  ETA 20s"
    assert _screen(out.getvalue()) == ["docs 400/1000  tokens 204800  rate 1.235  ETA 20s"]


def test_long_line_is_cut_to_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "30")
    out = FakeTTY()
    progress = Progress(10, stream=out, min_interval_s=0.0)
    progress.update(_record(1, 1.0, 8))
    assert max(len(row) for row in _screen(out.getvalue())) <= 29


def test_formatting() -> None:
    assert [format_duration(s) for s in (0, 45.4, 125, 3600 * 3 + 7 * 60)] == ["0s", "45s", "2m05s", "3h07m"]
    assert [format_rate(r) for r in (950, 12_400, 3_100_000)] == ["950", "12.4k", "3.10M"]
