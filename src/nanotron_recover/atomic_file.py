"""Replace a small shared file atomically, safe between the threads of one process.

The run directory's small files (``abandoned.json``, failure records, ``outcome.json``, the rank
table) are written aside and renamed over the target, so a reader sees the old file or the new
one, never a part. The aside name must be unique per *write*, not per process: a rank writes
some of them from several threads at once (its watchdog and its join watch both give a stuck
re-join up, within milliseconds of each other). With one aside name per process, the second
writer truncated the file the first had just renamed into place; the first thread then killed
the process (``fail_stop``) before the second had written a byte, leaving an empty
``abandoned.json`` that the supervisor could not read. The job then waited for the commit
deadline's repair bound (9 s more) instead of being relaunched at once.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path

_count = itertools.count()


def aside_path(path: Path) -> Path:
    """A name next to ``path`` that no other write, of any thread or process, uses."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_count)}.tmp")


def write_text_atomically(
    path: str | Path, text: str, before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``text`` to ``path`` through a unique aside file; ``before_rename`` (a fencing check)
    runs between the write and the rename and may raise to cancel it. Raises OSError; the aside
    file is gone either way."""
    path = Path(path)
    tmp = aside_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_version(path: str | Path) -> tuple[int, int, int] | None:
    """Which version of a file this is: (inode, size, mtime in ns), None when it is missing. A file
    replaced by a rename is a new inode; one appended to grows."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
