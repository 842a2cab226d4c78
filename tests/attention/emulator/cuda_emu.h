// Just enough of CUDA to run cuda/*.cu on the CPU, one OS thread per GPU thread.
//
// CTAs of a launch run one after another on a pool of blockDim.x threads, so `__shared__`
// (made `static`) is private to the running CTA. __syncthreads is a barrier of the CTA's
// threads; __shfl_xor_sync exchanges through a per-warp array between two warp barriers, so a
// shuffle that not all 32 lanes reach deadlocks here as it would misbehave on the GPU. The
// 16-bit conversions round to nearest even like the PTX cvt.rn instructions.
//
// The warp-level instructions of cuda/warp_mma.cuh follow the PTX ISA (sections cited there):
// - mma.sync m16n8k16 (f16/bf16 in, f32 accumulate): every lane posts its fragments, each
//   lane rebuilds the whole A (16x16) and B (16x8) from all lanes with the ISA's layout
//   formulas and computes its own four results (products exact, fp32 sums in k order).
// - ldmatrix .x1/.x2/.x4 (.trans): each lane posts its row address; lanes 8i..8i+7 supply
//   matrix i; each lane reads its fragment from the posted rows. Addresses must be 16-byte
//   aligned rows inside the dynamic shared memory, else the launch fails.
// - cp.async (16 bytes, optional zero fill) + commit_group / wait_group N: the destination
//   reads as poison (0xff bytes: NaN in f16/bf16/e4m3) from issue until the thread's
//   wait_group covers its group; only then are the bytes copied. A missing or too-weak wait
//   therefore feeds NaN into the result. Copies still pending when a CTA ends fail the
//   launch.
// Failures (qw_emu_fail) do not stop the threads (that could deadlock a barrier); they make
// the launch return an error with the first message.
#pragma once

#include <atomic>
#include <barrier>
#include <cstdio>
#include <mutex>
#include <string>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define QW_CPU_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

using std::max;
using std::min;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned qw_emu_float_bits(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float qw_emu_half_to_float(unsigned short h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline unsigned short qw_emu_float_to_half(float x) {
  _Float16 v = static_cast<_Float16>(x);  // IEEE round to nearest even
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline unsigned short qw_emu_float_to_bf16(float x) {
  unsigned u = qw_emu_float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

struct QwEmuLaneSlot {
  alignas(16) unsigned char bytes[64];
};

struct QwEmuState {
  std::unique_ptr<std::barrier<>> cta;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> xchg;
  std::vector<QwEmuLaneSlot> lanes;  // warp-collective exchange, one slot per thread
  std::vector<unsigned char> dynamic_smem;
  size_t dynamic_smem_bytes = 0;
  std::mutex mu;
  std::string error;  // first failure of the running launch ("" = none)
};
inline QwEmuState qw_emu;

inline void qw_emu_fail(const std::string& msg) {
  std::lock_guard<std::mutex> lock(qw_emu.mu);
  if (qw_emu.error.empty()) qw_emu.error = msg;
}

template <typename T> T* qw_emu_dynamic_smem() {
  return reinterpret_cast<T*>(qw_emu.dynamic_smem.data());
}
inline unsigned qw_emu_dynamic_smem_bytes() { return static_cast<unsigned>(qw_emu.dynamic_smem_bytes); }

// Whether [p, p + n) lies inside the launch's dynamic shared memory.
inline bool qw_emu_in_dynamic_smem(const void* p, size_t n) {
  const auto* b = qw_emu.dynamic_smem.data();
  const auto* c = static_cast<const unsigned char*>(p);
  return c >= b && c + n <= b + qw_emu.dynamic_smem_bytes;
}

inline void __syncthreads() { qw_emu.cta->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { qw_emu.warps[threadIdx.x / 32]->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto& bar = *qw_emu.warps[warp];
  qw_emu.xchg[warp * 32 + lane] = v;
  bar.arrive_and_wait();
  const float r = qw_emu.xchg[warp * 32 + (lane ^ static_cast<unsigned>(lane_mask))];
  bar.arrive_and_wait();
  return r;
}

inline unsigned qw_emu_lane() { return threadIdx.x % 32; }
inline unsigned qw_emu_warp() { return threadIdx.x / 32; }
inline QwEmuLaneSlot& qw_emu_slot(unsigned warp, unsigned lane) { return qw_emu.lanes[warp * 32 + lane]; }

// -- atomics, fences, misc -------------------------------------------------------------

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline unsigned qw_emu_byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned>((v >> (8 * sel)) & 0xffu) << (8 * i);
  }
  return r;
}

inline unsigned qw_emu_pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(qw_emu_float_to_bf16(lo)) | (static_cast<unsigned>(qw_emu_float_to_bf16(hi)) << 16);
}
inline unsigned qw_emu_pack_f16x2(float lo, float hi) {
  return static_cast<unsigned>(qw_emu_float_to_half(lo)) | (static_cast<unsigned>(qw_emu_float_to_half(hi)) << 16);
}

// Float to FP8 E4M3 (no infinities, max 448): round to nearest even, saturate finite values
// to +-448, NaN to 0x7f (the semantics of PTX cvt.rn.satfinite.e4m3x2.f32).
inline unsigned char qw_emu_float_to_e4m3(float x) {
  const unsigned char sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return 0x7f;
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 of them reach 2^-6 = code 8)
    return sign | static_cast<unsigned char>(std::nearbyint(std::ldexp(a, 9)));
  }
  int e;
  const float frac = std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  int m = static_cast<int>(std::nearbyint((frac * 2.f - 1.f) * 8.f));  // exact: a power-of-two scale
  int biased = e - 1 + 7;
  if (m == 8) {
    m = 0;
    ++biased;
  }
  const int code = (biased << 3) | m;
  return sign | static_cast<unsigned char>(code > 0x7e ? 0x7e : code);
}

