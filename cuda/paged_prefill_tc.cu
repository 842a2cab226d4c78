// Paged prefill attention on tensor cores: one launch over the query tiles of every
// prefilling sequence of a step (chunked prefill, prefix-cache hits), straight from the
// paged cache.
//
// Kernel
//   paged_prefill_tc<DT, KV8, HEAD_DIM, CAP>
//   DT: 1 = float16, 2 = bfloat16 (query, output; cache too unless KV8). KV8: the cache is FP8
//   E4M3 with per-layer scales kv_scales = {k_scale, v_scale} (qworker/attention/fp8.py); the
//   tensor cores then run in f16. HEAD_DIM: a multiple of 16 up to 256. CAP: 1 = a soft-capped
//   layer (Gemma 2, see Work); 0 (the default) compiles without it and ignores softcap_log2.
//
// KV layout (qworker/attention/backend.py), one layer:
//   key_cache, value_cache : [num_blocks, num_kv_heads, block_size, HEAD_DIM], HEAD_DIM contiguous.
//
// Rows  : sequence s owns query tokens [query_start_loc[s], query_start_loc[s+1]) (q_len of
//   them, the last q_len of its seq_lens[s] tokens, already in the cache). Its rows are the
//   (token, query head) pairs of one KV head packed as row = token * group + head, so a KV
//   head's GQA group shares every K/V load. Row r attends causally (bottom-right): keys
//   [lo, past + r / group] with past = seq_lens[s] - q_len and lo = that minus
//   sliding_window - 1 (or 0).
// Grid  : x = query tile (tiles[x] = {sequence, first row}, 64 rows each, built on the host
//   longest context first), y = KV head. Block: 128 threads = 4 warps, warp w owns rows
//   16w .. 16w + 15 of the tile.
// Work  : the tile's query rows are staged in shared memory (MT = f16 for KV8, else DT;
//   FP8: permuted within each 16-wide k step like paged_decode_tc.cu). K/V tiles of 32
//   tokens go through a two-stage cp.async ring shared by the four warps (rows padded so
//   ldmatrix is bank-conflict free, zero-filled outside [lo, hi)). Per KV tile and warp, on
//   tensor cores (mma.m16n8k16, fp32 accumulate): S = Q K^T (16 rows x 32 keys: A = Q via
//   ldmatrix, B = K via ldmatrix), soft-cap when CAP (log2-domain logit l ->
//   softcap_log2 * tanh(l / softcap_log2), softcap_log2 = cap * log2(e): cap * tanh(s / cap) on
//   the scaled score, Gemma 2), mask, fp32 online softmax per row (log2 domain), then
//   O += P V with P taken from the S accumulators as the A fragment and V via
//   ldmatrix.trans (FP8: ldmatrix.trans of e4m3 pairs + prmt gives the B fragments of the
//   even and the odd d columns of a 16-d group at once). O is 16 x HEAD_DIM per warp
//   (HEAD_DIM / 2 registers per thread); out = O / l.
//
// Reference: qworker.attention.torch_ref.TorchAttentionBackend.forward (prefill rows), the
// oracle of tests/attention/test_prefill_tc.py (CPU emulator) and test_cuda_backend.py (GPU).

#include "warp_mma.cuh"

