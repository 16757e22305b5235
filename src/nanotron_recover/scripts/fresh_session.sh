#!/bin/sh
# sh fresh_session.sh NAME PROGRAM [ARGS...]: remove a dead process's Open MPI session folder
# <tmp>/NAME.<this pid>, then become PROGRAM under this same pid (exec keeps it), so PROGRAM
# (mpirun: NAME "ompi"; a prted daemon: NAME "prted") finds no stale PMIx rendezvous file of
# its own. Why: src/nanotron_recover/session_dirs.py.
name=$1
shift
rm -rf -- "${TMPDIR:-${TEMP:-${TMP:-/tmp}}}/$name.$$"
# mpirun and its daemons load the project's fix for PRRTE's spawn defects when the supervisor built
# one (src/nanotron_recover/ft/prrte_fix.py); it leaves LD_PRELOAD as it loads, so the ranks do not
# inherit it.
if [ -n "$NANOTRON_RECOVER_PRRTE_FIX" ] && [ -r "$NANOTRON_RECOVER_PRRTE_FIX" ]; then
    LD_PRELOAD="$NANOTRON_RECOVER_PRRTE_FIX${LD_PRELOAD:+:$LD_PRELOAD}"
    export LD_PRELOAD
fi
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
