// Helpers shared by every kernel family (see kernels/README.md).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// Programmatic dependent launch (sm_90+; no-ops before). `Gpu::launch`
// starts a kernel while its predecessor on the stream may still run, so a
// kernel launched that way calls strata_pdl_wait() before it reads anything
// an earlier kernel writes or writes anything an earlier kernel touches
// (only constant inputs, such as weights, may be touched before).
// strata_pdl_trigger() lets the next kernel's blocks start once every block
// of this one has started (always safe: that kernel waits in turn).
static __device__ __forceinline__ void strata_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void strata_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
