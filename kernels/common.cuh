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

// Requests share `part` of `parts` of bytes [0, n) at p into L2 for a later
// kernel (cp.async.bulk.prefetch.L2, sm_90+; nothing before, nor for p null
// or n 0): a decode kernel whose own reads leave HBM idle pulls in what the
// next one will read, so that one reads L2. Shares are whole 16-byte units
// from the first 16-byte boundary (a head and a tail under 16 bytes are left
// out); warp 0's lanes issue a share in
// pieces of STRATA_L2_PIECE bytes; the other threads do nothing. Only for
// constant data (weights): nothing orders it after a writer.
#define STRATA_L2_PIECE 16384u
static __device__ __forceinline__ void strata_l2_ahead(const void* p, unsigned long long n, unsigned int part,
                                                       unsigned int parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p == nullptr || threadIdx.x >= 32 || parts == 0) return;
    const unsigned long long skip = (16 - (reinterpret_cast<unsigned long long>(p) & 15)) & 15;  // to 16 bytes
    if (n <= skip) return;
    const unsigned long long units = (n - skip) >> 4, per = (units + parts - 1) / parts;
    const unsigned long long lo = (unsigned long long)part * per * 16;
    const unsigned long long hi = min(units, ((unsigned long long)part + 1) * per) * 16;
    const char* base = static_cast<const char*>(p) + skip;
    for (unsigned long long off = lo + (unsigned long long)threadIdx.x * STRATA_L2_PIECE; off < hi;
         off += 32ull * STRATA_L2_PIECE) {
        const unsigned int size = (unsigned int)min((unsigned long long)STRATA_L2_PIECE, hi - off);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size) : "memory");
    }
#endif
}

// strata_l2_ahead with the whole grid's blocks as the parts.
static __device__ __forceinline__ void strata_l2_ahead_grid(const void* p, unsigned long long n) {
    const unsigned int part = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    strata_l2_ahead(p, n, part, gridDim.x * gridDim.y * gridDim.z);
}
