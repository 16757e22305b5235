"""The tests' own check of a finished run: exit 0 is not enough for a ``train`` run under ULFM's
``mpirun``, which exits 0 when every rank died by a signal."""

from __future__ import annotations

import pytest

from nanotron_recover.outcome import write_outcome
from tests.helpers.mpirun_utils import Completed, check, train_run_dir


def test_the_run_folder_of_a_train_command():
    assert train_run_dir(["train", "--config", "c.yaml", "--run-dir", "/r"]).as_posix() == "/r"
    assert train_run_dir(["train", "--run-dir=/r", "--set", "a=1"]).as_posix() == "/r"
    assert train_run_dir(["train", "--run-dir", "/r", "--dry-run"]) is None
    assert train_run_dir(["launch", "--run-dir", "/r"]) is None
    assert train_run_dir(["train", "--config", "c.yaml"]) is None


def test_exit_0_without_an_outcome_or_with_a_failed_one_fails(tmp_path):
    with pytest.raises(AssertionError, match="wrote no outcome"):
        check(Completed(0, "step 4/10", "", run_dir=tmp_path))
    write_outcome(tmp_path, status="stopped", last_step=4, target_step=10, exit_code=5, message="hang")
    with pytest.raises(AssertionError, match="outcome says"):
        check(Completed(0, "", "", run_dir=tmp_path))
    write_outcome(tmp_path, status="completed", last_step=4, target_step=10, exit_code=0)
    with pytest.raises(AssertionError, match="completed short"):
        check(Completed(0, "", "", run_dir=tmp_path))
    write_outcome(tmp_path, status="completed", last_step=10, target_step=10, exit_code=0)
    assert check(Completed(0, "", "", run_dir=tmp_path)).returncode == 0
    with pytest.raises(AssertionError, match="exit 3"):
        check(Completed(3, "", "", run_dir=tmp_path))
