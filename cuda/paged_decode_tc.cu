// Paged decode attention on tensor cores (fp16 / bf16 queries; fp16 / bf16 / FP8 E4M3 cache),
// with split-KV and the split merge in the same launch.
//
// Kernel
//   paged_decode_tc<DT, KV8, HEAD_DIM, NT, CAP>
//   DT: 1 = float16, 2 = bfloat16 (query, output; cache too unless KV8).
//   KV8: 1 = the cache holds FP8 E4M3 with one scale per layer for K and one for V
//        (kv_scales = {k_scale, v_scale}, see qworker/attention/fp8.py); the tensor cores then
//        run in f16 (e4m3 widens to f16 exactly), the query is converted to f16.
//   HEAD_DIM: a multiple of 16 up to 256. NT: query heads per CTA in units of 8 (1 or 2).
//   CAP: 1 = a soft-capped layer (Gemma 2), see the softmax step below; 0 (the default) compiles
//   without it and ignores softcap_log2.
//
// KV layout (qworker/attention/backend.py), one layer:
//   key_cache, value_cache : [num_blocks, num_kv_heads, block_size, HEAD_DIM], HEAD_DIM contiguous;
//   token i of a sequence is in block block_tables[seq][i >> block_shift], row i & (block_size-1).
//
// Grid  : x = sequence, y = kv_head * head_tiles + tile, z = KV split (gridDim.z = the most
//         splits any sequence may use). Block: W warps (DecodeLayout::kWarps, 4 or 2).
// Work  : the CTA serves query heads [kv_head * group + tile * 8NT, +8NT) (rows past the
//   group are zero) of one sequence over the context range of its split. Context tokens
//   [start, ctx) with start = max(0, ctx - sliding_window) (or 0); aligned a0 = start & ~15,
//   split z covers [a0 + z * P, a0 + (z + 1) * P) with P = partition_size (a multiple of 64),
//   the last used split running to ctx; P <= 0 means one split. n = the splits a sequence
//   needs, from its own seq_lens entry, so a grid planned for an upper bound (CUDA graphs)
//   stays valid: splits past n exit at once.
//   Tokens go in tiles of 16 aligned to multiples of 16; warp w takes tiles w, w + W, ... of
//   the split, through its own ring of S stages in shared memory (K tile then V tile, rows
//   padded so ldmatrix is bank-conflict free) fed by cp.async (16 B per copy, zero-filled
//   outside the split) three stages ahead: the warp never waits on another warp in the loop.
//   Per tile, on tensor cores (mma.m16n8k16, fp32 accumulate):
//     S = Q K^T   A = Q (16 rows = the query heads, padded; d in k), B = K via ldmatrix:
//                 S is [16 heads x 16 tokens] in two n8 tiles.
//     soft-cap (CAP = 1): each log2-domain logit l becomes
//                 softcap_log2 * tanh(l / softcap_log2), softcap_log2 = cap * log2(e), i.e.
//                 cap * tanh(s / cap) on the scaled score s, before the mask.
//     online softmax per head row in fp32 (log2 domain), thread-partial row sums.
//     O^T += V^T P^T   A = V^T via ldmatrix.trans (16 d rows x 16 tokens), B = P^T built
//                 straight from the S accumulators (no transpose needed: S's rows are the
//                 heads, P^T's columns are the heads). O^T is [HEAD_DIM x 8NT]: HEAD_DIM / 4
//                 fp32 registers per thread for NT = 1.
//   FP8: K and V tiles stay e4m3 in shared memory (half the bytes); ldmatrix moves 16-bit
//   pairs, so the fragments come out with permuted k (K) and d (V) indices, matched by the
//   query staging (qslot below) and the output mapping (vd below); prmt + shifts widen them
//   to f16 in registers.
//   End: the W warps merge (shared memory); one split writes out = O / l directly; with
//   several, each writes (O, m, l) to work_o / work_ml [seq, q_head, gridDim.z(, D)], and
//   the last CTA of the (seq, head tile) to arrive (a device counter, reset to 0 by it)
//   merges them with log-sum-exp weights and writes out.
//
// Reference: qworker.attention.torch_ref.TorchAttentionBackend.forward, the oracle of
// tests/attention/test_cuda_backend.py (GPU) and tests/attention/test_decode_tc.py (this very
// source on the CPU emulator, tests/attention/emulator).

