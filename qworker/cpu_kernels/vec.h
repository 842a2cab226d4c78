/* The fp32 vector type of the CPU kernels: VL lanes, as wide as the target the library
 * is compiled for (-march=native), through GCC/Clang vector extensions. Loads and stores
 * go through memcpy, so pointers need no alignment. */
#pragma once
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
