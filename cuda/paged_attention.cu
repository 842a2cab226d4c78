// Paged decode attention over a block-table KV cache, with an optional split-K pass.
//
// Kernels
//   paged_attention_decode<DT, HEAD_DIM, GT, CAP>  one CTA per (work item, KV head x head tile,
//                                              partition)
//   paged_attention_reduce<DT>                 one CTA per (query head, work item); merges partitions
//   DT: 0 = float32, 1 = float16, 2 = bfloat16 (storage of query, cache and output).
//   HEAD_DIM: a multiple of 16 up to 256. GT: query heads served per CTA (1, 2, 4 or 8).
//   CAP: 1 = a soft-capped layer (Gemma 2: cap * tanh(s / cap) on each scaled score s); each
//   logit, kept in the log2 domain, becomes softcap_log2 * tanh(logit / softcap_log2) with
//   softcap_log2 = cap * log2(e), the same map. CAP = 0 (the default, every other model)
//   compiles without it and ignores softcap_log2.
//
// KV layout (qworker/attention/backend.py), one layer:
//   key_cache, value_cache : [num_blocks, num_kv_heads, block_size, HEAD_DIM], HEAD_DIM contiguous.
//   Token i of a sequence sits in block block_tables[seq][i >> block_shift] at row
//   i & (block_size - 1); element offsets are 64-bit (block * kv_block_stride can pass 2^31).
//
// Work items: item w owns query row w (query + w * q_stride, heads HEAD_DIM apart), reads the
// block-table row work_seq[w] (w itself when work_seq is null) and attends to context tokens
// [start, ctx_lens[w]) where start = max(0, ctx_lens[w] - sliding_window) when a window is set,
// else 0. A decode step passes one item per decoding sequence (the query is the last token);
// the "paged prefill" path passes one item per prefill token with ctx_len = its position + 1.
//
// Grid  : x = work item, y = kv_head * head_tiles + tile, z = partition (1 when not split).
// Block : 128 threads = 4 warps. A row of HEAD_DIM elements is NC = HEAD_DIM * bytes / 16
//   16-byte chunks; a "thread group" of TG = next_pow2(NC) (<= 32) lanes owns one token at a
//   time, lane l holding chunks l, l + TG, ... (CPL of them). A warp therefore works on
//   TPW = 32 / TG tokens at once, U of those batches per iteration so that several 16-byte
//   loads are in flight per thread.
// CTA   : serves the GT query heads [kv_head * group + tile * GT, +GT) of one KV head, so every
//   K/V row is loaded once for all of them (GQA). The query, pre-scaled by scale * log2(e), lives
//   in registers as fp32. Tokens are processed in chunks of 256: pass 1 computes the GT logits
//   of every token into shared memory [token][head] (the GT partial dot products of a token are
//   summed over its thread group by a split reduction: GT - 1 shuffles halve the head list
//   lane pair by lane pair, then log2(TG / GT) butterfly steps, if any, finish the sums);
//   then one warp per head takes the chunk max, turns logits into exp2(logit - max),
//   and rescales the running sum (online softmax across chunks, fp32); pass 2 reads V rows and
//   accumulates p * v into per-thread fp32 registers. At the end the partial accumulators of
//   all thread groups are summed (shuffles within a warp, shared memory across warps).
//   Unsplit (partition_size <= 0): out = acc / sum, written in DT. Split: partition z covers
//   [start + z * partition_size, +partition_size); the CTA writes its unnormalised acc, running
//   max (log2 domain) and sum to part_out / part_max / part_sum [work, q_head, max_parts(, D)],
//   and paged_attention_reduce merges them with log-sum-exp weights.
//
// Reference: qworker.attention.torch_ref.TorchAttentionBackend.forward, the oracle of
// tests/attention/test_cuda_backend.py: on a GPU every dtype / head size / block size / GQA
// ratio, split on and off, partly filled last blocks, sliding windows, contexts to 32k; on the
// CPU this very source through the emulator of tests/attention/emulator.
//
// No headers are included: 16-bit conversions are inline PTX, so NVRTC needs no include path.

#define QW_NEG_INF (__int_as_float(0xff800000))