#include "warp_mma.cuh"

#ifndef QW_EMU_MUTATE_WAIT
// 0 always, except in tests/attention/test_decode_tc.py, which builds the emulator with a
// wait one group too weak to show that reading a stage still in flight fails the tests.
#define QW_EMU_MUTATE_WAIT 0
#endif

namespace qw {

constexpr int kDecodeTile = 16;       // tokens per warp step
constexpr int kMaxDecodeSplits = 64;  // gridDim.z limit (merge weights in shared memory)

// Shared-memory plan of the decode kernel (mirrored by decode_tc_layout in
// qworker/attention/cuda_kernels.py; the kernel refuses a launch with less dynamic shared
// memory than kSmemBytes).
template <int KV8, int HEAD_DIM> struct DecodeLayout {
  static constexpr int kEB = KV8 ? 1 : 2;                            // bytes per cached element
  static constexpr int kRowBytes = HEAD_DIM * kEB;
  static constexpr int kChunks = kRowBytes / 16;                     // 16-byte pieces per row
  static constexpr int kSRow = kRowBytes + (kChunks % 2 == 0 ? 16 : 0);  // odd count of pieces
  static constexpr int kStageWarp = 2 * kDecodeTile * kSRow;         // K tile, then V tile
  static constexpr int kBudget = 110 * 1024;                         // 2 CTAs per SM fit
  // 4 warps while 2 stages of each fit and the fp32 accumulators leave room under 128
  // registers; past head 160 (16-bit cache) 2 warps with deeper rings, up to 255 registers.
  static constexpr int kWarps = kBudget / (4 * kStageWarp) >= 2 && HEAD_DIM * kEB <= 320 ? 4 : 2;
  static constexpr int kStagesFit = kBudget / (kWarps * kStageWarp);
  static constexpr int kStages = kStagesFit > 4 ? 4 : kStagesFit;
  static constexpr int kQRow = HEAD_DIM * 2 + 16;                    // staged query row (16-bit)
  static constexpr int kQBytes = 16 * kQRow;
  static constexpr int kRingBytes = kWarps * kStages * kStageWarp;
  static constexpr int kSmemBytes = kQBytes + kRingBytes;
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 16 <= 256");
  static_assert(kStages >= 2, "shared memory budget too small for two stages");
};

// d index of k slot s (0..15) of a 16-wide k step when K is FP8: ldmatrix hands a lane four
// consecutive bytes (d 4t .. 4t+3) for the B fragment's slots (2t, 2t+1) and (2t+8, 2t+9).
__host__ __device__ constexpr int qslot_fp8(int s) {
  return s < 8 ? 4 * (s >> 1) + (s & 1) : 4 * ((s - 8) >> 1) + 2 + (s & 1);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace qw

template <int DT, int KV8, int HEAD_DIM, int NT, int CAP = 0>
// Register cap: 128 per thread for 4-warp CTAs (4 CTAs' worth); 2-warp CTAs (head 256) are
// held to 2 per SM by shared memory anyway, so they may use up to 255.
__global__ void __launch_bounds__(qw::DecodeLayout<KV8, HEAD_DIM>::kWarps * 32,
                                  qw::DecodeLayout<KV8, HEAD_DIM>::kWarps == 4 ? 4 : 2)
paged_decode_tc(void* __restrict__ out,            // [seqs, q_heads, D], rows out_stride apart
                float* __restrict__ work_o,         // [seqs, q_heads, gridDim.z, D] (split only)
                float* __restrict__ work_ml,        // [seqs, q_heads, gridDim.z, 2] (split only)
                int* __restrict__ counters,         // [seqs * gridDim.y], zero between launches
                const void* __restrict__ query,     // [seqs, q_heads, D], rows q_stride apart
                const void* __restrict__ key_cache, const void* __restrict__ value_cache,
                const int* __restrict__ block_tables,  // [rows, bt_stride]
                const int* __restrict__ seq_lens,      // [seqs]
                const float* __restrict__ kv_scales,   // {k_scale, v_scale} (KV8 only)
                const long long q_stride, const long long out_stride, const int bt_stride,
                const int num_kv_heads, const int group, const int head_tiles,
                const long long kv_block_stride, const long long kv_head_stride,
                const int block_shift, const float scale_log2, const int sliding_window,
                const int partition_size, const float softcap_log2) {
  using namespace qw;
  using L = DecodeLayout<KV8, HEAD_DIM>;
  constexpr int W = L::kWarps;
  constexpr int S = L::kStages;
  constexpr int MT = KV8 ? 1 : DT;          // tensor-core input type
  constexpr int ROWS = 8 * NT;              // query heads per CTA
  constexpr int KSTEPS = HEAD_DIM / 16;
  constexpr bool Q_REGS = HEAD_DIM * NT <= 64;  // else re-read from shared memory per tile
  static_assert(DT == 1 || DT == 2, "tensor-core decode takes f16 / bf16 queries");
  static_assert(NT == 1 || NT == 2, "NT is 1 or 2");
  static_assert(W * ROWS * (HEAD_DIM + 2) * 4 <= L::kRingBytes, "warp merge must fit the ring");
  static_assert(ROWS * (kMaxDecodeSplits + 1) * 4 <= L::kRingBytes, "split merge must fit");

  QW_TC_DYNAMIC_SMEM(smem);
  __shared__ int s_last;
  if (dynamic_smem_bytes() < static_cast<unsigned>(L::kSmemBytes) || gridDim.z > kMaxDecodeSplits ||
      blockDim.x != W * 32) {
    fail_launch();
    return;
  }
  unsigned char* s_q = smem;
  unsigned char* s_ring = smem + L::kQBytes;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y / head_tiles;
  const int tile = blockIdx.y - kv_head * head_tiles;
  const int h0 = kv_head * group + tile * ROWS;  // first query head of this CTA
  const int nh = min(ROWS, group - tile * ROWS);
  const int num_q_heads = num_kv_heads * group;
  const long long out_row = static_cast<long long>(seq) * out_stride;

  const int ctx = seq_lens[seq];
  const int start = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int a0 = start & ~(kDecodeTile - 1);
  int n_parts = 1;
  if (partition_size > 0 && ctx > start) {
    n_parts = min((ctx - a0 + partition_size - 1) / partition_size, static_cast<int>(gridDim.z));
  }
  if (static_cast<int>(blockIdx.z) >= n_parts) return;
  if (ctx <= start) {  // no context (a padding row): zeros, never NaN
    for (int i = tid; i < nh * HEAD_DIM; i += W * 32) {
      static_cast<unsigned short*>(out)[out_row + static_cast<long long>(h0) * HEAD_DIM + i] = 0;
    }
    return;
  }
  const int z = blockIdx.z;
  int p_lo = start, p_hi = ctx;
  if (partition_size > 0) {
    p_lo = max(start, a0 + z * partition_size);
    p_hi = z == n_parts - 1 ? ctx : a0 + (z + 1) * partition_size;
  }

  // Stage the query rows as MT pairs (FP8: permuted within each 16-wide k step).
  const unsigned short* q16 = static_cast<const unsigned short*>(query);
  const long long q_row = static_cast<long long>(seq) * q_stride;
  for (int i = tid; i < 16 * (HEAD_DIM / 2); i += W * 32) {
    const int row = i / (HEAD_DIM / 2);
    const int s = 2 * (i - row * (HEAD_DIM / 2));  // slot pair (s, s + 1)
    const int d = KV8 ? (s & ~15) + qslot_fp8(s & 15) : s;
    unsigned v = 0u;
    if (row < nh) {
      const long long at = q_row + static_cast<long long>(h0 + row) * HEAD_DIM + d;
      v = pack2<MT>(b16_to_float<DT>(q16[at]), b16_to_float<DT>(q16[at + 1]));
    }
    *reinterpret_cast<unsigned*>(s_q + row * L::kQRow + s * 2) = v;
  }
  __syncthreads();

  // The query A fragment of k step kk (rows 8-15 are zero for NT = 1).
  auto load_q = [&](unsigned (&qa)[4], int kk) {
    const int mi = lane >> 3, r = lane & 7;
    if constexpr (NT == 2) {
      ldmatrix_x4(qa, s_q + ((mi & 1) * 8 + r) * L::kQRow + (kk * 16 + (mi >> 1) * 8) * 2);
    } else {
      unsigned q2[2];
      ldmatrix_x2(q2, s_q + r * L::kQRow + (kk * 16 + (mi & 1) * 8) * 2);
      qa[0] = q2[0];
      qa[1] = 0u;
      qa[2] = q2[1];
      qa[3] = 0u;
    }
  };
  unsigned qf[Q_REGS ? KSTEPS : 1][4];
  if constexpr (Q_REGS) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) load_q(qf[kk], kk);
  }

