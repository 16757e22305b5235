"""The cluster configs and ``nanotron-recover slurm``, down to a job on a real (local) Slurm.

- ``configs/llama7b_c4.yaml`` / ``llama1b_c4.yaml``: the dry-run plan (world size, replicas, B,
  parameter count) and a per-GPU memory estimate that fits an A100 40GB.
- ``render_sbatch``: the script's directives and mpirun line, TP groups inside a node, and the
  refusals (a layout that does not fill nodes x GPUs, a TP group split across nodes).
- A real single-node Slurm (munged + slurmctld + slurmd on localhost, installed with apt when
  missing): a CPU job with an injected replica failure is submitted with sbatch, completes, records
  the failure, and its loss curve and micro-batch ids equal a plain run's; a job whose every replica
  is killed ends FAILED (its exit status follows the run's outcome record, not mpirun's).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun_utils import REPO, check, run_cli
from slurm_local.cluster import LocalSlurm, SlurmUnavailable, ensure_installed

from nanotron_recover import slurm as slurm_module
from nanotron_recover.config import load_config
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.errors import InputError
from nanotron_recover.estimate import GIB, plan_summary
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from nanotron_recover.slurm import add_slurm_arguments, render_sbatch, run_slurm

pytestmark = pytest.mark.mpi

CONFIGS = REPO / "configs"
A100_GIB = 40
JOB_TIMEOUT_S = 300


# -- configs --------------------------------------------------------------------------------------
EXPECTED = {
    # config: (world size, replicas, B, parameters)
    "llama7b_c4": (512, 64, 8192, 6_738_415_616),
    "llama1b_c4": (16, 8, 256, 1_100_048_384),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_config_plan_fits_an_a100(name):
    world, replicas, b, params = EXPECTED[name]
    cfg = load_config(CONFIGS / f"{name}.yaml", check_paths=False)
    plan = plan_summary(cfg)
    assert (plan["world_size"], plan["replicas"], plan["B"], plan["parameters"]) == (
        world,
        replicas,
        b,
        params,
    )
    assert cfg.recover.enabled and cfg.model.dtype == "bfloat16" and cfg.optimizer.accumulate_grad_in_fp32
    worst = plan["worst_stage"]
    # Weights, fp32 master, grads and Adam moments alone are 18 bytes per parameter of the stage.
    assert 18 * worst.parameters < worst.total_bytes < A100_GIB * GIB, f"{worst.total_bytes / GIB:.1f} GiB"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_config_dry_run_cli(name):
    """``train --dry-run`` on the real config; the data folder is swapped for synthetic tokens
    because the dry run checks that dataset folders exist and C4 is not here."""
    world, replicas, b, params = EXPECTED[name]
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "train", "--config", str(CONFIGS / f"{name}.yaml")]
    cmd += ["--dry-run", "--set", "data_stages.0.data.dataset=null"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    assert re.search(rf"^world size\s+{world}\b", out, re.M), out
    assert re.search(rf"^replicas\s+{replicas}$", out, re.M), out
    assert re.search(rf"^B\s+{b} micro-batches", out, re.M), out
    assert f"parameters      {params:,}" in out
    total = float(re.search(r"^\s+total\s+([\d.]+) GiB", out, re.M).group(1))
    assert total < A100_GIB


# -- rendering ------------------------------------------------------------------------------------
def seven_b(**overrides):
    cfg = load_config(CONFIGS / "llama7b_c4.yaml", check_paths=False)
    args = dict(
        nodes=64,
        gpus_per_node=8,
        partition="gpu",
        time="2-00:00:00",
        job_name=None,
        run_dir="runs/llama7b_c4",
        overrides=[],
    )
    args.update(overrides)
    return render_sbatch(cfg, "configs/llama7b_c4.yaml", **args)


def test_gpu_script_directives_and_launch_line(tmp_path):
    script = seven_b(account="proj42", wandb={"project": "recover", "group": "7b", "mode": "offline"})
    for line in [
        "#SBATCH --job-name=llama7b_c4",
        "#SBATCH --nodes=64",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --output=runs/llama7b_c4/slurm-%j.out",
        "export WANDB_PROJECT=recover",
        "export WANDB_RUN_GROUP=7b",
        "export WANDB_MODE=offline",
    ]:
        assert line in script.splitlines(), line
    assert "--with-ft ulfm --mca coll ^han,cuda --mca async_mpi_finalize 1" in script
    assert "--map-by ppr:8:node" in script and "-n 512" in script
    assert "-m nanotron_recover.cli train --config configs/llama7b_c4.yaml" in script
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in script and "TORCH_NCCL_BLOCKING_WAIT" in script
    assert "srun" not in script.replace("not srun", ""), "ULFM needs mpirun, never srun"
    assert "MASTER_ADDR" not in script, "each replica's store address travels over MPI"
    assert "--oversubscribe" not in script and "NANOTRON_RECOVER_DEVICE=cpu" not in script
    assert not re.search(r"@[A-Z][A-Z0-9_]*@", script), "no placeholder left"
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


def test_tensor_parallel_groups_stay_inside_a_node():
    """ppr:<ranks per node>:node places rank r on node r // ranks_per_node; rank r's tp group is
    r // tp. With tp dividing the ranks per node no group straddles two nodes."""
    cfg = load_config(CONFIGS / "llama7b_c4.yaml", check_paths=False)
    for gpus, nodes in ((8, 64), (4, 128)):
        render_sbatch(cfg, "c.yaml", nodes=nodes, gpus_per_node=gpus, partition=None, time="60",
                      job_name=None, run_dir="r", overrides=[])  # fmt: skip
        tp = cfg.parallelism.tp
        for group in range(cfg.world_size // tp):
            assert len({r // gpus for r in range(group * tp, (group + 1) * tp)}) == 1


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_refuses_layout_that_does_not_fill_the_nodes():
    with pytest.raises(InputError) as e:
        seven_b(nodes=32)
    msg = one_line_error(e)
    assert "256 GPUs" in msg and "512" in msg and "--nodes 64" in msg and "parallelism.dp=32" in msg


def test_refuses_tensor_parallel_group_split_across_nodes():
    with pytest.raises(InputError) as e:
        seven_b(nodes=256, gpus_per_node=2)
    assert "tp=4" in one_line_error(e) and "inside one node" in str(e.value)
    cfg = load_config(CONFIGS / "llama1b_c4.yaml", check_paths=False, overrides=["parallelism.tp=4"])
    with pytest.raises(InputError, match="tensor-parallel"):
        render_sbatch(cfg, "c.yaml", nodes=16, gpus_per_node=2, partition=None, time="60",
                      job_name=None, run_dir="r", overrides=[])  # fmt: skip
    # 6 GPUs per node: 6 % tp=4 != 0 although 4 <= 6.
    cfg = load_config(
        CONFIGS / "llama1b_c4.yaml",
        check_paths=False,
        overrides=["parallelism.tp=4", "parallelism.dp=3", "recover.min_replicas=1"],
    )
    with pytest.raises(InputError, match="tp must divide"):
        render_sbatch(cfg, "c.yaml", nodes=2, gpus_per_node=6, partition=None, time="60",
                      job_name=None, run_dir="r", overrides=[])  # fmt: skip


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"time": "two days"}, "Slurm time"),
        ({"partition": "gpu; rm -rf"}, "#SBATCH"),
        ({"run_dir": "runs/my run"}, "run dir"),
        ({"wandb": {"project": "p", "team": "x"}}, "unknown key"),
        ({"wandb": {"mode": "sometimes"}}, "online"),
    ],
)
def test_refuses_values_a_script_cannot_hold(bad, match):
    with pytest.raises(InputError, match=match) as e:
        seven_b(**bad)
    one_line_error(e)


