// Warp-level tensor-core, shared-memory and async-copy helpers shared by the tensor-core
// attention kernels (paged_decode_tc.cu, paged_prefill_tc.cu).
//
// Every piece of inline PTX of those kernels lives here, behind one small function each, so
// that the CPU emulator (tests/attention/emulator/cuda_emu.h, QW_CPU_EMULATION) can provide
// the same functions with the semantics of the PTX ISA. The emulator's versions are checked
// against the PTX ISA's fragment tables, element by element, in
// tests/attention/test_emulator.py, so a layout mistake cannot hide by being made in the
// kernel and the emulator alike. PTX ISA sections used (CUDA 12/13 documentation):
//   9.7.14.5.8   mma.m16n8k16 fragments (f16/bf16 A, B; f32 C/D)
//   9.7.14.5.15  ldmatrix (m8n8, .x1/.x2/.x4, .trans, b16)
//   9.7.9.25     cp.async, cp.async.commit_group, cp.async.wait_group
// Fragment layouts (groupID g = lane >> 2, threadID_in_group t = lane & 3):
//   A 16x16 (row): reg0 = (row g,   cols 2t, 2t+1)   reg1 = (row g+8, cols 2t, 2t+1)
//                  reg2 = (row g,   cols 2t+8, +9)   reg3 = (row g+8, cols 2t+8, +9)
//   B 16x8  (col): reg0 = (rows 2t, 2t+1, col g)     reg1 = (rows 2t+8, 2t+9, col g)
//   C/D 16x8 f32 : c0, c1 = (row g, cols 2t, 2t+1)   c2, c3 = (row g+8, cols 2t, 2t+1)
//   (each 32-bit register holds the lower-indexed element in its low half)
//   ldmatrix m8n8: lanes 8i..8i+7 give the row addresses of matrix i (.x1: lanes 0-7,
//   .x2: 0-15, .x4: 0-31); register i of lane L holds row L/4, cols 2(L%4), 2(L%4)+1 of
//   matrix i, or with .trans rows 2(L%4), 2(L%4)+1 of column L/4.
//
// No headers are included: NVRTC needs no include path, and Python inlines this file into
// each kernel source (qworker/attention/cuda_kernels.py) so the compiled-kernel cache key
// covers it.
#pragma once

#ifndef QW_NEG_INF
#define QW_NEG_INF (__int_as_float(0xff800000))
#endif

namespace qw {

// -- shared-memory addresses and dynamic shared memory --------------------------------

#ifdef QW_CPU_EMULATION
#define QW_TC_DYNAMIC_SMEM(name) unsigned char* name = qw_emu_dynamic_smem<unsigned char>()
#else
#define QW_TC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Bytes of dynamic shared memory this launch was given (PTX %dynamic_smem_size).
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
#ifdef QW_CPU_EMULATION
  return qw_emu_dynamic_smem_bytes();
#else
  unsigned r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
#endif
}

// Stop the launch with an error (GPU: trap; emulator: the launch returns failure).
__device__ __forceinline__ void fail_launch() {
#ifdef QW_CPU_EMULATION
  qw_emu_fail("kernel called fail_launch");
#else
  asm volatile("trap;");
#endif
}

#ifndef QW_CPU_EMULATION
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
#endif

// -- ldmatrix ---------------------------------------------------------------------------

// Each lane passes the address of the row it supplies (see the table above).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<4, false>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<4, true>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<2, false>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<2, true>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<1, false>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
               : "=r"(r[0])
               : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) {
#ifdef QW_CPU_EMULATION
  qw_emu_ldmatrix<1, true>(r, row);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
               : "=r"(r[0])
               : "r"(smem_addr(row)));
#endif
}

// -- mma.sync m16n8k16, fp32 accumulate ------------------------------------------------

// d += A * B with A, B in MT (1 = f16, 2 = bf16), fragments as in the table above.
template <int MT>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
#ifdef QW_CPU_EMULATION
  qw_emu_mma_16816<MT == 2>(d, a, b0, b1);
#else
  if constexpr (MT == 2) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// -- cp.async ---------------------------------------------------------------------------

// Copy 16 bytes global -> shared, asynchronously; with valid false the 16 bytes are zeros
// (src-size 0: nothing is read). Visible to this thread after the matching wait_group.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef QW_CPU_EMULATION
  qw_emu_cp_async(smem, gmem, 16, valid ? 16 : 0);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef QW_CPU_EMULATION
  qw_emu_cp_async_commit();
#else
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef QW_CPU_EMULATION
  qw_emu_cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// -- conversions ------------------------------------------------------------------------

// Two floats to a packed f16x2 (MT 1) or bf16x2 (MT 2), round to nearest even; lo in the low
// half.
template <int MT> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
#ifdef QW_CPU_EMULATION
  return MT == 2 ? qw_emu_pack_bf16x2(lo, hi) : qw_emu_pack_f16x2(lo, hi);
#else
  unsigned r;
  if constexpr (MT == 2) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#endif
}

// One 16-bit value (DT 1 = f16, 2 = bf16) to float.
template <int DT> __device__ __forceinline__ float b16_to_float(unsigned short h) {
  if constexpr (DT == 2) {
    return __uint_as_float(static_cast<unsigned>(h) << 16);
  } else {
#ifdef QW_CPU_EMULATION
    return qw_emu_half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
  }
}

// One float to a 16-bit value (DT 1 = f16, 2 = bf16), round to nearest even.
template <int DT> __device__ __forceinline__ unsigned short float_to_b16(float x) {
  return static_cast<unsigned short>(pack2<DT>(x, 0.f) & 0xffffu);
}

// FP8 E4M3 (the cache's storage, see qworker/attention/fp8.py) to f16, exactly, by moving
// bits: e4m3's exponent and mantissa land in f16's, so f16 value = e4m3 value * 2^-8 for
// normals and subnormals alike (NaN, never stored, would read as 480). The caller folds
// the 2^8 into its scale. w holds two e4m3 bytes at bits 0-7 and 16-23; the result holds
// the two f16 values in the same halves.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2_scaled(unsigned w) {
  return ((w & 0x007f007fu) << 7) | ((w & 0x00800080u) << 8);
}

// Bytes of x chosen by selector s (PTX prmt, CUDA __byte_perm): result byte i is byte
// (s >> 4i) & 7 of the pair {y:x} (0-3 from x, 4-7 from y).
__device__ __forceinline__ unsigned byte_perm(unsigned x, unsigned y, unsigned s) {
#ifdef QW_CPU_EMULATION
  return qw_emu_byte_perm(x, y, s);
#else
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
  return r;
#endif
}

// A float to FP8 E4M3: round to nearest even, saturating to +-448 (NaN stays NaN).
__device__ __forceinline__ unsigned char float_to_e4m3(float x) {
#ifdef QW_CPU_EMULATION
  return qw_emu_float_to_e4m3(x);
#else
  // x into both bytes (the ISA puts input a in the upper, b in the lower one): the low byte
  // is the answer whichever way round, and no constant operand is needed.
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(r) : "f"(x));
  return static_cast<unsigned char>(r & 0xffu);
#endif
}

// -- global memory between CTAs ---------------------------------------------------------

// Load that bypasses L1 (another CTA wrote it during this launch).
__device__ __forceinline__ float ld_cg(const float* p) {
#ifdef QW_CPU_EMULATION
  return *p;
#else
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
#endif
}

}  // namespace qw
