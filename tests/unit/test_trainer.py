"""DistributedTrainer: every step's metrics record says where the step's time went (timing.py),
and W&B receives the same fields; a run with ``checkpoints.keep_last`` ends with its newest
checkpoints only."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_recover.logging import read_metrics
from nanotron_recover.timing import PHASES
from tests.helpers.mpirun_utils import REPO, check, run_cli, single_rank_env

TINY = REPO / "configs" / "tiny_cpu.yaml"
FIELDS = [f"{p}_s" for p in PHASES] + ["reduce_bytes", "reduce_gbps", "wall_s"]


def test_every_step_record_carries_its_phase_times(tmp_path: Path):
    """One rank, four steps, a checkpoint after step 2 (it counts in step 3's record), W&B offline."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    sets = [
        "parallelism.dp=1",
        "tokens.batch_accumulation_per_replica=1",
        "tokens.train_steps=4",
        f"checkpoints.checkpoints_path={tmp_path / 'checkpoints'}",
        "checkpoints.checkpoint_interval=2",
        "checkpoints.save_final_state=false",
        "logging.wandb={project: test, group: g, mode: offline}",
    ]
    cmd = ["train", "--config", str(TINY), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = single_rank_env({"WANDB_SILENT": "true", "NETRC": str(tmp_path / "no-netrc")})
    env.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        env[var] = str(tmp_path / "wandb-home" / var.lower())
    check(run_cli(cmd, timeout=240, env=env))

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert all(r[f] >= 0 for f in FIELDS), r
        assert sum(r[f"{p}_s"] for p in PHASES) <= r["wall_s"], r
        assert r["step_time_s"] <= r["wall_s"]
        assert r["compute_s"] > 0 and r["optimizer_s"] > 0
        # One replica: nothing to reduce, gate or agree on, nothing to recover.
        assert r["reduce_bytes"] == 0 and r["gate_s"] == r["agree_s"] == r["recovery_s"] == 0
    assert records[2]["checkpoint_s"] > 0, "the save after step 2 counts in step 3"
    assert records[1]["checkpoint_s"] == records[3]["checkpoint_s"] == 0

    from tests.helpers.wandb_offline import read_offline_run

    history = read_offline_run(run_dir)["history"]
    for r in records:
        assert {f: history[r["step"]][f] for f in FIELDS} == pytest.approx({f: r[f] for f in FIELDS})


def test_a_run_with_keep_last_keeps_only_the_newest_checkpoints(tmp_path: Path):
    """Eight steps, a checkpoint every two, ``keep_last: 2``: the run ends with the last two, and
    ``latest`` names the newest."""
    ckpts = tmp_path / "checkpoints"
    sets = [
        "parallelism.dp=1",
        "tokens.batch_accumulation_per_replica=1",
        "tokens.train_steps=8",
        f"checkpoints.checkpoints_path={ckpts}",
        "checkpoints.checkpoint_interval=2",
        "checkpoints.keep_last=2",
    ]
    cmd = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        cmd += ["--set", s]
    check(run_cli(cmd, timeout=240, env=single_rank_env()))
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_6", "step_8"]
    assert (ckpts / "latest").read_text().strip() == "step_8"
