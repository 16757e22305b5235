"""The this-machine prediction of ``benchmarks/faults.py`` and its error against a measurement.

``benchmarks/faults.py --quick`` trains the tiny LLaMA on ``W`` replicas (``batch_accumulation = 2``)
for ``S`` steps, a replica killed in the forward pass of its first micro-batch every ``k`` steps
until half are gone, once with forward recovery (``recover``) and once with checkpoint-restart
every ``N`` steps (``ckpt-restart-N``). :func:`predict` runs the event model with the
``this-machine`` profile on the same config and schedule, and computes what faults.py reports, the
way it computes it:

- effective tokens/s per rank: committed tokens over the whole wall time (start-up and exit
  included) over the initial ranks;
- mean stall per fault: forward, the fault step's time minus the median step time of the run;
  checkpoint-restart, the failure to the *last* commit of the failed step (the incident's
  ``stall_s``: a later fault that makes the job recompute the step moves that commit).

:func:`compare` gives one row per (run, quantity) with the relative error; ``TOLERANCE`` is the
target. The comparison is deterministic: the measurements are read from a faults.json.
"""

from __future__ import annotations

import statistics

from ..config import Config, load_config
from ..demo import tiny_config_path
from .constants import Profile, get_profile
from .events import CKPT, FORWARD, Fault, Run, simulate
from .workload import build_workload

TOLERANCE = 0.25
QUANTITIES = ("effective_tokens_per_s_per_rank", "mean_stall_s")


def faults_config(replicas: int, steps: int) -> Config:
    """The config benchmarks/faults.py trains (tiny LLaMA, ``replicas`` x 2 micro-batches)."""
    overrides = [
        f"parallelism.dp={replicas}",
        "tokens.batch_accumulation_per_replica=2",
        f"tokens.train_steps={steps}",
    ]
    return load_config(tiny_config_path(), overrides, check_paths=False)


def schedule(measured: dict) -> list[Fault]:
    """faults.json's fault list as the model's faults (forward pass of the first micro-batch)."""
    return [Fault(step=f["step"], at=0.0, replica=f["replica"]) for f in measured["faults"]]


def forward_stalls(run: Run) -> list[float]:
    """faults.py's forward stall: the fault step's time minus the run's median step time."""
    median = statistics.median(run.step_s.values())
    return [run.step_s[s] - median for s in sorted({f.step for f in run.faults})]


def predict(measured: dict, profile: Profile | None = None) -> dict[str, dict[str, float]]:
    """What faults.py would report for every run of ``measured`` (a faults.json), by the model."""
    profile = profile or get_profile("this-machine")
    steps = measured["steps"]
    wl = build_workload(faults_config(measured["replicas"], steps), profile)
    faults = schedule(measured)
    out: dict[str, dict[str, float]] = {}
    for r in measured["runs"]:
        name = r["run"]
        if name == "recover":
            run = simulate(wl, profile, FORWARD, faults, steps)
            stalls = forward_stalls(run)
        elif name.startswith("ckpt-restart-"):
            run = simulate(wl, profile, CKPT, faults, steps, interval=int(name.rsplit("-", 1)[1]))
            stalls = [f.stall_last_s for f in run.faults]
        else:
            continue  # the plain run has no faults to model
        out[name] = {
            "effective_tokens_per_s_per_rank": steps * wl.tokens_per_step / run.wall_s / wl.ranks,
            "mean_stall_s": statistics.mean(stalls) if stalls else 0.0,
            "wall_s": run.wall_s,
        }
    return out


def compare(measured: dict, profile: Profile | None = None) -> list[dict]:
    """Rows ``{run, quantity, measured, predicted, error}``, error = predicted / measured - 1."""
    predicted = predict(measured, profile)
    rows = []
    for r in measured["runs"]:
        if r["run"] not in predicted:
            continue
        for q in ("wall_s", *QUANTITIES):
            m, p = float(r[q]), predicted[r["run"]][q]
            rows.append({"run": r["run"], "quantity": q, "measured": m, "predicted": p, "error": p / m - 1})
    return rows
