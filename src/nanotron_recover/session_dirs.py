"""Open MPI session folders left by killed processes, and the launch that cannot start because of one.

``mpirun`` (prterun) keeps its PMIx rendezvous files in ``<tmp>/ompi.<pid>/``, and each daemon it
starts on another host (``prted``, through ``srun``) in ``<tmp>/prted.<pid>/``. A process ended
by SIGKILL leaves its folder behind, and this project ends processes that way by design: the
supervisor ends a stalled job's session, a lost node's daemon is killed with it, a test kills its
job. Process ids are reused (``pid_max`` is 32768 in many containers): a later ``mpirun`` or
daemon that gets a dead one's pid finds its rendezvous file already there, PMIx's listener does
not start ("The PMIx server's listener thread failed to start", exit 213, in milliseconds), and the
job never runs. For a daemon, the whole job ends ("srun returned non-zero exit status ... from
launching the per-node daemon"), which the supervisor can only answer with a relaunch. After a day
of faults a node holds hundreds of such folders (measured here: 52 ``ompi.*`` and 386 ``prted.*``
in ``/tmp``: about 1 ``mpirun`` in 630 and 1 daemon in 85 could not start; a suite of a
thousand launches failed once).

The pid a process will have is known only inside it, so the folder is removed there:
:func:`fresh_session` runs ``mpirun`` through ``scripts/fresh_session.sh``, which removes
``<tmp>/ompi.$$`` and then ``exec``s ``mpirun`` under the same pid; it also makes itself the
daemons' launch agent (``PRTE_MCA_prte_launch_agent``), so each ``prted`` removes its own
``<tmp>/prted.$$`` first the same way. A live process never owns the removed folder: the pid is
the caller's own.
"""

from __future__ import annotations

from pathlib import Path

from .hosts import launcher_at

SCRIPT = Path(__file__).parent / "scripts" / "fresh_session.sh"


def fresh_session(cmd: list[str]) -> list[str]:
    """``cmd`` with its ``mpirun`` started so that neither it nor its daemons can meet a stale
    session folder of their own pid (the script goes right before ``mpirun``, past ``env`` and
    ``timeout`` wrappers, so ``exec`` hands ``mpirun`` the pid it cleaned for); a command that
    runs no ``mpirun`` unchanged. Open MPI splits the launch agent at spaces, so a script path
    with a space is left out."""
    at = launcher_at(cmd)
    if at is None or " " in str(SCRIPT):
        return list(cmd)
    return [*cmd[:at], "sh", str(SCRIPT), "ompi", *cmd[at:]]
