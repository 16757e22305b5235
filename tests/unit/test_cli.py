"""nanotron_recover.cli: ``train --dry-run``, the refusals of train, launch and convert, and how
``train`` reports an error under mpirun (rank 0 only, the exit status of the error's kind).

Nothing here starts mpirun or a trainer: ``subprocess.call`` and the conversion functions are
replaced by tripwires, so a refusal that stops refusing fails loudly instead of launching a job.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_recover import cli
from nanotron_recover.cli import main
from nanotron_recover.errors import ExitCode, StopRun
from nanotron_recover.models import hf_conversion
from nanotron_recover.outcome import read_outcome, write_outcome

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
LLAMA_7B = [
    "model.dtype=bfloat16",
    "model.model_config.hidden_size=4096",
    "model.model_config.intermediate_size=11008",
    "model.model_config.num_attention_heads=32",
    "model.model_config.num_key_value_heads=32",
    "model.model_config.num_hidden_layers=32",
    "model.model_config.vocab_size=32000",
    "model.model_config.max_position_embeddings=4096",
    "tokens.sequence_length=4096",
    "tokens.micro_batch_size=1",
]


@pytest.fixture(autouse=True)
def no_launches(monkeypatch: pytest.MonkeyPatch):
    def tripwire(*args, **kwargs):
        raise AssertionError(f"the CLI tried to start a process: {args} {kwargs}")

    monkeypatch.setattr(subprocess, "call", tripwire)
    monkeypatch.setattr(subprocess, "run", tripwire)
    monkeypatch.setattr(subprocess, "Popen", tripwire)
    monkeypatch.setattr(hf_conversion, "from_hf", tripwire)
    monkeypatch.setattr(hf_conversion, "to_hf", tripwire)


def with_sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def one_error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The single stderr line of a refused command, without its ``nanotron-recover <cmd>: error:`` prefix."""
    out, err = capsys.readouterr()
    assert out == ""
    prefix = f"nanotron-recover {command}: error: "
    assert err.startswith(prefix), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err[len(prefix) : -1]


# -- train --dry-run ------------------------------------------------------------------------------
def test_dry_run_prints_the_plan_of_the_tiny_config(capsys: pytest.CaptureFixture[str], monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # any MPI import would now raise ImportError

    status = main(["train", "--config", TINY, "--dry-run"])

    out, err = capsys.readouterr()
    assert status == 0
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "world size      2  (tp=1 x pp=1 x dp=2)"
    assert lines[1] == "replicas        2"
    assert lines[2] == "B               8 micro-batches per step (G=4 per replica)"
    assert lines[3] == "tokens/step     1,024"
    # h=64, i=128, v=512, 2 layers, 4 heads, 2 kv heads of 16, untied:
    # per layer 64*64*2 + 64*32*2 + 3*64*128 + 2*64 = 36,992; 2*36,992 + 2*512*64 + 64 = 139,584.
    assert lines[4] == "parameters      139,584 (0.00B)"
    assert lines[5] == "pipeline        1f1b, recover=off"
    assert "heaviest stage = pp rank 0, 2 layers, 139,584 parameters" in lines[6]
    assert re.fullmatch(r"  total +\d+\.\d\d GiB", lines[-1])


def test_dry_run_with_overrides_shows_them_in_the_plan(capsys: pytest.CaptureFixture[str]):
    status = main(
        [
            "train",
            "--config",
            TINY,
            "--dry-run",
            "--set",
            "parallelism.dp=3",
            "--set",
            "parallelism.pp=2",
            "--set",
            "parallelism.pp_engine=afab",
            "--set",
            "recover.enabled=true",
        ]
    )
    out, _ = capsys.readouterr()
    assert status == 0
    assert "world size      6  (tp=1 x pp=2 x dp=3)" in out
    assert "B               12 micro-batches per step (G=4 per replica)" in out
    assert "pipeline        afab, recover=on" in out


def test_dry_run_memory_total_is_the_sum_of_its_parts(capsys: pytest.CaptureFixture[str]):
    status = main(["train", "--config", TINY, "--dry-run", *with_sets(LLAMA_7B)])

    out, _ = capsys.readouterr()
    assert status == 0
    assert "parameters      6,738,415,616 (6.74B)" in out
    gib = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S.*?) +(\d+\.\d\d) GiB$", out, re.MULTILINE)}
    assert list(gib) == [
        "parameters",
        "fp32 master",
        "fp32 grads",
        "optimizer",
        "activations",
        "snapshots",
        "total",
    ]
    assert gib["snapshots"] == 0.0, "the tiny config's recover mode is off"
    # bf16 weights (2 B), fp32 master (4 B), fp32 grads (4 B), two fp32 moments (8 B) per parameter.
    params_gib = 6_738_415_616 / 2**30
    assert gib["parameters"] == pytest.approx(2 * params_gib, abs=0.01)
    assert gib["fp32 master"] == pytest.approx(4 * params_gib, abs=0.01)
    assert gib["fp32 grads"] == pytest.approx(4 * params_gib, abs=0.01)
    assert gib["optimizer"] == pytest.approx(8 * params_gib, abs=0.01)
    parts = sum(v for k, v in gib.items() if k != "total")
    assert gib["total"] == pytest.approx(parts, abs=0.03)
    assert gib["total"] > 18 * params_gib


