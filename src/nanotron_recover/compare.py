"""``nanotron-recover compare RUN_DIR ...``: do runs agree, and what did failures cost them?

Reads each run's ``metrics.jsonl`` (and ``incidents.jsonl`` when there is one). The first run is
the reference; for every other run it reports, over the steps both logged: how many there are,
the largest absolute and relative loss difference (relative to the reference's loss), and
whether every ``ids_digest`` agrees, i.e. whether both runs trained on exactly the same
micro-batches each step. A forward-recovery run that survived failures should match a failure-free
plain run on the digests and, up to reduction order, on the loss.

``--out FILE.png`` also draws two panels: the loss per step of every run overlaid, and the alive
replicas per step with a dashed vertical line at each incident.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .logging.jsonl import read_jsonl


@dataclass
class RunData:
    """One run's logs; ``steps`` maps step -> its metrics record (the last one if repeated)."""

    name: str
    path: Path
    steps: dict[int, dict[str, Any]]
    incidents: list[dict[str, Any]] = field(default_factory=list)

    @property
    def incident_steps(self) -> list[int]:
        return sorted(int(i["step"]) for i in self.incidents)


@dataclass
class RunComparison:
    """One run against the reference. Differences are None when no common step has a loss;
    ``digests_agree`` is None when no common step has a digest on both sides."""

    name: str
    common_steps: int
    max_abs_loss_diff: float | None
    max_rel_loss_diff: float | None
    digests_agree: bool | None
    first_digest_mismatch: int | None
    incidents: int


@dataclass
class ComparisonResult:
    runs: list[RunData]
    comparisons: list[RunComparison]  # one per run after the reference, in order

    @property
    def reference(self) -> RunData:
        return self.runs[0]


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"run directory {run_dir} does not exist")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise InputError(f"{metrics} not found: is {run_dir} the --run-dir of a training run?")
    steps: dict[int, dict[str, Any]] = {}
    for record in read_jsonl(metrics):
        if "step" not in record:
            raise InputError(f"{metrics}: a record has no 'step'")
        steps[int(record["step"])] = record
    incidents_path = run_dir / "incidents.jsonl"
    incidents = read_jsonl(incidents_path) if incidents_path.is_file() else []
    return RunData(name=run_dir.resolve().name, path=run_dir, steps=steps, incidents=incidents)


