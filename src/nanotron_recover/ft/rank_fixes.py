"""Fixes for Open MPI loaded into every rank, before libmpi (``rank_fixes.c``, see its comments).

Four defects of Open MPI 5.0.x on this project's path:

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
- **a connection from another launch.** Open MPI's TCP transport binds every process's listening
  port to the first free one from 1024, so a process of a later launch on a host gets the port of
  one of an earlier launch, and a process of that launch that still runs (on a node frozen or cut
  off while its job was relaunched, or slow to die) dials it: the transport takes a name it does
  not know for a process of its own job and lets it in (measured: a crafted handshake with another
  job's name was looked up as "part of this MPI job" and stopped only by the address check).
  ``mca_btl_tcp_proc_lookup`` is defined here (reached through libopen-pal's PLT) and answers "no
  such process" for a job family other than this launch's (processes a re-join spawns share it);
- **a silent abort.** Open MPI's internal aborts (``ompi_rte_abort``) give their reason to the
  runtime only, which prints nothing with a recoverable job: the rank exited 255 with no word. The
  reason, host and pid now go to the rank's stderr first;
- **a failure inside a spawn's or a merge's context-id allocation.** ``Spawn`` and ``Merge`` agree on
  the new communicator's context id with a nested request whose last step has no callback, and
  Open MPI's progress loop then overwrites the error a failed step recorded with success: the
  allocation starts another round against the failed process, forever (``NBC_Progress: an error
  75`` once per round), no revoke ends it, and the spawned processes wait in ``MPI_Init``. A
  re-join's members spun so in ``Spawn`` on CI. ``ompi_comm_request_schedule_append_w_flags`` is
  defined here (libmpi's PLT) and gives such a step a callback that returns the recorded error:
  the creation raises it (``MPI_ERR_PROC_FAILED``), and the join handles it like any failed stage
  (reproduced with plain mpi4py in ``tests/integration/ft/test_rank_fixes.py``: the spawn's root
  SIGKILLed as it starts the allocation's exchange; rank 1's ``Spawn`` never returns without the
  fix, raises at once with it; ``Merge`` takes the same path by reading, untested).

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
            _loaded.rank_fixes_refused.restype = ctypes.c_ulong
            _loaded.rank_fixes_kept_errors.restype = ctypes.c_ulong
        except (OSError, AttributeError) as e:
            _loaded, problem = None, str(e)
    if problem is not None and not _said:
        _said = True
        print(
            f"[nanotron-recover] Open MPI fixes not loaded ({path}): {problem}", file=sys.stderr, flush=True
        )
    return _loaded is not None


def refused() -> int:
    """How many connections of processes of other launches this process refused (0 without it)."""
    return int(_loaded.rank_fixes_refused()) if _loaded is not None else 0


def kept_errors() -> int:
    """How many callback-less steps of this process's communicator requests returned an error that
    libmpi alone would have dropped (0 without the fix)."""
    return int(_loaded.rank_fixes_kept_errors()) if _loaded is not None else 0


def caught() -> int:
    """How many revokes of this process met a communicator without collectives (0 without the fix)."""
    return int(_loaded.rank_fixes_caught()) if _loaded is not None else 0
