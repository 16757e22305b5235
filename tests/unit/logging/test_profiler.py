"""The ``profiler:`` section: Nanotron's schedule, its validation, and traces of a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanotron_recover.config import ConfigError, load_config
from nanotron_recover.config.schema import ProfilerArgs
from nanotron_recover.logging.profiler import StepProfiler
from tests.helpers.mpirun_utils import REPO, check, run_cli

TINY = REPO / "configs" / "tiny_cpu.yaml"


def args(tmp_path: Path | None = None, **kw) -> ProfilerArgs:
    kw.setdefault("with_stack", False)  # stacks make traces slow to write and large
    return ProfilerArgs(profiler_export_path=tmp_path, **kw)


def events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"]


# -- the schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "steps", "recorded"),
    [
        # Nanotron's defaults: step n runs under schedule step n, so skip_first 3 covers steps 1-2.
        ({}, 10, [5]),
        ({"skip_first": 0, "wait": 0, "warmup": 1, "active": 1}, 5, [1]),
        ({"skip_first": 1, "wait": 1, "warmup": 1, "active": 2, "repeat": 2}, 12, [3, 4, 7, 8]),
        # repeat 0: cycles until the end of training.
        ({"skip_first": 0, "wait": 1, "warmup": 1, "active": 1, "repeat": 0}, 9, [2, 5, 8]),
        ({"skip_first": 20}, 10, []),
    ],
)
def test_recorded_steps_follow_nanotrons_schedule(kw: dict, steps: int, recorded: list[int]):
    assert StepProfiler.recorded_steps(args(**kw), steps) == recorded


def test_one_trace_per_cycle_holds_the_recorded_steps(tmp_path: Path):
    a = args(tmp_path, skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    profiler = StepProfiler.for_run(a, "run", "replica0_pp0_tp0")
    with profiler:
        for step in range(1, 11):
            profiler.step(step)
            with torch.profiler.record_function(f"step{step}"):
                torch.randn(32, 32) @ torch.randn(32, 32)
    assert [p.name for p in profiler.written] == [
        "replica0_pp0_tp0.step4.pt.trace.json",
        "replica0_pp0_tp0.step8.pt.trace.json",
    ]
    assert all(p.parent == tmp_path / "run" for p in profiler.written)
    for path, steps in zip(profiler.written, ([3, 4], [7, 8]), strict=True):
        names = {e.get("name") for e in events(path)}
        assert {f"step{s}" for s in steps} <= names
        assert not {f"step{s}" for s in range(1, 11) if s not in steps} & names


def test_a_cycle_cut_short_by_the_end_of_training_is_still_written(tmp_path: Path):
    profiler = StepProfiler.for_run(args(tmp_path, skip_first=0, wait=0, warmup=1, active=5), "r", "w")
    with profiler:
        for step in (7, 8):  # a resumed run: two steps, numbered from its checkpoint
            profiler.step(step)
    assert [p.name for p in profiler.written] == ["w.step8.pt.trace.json"]


def test_no_export_path_means_no_profiler():
    assert StepProfiler.for_run(None, "r", "w") is None
    assert StepProfiler.for_run(args(None), "r", "w") is None


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "profiler={profiler_export_path: tb}",
            "profiler: skip_first + repeat * (wait + warmup + active) = 6 steps is longer than the run "
            "(tokens.train_steps=5): shorten the profiling window or train longer",
        ),
        ("profiler={profiler_export_path: tb, active: 0}", "profiler.active must be >= 1"),
        ("profiler={profiler_export_path: tb, wait: -1}", "profiler.wait must be >= 0, got -1"),
        ("profiler={profiler_export_path: tb, repeat: -2}", "profiler.repeat must be >= 0, got -2"),
        ("profiler={export_path: tb}", "unknown key 'export_path' in section 'profiler'"),
    ],
)
def test_a_profiler_that_cannot_run_is_refused_in_one_line(override: str, message: str):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["tokens.train_steps=5", override])
    assert str(info.value).startswith(message)


def test_a_window_that_fits_the_run_loads_with_nanotrons_fields():
    cfg = load_config(
        TINY,
        [
            "tokens.train_steps=6",
            "profiler={profiler_export_path: tb, record_shapes: true, profile_memory: true, "
            "with_stack: false, export_chrome_trace: true}",
        ],
    )
    assert cfg.profiler == ProfilerArgs(
        profiler_export_path=Path("tb"),
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
        export_chrome_trace=True,
    )


# -- a real run --------------------------------------------------------------------------------------
def test_a_training_run_leaves_a_trace_of_its_profiled_step_and_a_benchmark_row(tmp_path: Path):
    """One rank, three steps: step 2 is recorded; the trace is Chrome-trace JSON holding the
    training step's work, and the benchmark CSV gets its header and one row."""
    run_dir, traces, csv_path = tmp_path / "run", tmp_path / "traces", tmp_path / "out" / "bench.csv"
    sets = [
        "parallelism.dp=1",
        "tokens.batch_accumulation_per_replica=1",
        "tokens.train_steps=3",
        f"profiler={{profiler_export_path: {traces}, skip_first: 1, wait: 0, warmup: 1, active: 1, "
        "with_stack: false, record_shapes: true}",
        f"general.benchmark_csv_path={csv_path}",
    ]
    cmd = ["train", "--config", str(TINY), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    check(run_cli(cmd, timeout=180))

    written = sorted((traces / "run").iterdir())
    assert [p.name for p in written] == ["replica0_pp0_tp0.step2.pt.trace.json"]
    trace_events = events(written[0])
    names = {e.get("name", "") for e in trace_events}
    assert len(trace_events) > 50
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]

    header, *rows = csv_path.read_text().splitlines()
    assert len(rows) == 1
    row = dict(zip(header.split(","), rows[0].split(","), strict=True))
    expected = {"name": "tiny_cpu", "world_size": "1", "dp": "1", "tp": "1", "pp": "1", "seq_len": "64"}
    assert {key: row[key] for key in expected} == expected
    assert (row["mbs"], row["gbs"], row["steps_measured"]) == ("2", "2", "2")
    assert float(row["tokens_per_s"]) > 0 and float(row["tok/s/gpu"]) == float(row["tokens_per_s"])