  float lscale = scale_log2;
  float vscale = 1.f;
  if constexpr (KV8 != 0) {
    lscale *= kv_scales[0] * 256.f;  // e4m3 -> f16 by moving bits leaves a factor 2^-8
    vscale = kv_scales[1] * 256.f;
  }
  const float inv_cap = CAP != 0 ? 1.f / softcap_log2 : 0.f;

  const char* kc = static_cast<const char*>(key_cache);
  const char* vc = static_cast<const char*>(value_cache);
  const int* bt = block_tables + static_cast<long long>(seq) * bt_stride;
  const int bmask = (1 << block_shift) - 1;
  const long long head_off = static_cast<long long>(kv_head) * kv_head_stride;

  const int j0 = p_lo >> 4;                       // first tile (absolute, 16 tokens each)
  const int n_tiles = ((p_hi - 1) >> 4) - j0 + 1;
  const int n_my = warp < n_tiles ? (n_tiles - warp + W - 1) / W : 0;
  unsigned char* my_ring = s_ring + warp * S * L::kStageWarp;

  // Block ids of the two 8-token halves of tile j (the same block when blocks hold >= 16).
  auto tile_blocks = [&](int i, int& lo, int& hi) {
    lo = hi = 0;
    if (i >= n_my) return;
    const int pos0 = (j0 + warp + i * W) * kDecodeTile;
    const bool lo_ok = pos0 + 8 > p_lo && pos0 < p_hi;       // a token of rows 0-7 is in range
    const bool hi_ok = pos0 + 16 > p_lo && pos0 + 8 < p_hi;  // ... of rows 8-15
    if (block_shift >= 4) {
      if (lo_ok || hi_ok) lo = hi = bt[pos0 >> block_shift];
    } else {
      if (lo_ok) lo = bt[pos0 >> block_shift];
      if (hi_ok) hi = bt[(pos0 + 8) >> block_shift];
    }
  };
  // A lane's 16-byte pieces of a tile: lane l copies column l % C of rows l / C, + STEP,
  // + 2 STEP, ... (C = pieces per row, STEP = 32 / C rows per pass of the warp), so its
  // addresses are a per-lane constant plus (for C a power of two) compile-time offsets.
  constexpr int C = L::kChunks;
  constexpr int STEP = 32 / C;
  constexpr int PASSES = (kDecodeTile + STEP - 1) / STEP;
  constexpr bool EXACT = STEP * C == 32 && kDecodeTile % STEP == 0;  // every lane, every pass
  constexpr bool FIXED_HALF = EXACT && STEP <= 8;  // a pass's rows 0-7 / 8-15 known at compile time
  constexpr int ROW = L::kRowBytes;
  const int r0 = lane / C;
  const bool lane_on = lane < STEP * C;
  const int col16 = (lane - r0 * C) * 16;
  const int lane_s = r0 * L::kSRow + col16;
  auto issue = [&](int i, int blo, int bhi) {
    unsigned char* sk = my_ring + (i % S) * L::kStageWarp;
    unsigned char* sv = sk + kDecodeTile * L::kSRow;
    const int pos0 = (j0 + warp + i * W) * kDecodeTile;
    // byte offsets of rows 0 and 8 of the tile (blocks hold >= 8 rows, tiles start at 16k)
    const long long off_lo =
        (static_cast<long long>(blo) * kv_block_stride + head_off + static_cast<long long>(pos0 & bmask) * HEAD_DIM) * L::kEB + col16;
    const long long off_hi =
        (static_cast<long long>(bhi) * kv_block_stride + head_off + static_cast<long long>((pos0 + 8) & bmask) * HEAD_DIM) * L::kEB + col16;
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
      const int r = r0 + k * STEP;
      if constexpr (!EXACT) {
        if (!lane_on || r >= kDecodeTile) continue;
      }
      const bool upper = FIXED_HALF ? k * STEP >= 8 : r >= 8;
      const int rin = FIXED_HALF ? r0 + ((k * STEP) & 7) : (r & 7);
      const int pos = pos0 + r;
      const bool ok = pos >= p_lo && pos < p_hi;
      const long long off = (upper ? off_hi : off_lo) + rin * ROW;
      cp_async16(sk + lane_s + k * STEP * L::kSRow, kc + off, ok);
      cp_async16(sv + lane_s + k * STEP * L::kSRow, vc + off, ok);
    }
  };

  float o[KSTEPS][NT][4];
