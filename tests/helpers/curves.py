"""The two checks every fault test makes: the same loss curve as the reference run, and surviving
replicas bitwise identical (from the parameter digests each rank writes at the end of a run)."""

from __future__ import annotations

from pathlib import Path

import pytest


def assert_same_curve(
    got: list[dict], want: list[dict], rel: float = 1e-5, grad_norm_rel: float | None = None
) -> None:
    """Step by step: the same steps, the same micro-batch ids, the loss within ``rel``."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g["ids_digest"] == w["ids_digest"], f"step {g['step']} consumed other micro-batches"
        assert g["loss"] == pytest.approx(w["loss"], rel=rel), f"step {g['step']}: {g['loss']} vs {w['loss']}"
        if grad_norm_rel is not None:
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=grad_norm_rel), f"step {g['step']}"


def assert_replicas_identical(run_dir: Path, survivors: list[int]) -> None:
    """Exactly the ``survivors`` finished, and at every (pp, tp) coordinate (HSDP: shard index, each
    holding the full model's digest) their parameters are bitwise identical."""
    digests: dict[tuple[str, str], set[str]] = {}
    seen = set()
    for f in (run_dir / "parameters").glob("replica*_pp*_tp*.sha256"):
        replica, pp, tp = f.stem.split("_")
        seen.add(int(replica.removeprefix("replica")))
        digests.setdefault((pp, tp), set()).add(f.read_text().strip())
    assert seen == set(survivors), "only the survivors finish, and all of them do"
    for coord, values in digests.items():
        assert len(values) == 1, f"surviving replicas differ at {coord}"
