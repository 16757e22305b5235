"""A fix for Open MPI's runtime, preloaded into it, so that a job can spawn across hosts more than
once and its daemons do not die around a spawn.

Every ``MPI_Comm_spawn`` whose processes span hosts ends in PRRTE's ``connect_release()``
(``src/prted/pmix/pmix_server_dyn.c``, PRRTE 3.0.x, which Open MPI 5.0.x bundles; read in 3.0.13
and 3.0.14, the same code), on mpirun and on every daemon of the connect. Since PRRTE 3.0.1 the
collective it runs wraps its directives in a byte object, which ``connect_release()`` was never
changed to read (PRRTE 4 rewrote it). Two defects follow:

- **The second spawn's process cannot reach the job.** The wrapped directives are read as a
  namespace named ``""``, which is registered with the PMIx server. PMIx compares namespaces so
  that an empty one matches any: when a later spawned process's address (its direct modex) comes
  back, the server resolves the waiting requests against ``""`` and answers them "not found".
  Every member then fails to reach the new process (``opal_modex_recv: failed with return
  value=-46``, "unable to reach each other ... on host: unknown") and it dies in ``MPI_Init``.
  Measured with plain mpi4py on the emulated cluster (a launch on 2 nodes spawning one process
  after the other onto free nodes, 4 times): 0 of 3 runs got past the second spawn (in two its
  process could not reach the job; in one mpirun died of the defect below at the first).
- **Heap corruption.** Without a context id the info array has one element, yet two are passed
  on and the second is destructed. mpirun or a daemon then dies, at once or later ("PRTE has lost
  communication with a remote daemon", a ``prted`` segfault after ``PMIX_ERROR ...
  pmix_server_dyn.c at line 1113``): the job is lost and relaunched. With the first defect taken
  away by PMIx's fully described buffers (``--pmixmca bfrops_base_default_type 2``), 3 of 3 such
  runs lost a daemon at their first spawn.

No parameter of Open MPI avoids the second (fully described buffers avoid only the first).
``prrte_connect_fix.c`` avoids both, in the runtime's processes only: ``PMIx_Info_create(n)`` allocates one constructed, empty element more, and an empty
namespace is refused. With it the same program spawned four times across hosts, 5 of 5 runs,
with no lost daemon (each connect then logs a harmless ``PMIX ERROR`` for the refused namespace).

How it gets there: the supervisor compiles the C file with the host's C compiler into the run
folder (which every node of a job sees) at the run's first launch and reuses it after
(:func:`runtime_env`), and
``scripts/fresh_session.sh``, which starts mpirun and, as their launch agent, every daemon, puts
it in their ``LD_PRELOAD``; the library takes itself out of ``LD_PRELOAD`` as it loads, so the
ranks do not inherit it. Without a compiler (or where the build fails, or the run folder's path
has a space or a colon, which ``LD_PRELOAD`` cannot hold) the job runs without it, said at each
launch, and a launch that spans hosts spawns at most ``recover.rejoin.spawns_across_hosts``
times before it regrows by a relaunch (``data_parallel/forward/rejoin.py``). A rank knows the fix
is in from :data:`ENV` in its environment (:func:`active`): measured on the emulated cluster, every
rank of the launch and every spawned process, on every node, has it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .native import FOLDER, BuildError, compiler
from .native import build as build_library
from .native import library_path as native_library_path

ENV = "NANOTRON_RECOVER_PRRTE_FIX"  # the library's path, read by scripts/fresh_session.sh
SOURCE = Path(__file__).with_name("prrte_connect_fix.c")
__all__ = [
    "ENV",
    "FOLDER",
    "SOURCE",
    "BuildError",
    "active",
    "build",
    "compiler",
    "library_path",
    "runtime_env",
]


def library_path(run_dir: str | Path) -> Path:
    """Where the library built from the current source lives in ``run_dir`` (its name carries the
    source's digest, so a changed source is built anew)."""
    return native_library_path(SOURCE, run_dir)


def active() -> bool:
    """Whether this process's launch started Open MPI's runtime with the fix: :data:`ENV`, which
    the supervisor sets for the whole launch only when ``fresh_session.sh`` starts it (so it is
    alike on every rank, which the re-join's decision needs; nothing here that could differ
    between nodes, such as a file check, is read)."""
    return bool(os.environ.get(ENV))


def build(run_dir: str | Path) -> Path:
    """The fix's library in ``run_dir``, compiled unless already there; raises :class:`BuildError`."""
    return build_library(SOURCE, run_dir, compiler())


def runtime_env(run_dir: str | Path, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """The environment entry that makes ``scripts/fresh_session.sh`` preload the fix into mpirun
    and its daemons (built first if needed), or none when it cannot be built (said through ``log``).
    The caller sets it only for a command that script starts, and removes an inherited one otherwise."""
    try:
        folder = Path(run_dir).resolve()
        if any(c in str(folder) for c in " :"):
            raise BuildError(f"the run folder {folder} has a space or a colon, which LD_PRELOAD cannot hold")
        return {ENV: str(build(folder))}
    except (BuildError, OSError) as e:
        if log is not None:
            log(
                f"Open MPI's runtime runs without the spawn fix ({e}): a launch across hosts spawns "
                "at most recover.rejoin.spawns_across_hosts times, then regrows by a relaunch"
            )
        return {}
