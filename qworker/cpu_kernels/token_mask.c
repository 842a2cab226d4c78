/* Greedy choice under token bitmasks for the CPU: argmax over each row's allowed tokens.
 *
 * x [rows, vocab] fp32 logits (row stride ldx, unit element stride); words int32
 * [*, ldw] bitmasks, contiguous rows of ldw words: bit t % 32 of word t / 32 allows
 * token t, as llguidance writes them (qworker/engine/structured/bitmask.py), and tokens
 * past 32 * ldw are never allowed; word_row[r] is row r's mask row, or -1 for an
 * unconstrained row. out[r] = the first index of the
 * largest allowed logit, exactly what torch.where(allowed, x, -inf).argmax(-1) returns:
 * a NaN wins (torch's argmax propagates it), and a row whose allowed logits are all -inf
 * (or that allows nothing) gives 0.
 *
 * A zero word skips its 32 logits unread: a grammar's masks are mostly zeros outside
 * strings, so a masked row costs less than the where + argmax passes over every logit.
 * Rows go to the pool (pool.c); tested against torch in tests/cpu_kernels.
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"

typedef struct {
    const float *x;
    const int32_t *words;
    const int64_t *word_row;
    int64_t *out;
    int64_t vocab, ldx, ldw;
} argmax_job;

static int64_t row_argmax(const float *x, const uint32_t *w, int64_t mask_words,
                          int64_t vocab) {
    float best = -INFINITY;
    int64_t at = 0;
    int64_t nwords = (vocab + 31) / 32;
    if (w && nwords > mask_words) nwords = mask_words; /* tokens past the mask: never allowed */
    for (int64_t j = 0; j < nwords; j++) {
        uint32_t bits = w ? w[j] : 0xFFFFFFFFu;
        if (!bits) continue;
        int64_t base = j * 32, end = vocab - base < 32 ? vocab - base : 32;
        for (int64_t b = 0; b < end; b++) {
            if (!((bits >> b) & 1u)) continue;
            float v = x[base + b];
            if (v != v) return base + b; /* NaN */
            if (v > best) {
                best = v;
                at = base + b;
            }
        }
    }
    return at;
}

static void argmax_chunk(const void *ctx, int64_t r) {
    const argmax_job *j = ctx;
    int64_t wr = j->word_row[r];
    const uint32_t *w = wr < 0 ? 0 : (const uint32_t *)(j->words + wr * j->ldw);
    j->out[r] = row_argmax(j->x + r * j->ldx, w, j->ldw, j->vocab);
}

/* out[r] for every r < rows (see the top of this file). */
void qw_masked_argmax(const float *x, int64_t rows, int64_t vocab, int64_t ldx,
                      const int32_t *words, int64_t ldw, const int64_t *word_row, int64_t *out) {
    argmax_job j = {x, words, word_row, out, vocab, ldx, ldw};
    qw_pool_run(argmax_chunk, &j, rows);
}
