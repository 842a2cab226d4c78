/* fp32 y = x @ W^T (+ bias) for the CPU, over weights packed once into column panels.
 *
 * Layout: W [N, K] (nn.Linear's) is packed into ceil(N / PW) panels; panel p holds
 * columns p*PW .. p*PW+PW-1 of W^T as [K][PW] floats, contiguous (zero columns pad
 * the last panel). A decode step's matmul then streams each panel once, front to
 * back, which is what the hardware prefetcher does best; the row-major weight of
 * nn.Linear makes the BLAS re-read it in short strided runs at small M.
 *
 * Work: one call computes every row of x against panels [p0, p1). A tile is MB (at
 * most MB_MAX) rows of x by one panel: MB x NC vector accumulators, one panel row
 * loaded per k (NC vectors) and each x[m, k] broadcast, so the inner loop is MB x NC
 * FMAs for NC + MB loads. K is walked in blocks of KC so that a panel block stays in
 * L2 while every row tile of x passes over it (prefill); partial sums go through y
 * in fp32 unchanged.
 *
 * Rounding: each output is one fp32 accumulator summed over k = 0 .. K-1 in order,
 * bias added last; the vector types only batch independent outputs, never reassociate
 * a sum. Tested against torch.nn.functional.linear (tests/models/test_cpu_gemm.py).
 *
 * Portable C (GCC/Clang vector extensions); the vector width follows the target the
 * library is compiled for (qworker/models/cpu_gemm.py compiles it with -march=native).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define NC 4
#elif defined(__AVX__)
#define VL 8
#define NC 2
#elif defined(__aarch64__)
#define VL 4
#define NC 4
#else
#define VL 4
#define NC 2
#endif
#define MB_MAX 6
#define PW (VL * NC)
#define KC 512

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* y[m, 0:ncols] (+)= sum_{k < kn} x[m, k] * panel[k, 0:ncols] for m < MB. */
#define DEFINE_TILE(MB)                                                                    \
    static void tile_##MB(const float *x, int64_t ldx, const float *panel, int64_t kn,      \
                          float *y, int64_t ldy, int64_t ncols, int accumulate) {           \
        vf acc[MB][NC];                                                                    \
        float buf[PW];                                                                     \
        for (int m = 0; m < MB; m++) {                                                     \
            if (accumulate && ncols == PW) {                                               \
                for (int c = 0; c < NC; c++) acc[m][c] = vload(y + m * ldy + c * VL);      \
            } else if (accumulate) {                                                       \
                memset(buf, 0, sizeof buf);                                                \
                memcpy(buf, y + m * ldy, (size_t)ncols * sizeof(float));                   \
                for (int c = 0; c < NC; c++) acc[m][c] = vload(buf + c * VL);              \
            } else {                                                                       \
                for (int c = 0; c < NC; c++) acc[m][c] = (vf){0};                          \
            }                                                                              \
        }                                                                                  \
        for (int64_t k = 0; k < kn; k++) {                                                 \
            vf w[NC];                                                                      \
            for (int c = 0; c < NC; c++) w[c] = vload(panel + k * PW + c * VL);            \
            for (int m = 0; m < MB; m++) {                                                 \
                float xs = x[m * ldx + k];                                                 \
                for (int c = 0; c < NC; c++) acc[m][c] += xs * w[c];                       \
            }                                                                              \
        }                                                                                  \
        for (int m = 0; m < MB; m++) {                                                     \
            if (ncols == PW) {                                                             \
                for (int c = 0; c < NC; c++) vstore(y + m * ldy + c * VL, acc[m][c]);      \
            } else {                                                                       \
                for (int c = 0; c < NC; c++) vstore(buf + c * VL, acc[m][c]);              \
                memcpy(y + m * ldy, buf, (size_t)ncols * sizeof(float));                   \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                        int64_t, int);
static const tile_fn TILES[MB_MAX + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* Columns per panel of this build (the packed layout depends on it). */
int64_t qw_gemm_panel_width(void) { return PW; }

/* Pack W [N, K] (row stride ldw) into out: ceil(N / PW) * K * PW floats. */
void qw_gemm_pack(const float *w, int64_t n, int64_t k, int64_t ldw, float *out) {
    int64_t panels = (n + PW - 1) / PW;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * PW;
        for (int64_t j = 0; j < PW; j++) {
            int64_t col = p * PW + j;
            if (col < n) {
                const float *src = w + col * ldw;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * PW + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * PW + j] = 0.0f;
            }
        }
    }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T + bias, for the columns
 * of panels [p0, p1) only; bias may be NULL. */
void qw_gemm(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
             int64_t k, const float *bias, float *y, int64_t ldy, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = packed + p * k * PW;
        int64_t col = p * PW;
        int64_t ncols = n - col < PW ? n - col : PW;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            int64_t kn = k - k0 < KC ? k - k0 : KC;
            for (int64_t r = 0; r < m; r += MB_MAX) {
                int64_t mb = m - r < MB_MAX ? m - r : MB_MAX;
                TILES[mb](x + r * ldx + k0, ldx, panel + k0 * PW, kn, y + r * ldy + col, ldy,
                          ncols, k0 > 0);
            }
        }
        if (bias) {
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < ncols; j++) y[r * ldy + col + j] += bias[col + j];
        }
    }
}