#pragma unroll
  for (int md = 0; md < KSTEPS; ++md)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[md][n][e] = 0.f;
  float m_run[NT], l_run[NT];  // head rows g (and g + 8): running max (log2) and partial sum
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    m_run[n] = QW_NEG_INF;
    l_run[n] = 0.f;
  }

  int nb_lo, nb_hi;  // block ids of the next tile to issue
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    int blo, bhi;
    tile_blocks(i, blo, bhi);
    if (i < n_my) issue(i, blo, bhi);
    cp_async_commit();
  }
  tile_blocks(S - 1, nb_lo, nb_hi);

  for (int i = 0; i < n_my; ++i) {
    if (i + S - 1 < n_my) issue(i + S - 1, nb_lo, nb_hi);
    cp_async_commit();
    tile_blocks(i + S, nb_lo, nb_hi);
    cp_async_wait<S - 1 + QW_EMU_MUTATE_WAIT>();
    __syncwarp();

    const unsigned char* sk = my_ring + (i % S) * L::kStageWarp;
    const unsigned char* sv = sk + kDecodeTile * L::kSRow;
    const int mi = lane >> 3, r = lane & 7;

    // S = Q K^T: two n8 tiles (tokens 0-7, 8-15).
    float sacc[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[n][e] = 0.f;
    if constexpr (KV8 == 0) {
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned qa[4];
        if constexpr (Q_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[e] = qf[kk][e];
        } else {
          load_q(qa, kk);
        }
        unsigned kf[4];  // {tokens 0-7: d 0-7, d 8-15; tokens 8-15: d 0-7, d 8-15}
        ldmatrix_x4(kf, sk + ((mi >> 1) * 8 + r) * L::kSRow + (kk * 16 + (mi & 1) * 8) * 2);
        mma_16816<MT>(sacc[0], qa, kf[0], kf[1]);
        mma_16816<MT>(sacc[1], qa, kf[2], kf[3]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk += 2) {
        // {k step kk: tokens 0-7, 8-15; k step kk + 1: tokens 0-7, 8-15}, 16 bytes = 16 d each
        unsigned kf[4];
        if (kk + 1 < KSTEPS) {
          ldmatrix_x4(kf, sk + ((mi & 1) * 8 + r) * L::kSRow + (kk + (mi >> 1)) * 16);
        } else {
          unsigned k2[2];
          ldmatrix_x2(k2, sk + ((mi & 1) * 8 + r) * L::kSRow + kk * 16);
          kf[0] = k2[0];
          kf[1] = k2[1];
          kf[2] = kf[3] = 0u;
        }
#pragma unroll
        for (int h = 0; h < 2 && kk + h < KSTEPS; ++h) {
          unsigned qa[4];
          if constexpr (Q_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[e] = qf[kk + h][e];
          } else {
            load_q(qa, kk + h);
          }
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const unsigned w = kf[2 * h + n];  // bytes d 4t .. 4t+3 of token g
            mma_16816<MT>(sacc[n], qa, e4m3x2_to_f16x2_scaled(byte_perm(w, 0u, 0x4140u)),
                          e4m3x2_to_f16x2_scaled(byte_perm(w, 0u, 0x4342u)));
          }
        }
      }
    }

    // Mask, online softmax per head row (fp32, log2 domain).
    const int pos0 = (j0 + warp + i * W) * kDecodeTile;
    float p[2][4];
    float alpha[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {  // row g (n = 0) holds c0, c1; row g + 8 (n = 1) c2, c3
      float mx = QW_NEG_INF;
#pragma unroll
      for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = pos0 + tt * 8 + 2 * t + e;
          float v = sacc[tt][2 * n + e] * lscale;
          if constexpr (CAP != 0) v = softcap_log2 * tanhf(v * inv_cap);
          if (pos < p_lo || pos >= p_hi) v = QW_NEG_INF;
          p[tt][2 * n + e] = v;
          mx = fmaxf(mx, v);
        }
      mx = quad_max(mx);
      const float m_new = fmaxf(m_run[n], mx);
      const float base = m_new == QW_NEG_INF ? 0.f : m_new;
      alpha[n] = exp2f(m_run[n] - base);
      float sum = 0.f;
#pragma unroll
      for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(p[tt][2 * n + e] - base);
          p[tt][2 * n + e] = pe;
          sum += pe;
        }
      l_run[n] = l_run[n] * alpha[n] + sum;
      m_run[n] = m_new;
    }

    // Rescale O^T: column (head) 2t + e of head tile n takes the alpha of lane 8t + 4e.
    unsigned pb[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float a_lo = __shfl_sync(0xffffffffu, alpha[n], 8 * t);
      const float a_hi = __shfl_sync(0xffffffffu, alpha[n], 8 * t + 4);
#pragma unroll
      for (int md = 0; md < KSTEPS; ++md) {
        o[md][n][0] *= a_lo;
        o[md][n][1] *= a_hi;
        o[md][n][2] *= a_lo;
        o[md][n][3] *= a_hi;
      }
      // P^T as the B fragment: (tokens 2t, 2t+1 | 2t+8, 2t+9; head g of tile n).
      pb[n][0] = pack2<MT>(p[0][2 * n], p[0][2 * n + 1]);
      pb[n][1] = pack2<MT>(p[1][2 * n], p[1][2 * n + 1]);
    }

    // O^T += V^T P^T, 16 d rows per m tile.
    if constexpr (KV8 == 0) {
#pragma unroll
      for (int md = 0; md < KSTEPS; ++md) {
        unsigned va[4];  // {d 0-7 / tokens 0-7, d 8-15 / tokens 0-7, d 0-7 / 8-15, d 8-15 / 8-15}
        ldmatrix_x4_trans(va, sv + ((mi >> 1) * 8 + r) * L::kSRow + (md * 16 + (mi & 1) * 8) * 2);
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_16816<MT>(o[md][n], va, pb[n][0], pb[n][1]);
      }
    } else {
#pragma unroll
      for (int md = 0; md < KSTEPS; md += 2) {
        // {m tile md: tokens 0-7, 8-15; m tile md + 1: tokens 0-7, 8-15}; a lane's word holds
        // bytes {V[2t][2g], V[2t][2g+1], V[2t+1][2g], V[2t+1][2g+1]} of its 16-d group.
        unsigned vf[4];
        if (md + 1 < KSTEPS) {
          ldmatrix_x4_trans(vf, sv + ((mi & 1) * 8 + r) * L::kSRow + (md + (mi >> 1)) * 16);
        } else {
          unsigned v2[2];
          ldmatrix_x2_trans(v2, sv + ((mi & 1) * 8 + r) * L::kSRow + md * 16);
          vf[0] = v2[0];
          vf[1] = v2[1];
          vf[2] = vf[3] = 0u;
        }
#pragma unroll
        for (int h = 0; h < 2 && md + h < KSTEPS; ++h) {
          // row slot g = d 2g, row slot g + 8 = d 2g + 1; k slots = tokens as stored
          const unsigned va[4] = {
              e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h], 0u, 0x4240u)),
              e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h], 0u, 0x4341u)),
              e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h + 1], 0u, 0x4240u)),
              e4m3x2_to_f16x2_scaled(byte_perm(vf[2 * h + 1], 0u, 0x4341u)),
          };
