/*
 * Preloaded into Open MPI's runtime processes (mpirun and every prted daemon): works around two
 * defects of PRRTE 3.0.x's connect_release() (src/prted/pmix/pmix_server_dyn.c), which every
 * MPI_Comm_spawn across hosts runs. Why and how it was measured: ft/prrte_fix.py.
 *
 * 1. connect_release() allocates its info array with PMIX_INFO_CREATE(info, 1) when no context id
 *    was asked for, then registers the first namespace with two of its elements and destructs the
 *    second one: a read and a destruct past the end of the array, which corrupts the heap (a
 *    daemon or mpirun dies around a spawn). PMIx_Info_create(n) here allocates one element more,
 *    constructed and empty, so the second element is a valid empty one.
 * 2. It reads the collective's wrapped directives as a namespace, and registers a namespace named
 *    "" that then matches every later namespace and answers their direct-modex requests with
 *    "not found" (the second spawn's process cannot reach the job). An empty namespace is refused.
 *
 * Every info array the runtime allocates gets the spare element (libpmix and libprrte create
 * them in many places): harmless, a few hundred bytes each. In prterun and prted the library takes itself out of LD_PRELOAD as it
 * loads, so the processes they start (the ranks) do not inherit it; mpirun itself only execs
 * prterun, which must inherit it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PMIX_ERR_BAD_PARAM (-27)

static void *next_symbol(const char *name)
{
    void *symbol = dlsym(RTLD_NEXT, name);
    if (symbol == NULL) {
        /* libpmix loaded later with RTLD_LOCAL (a Python process) is not in the search order. */
        void *lib = dlopen("libpmix.so.2", RTLD_LAZY | RTLD_NOLOAD);
        if (lib != NULL) {
            symbol = dlsym(lib, name);
        }
    }
    if (symbol == NULL) {
        fprintf(stderr, "prrte_connect_fix: %s not found\n", name);
        abort();
    }
    return symbol;
}

typedef void *(*info_create_fn)(size_t);

/* The next definitions, found once; the runtime's threads may call in at the same time, so the
 * pointers are read and written atomically (two threads finding them both store the same value). */
static info_create_fn real_info_create;

void *PMIx_Info_create(size_t n)
{
    info_create_fn real = __atomic_load_n(&real_info_create, __ATOMIC_ACQUIRE);
    if (real == NULL) {
        real = (info_create_fn) next_symbol("PMIx_Info_create");
        __atomic_store_n(&real_info_create, real, __ATOMIC_RELEASE);
    }
    return real(n == 0 ? 0 : n + 1);
}

typedef int (*register_nspace_fn)(const char *, int, void *, size_t, void *, void *);

static register_nspace_fn real_register_nspace;

int PMIx_server_register_nspace(const char *nspace, int nlocalprocs, void *info, size_t ninfo,
                                void *cbfunc, void *cbdata)
{
    if (nspace == NULL || nspace[0] == '\0') {
        return PMIX_ERR_BAD_PARAM;
    }
    register_nspace_fn real = __atomic_load_n(&real_register_nspace, __ATOMIC_ACQUIRE);
    if (real == NULL) {
        real = (register_nspace_fn) next_symbol("PMIx_server_register_nspace");
        __atomic_store_n(&real_register_nspace, real, __ATOMIC_RELEASE);
    }
    return real(nspace, nlocalprocs, info, ninfo, cbfunc, cbdata);
}

/* In the runtime's own processes, remove every LD_PRELOAD entry that names this library (by its
 * file name), so that their children do not load it. */
__attribute__((constructor)) static void leave_preload(void)
{
    Dl_info self;
    const char *preload = getenv("LD_PRELOAD");
    const char *program = program_invocation_short_name;
    if (strcmp(program, "prterun") != 0 && strcmp(program, "prted") != 0) {
        return;
    }
    if (preload == NULL || dladdr((void *) leave_preload, &self) == 0 || self.dli_fname == NULL) {
        return;
    }
    const char *base = strrchr(self.dli_fname, '/');
    base = base == NULL ? self.dli_fname : base + 1;
    char *copy = strdup(preload), *kept = calloc(strlen(preload) + 1, 1), *save = NULL;
    if (copy == NULL || kept == NULL) {
        free(copy);
        free(kept);
        return;
    }
    for (char *entry = strtok_r(copy, ": ", &save); entry != NULL; entry = strtok_r(NULL, ": ", &save)) {
        const char *entry_base = strrchr(entry, '/');
        entry_base = entry_base == NULL ? entry : entry_base + 1;
        if (strcmp(entry_base, base) == 0) {
            continue;
        }
        if (kept[0] != '\0') {
            strcat(kept, ":");
        }
        strcat(kept, entry);
    }
    if (kept[0] == '\0') {
        unsetenv("LD_PRELOAD");
    } else {
        setenv("LD_PRELOAD", kept, 1);
    }
    free(copy);
    free(kept);
}
