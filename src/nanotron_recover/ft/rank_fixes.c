/*
 * Loaded into every rank before Open MPI (ft/rank_fixes.py). Three parts: a failure notice that
 * arrives while a communicator is being created must not crash the rank (here); a fragment from a
 * rank its communicator does not have is dropped, not fatal; an abort says why (both further down).
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
 * A fragment that names a source outside its communicator is dropped, not fatal.
 *
 * ob1's receive callbacks look the sender up in the communicator the fragment names
 * (mca_pml_ob1_peer_lookup, ompi/mca/pml/ob1/pml_ob1_comm.h); a source rank past the
 * communicator's size ends the process through ompi_rte_abort ("PML OB1 received a message from a
 * rank outside the valid range of the communicator"), and with it the whole job, since the runtime
 * ends every process of a job one of them aborts. Seen in this project's chaos campaigns on the
 * emulated cluster, always during a recovery's MPIX_Comm_shrink: one relaunch of the job each time.
 *
 * The check runs first thing in the callback, before the matching lock is taken, anything is
 * allocated or the fragment is matched (pml_ob1_recvfrag.c). So the callbacks of the three
 * fragment kinds that carry a match header (MATCH, RNDV, RGET) are wrapped in the table the
 * transports dispatch through (mca_btl_base_active_message_trigger, opal/mca/btl/btl.h): the
 * wrapper marks the thread as inside one, and the abort below, called from inside it for that
 * reason, jumps back to the wrapper, which returns to the transport as if ob1 had taken the
 * fragment. It is dropped: no receive of the communicator sees it. The same abort anywhere else
 * (e.g. the pending fragments a new communicator adopts, mca_pml_ob1_add_comm) still ends the rank.
 */
#define OB1_HDR_TYPE_MATCH 0x41 /* MCA_BTL_TAG_PML + 1, ompi/mca/pml/ob1/pml_ob1_hdr.h */
#define OB1_HDR_TYPE_RGET 0x43  /* MATCH, RNDV, RGET: the kinds that carry a match header */
#define STRAY_REASON "outside the valid range of the communicator"

typedef void (*recv_cb_fn)(void *, const void *);
struct recv_cb { recv_cb_fn cbfunc; void *cbdata; };   /* mca_btl_active_message_callback_t */
struct segment { void *addr; uint64_t len; };          /* mca_btl_base_segment_t */
struct recv_desc { void *endpoint; const struct segment *segments; size_t count; uint8_t tag; void *cbdata; };

static recv_cb_fn ob1_callback[OB1_HDR_TYPE_RGET + 1];
static __thread sigjmp_buf *stray_jump;                /* set while a wrapped callback runs */
static unsigned long dropped;

static void said_dropped(const struct recv_desc *desc)
{
    unsigned short ctx = 0;
    int src = -1, tag = 0;
    if (desc->segments != NULL && desc->segments->addr != NULL && desc->segments->len >= 12) {
        const unsigned char *h = desc->segments->addr;   /* common header, then ctx, src, tag */
        memcpy(&ctx, h + 2, sizeof ctx);
        memcpy(&src, h + 4, sizeof src);
        memcpy(&tag, h + 8, sizeof tag);
    }
    if (__atomic_add_fetch(&dropped, 1, __ATOMIC_RELAXED) <= 3) {
        fprintf(stderr, "[nanotron-recover] pid %d: dropped a message for context id %u from rank %d "
                "(tag %d), which its communicator does not have (Open MPI would end the rank)\n",
                (int) getpid(), ctx, src, tag);
        fflush(stderr);
    }
}

static void guarded_callback(void *btl, const void *vdesc)
{
    const struct recv_desc *desc = vdesc;
    recv_cb_fn real = ob1_callback[desc->tag <= OB1_HDR_TYPE_RGET ? desc->tag : 0];
    sigjmp_buf here, *outer = stray_jump;
    if (sigsetjmp(here, 0) == 0) {
        stray_jump = &here;
        real(btl, vdesc);
    } else {
        said_dropped(desc);
    }
    stray_jump = outer;
}

/* Wrap ob1's receive callbacks (after MPI_Init, which registers them). 1 if wrapped, 0 if not. */
int rank_fixes_guard_fragments(void)
{
    struct recv_cb *table = (struct recv_cb *) mpi_symbol("mca_btl_base_active_message_trigger");
    if (table == NULL || ob1_callback[OB1_HDR_TYPE_MATCH] != NULL) {
        return table != NULL;
    }
    for (int tag = OB1_HDR_TYPE_MATCH; tag <= OB1_HDR_TYPE_RGET; tag++) {
        if (table[tag].cbfunc == NULL) {
            return 0;  /* not ob1's table as expected: leave it alone */
        }
    }
    for (int tag = OB1_HDR_TYPE_MATCH; tag <= OB1_HDR_TYPE_RGET; tag++) {
        ob1_callback[tag] = table[tag].cbfunc;
        __atomic_store_n(&table[tag].cbfunc, guarded_callback, __ATOMIC_RELEASE);
    }
    return 1;
}

/* How many stray fragments this process dropped. */
unsigned long rank_fixes_dropped(void)
{
    return __atomic_load_n(&dropped, __ATOMIC_RELAXED);
}

/*
 * ompi_rte_abort(code, fmt, ...) is how Open MPI ends a rank on an internal error. The reason it
 * formats goes to PMIx_Abort only, which, with a recoverable runtime, prints nothing: the rank just
 * exits with status 255. This definition (reached through libmpi's PLT like the one above) drops
 * a stray fragment (see above) and otherwise says the reason on stderr, with the host and pid,
 * before it hands over to libmpi's own.
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
    if (stray_jump != NULL && strstr(reason, STRAY_REASON) != NULL) {
        siglongjmp(*stray_jump, 1);
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
