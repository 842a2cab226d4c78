/* A work-sharing pool for the CPU kernels: the caller and helper threads claim a job's
 * chunks one at a time from a shared counter.
 *
 * The caller never waits for a helper to start: it claims chunks itself and then waits
 * only for chunks a helper has already claimed. On a machine whose other cores are
 * busy, a parked helper therefore costs nothing beyond the chunk it holds (an OpenMP
 * team instead waits at every barrier for its slowest thread to be scheduled). Which
 * thread runs a chunk never changes a result: chunks write disjoint outputs.
 *
 * The claim word packs (job generation, chunk count, next chunk) so that a helper still
 * looking at a finished job can never claim a chunk of the next one; a job's function
 * and context are read only after a successful claim, and the caller does not return
 * (and so reuse them) before every claimed chunk is done. Helpers spin briefly between
 * jobs (one layer's kernels come microseconds apart), then sleep on a condition
 * variable. Tested by tests/cpu_kernels/test_pool.py.
 */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define MAX_HELPERS 63
#define SPIN_ITERS 20000
#define YIELD_EVERY 64

static qw_task_fn job_fn;
static const void *job_ctx;
static _Atomic uint64_t claim_word; /* gen:24 | chunks:20 | next:20 */
static _Atomic int64_t chunks_done;
static _Atomic uint64_t generation;
static _Atomic int sleepers;
static _Atomic int stopping;
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t job_mu = PTHREAD_MUTEX_INITIALIZER; /* one shared job at a time */
static pthread_t helpers[MAX_HELPERS];
static int num_helpers;

#define GEN_OF(w) ((w) >> 40)
#define COUNT_OF(w) (((w) >> 20) & 0xFFFFF)
#define NEXT_OF(w) ((w) & 0xFFFFF)

/* Claim and run chunks of job generation gen until none is left. */
static void run_chunks(uint64_t gen) {
    for (;;) {
        uint64_t w = atomic_load_explicit(&claim_word, memory_order_acquire);
        if (GEN_OF(w) != (gen & 0xFFFFFF) || NEXT_OF(w) >= COUNT_OF(w)) return;
        if (!atomic_compare_exchange_weak_explicit(&claim_word, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        job_fn(job_ctx, (int64_t)NEXT_OF(w));
        atomic_fetch_add_explicit(&chunks_done, 1, memory_order_release);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&generation);
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (atomic_load_explicit(&stopping, memory_order_relaxed)) return NULL;
            if (++spins < SPIN_ITERS) {
                /* now and then let a thread waiting for this core run (the grammar's mask
                 * fills, the event loop): one descheduled mid-chunk would stall the caller */
                if (spins % YIELD_EVERY == 0) sched_yield();
                else qw_cpu_relax();
                continue;
            }
            pthread_mutex_lock(&sleep_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen && !atomic_load(&stopping))
                pthread_cond_wait(&sleep_cv, &sleep_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&sleep_mu);
            spins = 0;
        }
        seen = g;
        run_chunks(g);
    }
}

int64_t qw_pool_threads(void) { return num_helpers + 1; }

/* Run jobs on `threads` threads, the caller included; returns the number now in use. */
int64_t qw_pool_set_threads(int64_t threads) {
    int want = threads - 1 < 0 ? 0 : (threads - 1 > MAX_HELPERS ? MAX_HELPERS : (int)threads - 1);
    pthread_mutex_lock(&job_mu);
    if (want < num_helpers) { /* stop them all, start the wanted number below */
        atomic_store(&stopping, 1);
        pthread_mutex_lock(&sleep_mu);
        pthread_cond_broadcast(&sleep_cv);
        pthread_mutex_unlock(&sleep_mu);
        for (int i = 0; i < num_helpers; i++) pthread_join(helpers[i], NULL);
        num_helpers = 0;
        atomic_store(&stopping, 0);
    }
    while (num_helpers < want) {
        if (pthread_create(&helpers[num_helpers], NULL, helper_main, NULL) != 0) break;
        num_helpers++;
    }
    pthread_mutex_unlock(&job_mu);
    return num_helpers + 1;
}

void qw_pool_run(qw_task_fn fn, const void *ctx, int64_t chunks) {
    if (chunks <= 0) return;
    if (num_helpers == 0 || chunks < 2 || chunks > QW_POOL_MAX_CHUNKS ||
        pthread_mutex_trylock(&job_mu) != 0) {
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    uint64_t gen = atomic_load(&generation) + 1;
    job_fn = fn;
    job_ctx = ctx;
    atomic_store_explicit(&chunks_done, 0, memory_order_relaxed);
    atomic_store_explicit(&claim_word, ((gen & 0xFFFFFF) << 40) | ((uint64_t)chunks << 20),
                          memory_order_release);
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_mu);
        pthread_cond_broadcast(&sleep_cv);
        pthread_mutex_unlock(&sleep_mu);
    }
    run_chunks(gen);
    while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks) qw_cpu_relax();
    pthread_mutex_unlock(&job_mu);
}
