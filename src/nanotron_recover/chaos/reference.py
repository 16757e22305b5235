"""The fault-free reference a chaos campaign is judged against: the plain run of the same config.

The step contract makes a step's loss a function of the config only: step ``s`` sums micro-batches
``(s-1)*B .. s*B-1``, whatever the layout. So the reference is the cheapest run with the same
``B``: one process (tp = pp = dp = 1, ``B`` accumulation steps), forward recovery off (plain mode),
no injected faults, its own checkpoint folder. ``recover.exact`` is kept: with it on, the campaign's
job must match the reference bit for bit.

A reference is reused when one with the same key (the config file's bytes and the overrides the
reference runs with) completed before in the same folder: ``chaos_reference.json`` records the
key, and its ``metrics.jsonl`` must hold every step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import Config
from ..errors import InputError
from ..logging.metrics import read_metrics

RECORD = "chaos_reference.json"


def reference_sets(cfg: Config, sets: list[str], checkpoints: Path) -> list[str]:
    """The campaign's overrides, then what makes the same trajectory a one-process plain run."""
    sets = [s for s in sets if not s.startswith(("recover.faults", "recover.random_faults"))]
    p = cfg.parallelism
    layout = ["parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=1"]
    if getattr(p, "dp_shard", 1) != 1:
        layout.append("parallelism.dp_shard=1")
    return [
        *sets,
        *layout,
        f"tokens.batch_accumulation_per_replica={cfg.microbatches_per_step}",
        "recover.enabled=false",
        "recover.rejoin.mode=off",
        "recover.faults=[]",
        "recover.random_faults=null",
        f"checkpoints.checkpoints_path={checkpoints}",
        "checkpoints.checkpoint_interval=0",
        "checkpoints.resume_checkpoint_path=null",
    ]


def reference_key(config: Path, sets: list[str]) -> str:
    h = hashlib.sha256(Path(config).read_bytes())
    h.update(json.dumps(sets).encode())
    return h.hexdigest()[:16]


def _complete(ref_dir: Path, key: str, steps: int) -> bool:
    try:
        record = json.loads((ref_dir / RECORD).read_text())
        metrics = read_metrics(ref_dir)
    except (OSError, ValueError):
        return False
    return record.get("key") == key and [r["step"] for r in metrics] == list(range(1, steps + 1))


@dataclasses.dataclass
class PendingReference:
    """A reference run: found complete (``proc`` None) or started and still to be waited for.

    A campaign may start its reference and its job at the same time (:func:`start_reference`) and
    wait for the reference only when it judges the job: the reference then costs no wall time of
    its own, but takes CPU from the job while both run (the job's faults cost more, not less)."""

    ref_dir: Path
    reused: bool
    key: str
    steps: int
    record: dict
    proc: subprocess.Popen | None = None
    started: float = 0.0
    error: InputError | None = None  # why it failed, once known

    def wait(self, timeout_s: float) -> Path:
        """The reference's folder once it holds every step; an :class:`InputError` naming the log
        when the run failed or did not finish within ``timeout_s`` of its start (then it is
        killed), the same error at every later call."""
        if self.error is not None:
            raise self.error
        if self.proc is not None:
            proc, self.proc = self.proc, None
            left = max(1.0, timeout_s - (time.monotonic() - self.started))
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                self.error = InputError(
                    f"the plain reference run did not finish in {timeout_s:g} s ({self.ref_dir})"
                )
                raise self.error from None
            if rc != 0 or not _complete_steps(self.ref_dir, self.steps):
                tail = (self.ref_dir / "reference.log").read_text(errors="replace")[-2000:]
                self.error = InputError(
                    f"the plain reference run failed (exit {rc}), see {self.ref_dir}/reference.log:\n{tail}"
                )
                raise self.error
            (self.ref_dir / RECORD).write_text(json.dumps(self.record) + "\n")
        return self.ref_dir

    def check(self) -> None:
        """Raise the :meth:`wait` error now if the reference already ended without success."""
        if self.error is not None or (self.proc is not None and self.proc.poll() is not None):
            self.wait(timeout_s=1.0)

    def kill(self) -> None:
        """Stop a reference still running (a campaign given up before its judgement)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def start_reference(config: Path, cfg: Config, sets: list[str], ref_root: Path) -> PendingReference:
    """Find the reference complete in ``ref_root/<key>``, or start it there in the background."""
    steps = cfg.tokens.train_steps
    probe = reference_sets(cfg, sets, Path("CHECKPOINTS"))
    key = reference_key(config, probe)
    ref_dir = (ref_root / key).resolve()
    if _complete(ref_dir, key, steps):
        return PendingReference(ref_dir, True, key, steps, {})
    if ref_dir.exists():
        for name in ("metrics.jsonl", "outcome.json", RECORD):
            (ref_dir / name).unlink(missing_ok=True)
    ref_dir.mkdir(parents=True, exist_ok=True)
    ref_sets = reference_sets(cfg, sets, ref_dir / "checkpoints")
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "train", "--config", str(config)]
    cmd += ["--run-dir", str(ref_dir)] + [a for s in ref_sets for a in ("--set", s)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(ref_dir / "reference.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    record = {"key": key, "sets": ref_sets, "config": str(config)}
    return PendingReference(ref_dir, False, key, steps, record, proc, time.monotonic())


def ensure_reference(
    config: Path,
    cfg: Config,
    sets: list[str],
    ref_root: Path,
    *,
    timeout_s: float,
) -> tuple[Path, bool]:
    """The reference run's folder (run now, or reused when complete with the same key) and whether
    it was reused. ``ref_root/<key>`` holds it."""
    pending = start_reference(config, cfg, sets, ref_root)
    return pending.wait(timeout_s), pending.reused


def _complete_steps(ref_dir: Path, steps: int) -> bool:
    try:
        return [r["step"] for r in read_metrics(ref_dir)] == list(range(1, steps + 1))
    except (OSError, ValueError, KeyError):
        return False
