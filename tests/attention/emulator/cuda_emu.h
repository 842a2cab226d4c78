// Just enough of CUDA to run cuda/*.cu on the CPU, one OS thread per GPU thread.
//
// CTAs of a launch run one after another on a pool of blockDim.x threads, so `__shared__`
// (made `static`) is private to the running CTA. __syncthreads is a barrier of the CTA's
// threads; __shfl_xor_sync exchanges through a per-warp array between two warp barriers, so a
// shuffle that not all 32 lanes reach deadlocks here as it would misbehave on the GPU. The
// 16-bit conversions round to nearest even like the PTX cvt.rn instructions.
#pragma once

#include <barrier>
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

struct QwEmuState {
  std::unique_ptr<std::barrier<>> cta;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> xchg;
  std::vector<unsigned char> dynamic_smem;
};
inline QwEmuState qw_emu;

template <typename T> T* qw_emu_dynamic_smem() {
  return reinterpret_cast<T*>(qw_emu.dynamic_smem.data());
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

// Run `body()` for every CTA of `grid` on `block.x` threads (block.y = block.z = 1).
template <typename F> void qw_emu_launch(dim3 grid, dim3 block, size_t shared_mem, F body) {
  const unsigned n = block.x;
  blockDim = block;
  gridDim = grid;
  qw_emu.cta = std::make_unique<std::barrier<>>(n);
  qw_emu.warps.clear();
  for (unsigned w = 0; w < (n + 31) / 32; ++w) qw_emu.warps.push_back(std::make_unique<std::barrier<>>(32));
  qw_emu.xchg.assign(((n + 31) / 32) * 32, 0.f);
  qw_emu.dynamic_smem.assign(shared_mem + 16, 0xff);  // poisoned: kernels must write before reading
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = dim3{t, 0, 0};
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = dim3{x, y, z};
            body();
            qw_emu.cta->arrive_and_wait();  // CTAs never overlap: `static` shared memory is theirs
          }
    });
  }
  for (auto& th : threads) th.join();
}
