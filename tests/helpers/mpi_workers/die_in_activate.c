/*
 * Test only (tests/integration/ft/test_rank_fixes.py): SIGKILL this process as it enters Open
 * MPI's ompi_comm_activate() for the DIE_IN_ACTIVATE-th time, after a short pause that lets its
 * peers reach their own activate of the same communicator. Loaded with RTLD_GLOBAL before libmpi,
 * which calls ompi_comm_activate through its PLT from every communicator creation.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

typedef int (*activate_fn)(void **, void *, void *, const void *, const void *, int, int);

static int calls;

int ompi_comm_activate(void **newcomm, void *comm, void *bridgecomm, const void *arg0, const void *arg1,
                       int send_first, int mode)
{
    const char *nth = getenv("DIE_IN_ACTIVATE");
    if (nth != NULL && ++calls == atoi(nth)) {
        usleep(300000);
        kill(getpid(), SIGKILL);
    }
    void *lib = dlopen("libmpi.so.40", RTLD_LAZY | RTLD_NOLOAD);
    activate_fn real = (activate_fn) dlsym(lib, "ompi_comm_activate");
    return real(newcomm, comm, bridgecomm, arg0, arg1, send_first, mode);
}
