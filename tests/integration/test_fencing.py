"""A process of an older job that wakes up inside a newer one writes nothing: real processes.

The test stops the writer of a checkpoint (SIGSTOP, from outside) the moment its save's folder
appears: past its fencing check, before its publication (the model is made large enough, about
150 MB of shards, for the write to take a while). It stays stopped while the supervisor's token
advances and a newer job trains to the end in the same run directory. Woken up (SIGCONT), the old
writer finishes its save: every rename of its publication, its outcome, its digests and its
metrics are refused at the moment of writing, so ``latest``, ``outcome.json``, the parameter
digests and ``metrics.jsonl`` stay the newer job's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from nanotron_recover import fencing
from nanotron_recover.checkpoint import CheckpointReader
from nanotron_recover.commit_record import read_commit
from nanotron_recover.logging import read_metrics
from nanotron_recover.outcome import read_outcome
from nanotron_recover.supervisor import new_generation
from tests.helpers.mpirun_utils import REPO, BackgroundJob, layout, single_rank_env

pytestmark = pytest.mark.mpi

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 8


def train_args(run_dir: Path) -> list[str]:
    sets = [
        *layout(1, 1, 1, 2),
        # Large enough that writing a checkpoint takes a while (~150 MB with Adam's state).
        "model.model_config.hidden_size=512",
        "model.model_config.intermediate_size=1376",
        "model.model_config.num_hidden_layers=4",
        "model.model_config.num_attention_heads=8",
        "model.model_config.num_key_value_heads=8",
        f"tokens.train_steps={STEPS}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.checkpoint_interval=3",
        "checkpoints.resume_checkpoint_path=null",
        "recover.enabled=true",
    ]
    args = ["train", "--config", CONFIG, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return args


class TokenJob(BackgroundJob):
    """One ``train`` process holding ``token`` (as the supervisor hands it to a job it starts)."""

    def __init__(self, run_dir: Path, args: list[str], token: fencing.Token):
        import subprocess

        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanotron_recover.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=single_rank_env({fencing.ENV: str(token)}),
            cwd=REPO,
            start_new_session=True,
        )


def digests(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((run_dir / "parameters").glob("*.sha256"))}


def test_a_checkpoint_writer_stopped_before_its_publish_writes_nothing_once_a_newer_job_owns_the_run(
    tmp_path,
):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    old_token = new_generation(run_dir, fencing.new_nonce())
    old = TokenJob(run_dir, train_args(run_dir), old_token)
    new = None
    try:
        # The old job saves step 3; it is stopped inside its save of step 6.
        old.wait_until((ckpts / "step_6.tmp").exists, "the save of step 6", timeout=240)
        os.kill(old.proc.pid, signal.SIGSTOP)
        assert not (ckpts / "step_6").exists(), "stopped too late: published"
        assert CheckpointReader(ckpts).step == 3

        # The supervisor fences the old job and starts a newer one, which resumes from step 3; it
        # is held after committing step 4, before its own first save (which would sweep the old
        # save's folder away and so hide what the old writer does).
        new_token = new_generation(run_dir)
        assert new_token.generation == old_token.generation + 1
        new = TokenJob(run_dir, train_args(run_dir), new_token)

        def newer_committed_4() -> bool:
            record = read_commit(run_dir)
            return record is not None and record.token == new_token and record.step >= 4

        new.wait_until(newer_committed_4, "the newer job's step 4", timeout=240)
        os.kill(new.proc.pid, signal.SIGSTOP)
        metrics = (run_dir / "metrics.jsonl").read_text()

        # The old writer wakes up inside the newer job and finishes its save of step 6.
        os.kill(old.proc.pid, signal.SIGCONT)
        result = old.finish(timeout=120)
        assert result.returncode != 0, result.output[-3000:]
        assert f"holds fencing token {old_token}" in result.output, result.output[-3000:]
        assert CheckpointReader(ckpts).step == 3, "the old job moved latest"
        assert not (ckpts / "step_6").exists(), "the old job published its step 6"
        assert read_outcome(run_dir) is None, "the old job wrote the outcome"
        assert digests(run_dir) == {}, "the old job wrote parameter digests"
        assert (run_dir / "metrics.jsonl").read_text() == metrics
        assert read_commit(run_dir).token == new_token

        # The newer job goes on to the end: everything shared is its own.
        os.kill(new.proc.pid, signal.SIGCONT)
        done = new.finish(timeout=240)
    finally:
        old.kill()
        if new is not None:
            new.kill()
    assert done.returncode == 0, done.output[-3000:]
    outcome = read_outcome(run_dir)
    assert (outcome["status"], outcome["last_step"], outcome["token"]) == (
        "completed",
        STEPS,
        new_token.as_record(),
    )
    reader = CheckpointReader(ckpts)
    reader.verify()
    assert reader.step == STEPS
    for step in (6, STEPS):
        meta = json.loads((ckpts / f"step_{step}" / "meta.json").read_text())
        assert meta["token"] == new_token.as_record()
    assert digests(run_dir), "the newer job wrote no digests"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert not list(ckpts.glob("*.tmp")), "a save was left behind"