/* ---- a work-sharing pool ------------------------------------------------------------
 *
 * qw_gemm_parallel splits the panels into chunks that the calling thread and up to
 * MAX_HELPERS helper threads claim one at a time from a shared counter. The caller
 * never waits for a helper to start: it claims chunks itself and then waits only for
 * chunks a helper has already claimed. On a machine whose other cores are busy, a
 * parked helper therefore costs nothing beyond the chunk it holds (an OpenMP team
 * instead waits at every barrier for its slowest thread to be scheduled).
 *
 * The claim word packs (job generation, chunk count, next chunk) so that a helper
 * still looking at a finished job can never claim a chunk of the next one; a job's
 * arguments are read only after a successful claim, and the caller does not reuse
 * them before every claimed chunk is done. Helpers spin briefly between jobs (the
 * matmuls of one layer come microseconds apart), then sleep on a condition variable.
 */
#define MAX_HELPERS 63
#define SPIN_ITERS 20000

typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, ldx, n, k, ldy, panels, chunk;
} gemm_args;

static gemm_args job;
static _Atomic uint64_t claim_word;  /* gen:24 | chunks:20 | next:20 */
static _Atomic int64_t chunks_done;
static _Atomic uint64_t generation;
static _Atomic int sleepers;
static _Atomic int stopping;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t job_mu = PTHREAD_MUTEX_INITIALIZER; /* one shared job at a time */
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pthread_t helpers[MAX_HELPERS];
static int num_helpers;

#define GEN_OF(w) ((w) >> 40)
#define COUNT_OF(w) (((w) >> 20) & 0xFFFFF)
#define NEXT_OF(w) ((w) & 0xFFFFF)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and run chunks of job generation gen until none is left. */
static void run_chunks(uint64_t gen) {
    for (;;) {
        uint64_t w = atomic_load_explicit(&claim_word, memory_order_acquire);
        if (GEN_OF(w) != (gen & 0xFFFFFF) || NEXT_OF(w) >= COUNT_OF(w)) return;
        if (!atomic_compare_exchange_weak_explicit(&claim_word, &w, w + 1,
                                                   memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        int64_t c = (int64_t)NEXT_OF(w);
        int64_t p0 = c * job.chunk;
        int64_t p1 = p0 + job.chunk < job.panels ? p0 + job.chunk : job.panels;
        qw_gemm(job.x, job.m, job.ldx, job.packed, job.n, job.k, job.bias, job.y, job.ldy,
                p0, p1);
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
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen && !atomic_load(&stopping))
                pthread_cond_wait(&pool_cv, &pool_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&pool_mu);
            spins = 0;
        }
        seen = g;
        run_chunks(g);
    }
}

/* Start helpers so that gemm work runs on `threads` threads (the caller included);
 * returns the number of threads now in use. */
int64_t qw_gemm_set_threads(int64_t threads) {
    pthread_mutex_lock(&job_mu);
    int want = threads - 1 < 0 ? 0 : (threads - 1 > MAX_HELPERS ? MAX_HELPERS : threads - 1);
    if (want < num_helpers) {  /* stop them all, restart the wanted number */
        atomic_store(&stopping, 1);
        pthread_mutex_lock(&pool_mu);
        pthread_cond_broadcast(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
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

/* qw_gemm over every panel, shared with the helpers; a second concurrent caller runs
 * its matmul alone on its own thread. */
void qw_gemm_parallel(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                      int64_t k, const float *bias, float *y, int64_t ldy) {
    int64_t panels = (n + PW - 1) / PW;
    /* Enough chunks for the threads to even out, each worth a call's overhead. */
    int64_t work = m * k * PW;            /* multiply-adds in one panel */
    int64_t min_panels = work >= (1 << 18) ? 1 : ((1 << 18) + work - 1) / work;
    int64_t chunk = panels / (4 * (num_helpers + 1));
    if (chunk < min_panels) chunk = min_panels;
    if (chunk < 1) chunk = 1;
    int64_t chunks = (panels + chunk - 1) / chunk;
    if (num_helpers == 0 || chunks < 2 || chunks > 0xFFFFF ||
        pthread_mutex_trylock(&job_mu) != 0) {
        qw_gemm(x, m, ldx, packed, n, k, bias, y, ldy, 0, panels);
        return;
    }
    uint64_t gen = atomic_load(&generation) + 1;
    job = (gemm_args){x, packed, bias, y, m, ldx, n, k, ldy, panels, chunk};
    atomic_store_explicit(&chunks_done, 0, memory_order_relaxed);
    atomic_store_explicit(&claim_word,
                          ((gen & 0xFFFFFF) << 40) | ((uint64_t)chunks << 20),
                          memory_order_release);
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&pool_mu);
        pthread_cond_broadcast(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
    }
    run_chunks(gen);
    while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks) cpu_relax();
    pthread_mutex_unlock(&job_mu);
}
