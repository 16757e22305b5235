"""The plain reference: started beside a job, waited for, reused when complete, never reused when
it did not end well."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from nanotron_recover.chaos.reference import RECORD, ensure_reference, start_reference
from nanotron_recover.config import load_config
from nanotron_recover.errors import InputError
from nanotron_recover.logging.metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_cpu.yaml"
SETS = [
    "model.model_config.hidden_size=32",
    "model.model_config.intermediate_size=64",
    "tokens.sequence_length=32",
    "tokens.micro_batch_size=1",
    "tokens.train_steps=3",
    "parallelism.dp=2",
    "tokens.batch_accumulation_per_replica=2",
    "data_stages.0.data.dataset=null",
]


def _cfg():
    return load_config(CONFIG, SETS)


def test_a_reference_started_in_the_background_is_waited_for_then_reused(tmp_path):
    pending = start_reference(CONFIG, _cfg(), SETS, tmp_path)
    assert not pending.reused and pending.proc is not None
    assert not (pending.ref_dir / RECORD).exists()  # recorded only once it is known complete
    ref_dir = pending.wait(timeout_s=300)
    assert [r["step"] for r in read_metrics(ref_dir)] == [1, 2, 3]
    assert (ref_dir / RECORD).exists()
    again = start_reference(CONFIG, _cfg(), SETS, tmp_path)
    assert again.reused and again.proc is None and again.ref_dir == ref_dir
    assert ensure_reference(CONFIG, _cfg(), SETS, tmp_path, timeout_s=300) == (ref_dir, True)


def test_a_killed_reference_is_an_error_naming_its_log_and_is_run_again(tmp_path):
    pending = start_reference(CONFIG, _cfg(), SETS, tmp_path)
    pending.check()  # still running: nothing to say yet
    pending.kill()
    with pytest.raises(InputError, match="reference.log"):
        pending.check()  # ended without success: said at once, before any wait
    with pytest.raises(InputError, match="reference.log"):
        pending.wait(timeout_s=300)
    assert not (pending.ref_dir / RECORD).exists()
    rerun = start_reference(CONFIG, _cfg(), SETS, tmp_path)
    try:
        assert not rerun.reused and rerun.proc is not None
    finally:
        rerun.kill()


def test_a_reference_past_its_timeout_is_killed_and_named(tmp_path):
    pending = start_reference(CONFIG, _cfg(), SETS, tmp_path)
    proc = pending.proc
    os.kill(proc.pid, signal.SIGSTOP)  # a frozen reference: it cannot finish
    with pytest.raises(InputError, match="did not finish in 0.5 s"):
        pending.wait(timeout_s=0.5)
    assert proc.poll() == -signal.SIGKILL
    with pytest.raises(InputError, match="did not finish"):
        pending.wait(timeout_s=300)  # the same error again, never the folder of a killed run
