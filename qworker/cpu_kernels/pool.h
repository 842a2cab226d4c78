/* The work-sharing thread pool of the CPU kernels (pool.c). */
#pragma once
#include <stdint.h>

/* One chunk of a job: fn(ctx, c) for c in [0, chunks). */
typedef void (*qw_task_fn)(const void *ctx, int64_t chunk);

/* Run fn(ctx, c) for every c < chunks on the caller and the pool's helpers; returns
 * when all are done. A call made while another job runs (another thread, or from
 * inside a task) runs its chunks on the calling thread alone. */
void qw_pool_run(qw_task_fn fn, const void *ctx, int64_t chunks);

/* Threads a job runs on, the caller included. */
int64_t qw_pool_threads(void);

/* Largest chunk count one job may have. */
#define QW_POOL_MAX_CHUNKS 0xFFFFF

/* Spin-wait hint. */
static inline void qw_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
