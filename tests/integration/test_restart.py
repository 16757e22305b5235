"""The checkpoint-restart baseline: a job whose ranks really SIGKILL themselves is relaunched from
its last (asynchronous) checkpoint and ends with exactly the plain run's per-step losses; a run that
stops on bad input, an I/O error or a deterministic exception is never relaunched (the loop itself
is also driven with stand-in jobs that write the outcome record a real run would)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanotron_recover.errors import ExitCode
from nanotron_recover.logging import read_incidents, read_metrics
from tests.helpers.mpirun_utils import REPO, check, run_cli

pytestmark = pytest.mark.mpi

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


def test_a_run_stopped_on_bad_input_is_not_restarted(tmp_path):
    """Every rank meets the same bad input at start-up: the run records it, the launcher says it
    once and exits 2 instead of relaunching."""
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
    assert result.returncode == ExitCode.INPUT, result.output[-3000:]
    assert "the run stopped (input): not restarting" in result.output
    assert "relaunching" not in result.output
    message = f"dataset folder '{tmp_path}' holds no Nanoset files (*.ds)"
    assert result.output.count(message) == 1, result.output[-3000:]
    assert f"nanotron-recover launch: {message}" in result.stderr


# -- the restart loop with stand-in jobs ------------------------------------------------------------
def restart_cfg(**extra: str):
    from nanotron_recover.config import load_config

    sets = ["recover.enabled=true", "recover.mode=checkpoint_restart", "checkpoints.checkpoint_interval=2"]
    return load_config(CONFIG, sets + [f"{k}={v}" for k, v in extra.items()], check_paths=False)


def stand_in_job(tmp_path: Path, body: str) -> list[str]:
    """A Python script in place of mpirun; each launch appends a line to ``launches``."""
    script = tmp_path / "job.py"
    script.write_text(
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from nanotron_recover.outcome import write_outcome\n"
        f"run_dir, tmp = Path({str(tmp_path / 'run')!r}), Path({str(tmp_path)!r})\n"
        "with open(tmp / 'launches', 'a') as f:\n"
        "    f.write('x\\n')\n"
        "launch = len((tmp / 'launches').read_text().splitlines())\n" + body
    )
    return [sys.executable, str(script)]


@pytest.mark.parametrize(("kind", "code"), [("input", 2), ("io", 5), ("deterministic", 4)])
def test_stops_that_are_not_faults_are_never_relaunched(tmp_path, capsys, kind, code):
    from nanotron_recover.restart import run_with_restarts

    cmd = stand_in_job(
        tmp_path,
        "with open(run_dir / 'metrics.jsonl', 'a') as f:\n"
        "    f.write(json.dumps({'step': launch, 'time': time.time()}) + '\\n')\n"
        f"write_outcome(run_dir, status='stopped', last_step=launch, target_step=10, exit_code={code}, "
        f"kind={kind!r}, message='stopped: {kind}')\n"
        "sys.exit(1)\n",
    )
    run_dir = tmp_path / "run"
    assert run_with_restarts(restart_cfg(), run_dir, cmd, tmp_path / "ckpt", grace_s=1) == code
    assert (tmp_path / "launches").read_text().count("x") == 1
    err = capsys.readouterr().err
    assert f"the run stopped ({kind}): not restarting" in err
    assert err.count(f"stopped: {kind}") == 1


def test_a_failing_launch_without_progress_is_not_restarted(tmp_path, capsys):
    """A job that dies without progress, without an injected fault and without a record is a real
    error: one launch, then the supervisor's line and a non-zero status."""
    from nanotron_recover.restart import run_with_restarts

    cmd = stand_in_job(tmp_path, "sys.exit(7)\n")
    code = run_with_restarts(
        restart_cfg(), tmp_path / "run", cmd, tmp_path / "ckpt", grace_s=1, target_step=10
    )
    assert code == ExitCode.FAILED
    assert (tmp_path / "launches").read_text().count("x") == 1
    err = capsys.readouterr().err
    assert "launch failed (exit 7) without progress: not restarting" in err
    assert "every replica lost: the job ended without an outcome record" in err
    assert "last committed step 0 of 10" in err


def test_relaunches_after_progress_until_the_run_completes(tmp_path, capsys):
    """Each launch commits a step and dies (no record) until the third, which completes: two
    restarts, exit 0 from the last launch's record, and max_restarts bounds the loop."""
    from nanotron_recover.restart import run_with_restarts

    cmd = stand_in_job(
        tmp_path,
        "with open(run_dir / 'metrics.jsonl', 'a') as f:\n"
        "    f.write(json.dumps({'step': launch, 'time': time.time()}) + '\\n')\n"
        "if launch == 3:\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
        "sys.exit(0 if launch == 3 else 137)\n",
    )
    run_dir = tmp_path / "run"
    assert run_with_restarts(restart_cfg(), run_dir, cmd, tmp_path / "ckpt", grace_s=1) == 0
    assert [i["restart"] for i in read_incidents(run_dir)] == [1, 2]
    assert [i["exit_code"] for i in read_incidents(run_dir)] == [137, 137]

    (tmp_path / "launches").unlink()
    (run_dir / "metrics.jsonl").unlink()
    code = run_with_restarts(restart_cfg(**{"recover.max_restarts": "1"}), run_dir, cmd, tmp_path / "ckpt",
                             grace_s=1)  # fmt: skip
    assert code == ExitCode.FAILED
    assert "giving up after 1 restarts" in capsys.readouterr().err


def test_restart_incidents_reach_wandb(tmp_path, monkeypatch):
    """The launcher's restart incidents (with their stall) go to incidents.jsonl and to W&B."""
    from nanotron_recover.config import load_config
    from nanotron_recover.restart import Restart, _write_incidents
    from tests.helpers.wandb_offline import read_offline_run

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
