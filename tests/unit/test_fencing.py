"""The run directory's fencing token: it only grows, it is checked at the moment of writing, and
a process of an older job writes nothing."""

from __future__ import annotations

import json

import pytest

from nanotron_recover import fencing
from nanotron_recover.commit_record import read_commit, write_commit
from nanotron_recover.logging import MetricsWriter
from nanotron_recover.logging.incidents import IncidentLog
from nanotron_recover.outcome import read_outcome, write_outcome


def test_the_generation_only_grows_and_a_new_supervisor_start_goes_past_the_file(tmp_path):
    first = fencing.advance(tmp_path, "aaaa")
    second = fencing.advance(tmp_path)
    assert (first.generation, second.generation) == (1, 2)
    assert second.nonce == "aaaa"  # a relaunch of the same start keeps its nonce
    # A later supervisor start (a new Slurm job in the same run directory): a new nonce, and a
    # generation past the file's, never 0 or 1 again.
    third = fencing.advance(tmp_path, fencing.new_nonce())
    assert third.generation == 3 and third.nonce != "aaaa"
    assert fencing.read_token(tmp_path) == third


def test_an_unreadable_token_is_an_error_not_generation_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(fencing, "READ_RETRY_S", 0.0)
    (tmp_path / fencing.FILENAME).write_text("{not json")
    with pytest.raises(fencing.TokenError, match="unreadable fencing token"):
        fencing.read_token(tmp_path)
    with pytest.raises(fencing.TokenError):
        fencing.advance(tmp_path)
    fencing.set_mine(fencing.Token("aaaa", 1))
    assert not fencing.is_current(tmp_path)  # refuses the write rather than guess


def test_a_process_adopts_its_token_from_the_environment_or_the_file(tmp_path, monkeypatch):
    token = fencing.advance(tmp_path, "bbbb")
    monkeypatch.delenv(fencing.ENV, raising=False)
    assert fencing.adopt(tmp_path) == token
    monkeypatch.setenv(fencing.ENV, "cccc:7")
    assert fencing.adopt(tmp_path) == fencing.Token("cccc", 7)
    assert not fencing.is_current(tmp_path)
    monkeypatch.setenv(fencing.ENV, "no-generation")
    with pytest.raises(ValueError, match="not a fencing token"):
        fencing.adopt(tmp_path)


def test_every_shared_write_of_an_older_job_is_refused_at_the_moment_of_writing(tmp_path):
    old = fencing.advance(tmp_path, "dddd")
    fencing.set_mine(old)
    # Written while current: accepted, and the records name the writer's token.
    assert write_outcome(tmp_path, status="stopped", last_step=3, target_step=9, exit_code=1)
    write_commit(tmp_path, 3)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 1})
    IncidentLog(tmp_path / "incidents.jsonl").write({"step": 1})
    assert read_outcome(tmp_path)["token"] == {"nonce": "dddd", "generation": 1}
    assert read_commit(tmp_path).token == old
    # A newer job starts (the supervisor advanced the token): the old process wakes up.
    new = fencing.advance(tmp_path)
    assert not write_outcome(tmp_path, status="completed", last_step=9, target_step=9, exit_code=0)
    assert read_outcome(tmp_path)["last_step"] == 3
    with pytest.raises(fencing.Fenced, match=f"run directory {tmp_path} is at {new}"):
        write_commit(tmp_path, 9)
    assert read_commit(tmp_path).step == 3
    with pytest.raises(fencing.Fenced):
        metrics.write({"step": 2})
    with pytest.raises(fencing.Fenced):
        MetricsWriter(tmp_path / "metrics.jsonl", truncate_after_step=0)
    with pytest.raises(fencing.Fenced):
        IncidentLog(tmp_path / "incidents.jsonl").write({"step": 2})
    metrics.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert len((tmp_path / "incidents.jsonl").read_text().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_a_process_without_a_token_is_fenced_once_a_supervisor_owns_the_directory(tmp_path):
    fencing.adopt(tmp_path)  # a job started by hand: no token file yet
    assert fencing.mine() is None and fencing.is_current(tmp_path)
    fencing.advance(tmp_path, "eeee")
    assert not fencing.is_current(tmp_path)
