"""compare: exact differences on synthetic runs, the plot, the CLI entry, and bad input."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from nanotron_recover.compare import (
    add_compare_arguments,
    compare_runs,
    format_comparison,
    plot_comparison,
    run_compare,
)
from nanotron_recover.errors import InputError
from nanotron_recover.logging import ids_digest


def _write_run(
    run_dir: Path,
    losses: dict[int, float],
    replicas: dict[int, int] | None = None,
    incidents: list[dict] | None = None,
    ids_shift: dict[int, int] | None = None,
) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step, loss in losses.items():
        shift = (ids_shift or {}).get(step, 0)
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "loss": loss,
                    "replicas": (replicas or {}).get(step, 4),
                    "ids_digest": ids_digest(range(8 * step + shift, 8 * step + 8 + shift)),
                }
            )
        )
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if incidents is not None:
        (run_dir / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in incidents))
    return run_dir


REF_LOSSES = {1: 4.0, 2: 3.5, 3: 3.0, 4: 2.5, 5: 2.0}


def test_exact_differences_and_digest_agreement(tmp_path: Path) -> None:
    ref = _write_run(tmp_path / "plain", REF_LOSSES)
    # recover: steps 1-4 only; step 1 off by 0.5 (rel 0.125), step 4 by 0.375 (rel 0.15): the
    # largest absolute and relative differences come from different steps.
    recover = _write_run(
        tmp_path / "recover",
        {1: 4.5, 2: 3.5, 3: 3.0, 4: 2.875},
        replicas={1: 4, 2: 3, 3: 3, 4: 2},
        incidents=[{"step": 2, "failed_replicas": [1]}, {"step": 4, "failed_replicas": [3]}],
    )
    result = compare_runs([ref, recover])
    (c,) = result.comparisons
    assert c.name == "recover"
    assert c.common_steps == 4
    assert c.max_abs_loss_diff == 0.5
    assert c.max_rel_loss_diff == 0.375 / 2.5
    assert c.digests_agree is True and c.first_digest_mismatch is None
    assert c.incidents == 2
    assert result.reference.incident_steps == [] and result.runs[1].incident_steps == [2, 4]

    table = format_comparison(result)
    rows = table.splitlines()
    assert rows[0].split() == [
        "run",
        "steps",
        "common",
        "max",
        "|dloss|",
        "max",
        "rel",
        "dloss",
        "ids_digest",
        "incidents",
    ]
    assert rows[2].split() == ["plain", "(ref)", "5", "-", "-", "-", "-", "0"]
    assert rows[3].split() == ["recover", "4", "4", "5.000e-01", "1.500e-01", "agree", "2"]


def test_identical_runs_and_digest_disagreement(tmp_path: Path) -> None:
    ref = _write_run(tmp_path / "a", REF_LOSSES)
    same = _write_run(tmp_path / "b", REF_LOSSES)
    shifted = _write_run(tmp_path / "c", REF_LOSSES, ids_shift={3: 1, 5: 1})
    result = compare_runs([ref, same, shifted])
    b, c = result.comparisons
    assert (b.max_abs_loss_diff, b.max_rel_loss_diff, b.digests_agree) == (0.0, 0.0, True)
    assert c.digests_agree is False and c.first_digest_mismatch == 3
    assert c.max_abs_loss_diff == 0.0
    table = format_comparison(result)
    assert "differ@3" in table and "agree" in table


def test_nan_no_overlap_and_missing_digests(tmp_path: Path) -> None:
    ref = _write_run(tmp_path / "ref", {1: 4.0, 2: 3.0})
    # json.dumps writes NaN as the bare token NaN, which json.loads reads back.
    nan_run = _write_run(tmp_path / "nan", {1: 4.0, 2: float("nan")})
    later = _write_run(tmp_path / "later", {7: 1.0})
    no_digest = tmp_path / "nodigest"
    no_digest.mkdir()
    (no_digest / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.0}\n{"step": 3, "lo'
    )
    result = compare_runs([ref, nan_run, later, no_digest])
    nan_c, later_c, nodig_c = result.comparisons
    assert math.isinf(nan_c.max_abs_loss_diff) and math.isinf(nan_c.max_rel_loss_diff)
    assert later_c.common_steps == 0 and later_c.max_abs_loss_diff is None and later_c.digests_agree is None
    # The torn last line is dropped; no digests on one side: nothing to say about them.
    assert nodig_c.common_steps == 2 and nodig_c.max_abs_loss_diff == 0.0 and nodig_c.digests_agree is None
    assert "n/a" in format_comparison(result)


def test_plot_is_a_valid_png(tmp_path: Path) -> None:
    from matplotlib.image import imread

    ref = _write_run(tmp_path / "plain", REF_LOSSES)
    recover = _write_run(
        tmp_path / "recover",
        {1: 4.0, 2: 3.6, 3: 3.1, 4: 2.6, 5: 2.1},
        replicas={1: 4, 2: 3, 3: 3, 4: 3, 5: 2},
        incidents=[{"step": 2}, {"step": 5}],
    )
    out = plot_comparison(compare_runs([ref, recover]), tmp_path / "plots" / "cmp.png")
    assert out == tmp_path / "plots" / "cmp.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(out)
    assert image.shape[0] > 0 and image.shape[1] > 0
    assert image.shape[:2] == (700, 1000)  # figsize 10x7 inches at 100 dpi


def test_same_folder_names_are_told_apart(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "x" / "recover", REF_LOSSES)
    b = _write_run(tmp_path / "y" / "recover", REF_LOSSES)
    result = compare_runs([a, b])
    assert [r.name for r in result.runs] == ["x/recover", "y/recover"]


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        compare_runs([tmp_path / "nope"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=str(empty / "metrics.jsonl")):
        compare_runs([empty])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2, "loss": 1}\n')
    with pytest.raises(InputError, match="metrics.jsonl:2"):
        compare_runs([bad])
    with pytest.raises(InputError):
        compare_runs([])


def test_cli_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = _write_run(tmp_path / "plain", REF_LOSSES)
    other = _write_run(tmp_path / "recover", REF_LOSSES, incidents=[{"step": 3}])
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    out_png = tmp_path / "cmp.png"
    args = parser.parse_args([str(ref), str(other), "--out", str(out_png)])
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    assert "recover" in printed and "agree" in printed and f"wrote {out_png}" in printed
    assert out_png.is_file()
    assert run_compare(parser.parse_args([str(ref)])) == 0  # a lone run: its row, no plot
