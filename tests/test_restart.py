"""The checkpoint-restart baseline: a job whose ranks really SIGKILL themselves is relaunched from
its last (asynchronous) checkpoint and ends with exactly the plain run's per-step losses."""

from __future__ import annotations

import json

import pytest
from mpirun_utils import REPO, check, run_cli

from nanotron_recover.logging import read_incidents, read_metrics

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 10


def sets(run_dir, corpus, extra):
    out = []
    for s in [
        f"tokens.train_steps={STEPS}",
        "parallelism.dp=2",
        f"data_stages.0.data.dataset={{dataset_folder: {corpus}}}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        *extra,
    ]:
        out += ["--set", s]
    return out


def test_two_faults_two_restarts_same_curve(tmp_path, local_dataset):
    corpus = local_dataset.corpus_dir
    plain_dir, ckr_dir = tmp_path / "plain", tmp_path / "ckr"
    check(run_cli(["launch", "--config", CONFIG, "--run-dir", str(plain_dir), *sets(plain_dir, corpus, [])]))
    faults = [{"step": 5, "replica": 1, "phase": "backward"}, {"step": 8, "replica": 0, "phase": "forward"}]
    extra = [
        "recover.enabled=true",
        "recover.mode=checkpoint_restart",
        "checkpoints.checkpoint_interval=3",
        f"recover.faults={json.dumps(faults)}",
    ]
    result = check(
        run_cli(["launch", "--config", CONFIG, "--run-dir", str(ckr_dir), *sets(ckr_dir, corpus, extra)])
    )
    assert result.output.count("relaunching from the checkpoint") == 2

    plain, ckr = read_metrics(plain_dir), read_metrics(ckr_dir)
    assert [r["step"] for r in ckr] == list(range(1, STEPS + 1)), "each step logged once, from its final run"
    for p, c in zip(plain, ckr, strict=True):
        assert c["ids_digest"] == p["ids_digest"]
        assert c["loss"] == pytest.approx(p["loss"], rel=1e-6), f"step {c['step']}"

    incidents = read_incidents(ckr_dir)
    assert [i["restart"] for i in incidents] == [1, 2]
    assert [(i["step"], i["phase"], i["failed_replicas"]) for i in incidents] == [
        (5, "backward", [1]),
        (8, "forward", [0]),
    ]
    assert [i["resumed_from_step"] for i in incidents] == [3, 6]
    assert [i["recomputed_steps"] for i in incidents] == [1, 1]
    assert all(i["stall_s"] > 0 for i in incidents)


def test_a_failing_launch_is_not_restarted_forever(tmp_path):
    """A job that dies without progress and without an injected fault is a real error."""
    run_dir = tmp_path / "bad"
    extra = [
        "recover.enabled=true",
        "recover.mode=checkpoint_restart",
        "checkpoints.checkpoint_interval=3",
        # The dataset folder exists but is not a corpus: every rank fails at start-up.
        f"data_stages.0.data.dataset={{dataset_folder: {tmp_path}}}",
    ]
    args = ["launch", "--config", CONFIG, "--run-dir", str(run_dir)]
    for s in [f"tokens.train_steps={STEPS}", "parallelism.dp=2", *extra]:
        args += ["--set", s]
    result = run_cli(args, timeout=120)
    assert result.returncode != 0
    assert "without progress: not restarting" in result.output


def test_restart_incidents_reach_wandb(tmp_path, monkeypatch):
    """The launcher's restart incidents (with their stall) go to incidents.jsonl and to W&B."""
    from test_wandb_logger import read_offline_run

    from nanotron_recover.config import load_config
    from nanotron_recover.restart import Restart, _write_incidents

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    cfg = load_config(
        CONFIG,
        [
            "recover.enabled=true",
            "recover.mode=checkpoint_restart",
            "checkpoints.checkpoint_interval=2",
            "logging.wandb={project: test, group: g, mode: offline}",
        ],
        check_paths=False,
    )
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time": 100.0 + s}) + "\n" for s in range(1, 7))
    )
    restart = Restart(
        1,
        failed_at=103.5,
        step=4,
        phase="forward",
        failed_replicas=[1],
        failed_ranks=[1],
        resumed_from_step=2,
        exit_code=137,
    )
    _write_incidents(cfg, tmp_path, [restart])

    (incident,) = read_incidents(tmp_path)
    assert incident["stall_s"] == pytest.approx(0.5), "step 4 recommitted at t=104, death at 103.5"
    assert incident["recomputed_steps"] == 1
    run = read_offline_run(tmp_path)
    assert run["run"].display_name == "ckpt-restart-2-restarts"
    assert run["run"].run_group == "g"
    assert run["history"][4]["incident/stall_s"] == pytest.approx(0.5)
    assert run["history"][4]["incident/restart"] == 1
