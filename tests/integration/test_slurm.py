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
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover import slurm as slurm_module
from nanotron_recover.config import load_config
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.errors import InputError
from nanotron_recover.estimate import GIB, plan_summary
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from nanotron_recover.slurm import add_slurm_arguments, render_sbatch, run_slurm
from tests.helpers.mpirun_utils import REPO, check, run_cli
from tests.helpers.slurm_local.cluster import LocalSlurm, SlurmUnavailable, ensure_installed

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
    assert (
        "--with-ft ulfm --prtemca state_base_recoverable 1 --mca coll ^han,cuda --mca btl ^ofi --mca async_mpi_finalize 1"
        in script
    )
    assert "--map-by ppr:8:node" in script and "-n 512" in script
    assert "-m nanotron_recover.cli train --config configs/llama7b_c4.yaml" in script
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in script and "TORCH_NCCL_BLOCKING_WAIT" in script
    # ULFM needs mpirun, never srun: srun starts only the node-memory snapshots' cleanup steps.
    cleanup = script[
        script.index("clean_snapshots() {") : script.index("\n}\n", script.index("clean_snapshots() {"))
    ]
    assert "srun --overlap" in cleanup and "${CLEAN[@]}" in cleanup
    outside = [line for line in script.replace(cleanup, "").splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in outside if "srun" in line], "ULFM needs mpirun, never srun"
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


# -- spare nodes for re-join ---------------------------------------------------------------------
REJOIN = ["recover.rejoin.mode=spawn"]  # the C4 configs already recover forward


def one_b(spare_nodes: int | None = None, sets: list[str] = REJOIN, **overrides) -> str:
    cfg = load_config(CONFIGS / "llama1b_c4.yaml", sets, check_paths=False)
    args = dict(
        nodes=4, gpus_per_node=4, partition=None, time="60", job_name=None, run_dir="r", overrides=sets
    )
    args.update(overrides)
    if spare_nodes is not None:
        args["spare_nodes"] = spare_nodes
    return render_sbatch(cfg, "configs/llama1b_c4.yaml", **args)


def seven_b_rejoin(spare_nodes: int) -> str:
    """The 7B job of ``seven_b`` with ``--set recover.rejoin.mode=spawn``, on ``spare_nodes`` spares."""
    cfg = load_config(CONFIGS / "llama7b_c4.yaml", REJOIN, check_paths=False)
    return render_sbatch(cfg, "configs/llama7b_c4.yaml", nodes=64, gpus_per_node=8, partition="gpu",
                         time="2-00:00:00", job_name=None, run_dir="runs/llama7b_c4", overrides=REJOIN,
                         spare_nodes=spare_nodes)  # fmt: skip


