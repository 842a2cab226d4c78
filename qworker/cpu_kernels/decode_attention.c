/* Paged decode attention for the CPU: one query row per sequence over its cached K/V.
 *
 * Layout: q [S, Hq, D] and out [S, Hq, D] (any row and head strides, unit element
 * stride); the caches [num_blocks, Hkv, B, D] (any block/head/token strides, unit
 * element stride), fp32; block_tables int32 [S, >= ceil(len / B)]; seq_lens int64 [S]
 * count the tokens in the cache, this step's included. Query head qh reads KV head
 * qh / (Hq / Hkv) (GQA/MQA). With window > 0 only the last `window` tokens are seen; with
 * softcap > 0 each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
 *
 * Work: one task per (sequence, KV head): the task scores the G = Hq / Hkv query heads
 * of that KV head against each token (every K row loaded once for the G dot products),
 * takes each head's softmax over its scores, then sums the V rows weighted by the
 * probabilities (every V row loaded once for the G heads). Tasks go to the pool
 * (pool.c) in chunks; slots past a sequence's length are never read.
 *
 * Rounding: fp32 throughout, as the torch reference (qworker/attention/torch_ref.py):
 * scores q.k times scale (then soft-capped), p = exp(s - max), out = (sum p v) / (sum p).
 * Tested against
 * it by tests/attention/test_cpu_backend.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "vec.h"

/* Sum of the lanes, pairwise (halves added until one lane is left). */
static inline float hsum(vf v) {
#if !defined(__clang__) && (!defined(__GNUC__) || __GNUC__ < 12)
    float s = 0.0f; /* no __builtin_shufflevector: lane by lane */
    for (int l = 0; l < VL; l++) s += v[l];
    return s;
#else
#define SH(...) v += __builtin_shufflevector(v, v, __VA_ARGS__)
#if VL == 16
    SH(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    SH(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    SH(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    SH(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif VL == 8
    SH(4, 5, 6, 7, 0, 1, 2, 3);
    SH(2, 3, 0, 1, 6, 7, 4, 5);
    SH(1, 0, 3, 2, 5, 4, 7, 6);
#else
    SH(2, 3, 0, 1);
    SH(1, 0, 3, 2);
#endif
#undef SH
    return v[0];
#endif
}

static inline float dot(const float *a, const float *b, int64_t d) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + VL <= d; i += VL) acc += vload(a + i) * vload(b + i);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* out[0:d] += p * v[0:d] */
static inline void axpy(float *out, float p, const float *v, int64_t d) {
    int64_t i = 0;
    for (; i + VL <= d; i += VL) vstore(out + i, vload(out + i) + p * vload(v + i));
    for (; i < d; i++) out[i] += p * v[i];
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *block_tables;
    const int64_t *seq_lens;
    int64_t q_row, q_head, out_row, out_head;
    int64_t k_block, k_head, k_tok, v_block, v_head, v_tok, bt_row;
    int64_t num_kv_heads, group, head_dim, block_size, window, tasks_per_chunk, num_tasks;
    float scale, softcap;
} attn_job;

#define STACK_FLOATS 8192

static void attend_one(const attn_job *j, int64_t s, int64_t h) {
    int64_t len = j->seq_lens[s];
    int64_t start = (j->window > 0 && len > j->window) ? len - j->window : 0;
    int64_t n = len - start, g_count = j->group, d = j->head_dim, bs = j->block_size;
    float stack_buf[STACK_FLOATS];
    int64_t need = g_count * n + g_count * d;
    float *buf = need <= STACK_FLOATS ? stack_buf : malloc((size_t)need * sizeof(float));
    if (!buf) return; /* out of memory: leave the rows as they are (never expected) */
    float *scores = buf, *acc = buf + g_count * n;
    const int32_t *table = j->block_tables + s * j->bt_row;
    const float *q0 = j->q + s * j->q_row + h * g_count * j->q_head;
    for (int64_t t = 0; t < n; t++) {
        int64_t pos = start + t;
        const float *k = j->k_cache + (int64_t)table[pos / bs] * j->k_block + h * j->k_head +
                         (pos % bs) * j->k_tok;
        for (int64_t g = 0; g < g_count; g++)
            scores[g * n + t] = dot(q0 + g * j->q_head, k, d) * j->scale;
    }
    if (j->softcap > 0.0f) {
        const float cap = j->softcap;
        for (int64_t i = 0; i < g_count * n; i++) scores[i] = cap * tanhf(scores[i] / cap);
    }
    float total[64], *tot = g_count <= 64 ? total : malloc((size_t)g_count * sizeof(float));
    if (!tot) {
        if (buf != stack_buf) free(buf);
        return;
    }
    for (int64_t g = 0; g < g_count; g++) {
        float *sg = scores + g * n, top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) top = sg[t] > top ? sg[t] : top;
        for (int64_t t = 0; t < n; t++) {
            sg[t] = expf(sg[t] - top);
            sum += sg[t];
        }
        tot[g] = sum;
    }
    memset(acc, 0, (size_t)(g_count * d) * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        int64_t pos = start + t;
        const float *v = j->v_cache + (int64_t)table[pos / bs] * j->v_block + h * j->v_head +
                         (pos % bs) * j->v_tok;
        for (int64_t g = 0; g < g_count; g++) axpy(acc + g * d, scores[g * n + t], v, d);
    }
    for (int64_t g = 0; g < g_count; g++) {
        float *o = j->out + s * j->out_row + (h * g_count + g) * j->out_head;
        for (int64_t i = 0; i < d; i++) o[i] = acc[g * d + i] / tot[g];
    }
    if (tot != total) free(tot);
    if (buf != stack_buf) free(buf);
}

static void attn_chunk(const void *ctx, int64_t c) {
    const attn_job *j = ctx;
    int64_t t0 = c * j->tasks_per_chunk;
    int64_t t1 = t0 + j->tasks_per_chunk < j->num_tasks ? t0 + j->tasks_per_chunk : j->num_tasks;
    for (int64_t t = t0; t < t1; t++) attend_one(j, t / j->num_kv_heads, t % j->num_kv_heads);
}

/* Attention of the first num_seqs query rows (one decode each), written to out. */
void qw_decode_attention(const float *q, int64_t q_row, int64_t q_head, const float *k_cache,
                         int64_t k_block, int64_t k_head, int64_t k_tok, const float *v_cache,
                         int64_t v_block, int64_t v_head, int64_t v_tok,
                         const int32_t *block_tables, int64_t bt_row, const int64_t *seq_lens,
                         int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t window, float scale,
                         float softcap, float *out, int64_t out_row, int64_t out_head) {
    int64_t tasks = num_seqs * num_kv_heads;
    int64_t group = num_q_heads / num_kv_heads;
    int64_t tokens = 0;
    for (int64_t s = 0; s < num_seqs; s++) tokens += seq_lens[s];
    /* chunks of at least ~32K multiply-adds, about four per thread */
    int64_t work_per_task = tokens / (num_seqs > 0 ? num_seqs : 1) * group * head_dim * 2 + 1;
    int64_t per_chunk = (1 << 15) / work_per_task + 1;
    int64_t even = tasks / (4 * qw_pool_threads());
    if (per_chunk < even) per_chunk = even;
    attn_job j = {q, k_cache, v_cache, out, block_tables, seq_lens, q_row, q_head, out_row,
                  out_head, k_block, k_head, k_tok, v_block, v_head, v_tok, bt_row, num_kv_heads,
                  group, head_dim, block_size, window, per_chunk, tasks, scale, softcap};
    qw_pool_run(attn_chunk, &j, (tasks + per_chunk - 1) / per_chunk);
}
