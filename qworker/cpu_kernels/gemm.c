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
 * Threads: qw_gemm_parallel hands chunks of panels to the pool (pool.c); a column's
 * result does not depend on which thread computes it.
 *
 * Rounding: each output is one fp32 accumulator summed over k = 0 .. K-1 in order,
 * bias added last; the vector types only batch independent outputs, never reassociate
 * a sum. Tested against torch.nn.functional.linear (tests/models/test_cpu_gemm.py).
 *
 * Portable C (GCC/Clang vector extensions); the vector width follows the target the
 * library is compiled for (qworker/cpu_kernels compiles it with -march=native).
 */
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "vec.h"

/* NC vectors per panel row: enough independent accumulators to hide the FMA latency */
#if VL == 16 || defined(__aarch64__)
#define NC 4
#else
#define NC 2
#endif
#define MB_MAX 6
#define PW (VL * NC)
#define KC 512

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


typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, ldx, n, k, ldy, panels, chunk;
} gemm_job;

static void gemm_chunk(const void *ctx, int64_t c) {
    const gemm_job *j = ctx;
    int64_t p0 = c * j->chunk;
    int64_t p1 = p0 + j->chunk < j->panels ? p0 + j->chunk : j->panels;
    qw_gemm(j->x, j->m, j->ldx, j->packed, j->n, j->k, j->bias, j->y, j->ldy, p0, p1);
}

/* qw_gemm over every panel, in chunks shared by the pool's threads. */
void qw_gemm_parallel(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                      int64_t k, const float *bias, float *y, int64_t ldy) {
    int64_t panels = (n + PW - 1) / PW;
    /* About four chunks per thread to even out, each worth a claim's overhead. */
    int64_t per_panel = m * k * PW; /* multiply-adds */
    int64_t min_panels = per_panel >= (1 << 18) ? 1 : ((1 << 18) + per_panel - 1) / per_panel;
    int64_t chunk = panels / (4 * qw_pool_threads());
    if (chunk < min_panels) chunk = min_panels;
    if (chunk < 1) chunk = 1;
    gemm_job j = {x, packed, bias, y, m, ldx, n, k, ldy, panels, chunk};
    qw_pool_run(gemm_chunk, &j, (panels + chunk - 1) / chunk);
}
