"""The run directory's fencing token: which processes may still write its shared files.

A job relaunched inside its allocation can leave processes of the old job alive: a node cut off
from the network, or frozen and thawed later, cannot be ended by the runtime. Such a process may
wake up while a newer job trains in the same run directory and would then move ``latest`` back,
overwrite the outcome, append stale metrics. Every shared write therefore carries a check against
one token, held in ``<run_dir>/token.json``::

    {"nonce": "<random hex, one per supervisor start>", "generation": <int>, "time": <wall clock>}

- The **generation only grows.** The supervisor advances it (:func:`advance`) before it starts a
  job, and again the moment a job it will relaunch has ended, before it cleans up and probes the
  hosts: the old job's processes are fenced from that instant. A supervisor start reads the file
  and goes one past it, so a process of an earlier Slurm job in the same run directory is never
  current again; the **nonce** (fresh per supervisor start) tells two such starts apart even if the
  file was removed in between.
- The new token is written **durably** (written, ``fsync``-ed, renamed, folder ``fsync``-ed)
  before any process of the new job runs, and handed to the job's processes in
  ``NANOTRON_RECOVER_TOKEN`` (spawned processes inherit it from the runtime). A job started without
  a supervisor takes the token the file holds at its start (none: no file).
- **Every shared write checks the token at the moment of writing** (:func:`guard`), right before
  the rename or append that makes it visible: the outcome, a checkpoint's publication and
  ``latest``, the parameter digests, a snapshot's publication, metrics and incident lines, the
  commit record. A process whose token is not the file's writes nothing and fail-stops.

What a filesystem without compare-and-swap leaves open: a process stopped between the check and
the rename it guards (a window of microseconds, against the minutes a save takes) still renames
once it wakes up. The renames it guards carry the token inside what they publish (``outcome.json``,
``commit.json``, a checkpoint's ``meta.json``), so a reader can tell which generation wrote it.

A read error is never "generation 0": an unreadable token file refuses the write (after a few
retries, so a passing NFS hiccup does not stop a healthy rank).

Within one generation, a process the job itself removed (shrunk away after it failed or froze)
is marked by an empty file ``<run_dir>/fence/<host>-<pid>`` (:func:`removed_marker`), written by
the job's logging rank: such a process writes nothing if it wakes up, and the supervisor's
heartbeat-file watch knows the job has already dealt with it. A relaunch clears the folder.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .atomic_file import write_text_atomically

FILENAME = "token.json"
REMOVED_DIR = "fence"  # processes the job removed, one empty file each
ENV = "NANOTRON_RECOVER_TOKEN"
READ_TRIES = 3
READ_RETRY_S = 0.05


class TokenError(RuntimeError):
    """``token.json`` exists but cannot be read or parsed."""


class Fenced(PermissionError):
    """This process's token is not the run directory's: it must not write shared files. A
    PermissionError, so that every path that handles a refused write (a checkpoint abandoned and
    discarded, a record not written) handles this one the same way."""


@dataclass(frozen=True)
class Token:
    nonce: str
    generation: int

    def __str__(self) -> str:
        return f"{self.nonce}:{self.generation}"

    @classmethod
    def parse(cls, text: str) -> Token:
        nonce, _, generation = text.strip().rpartition(":")
        if not nonce or not generation.isdigit():
            raise ValueError(f"not a fencing token: {text!r} (expected NONCE:GENERATION)")
        return cls(nonce, int(generation))

    def as_record(self) -> dict[str, object]:
        return {"nonce": self.nonce, "generation": self.generation}


def read_token(run_dir: str | Path) -> Token | None:
    """The run directory's token; None when it has none. Raises TokenError when the file exists
    and stays unreadable or malformed over :data:`READ_TRIES` reads."""
    path = Path(run_dir) / FILENAME
    error: Exception | None = None
    for attempt in range(READ_TRIES):
        try:
            record = json.loads(path.read_text())
            return Token(str(record["nonce"]), int(record["generation"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            error = e
            if attempt + 1 < READ_TRIES:
                time.sleep(READ_RETRY_S)
    raise TokenError(f"{path}: unreadable fencing token ({error})")


def advance(run_dir: str | Path, nonce: str | None = None) -> Token:
    """Make a new current token, one generation past the file's (the first is generation 1), and
    write it durably; the token (for the job about to start, in :data:`ENV`: the caller, the
    supervisor, is the authority and fences nothing of its own). ``nonce`` defaults to the current one when the file has one and a
    fresh one otherwise: a supervisor passes :func:`new_nonce` once, at its start."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    current = read_token(run_dir)
    nonce = nonce or (current.nonce if current is not None else new_nonce())
    token = Token(nonce, 1 if current is None else current.generation + 1)
    path = run_dir / FILENAME
    tmp = path.with_name(f"{FILENAME}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({**token.as_record(), "time": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(run_dir)
    return token


def new_nonce() -> str:
    return secrets.token_hex(8)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename is what makes it visible
    finally:
        os.close(fd)


# -- this process's own token ---------------------------------------------------------------------
_mine: Token | None = None
_adopted = False
_run_dir: Path | None = None  # the run directory the token was adopted for


def set_mine(token: Token | None, run_dir: str | Path | None = None) -> None:
    global _mine, _adopted, _run_dir
    _mine, _adopted = token, True
    _run_dir = None if run_dir is None else Path(run_dir)


def mine() -> Token | None:
    return _mine


def adopt(run_dir: str | Path) -> Token | None:
    """At a process's start: its token, from ``NANOTRON_RECOVER_TOKEN`` (a supervised job) or else
    from the run directory as it is now (a job started without a supervisor); this process's."""
    text = os.environ.get(ENV)
    set_mine(Token.parse(text) if text else read_token(run_dir), run_dir)
    return _mine


def is_current(run_dir: str | Path) -> bool:
    """Whether this process may write the run directory's shared files: its token is the file's.
    A process that never adopted a token (a tool, a test) is not fenced."""
    if not _adopted:
        return True
    try:
        return read_token(run_dir) == _mine
    except TokenError:
        return False


def guard(run_dir: str | Path, what: str) -> None:
    """Right before a shared write becomes visible: raise :class:`Fenced` unless this process's
    token is current. ``what`` names the write, for the message."""
    if is_current(run_dir):
        return
    try:
        current = read_token(run_dir)
    except TokenError as e:
        current = f"unreadable: {e}"  # type: ignore[assignment]
    raise Fenced(
        f"not writing {what}: this process holds fencing token {_mine}, the run directory "
        f"{run_dir} is at {current} (a newer job owns it)"
    )


def guard_adopted(what: str) -> None:
    """:func:`guard` against the run directory this process adopted its token for (a write outside
    it, e.g. a checkpoint folder elsewhere, is still the run's); nothing for a process without one."""
    if _adopted and _run_dir is not None:
        guard(_run_dir, what)


def publish_text(run_dir: str | Path, path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, fenced: written aside, then :func:`guard`, then
    renamed (a reader sees the old file or the new one; an older job's process changes nothing).
    Raises :class:`Fenced` or OSError; the aside file is gone either way."""
    path = Path(path)
    write_text_atomically(path, text, before_rename=lambda: guard(run_dir, path.name))


def removed_marker(run_dir: str | Path, host: str, pid: int) -> Path:
    """The file that says the job removed process ``pid`` on ``host`` (per process, not per rank:
    after a re-join a rank belongs to a new process)."""
    return Path(run_dir) / REMOVED_DIR / f"{host}-{pid}"
