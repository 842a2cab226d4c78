// Test kernels for the emulator's warp-level instructions (tests/attention/test_emulator.py):
// each runs one warp through a helper of cuda/warp_mma.cuh and dumps what every lane got, so
// the Python side can hold it against the PTX ISA's tables element by element.

#include "warp_mma.cuh"

// ldmatrix: image (image_bytes) is copied into dynamic shared memory; lane L passes the row
// address smem + offsets[L]; out[L * 4 + i] = register i of lane L.
template <int N, int TRANS>
void qw_test_ldmatrix(const unsigned char* image, const int image_bytes, const int* offsets, unsigned* out) {
  QW_TC_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  for (int i = lane; i < image_bytes; i += 32) smem[i] = image[i];
  __syncwarp();
  unsigned r[4] = {0u, 0u, 0u, 0u};
  const unsigned char* row = smem + offsets[lane];
  if constexpr (N == 4) {
    unsigned x[4];
    if (TRANS) qw::ldmatrix_x4_trans(x, row); else qw::ldmatrix_x4(x, row);
    for (int i = 0; i < 4; ++i) r[i] = x[i];
  } else if constexpr (N == 2) {
    unsigned x[2];
    if (TRANS) qw::ldmatrix_x2_trans(x, row); else qw::ldmatrix_x2(x, row);
    r[0] = x[0];
    r[1] = x[1];
  } else {
    unsigned x[1];
    if (TRANS) qw::ldmatrix_x1_trans(x, row); else qw::ldmatrix_x1(x, row);
    r[0] = x[0];
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// mma: frags[L * 6 + 0..3] = lane L's A registers, [4..5] its B registers; c[L * 4 + i] its
// accumulators in; d[L * 4 + i] out.
template <int MT>
void qw_test_mma(const unsigned* frags, const float* c, float* d) {
  const int lane = threadIdx.x;
  const unsigned a[4] = {frags[lane * 6], frags[lane * 6 + 1], frags[lane * 6 + 2], frags[lane * 6 + 3]};
  float acc[4] = {c[lane * 4], c[lane * 4 + 1], c[lane * 4 + 2], c[lane * 4 + 3]};
  qw::mma_16816<MT>(acc, a, frags[lane * 6 + 4], frags[lane * 6 + 5]);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
}

// cp.async: lane L copies 16-byte chunk L of src (and, for the two-group modes, chunk 32 + L)
// into shared memory; out gets what lane L then reads back, 16 bytes per read.
//   mode 0: commit, read without waiting          -> poison
//   mode 1: commit, wait_group 0, read            -> data
//   mode 2: group A, group B, wait_group 1, read A and B, wait_group 0, read B
//                                                 -> A data, B poison, B data
//   mode 3: zero-fill copy, commit, wait 0, read  -> zeros
//   mode 4: commit and never wait                 -> the launch fails
//   mode 5: no commit, wait_group 0, read         -> poison (uncommitted copies are not waited for)
//           then commit, wait_group 0, read       -> data
void qw_test_cp_async(const unsigned char* src, unsigned char* out, const int mode) {
  QW_TC_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  unsigned char* a = smem + 16 * lane;
  unsigned char* b = smem + 16 * (32 + lane);
  auto read = [&](const unsigned char* p, int slot) {
    for (int i = 0; i < 16; ++i) out[(slot * 32 + lane) * 16 + i] = p[i];
  };
  if (mode == 0) {
    qw::cp_async16(a, src + 16 * lane, true);
    qw::cp_async_commit();
    read(a, 0);
    qw::cp_async_wait<0>();
  } else if (mode == 1) {
    qw::cp_async16(a, src + 16 * lane, true);
    qw::cp_async_commit();
    qw::cp_async_wait<0>();
    read(a, 0);
  } else if (mode == 2) {
    qw::cp_async16(a, src + 16 * lane, true);
    qw::cp_async_commit();
    qw::cp_async16(b, src + 16 * (32 + lane), true);
    qw::cp_async_commit();
    qw::cp_async_wait<1>();
    read(a, 0);
    read(b, 1);
    qw::cp_async_wait<0>();
    read(b, 2);
  } else if (mode == 3) {
    qw::cp_async16(a, src + 16 * lane, false);
    qw::cp_async_commit();
    qw::cp_async_wait<0>();
    read(a, 0);
  } else if (mode == 4) {
    qw::cp_async16(a, src + 16 * lane, true);
    qw::cp_async_commit();
  } else {
    qw::cp_async16(a, src + 16 * lane, true);
    qw::cp_async_wait<0>();
    read(a, 0);
    qw::cp_async_commit();
    qw::cp_async_wait<0>();
    read(a, 1);
  }
}

// Conversions: enc[i] = float_to_e4m3(x[i]); dec[i] = e4m3x2_to_f16x2_scaled(words[i]);
// perm[i] = byte_perm(words[i], 0x76543210 pattern y, selectors[i]).
void qw_test_convert(const float* x, unsigned char* enc, const unsigned* words, unsigned* dec,
                     const unsigned* selectors, unsigned* perm, const int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    enc[i] = qw::float_to_e4m3(x[i]);
    dec[i] = qw::e4m3x2_to_f16x2_scaled(words[i]);
    perm[i] = qw::byte_perm(words[i], 0xfedcba98u, selectors[i]);
  }
}