namespace qw {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;          // tokens whose logits are staged in shared memory at once
constexpr int kMinBlockSize = 8;     // smallest block size the host side allows

template <int DT> struct DType { static constexpr int kBytes = 2; };
template <> struct DType<0> { static constexpr int kBytes = 4; };

// QW_CPU_EMULATION: tests/attention/emulator compiles this file as C++ on the CPU (threads
// for lanes) to check the index math without a GPU; it supplies these conversions and the
// dynamic shared-memory declaration. On the GPU both are plain PTX / CUDA.
#ifdef QW_CPU_EMULATION
#define QW_DYNAMIC_SMEM(T, name) T* name = qw_emu_dynamic_smem<T>()
#else
#define QW_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ float half_to_float(unsigned short h) {
#ifdef QW_CPU_EMULATION
  return qw_emu_half_to_float(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short float_to_half(float x) {
#ifdef QW_CPU_EMULATION
  return qw_emu_float_to_half(x);
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#endif
}

__device__ __forceinline__ unsigned short float_to_bf16(float x) {
#ifdef QW_CPU_EMULATION
  return qw_emu_float_to_bf16(x);
#else
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#endif
}

// One 32-bit word of a 16-byte chunk: one float, or two 16-bit values (low half first).
template <int DT> __device__ __forceinline__ void unpack_word(unsigned w, float* f) {
  if constexpr (DT == 0) {
    f[0] = __uint_as_float(w);
  } else if constexpr (DT == 1) {
    f[0] = half_to_float(static_cast<unsigned short>(w & 0xffffu));
    f[1] = half_to_float(static_cast<unsigned short>(w >> 16));
  } else {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
}

template <int DT> __device__ __forceinline__ void unpack16(const uint4& v, float* f) {
  constexpr int P = 4 / DType<DT>::kBytes;  // values per word
  unpack_word<DT>(v.x, f);
  unpack_word<DT>(v.y, f + P);
  unpack_word<DT>(v.z, f + 2 * P);
  unpack_word<DT>(v.w, f + 3 * P);
}

template <int DT> __device__ __forceinline__ float load_elem(const void* base, long long i) {
  if constexpr (DT == 0) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (DT == 1) {
    return half_to_float(static_cast<const unsigned short*>(base)[i]);
  } else {
    return __uint_as_float(static_cast<unsigned>(static_cast<const unsigned short*>(base)[i]) << 16);
  }
}

template <int DT> __device__ __forceinline__ void store_elem(void* base, long long i, float x) {
  if constexpr (DT == 0) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (DT == 1) {
    static_cast<unsigned short*>(base)[i] = float_to_half(x);
  } else {
    static_cast<unsigned short*>(base)[i] = float_to_bf16(x);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions for kThreads threads; s_red holds kWarps floats. All threads return
// the result; the trailing barrier lets the caller reuse s_red at once.
__device__ __forceinline__ float block_max(float v, float* s_red) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = s_red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, s_red[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ float block_sum(float v, float* s_red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) r += s_red[w];
  __syncthreads();
  return r;
}

__host__ __device__ constexpr int next_pow2_capped(int n) {
  return n > 16 ? 32 : n > 8 ? 16 : n > 4 ? 8 : n > 2 ? 4 : n > 1 ? 2 : 1;
}

__host__ __device__ constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n / 2); }

// Split steps of the thread-group reduction of GT partial dot products: at step K the lanes
// of each pair (lane, lane ^ O) hold the same list of N = GT >> K heads; the lower lane keeps
// the first half and receives its partner's first half, the upper lane the second halves.
// One shuffle per kept value halves the list, so GT heads cost GT - 1 shuffles instead of
// GT * log2(TG). `lo` accumulates the first head of the lane's list.
template <int GT, int TG, int K>
__device__ __forceinline__ void split_steps(float (&v)[GT], int lane, int& lo) {
  constexpr int N = GT >> K;
  constexpr int O = TG >> (K + 1);
  if constexpr (N > 1 && O > 0) {
    constexpr int HALF = N / 2;
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      const float send = upper ? v[i] : v[i + HALF];
      const float keep = upper ? v[i + HALF] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    if (upper) lo += HALF;
    split_steps<GT, TG, K + 1>(v, lane, lo);
  }
}

}  // namespace qw

template <int DT, int HEAD_DIM, int GT, int CAP = 0>
__global__ void __launch_bounds__(qw::kThreads, 2) paged_attention_decode(
    void* __restrict__ out,              // [num_work, num_q_heads, HEAD_DIM] rows out_stride apart
    float* __restrict__ part_out,        // [num_work, num_q_heads, max_parts, HEAD_DIM] (split only)
    float* __restrict__ part_max,        // [num_work, num_q_heads, max_parts] (split only)
    float* __restrict__ part_sum,        // [num_work, num_q_heads, max_parts] (split only)
    const void* __restrict__ query,      // row w at w * q_stride elements, heads HEAD_DIM apart
    const void* __restrict__ key_cache,  // one layer, see the KV layout above
    const void* __restrict__ value_cache,
    const int* __restrict__ block_tables,  // [rows, bt_stride]
    const int* __restrict__ work_seq,      // [num_work] block-table row of each item, or null
    const int* __restrict__ ctx_lens,      // [num_work] visible context length of each item
    const long long q_stride, const long long out_stride, const int bt_stride,
    const int num_kv_heads, const int group, const int head_tiles,
    const long long kv_block_stride, const long long kv_head_stride, const int block_shift,
    const float scale_log2, const int sliding_window, const int partition_size,
    const int max_parts, const float softcap_log2) {
  using namespace qw;
  constexpr int kBytes = DType<DT>::kBytes;
  constexpr int VEC = 16 / kBytes;                 // elements per 16-byte chunk
  static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must fill whole 16-byte chunks");
  constexpr int NC = HEAD_DIM / VEC;               // chunks per K/V row
  constexpr int TG = next_pow2_capped(NC);         // lanes per token
  constexpr int CPL = (NC + TG - 1) / TG;          // chunks per lane
  constexpr int TPW = 32 / TG;                     // tokens per warp per batch
  constexpr int U = CPL >= 4 ? 1 : 4 / CPL;        // batches per iteration (loads in flight)
  constexpr int TOK_STEP = TPW * U;                // tokens per warp per iteration
  constexpr int RED = kWarps * HEAD_DIM > kChunk ? kWarps * HEAD_DIM : kChunk;
  constexpr int SPLIT = ilog2(GT) < ilog2(TG) ? ilog2(GT) : ilog2(TG);  // split reduce steps
  constexpr int NF = GT >> SPLIT;                  // heads per lane after the split steps

  __shared__ float s_buf[GT * RED];  // logits / probs [token][head], then the reduction
  __shared__ long long s_base[kChunk / kMinBlockSize + 1];  // element offset of each block's head
  __shared__ float s_m[GT], s_l[GT], s_alpha[GT];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int lig = lane & (TG - 1);  // lane in thread group
  const int gw = lane / TG;         // thread group in warp

  const int w = blockIdx.x;
  const int kv_head = blockIdx.y / head_tiles;
  const int tile = blockIdx.y - kv_head * head_tiles;
  const int nh = min(GT, group - tile * GT);   // valid heads of this tile
  const int h0 = kv_head * group + tile * GT;  // first query head of this tile
  const int num_q_heads = num_kv_heads * group;

  const int seq = work_seq != nullptr ? work_seq[w] : w;
  const int ctx = ctx_lens[w];
  const float inv_cap = CAP != 0 ? 1.f / softcap_log2 : 0.f;
  const int start = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  int p_begin = start;
  int p_end = ctx;
  if (partition_size > 0) {
    p_begin = start + static_cast<int>(blockIdx.z) * partition_size;
    if (p_begin >= ctx) return;  // past this item's context: the reduce never reads it
    p_end = min(ctx, p_begin + partition_size);
  }

  float q[GT][CPL][VEC];
  float acc[GT][CPL][VEC];
  const long long q_row = static_cast<long long>(w) * q_stride;
#pragma unroll
  for (int i = 0; i < GT; ++i) {
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = lig + j * TG;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        q[i][j][e] = (i < nh && c < NC)
                         ? load_elem<DT>(query, q_row + static_cast<long long>(h0 + i) * HEAD_DIM +
                                                    c * VEC + e) * scale_log2
                         : 0.f;
        acc[i][j][e] = 0.f;
      }
    }
  }
  if (tid < GT) {
    s_m[tid] = QW_NEG_INF;
    s_l[tid] = 0.f;
  }

