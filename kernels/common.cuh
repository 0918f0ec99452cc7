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

// Thread-block clusters (sm_90+; a block is its own cluster of one before).
// strata_cluster_arrive (release) and strata_cluster_wait (acquire) are the
// two halves of the cluster's barrier: what a block wrote to its shared
// memory before its arrive is visible to every block of the cluster after
// its wait. A block reads another's shared memory (strata_cluster_ld_*)
// only between a barrier after that block's writes and one before that
// block exits.
static __device__ __forceinline__ unsigned int strata_cluster_rank() {
    unsigned int r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// The cluster's size (blocks).
static __device__ __forceinline__ unsigned int strata_cluster_size() {
    unsigned int n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

static __device__ __forceinline__ void strata_cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}

static __device__ __forceinline__ void strata_cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// The address of `p` (this block's shared memory) in block `rank` of the cluster.
static __device__ __forceinline__ unsigned int strata_cluster_map(const void* p, unsigned int rank) {
    unsigned int remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(s), "r"(rank));
#else
    (void)p;
    (void)rank;
#endif
    return remote;
}

// The float at `p` (this block's shared memory) in block `rank` of the cluster.
static __device__ __forceinline__ float strata_cluster_ld_f32(const float* p, unsigned int rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int remote = strata_cluster_map(p, rank);
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#else
    (void)p;
    (void)rank;
#endif
    return v;
}

// The float4 at `p` (16-byte aligned, this block's shared memory) in block `rank` of the cluster.
static __device__ __forceinline__ float4 strata_cluster_ld_f4(const float* p, unsigned int rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int remote = strata_cluster_map(p, rank);
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
#else
    (void)p;
    (void)rank;
#endif
    return v;
}

// 4 bytes global -> shared without a register (cp.async, sm_80+): a value a
// block needs only at its end is requested at its start, and no thread
// stalls for it (a register held across the block's work may be spilled,
// and the spill store waits for the load). Before reading the copy, the
// issuing thread calls strata_cp_async_wait_all() and then the block a
// barrier. Before sm_80: a plain copy.
static __device__ __forceinline__ void strata_cp_async4(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
#else
    *reinterpret_cast<unsigned int*>(smem) = *reinterpret_cast<const unsigned int*>(gmem);
#endif
}

// 16 bytes global -> shared (cp.async.cg: not through L1) under the L2
// policy pol (strata_l2_policy), sm_80+; before sm_80 a plain copy. As
// strata_cp_async4: the issuing thread waits (strata_cp_async_wait_all or a
// group wait) before it reads the copy, and the block a barrier before
// another thread does.
static __device__ __forceinline__ void strata_cp_async16(void* smem, const void* gmem, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "l"(pol)
                 : "memory");
#else
    (void)pol;
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

static __device__ __forceinline__ void strata_cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ops::rmsnorm's arithmetic, for every kernel that norms a row: the inverse
// root of the mean square from the row's sum of squares ss over n elements,
// and one normed element x * inv * w (in that order).
static __device__ __forceinline__ float strata_rms_inv(float ss, int n, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)n), eps)));
}

static __device__ __forceinline__ float strata_normed(float x, float inv, float w) {
    return __fmul_rn(__fmul_rn(x, inv), w);
}

static __device__ __forceinline__ float4 strata_normed4(float4 x, float inv, float4 w) {
    return make_float4(strata_normed(x.x, inv, w.x), strata_normed(x.y, inv, w.y), strata_normed(x.z, inv, w.z),
                       strata_normed(x.w, inv, w.w));
}

// NeoX RoPE in Rope::cos_sin's operations: the angle of pair i at position
// pos is the f32 product (float)pos * inv_freq[i] (f); its cos and sin
// (full-range precise sincosf) are scaled by attention_factor; the pair
// (a, b) = (x[i], x[i + half]) becomes (a c - b s, b c + a s).
static __device__ __forceinline__ void strata_rope_cos_sin(float f, unsigned long long pos, float attention_factor,
                                                           float& c, float& sn) {
    const float angle = __fmul_rn(__ull2float_rn(pos), f);
    sincosf(angle, &sn, &c);
    c = __fmul_rn(c, attention_factor);
    sn = __fmul_rn(sn, attention_factor);
}