def launch_lines(script: str) -> list[str]:
    """The #SBATCH lines and the lines that make the mpirun command (``MPI_EXTRA=`` to ``CMD=(...)``)."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("MPI_EXTRA=("))
    cmd = next(i for i, line in enumerate(lines) if line.startswith("CMD=("))
    end = next(i for i in range(cmd, len(lines)) if lines[i].rstrip().endswith(")"))
    return [x for x in lines if x.startswith("#SBATCH")] + lines[start : end + 1]


def test_no_spare_nodes_leaves_the_script_as_it_was():
    default, zero = seven_b(), seven_b(spare_nodes=0)
    assert zero == default
    lines = launch_lines(zero)
    assert "#SBATCH --nodes=64" in lines and "#SBATCH --ntasks-per-node=8" in lines
    assert "MPI_EXTRA=()" in lines
    assert '    --map-by ppr:8:node --bind-to none "${MPI_EXTRA[@]}" "${ROOT[@]}" "${FORWARD[@]}"' in lines
    assert "    --output tag -n 512" in lines
    assert "NOOVERSUBSCRIBE" not in "\n".join(lines) and "spare node" not in zero.splitlines()[5]
    # A CPU job keeps its oversubscription (ranks may outnumber the CPUs).
    cpu = load_config(tiny_config_path(), check_paths=False)
    text = render_sbatch(cpu, "c.yaml", nodes=1, gpus_per_node=0, partition=None, time="10",
                         job_name=None, run_dir="r", overrides=[], spare_nodes=0)  # fmt: skip
    assert "MPI_EXTRA=(--oversubscribe)" in text and "--map-by ppr:2:node --bind-to" in text


def test_spare_nodes_are_allocated_and_left_free_by_the_mapping():
    script = seven_b_rejoin(spare_nodes=2)
    lines = launch_lines(script)
    assert "#SBATCH --nodes=66" in lines and "#SBATCH --ntasks-per-node=8" in lines
    assert "#SBATCH --gpus-per-node=8" in lines
    # ppr:8:node with -n 512 fills 64 nodes and stops; NOOVERSUBSCRIBE keeps a spawn off busy nodes.
    assert (
        '    --map-by ppr:8:node:NOOVERSUBSCRIBE --bind-to none "${MPI_EXTRA[@]}" "${ROOT[@]}" "${FORWARD[@]}"'
        in lines
    )
    assert "    --output tag -n 512" in lines and "MPI_EXTRA=()" in lines
    assert "--oversubscribe" not in script and "--host" not in "\n".join(lines)
    assert "plus 2 spare node(s) left free for re-join" in script.splitlines()[5]
    assert "--set recover.rejoin.mode=spawn" in script


def test_a_cpu_job_with_spare_nodes_does_not_oversubscribe():
    """A spawned job inherits mpirun's oversubscription: with it, a re-join would double up on a busy
    node once the spares are full instead of failing."""
    cfg = load_config(tiny_config_path(), ["recover.enabled=true", *REJOIN], check_paths=False)
    text = render_sbatch(cfg, "c.yaml", nodes=1, gpus_per_node=0, partition=None, time="10",
                         job_name=None, run_dir="r", overrides=[], spare_nodes=1)  # fmt: skip
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
    assert "MPI_EXTRA=()" in text and "--oversubscribe" not in text and "NOOVERSUBSCRIBE" in text
    assert "--map-by ppr:2:node:NOOVERSUBSCRIBE --bind-to none" in text


@pytest.mark.parametrize(
    "sets",
    [
        [],  # recover.rejoin.mode: off (the default)
        ["recover.rejoin.mode='off'"],  # quoted: PyYAML (YAML 1.1) reads a bare off as false
    ],
)
def test_spare_nodes_without_forward_recovery_are_refused(sets):
    with pytest.raises(InputError) as e:
        one_b(spare_nodes=2, sets=[*sets, "recover.enabled=false"])
    msg = one_line_error(e)
    assert msg == (
        "--spare-nodes 2 leaves nodes free to replace a lost one, but the config does not run forward "
        "recovery, so nothing would ever run there: set recover.enabled: true (e.g. --set "
        "recover.enabled=true) or drop --spare-nodes"
    )


def test_negative_spare_nodes_are_refused():
    with pytest.raises(InputError, match=r"^--spare-nodes must be >= 0, got -1$"):
        one_b(spare_nodes=-1)


def test_run_slurm_spare_nodes_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(CONFIGS / "llama1b_c4.yaml"), "--nodes", "4", "--gpus-per-node", "4"]
    assert slurm_args(argv).spare_nodes == 0
    assert run_slurm(slurm_args([*argv, "--spare-nodes", "1", "--set", "recover.rejoin.mode=spawn"])) == 0
    text = (tmp_path / "runs" / "llama1b_c4" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=5" in text and "--map-by ppr:4:node:NOOVERSUBSCRIBE" in text and "-n 16" in text
    with pytest.raises(InputError, match="does not run forward recovery"):
        run_slurm(slurm_args([*argv, "--spare-nodes", "1", "--set", "recover.enabled=false"]))


def _mpirun_map(script: str, nodes: list[str], slots: int) -> dict[str, list[int]]:
    """What mpirun maps the script's ranks to inside a Slurm allocation of ``nodes`` x ``slots``
    (Open MPI reads the allocation from SLURM_* variables; ``--do-not-launch`` starts nothing):
    node name -> ranks, in mpirun's node order."""
    map_by = re.search(r"--map-by (\S+)", script).group(1)
    world = re.search(r"--output tag -n (\d+)", script).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PRTE_", "OMPI_", "PMIX_"))}
    nodelist = ",".join(nodes)
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_JOBID="4242",
        SLURM_NODELIST=nodelist,
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NNODES=str(len(nodes)),
        SLURM_TASKS_PER_NODE=f"{slots}(x{len(nodes)})",
    )
    cmd = [slurm_module._mpirun_for_job(), "--do-not-launch", "--display", "map", "--map-by", map_by]
    cmd += ["--bind-to", "none", "-n", world]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    out = subprocess.run([*cmd, "true"], env=env, capture_output=True, text=True, timeout=120)
    placed: dict[str, list[int]] = {}
    node = None
    for line in (out.stdout + out.stderr).splitlines():
        if m := re.match(r"Data for node: (\S+)", line):
            node = m.group(1)
            placed[node] = []
        elif (m := re.search(r"App rank: (\d+)", line)) and node is not None:
            placed[node].append(int(m.group(1)))
    assert placed, f"no map from {' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return placed