#pragma unroll
          for (int n = 0; n < NT; ++n) mma_16816<MT>(o[md + h][n], va, pb[n][0], pb[n][1]);
        }
      }
    }
    __syncwarp();  // this stage is refilled by the next iteration's issue
  }
  cp_async_wait<0>();

  // Merge the warps: (m, l, O) of each through shared memory (the ring is free now).
#pragma unroll
  for (int n = 0; n < NT; ++n) l_run[n] = quad_sum(l_run[n]);
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(s_ring);  // [W][ROWS][HEAD_DIM]
  float* s_m = s_o + W * ROWS * HEAD_DIM;         // [W][ROWS]
  float* s_l = s_m + W * ROWS;
  if (t == 0) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s_m[warp * ROWS + 8 * n + g] = m_run[n];
      s_l[warp * ROWS + 8 * n + g] = l_run[n];
    }
  }
#pragma unroll
  for (int md = 0; md < KSTEPS; ++md) {
    const int d_lo = KV8 ? md * 16 + 2 * g : md * 16 + g;  // rows c0, c1
    const int d_hi = KV8 ? d_lo + 1 : d_lo + 8;            // rows c2, c3
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float* base = s_o + (warp * ROWS + 8 * n + 2 * t) * HEAD_DIM;
      base[d_lo] = o[md][n][0];
      base[HEAD_DIM + d_lo] = o[md][n][1];
      base[d_hi] = o[md][n][2];
      base[HEAD_DIM + d_hi] = o[md][n][3];
    }
  }
  __syncthreads();

  float* w_o = nullptr;
  float* w_ml = nullptr;
  const long long head_base = (static_cast<long long>(seq) * num_q_heads + h0) * gridDim.z;
  if (n_parts > 1) {
    w_o = work_o + head_base * HEAD_DIM;
    w_ml = work_ml + head_base * 2;
  }
  for (int idx = tid; idx < nh * HEAD_DIM; idx += W * 32) {
    const int h = idx / HEAD_DIM;
    const int d = idx - h * HEAD_DIM;
    float mx = QW_NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, s_m[w * ROWS + h]);
    float acc = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wt = exp2f(s_m[w * ROWS + h] - mx);  // 0 for a warp that saw no token
      acc += wt * s_o[(w * ROWS + h) * HEAD_DIM + d];
      sum += wt * s_l[w * ROWS + h];
    }
    acc *= vscale;
    if (n_parts == 1) {
      static_cast<unsigned short*>(out)[out_row + static_cast<long long>(h0 + h) * HEAD_DIM + d] =
          float_to_b16<DT>(sum != 0.f ? acc / sum : 0.f);  // NaN stays NaN
    } else {
      const long long at = static_cast<long long>(h) * gridDim.z + z;
      w_o[at * HEAD_DIM + d] = acc;
      if (d == 0) {
        w_ml[at * 2] = mx;
        w_ml[at * 2 + 1] = sum;
      }
    }
  }
  if (n_parts == 1) return;

  // Split merge by the last CTA of this (sequence, head tile) to finish.
  __threadfence();
  __syncthreads();
  int* counter = counters + static_cast<long long>(seq) * gridDim.y + blockIdx.y;
  if (tid == 0) s_last = atomicAdd(counter, 1) == n_parts - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  float* s_w = reinterpret_cast<float*>(s_ring);  // [ROWS][n_parts] weights, then [ROWS] 1/l
  float* s_inv = s_w + ROWS * kMaxDecodeSplits;
  for (int h = tid; h < nh; h += W * 32) {
    const float* ml = w_ml + static_cast<long long>(h) * gridDim.z * 2;
    float mx = QW_NEG_INF;
    for (int k = 0; k < n_parts; ++k) mx = fmaxf(mx, ld_cg(ml + 2 * k));
    float sum = 0.f;
    for (int k = 0; k < n_parts; ++k) {
      const float wt = exp2f(ld_cg(ml + 2 * k) - mx);
      s_w[h * kMaxDecodeSplits + k] = wt;
      sum += wt * ld_cg(ml + 2 * k + 1);
    }
    s_inv[h] = sum != 0.f ? 1.f / sum : 0.f;
  }
  __syncthreads();
  for (int idx = tid; idx < nh * HEAD_DIM; idx += W * 32) {
    const int h = idx / HEAD_DIM;
    const int d = idx - h * HEAD_DIM;
    const float* po = w_o + static_cast<long long>(h) * gridDim.z * HEAD_DIM + d;
    float acc = 0.f;
    for (int k = 0; k < n_parts; ++k) acc += s_w[h * kMaxDecodeSplits + k] * ld_cg(po + k * HEAD_DIM);
    static_cast<unsigned short*>(out)[out_row + static_cast<long long>(h0 + h) * HEAD_DIM + d] =
        float_to_b16<DT>(acc * s_inv[h]);
  }
  if (tid == 0) *counter = 0;  // every split of this launch has arrived: ready for the next
}