  const char* kc = static_cast<const char*>(key_cache);
  const char* vc = static_cast<const char*>(value_cache);
  const int* bt = block_tables + static_cast<long long>(seq) * bt_stride;
  const int bmask = (1 << block_shift) - 1;

  for (int c0 = p_begin; c0 < p_end; c0 += kChunk) {
    const int clen = min(kChunk, p_end - c0);
    const int b_first = c0 >> block_shift;
    const int nb = ((c0 + clen - 1) >> block_shift) - b_first + 1;
    for (int i = tid; i < nb; i += kThreads) {
      s_base[i] = static_cast<long long>(bt[b_first + i]) * kv_block_stride +
                  static_cast<long long>(kv_head) * kv_head_stride;
    }
    __syncthreads();  // s_base ready; s_m / s_l initialised; previous chunk fully consumed

    // Pass 1: logits of every token of the chunk for the GT heads. The loop bound is uniform
    // across each warp, so the shuffles below always see all 32 lanes.
    for (int t0 = warp * TOK_STEP; t0 < clen; t0 += kWarps * TOK_STEP) {
      uint4 kv[U][CPL];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u * TPW + gw;
        long long off = 0;
        if (t < clen) {
          const int pos = c0 + t;
          off = s_base[(pos >> block_shift) - b_first] + static_cast<long long>(pos & bmask) * HEAD_DIM;
        }
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          const int c = lig + j * TG;
          if (t < clen && c < NC) {
            kv[u][j] = *reinterpret_cast<const uint4*>(kc + (off + c * VEC) * kBytes);
          } else {
            kv[u][j] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float dot[GT];
#pragma unroll
        for (int i = 0; i < GT; ++i) dot[i] = 0.f;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          float f[VEC];
          unpack16<DT>(kv[u][j], f);
#pragma unroll
          for (int i = 0; i < GT; ++i) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot[i] = fmaf(q[i][j][e], f[e], dot[i]);
          }
        }
        // Reduce across the thread group: split steps on the high lane bits leave each lane
        // NF = GT >> SPLIT heads [lo, lo + NF); plain butterfly steps on the low bits finish
        // the sums, and the lanes whose low bits are zero write them.
        int lo = 0;
        split_steps<GT, TG, 0>(dot, lig, lo);
#pragma unroll
        for (int o = (TG >> SPLIT) / 2; o > 0; o >>= 1) {
#pragma unroll
          for (int i = 0; i < NF; ++i) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], o);
        }
        const int t = t0 + u * TPW + gw;
        if (t < clen && (lig & ((TG >> SPLIT) - 1)) == 0) {
#pragma unroll
          for (int i = 0; i < NF; ++i) {
            if constexpr (CAP != 0) {
              s_buf[t * GT + lo + i] = softcap_log2 * tanhf(dot[i] * inv_cap);
            } else {
              s_buf[t * GT + lo + i] = dot[i];
            }
          }
        }
      }
    }
    __syncthreads();

    // Softmax bookkeeping: one warp per head, fp32, log2 domain.
    for (int i = warp; i < GT; i += kWarps) {
      float mx = QW_NEG_INF;
      for (int t = lane; t < clen; t += 32) mx = fmaxf(mx, s_buf[t * GT + i]);
      mx = warp_max(mx);
      const float m_old = s_m[i];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int t = lane; t < clen; t += 32) {
        const float p = exp2f(s_buf[t * GT + i] - m_new);
        s_buf[t * GT + i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
        s_alpha[i] = alpha;
        s_l[i] = s_l[i] * alpha + sum;
        s_m[i] = m_new;
      }
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < GT; ++i) {
      const float a = s_alpha[i];
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[i][j][e] *= a;
      }
    }

    // Pass 2: acc += p * V over the chunk.
    for (int t0 = warp * TOK_STEP; t0 < clen; t0 += kWarps * TOK_STEP) {
      uint4 kv[U][CPL];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u * TPW + gw;
        long long off = 0;
        if (t < clen) {
          const int pos = c0 + t;
          off = s_base[(pos >> block_shift) - b_first] + static_cast<long long>(pos & bmask) * HEAD_DIM;
        }
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          const int c = lig + j * TG;
          if (t < clen && c < NC) {
            kv[u][j] = *reinterpret_cast<const uint4*>(vc + (off + c * VEC) * kBytes);
          } else {
            kv[u][j] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u * TPW + gw;
        const bool ok = t < clen;
        const int ts = ok ? t : 0;  // never index shared memory out of range
        float p[GT];
#pragma unroll
        for (int i = 0; i < GT; ++i) p[i] = ok ? s_buf[ts * GT + i] : 0.f;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          float f[VEC];
          unpack16<DT>(kv[u][j], f);
#pragma unroll
          for (int i = 0; i < GT; ++i) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[i][j][e] = fmaf(p[i], f[e], acc[i][j][e]);
          }
        }
      }
    }
    __syncthreads();  // s_buf / s_base are rewritten by the next chunk
  }

  // Sum the thread groups of each warp, then the warps through shared memory.