// -- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 --------------------

inline float qw_emu_b16(unsigned short h, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<unsigned>(h) << 16) : qw_emu_half_to_float(h);
}

template <bool BF16>
inline void qw_emu_mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const unsigned warp = qw_emu_warp(), lane = qw_emu_lane();
  auto& bar = *qw_emu.warps[warp];
  unsigned post[6] = {a[0], a[1], a[2], a[3], b0, b1};
  std::memcpy(qw_emu_slot(warp, lane).bytes, post, sizeof(post));
  bar.arrive_and_wait();
  // Rebuild A (16x16) and B (16x8) from every lane's fragments (PTX ISA 9.7.14.5.8).
  float A[16][16], B[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    unsigned f[6];
    std::memcpy(f, qw_emu_slot(warp, l).bytes, sizeof(f));
    const unsigned g = l >> 2, t = l & 3;
    for (unsigned i = 0; i < 8; ++i) {  // a0..a7: register i/2, half i%2
      const unsigned short h = static_cast<unsigned short>(f[i / 2] >> (16 * (i % 2)));
      const unsigned row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const unsigned col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = qw_emu_b16(h, BF16);
    }
    for (unsigned i = 0; i < 4; ++i) {  // b0..b3
      const unsigned short h = static_cast<unsigned short>(f[4 + i / 2] >> (16 * (i % 2)));
      const unsigned row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][g] = qw_emu_b16(h, BF16);
    }
  }
  bar.arrive_and_wait();
  const unsigned g = lane >> 2, t = lane & 3;
  for (unsigned i = 0; i < 4; ++i) {  // c0..c3
    const unsigned row = i < 2 ? g : g + 8;
    const unsigned col = t * 2 + (i & 1);
    float acc = d[i];
    for (unsigned k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}

// -- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 ------------------------------

template <int N, bool TRANS>
inline void qw_emu_ldmatrix(unsigned (&r)[N], const void* row) {
  const unsigned warp = qw_emu_warp(), lane = qw_emu_lane();
  auto& bar = *qw_emu.warps[warp];
  std::memcpy(qw_emu_slot(warp, lane).bytes, &row, sizeof(row));
  bar.arrive_and_wait();
  const unsigned g = lane >> 2, t = lane & 3;
  for (int m = 0; m < N; ++m) {
    const unsigned char* rows[8];
    for (unsigned j = 0; j < 8; ++j) {
      const void* p;
      std::memcpy(&p, qw_emu_slot(warp, 8 * m + j).bytes, sizeof(p));
      rows[j] = static_cast<const unsigned char*>(p);
      if ((reinterpret_cast<uintptr_t>(p) & 15u) != 0 || !qw_emu_in_dynamic_smem(p, 16)) {
        qw_emu_fail("ldmatrix: row address not 16-byte aligned inside dynamic shared memory");
        rows[j] = nullptr;
      }
    }
    unsigned short lo = 0xffff, hi = 0xffff;
    if (!TRANS) {  // row g, columns 2t and 2t + 1
      if (rows[g] != nullptr) {
        std::memcpy(&lo, rows[g] + 4 * t, 2);
        std::memcpy(&hi, rows[g] + 4 * t + 2, 2);
      }
    } else {  // column g of rows 2t and 2t + 1
      if (rows[2 * t] != nullptr) std::memcpy(&lo, rows[2 * t] + 2 * g, 2);
      if (rows[2 * t + 1] != nullptr) std::memcpy(&hi, rows[2 * t + 1] + 2 * g, 2);
    }
    r[m] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
  }
  bar.arrive_and_wait();
}

// -- cp.async.cg.shared.global + commit_group / wait_group ----------------------------------

struct QwEmuCopy {
  unsigned char* dst;
  const unsigned char* src;
  int size, src_size;
  long long group;  // the commit count when issued: it belongs to the next commit's group
};
struct QwEmuCpState {
  std::vector<QwEmuCopy> pending;
  long long committed = 0;
};
inline thread_local QwEmuCpState qw_emu_cp;

inline void qw_emu_cp_async(void* dst, const void* src, int size, int src_size) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15u) != 0 || !qw_emu_in_dynamic_smem(dst, size)) {
    qw_emu_fail("cp.async: destination not 16-byte aligned inside dynamic shared memory");
    return;
  }
  std::memset(dst, 0xff, size);  // poison until the wait that covers this group
  qw_emu_cp.pending.push_back({static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src),
                               size, src_size, qw_emu_cp.committed});
}