static __device__ __forceinline__ void strata_rope_rotate(float& a, float& b, float c, float sn) {
    const float lo = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
    b = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
    a = lo;
}

static __device__ __forceinline__ void strata_rope_pair(float& a, float& b, float f, unsigned long long pos,
                                                        float attention_factor) {
    float c, sn;
    strata_rope_cos_sin(f, pos, attention_factor, c, sn);
    strata_rope_rotate(a, b, c, sn);
}

// out[0..head_dim) = rope(rmsnorm(x)) of one head row at position pos, by
// one warp (lane = its lane): the per-head q/k norm and NeoX RoPE (pairs
// (i, i + half), dims past 2 * half pass through). dense_rmsnorm_rope and
// attn_qkv_prep's generic path call it, its register path calls the same
// helpers, so their results are the same bits.
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
    const float inv = strata_rms_inv(ss, head_dim, eps);
    for (int i = lane; i < half; i += 32) {
        float a = strata_normed(xr[i], inv, w[i]);
        float b = strata_normed(xr[i + half], inv, w[i + half]);
        strata_rope_pair(a, b, inv_freq[i], pos, attention_factor);
        orow[i] = a;
        orow[i + half] = b;
    }
    for (int i = 2 * half + lane; i < head_dim; i += 32) orow[i] = strata_normed(xr[i], inv, w[i]);
}

// L2 priority of data a decode step reads once (STRATA_L2_STREAM, default
// on): the large dense GEMVs' weights, the tensor-core expert GEMVs' codes
// and block scales and the one-row attention's KV cache are loaded with an
// evict-first policy, so the gigabytes a step streams through L2 evict each
// other before what the next layer reads again: the kernels' machine code,
// the activations, the norm weights, the routers, the blob tables and the
// experts' global scales (kernels/README.md; measured in docs/performance.md,
// fifteenth session).
#ifndef STRATA_L2_STREAM
#define STRATA_L2_STREAM 1
#endif

// An L2 policy for .L2::cache_hint loads: evict-first (FIRST) or the
// default, evict-normal (sm_80+; 0 before, and the loads below then carry no
// hint).
template <bool FIRST>
static __device__ __forceinline__ uint64_t strata_l2_policy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && STRATA_L2_STREAM
    uint64_t p;
    if (FIRST)
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    else
        asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
    return p;
#else
    return 0;
#endif
}

static __device__ __forceinline__ uint64_t strata_stream_policy() { return strata_l2_policy<true>(); }

// 16 bytes through the read-only path (as __ldg) under the L2 policy pol;
// NO_L1: not allocated in L1 either.
template <bool NO_L1>
static __device__ __forceinline__ uint4 strata_ld_hint_u4(const void* p, uint64_t pol) {
    uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && STRATA_L2_STREAM
    if (NO_L1)
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p), "l"(pol));
    else
        asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p), "l"(pol));
#else
    (void)pol;
    if (NO_L1)
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p));
    else
        v = __ldg(reinterpret_cast<const uint4*>(p));
#endif
    return v;
}

// A u16 through the read-only path, L2 evict-first.
static __device__ __forceinline__ uint32_t strata_ld_stream_u16(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && STRATA_L2_STREAM
    unsigned short v;
    asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(strata_stream_policy()));
    return v;
#else
    return __ldg(reinterpret_cast<const unsigned short*>(p));
#endif
}

// 16 bytes / a float through L2 only (as __ldcg: data other kernels wrote),
// evict-first. volatile: kept in order with strata_pdl_wait.
static __device__ __forceinline__ uint4 strata_ldcg_stream_u4(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && STRATA_L2_STREAM
    uint4 v;
    asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(strata_stream_policy()));
    return v;
#else
    return __ldcg(reinterpret_cast<const uint4*>(p));
#endif
}

static __device__ __forceinline__ float strata_ldcg_stream_f32(const float* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && STRATA_L2_STREAM
    float v;
    asm volatile("ld.global.cg.L2::cache_hint.f32 %0, [%1], %2;" : "=f"(v) : "l"(p), "l"(strata_stream_policy()));
    return v;
#else
    return __ldcg(p);
#endif
}
