"""Fixes for Open MPI loaded into every rank, before libmpi (``rank_fixes.c``, see its comments).

Three defects of Open MPI 5.0.x that end a rank, and with it the job, each found by a chaos
campaign on this project's path:

- **a failure notice during a communicator's creation.** Open MPI revokes, locally, every
  communicator that holds a process reported failed (``ompi_comm_set_rank_failed`` ->
  ``ompi_comm_revoke_local``), and that revoke calls the communicator's collectives, which a
  communicator being created (``Dup``, ``Split``, ``Shrink``...) does not have until the end of its
  ``ompi_comm_activate``: a null dereference ("Failing at address: 0x450"; the trace of
  sandialabs/Fenix#136). Ranks that crashed so inside a recovery's ``Shrink`` cost a relaunch of the
  whole job each. Reproduced with plain mpi4py (``tests/integration/ft/test_rank_fixes.py``: three
  ranks duplicate a communicator and one is SIGKILLed as it enters ``ompi_comm_activate``; both
  survivors crash, every time; with the fix both finish the ``Dup``, shrink and reduce).
  ``ompi_comm_revoke_local`` is defined here (libmpi calls it through its PLT) and runs libmpi's own
  under a guard that turns that one fault into the end of the revoke;
- **a message from a rank its communicator does not have.** ob1 ends the process on a fragment
  whose source rank is past its communicator's size (``mca_pml_ob1_peer_lookup``), and the runtime
  then ends every process of the job. Seen in the campaigns on the emulated cluster, always during
  a recovery's ``Shrink``, a relaunch each. Once MPI is initialized, :func:`guard_fragments` wraps
  ob1's receive callbacks so that such a fragment is dropped and said on stderr instead;
- **a silent abort.** Open MPI's internal aborts (``ompi_rte_abort``) give their reason to the
  runtime only, which prints nothing with a recoverable job: the rank exited 255 with no word. The
  reason, host and pid now go to the rank's stderr first.

The library must be in the process before libmpi: :func:`load` is called by :mod:`.ulfm` before it
imports ``mpi4py.MPI`` (a plain run, which never shrinks, loads MPI elsewhere and goes without it),
and loads the library :data:`ENV` names, with ``RTLD_GLOBAL`` so that libmpi, loaded after it,
binds to it. The supervisor builds it into the run folder with the host's C compiler
(:mod:`.native`) and names it in the launch's environment, which every launch rank inherits
(:func:`rank_env`); a re-join's spawn command passes it on to the processes it spawns
(``rejoin.spawn_command``: the runtime does not pass the job's environment on to them; one that
went without it crashed in a later ``Shrink``). Without a compiler, or in a process started
without the variable, ranks run without it, said once.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .native import BuildError, compiler
from .native import build as build_library
from .native import library_path as native_library_path

ENV = "NANOTRON_RECOVER_RANK_FIXES"  # the library's path, in the launch's environment
SOURCE = Path(__file__).with_name("rank_fixes.c")

_loaded: ctypes.CDLL | None = None
_said = False


def library_path(run_dir: str | Path) -> Path:
    return native_library_path(SOURCE, run_dir)


def build(run_dir: str | Path) -> Path:
    """The fix's library in ``run_dir``, compiled unless already there; raises ``BuildError``."""
    return build_library(SOURCE, run_dir, compiler())


def rank_env(run_dir: str | Path, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """The environment entry that makes every rank of a launch load the fix (built first if needed),
    or none when it cannot be built (said through ``log``)."""
    try:
        return {ENV: str(build(Path(run_dir).resolve()))}
    except (BuildError, OSError) as e:
        if log is not None:
            log(
                f"the ranks run without the Open MPI fixes ({e}): a failure reported while a "
                "communicator is created crashes a rank (Open MPI, Fenix#136), and the job is relaunched"
            )
        return {}


def _mapped(name: str) -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any(name in line for line in maps)
    except OSError:
        return False


def load() -> bool:
    """Load the library :data:`ENV` names into this process, before libmpi; whether it is in.
    Called again, it answers without loading twice. A library that cannot be loaded, or libmpi
    already loaded (the fix would not bind), is said once on stderr."""
    global _loaded, _said
    if _loaded is not None:
        return True
    path = os.environ.get(ENV)
    if not path:
        return False
    problem = None
    if _mapped("/libmpi.so"):
        problem = "libmpi was loaded before it"
    else:
        try:
            _loaded = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded.rank_fixes_caught.restype = ctypes.c_ulong
            _loaded.rank_fixes_dropped.restype = ctypes.c_ulong
        except (OSError, AttributeError) as e:
            _loaded, problem = None, str(e)
    if problem is not None and not _said:
        _said = True
        print(
            f"[nanotron-recover] Open MPI fixes not loaded ({path}): {problem}", file=sys.stderr, flush=True
        )
    return _loaded is not None


def guard_fragments() -> bool:
    """Once MPI is initialized (ob1 has registered its receive callbacks): wrap them so that a
    fragment naming a source outside its communicator is dropped instead of ending the rank (see
    ``rank_fixes.c``). Whether they are wrapped (False without the library)."""
    return _loaded is not None and bool(_loaded.rank_fixes_guard_fragments())


def dropped() -> int:
    """How many such fragments this process dropped (0 without the library)."""
    return int(_loaded.rank_fixes_dropped()) if _loaded is not None else 0


def caught() -> int:
    """How many revokes of this process met a communicator without collectives (0 without the fix)."""
    return int(_loaded.rank_fixes_caught()) if _loaded is not None else 0