# -- train refusals -------------------------------------------------------------------------------
def test_bad_config_value_returns_2_with_one_line(capsys: pytest.CaptureFixture[str]):
    status = main(["train", "--config", TINY, "--dry-run", "--set", "parallelism.tp=3"])
    assert status == 2
    assert one_error_line(capsys, "train") == (
        "parallelism.tp=3 does not divide model_config.num_attention_heads=4: "
        "choose tp among the divisors of the head count"
    )


def test_unknown_key_returns_2_naming_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text(Path(TINY).read_text().replace("  micro_batch_size: 2", "  micro_batchsize: 2"))
    assert main(["train", "--config", str(path), "--dry-run"]) == 2
    assert one_error_line(capsys, "train").startswith("unknown key 'micro_batchsize' in section 'tokens'")


def test_missing_config_file_returns_2(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    missing = tmp_path / "missing.yaml"
    assert main(["train", "--config", str(missing), "--dry-run"]) == 2
    assert one_error_line(capsys, "train") == f"config file {str(missing)!r} does not exist"


def test_invalid_yaml_returns_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("tokens:\n  micro_batch_size: [2\n  train_steps: 3\n")
    assert main(["train", "--config", str(path), "--dry-run"]) == 2
    message = one_error_line(capsys, "train")
    assert message.startswith(f"config file {str(path)!r} is not valid YAML: line 3, column ")


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("parallelism.tp", "--set 'parallelism.tp': expected KEY=VALUE, e.g. parallelism.tp=2"),
        ("general.run=[x", "--set 'general.run=[x': value is not valid YAML: line 1, column 3: "),
        ("data_stages.4.data.seed=1", "--set data_stages.4: '4' is not an index of a list of length 1"),
    ],
)
def test_bad_set_returns_2_with_one_line(capsys: pytest.CaptureFixture[str], assignment: str, message: str):
    assert main(["train", "--config", TINY, "--dry-run", "--set", assignment]) == 2
    assert one_error_line(capsys, "train").startswith(message)


def test_missing_config_argument_is_an_argparse_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as info:
        main(["train", "--dry-run"])
    assert info.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err


# -- train errors under mpirun -----------------------------------------------------------------------
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@pytest.fixture
def no_rank(monkeypatch: pytest.MonkeyPatch):
    for var in (*RANK_VARS, "NANOTRON_RECOVER_SUPERVISED"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("var", RANK_VARS)
@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_error_is_printed_by_every_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_rank, tmp_path: Path, var, rank
):
    """Rank 1 says it too: under mpirun the first rank to exit non-zero gets the others killed, so
    a line left to rank 0 alone was lost whenever rank 1 was faster."""
    monkeypatch.setenv(var, rank)
    missing = tmp_path / "missing.yaml"
    assert main(["train", "--config", str(missing), "--run-dir", str(tmp_path / "run")]) == ExitCode.INPUT
    assert one_error_line(capsys, "train") == f"config file {str(missing)!r} does not exist"


