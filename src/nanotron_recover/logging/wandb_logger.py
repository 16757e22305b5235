"""Optional Weights & Biases logging of the per-step metrics and the incidents a run survived.

``metrics.jsonl`` and ``incidents.jsonl`` stay the source of truth; W&B is a mirror for dashboards.
It is therefore strictly best effort: when ``wandb`` is not installed, ``wandb.init`` fails (no
network, no API key, a broken install) or a later call raises, :class:`RunLogger` warns once and
turns into a no-op. Training never fails because of W&B.

Mode: an explicit ``mode`` in :class:`WandbArgs` wins; otherwise ``WANDB_MODE`` from the
environment; otherwise ``online`` when an API key is available (``WANDB_API_KEY`` or a netrc entry
for the W&B host) and ``offline`` when not. Offline runs are written under ``<run_dir>/wandb`` and
can be uploaded later with ``wandb sync <run_dir>/wandb/offline-run-*``. An online run whose init
fails (say the network is down) is retried offline before giving up.

The ``logging.wandb`` section itself (:class:`~nanotron_recover.config.schema.WandbArgs`) is part of
the config; this module imports ``wandb`` only inside :meth:`RunLogger.start`, so ``wandb`` is not a
hard dependency.
"""

from __future__ import annotations

import dataclasses
import math
import netrc
import os
import warnings
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config import WandbArgs

# Columns of the W&B incidents table, in order; lists are shown as text, counts as numbers.
INCIDENT_COLUMNS = [
    "step",
    "phase",
    "action",
    "failed_replicas",
    "failed_ranks",
    "alive_replicas",
    "epoch",
    "lost_microbatches",
    "extra_microbatches",
    "detect_s",
    "recover_s",
]


def run_name_for(mode: str, interval: int | None = None) -> str:
    """``plain``, ``recover`` or ``ckpt-restart-<interval>``: one name per way of surviving failures,
    so runs of the same experiment line up in one W&B group.

    ``mode`` is ``plain``, ``recover`` (or the config's ``forward``) or ``ckpt-restart`` (or the
    config's ``checkpoint_restart``); ``interval`` is the checkpoint interval, needed for the last.
    """
    if mode == "plain":
        return "plain"
    if mode in ("recover", "forward"):
        return "recover"
    if mode in ("ckpt-restart", "checkpoint_restart"):
        if interval is None:
            raise ValueError("run_name_for: ckpt-restart needs the checkpoint interval")
        return f"ckpt-restart-{interval}"
    raise ValueError(f"run_name_for: unknown mode {mode!r} (plain, recover or ckpt-restart)")


def run_name_for_config(cfg: Any) -> str:
    """:func:`run_name_for` applied to a loaded ``Config`` (read by attribute, no import needed)."""
    recover = cfg.recover
    if not recover.enabled:
        return run_name_for("plain")
    return run_name_for(recover.mode, cfg.checkpoints.checkpoint_interval)


def resolve_mode(mode: str | None) -> str:
    """The W&B mode to run in: ``mode`` if given, else ``WANDB_MODE``, else by API-key presence."""
    if mode is None:
        mode = os.environ.get("WANDB_MODE") or None
    if mode == "dryrun":  # wandb's old spelling of offline
        mode = "offline"
    if mode in ("online", "offline", "disabled"):
        return mode
    if mode is not None:
        raise ValueError(f"W&B mode must be online, offline or disabled, got {mode!r}")
    return "online" if _has_api_key() else "offline"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    # wandb login stores the key in netrc under the API host; only its presence matters here.
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"W&B logging disabled: {message}", RuntimeWarning, stacklevel=3)