inline void qw_emu_cp_async_commit() { ++qw_emu_cp.committed; }

inline void qw_emu_cp_async_wait(int n) {
  auto& st = qw_emu_cp;
  std::vector<QwEmuCopy> still;
  for (const auto& c : st.pending) {
    if (c.group < st.committed - n) {  // a committed group older than the n newest
      if (c.src_size > 0) std::memcpy(c.dst, c.src, c.src_size);
      if (c.src_size < c.size) std::memset(c.dst + c.src_size, 0, c.size - c.src_size);
    } else {
      still.push_back(c);
    }
  }
  st.pending.swap(still);
}

inline float __shfl_sync(unsigned, float v, int src_lane) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto& bar = *qw_emu.warps[warp];
  qw_emu.xchg[warp * 32 + lane] = v;
  bar.arrive_and_wait();
  const float r = qw_emu.xchg[warp * 32 + (static_cast<unsigned>(src_lane) & 31u)];
  bar.arrive_and_wait();
  return r;
}

// Run `body()` for every CTA of `grid` on `block.x` threads (block.y = block.z = 1).
template <typename F> void qw_emu_launch(dim3 grid, dim3 block, size_t shared_mem, F body) {
  const unsigned n = block.x;
  blockDim = block;
  gridDim = grid;
  qw_emu.cta = std::make_unique<std::barrier<>>(n);
  qw_emu.warps.clear();
  for (unsigned w = 0; w < (n + 31) / 32; ++w) qw_emu.warps.push_back(std::make_unique<std::barrier<>>(32));
  qw_emu.xchg.assign(((n + 31) / 32) * 32, 0.f);
  qw_emu.lanes.assign(((n + 31) / 32) * 32, QwEmuLaneSlot{});
  qw_emu.dynamic_smem.assign(shared_mem + 16, 0xff);  // poisoned: kernels must write before reading
  qw_emu.dynamic_smem_bytes = shared_mem;
  qw_emu.error.clear();
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = dim3{t, 0, 0};
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = dim3{x, y, z};
            body();
            if (!qw_emu_cp.pending.empty()) {
              qw_emu_fail("cp.async copies still pending when the CTA ended (missing wait_group)");
              qw_emu_cp.pending.clear();
            }
            qw_emu.cta->arrive_and_wait();  // CTAs never overlap: `static` shared memory is theirs
          }
    });
  }
  for (auto& th : threads) th.join();
}
