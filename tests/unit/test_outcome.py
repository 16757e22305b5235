"""``outcome.py``: the give-up record the supervisor acts on."""

from __future__ import annotations

from nanotron_recover.outcome import ABANDONED, clear_abandoned, read_abandoned, write_abandoned


def test_written_give_up_is_read_back_with_its_reason(tmp_path):
    write_abandoned(tmp_path, "watchdog: phase 'rejoin' hung")
    assert read_abandoned(tmp_path)["reason"] == "watchdog: phase 'rejoin' hung"
    clear_abandoned(tmp_path)
    assert read_abandoned(tmp_path) is None


def test_an_empty_or_broken_give_up_file_still_gives_the_job_up(tmp_path):
    """Its presence is the signal: a writer killed mid-write must not leave the job to the commit
    deadline."""
    for text in ("", '{"reason": "watch', "[1, 2]"):
        (tmp_path / ABANDONED).write_text(text)
        got = read_abandoned(tmp_path)
        assert got is not None and ABANDONED in got["reason"], (text, got)