def test_mpirun_places_the_ranks_on_the_first_nodes_and_leaves_the_spares_free():
    """The rendered --map-by and -n, given to this machine's mpirun inside a (simulated) Slurm
    allocation of 4 + 2 nodes x 4 slots: ranks 0..15 fill the first four nodes in order, four per
    node, and the two spare nodes get none (their slots are what a re-join spawns into)."""
    script = one_b(spare_nodes=2)
    assert "#SBATCH --nodes=6" in script
    here = socket.gethostname().split(".")[0]  # the batch host, where mpirun runs, comes first
    nodes = [here, "nrnodeb", "nrnodec", "nrnoded", "nrsparee", "nrsparef"]
    placed = _mpirun_map(script, nodes, slots=4)
    assert list(placed) == nodes[:4], placed
    assert [placed[n] for n in nodes[:4]] == [list(range(4 * i, 4 * i + 4)) for i in range(4)]


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
    assert "-m nanotron_recover.supervisor supervise" in script and "--mca mpi_ft_detector true" in script
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


def test_slurm_job_whose_every_replica_dies_is_relaunched_in_its_allocation(
    slurm, tmp_path, monkeypatch, capsys
):
    """Both replicas SIGKILLed at step 3: mpirun exits 0 under ULFM and no run recorded an outcome.
    The job's supervisor relaunches it inside the same allocation (its node answers the srun probe,
    so no host was lost), the relaunched job restores from node memory, the injected faults
    do not fire twice, and the job completes (without a relaunch it ends FAILED with exit 1:
    tests/integration/test_launcher.py)."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "dead_run"
    sets = ["parallelism.dp=2", "tokens.train_steps=4", "data_stages.0.data.dataset=null", *DEADLINES]
    sets += ["recover.enabled=true", "recover.faults=[{step: 3, replica: 0}, {step: 3, replica: 1}]"]
    sets += [f"recover.snapshot.dir={tmp_path / 'node_memory'}"]
    argv = ["--config", str(tiny_config_path()), "--nodes", "1", "--gpus-per-node", "0", "--time", "10"]
    argv += ["--run-dir", str(run_dir), "--job-name", "nr-dead", "--submit"]
    argv += [a for s in sets for a in ("--set", s)]

    assert run_slurm(slurm_args(argv)) == 0
    job_id = re.search(r"submitted job (\d+)", capsys.readouterr().out).group(1)
    state = slurm.wait_job(job_id, JOB_TIMEOUT_S)
    log = run_dir / f"slurm-{job_id}.out"
    text = log.read_text() if log.exists() else slurm.logs()
    assert state == "COMPLETED", f"job {job_id} {state}\n{text[-4000:]}"
    assert "the job ended without an outcome after step 2 (every replica lost): relaunching it" in text
    outcome = read_outcome(run_dir)
    assert outcome["status"] == "completed" and outcome["last_step"] == 4
    (relaunch,) = [i for i in read_incidents(run_dir) if i["kind"] == "job_lost"]
    # Step 2's snapshot may still be being written when the ranks die: then step 1's is used.
    assert relaunch["state_from"] == "snapshot" and relaunch["restored_step"] in (1, 2)
    assert relaunch["step"] == relaunch["restored_step"] + 1
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


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
