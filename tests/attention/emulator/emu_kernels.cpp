// The kernels of cuda/ built for the CPU emulator, behind one C entry point per kernel.
//
// qw_emu_run(name, grid, block, shared_mem, nargs, args, sizes) mirrors cuLaunchKernel: args
// holds a pointer to each argument's bytes and sizes their byte counts as the caller packed
// them (numpy scalars, like cupy does); a count or size that disagrees with the kernel's
// parameter list is refused (returns -2), so an argument-order or width mismatch between
// the Python backend and the kernels fails on the CPU.

#include "cuda_emu.h"

#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "paged_attention.cu"
#include "cache_ops.cu"
#include "paged_decode_tc.cu"
#include "paged_prefill_tc.cu"
#include "selftest.cpp"

namespace {

template <typename... P, size_t... I>
void call_with(void (*k)(P...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <typename... P>
int run(void (*k)(P...), dim3 grid, dim3 block, size_t smem, int nargs, void** args, const int* sizes) {
  constexpr int n = sizeof...(P);
  if (nargs != n) {
    std::fprintf(stderr, "emu: %d arguments given, kernel takes %d\n", nargs, n);
    return -2;
  }
  const size_t expect[] = {sizeof(P)...};
  for (int i = 0; i < n; ++i) {
    if (static_cast<size_t>(sizes[i]) != expect[i]) {
      std::fprintf(stderr, "emu: argument %d has %d bytes, kernel expects %zu\n", i, sizes[i], expect[i]);
      return -2;
    }
  }
  qw_emu_launch(grid, block, smem, [&] { call_with(k, args, std::index_sequence_for<P...>{}); });
  if (!qw_emu.error.empty()) {
    std::fprintf(stderr, "emu: %s\n", qw_emu.error.c_str());
    return -3;
  }
  return 0;
}

}  // namespace

#define QW_DECODE(DT, D, GT) \
  if (name == "paged_attention_decode<" #DT ", " #D ", " #GT ">") return run(&paged_attention_decode<DT, D, GT>, g, b, smem, nargs, args, sizes);
#define QW_REDUCE(DT) \
  if (name == "paged_attention_reduce<" #DT ">") return run(&paged_attention_reduce<DT>, g, b, smem, nargs, args, sizes);
#define QW_DECODE_TC(DT, KV8, D, NT) \
  if (name == "paged_decode_tc<" #DT ", " #KV8 ", " #D ", " #NT ">") return run(&paged_decode_tc<DT, KV8, D, NT>, g, b, smem, nargs, args, sizes);
#define QW_PREFILL_TC(DT, KV8, D) \
  if (name == "paged_prefill_tc<" #DT ", " #KV8 ", " #D ">") return run(&paged_prefill_tc<DT, KV8, D>, g, b, smem, nargs, args, sizes);
// Soft-capped instantiations (the templates' trailing CAP = 1).
#define QW_DECODE_CAP(DT, D, GT) \
  if (name == "paged_attention_decode<" #DT ", " #D ", " #GT ", 1>") return run(&paged_attention_decode<DT, D, GT, 1>, g, b, smem, nargs, args, sizes);
#define QW_DECODE_TC_CAP(DT, KV8, D, NT) \
  if (name == "paged_decode_tc<" #DT ", " #KV8 ", " #D ", " #NT ", 1>") return run(&paged_decode_tc<DT, KV8, D, NT, 1>, g, b, smem, nargs, args, sizes);
#define QW_PREFILL_TC_CAP(DT, KV8, D) \
  if (name == "paged_prefill_tc<" #DT ", " #KV8 ", " #D ", 1>") return run(&paged_prefill_tc<DT, KV8, D, 1>, g, b, smem, nargs, args, sizes);
#define QW_CACHE_FP8(DT) \
  if (name == "reshape_and_cache_fp8<" #DT ">") return run(&reshape_and_cache_fp8<DT>, g, b, smem, nargs, args, sizes);
#define QW_SELFTEST(NAME, ...) \
  if (name == NAME) return run(&__VA_ARGS__, g, b, smem, nargs, args, sizes);
#define QW_CACHE(U) \
  if (name == "reshape_and_cache<" #U ">") return run(&reshape_and_cache<U>, g, b, smem, nargs, args, sizes);

extern "C" int qw_emu_run(const char* cname, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned long long smem, int nargs, void** args, const int* sizes) {
  const std::string name(cname);
  const dim3 g{gx, gy, gz};
  const dim3 b{bx, 1, 1};
#include "emu_instances.inc"
  QW_REDUCE(0)
  QW_REDUCE(1)
  QW_REDUCE(2)
  QW_CACHE(2)
  QW_CACHE(4)
  QW_CACHE(16)
  if (name == "copy_blocks") return run(&copy_blocks, g, b, smem, nargs, args, sizes);
  QW_CACHE_FP8(0)
  QW_CACHE_FP8(1)
  QW_CACHE_FP8(2)
  QW_SELFTEST("qw_test_ldmatrix<1, 0>", qw_test_ldmatrix<1, 0>)
  QW_SELFTEST("qw_test_ldmatrix<1, 1>", qw_test_ldmatrix<1, 1>)
  QW_SELFTEST("qw_test_ldmatrix<2, 0>", qw_test_ldmatrix<2, 0>)
  QW_SELFTEST("qw_test_ldmatrix<2, 1>", qw_test_ldmatrix<2, 1>)
  QW_SELFTEST("qw_test_ldmatrix<4, 0>", qw_test_ldmatrix<4, 0>)
  QW_SELFTEST("qw_test_ldmatrix<4, 1>", qw_test_ldmatrix<4, 1>)
  QW_SELFTEST("qw_test_mma<1>", qw_test_mma<1>)
  QW_SELFTEST("qw_test_mma<2>", qw_test_mma<2>)
  QW_SELFTEST("qw_test_cp_async", qw_test_cp_async)
  QW_SELFTEST("qw_test_convert", qw_test_convert)
  std::fprintf(stderr, "emu: kernel %s not built\n", cname);
  return -1;
}