namespace qw {

constexpr int kPrefillRows = 64;  // query rows per CTA (4 warps x 16)
constexpr int kPrefillKV = 32;    // keys per KV tile

// Shared-memory plan of the prefill kernel (mirrored by prefill_tc_layout in
// qworker/attention/cuda_kernels.py).
template <int KV8, int HEAD_DIM> struct PrefillLayout {
  static constexpr int kEB = KV8 ? 1 : 2;
  static constexpr int kRowBytes = HEAD_DIM * kEB;
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kSRow = kRowBytes + (kChunks % 2 == 0 ? 16 : 0);
  static constexpr int kStage = 2 * kPrefillKV * kSRow;  // K tile, then V tile
  static constexpr int kStages = 2;
  static constexpr int kQRow = HEAD_DIM * 2 + 16;
  static constexpr int kQBytes = kPrefillRows * kQRow;
  static constexpr int kSmemBytes = kQBytes + kStages * kStage;
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 16 <= 256");
};

__host__ __device__ constexpr int prefill_qslot_fp8(int s) {
  return s < 8 ? 4 * (s >> 1) + (s & 1) : 4 * ((s - 8) >> 1) + 2 + (s & 1);
}

__device__ __forceinline__ float quad_max_p(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum_p(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace qw

template <int DT, int KV8, int HEAD_DIM, int CAP = 0>
// Register cap: 170 per thread (3 CTAs per SM) up to head 96, 255 (2 CTAs) beyond; heads
// past 160 spill and are not offered (qworker/attention/cuda_kernels.py PREFILL_TC_MAX_HEAD).
__global__ void __launch_bounds__(128, HEAD_DIM <= 96 ? 3 : 2) paged_prefill_tc(
    void* __restrict__ out,                  // [tokens, q_heads, D], rows out_stride apart
    const void* __restrict__ query,          // [tokens, q_heads, D], rows q_stride apart
    const void* __restrict__ key_cache, const void* __restrict__ value_cache,
    const int* __restrict__ block_tables,    // [seqs, bt_stride]
    const int* __restrict__ seq_lens,        // [seqs]
    const int* __restrict__ query_start_loc, // [seqs + 1]
    const int* __restrict__ tiles,           // [gridDim.x, 2]: sequence, first packed row
    const float* __restrict__ kv_scales,     // {k_scale, v_scale} (KV8 only)
    const long long q_stride, const long long out_stride, const int bt_stride,
    const int num_kv_heads, const int group, const long long kv_block_stride,
    const long long kv_head_stride, const int block_shift, const float scale_log2,
    const int sliding_window, const float softcap_log2) {
  using namespace qw;
  using L = PrefillLayout<KV8, HEAD_DIM>;
  constexpr int MT = KV8 ? 1 : DT;
  constexpr int KSTEPS = HEAD_DIM / 16;
  constexpr int NTILES = HEAD_DIM / 8;  // n8 tiles of O
  static_assert(DT == 1 || DT == 2, "tensor-core prefill takes f16 / bf16 queries");

  QW_TC_DYNAMIC_SMEM(smem);
  if (dynamic_smem_bytes() < static_cast<unsigned>(L::kSmemBytes)) {
    fail_launch();
    return;
  }
  unsigned char* s_q = smem;
  unsigned char* s_kv = smem + L::kQBytes;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;

  const int seq = tiles[2 * blockIdx.x];
  const int row0 = tiles[2 * blockIdx.x + 1];
  const int kv_head = blockIdx.y;
  const int qs = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - qs;
  const int ctx = seq_lens[seq];
  const int past = ctx - q_len;
  const int n_rows = q_len * group;
  if (row0 >= n_rows) return;
  const int last_row = min(row0 + kPrefillRows, n_rows) - 1;
  const int kv_hi = past + last_row / group + 1;
  const int kv_lo = sliding_window > 0 ? max(0, past + row0 / group - sliding_window + 1) : 0;

  // Stage the tile's query rows.
  const unsigned short* q16 = static_cast<const unsigned short*>(query);
  for (int i = tid; i < kPrefillRows * (HEAD_DIM / 2); i += 128) {
    const int row = i / (HEAD_DIM / 2);
    const int s = 2 * (i - row * (HEAD_DIM / 2));
    const int d = KV8 ? (s & ~15) + prefill_qslot_fp8(s & 15) : s;
    const int pr = row0 + row;
    unsigned v = 0u;
    if (pr < n_rows) {
      const int tok = pr / group;
      const int head = kv_head * group + (pr - tok * group);
      const long long at = static_cast<long long>(qs + tok) * q_stride + static_cast<long long>(head) * HEAD_DIM + d;
      v = pack2<MT>(b16_to_float<DT>(q16[at]), b16_to_float<DT>(q16[at + 1]));
    }
    *reinterpret_cast<unsigned*>(s_q + row * L::kQRow + s * 2) = v;
  }

  float lscale = scale_log2;
  float vscale = 1.f;
  if constexpr (KV8 != 0) {
    lscale *= kv_scales[0] * 256.f;
    vscale = kv_scales[1] * 256.f;
  }
  const float inv_cap = CAP != 0 ? 1.f / softcap_log2 : 0.f;

  // This lane's two rows (g and g + 8 of the warp): their last visible key.
  const int ra = row0 + warp * 16 + g;
  const int qpa = past + ra / group;
  const int qpb = past + (ra + 8) / group;

  const char* kc = static_cast<const char*>(key_cache);
  const char* vc = static_cast<const char*>(value_cache);
  const int* bt = block_tables + static_cast<long long>(seq) * bt_stride;
  const int bmask = (1 << block_shift) - 1;
  const long long head_off = static_cast<long long>(kv_head) * kv_head_stride;
  const int k_first = kv_lo & ~(kPrefillKV - 1);
  const int n_kv = (kv_hi - k_first + kPrefillKV - 1) / kPrefillKV;

  // Thread i copies column i % C of rows i / C, + STEP, ... (C = 16-byte pieces per row,
  // STEP = 128 / C rows per pass of the CTA): per-thread constants plus row offsets.
  constexpr int C = L::kChunks;
  constexpr int STEP = 128 / C;
  constexpr int PASSES = (kPrefillKV + STEP - 1) / STEP;
  constexpr bool EXACT = STEP * C == 128 && kPrefillKV % STEP == 0;
  const int r0 = tid / C;
  const bool thread_on = tid < STEP * C;
  const int col16 = (tid - r0 * C) * 16;
  const int thread_s = r0 * L::kSRow + col16;
  const long long base = head_off * L::kEB + col16;
  auto issue = [&](int n) {
    unsigned char* sk = s_kv + (n % L::kStages) * L::kStage;
    unsigned char* sv = sk + kPrefillKV * L::kSRow;
    const int pos0 = k_first + n * kPrefillKV;
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
      const int r = r0 + k * STEP;
      if constexpr (!EXACT) {
        if (!thread_on || r >= kPrefillKV) continue;
      }
      const int pos = pos0 + r;
      const bool ok = pos >= kv_lo && pos < kv_hi;
      long long off = 0;
      if (ok) {
        const long long blk = bt[pos >> block_shift];
        off = base + (blk * kv_block_stride + static_cast<long long>(pos & bmask) * HEAD_DIM) * L::kEB;
      }
      cp_async16(sk + thread_s + k * STEP * L::kSRow, kc + off, ok);
      cp_async16(sv + thread_s + k * STEP * L::kSRow, vc + off, ok);
    }
  };

  float o[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m_run[2] = {QW_NEG_INF, QW_NEG_INF};
  float l_run[2] = {0.f, 0.f};

  issue(0);
  cp_async_commit();
  for (int n = 0; n < n_kv; ++n) {
    if (n + 1 < n_kv) issue(n + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // tile n (and, the first time, the staged query) visible to all

    const unsigned char* sk = s_kv + (n % L::kStages) * L::kStage;
    const unsigned char* sv = sk + kPrefillKV * L::kSRow;
    const int pos0 = k_first + n * kPrefillKV;

    float sacc[4][4];  // 16 rows x 32 keys: n8 tiles of keys 0-7, 8-15, 16-23, 24-31
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[nt][e] = 0.f;
    const unsigned char* qw_rows = s_q + (warp * 16 + (mi & 1) * 8 + r8) * L::kQRow;
    if constexpr (KV8 == 0) {
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned qa[4];
        ldmatrix_x4(qa, qw_rows + (kk * 16 + (mi >> 1) * 8) * 2);
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          unsigned kf[4];
          ldmatrix_x4(kf, sk + (pp * 16 + (mi >> 1) * 8 + r8) * L::kSRow + (kk * 16 + (mi & 1) * 8) * 2);
          mma_16816<MT>(sacc[2 * pp], qa, kf[0], kf[1]);
          mma_16816<MT>(sacc[2 * pp + 1], qa, kf[2], kf[3]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk += 2) {
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          unsigned kf[4];
          if (kk + 1 < KSTEPS) {
            ldmatrix_x4(kf, sk + (pp * 16 + (mi & 1) * 8 + r8) * L::kSRow + (kk + (mi >> 1)) * 16);
          } else {
            unsigned k2[2];
            ldmatrix_x2(k2, sk + (pp * 16 + (mi & 1) * 8 + r8) * L::kSRow + kk * 16);
            kf[0] = k2[0];
            kf[1] = k2[1];
            kf[2] = kf[3] = 0u;
          }
#pragma unroll
          for (int h = 0; h < 2 && kk + h < KSTEPS; ++h) {
            unsigned qa[4];
            ldmatrix_x4(qa, qw_rows + ((kk + h) * 16 + (mi >> 1) * 8) * 2);
#pragma unroll
            for (int nn = 0; nn < 2; ++nn) {
              const unsigned w = kf[2 * h + nn];
              mma_16816<MT>(sacc[2 * pp + nn], qa, e4m3x2_to_f16x2_scaled(byte_perm(w, 0u, 0x4140u)),
                            e4m3x2_to_f16x2_scaled(byte_perm(w, 0u, 0x4342u)));
            }
          }
        }
      }
    }

    // Mask (causal, window, range) and online softmax for rows a (c0, c1) and b (c2, c3).
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int qp = rr == 0 ? qpa : qpb;
      float mx = QW_NEG_INF;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kp = pos0 + nt * 8 + 2 * t + e;
          float v = sacc[nt][2 * rr + e] * lscale;
          if constexpr (CAP != 0) v = softcap_log2 * tanhf(v * inv_cap);
          if (kp > qp || kp < kv_lo || (sliding_window > 0 && kp <= qp - sliding_window)) v = QW_NEG_INF;
          sacc[nt][2 * rr + e] = v;
          mx = fmaxf(mx, v);
        }
      mx = quad_max_p(mx);
      const float m_new = fmaxf(m_run[rr], mx);
      const float base = m_new == QW_NEG_INF ? 0.f : m_new;
      alpha[rr] = exp2f(m_run[rr] - base);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(sacc[nt][2 * rr + e] - base);
          sacc[nt][2 * rr + e] = pe;
          sum += pe;
        }
      l_run[rr] = l_run[rr] * alpha[rr] + sum;
      m_run[rr] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
      o[nt][0] *= alpha[0];
      o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1];
      o[nt][3] *= alpha[1];
    }

