/*
 * Test only (tests/integration/ft/test_rank_fixes.py): SIGKILL this process as it starts the
 * first round of a context-id allocation it leads across two jobs, the step of MPI_Comm_spawn
 * (and MPI_Comm_connect/accept) where the spawn's root trades its side's candidate id with the
 * spawned processes' root through the PMIx data server (ompi/communicator/comm_cid.c,
 * ompi_comm_allreduce_pmix_reduce_complete: keys "<port>:nextcid:send:<iter>"). The other parents
 * are then inside the same allocation's libnbc broadcast from this root.
 *
 * Loaded with RTLD_GLOBAL before libmpi, which calls opal_pmix_base_exchange (libopen-pal)
 * through its PLT. A pmix_info_t begins with its key (char[PMIX_MAX_KEYLEN + 1]).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

typedef int (*exchange_fn)(void *, void *, int);

int opal_pmix_base_exchange(void *indat, void *outdat, int timeout)
{
    if (indat != NULL && strstr((const char *) indat, ":nextcid:") != NULL) {
        kill(getpid(), SIGKILL);
    }
    void *lib = dlopen("libopen-pal.so.80", RTLD_LAZY | RTLD_NOLOAD);
    exchange_fn real = (exchange_fn) (lib != NULL ? dlsym(lib, "opal_pmix_base_exchange")
                                                  : dlsym(RTLD_NEXT, "opal_pmix_base_exchange"));
    return real(indat, outdat, timeout);
}
