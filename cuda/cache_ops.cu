// KV cache maintenance: write a step's new K/V into their slots, and copy whole blocks.
//
// Kernels
//   reshape_and_cache<UNIT>     grid x = token, block 128 threads; UNIT = bytes per access (2, 4, 16)
//   reshape_and_cache_fp8<DT>   grid x = token, block 128 threads; DT = input dtype (0 = float32,
//                               1 = float16, 2 = bfloat16), cache FP8 E4M3
//   copy_blocks                 grid (pair, layer, 0 = keys / 1 = values), block 128 threads
//
// KV layout (qworker/attention/backend.py): one layer's cache is
//   [num_blocks, num_kv_heads, block_size, head_dim], head_dim contiguous; the whole pool is
//   [num_layers, num_blocks, num_kv_heads, block_size, head_dim] (layer_stride_bytes apart).
//   Slot s of a layer is block s / block_size, row s % block_size.
//
// reshape_and_cache: the CTA of token t reads slot_mapping[t]; -1 (padding) writes nothing.
//   Its threads stride over the num_heads * row_bytes / UNIT pieces of the token's key and
//   value rows (input [num_tokens, num_heads, head_dim]: rows of one token row_bytes apart,
//   tokens key_stride_bytes apart, so a view into a fused QKV projection works) and store each
//   at block * block_stride + head * head_stride + row * row_bytes. The cache has the input's
//   dtype: the kernel moves bytes. UNIT = 16 when every address is 16-byte aligned (the host
//   checks), else the element size.
// reshape_and_cache_fp8: the same slots, but each element is quantized: byte =
//   e4m3(x / scale) with round to nearest even, saturating at +-448, scale = kv_scales[0]
//   for keys and kv_scales[1] for values (the layer's scales on the device, see
//   qworker/attention/fp8.py; read at run time, so CUDA graphs stay valid). Input rows are
//   element strides key_stride / value_stride apart, heads head_dim apart.
// copy_blocks: the CTA of (pair i, layer l, k/v) copies block src[i] to dst[i] of that layer,
//   16 bytes per thread per step (a block is num_kv_heads * block_size * head_dim elements, a
//   multiple of 16 bytes when head_dim is a multiple of 8). src and dst must be disjoint sets:
//   pairs run in parallel (copy-on-write only ever copies into freshly allocated blocks).
//
// Swapping between the device pool and the pinned host pool is not a kernel: the backend
// gathers the blocks on the source device and moves them with torch copies (cudaMemcpyAsync),
// see qworker/attention/cuda_backend.py.
//
// Reference: qworker.attention.torch_ref.TorchAttentionBackend.write_kv / copy_blocks
// (tests/attention/test_cuda_backend.py compares byte for byte).

#include "warp_mma.cuh"

namespace qw {

template <int UNIT> struct Unit;
template <> struct Unit<2> { using type = unsigned short; };
template <> struct Unit<4> { using type = unsigned int; };
template <> struct Unit<16> { using type = uint4; };

}  // namespace qw

template <int UNIT>
__global__ void __launch_bounds__(128) reshape_and_cache(
    const char* __restrict__ key, const char* __restrict__ value, char* __restrict__ key_cache,
    char* __restrict__ value_cache, const long long* __restrict__ slot_mapping,
    const long long key_stride_bytes, const long long value_stride_bytes, const int num_heads,
    const int row_bytes, const int block_size, const long long block_stride_bytes,
    const long long head_stride_bytes) {
  using T = typename qw::Unit<UNIT>::type;
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long blk = slot / block_size;
  const long long row = slot - blk * block_size;
  const int per_row = row_bytes / UNIT;
  const int n = num_heads * per_row;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int h = idx / per_row;
    const int u = idx - h * per_row;
    const long long in_off = static_cast<long long>(h) * row_bytes + static_cast<long long>(u) * UNIT;
    const long long dst = blk * block_stride_bytes + static_cast<long long>(h) * head_stride_bytes +
                          row * row_bytes + static_cast<long long>(u) * UNIT;
    *reinterpret_cast<T*>(key_cache + dst) =
        *reinterpret_cast<const T*>(key + t * key_stride_bytes + in_off);
    *reinterpret_cast<T*>(value_cache + dst) =
        *reinterpret_cast<const T*>(value + t * value_stride_bytes + in_off);
  }
}

template <int DT>
__global__ void __launch_bounds__(128) reshape_and_cache_fp8(
    const void* __restrict__ key, const void* __restrict__ value, unsigned char* __restrict__ key_cache,
    unsigned char* __restrict__ value_cache, const long long* __restrict__ slot_mapping,
    const float* __restrict__ kv_scales, const long long key_stride, const long long value_stride,
    const int num_heads, const int head_dim, const int block_size, const long long block_stride,
    const long long head_stride) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long blk = slot / block_size;
  const long long row = slot - blk * block_size;
  const float ks = kv_scales[0];
  const float vs = kv_scales[1];
  const int n = num_heads * head_dim;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int h = idx / head_dim;
    const int d = idx - h * head_dim;
    float k, v;
    if constexpr (DT == 0) {
      k = static_cast<const float*>(key)[t * key_stride + idx];
      v = static_cast<const float*>(value)[t * value_stride + idx];
    } else {
      k = qw::b16_to_float<DT>(static_cast<const unsigned short*>(key)[t * key_stride + idx]);
      v = qw::b16_to_float<DT>(static_cast<const unsigned short*>(value)[t * value_stride + idx]);
    }
    const long long dst = blk * block_stride + h * head_stride + row * head_dim + d;
    key_cache[dst] = qw::float_to_e4m3(k / ks);
    value_cache[dst] = qw::float_to_e4m3(v / vs);
  }
}

extern "C" __global__ void __launch_bounds__(128) copy_blocks(
    char* key_pool, char* value_pool, const long long* __restrict__ src,
    const long long* __restrict__ dst, const long long layer_stride_bytes, const long long block_bytes) {
  char* pool = blockIdx.z == 0 ? key_pool : value_pool;
  const long long layer = static_cast<long long>(blockIdx.y) * layer_stride_bytes;
  const char* from = pool + layer + src[blockIdx.x] * block_bytes;
  char* to = pool + layer + dst[blockIdx.x] * block_bytes;
  for (long long i = static_cast<long long>(threadIdx.x) * 16; i < block_bytes;
       i += static_cast<long long>(blockDim.x) * 16) {
    *reinterpret_cast<uint4*>(to + i) = *reinterpret_cast<const uint4*>(from + i);
  }
}