    // O += P V, 16 keys per k step; P's A fragment comes from two S n8 tiles.
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const unsigned pa[4] = {
          pack2<MT>(sacc[2 * cc][0], sacc[2 * cc][1]),
          pack2<MT>(sacc[2 * cc][2], sacc[2 * cc][3]),
          pack2<MT>(sacc[2 * cc + 1][0], sacc[2 * cc + 1][1]),
          pack2<MT>(sacc[2 * cc + 1][2], sacc[2 * cc + 1][3]),
      };
      const unsigned char* vrows = sv + (cc * 16 + (mi & 1) * 8 + r8) * L::kSRow;
      if constexpr (KV8 == 0) {
#pragma unroll
        for (int pd = 0; pd < HEAD_DIM / 16; ++pd) {
          // {keys 0-7 / d 0-7, keys 8-15 / d 0-7, keys 0-7 / d 8-15, keys 8-15 / d 8-15}
          unsigned vb[4];
          ldmatrix_x4_trans(vb, vrows + (pd * 16 + (mi >> 1) * 8) * 2);
          mma_16816<MT>(o[2 * pd], pa, vb[0], vb[1]);
          mma_16816<MT>(o[2 * pd + 1], pa, vb[2], vb[3]);
        }
      } else {
#pragma unroll
        for (int gp = 0; gp < HEAD_DIM / 16; gp += 2) {
          // {group gp: keys 0-7, 8-15; group gp + 1: keys 0-7, 8-15}, 16 d (bytes) per group
          unsigned vf[4];
          if (gp + 1 < HEAD_DIM / 16) {
            ldmatrix_x4_trans(vf, vrows + (gp + (mi >> 1)) * 16);
          } else {
            unsigned v2[2];
            ldmatrix_x2_trans(v2, vrows + gp * 16);
            vf[0] = v2[0];
            vf[1] = v2[1];
            vf[2] = vf[3] = 0u;
          }
#pragma unroll
          for (int h = 0; h < 2 && gp + h < HEAD_DIM / 16; ++h) {
            // n slot g of tile 2(gp+h) is d 16(gp+h) + 2g, of tile 2(gp+h) + 1 is d + 1
            mma_16816<MT>(o[2 * (gp + h)], pa, e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h], 0u, 0x4240u)),
                          e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h + 1], 0u, 0x4240u)));
            mma_16816<MT>(o[2 * (gp + h) + 1], pa, e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h], 0u, 0x4341u)),
                          e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h + 1], 0u, 0x4341u)));
          }
        }
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration
  }
  cp_async_wait<0>();

  // out = O / l for the lane's rows a (c0, c1) and b (c2, c3).
  unsigned short* o16 = static_cast<unsigned short*>(out);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float l = quad_sum_p(l_run[rr]);
    const int pr = ra + 8 * rr;
    if (pr >= n_rows || pr > last_row) continue;
    const int tok = pr / group;
    const int head = kv_head * group + (pr - tok * group);
    const float inv = l != 0.f ? vscale / l : 0.f;  // NaN stays NaN
    unsigned short* dst = o16 + static_cast<long long>(qs + tok) * out_stride + static_cast<long long>(head) * HEAD_DIM;
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
      int d0, d1;
      if constexpr (KV8 == 0) {
        d0 = nt * 8 + 2 * t;
        d1 = d0 + 1;
      } else {  // tile 2gp: d 16gp + 4t, + 2; tile 2gp + 1: d 16gp + 4t + 1, + 3
        d0 = (nt >> 1) * 16 + 4 * t + (nt & 1);
        d1 = d0 + 2;
      }
      dst[d0] = float_to_b16<DT>(o[nt][2 * rr] * inv);
      dst[d1] = float_to_b16<DT>(o[nt][2 * rr + 1] * inv);
    }
  }
}