#pragma unroll
  for (int o = TG; o < 32; o <<= 1) {
#pragma unroll
    for (int i = 0; i < GT; ++i) {
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[i][j][e] += __shfl_xor_sync(0xffffffffu, acc[i][j][e], o);
      }
    }
  }
  if (gw == 0) {
#pragma unroll
    for (int i = 0; i < GT; ++i) {
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = lig + j * TG;
        if (c < NC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_buf[(warp * GT + i) * HEAD_DIM + c * VEC + e] = acc[i][j][e];
        }
      }
    }
  }
  __syncthreads();

  for (int idx = tid; idx < GT * HEAD_DIM; idx += kThreads) {
    const int i = idx / HEAD_DIM;
    const int d = idx - i * HEAD_DIM;
    if (i >= nh) continue;
    float s = 0.f;
#pragma unroll
    for (int wv = 0; wv < kWarps; ++wv) s += s_buf[(wv * GT + i) * HEAD_DIM + d];
    const int h = h0 + i;
    if (partition_size > 0) {
      const long long pi =
          (static_cast<long long>(w) * num_q_heads + h) * max_parts + static_cast<long long>(blockIdx.z);
      part_out[pi * HEAD_DIM + d] = s;
      if (d == 0) {
        part_max[pi] = s_m[i];
        part_sum[pi] = s_l[i];
      }
    } else {
      const float l = s_l[i];
      store_elem<DT>(out, static_cast<long long>(w) * out_stride + static_cast<long long>(h) * HEAD_DIM + d,
                     l > 0.f ? s / l : 0.f);
    }
  }
}

