"""``nanotron-recover snapshots clean`` (``snapshot_cleanup.py``) and ``launch``'s own cleanup: one
run's node-memory snapshots removed on this host, named as the ranks name them, what was removed
said in one line; nothing else touched, exit 0 when there was nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanotron_recover import launcher
from nanotron_recover.cli import main
from nanotron_recover.config import load_config
from nanotron_recover.data_parallel.forward.restore import snapshot_layout_id
from nanotron_recover.data_parallel.forward.snapshot_folder import snapshot_run_id
from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots
from nanotron_recover.engines.state import EngineState
from nanotron_recover.snapshot_cleanup import clean_this_host
from tests.helpers.python_probe import probe_stdout

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
PREFIX = "nanotron-recover snapshots clean: "


def sets_for(shm: Path) -> list[str]:
    return ["recover.enabled=true", f"recover.snapshot.dir={shm}", "tokens.train_steps=7"]


def snapshots_of(run_dir: Path, shm: Path, replicas: tuple[int, ...] = (0, 1)) -> Path:
    """Snapshots of the tiny run in ``run_dir`` as its ranks write them; the run's folder."""
    cfg = load_config(TINY, sets_for(shm), check_paths=False)
    run_id = snapshot_run_id(cfg, run_dir)
    for replica in replicas:
        store = NodeSnapshots(shm, run_id, snapshot_layout_id(cfg), coordinate=0, replica=replica)
        store.write(3, lambda: EngineState({"w": torch.ones(50_000)}, {"step": 3}), asynchronous=False)
        assert store.error is None
    return shm / run_id


def clean(*args: str) -> list[str]:
    return ["snapshots", "clean", *args]


def with_sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def test_clean_removes_the_runs_snapshots_on_this_host_and_says_how_much(tmp_path, capsys):
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    folder = snapshots_of(run_dir, shm)
    other = snapshots_of(tmp_path / "another-run", shm)  # same config, another run dir: kept
    held = sum(f.lstat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())
    args = clean("--config", TINY, "--run-dir", str(run_dir), *with_sets(sets_for(shm)))

    assert main(args) == 0

    out, err = capsys.readouterr()
    assert err == "" and out.startswith(PREFIX) and out.count("\n") == 1, out
    assert held >= 2 * 200_000 and f"KiB ({held} bytes) of node-memory snapshots of run {folder.name}" in out
    assert "removed 6 files, " in out and f"from {folder}\n" in out
    assert not folder.exists() and other.is_dir() and len(list(other.rglob("state.bin"))) == 2

    assert main(args) == 0  # nothing left: still 0, and says so
    out, _ = capsys.readouterr()
    assert f"no node-memory snapshots of run {folder.name} under {shm}" in out


def test_clean_by_run_id_and_folder(tmp_path, capsys):
    shm = tmp_path / "shm"
    folder = snapshots_of(tmp_path / "run", shm, replicas=(2,))

    assert main(clean("--run-id", folder.name, "--dir", str(shm))) == 0

    assert "removed 3 files" in capsys.readouterr().out and not folder.exists() and shm.is_dir()


@pytest.mark.parametrize(
    "args, why",
    [
        (["--config", TINY], "needs --config and --run-dir"),
        ([], "needs --config and --run-dir"),
        (["--run-id", "x", "--run-dir", "r"], "either --run-id or --config with --run-dir"),
        (["--run-id", "../x"], "is not a run id"),
    ],
)
def test_clean_refuses_what_names_no_single_run(tmp_path, capsys, args, why):
    assert main(clean(*args, "--dir", str(tmp_path))) == 2
    _, err = capsys.readouterr()
    assert err.startswith("nanotron-recover snapshots: error: ") and why in err, err


def test_clean_refuses_a_folder_that_is_not_private_and_touches_nothing_behind_it(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    folder = snapshots_of(tmp_path / "run", elsewhere)
    (tmp_path / "link").symlink_to(elsewhere)

    assert main(clean("--run-id", folder.name, "--dir", str(tmp_path / "link"))) == 1

    _, err = capsys.readouterr()
    assert "nothing removed" in err and "is a symlink" in err and err.count("\n") == 1
    assert len(list(folder.rglob("state.bin"))) == 2


def test_launch_removes_this_hosts_snapshots_once_the_supervisor_is_done(tmp_path, monkeypatch, capsys):
    """A run the supervisor did not complete and will not relaunch (lost with no relaunch left,
    interrupted): its snapshots would stay in /dev/shm. ``launch`` removes them on its host."""
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    folder = snapshots_of(run_dir, shm)
    seen: list[bool] = []

    def lost_job(*args, **kwargs) -> int:
        seen.append(folder.is_dir())  # still there while the supervisor may relaunch from them
        return 1

    monkeypatch.setattr(launcher, "run_relaunching", lost_job)
    monkeypatch.setattr(launcher, "mpirun_path", lambda: "mpirun")

    code = launcher.launch(TINY, sets_for(shm), run_dir=run_dir)

    assert code == 1 and seen == [True] and not folder.exists()
    assert "nanotron-recover launch: " in capsys.readouterr().err


def test_clean_this_host_is_quiet_when_there_is_nothing_or_snapshots_are_off(tmp_path):
    cfg = load_config(TINY, sets_for(tmp_path / "shm"), check_paths=False)
    assert clean_this_host(cfg, tmp_path / "run") is None and not (tmp_path / "shm").exists()
    off = load_config(TINY, [*sets_for(tmp_path / "shm"), "recover.snapshot.interval=0"], check_paths=False)
    snapshots_of(tmp_path / "run", tmp_path / "shm")
    assert clean_this_host(off, tmp_path / "run") is None
    assert "removed 6 files" in clean_this_host(cfg, tmp_path / "run")


def test_clean_runs_without_torch_mpi_or_the_trainer(tmp_path):
    """The job script runs ``snapshots clean`` on every node of the allocation at every job's end:
    a process that loads torch, MPI or the training code there costs seconds of CPU per node. It
    must remove a real run's snapshots with none of them imported."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    folder = snapshots_of(run_dir, shm)
    probe = (
        "import sys\n"
        "from nanotron_recover.cli import main\n"
        f"code = main(['snapshots', 'clean', '--config', {TINY!r}, '--run-dir', {str(run_dir)!r}, "
        + ", ".join(f"'--set', {s!r}" for s in sets_for(shm))
        + "])\n"
        "heavy = sorted(m for m in ('torch', 'mpi4py.MPI', 'nanotron_recover.trainer') if m in sys.modules)\n"
        "print('loaded:', heavy)\n"
        "sys.exit(code)\n"
    )
    out = probe_stdout(probe)
    assert "loaded: []" in out, out
    assert "removed 6 files, " in out, out
    assert not folder.exists()
