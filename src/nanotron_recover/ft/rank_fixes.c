/*
 * Loaded into every rank before Open MPI (ft/rank_fixes.py). Four parts: a failure notice that
 * arrives while a communicator is being created must not crash the rank (here); only processes of
 * this launch may connect; an abort says why; a failure met while a spawn or a merge allocates its
 * context id ends that creation with the error instead of retrying it forever (the last three
 * further down).
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
#include <stdarg.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
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
            fprintf(stderr, "rank_fixes: libmpi's ompi_comm_revoke_local not found\n");
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
unsigned long rank_fixes_caught(void)
{
    return __atomic_load_n(&caught, __ATOMIC_RELAXED);
}

/*
 * Only processes of this launch are let in.
 *
 * Open MPI's TCP transport binds each process's listening socket to the first free port from
 * btl_tcp_port_min_v4 (1024) up (opal/mca/btl/tcp/btl_tcp_component.c), so a process started on a
 * host where another one of an earlier launch listened gets that one's port again. A process of
 * the earlier launch that still runs (a relaunch does not wait for every rank of the launch it ends
 * to be gone: the node may be frozen or cut off, or its ranks slow to die) and dials its old peer
 * reaches the new process, and the transport lets it in: an unknown name is looked up
 * (mca_btl_tcp_proc_lookup -> opal_proc_for_name) and added as a peer. Its messages then land on
 * the new process's communicators of the same context ids: agreements decided with another job's
 * values, fragments from ranks the communicator does not have, communicators with clashing context
 * ids. Seen in the chaos campaigns on the emulated cluster after relaunches: healthy ranks entering
 * a recovery with no failure, step agreements returning garbage, and then a stall or an abort.
 *
 * A process of another launch has another job family: the upper 16 bits of a job id are a hash of
 * the launch's PMIx namespace (opal_pmix_convert_nspace, opal/mca/pmix/base/pmix_base_fns.c), the
 * lower 16 the job within the launch, so processes a re-join spawns share the family. The lookup
 * of a connecting process is made through libopen-pal's PLT, so this definition stands in for it
 * and answers "no such process" for another family: the transport closes that connection
 * ("server accept cannot find guid", its help text) and none of its messages is read.
 */
typedef void *(*proc_lookup_fn)(const void *);
struct process_name { uint32_t jobid; uint32_t vpid; };   /* opal_process_name_t */
static unsigned long refused;

static uint32_t my_job_family(void)
{
    /* opal_process_info_t begins with my_name (opal/util/proc.h) */
    const struct process_name *me = (const struct process_name *) mpi_symbol("opal_process_info");
    return me == NULL ? 0 : me->jobid >> 16;
}

void *mca_btl_tcp_proc_lookup(const void *name)
{
    static proc_lookup_fn real;
    proc_lookup_fn fn = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (fn == NULL) {
        fn = (proc_lookup_fn) mpi_symbol("mca_btl_tcp_proc_lookup");
        if (fn == NULL || fn == mca_btl_tcp_proc_lookup) {
            return NULL;
        }
        __atomic_store_n(&real, fn, __ATOMIC_RELEASE);
    }
    const struct process_name *peer = name;
    uint32_t mine = my_job_family();
    if (peer != NULL && mine != 0 && peer->jobid >> 16 != mine) {
        if (__atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED) <= 3) {
            fprintf(stderr, "[nanotron-recover] pid %d: refused a connection from process %u of job "
                    "family %u, not this launch's (%u)\n",
                    (int) getpid(), peer->vpid, peer->jobid >> 16, mine);
            fflush(stderr);
        }
        return NULL;
    }
    return fn(name);
}

/* How many connections of processes of other launches this process refused. */
unsigned long rank_fixes_refused(void)
{
    return __atomic_load_n(&refused, __ATOMIC_RELAXED);
}

/*
 * ompi_rte_abort(code, fmt, ...) is how Open MPI ends a rank on an internal error. The reason it
 * formats goes to PMIx_Abort only, which, with a recoverable runtime, prints nothing: the rank just
 * exits with status 255. This definition (reached through libmpi's PLT like the one above) says
 * the reason on stderr, with the host and pid, before it hands over to libmpi's own.
 */
typedef void (*rte_abort_fn)(int, char *, ...);

void ompi_rte_abort(int error_code, char *fmt, ...)
{
    char reason[512] = "";
    if (fmt != NULL) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(reason, sizeof reason, fmt, args);
        va_end(args);
    }
    char host[64] = "?";
    gethostname(host, sizeof host - 1);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    fprintf(stderr, "[nanotron-recover] %s pid %d: Open MPI aborts this rank at %ld.%03ld (code %d): %s\n",
            host, (int) getpid(), (long) now.tv_sec, now.tv_nsec / 1000000, error_code, reason);
    fflush(stderr);
    rte_abort_fn real = (rte_abort_fn) mpi_symbol("ompi_rte_abort");
    if (real != NULL && real != (rte_abort_fn) ompi_rte_abort) {
        real(error_code, "%s", reason);
    }
    _exit(error_code == 0 ? 1 : error_code);
}