def slurm_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanotron-recover slurm")
    add_slurm_arguments(parser)
    return parser.parse_args(argv)


def test_run_slurm_writes_the_script_under_the_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = slurm_args(["--config", str(CONFIGS / "llama1b_c4.yaml"), "--nodes", "4", "--gpus-per-node", "4"])
    assert run_slurm(args) == 0
    script = tmp_path / "runs" / "llama1b_c4" / "job.sbatch"
    assert capsys.readouterr().out.strip() == str(Path("runs") / "llama1b_c4" / "job.sbatch")
    text = script.read_text()
    assert "#SBATCH --nodes=4" in text and "--map-by ppr:4:node" in text and "-n 16" in text
    assert f"#SBATCH --chdir={tmp_path}" in text


def test_wandb_section_of_the_config_is_mirrored_into_the_job(tmp_path, monkeypatch):
    """``logging.wandb`` (project/entity/group/mode) becomes WANDB_* in the script; unset fields don't."""

    @dataclasses.dataclass
    class Wandb:  # the shape of the config's logging.wandb section
        project: str = "recover"
        entity: str | None = None
        group: str | None = "c4-1b"
        mode: str | None = "offline"
        name: str | None = "ignored"

    cfg = load_config(CONFIGS / "llama1b_c4.yaml", check_paths=False)
    cfg.logging.wandb = Wandb()
    monkeypatch.setattr(slurm_module, "load_config", lambda *a, **k: cfg)
    monkeypatch.chdir(tmp_path)
    run_slurm(slurm_args(["--config", "configs/llama1b_c4.yaml", "--nodes", "4", "--gpus-per-node", "4"]))
    lines = (tmp_path / "runs" / "llama1b_c4" / "job.sbatch").read_text().splitlines()
    exported = sorted(x for x in lines if x.startswith("export WANDB_") and "WANDB_DIR" not in x)
    assert exported == [
        "export WANDB_MODE=offline",
        "export WANDB_PROJECT=recover",
        "export WANDB_RUN_GROUP=c4-1b",
    ]


# -- a real Slurm ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm: {e}")
    cluster = LocalSlurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def tiny_sets(corpus: Path, steps: int = 8) -> list[str]:
    return [
        "parallelism.dp=2",
        f"tokens.train_steps={steps}",
        f"data_stages.0.data.dataset={{dataset_folder: {corpus}}}",
    ]


