"""Building the small C libraries the project loads into Open MPI's processes: the runtime's spawn
fix (:mod:`.prrte_fix`) and the ranks' fixes (:mod:`.rank_fixes`).

Each is compiled with the host's C compiler into the run folder (which every node of a job sees),
once: its name carries the source's digest, so a changed source is built anew and an unchanged one
is reused by every later launch. The compiler writes to a file of its own and the result is renamed
into place whole, so two builders at once (two supervisors, or a rank and a supervisor) never see
half a library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FOLDER = "runtime"  # under the run folder
BUILD_TIMEOUT_S = 60.0


class BuildError(RuntimeError):
    """A library could not be compiled here."""


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def library_path(source: Path, run_dir: str | Path) -> Path:
    """Where the library built from ``source`` as it is now lives in ``run_dir``."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return Path(run_dir) / FOLDER / f"{source.stem}-{digest}.so"


def build(source: Path, run_dir: str | Path, cc: str | None) -> Path:
    """``source``'s library in ``run_dir``, compiled with ``cc`` unless already there; raises
    :class:`BuildError` (no compiler, a folder that cannot be written, a failed build)."""
    target = library_path(source, run_dir)
    if target.is_file():
        return target
    if cc is None:
        raise BuildError("no C compiler (set CC, or install cc)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own (not the pid: the supervisors of two jobs on two nodes, each in its
        # own pid namespace, may build at once), renamed into place whole.
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise BuildError(f"cannot write in {target.parent}: {e}") from None
    partial = Path(name)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(partial), str(source), "-ldl", "-lpthread"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from None
    finally:
        partial.unlink(missing_ok=True)
    return target
