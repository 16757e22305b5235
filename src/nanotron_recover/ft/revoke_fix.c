/*
 * Loaded into every rank before Open MPI (ft/revoke_fix.py): keeps a process-failure notice that
 * arrives while a communicator is being created from crashing the rank.
 *
 * Open MPI 5.0.x (and main, as read): when a process is reported failed,
 * ompi_errhandler_proc_failed_internal() calls ompi_comm_set_rank_failed() for every communicator
 * that holds it, which calls ompi_comm_revoke_local(comm, true)
 * (ompi/communicator/ft/comm_ft.c, comm_ft_revoke.c). A communicator being created (MPI_Comm_dup,
 * split, MPIX_Comm_shrink...) is in that list from its context id on, but its collectives are
 * selected only at the end of ompi_comm_activate(): until then comm->c_coll is NULL, and
 * revoke_local's call comm->c_coll->coll_revoke_local(comm) dereferences it ("Failing at address:
 * 0x450"). The same trace is sandialabs/Fenix#136. Seen in this project's long chaos campaign:
 * ranks crashed in MPIX_Comm_shrink's activate, each time costing a relaunch of the whole job.
 *
 * This library defines ompi_comm_revoke_local() (libmpi calls it through its PLT, so the first
 * definition in the global scope wins) and calls libmpi's own under a guard: a fault on the null
 * page inside that call -- the missing collectives, the only null dereference there -- jumps back
 * here, and the revoke is finished as libmpi would finish it (waiters woken with MPI_ERR_REVOKED).
 * What the fault skips is the revoke of the sub-communicators the collectives made, and a
 * communicator without collectives has none. The guard's SIGSEGV handler is installed for the
 * call only and the previous one put back after it; a fault of another thread meanwhile is handed
 * back to the previous handler.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MPI_ERR_REVOKED 77                      /* Open MPI's mpi.h (mpi-ext.h: MPIX_ERR_REVOKED) */
#define NULL_PAGE_LIMIT ((uintptr_t) 1 << 16)   /* a field read through a NULL struct pointer */

typedef bool (*revoke_local_fn)(void *, bool);
typedef void (*wakeup_fn)(int);

static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int guarded;
static __thread sigjmp_buf guard_jump;
static struct sigaction previous;
static unsigned long caught;

static void *mpi_symbol(const char *name)
{
    /* libmpi loaded after this library (by mpi4py) is not after it for RTLD_NEXT: ask it directly. */
    void *lib = dlopen("libmpi.so.40", RTLD_LAZY | RTLD_NOLOAD);
    void *symbol = lib == NULL ? NULL : dlsym(lib, name);
    return symbol != NULL ? symbol : dlsym(RTLD_NEXT, name);
}

static void on_segv(int sig, siginfo_t *info, void *context)
{
    (void) sig;
    (void) context;
    if (guarded && (uintptr_t) info->si_addr < NULL_PAGE_LIMIT) {
        siglongjmp(guard_jump, 1);
    }
    /* Not the fault this guard is for: the faulting instruction runs again under the previous handler. */
    sigaction(SIGSEGV, &previous, NULL);
}

static void wake_waiters(void)
{
    const bool *threads = (const bool *) mpi_symbol("opal_uses_threads");
    wakeup_fn wake = (wakeup_fn) mpi_symbol(threads != NULL && *threads
                                                ? "opal_threads_base_wait_sync_global_wakeup_mt"
                                                : "opal_threads_base_wait_sync_global_wakeup_st");
    if (wake != NULL) {
        wake(MPI_ERR_REVOKED);
    }
}

bool ompi_comm_revoke_local(void *comm, bool coll_only)
{
    static revoke_local_fn real;
    revoke_local_fn fn = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (fn == NULL) {
        fn = (revoke_local_fn) mpi_symbol("ompi_comm_revoke_local");
        if (fn == NULL || fn == ompi_comm_revoke_local) {
            fprintf(stderr, "revoke_fix: libmpi's ompi_comm_revoke_local not found\n");
            return false;
        }
        __atomic_store_n(&real, fn, __ATOMIC_RELEASE);
    }
    if (guarded) {
        return fn(comm, coll_only); /* reentered from inside a guarded call: already guarded */
    }
    pthread_mutex_lock(&guard_lock);
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_segv;
    ours.sa_flags = SA_SIGINFO;
    sigemptyset(&ours.sa_mask);
    sigaction(SIGSEGV, &ours, &previous);
    bool revoked;
    if (sigsetjmp(guard_jump, 1) == 0) {
        guarded = 1;
        revoked = fn(comm, coll_only);
        guarded = 0;
    } else {
        guarded = 0;
        revoked = true;
        __atomic_add_fetch(&caught, 1, __ATOMIC_RELAXED);
        wake_waiters();
    }
    sigaction(SIGSEGV, &previous, NULL);
    pthread_mutex_unlock(&guard_lock);
    return revoked;
}

/* How many revokes met a communicator without collectives (read by tests and the rank's report). */
unsigned long revoke_fix_caught(void)
{
    return __atomic_load_n(&caught, __ATOMIC_RELAXED);
}
