"""RunLogger: offline runs read back from the ``.wandb`` file they write (``tests/helpers/wandb_offline.py``),
and every failure path a no-op."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from nanotron_recover.logging import wandb_logger
from nanotron_recover.logging.wandb_logger import (
    RunLogger,
    WandbArgs,
    resolve_mode,
    run_name_for,
    run_name_for_config,
)
from tests.helpers.wandb_offline import read_offline_run

try:
    import wandb
except ImportError:  # the no-op paths are tested either way
    wandb = None
needs_wandb = pytest.mark.skipif(wandb is None, reason="wandb is not installed")


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network, no real credentials, nothing written outside tmp_path; warnings re-armed."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setattr(wandb_logger, "_warned", False)


def _record(step: int, loss: float) -> dict[str, Any]:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": 0.5,
        "tokens": 1024,
        "consumed_tokens": 1024 * step,
        "step_time_s": 0.25,
        "tokens_per_s": 4096.0,
        "replicas": 4 if step < 2 else 3,
        "ids_digest": f"digest{step}",
        "world_epoch": 0 if step < 2 else 1,
        "g_cur": 2,
        "g_ext": 0,
    }


INCIDENT = {
    "step": 2,
    "phase": "backward",
    "failed_replicas": [1],
    "failed_ranks": [2, 3],
    "epoch": 1,
    "action": "promote_spare",
    "lost_ids": [8, 9],
    "extra_microbatches": 2,
    "detect_s": None,
    "recover_s": 0.125,
    "shrink_s": 0.01,
    "rounds": 1,
    "alive_replicas": [0, 2, 3],
}

REJOIN = {
    "step": 3,
    "kind": "rejoin",
    "status": "joined",
    "replicas": [1],
    "spawned_ranks": [2, 3],
    "orphans_reused": [],
    "state_bytes": 1024,
    "transfer_s": 0.25,
    "spawn_s": 2.5,
    "join_s": 4.0,
    "epoch": 2,
    "alive_replicas": [0, 1, 2, 3],
}


def test_run_names() -> None:
    assert run_name_for("plain") == "plain"
    assert run_name_for("recover") == run_name_for("forward") == "recover"
    assert run_name_for("ckpt-restart", 50) == run_name_for("checkpoint_restart", 50) == "ckpt-restart-50"
    with pytest.raises(ValueError):
        run_name_for("ckpt-restart")
    with pytest.raises(ValueError):
        run_name_for("bogus")


def test_run_name_from_config() -> None:
    from types import SimpleNamespace

    from nanotron_recover.config.schema import Config

    cfg = Config()
    assert run_name_for_config(cfg) == "plain"
    cfg.recover.enabled = True
    assert run_name_for_config(cfg) == "recover"
    cfg = SimpleNamespace(
        recover=SimpleNamespace(enabled=True, mode="checkpoint_restart"),
        checkpoints=SimpleNamespace(checkpoint_interval=25),
    )
    assert run_name_for_config(cfg) == "ckpt-restart-25"


def test_mode_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert resolve_mode("online") == "online"  # explicit wins over WANDB_MODE=offline
    assert resolve_mode(None) == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert resolve_mode(None) == "offline"  # no key anywhere
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode(None) == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert resolve_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode(None) == "disabled"


def test_no_args_or_disabled_is_a_noop(tmp_path: Path) -> None:
    for args in (None, WandbArgs(mode="disabled")):
        logger = RunLogger.start(args, tmp_path, "plain", {})
        assert not logger.enabled
        logger.log_step(_record(1, 2.0))
        logger.log_incident(INCIDENT)
        logger.finish()
    assert not (tmp_path / "wandb").exists()


@needs_wandb
def test_offline_run_round_trip(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = WandbArgs(group="exp1")
    logger = RunLogger.start(
        args, run_dir, run_name_for("recover"), {"tokens": {"train_steps": 3}, "p": Path("x")}
    )
    assert logger.enabled
    losses = {1: 4.5, 2: 4.25, 3: 4.0}
    logger.log_step(_record(1, losses[1]))
    logger.log_incident(INCIDENT)  # the trainer reports a step's incidents before its metrics
    logger.log_step(_record(2, losses[2]))
    logger.log_step(_record(2, 99.0))  # a replayed step is skipped
    logger.log_incident(REJOIN)
    logger.log_step(_record(3, losses[3]))
    logger.finish()
    logger.finish()  # idempotent

    run = read_offline_run(run_dir)
    assert run["run"].display_name == "recover"
    assert run["run"].run_group == "exp1"
    assert run["run"].project == "nanotron-recover"
    assert run["config"]["tokens"] == {"train_steps": 3}
    assert run["config"]["p"] == "x"  # a Path, stored as text
    history = run["history"]
    assert sorted(history) == [1, 2, 3]
    for step, loss in losses.items():
        row = history[step]
        expected = _record(step, loss)
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "tokens",
            "consumed_tokens",
            "replicas",
            "world_epoch",
            "g_cur",
        ):
            assert row[key] == pytest.approx(expected[key]), (step, key)
        assert "step" not in row and "ids_digest" not in row
    assert history[2]["incident/failed_replicas"] == 1
    assert history[2]["incident/failed_ranks"] == 2
    assert history[2]["incident/alive_replicas"] == 3
    assert history[2]["incident/recover_s"] == pytest.approx(0.125)
    assert history[2]["incident/count"] == 1
    assert "incident/detect_s" not in history[2]  # null: not injected, unknown
    assert "incident/failed_replicas" not in history[1]
    assert run["summary"]["ids_digest"] == "digest3"
    assert run["summary"]["loss"] == pytest.approx(4.0)

    # The table is re-logged whole with every incident: the last one holds every row.
    tables = [
        json.loads(f.read_text())
        for f in (run["dir"] / "files" / "media" / "table").glob("incidents_*.table.json")
    ]
    table = max(tables, key=lambda t: len(t["data"]))
    assert table["columns"] == wandb_logger.INCIDENT_COLUMNS
    assert table["data"] == [
        [2, "backward", "promote_spare", "1", "2,3", 3, 1, 2, 2, None, 0.125],
        [3, "rejoin", "joined", "", "", 4, 2, 0, None, None, None],
    ]
    assert history[3]["incident/count"] == 2
    assert history[3]["incident/alive_replicas"] == 4
    for key in ("state_bytes", "transfer_s", "spawn_s", "join_s"):
        assert history[3][f"incident/{key}"] == pytest.approx(REJOIN[key]), key


@needs_wandb
def test_late_incident_goes_to_the_current_step(tmp_path: Path) -> None:
    logger = RunLogger.start(WandbArgs(), tmp_path, "recover", {})
    logger.log_step(_record(1, 3.0))
    logger.log_step(_record(2, 2.0))
    logger.log_incident({**INCIDENT, "step": 1})
    logger.finish()
    history = read_offline_run(tmp_path)["history"]
    assert history[2]["incident/count"] == 1 and "incident/count" not in history[1]


def test_missing_wandb_package_warns_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.warns(RuntimeWarning, match="not installed"):
        logger = RunLogger.start(WandbArgs(), tmp_path, "plain", {})
    assert not logger.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunLogger.start(WandbArgs(), tmp_path, "plain", {})  # no second warning


@needs_wandb
def test_init_failure_is_a_noop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken_init(**kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(RuntimeWarning, match="boom"):
        logger = RunLogger.start(WandbArgs(), tmp_path, "plain", {})
    assert not logger.enabled
    logger.log_step(_record(1, 1.0))
    logger.finish()


@needs_wandb
def test_online_failure_falls_back_to_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_init = wandb.init
    modes = []

    def init(**kwargs: Any) -> Any:
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise RuntimeError("no network")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    with pytest.warns(RuntimeWarning, match="logging offline"):
        logger = RunLogger.start(WandbArgs(mode="online"), tmp_path, "plain", {})
    assert modes == ["online", "offline"] and logger.enabled
    logger.log_step(_record(1, 1.5))
    logger.finish()
    assert read_offline_run(tmp_path)["history"][1]["loss"] == 1.5


def test_a_failing_call_disables_logging() -> None:
    class FlakyRun:
        summary: dict[str, Any] = {}
        finished = False

        def log(self, data: dict[str, Any], step: int) -> None:
            raise ConnectionError("lost the service")

        def finish(self, exit_code: int | None = None) -> None:
            self.finished = True

    run = FlakyRun()
    logger = RunLogger(run)
    with pytest.warns(RuntimeWarning, match="lost the service"):
        logger.log_step(_record(1, 1.0))
    assert not logger.enabled and run.finished
    logger.log_step(_record(2, 1.0))  # no-op now
    logger.finish()
