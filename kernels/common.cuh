// Helpers shared by every kernel family (see kernels/README.md).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// Programmatic dependent launch (sm_90+; no-ops before). `Gpu::launch`
// starts a kernel while its predecessor on the stream may still run, so a
// kernel launched that way calls strata_pdl_wait() before it reads anything
// an earlier kernel writes or writes anything an earlier kernel touches
// (only constant inputs, such as weights, may be touched before; the
// exceptions, whose predecessors trigger late, are in kernels/README.md).
// strata_pdl_trigger() lets the next kernel's blocks start once every block
// of this one has triggered (or exited). Before this kernel's own wait that
// is safe when the next kernel touches nothing but constants before its
// wait; a kernel followed by one that reads more triggers after its wait.
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

// out[0..head_dim) = rope(rmsnorm(x)) of one head row at position pos, by
// one warp (lane = its lane): the per-head q/k norm and NeoX RoPE (pairs
// (i, i + half), dims past 2 * half pass through), in ops::rmsnorm's and
// Rope::cos_sin's operations. dense_rmsnorm_rope and attn_qkv_prep both
// call it, so their results are the same bits.
static __device__ __forceinline__ void strata_rmsnorm_rope_row(const float* __restrict__ xr,
                                                               const float* __restrict__ w, float* orow,
                                                               int head_dim, float eps,
                                                               const float* __restrict__ inv_freq, int half,
                                                               unsigned long long pos, float attention_factor,
                                                               int lane) {
    float ss = 0.0f;
    for (int i = lane; i < head_dim; i += 32) ss = fmaf(xr[i], xr[i], ss);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)head_dim), eps)));
    for (int i = lane; i < half; i += 32) {
        const float a = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
        const float b = __fmul_rn(__fmul_rn(xr[i + half], inv), w[i + half]);
        const float angle = __fmul_rn(__ull2float_rn(pos), inv_freq[i]);
        float sn, c;
        sincosf(angle, &sn, &c);
        c = __fmul_rn(c, attention_factor);
        sn = __fmul_rn(sn, attention_factor);
        orow[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
        orow[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
    }
    for (int i = 2 * half + lane; i < head_dim; i += 32) orow[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}
