"""A process spawned by a re-join beats before its heavy imports: the spawn command's environment
names the heartbeat file, the CLI module starts beating first, and the members' start window is
two heartbeat timeouts (at least 15 s) instead of 30 s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from nanotron_recover import fencing
from nanotron_recover.config.recover import RecoverArgs
from nanotron_recover.data_parallel.forward.rejoin import spawn_command, spawn_start_s
from nanotron_recover.ft import rank_fixes
from nanotron_recover.ft.abandoned_join import ENV as JOIN_ENV
from nanotron_recover.ft.liveness import heartbeat_file
from nanotron_recover.ft.spawn_start import ENV, beat_value


def test_the_spawn_command_names_the_heartbeat_and_runs_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli", "train", "--config", "c.yaml"])
    monkeypatch.setattr(fencing, "mine", lambda: None)
    monkeypatch.delenv(rank_fixes.ENV, raising=False)
    cmd = spawn_command(tmp_path, 0.5)
    # ULFM's detector off in the spawned world: a partitioned pair must not report each other dead.
    assert cmd[:3] == ["env", f"{ENV}={tmp_path}|0.5", "OMPI_MCA_mpi_ft_detector=false"]
    assert cmd[3:] == [sys.executable, "-m", "nanotron_recover.cli", "train", "--config", "c.yaml"]
    # A named join reaches the spawned process, whose watcher ends it if the join is given up.
    named = spawn_command(tmp_path, 0.5, "0-3-41")
    assert named[:4] == [*cmd[:3], f"{JOIN_ENV}=0-3-41"] and named[4:] == cmd[3:]
    # The Open MPI fixes this rank runs with reach the spawned process too (the runtime may not pass
    # the job's environment on), and nothing is named where the rank has none.
    assert not any(a.startswith(rank_fixes.ENV) for a in cmd)
    monkeypatch.setenv(rank_fixes.ENV, "/run/runtime/rank_fixes-0.so")
    fixed = spawn_command(tmp_path, 0.5)
    assert fixed[:4] == [*cmd[:3], f"{rank_fixes.ENV}=/run/runtime/rank_fixes-0.so"] and fixed[4:] == cmd[3:]


def test_the_cli_module_beats_before_its_imports_end(tmp_path):
    """The file exists (and the variable is gone, so that nothing the process starts inherits
    it) right after ``import nanotron_recover.cli``; the process then beats every period."""
    code = (
        f"import os, time, nanotron_recover.cli\nprint({ENV!r} in os.environ, flush=True)\ntime.sleep(0.6)\n"
    )
    env = {**os.environ, ENV: beat_value(tmp_path, 0.2)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    files = list((tmp_path / "heartbeats").iterdir())
    assert len(files) == 1 and files[0].name.startswith(f"{socket.gethostname()}.")


def test_no_variable_no_beat(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    code = "import nanotron_recover.cli"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, timeout=120
    )
    assert out.returncode == 0 and not (tmp_path / "heartbeats").exists()


def test_a_second_start_keeps_the_first_thread(tmp_path):
    from nanotron_recover.ft.liveness import start_heartbeat

    path = heartbeat_file(tmp_path, "h", 1)
    first = start_heartbeat(tmp_path, 0.05, path=path)
    assert start_heartbeat(tmp_path, 0.05, path=path) is first


@pytest.mark.parametrize(
    ("heartbeat_timeout_s", "join_timeout_s", "expected"),
    [(5.0, 300.0, 15.0), (7.0, 300.0, 15.0), (10.0, 300.0, 20.0), (10.0, 12.0, 12.0)],
)
def test_the_members_start_window(heartbeat_timeout_s, join_timeout_s, expected):
    args = RecoverArgs(heartbeat_timeout_s=heartbeat_timeout_s)
    args.rejoin.join_timeout_s = join_timeout_s
    assert spawn_start_s(args) == expected