// Merge the partitions written by a split paged_attention_decode launch.
// Grid: x = query head, y = work item. Block: 128 threads. Dynamic shared memory: max_parts
// floats (one weight per partition).
template <int DT>
__global__ void __launch_bounds__(qw::kThreads) paged_attention_reduce(
    void* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ ctx_lens, const long long out_stride,
    const int num_q_heads, const int head_dim, const int partition_size, const int max_parts,
    const int sliding_window) {
  using namespace qw;
  QW_DYNAMIC_SMEM(float, s_w);  // max_parts floats
  __shared__ float s_red[kWarps];
  const int h = blockIdx.x;
  const int w = blockIdx.y;
  const int tid = threadIdx.x;
  const int ctx = ctx_lens[w];
  const int start = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  int n = ctx > start ? (ctx - start + partition_size - 1) / partition_size : 0;
  n = min(n, max_parts);
  const long long base = (static_cast<long long>(w) * num_q_heads + h) * max_parts;

  float mx = QW_NEG_INF;
  for (int p = tid; p < n; p += kThreads) mx = fmaxf(mx, part_max[base + p]);
  mx = block_max(mx, s_red);
  float ls = 0.f;
  for (int p = tid; p < n; p += kThreads) {
    const float wgt = exp2f(part_max[base + p] - mx);
    s_w[p] = wgt;
    ls += wgt * part_sum[base + p];
  }
  ls = block_sum(ls, s_red);  // its barriers also publish s_w
  const float inv = ls > 0.f ? 1.f / ls : 0.f;
  for (int d = tid; d < head_dim; d += kThreads) {
    float a = 0.f;
    for (int p = 0; p < n; ++p) a = fmaf(s_w[p], part_out[(base + p) * head_dim + d], a);
    store_elem<DT>(out, static_cast<long long>(w) * out_stride + static_cast<long long>(h) * head_dim + d,
                   a * inv);
  }
}