def _loss_diff(a: Any, b: Any) -> tuple[float, float] | None:
    """(absolute, relative to ``a``) difference of two losses; None if either is missing."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    if math.isnan(a) or math.isnan(b):
        # Both diverged alike counts as agreement; one NaN is as far apart as it gets.
        return (0.0, 0.0) if math.isnan(a) and math.isnan(b) else (math.inf, math.inf)
    diff = abs(a - b)
    if diff == 0:
        return 0.0, 0.0
    return diff, diff / abs(a) if a != 0 else math.inf


def compare_pair(ref: RunData, other: RunData) -> RunComparison:
    common = sorted(set(ref.steps) & set(other.steps))
    abs_diffs, rel_diffs = [], []
    compared_digests, mismatch = 0, None
    for step in common:
        r, o = ref.steps[step], other.steps[step]
        diff = _loss_diff(r.get("loss"), o.get("loss"))
        if diff is not None:
            abs_diffs.append(diff[0])
            rel_diffs.append(diff[1])
        if "ids_digest" in r and "ids_digest" in o:
            compared_digests += 1
            if r["ids_digest"] != o["ids_digest"] and mismatch is None:
                mismatch = step
    return RunComparison(
        name=other.name,
        common_steps=len(common),
        max_abs_loss_diff=max(abs_diffs) if abs_diffs else None,
        max_rel_loss_diff=max(rel_diffs) if rel_diffs else None,
        digests_agree=(mismatch is None) if compared_digests else None,
        first_digest_mismatch=mismatch,
        incidents=len(other.incidents),
    )


def compare_runs(run_dirs: list[Path]) -> ComparisonResult:
    """Load every run (the first is the reference) and compare each other run with it."""
    if not run_dirs:
        raise InputError("compare needs at least one run directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    _disambiguate_names(runs)
    return ComparisonResult(runs=runs, comparisons=[compare_pair(runs[0], r) for r in runs[1:]])


def _disambiguate_names(runs: list[RunData]) -> None:
    """Runs from different parents may share a folder name (a/recover, b/recover): the legend and
    the table need them apart, so such names get their parent folder too."""
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.3e}"


def format_comparison(result: ComparisonResult) -> str:
    """A plain-text table, one row per run, the reference first."""
    ref = result.reference
    header = ["run", "steps", "common", "max |dloss|", "max rel dloss", "ids_digest", "incidents"]
    rows = [[ref.name + " (ref)", str(len(ref.steps)), "-", "-", "-", "-", str(len(ref.incidents))]]
    for run, c in zip(result.runs[1:], result.comparisons, strict=True):
        if c.digests_agree is None:
            digests = "n/a"
        elif c.digests_agree:
            digests = "agree"
        else:
            digests = f"differ@{c.first_digest_mismatch}"
        rows.append(
            [
                c.name,
                str(len(run.steps)),
                str(c.common_steps),
                _fmt(c.max_abs_loss_diff),
                _fmt(c.max_rel_loss_diff),
                digests,
                str(c.incidents),
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        # The run name reads best left-aligned, numbers right-aligned.
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def plot_comparison(result: ComparisonResult, out_png: Path) -> Path:
    """Write the two-panel figure (loss; alive replicas with incidents) to ``out_png``."""
    # The object API with the Agg canvas: no pyplot, so no global backend is chosen or changed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rep = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    for i, run in enumerate(result.runs):
        color = f"C{i % 10}"
        loss_steps = [s for s in sorted(run.steps) if isinstance(run.steps[s].get("loss"), (int, float))]
        # Later runs are drawn dashed and thinner so a run that matches the reference stays visible.
        style = {"linewidth": 1.8 if i == 0 else 1.2, "linestyle": "-" if i == 0 else "--"}
        ax_loss.plot(
            loss_steps, [run.steps[s]["loss"] for s in loss_steps], color=color, label=run.name, **style
        )
        rep_steps = [s for s in sorted(run.steps) if isinstance(run.steps[s].get("replicas"), int)]
        ax_rep.step(
            rep_steps,
            [run.steps[s]["replicas"] for s in rep_steps],
            where="post",
            color=color,
            label=run.name,
            **style,
        )
        for step in run.incident_steps:
            ax_rep.axvline(step, color=color, linestyle=":", linewidth=1.0, alpha=0.8)
        # Markers on the run's own curve too: runs failing at the same step share one vertical line.
        marked = [s for s in run.incident_steps if isinstance(run.steps.get(s, {}).get("replicas"), int)]
        if marked:
            ax_rep.scatter(
                marked,
                [run.steps[s]["replicas"] for s in marked],
                color=color,
                marker="x",
                zorder=3,
                label=f"{run.name} incidents",
            )
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss per step")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)
    ax_rep.set_xlabel("step")
    ax_rep.set_ylabel("alive replicas")
    ax_rep.set_title("alive replicas (x and dotted line: incidents)")
    ax_rep.yaxis.get_major_locator().set_params(integer=True)
    ax_rep.grid(alpha=0.3)
    if any(r.incidents for r in result.runs):
        ax_rep.legend(loc="lower left", fontsize="small")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


# -- CLI ------------------------------------------------------------------------------------------
def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run directories; the first is the reference",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE.png", help="also plot loss and alive replicas to this PNG"
    )


def run_compare(args: argparse.Namespace) -> int:
    result = compare_runs(args.run_dirs)
    print(format_comparison(result), flush=True)
    if args.out is not None:
        print(f"wrote {plot_comparison(result, args.out)}", flush=True)
    return 0
