"""The commit record: one atomically replaced file the supervisor reads for the last committed step."""

from __future__ import annotations

from nanotron_recover import fencing
from nanotron_recover.commit_record import FILENAME, read_commit, write_commit
from nanotron_recover.supervisor import last_committed_step


def test_the_supervisor_reads_the_commit_record_before_the_metrics(tmp_path):
    # metrics.jsonl may hold a line a fenced process appended, or be mid-rewrite: the record wins.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 9}\n')
    assert last_committed_step(tmp_path) == 9  # no record: the metrics, as before
    write_commit(tmp_path, 2)
    assert last_committed_step(tmp_path) == 2
    record = read_commit(tmp_path)
    assert record.step == 2 and record.token is None and record.time > 0


def test_a_torn_or_missing_record_reads_as_none(tmp_path):
    assert read_commit(tmp_path) is None
    (tmp_path / FILENAME).write_text('{"step": ')
    assert read_commit(tmp_path) is None


def test_the_record_names_the_token_of_the_job_that_wrote_it(tmp_path):
    token = fencing.advance(tmp_path, "ffff")
    fencing.set_mine(token)
    write_commit(tmp_path, 5)
    assert read_commit(tmp_path).token == token