def _json_safe(value: Any) -> Any:
    """Config values W&B can store: dataclasses become dicts, paths and other objects strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Enum):  # a name of the failure vocabulary: its plain string
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _init(wandb: Any, mode: str, init: dict[str, Any]) -> Any:
    # Why these settings: the trainer's console output already goes to its own log (wrapping
    # stdout under MPI only adds risk), and an unreachable server must cost a minute at most
    # before the fallback to offline.
    settings = wandb.Settings(console="off", silent=True, init_timeout=60)
    return wandb.init(mode=mode, settings=settings, **init)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RunLogger:
    """One W&B run, or nothing. Build it with :meth:`start`; every method is safe to call either way."""

    def __init__(self, run: Any = None):
        self._run = run
        self._last_step = 0
        self._incident_rows: list[list[Any]] = []

    @classmethod
    def start(
        cls, args: WandbArgs | None, run_dir: Path, run_name: str, config: Mapping[str, Any] | Any
    ) -> RunLogger:
        """Start a W&B run writing under ``<run_dir>/wandb``; a no-op logger when ``args`` is None,
        the mode resolves to ``disabled``, or W&B cannot start."""
        if args is None:
            return cls()
        try:
            mode = resolve_mode(args.mode)
        except ValueError as e:
            _warn_once(str(e))
            return cls()
        if mode == "disabled":
            return cls()
        try:
            import wandb
        except ImportError:
            _warn_once("the wandb package is not installed (pip install wandb)")
            return cls()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        init = dict(
            project=args.project,
            entity=args.entity,
            group=args.group,
            name=args.name or run_name,
            dir=str(run_dir),
            config=_json_safe(config),
        )
        try:
            return cls(_init(wandb, mode, init))
        except Exception as e:  # any W&B failure must leave training running
            if mode != "online":
                _warn_once(f"wandb.init failed: {e}")
                return cls()
            first_error = e
        try:
            run = cls(_init(wandb, "offline", init))
        except Exception as e:
            _warn_once(f"wandb.init failed online ({first_error}) and offline ({e})")
            return cls()
        warnings.warn(
            f"W&B online init failed ({first_error}); logging offline under {run_dir / 'wandb'}",
            RuntimeWarning,
            stacklevel=2,
        )
        return run

    @property
    def enabled(self) -> bool:
        return self._run is not None

    @property
    def run(self) -> Any:
        """The underlying ``wandb`` run (None when disabled), for anything this class does not cover."""
        return self._run

    def log_step(self, record: Mapping[str, Any]) -> None:
        """Log one metrics record at ``step=record["step"]``: numbers as metrics, text (ids_digest)
        into the summary. Steps at or before the last one logged are skipped, so a logger taking
        over can replay its recent history the way MetricsWriter does."""
        if self._run is None:
            return
        step = int(record["step"])
        if step <= self._last_step:
            return
        metrics = {k: v for k, v in record.items() if k != "step" and _is_number(v)}
        text = {k: v for k, v in record.items() if isinstance(v, str)}
        try:
            self._run.log(metrics, step=step)
            for key, value in text.items():
                self._run.summary[key] = value
        except Exception as e:
            self._fail(e)
            return
        self._last_step = step

    def log_incident(self, record: Mapping[str, Any]) -> None:
        """Log an incident record (see incidents.py) as ``incident/*`` metrics at its step and as a
        row of the ``incidents`` table (re-logged whole each time: incidents are rare, and a run
        that dies later still has every row so far)."""
        if self._run is None:
            return
        import wandb

        step = int(record["step"])
        row = [
            step,
            str(record.get("phase", record.get("kind", ""))),  # a re-join has no phase: its kind
            str(record.get("action", record.get("status", ""))),
            _as_text(record.get("failed_replicas")),
            _as_text(record.get("failed_ranks")),
            len(record.get("alive_replicas") or []),
            record.get("epoch"),
            len(record.get("lost_ids") or []),
            record.get("extra_microbatches"),
            record.get("detect_s"),
            record.get("recover_s"),
        ]
        self._incident_rows.append(row)
        metrics: dict[str, Any] = {
            "incident/count": len(self._incident_rows),
            "incident/failed_replicas": len(record.get("failed_replicas") or []),
            "incident/failed_ranks": len(record.get("failed_ranks") or []),
            "incident/lost_microbatches": row[7],
        }
        if record.get("alive_replicas") is not None:
            metrics["incident/alive_replicas"] = row[5]
        keys = ("epoch", "extra_microbatches", "detect_s", "recover_s", "shrink_s", "stall_s", "restart")
        # A re-join's own measures (kind rejoin): the state it moved and how long it took.
        keys += ("state_bytes", "transfer_s", "spawn_s", "join_s")
        for key in keys:
            value = record.get(key)
            if _is_number(value) and math.isfinite(value):
                metrics[f"incident/{key}"] = value
        metrics["incidents"] = wandb.Table(
            columns=INCIDENT_COLUMNS, data=[list(r) for r in self._incident_rows]
        )
        try:
            # W&B drops data for a step older than the last one logged; an incident reported late
            # goes to the current step (its true step is in the table row).
            self._run.log(metrics, step=max(step, self._last_step))
        except Exception as e:
            self._fail(e)

    def finish(self, exit_code: int | None = None) -> None:
        """Close the run (a nonzero ``exit_code`` marks it failed) and wait until W&B has written
        (or, online, uploaded) everything, so the run's files are complete on return; idempotent."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            import wandb

            run.finish(exit_code=exit_code)
            # run.finish() can return while the wandb-core service still holds records in memory;
            # teardown waits for the service to flush and exit (the next start spawns a new one).
            wandb.teardown(exit_code)
        except Exception as e:
            _warn_once(f"wandb finish failed: {e}")

    def _fail(self, error: Exception) -> None:
        _warn_once(f"W&B call failed: {error}")
        run, self._run = self._run, None
        try:
            run.finish(exit_code=1)
        except Exception:  # already disabled; nothing more to do
            pass


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)
