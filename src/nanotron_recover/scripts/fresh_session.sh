#!/bin/sh
# sh fresh_session.sh NAME PROGRAM [ARGS...]: remove a dead process's Open MPI session folder
# <tmp>/NAME.<this pid>, then become PROGRAM under this same pid (exec keeps it), so PROGRAM
# (mpirun: NAME "ompi"; a prted daemon: NAME "prted") finds no stale PMIx rendezvous file of
# its own. Why: src/nanotron_recover/session_dirs.py.
name=$1
shift
rm -rf -- "${TMPDIR:-${TEMP:-${TMP:-/tmp}}}/$name.$$"
if [ "$name" = ompi ]; then
    # The daemons mpirun starts on other hosts (srun ... prted ...) come through here too, and
    # stay attached: a daemon that detaches forks away from the pid it cleaned for.
    PRTE_MCA_prte_launch_agent="sh $0 prted prted"
    export PRTE_MCA_prte_launch_agent
    mpirun=$1
    shift
    exec "$mpirun" --leave-session-attached "$@"
fi
exec "$@"
