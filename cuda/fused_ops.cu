// The small per-layer ops of a decoder step, one kernel each instead of 4-16 torch ops:
// residual add + RMSNorm, RMSNorm, SiLU(gate) x up, and NeoX rotary embedding of q and k.
// Owned by the engine (qworker/models/fused_kernels.py launches them; the torch forms in
// qworker/models/ops.py are the reference and the fallback).
//
// Kernels (DT: 0 = fp32, 1 = fp16, 2 = bf16; 128 threads per CTA)
//   rms_norm<DT>           grid x = row: out = w * norm(x)                 rows of `dim`
//   add_rms_norm<DT>       grid x = row: r' = x + r; out = w * norm(r')    (writes r' too)
//   silu_and_mul<DT>       grid x = token: out[t, i] = silu(g[t, i]) * u[t, i],
//                          g = gate_up[t, :inter], u = gate_up[t, inter:]
//   rotary_neox<DT>        grid x = token: q/k rows rotated in place by position pos[t]
//                          with cos/sin tables [max_pos, dim / 2] (halves, NeoX layout)
//
// Rounding follows the torch ops they replace in the model's dtype (qworker/models/ops.py,
// transformers' Llama): the residual sum is rounded to DT before it is normalised;
// norm(x) = x * rsqrt(mean(x^2) + eps) in fp32, rounded to DT, then times the weight in
// fp32 and rounded again; silu is rounded to DT before the product; each rotary product
// and sum is rounded to DT. In fp32 every rounding is the identity.
//
// Rows are addressed with strides (elements) so views into fused projections work. No
// headers: NVRTC compiles this file as is; tests compile it for the CPU with
// tests/attention/emulator/cuda_emu.h (QW_CPU_EMULATION).

