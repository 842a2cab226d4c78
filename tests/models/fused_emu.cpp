// cuda/fused_ops.cu built for the CPU emulator (tests/attention/emulator/cuda_emu.h), behind
// the same qw_emu_run entry point as the attention kernels' emulator (argument count and
// byte sizes checked against each kernel's parameter list).
#include "cuda_emu.h"

#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "fused_ops.cu"

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
  return 0;
}

}  // namespace

#define QW_FUSED(K, DT) \
  if (name == #K "<" #DT ">") return run(&K<DT>, g, b, smem, nargs, args, sizes);
#define QW_FUSED_ALL(DT) QW_FUSED(rms_norm, DT) QW_FUSED(add_rms_norm, DT) \
  QW_FUSED(silu_and_mul, DT) QW_FUSED(rotary_neox, DT)

extern "C" int qw_emu_run(const char* cname, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned long long smem, int nargs, void** args, const int* sizes) {
  const std::string name(cname);
  const dim3 g{gx, gy, gz};
  const dim3 b{bx, 1, 1};
  QW_FUSED_ALL(0)
  QW_FUSED_ALL(1)
  QW_FUSED_ALL(2)
  std::fprintf(stderr, "emu: kernel %s not built\n", cname);
  return -1;
}