def stop_in_train(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def cmd_train(args):
        args.target_step = 8
        raise error

    monkeypatch.setattr(cli, "cmd_train", cmd_train)


def test_stop_run_exits_with_its_code_and_is_recorded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_rank, tmp_path: Path
):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    stop_in_train(monkeypatch, StopRun("io", "disk full writing\ncheckpoints/step_3"))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")

    assert main(["train", "--config", TINY, "--run-dir", str(tmp_path)]) == ExitCode.IO == 5
    assert one_error_line(capsys, "train") == "disk full writing checkpoints/step_3"
    outcome = read_outcome(tmp_path)
    assert (outcome["status"], outcome["kind"], outcome["exit_code"]) == ("stopped", "io", 5)
    assert (outcome["last_step"], outcome["target_step"]) == (2, 8)
    assert outcome["message"] == "disk full writing checkpoints/step_3"


def test_under_the_supervisor_a_recorded_stop_is_left_to_the_launcher(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_rank, tmp_path: Path
):
    """The launcher prints the record's message; the trainer's own record is never overwritten."""
    write_outcome(tmp_path, status="stopped", last_step=5, target_step=8, exit_code=4, kind="deterministic",
                  message="the same exception again on micro-batch 41")  # fmt: skip
    stop_in_train(monkeypatch, StopRun("deterministic", "the same exception again on micro-batch 41"))
    monkeypatch.setenv("NANOTRON_RECOVER_SUPERVISED", "1")

    assert main(["train", "--config", TINY, "--run-dir", str(tmp_path)]) == ExitCode.DETERMINISTIC
    assert capsys.readouterr() == ("", "")
    assert read_outcome(tmp_path)["last_step"] == 5


def test_a_dry_run_error_writes_no_record(capsys, monkeypatch: pytest.MonkeyPatch, no_rank, tmp_path: Path):
    args = ["train", "--config", TINY, "--dry-run", "--run-dir", str(tmp_path), "--set", "parallelism.tp=3"]
    assert main(args) == 2
    assert read_outcome(tmp_path) is None


# -- launch refusals --------------------------------------------------------------------------------
def test_launch_refuses_a_rank_count_that_is_not_the_world_size(capsys: pytest.CaptureFixture[str]):
    assert main(["launch", "--config", TINY, "--nproc", "3"]) == 2
    assert one_error_line(capsys, "launch") == "--nproc 3 != tp*pp*dp = 2 from the config"


def test_launch_refuses_nproc_zero_instead_of_using_the_default(capsys: pytest.CaptureFixture[str]):
    assert main(["launch", "--config", TINY, "--nproc", "0"]) == 2
    assert one_error_line(capsys, "launch") == "--nproc 0 != tp*pp*dp = 2 from the config"


def test_launch_checks_the_overridden_world_size(capsys: pytest.CaptureFixture[str]):
    assert main(["launch", "--config", TINY, "--set", "parallelism.dp=4", "--nproc", "2"]) == 2
    assert one_error_line(capsys, "launch") == "--nproc 2 != tp*pp*dp = 4 from the config"


def test_launch_refuses_an_invalid_config_before_mpirun(capsys: pytest.CaptureFixture[str]):
    assert main(["launch", "--config", TINY, "--set", "parallelism.pp_engine=gpipe"]) == 2
    assert (
        one_error_line(capsys, "launch")
        == "parallelism.pp_engine: must be one of 'afab', '1f1b', got 'gpipe'"
    )


# -- convert refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "direction",
    [[], ["--from-hf", "hf_dir", "--to-hf", "ckpt_dir"]],
    ids=["neither", "both"],
)
def test_convert_needs_exactly_one_direction(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, direction: list[str]
):
    status = main(["convert", "--config", TINY, "--out", str(tmp_path / "out"), *direction])
    assert status == 2
    assert one_error_line(capsys, "convert") == "convert needs exactly one of --from-hf DIR or --to-hf CKPT"
    assert not (tmp_path / "out").exists()
