"""The commit deadline (``commit_deadline.py``): when a job that stopped committing steps counts
as stalled, with the bound derived from its own records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_recover.commit_deadline import CommitWatch, DeadlineArgs
from nanotron_recover.config import ConfigError
from nanotron_recover.config.recover import RecoverArgs

ARGS = DeadlineArgs(floor_s=60, steps=10, allowance_s=10, start_factor=3)


def commit(run_dir: Path, step: int, wall_s: float = 0.5, checkpoint_s: float = 0.0) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({"step": step, "loss": 1.0, "wall_s": wall_s, "checkpoint_s": checkpoint_s}) + "\n"
        )


def test_first_start_has_no_deadline_and_the_bound_is_derived_from_the_steps(tmp_path):
    watch = CommitWatch(tmp_path, ARGS, now=0.0)
    assert watch.poll(now=10_000.0) is None  # a first start of a large model may take long
    commit(tmp_path, 1, wall_s=0.5)
    assert watch.poll(now=10_020.0) is None
    assert watch.start_s == 10_020.0
    commit(tmp_path, 2, wall_s=0.5, checkpoint_s=7.0)
    commit(tmp_path, 3, wall_s=2.0)
    assert watch.poll(now=10_030.0) is None
    bound, why = watch.bound_s()
    # 60 floor + 10 x the median step (0.5) + the longest save (7) + 10 repair + the start (10020)
    assert bound == pytest.approx(60 + 5 + 7 + 10 + 10_020)
    assert "0.50 s a step" in why
    assert watch.poll(now=10_030.0 + bound) is None
    stalled = watch.poll(now=10_030.0 + bound + 1)
    assert stalled is not None and stalled.last_step == 3
    assert stalled.waited_s == pytest.approx(bound + 1)
    assert "no step committed for" in stalled.describe() and "after step 3" in stalled.describe()


def test_a_commit_resets_the_clock(tmp_path):
    commit(tmp_path, 1)
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=30), now=0.0)
    assert watch.poll(now=29.0) is None
    commit(tmp_path, 2)
    assert watch.poll(now=29.5) is None
    assert watch.poll(now=59.0) is None
    assert watch.poll(now=60.0) is not None


def test_a_relaunch_is_bounded_by_the_previous_start_and_its_rewrite_is_no_commit(tmp_path):
    for step in range(1, 11):
        commit(tmp_path, step)
    watch = CommitWatch(tmp_path, ARGS, previous_start_s=12.0, now=0.0)
    assert watch.poll(now=1.0) is None
    # The relaunched job's logging rank keeps the steps up to the restored one (8) and rewrites
    # the file: no commit, the clock of the start runs on.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:8]))
    assert watch.poll(now=2.0) is None and watch.last_commit is None
    bound, _ = watch.bound_s()
    assert bound == 60 + 3 * 12.0
    stalled = watch.poll(now=0.0 + bound + 0.5)
    assert stalled is not None and stalled.last_step is None and "since the launch" in stalled.describe()
    # The first redone step is a commit.
    watch = CommitWatch(tmp_path, ARGS, previous_start_s=12.0, now=0.0)
    commit(tmp_path, 9)
    assert watch.poll(now=5.0) is None and watch.last_commit == 5.0 and watch.start_s == 5.0


def test_a_rewrite_without_truncation_is_no_commit(tmp_path):
    for step in range(1, 5):
        commit(tmp_path, step)
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=30), now=0.0)
    commit(tmp_path, 5)
    assert watch.poll(now=1.0) is None and watch.last_commit == 1.0
    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text)  # a rank taking the logging role over
    watch.poll(now=20.0)
    assert watch.last_commit == 1.0
    assert watch.poll(now=31.5) is not None


def test_off_and_fixed(tmp_path):
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=0), previous_start_s=1.0, now=0.0)
    assert watch.poll(now=1e9) is None
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=5), now=0.0)
    assert watch.poll(now=5.0) is None and watch.poll(now=5.1) is not None  # even before a commit


def test_from_config():
    args = DeadlineArgs.from_recover(RecoverArgs(enabled=True, heartbeat_timeout_s=7.0))
    assert args.allowance_s == 14.0 and args.fixed_s is None
    assert DeadlineArgs.from_recover(RecoverArgs(enabled=True, commit_timeout_s=0)).off
    with pytest.raises(ConfigError, match="recover.commit_timeout_s must be >= 0"):
        RecoverArgs(enabled=True, commit_timeout_s=-1)


def test_after_a_silent_process_a_repair_bound_holds_not_the_stall_bound(tmp_path):
    watch = CommitWatch(tmp_path, ARGS, previous_start_s=5.0, now=0.0)
    commit(tmp_path, 1, wall_s=0.5)
    assert watch.poll(now=10.0) is None
    watch.note_loss(18.0)  # the heartbeat-file watch found a silent process
    repair, why = watch.repair_bound_s()
    assert repair == pytest.approx(10 + 10 * 0.5)  # 2 heartbeat timeouts + 10 typical steps, no floor
    assert "repair" in why
    assert watch.poll(now=18.0 + repair) is None
    stalled = watch.poll(now=18.0 + repair + 0.5)
    assert stalled is not None and stalled.last_step == 1
    assert stalled.waited_s == pytest.approx(8.0 + repair + 0.5)
    assert "went silent 8 s after that commit" in stalled.describe()
    assert watch.bound_s()[0] > 60  # the stall bound alone would have waited past the floor


def test_a_commit_after_the_silence_means_it_was_repaired(tmp_path):
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=45, allowance_s=10), now=0.0)
    commit(tmp_path, 1)
    assert watch.poll(now=1.0) is None
    watch.note_loss(2.0)
    commit(tmp_path, 2)  # the job repaired the step
    assert watch.poll(now=3.0) is None and watch.loss_at is None
    assert watch.poll(now=40.0) is None  # the fixed bound again
    watch.note_loss(2.5)  # a silence older than the newest commit is no loss
    assert watch.loss_at is None and watch.poll(now=47.0) is None and watch.poll(now=48.5) is not None


def test_no_repair_bound_before_the_first_commit_and_never_past_the_fixed_bound(tmp_path):
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=12, allowance_s=10), now=0.0)
    watch.note_loss(1.0)  # starting: the start-up bound holds
    assert watch.loss_at is None
    commit(tmp_path, 1, wall_s=1.0)
    assert watch.poll(now=2.0) is None
    watch.note_loss(3.0)
    assert watch.repair_bound_s()[0] == 12  # 10 + 10 x 1.0 capped by the fixed 12 s
    assert watch.poll(now=14.0) is None and watch.poll(now=15.5) is not None


def test_the_hosts_are_asked_once_per_probe_interval_while_no_step_commits(tmp_path):
    watch = CommitWatch(tmp_path, DeadlineArgs(fixed_s=45, probe_s=5, steps=10), now=0.0)
    assert not watch.overdue(now=1000.0)  # starting: a start-up is not a stall
    commit(tmp_path, 1, wall_s=0.3, checkpoint_s=1.0)
    assert watch.poll(now=10.0) is None
    after = watch.probe_after_s()
    assert after == pytest.approx(5 + 10 * 0.3 + 1.0)  # a heartbeat timeout + 10 steps + a save
    assert not watch.overdue(now=10.0 + after)
    assert watch.overdue(now=10.0 + after + 0.1)
    assert not watch.overdue(now=10.0 + after + 0.2)  # asked: not again at once
    assert watch.overdue(now=10.0 + 2 * after + 0.2)  # the stall goes on: asked again
    commit(tmp_path, 2, wall_s=0.3, checkpoint_s=1.0)
    assert watch.poll(now=40.0) is None
    assert not watch.overdue(now=40.0 + after)  # a commit restarts the clock
    assert watch.overdue(now=40.0 + after + 0.1)


def test_the_probe_interval_comes_from_the_heartbeat_timeout():
    args = DeadlineArgs.from_recover(RecoverArgs(enabled=True, heartbeat_timeout_s=7.0))
    assert args.probe_s == 7.0