namespace qwf {

constexpr int kThreads = 128;

#ifdef QW_CPU_EMULATION
inline float rsqrt_(float x) { return 1.0f / std::sqrt(x); }
inline float exp_(float x) { return std::exp(x); }
inline float h2f(unsigned short h) { return qw_emu_half_to_float(h); }
inline unsigned short f2h(float x) { return qw_emu_float_to_half(x); }
inline unsigned short f2bf(float x) { return qw_emu_float_to_bf16(x); }
#else
__device__ __forceinline__ float rsqrt_(float x) { return rsqrtf(x); }
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2h(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ unsigned short f2bf(float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
#endif

__device__ __forceinline__ float bf2f(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

template <int DT> struct Elem { using type = unsigned short; };
template <> struct Elem<0> { using type = float; };

template <int DT> __device__ __forceinline__ float load(const typename Elem<DT>::type* p, long long i) {
  if constexpr (DT == 0) return p[i];
  else if constexpr (DT == 1) return h2f(p[i]);
  else return bf2f(p[i]);
}

template <int DT> __device__ __forceinline__ void store(typename Elem<DT>::type* p, long long i, float x) {
  if constexpr (DT == 0) p[i] = x;
  else if constexpr (DT == 1) p[i] = f2h(x);
  else p[i] = f2bf(x);
}

// x rounded to DT and back: the value torch keeps after an op in that dtype.
template <int DT> __device__ __forceinline__ float round_to(float x) {
  if constexpr (DT == 0) return x;
  else if constexpr (DT == 1) return h2f(f2h(x));
  else return bf2f(f2bf(x));
}

// Sum of `v` over the CTA (kThreads threads); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  __syncthreads();  // partial[] is reused by the next call
  return total;
}

}  // namespace qwf

// Two passes over the row: sum of squares, then normalise (the second pass re-reads what
// the same thread read or wrote in the first, so out may alias x and residual_out residual).
template <int DT>
__global__ void __launch_bounds__(128) rms_norm(
    typename qwf::Elem<DT>::type* out, const typename qwf::Elem<DT>::type* x,
    const typename qwf::Elem<DT>::type* __restrict__ weight, const int dim, const long long out_stride,
    const long long x_stride, const float eps) {
  const auto* row = x + static_cast<long long>(blockIdx.x) * x_stride;
  auto* dst = out + static_cast<long long>(blockIdx.x) * out_stride;
  float sq = 0.f;
  for (int i = threadIdx.x; i < dim; i += qwf::kThreads) {
    const float v = qwf::load<DT>(row, i);
    sq += v * v;
  }
  const float rstd = qwf::rsqrt_(qwf::block_sum(sq) / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += qwf::kThreads) {
    qwf::store<DT>(dst, i, qwf::load<DT>(weight, i) * qwf::round_to<DT>(qwf::load<DT>(row, i) * rstd));
  }
}

template <int DT>
__global__ void __launch_bounds__(128) add_rms_norm(
    typename qwf::Elem<DT>::type* out, typename qwf::Elem<DT>::type* residual_out,
    const typename qwf::Elem<DT>::type* x, const typename qwf::Elem<DT>::type* residual,
    const typename qwf::Elem<DT>::type* __restrict__ weight, const int dim, const long long stride,
    const float eps) {
  const long long base = static_cast<long long>(blockIdx.x) * stride;
  float sq = 0.f;
  for (int i = threadIdx.x; i < dim; i += qwf::kThreads) {
    const float v = qwf::round_to<DT>(qwf::load<DT>(x + base, i) + qwf::load<DT>(residual + base, i));
    qwf::store<DT>(residual_out + base, i, v);
    sq += v * v;
  }
  const float rstd = qwf::rsqrt_(qwf::block_sum(sq) / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += qwf::kThreads) {
    const float v = qwf::load<DT>(residual_out + base, i);
    qwf::store<DT>(out + base, i, qwf::load<DT>(weight, i) * qwf::round_to<DT>(v * rstd));
  }
}

template <int DT>
__global__ void __launch_bounds__(128) silu_and_mul(
    typename qwf::Elem<DT>::type* __restrict__ out, const typename qwf::Elem<DT>::type* __restrict__ gate_up,
    const int inter, const long long out_stride, const long long in_stride) {
  const long long t = blockIdx.x;
  const auto* g = gate_up + t * in_stride;
  for (int i = threadIdx.x; i < inter; i += qwf::kThreads) {
    const float a = qwf::load<DT>(g, i);
    const float act = qwf::round_to<DT>(a / (1.0f + qwf::exp_(-a)));
    qwf::store<DT>(out + t * out_stride, i, act * qwf::load<DT>(g, inter + i));
  }
}

template <int DT>
__global__ void __launch_bounds__(128) rotary_neox(
    typename qwf::Elem<DT>::type* __restrict__ q, typename qwf::Elem<DT>::type* __restrict__ k,
    const typename qwf::Elem<DT>::type* __restrict__ cos_table,
    const typename qwf::Elem<DT>::type* __restrict__ sin_table, const long long* __restrict__ positions,
    const int num_q_heads, const int num_kv_heads, const int head_dim, const long long q_stride,
    const long long k_stride) {
  const long long t = blockIdx.x;
  const int half = head_dim / 2;
  const long long p = positions[t] * half;
  const int pairs = (num_q_heads + num_kv_heads) * half;
  for (int idx = threadIdx.x; idx < pairs; idx += qwf::kThreads) {
    const int h = idx / half;
    const int i = idx - h * half;
    typename qwf::Elem<DT>::type* row =
        h < num_q_heads ? q + t * q_stride + static_cast<long long>(h) * head_dim
                        : k + t * k_stride + static_cast<long long>(h - num_q_heads) * head_dim;
    const float c = qwf::load<DT>(cos_table, p + i);
    const float s = qwf::load<DT>(sin_table, p + i);
    const float x1 = qwf::load<DT>(row, i);
    const float x2 = qwf::load<DT>(row, i + half);
    const float a = qwf::round_to<DT>(x1 * c), b = qwf::round_to<DT>(x2 * s);
    const float e = qwf::round_to<DT>(x2 * c), f = qwf::round_to<DT>(x1 * s);
    qwf::store<DT>(row, i, a - b);
    qwf::store<DT>(row, i + half, e + f);
  }
}