FAULT = ["recover.enabled=true", "recover.faults=[{step: 3, replica: 1, phase: forward}]"]
# Short deadlines: a hang fails the test in minutes, not at the 10-minute default.
DEADLINES = ["recover.watchdog_timeout_s=120", "recover.gate_timeout_s=30"]


def test_slurm_job_recovers_forward_like_a_plain_run(slurm, local_dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    config = str(tiny_config_path())
    run_dir = tmp_path / "slurm_run"
    sets = tiny_sets(local_dataset.corpus_dir) + FAULT + DEADLINES
    argv = ["--config", config, "--nodes", "1", "--gpus-per-node", "0", "--time", "10"]
    argv += ["--run-dir", str(run_dir), "--job-name", "nr-test", "--submit"]
    argv += [a for s in sets for a in ("--set", s)]

    start = time.monotonic()
    assert run_slurm(slurm_args(argv)) == 0
    out = capsys.readouterr().out
    job_id = re.search(r"submitted job (\d+)", out).group(1)
    state = slurm.wait_job(job_id, JOB_TIMEOUT_S)
    elapsed = time.monotonic() - start
    log = run_dir / f"slurm-{job_id}.out"
    tail = log.read_text()[-4000:] if log.exists() else slurm.logs()
    assert state == "COMPLETED", f"job {job_id} {state}\n{tail}"
    with capsys.disabled():
        print(f"\n[slurm] job {job_id}: sbatch -> COMPLETED in {elapsed:.1f}s")

    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "--gpus-per-node" not in script
    assert "--oversubscribe" in script and "NANOTRON_RECOVER_DEVICE=cpu" in script
    assert "-m nanotron_recover.launcher supervise" in script and "--mca mpi_ft_detector true" in script
    assert (run_dir / "logs" / f"job-{job_id}" / "train.log").exists()
    assert read_outcome(run_dir)["status"] == "completed", "COMPLETED because the run recorded it"
    assert f"job {job_id} finished" in log.read_text() and "exit status 0" in log.read_text()

    incidents = read_incidents(run_dir)
    assert [i["failed_replicas"] for i in incidents] == [[1]], incidents
    assert incidents[0]["step"] == 3 and incidents[0]["phase"] == "forward"

    plain_dir = tmp_path / "plain"
    args = ["train", "--config", config, "--run-dir", str(plain_dir)]
    check(run_cli(args + [a for s in tiny_sets(local_dataset.corpus_dir) for a in ("--set", s)], nproc=2))
    want, got = read_metrics(plain_dir), read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 9))
    for g, w in zip(got, want, strict=True):
        assert g["ids_digest"] == w["ids_digest"], f"step {g['step']} consumed other micro-batches"
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"step {g['step']}"
    assert got[-1]["replicas"] == 1


def test_slurm_job_whose_every_replica_dies_ends_failed(slurm, tmp_path, monkeypatch, capsys):
    """Both replicas SIGKILLed at step 2: mpirun exits 0 under ULFM, but no run recorded that it
    completed, so the job's exit status (and Slurm's state) says it failed."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "dead_run"
    sets = ["parallelism.dp=2", "tokens.train_steps=4", "data_stages.0.data.dataset=null", *DEADLINES]
    sets += ["recover.enabled=true", "recover.faults=[{step: 2, replica: 0}, {step: 2, replica: 1}]"]
    argv = ["--config", str(tiny_config_path()), "--nodes", "1", "--gpus-per-node", "0", "--time", "10"]
    argv += ["--run-dir", str(run_dir), "--job-name", "nr-dead", "--submit"]
    argv += [a for s in sets for a in ("--set", s)]

    assert run_slurm(slurm_args(argv)) == 0
    job_id = re.search(r"submitted job (\d+)", capsys.readouterr().out).group(1)
    state = slurm.wait_job(job_id, JOB_TIMEOUT_S)
    log = run_dir / f"slurm-{job_id}.out"
    text = log.read_text() if log.exists() else slurm.logs()
    assert state == "FAILED", f"job {job_id} {state}\n{text[-4000:]}"
    assert "ExitCode=1:0" in slurm.run("scontrol", "show", "job", job_id).stdout
    assert (
        "nanotron-recover job: run ended without completing: no outcome record (every replica lost, "
        "or killed from outside); last committed step 1 of 4"
    ) in text
    assert read_outcome(run_dir) is None


def test_slurm_refuses_a_mismatched_layout_before_submission(slurm, local_dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.chdir(tmp_path)
    before = slurm.job_ids()
    argv = ["--config", str(tiny_config_path()), "--nodes", "1", "--gpus-per-node", "4", "--submit"]
    argv += ["--run-dir", str(tmp_path / "run")]
    argv += [a for s in tiny_sets(local_dataset.corpus_dir) for a in ("--set", s)]
    with pytest.raises(InputError) as e:
        run_slurm(slurm_args(argv))
    msg = one_line_error(e)
    assert "1 x --gpus-per-node 4 = 4 GPUs" in msg and "tp*pp*dp = 1*1*2 = 2 ranks" in msg
    assert not (tmp_path / "run" / "job.sbatch").exists()
    assert slurm.job_ids() == before