/*
 * A failure inside the context-id allocation of MPI_Comm_spawn, Intercomm_merge (and connect/accept,
 * Intercomm_create) is not dropped.
 *
 * Those creations agree on a context id with a nested request (ompi/communicator/comm_cid.c:
 * ompi_comm_allreduce_intra_pmix_nb, ompi_comm_allreduce_inter_nb...): a schedule of libnbc
 * reductions and broadcasts whose last item has no callback. ompi_comm_request_progress()
 * (ompi/communicator/comm_request.c, v5.0.x and main as read) marks the request failed when one of
 * its sub-requests failed, then, when the schedule is empty, overwrites that status with the last
 * callback's return code, OMPI_SUCCESS when there is no callback. So the nested request "succeeds"
 * without having written its result; ompi_comm_checkcid sees no error, the zeroed result disagrees,
 * and ompi_comm_nextcid_check_flag starts another round, which fails the same way against the
 * process that failed: forever, printing "NBC_Progress: an error 75" once per libnbc request, and
 * no revoke ends it (the revoke's errors are dropped the same way). The spawned processes on the
 * other side wait in MPI_Init meanwhile. Seen on CI: a re-join whose members spun in Spawn until
 * the job's deadline.
 *
 * ompi_comm_request_schedule_append_w_flags is reached through libmpi's PLT (from
 * ompi_comm_request_schedule_append too). This definition gives an item appended without a
 * callback one that returns the request's status, so the error the progress loop recorded is the
 * request's final status: the allocation ends with it (comm_cid.c's own callbacks already return
 * it when they see it), and so does the Spawn or the Merge, which the join handles like any failed
 * stage, after reopening the context-id gate (ulfm.reset_cid_gate). The status is read at the
 * offset of ompi_request_t's req_status.MPI_ERROR, found by the request type beside it
 * (OMPI_REQUEST_COMM); where neither the release nor the debug layout matches, the callback returns
 * success, as libmpi would. Reproduced and pinned for Spawn (tests/integration/ft/test_rank_fixes.py);
 * Merge and Intercomm_create take the same path by reading, untested.
 *
 * Left as it is: the error branch of ompi_comm_nextcid_check_flag clears the slot of the agreed id
 * without checking that this process had reserved it (the success branch checks): when the second
 * round fails on a process whose own candidate lost and whose slot of the agreed id holds another
 * communicator, that communicator's slot is cleared. Dup and Split reached that branch before this
 * fix; Spawn and Merge now do too, where they used to spin forever.
 */
typedef int (*comm_request_callback_fn)(void *);
typedef int (*schedule_append_fn)(void *, comm_request_callback_fn, void **, int, uint32_t);

#define OMPI_REQUEST_COMM 7           /* ompi/request/request_dbg.h: ompi_request_type_t */
static unsigned long kept;

static int request_error(const void *request)
{
    /* ompi_request_t: opal_free_list_item_t super, ompi_request_type_t req_type, then
     * ompi_status_public_t req_status {MPI_SOURCE, MPI_TAG, MPI_ERROR, ...} 8-byte aligned. The
     * free-list item is 56 bytes in a release build, 88 with OPAL_ENABLE_DEBUG. */
    static const size_t type_offsets[] = {56, 88};
    for (size_t i = 0; i < sizeof type_offsets / sizeof type_offsets[0]; ++i) {
        const char *base = (const char *) request;
        if (*(const int *) (base + type_offsets[i]) == OMPI_REQUEST_COMM) {
            return *(const int *) (base + type_offsets[i] + 8 + 2 * sizeof(int));
        }
    }
    return 0;
}

static int keep_error(void *request)
{
    int error = request_error(request);
    if (error != 0) {
        __atomic_add_fetch(&kept, 1, __ATOMIC_RELAXED);
    }
    return error;
}

int ompi_comm_request_schedule_append_w_flags(void *request, comm_request_callback_fn callback,
                                              void **subreqs, int subreq_count, uint32_t flags)
{
    static schedule_append_fn real;
    schedule_append_fn fn = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (fn == NULL) {
        fn = (schedule_append_fn) mpi_symbol("ompi_comm_request_schedule_append_w_flags");
        if (fn == NULL || fn == ompi_comm_request_schedule_append_w_flags) {
            /* Its callers mostly ignore the return code: an item left out would end a creation
             * with success and no context id. Only libmpi calls this, so it cannot be missing. */
            fprintf(stderr, "rank_fixes: libmpi's ompi_comm_request_schedule_append_w_flags not found\n");
            abort();
        }
        __atomic_store_n(&real, fn, __ATOMIC_RELEASE);
    }
    return fn(request, callback != NULL ? callback : keep_error, subreqs, subreq_count, flags);
}

/* How many callback-less steps of communicator requests returned a sub-request's error that libmpi
 * would have dropped (a request may count more than once). */
unsigned long rank_fixes_kept_errors(void)
{
    return __atomic_load_n(&kept, __ATOMIC_RELAXED);
}
