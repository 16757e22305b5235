"""The plain trainer is the fault-free reference: real multi-process runs on CPU (gloo).

- Layout invariance: the loss of step t depends only on the config, not on tp/pp/dp or the
  pipeline schedule, and every layout consumes the same micro-batch ids per step.
- Resume: stopping after step 5 and resuming gives the per-step losses of never stopping, on the
  same layout (bitwise) and on another layout (resharded weights and optimizer state).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_recover.logging import read_metrics
from tests.helpers.curves import assert_same_curve
from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 10


def train(run_dir: Path, corpus: Path, overrides: list[str], extra_args: list[str] = ()) -> list[dict]:
    sets = [
        f"tokens.train_steps={STEPS}",
        f"data_stages.0.data.dataset={{dataset_folder: {corpus}}}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        *overrides,
    ]
    nproc = 1
    for o in overrides:
        key, value = o.split("=")
        if key in ("parallelism.tp", "parallelism.pp", "parallelism.dp"):
            nproc *= int(value)
    args = ["train", "--config", CONFIG, "--run-dir", str(run_dir), *extra_args]
    for s in sets:
        args += ["--set", s]
    check(run_cli(args, nproc=nproc, timeout=600))
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, local_dataset) -> list[dict]:
    """tp=1, pp=1, dp=1 with G=8: B=8 micro-batches per step on one process."""
    return train(tmp_path_factory.mktemp("ref"), local_dataset.corpus_dir, layout(1, 1, 1, 8))


def test_reference_learns(reference):
    assert len(reference) == STEPS
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3, "the tiny model should learn the corpus"
    assert {r["replicas"] for r in reference} == {1}
    assert len({r["ids_digest"] for r in reference}) == STEPS, "each step consumes new ids"


@pytest.mark.mpi
def test_layout_invariance_tp2_pp2_dp2(tmp_path, local_dataset, reference):
    got = train(tmp_path, local_dataset.corpus_dir, layout(2, 2, 2, 4, "1f1b"))
    assert_same_curve(got, reference, rel=1e-5)
    assert {r["replicas"] for r in got} == {2}


@pytest.mark.mpi
def test_layout_invariance_afab_pp2(tmp_path, local_dataset, reference):
    """The all-forward-all-backward schedule end to end (tests/integration/engines/test_engine.py compares both
    schedules at every pipeline layout; one 2-rank run here keeps the suite's budget)."""
    got = train(tmp_path, local_dataset.corpus_dir, layout(1, 2, 1, 8, "afab"))
    assert_same_curve(got, reference, rel=1e-5)


@pytest.mark.mpi
def test_resume_same_layout_is_bitwise(tmp_path, local_dataset):
    overrides = layout(1, 1, 2, 4)
    full = train(tmp_path / "full", local_dataset.corpus_dir, overrides)
    first = train(tmp_path / "cut", local_dataset.corpus_dir, overrides, ["--stop-after-step", "5"])
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    resumed = train(tmp_path / "cut", local_dataset.corpus_dir, overrides)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for got, want in zip(resumed, full, strict=True):
        assert got["ids_digest"] == want["ids_digest"]
        assert got["loss"] == want["loss"], f"step {got['step']} differs after resume"
        assert got["lr"] == want["lr"]


@pytest.mark.mpi
def test_resume_on_another_layout(tmp_path, local_dataset, reference):
    """Saved on (tp=1, pp=1, dp=1), resumed on (tp=2, pp=1, dp=2): weights and Adam state reshard."""
    train(tmp_path, local_dataset.corpus_dir, layout(1, 1, 1, 8), ["--stop-after-step", "5"])
    resumed = train(tmp_path, local_dataset.corpus_dir, layout(2, 1, 2, 4))
    assert_same_curve(resumed, reference, rel=1e-5)


def test_corpus_from_another_tokenizer_is_refused(tmp_path, local_dataset):
    """A Nanoset's .ds.metadata records its tokenizer; training with a config naming another one
    stops with a one-line error instead of training on mismatched ids."""
    from nanotron_recover.data import build_local_tokenizer

    other = build_local_tokenizer(tmp_path / "other_tokenizer", vocab_size=300)
    args = ["train", "--config", CONFIG, "--run-dir", str(tmp_path / "run")]
    for s in [
        *layout(1, 1, 1, 2),
        "tokens.train_steps=1",
        "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
        f"data_stages.0.data.dataset={{dataset_folder: {local_dataset.corpus_dir}}}",
        f"tokenizer.tokenizer_name_or_path={other}",
    ]:
        args += ["--set", s]
    result = run_cli(args, timeout=120)
    assert result.returncode == 2, result.output[-2000:]
    assert "tokenizer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
