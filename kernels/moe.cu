// moe kernels (see kernels/README.md for conventions): the one MoE pipeline
// of src/moe/mod.rs on the device.
//
//   route:    moe_route_topk            logits [T, E] -> ids, weights [T, k]
//   decode:   moe_gate_up_gemv          act[t*k+j] = silu(gate_e x_t) * (up_e x_t)
//             moe_down_gemv             out[t] (+)= sum_j w[t,j] down_e act[t*k+j]
//             moe_gate_up_gemv_tc / moe_down_gemv_tc: the same on tensor cores
//             (sm_80+, H and I multiples of 256 where they are reduced over)
//   prefill:  moe_group_by_expert       counting sort of the (token, j) assignments by expert
//             moe_gate_up_grouped_simple / moe_down_grouped_simple   (one slot per block row, SIMT)
//             moe_gate_up_grouped_mma   / moe_down_grouped_mma       (tensor cores, sm_80+)
//             moe_gate_up_grouped_mma_split / moe_down_grouped_mma_split (the same, activations as bf16 hi + lo)
//             moe_combine               out[t] (+)= sum_j w[t,j] y[slot(t,j)]
//   generic:  moe_gate_up_gemv16, moe_down_gemv16, moe_gate_up_grouped16,
//             moe_down_grouped16: the same for a reduced dimension (H for
//             gate/up, I for down) that is a multiple of 16 but not of 32.
//
// NVFP4 (docs/pack-format.md): W[r, c] = e2m1(code) * e4m3(scale[r, c/16]) * g,
// element 2i of a row is the LOW nibble of byte i. Each kernel receives the
// device address of an expert blob and reads g from the blob's tail itself.
#include "common.cuh"
#include <cuda_fp16.h>

// Mirrors the Rust `backend::cuda::moe::BlobLayout` (#[repr(C)], 9 x u64).
struct MoeBlobLayout {
    uint64_t hidden, intermediate;
    uint64_t gate_codes, gate_scales, up_codes, up_scales, down_codes, down_scales, tail;
};

#define MOE_MAX_TOP_K 16
#define MOE_ROUTE_MAX_EXPERTS 1024
// Most experts moe_gate_up_gemv routes itself (FUSED_ROUTE_MAX_EXPERTS in moe.rs).
#define MOE_FUSED_ROUTE_MAX 512
#define MOE_GROUP_WARPS 16
// Rows of the grouped tensor-core GEMM tile (token rows of one expert).
#define MOE_TILE_M 64

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

static __device__ __forceinline__ float moe_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Larger value wins; equal values: the lower index wins (moe::route's order).
static __device__ __forceinline__ void moe_argmax_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

static __device__ __forceinline__ float moe_silu(float x) { return x / (1.0f + expf(-x)); }

// E4M3 (e4m3fn) byte -> f32, exact (denormals included): the byte's bits
// shifted into an f16 give value * 2^-8.
static __device__ __forceinline__ float moe_e4m3_to_f32(uint32_t b) {
    const unsigned short h = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
    return __half2float(__ushort_as_half(h)) * 256.0f;
}

// Two E2M1 nibbles (bits 0..3 and 16..19 of t) -> f16x2 holding value * 2^-14
// each (exact: 0.5 * 2^-14 is an f16 denormal, converted exactly to f32).
static __device__ __forceinline__ float2 moe_e2m1x2_scaled(uint32_t t) {
    const uint32_t h = ((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12);
    __half2 v;
    memcpy(&v, &h, 4);
    return __half22float2(v);
}

// The 8 E2M1 codes of w as four f16x2 pairs p[k] = (nibble k, nibble k + 4),
// each value * 2^-14 (bit for bit moe_e2m1x2_scaled(w >> 4k)). An f16 whose
// low byte is 0 is its high byte: sign at bit 7, magnitude bits at 1..3. So
// E holds that byte for the low nibble of each byte of w (elements 0, 2, 4,
// 6), O for the high nibble (1, 3, 5, 7), and each pair is two bytes of E or
// O moved to bytes 1 and 3: 11 integer ops for 8 codes. moe_e2m1x8_h gives
// the f16x2 bits (pair k in h[k]), moe_e2m1x8 the pairs as f32.
static __device__ __forceinline__ void moe_e2m1x8_h(uint32_t w, uint32_t (&h)[4]) {
    const uint32_t E = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);
    const uint32_t O = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);
    h[0] = __byte_perm(E, 0u, 0x2404);
    h[1] = __byte_perm(O, 0u, 0x2404);
    h[2] = E & 0xFF00FF00u;
    h[3] = O & 0xFF00FF00u;
}

// moe_e2m1x8_h converted to f32 pairs.
static __device__ __forceinline__ void moe_e2m1x8(uint32_t w, float2 (&p)[4]) {
    uint32_t h[4];
    moe_e2m1x8_h(w, h);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        __half2 v;
        memcpy(&v, &h[k], 4);
        p[k] = __half22float2(v);
    }
}

// acc + sum_{i<8} e2m1(nibble i of w) * 2^-14 * x_i, with x_0..3 in a, x_4..7 in b.
static __device__ __forceinline__ float moe_dot8(uint32_t w, float4 a, float4 b, float acc) {
    float2 f[4];
    moe_e2m1x8(w, f);
    acc = fmaf(f[0].x, a.x, acc);
    acc = fmaf(f[0].y, b.x, acc);
    acc = fmaf(f[1].x, a.y, acc);
    acc = fmaf(f[1].y, b.y, acc);
    acc = fmaf(f[2].x, a.z, acc);
    acc = fmaf(f[2].y, b.z, acc);
    acc = fmaf(f[3].x, a.w, acc);
    acc = fmaf(f[3].y, b.w, acc);
    return acc;
}

// One 32-element chunk of an NVFP4 row (16 code bytes, 2 block scales in the
// u16 `s`) dotted with x (8 float4 of the chunk, xq[0..8)), added to acc in
// units of 2^-14 (the caller multiplies by 2^14 * g once).
static __device__ __forceinline__ float moe_chunk_dot(uint4 c, uint32_t s, const float4 (&xq)[8], float acc) {
    float p0 = moe_dot8(c.x, xq[0], xq[1], 0.0f);
    p0 = moe_dot8(c.y, xq[2], xq[3], p0);
    float p1 = moe_dot8(c.z, xq[4], xq[5], 0.0f);
    p1 = moe_dot8(c.w, xq[6], xq[7], p1);
    acc = fmaf(p0, moe_e4m3_to_f32(s & 0xFFu), acc);
    acc = fmaf(p1, moe_e4m3_to_f32((s >> 8) & 0xFFu), acc);
    return acc;
}

// moe_chunk_dot with the chunk's x read from the staged (chunk transposed)
// row as it is used (2 float4 per code word): for a chunk whose x is used once.
static __device__ __forceinline__ float moe_chunk_dot_s(uint4 c, uint32_t s, const float4* xs, int nchunk, int ci,
                                                       float acc) {
    float p0 = moe_dot8(c.x, xs[0 * nchunk + ci], xs[1 * nchunk + ci], 0.0f);
    p0 = moe_dot8(c.y, xs[2 * nchunk + ci], xs[3 * nchunk + ci], p0);
    float p1 = moe_dot8(c.z, xs[4 * nchunk + ci], xs[5 * nchunk + ci], 0.0f);
    p1 = moe_dot8(c.w, xs[6 * nchunk + ci], xs[7 * nchunk + ci], p1);
    acc = fmaf(p0, moe_e4m3_to_f32(s & 0xFFu), acc);
    acc = fmaf(p1, moe_e4m3_to_f32((s >> 8) & 0xFFu), acc);
    return acc;
}

static __device__ __forceinline__ uint32_t moe_u4_word(uint4 v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
static __device__ __forceinline__ uint4 moe_ld_codes(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
static __device__ __forceinline__ uint32_t moe_ld_scales2(const uint8_t* p) {
    return (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p));
}
// The same for the tensor-core decode GEMVs, which read device memory (a
// resident blob or a slot) once a step: L2 evict-first (common.cuh). The
// CUDA-core GEMVs, which also read host blobs in place (mapped decode), keep
// the default: evict-first there made a mapped decode step 10% slower
// (docs/performance.md, fifteenth session).
static __device__ __forceinline__ uint4 moe_ld_codes_s(const uint8_t* p) {
    return strata_ld_hint_u4<false>(p, strata_stream_policy());
}
static __device__ __forceinline__ uint32_t moe_ld_scales2_s(const uint8_t* p) { return strata_ld_stream_u16(p); }
static __device__ __forceinline__ float moe_tail(const uint8_t* blob, const MoeBlobLayout& L, int m) {
    return __ldg(reinterpret_cast<const float*>(blob + L.tail) + m);
}

// Copies a row of n floats (n % 32 == 0) into shared memory in the "chunk
// transposed" order: float4 q (0..7) of 32-element chunk c goes to
// dst[q * (n / 32) + c], so lane c reading its chunk's q-th float4 is
// conflict-free across the warp.
static __device__ __forceinline__ void moe_stage_row(float4* dst, const float* src, int n) {
    const int nchunk = n >> 5;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (int f = threadIdx.x; f < (n >> 2); f += blockDim.x) dst[(f & 7) * nchunk + (f >> 3)] = s4[f];
}

// moe_stage_row for `rows` consecutive rows of n floats each (n % 32 == 0):
// row j goes to dst + j * n / 4, each chunk transposed. Flat over all rows,
// U float4 loads issued per thread before their stores (the serial
// load -> store chain of one float4 per round costs an L2 latency a round).
template <int U>
static __device__ __forceinline__ void moe_stage_rows(float4* dst, const float* src, int n, int rows) {
    const int nchunk = n >> 5, n4 = n >> 2, total = n4 * rows, step = blockDim.x;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (int f0 = threadIdx.x; f0 < total; f0 += U * step) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int f = f0 + u * step;
            if (f < total) v[u] = __ldg(s4 + f);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int f = f0 + u * step;
            if (f < total) {
                const int j = f / n4, ff = f - j * n4;
                dst[j * n4 + (ff & 7) * nchunk + (ff >> 3)] = v[u];
            }
        }
    }
}

static __device__ __forceinline__ void moe_load_xq(const float4* xs, int nchunk, int c, float4 (&xq)[8]) {
#pragma unroll
    for (int q = 0; q < 8; ++q) xq[q] = xs[q * nchunk + c];
}

// ---------------------------------------------------------------------------
// 1. Routing: softmax over E in f32, top-k (ties: lower expert id), optional
// renormalization. One block per token.
// ---------------------------------------------------------------------------

// Routing of one token by one warp: lane l holds experts l, l + 32, ... in
// registers, so the max, the sum and each of the k argmax rounds are
// shuffles, with no shared memory and no block barrier. Lanes j < top_k
// write ids_out[j] and w_out[j] (global or shared memory). PER_LANE * 32 >=
// num_experts; moe_topk_warp picks the smallest that holds E (registers).
template <int MOE_ROUTE_PER_LANE>
static __device__ __forceinline__ void moe_topk_warp_n(const float* __restrict__ row, int num_experts, int top_k,
                                                       int norm_topk_prob, uint32_t* ids_out, float* w_out) {
    const int lane = threadIdx.x & 31;
    float p[MOE_ROUTE_PER_LANE];
    float m = -INFINITY;
#pragma unroll
    for (int u = 0; u < MOE_ROUTE_PER_LANE; ++u) {
        const int i = lane + 32 * u;
        p[u] = i < num_experts ? __ldcg(row + i) : -INFINITY;  // through L2: see moe_down_route
        m = fmaxf(m, p[u]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < MOE_ROUTE_PER_LANE; ++u) {
        if (lane + 32 * u < num_experts) {
            p[u] = expf(p[u] - m);
            s += p[u];
        }
    }
    s = moe_warp_sum(s);
#pragma unroll
    for (int u = 0; u < MOE_ROUTE_PER_LANE; ++u) p[u] = lane + 32 * u < num_experts ? p[u] / s : -1.0f;

    // k rounds: the warp's argmax (ties: the lower id); the winner's lane
    // retires it (probabilities are >= 0: -1 is never chosen again).
    float chosen_p = 0.0f, sum = 0.0f;
    int chosen_e = 0;
    for (int j = 0; j < top_k; ++j) {
        float bv = -1.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int u = 0; u < MOE_ROUTE_PER_LANE; ++u) moe_argmax_merge(bv, bi, p[u], lane + 32 * u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        // Two warp reductions (redux.sync) instead of five shuffle rounds:
        // the largest value as an ordered key (a probability p >= 0 is
        // bits(p) + 1, as unsigned ordered like p; retired (-1), NaN and
        // absent are 0, which never wins), then the lowest id holding it.
        const unsigned int key = bv >= 0.0f ? __float_as_uint(bv) + 1u : 0u;
        const unsigned int best = __reduce_max_sync(0xffffffffu, key);
        bi = (int)__reduce_min_sync(0xffffffffu, best != 0u && key == best ? (unsigned int)bi : 0x7fffffffu);
        bv = best != 0u ? __uint_as_float(best - 1u) : -1.0f;
#else
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            moe_argmax_merge(bv, bi, v2, i2);
        }
#endif
        // No winner (NaN logits): an id >= E, which later kernels turn into NaN.
        if (bi < num_experts && (bi & 31) == lane) {
#pragma unroll
            for (int u = 0; u < MOE_ROUTE_PER_LANE; ++u)
                if (bi == lane + 32 * u) p[u] = -1.0f;
        }
        if (lane == j) {
            chosen_p = bv;
            chosen_e = bi;
        }
        sum += bv;  // in order, as moe::route (the same value in every lane)
    }
    if (lane < top_k) {
        ids_out[lane] = (uint32_t)chosen_e;
        w_out[lane] = norm_topk_prob ? chosen_p / sum : chosen_p;
    }
}

static __device__ __forceinline__ void moe_topk_warp(const float* __restrict__ row, int num_experts, int top_k,
                                                     int norm_topk_prob, uint32_t* ids_out, float* w_out) {
    if (num_experts <= 128)
        moe_topk_warp_n<4>(row, num_experts, top_k, norm_topk_prob, ids_out, w_out);
    else if (num_experts <= 512)
        moe_topk_warp_n<16>(row, num_experts, top_k, norm_topk_prob, ids_out, w_out);
    else
        moe_topk_warp_n<MOE_ROUTE_MAX_EXPERTS / 32>(row, num_experts, top_k, norm_topk_prob, ids_out, w_out);
}

// One warp (block) per token.
extern "C" __global__ void __launch_bounds__(32)
    moe_route_topk(const float* __restrict__ logits, int num_experts, int top_k, int norm_topk_prob,
                   uint32_t* __restrict__ ids, float* __restrict__ weights) {
    const size_t t = blockIdx.x;
    moe_topk_warp(logits + t * num_experts, num_experts, top_k, norm_topk_prob, ids + t * top_k,
                  weights + t * top_k);
}

// ---------------------------------------------------------------------------
// 2. Decode GEMVs. gate/up: a warp owns MOE_GEMV_ROWS rows of both matrices;
// each lane reads 16 code bytes (one 32-element chunk) per row and matrix,
// two chunks per step (stride 32 chunks), so 2 rows x 2 matrices x 2 chunks
// = 8 16-byte loads are in flight per lane. The activation row is staged in
// shared memory once per block. down: 8 lanes per output row (see
// moe_down_row); the decode kernel moe_down_gemv spreads a row's experts over
// 8 warps (see there), the SIMT grouped and generic kernels use moe_down_row.
// ---------------------------------------------------------------------------

#define MOE_GU_WARPS 8
#define MOE_DOWN_WARPS 4
#define MOE_GEMV_ROWS 2

// Rows [row0, row0 + 2) of silu(gate x) * (up x) for one expert blob; x is
// staged (chunk transposed) in xs; one warp. Rows >= I are computed on row
// I - 1 and not written.
static __device__ __forceinline__ void moe_gate_up_rows(const float4* xs, const uint8_t* blob, const MoeBlobLayout& L,
                                                        int row0, float* act_row) {
    const int H = (int)L.hidden, I = (int)L.intermediate, nchunk = H >> 5, lane = threadIdx.x & 31;
    const size_t code_row = (size_t)H >> 1, scale_row = (size_t)H >> 4;
    int rows[MOE_GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; ++r) rows[r] = min(row0 + r, I - 1);
    const uint8_t* gc = blob + L.gate_codes;
    const uint8_t* gs = blob + L.gate_scales;
    const uint8_t* uc = blob + L.up_codes;
    const uint8_t* us = blob + L.up_scales;
    float ag[MOE_GEMV_ROWS] = {}, au[MOE_GEMV_ROWS] = {};
    for (int c0 = lane; c0 < nchunk; c0 += 64) {
        const int c1 = c0 + 32;
        const bool has1 = c1 < nchunk;
        uint4 cg[MOE_GEMV_ROWS][2], cu[MOE_GEMV_ROWS][2];
        uint32_t sg[MOE_GEMV_ROWS][2], su[MOE_GEMV_ROWS][2];
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
            const size_t co = rows[r] * code_row, so = rows[r] * scale_row;
            cg[r][0] = moe_ld_codes(gc + co + 16 * c0);
            cu[r][0] = moe_ld_codes(uc + co + 16 * c0);
            sg[r][0] = moe_ld_scales2(gs + so + 2 * c0);
            su[r][0] = moe_ld_scales2(us + so + 2 * c0);
            if (has1) {
                cg[r][1] = moe_ld_codes(gc + co + 16 * c1);
                cu[r][1] = moe_ld_codes(uc + co + 16 * c1);
                sg[r][1] = moe_ld_scales2(gs + so + 2 * c1);
                su[r][1] = moe_ld_scales2(us + so + 2 * c1);
            } else {
                cg[r][1] = cu[r][1] = make_uint4(0, 0, 0, 0);
                sg[r][1] = su[r][1] = 0;
            }
        }
        float4 xq[8];
        moe_load_xq(xs, nchunk, c0, xq);
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
            ag[r] = moe_chunk_dot(cg[r][0], sg[r][0], xq, ag[r]);
            au[r] = moe_chunk_dot(cu[r][0], su[r][0], xq, au[r]);
        }
        if (has1) {
            moe_load_xq(xs, nchunk, c1, xq);
#pragma unroll
            for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
                ag[r] = moe_chunk_dot(cg[r][1], sg[r][1], xq, ag[r]);
                au[r] = moe_chunk_dot(cu[r][1], su[r][1], xq, au[r]);
            }
        }
    }
    const float gg = moe_tail(blob, L, 0) * 16384.0f, gu = moe_tail(blob, L, 1) * 16384.0f;
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
        const float g = moe_warp_sum(ag[r]) * gg;
        const float u = moe_warp_sum(au[r]) * gu;
        if (lane == 0 && row0 + r < I) act_row[row0 + r] = moe_silu(g) * u;
    }
}

// The blob of expert id e (table_s: the first MOE_FUSED_ROUTE_MAX entries
// of the table), nullptr for an id past the table.
static __device__ __forceinline__ const uint8_t* moe_table_blob(uint32_t e, const uint64_t* __restrict__ table,
                                                                int table_len, const uint64_t* table_s) {
    if (e >= (uint32_t)table_len) return nullptr;
    return reinterpret_cast<const uint8_t*>(e < (uint32_t)MOE_FUSED_ROUTE_MAX ? table_s[e] : __ldg(table + e));
}

// The expert blob of assignment a = t * k + j of a decode gate/up GEMV
// block, nullptr for an expert id past the table. With logits (decode: no
// moe_route_topk launch) every block of token t routes it in its warp 0 (the
// same operations, so the same result, as moe_route_topk) while the other
// warps load the table into shared memory (the blob address is then a
// shared-memory read, not an L2 round trip), and the blocks of y = 0 publish
// their choice j for the down kernel; without, the expert is ids[a]. Every
// thread of the block calls it (a barrier on the routed path).
// E <= MOE_FUSED_ROUTE_MAX (the wrappers' check): no 32-register path here.
static __device__ __forceinline__ const uint8_t* moe_gemv_blob(const uint32_t* __restrict__ ids,
                                                               const uint64_t* __restrict__ table, int table_len,
                                                               int a, int top_k, const float* __restrict__ logits,
                                                               int num_experts, int norm_topk_prob,
                                                               uint32_t* __restrict__ ids_out,
                                                               float* __restrict__ weights_out) {
    __shared__ uint32_t routed_ids[MOE_MAX_TOP_K];
    __shared__ float routed_w[MOE_MAX_TOP_K];
    __shared__ uint64_t table_s[MOE_FUSED_ROUTE_MAX];
    if (logits == nullptr) {
        const uint32_t e = __ldg(ids + a);
        return e < (uint32_t)table_len ? reinterpret_cast<const uint8_t*>(__ldg(table + e)) : nullptr;
    }
    const int t = a / top_k, j = a - t * top_k;
    const int table_s_len = min(table_len, MOE_FUSED_ROUTE_MAX);
    if (threadIdx.x < 32) {
        const float* row = logits + (size_t)t * num_experts;
        if (num_experts <= 128)
            moe_topk_warp_n<4>(row, num_experts, top_k, norm_topk_prob, routed_ids, routed_w);
        else
            moe_topk_warp_n<MOE_FUSED_ROUTE_MAX / 32>(row, num_experts, top_k, norm_topk_prob, routed_ids, routed_w);
    } else {
        for (int i = threadIdx.x - 32; i < table_s_len; i += blockDim.x - 32) table_s[i] = __ldg(table + i);
    }
    __syncthreads();
    const uint32_t e = routed_ids[j];
    if (blockIdx.y == 0 && threadIdx.x == 0) {
        ids_out[a] = e;
        weights_out[a] = routed_w[j];
    }
    return moe_table_blob(e, table, table_len, table_s);
}

// grid (T * k, ceil(I / (8 warps * 2 rows))), block 256, dynamic smem H * 4.
// act[a] for assignment a = t * k + j, expert ids[a], blob table[ids[a]].
// Latency first: the expert's first step of code and scale loads (8 x 16
// bytes a lane) is issued before x is staged, so the HBM reads overlap the
// staging and the barrier; three blocks per SM (<= 85 registers) put the
// T = 1, I = 768 grid (384 blocks) in one wave on 132 SMs.
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32, 3)
    moe_gate_up_gemv(const float* __restrict__ x, const uint32_t* __restrict__ ids, const uint64_t* __restrict__ table,
                     int table_len, MoeBlobLayout L, int top_k, float* __restrict__ act,
                     const float* __restrict__ logits, int num_experts, int norm_topk_prob,
                     uint32_t* __restrict__ ids_out, float* __restrict__ weights_out, int late_trigger) {
    extern __shared__ float4 moe_gu_xs[];
    // Programmatic dependent launch: wait before any access. late_trigger:
    // the down GEMV after it routes from the logits before its own wait, so
    // it starts only after this one's (the router GEMV has finished then).
    if (!late_trigger) strata_pdl_trigger();
    strata_pdl_wait();
    if (late_trigger) strata_pdl_trigger();
    const int a = blockIdx.x, t = a / top_k;
    const int H = (int)L.hidden, I = (int)L.intermediate, nchunk = H >> 5, lane = threadIdx.x & 31;
    const uint8_t* blob =
        moe_gemv_blob(ids, table, table_len, a, top_k, logits, num_experts, norm_topk_prob, ids_out, weights_out);
    float* act_row = act + (size_t)a * I;
    const int row0 = (blockIdx.y * MOE_GU_WARPS + (threadIdx.x >> 5)) * MOE_GEMV_ROWS;
    if (blob == nullptr) {  // a bad expert id: a visible NaN, never a wild read
        if (lane < MOE_GEMV_ROWS && row0 + lane < I) act_row[row0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    const size_t code_row = (size_t)H >> 1, scale_row = (size_t)H >> 4;
    // The warp's rows are row0, row0 + 1 (I is even); a row0 past I (none in
    // the wrapper's grid: I % 16 == 0) reads rows I - 2, I - 1 and writes
    // nothing, and every warp stays for the barrier.
    const size_t rbase = (size_t)min(row0, I - MOE_GEMV_ROWS);
    const uint8_t* bc = blob + rbase * code_row;
    const uint8_t* bs = blob + rbase * scale_row;
    uint4 cg[MOE_GEMV_ROWS][2], cu[MOE_GEMV_ROWS][2];
    uint32_t sg[MOE_GEMV_ROWS][2], su[MOE_GEMV_ROWS][2];
    // Chunks c0 and c0 + 32 of every row and matrix (zeros past the row).
    auto load = [&](int c0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = c0 + 32 * h;
#pragma unroll
            for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
                if (c < nchunk) {
                    cg[r][h] = moe_ld_codes(bc + L.gate_codes + r * code_row + 16 * c);
                    cu[r][h] = moe_ld_codes(bc + L.up_codes + r * code_row + 16 * c);
                    sg[r][h] = moe_ld_scales2(bs + L.gate_scales + r * scale_row + 2 * c);
                    su[r][h] = moe_ld_scales2(bs + L.up_scales + r * scale_row + 2 * c);
                } else {
                    cg[r][h] = cu[r][h] = make_uint4(0, 0, 0, 0);
                    sg[r][h] = su[r][h] = 0;
                }
            }
        }
    };
    load(lane);
    const float gg = moe_tail(blob, L, 0) * 16384.0f, gu = moe_tail(blob, L, 1) * 16384.0f;
    moe_stage_rows<2>(moe_gu_xs, x + (size_t)t * H, H, 1);
    __syncthreads();
    float ag[MOE_GEMV_ROWS] = {}, au[MOE_GEMV_ROWS] = {};
    for (int c0 = lane;;) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = c0 + 32 * h;
            if (c < nchunk) {
                // moe_chunk_dot for the 2 rows x 2 matrices, x read two float4 at a time.
                float pg[MOE_GEMV_ROWS][2] = {}, pu[MOE_GEMV_ROWS][2] = {};
#pragma unroll
                for (int wi = 0; wi < 4; ++wi) {
                    const float4 xa = moe_gu_xs[(2 * wi) * nchunk + c], xb = moe_gu_xs[(2 * wi + 1) * nchunk + c];
#pragma unroll
                    for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
                        pg[r][wi >> 1] = moe_dot8(moe_u4_word(cg[r][h], wi), xa, xb, pg[r][wi >> 1]);
                        pu[r][wi >> 1] = moe_dot8(moe_u4_word(cu[r][h], wi), xa, xb, pu[r][wi >> 1]);
                    }
                }
#pragma unroll
                for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
                    ag[r] = fmaf(pg[r][0], moe_e4m3_to_f32(sg[r][h] & 0xFFu), ag[r]);
                    ag[r] = fmaf(pg[r][1], moe_e4m3_to_f32((sg[r][h] >> 8) & 0xFFu), ag[r]);
                    au[r] = fmaf(pu[r][0], moe_e4m3_to_f32(su[r][h] & 0xFFu), au[r]);
                    au[r] = fmaf(pu[r][1], moe_e4m3_to_f32((su[r][h] >> 8) & 0xFFu), au[r]);
                }
            }
        }
        c0 += 64;
        if (c0 - lane >= nchunk) break;  // the same trip count in every lane
        load(c0);
    }
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
        const float g = moe_warp_sum(ag[r]) * gg;
        const float u = moe_warp_sum(au[r]) * gu;
        if (lane == 0 && row0 + r < I) act_row[row0 + r] = moe_silu(g) * u;
    }
}

// The down GEMV gives each output row to 8 lanes (MOE_DOWN_LANES): a down
// row has only I / 32 chunks (24 for I = 768, 16 for I = 512), so a whole
// warp per row would leave lanes idle. A warp owns 4 rows (one per 8-lane
// group); in moe_down_row a lane reads up to 3 chunks of its row for each of
// 4 experts per step: 12 16-byte loads in flight.
#define MOE_DOWN_LANES 8
#define MOE_DOWN_ROWS_PER_WARP (32 / MOE_DOWN_LANES)
#define MOE_DOWN_CHUNKS 3

// Row row0 + (lane / 8) of sum_j coef[j] * (down_{blob j} act_j) over the
// expert groups j0 = j_first, j_first + j_step, ... (4 experts a group), act_j
// staged (chunk transposed, I floats each) at acts + j * I / 4; coef[j] already
// holds w_j * g_down_j * 2^14. One warp; the result is valid in lanes with
// lane % 8 == 0.
static __device__ __forceinline__ float moe_down_row(const float4* acts, const uint8_t* const* blobs, const float* coef,
                                                     int nexp, const MoeBlobLayout& L, int row0, int j_first,
                                                     int j_step) {
    const int H = (int)L.hidden, I = (int)L.intermediate, nchunk = I >> 5, lane = threadIdx.x & 31;
    const int sub = lane & (MOE_DOWN_LANES - 1);
    const int row = min(row0 + lane / MOE_DOWN_LANES, H - 1);
    const size_t code_off = (size_t)row * ((size_t)I >> 1), scale_off = (size_t)row * ((size_t)I >> 4);
    float acc = 0.0f;
    // Experts in groups of 4, in order (the sum order is fixed).
    for (int j0 = j_first; j0 < nexp; j0 += j_step) {
        for (int cb = sub; cb < nchunk; cb += MOE_DOWN_LANES * MOE_DOWN_CHUNKS) {
            uint4 cd[4][MOE_DOWN_CHUNKS];
            uint32_t sd[4][MOE_DOWN_CHUNKS];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                for (int u = 0; u < MOE_DOWN_CHUNKS; ++u) {
                    const int c = cb + u * MOE_DOWN_LANES;
                    if (j0 + jj < nexp && c < nchunk) {
                        const uint8_t* b = blobs[j0 + jj];
                        cd[jj][u] = moe_ld_codes(b + L.down_codes + code_off + 16 * c);
                        sd[jj][u] = moe_ld_scales2(b + L.down_scales + scale_off + 2 * c);
                    } else {
                        cd[jj][u] = make_uint4(0, 0, 0, 0);
                        sd[jj][u] = 0;
                    }
                }
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                if (j0 + jj < nexp) {
                    float part = 0.0f;
#pragma unroll
                    for (int u = 0; u < MOE_DOWN_CHUNKS; ++u) {
                        const int c = cb + u * MOE_DOWN_LANES;
                        if (c < nchunk) {
                            float4 xq[8];
                            moe_load_xq(acts + (size_t)(j0 + jj) * (I >> 2), nchunk, c, xq);
                            part = moe_chunk_dot(cd[jj][u], sd[jj][u], xq, part);
                        }
                    }
                    acc = fmaf(coef[j0 + jj], part, acc);
                }
            }
        }
    }
#pragma unroll
    for (int o = MOE_DOWN_LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// The routing of a decode down GEMV, before its programmatic wait
// (logits non-null): warp 0 routes token t from the router logits (the
// operations of moe_route_topk, so the ids and weights the gate/up GEMV
// chose) into ids_s / w_s while the other warps load the table (its first
// MOE_FUSED_ROUTE_MAX entries) into table_s; then a barrier. Reading the
// logits here is safe because the gate/up GEMV before this kernel triggers
// only after its own wait: when this kernel starts, the router GEMV has
// finished. They are read through L2 (__ldcg in moe_topk_warp_n), never an
// L1 line of an earlier layer's. Without logits: the ids and weights the
// gate/up GEMV wrote, after the wait. table_s null: no table copy (table and
// table_len unused). Every thread calls it.
static __device__ __forceinline__ void moe_down_route(const float* __restrict__ logits, int num_experts,
                                                      int norm_topk_prob, const uint32_t* __restrict__ ids,
                                                      const float* __restrict__ weights,
                                                      const uint64_t* __restrict__ table, int table_len, int t,
                                                      int top_k, uint32_t* ids_s, float* w_s, uint64_t* table_s) {
    const int table_s_len = min(table_len, MOE_FUSED_ROUTE_MAX);
    if (logits != nullptr) {
        if (threadIdx.x < 32) {
            const float* row = logits + (size_t)t * num_experts;
            if (num_experts <= 128)
                moe_topk_warp_n<4>(row, num_experts, top_k, norm_topk_prob, ids_s, w_s);
            else
                moe_topk_warp_n<MOE_FUSED_ROUTE_MAX / 32>(row, num_experts, top_k, norm_topk_prob, ids_s, w_s);
        } else if (table_s != nullptr) {
            for (int i = threadIdx.x - 32; i < table_s_len; i += blockDim.x - 32) table_s[i] = __ldg(table + i);
        }
    } else {
        strata_pdl_wait();
        if (table_s != nullptr)
            for (int i = threadIdx.x; i < table_s_len; i += blockDim.x) table_s[i] = __ldg(table + i);
        if (threadIdx.x < top_k) {
            ids_s[threadIdx.x] = __ldg(ids + t * top_k + threadIdx.x);
            w_s[threadIdx.x] = __ldg(weights + t * top_k + threadIdx.x);
        }
    }
    __syncthreads();
}

// Down GEMV of the decode path (I % 32 == 0). grid (T, ceil(H / 8)), block
// 512 (16 warps), dynamic smem k * I * 4 (the token's k act rows, chunk
// transposed). out[t] (+)= sum_j weights[t*k+j] * down_{ids[t*k+j]} act[t*k+j].
// A block owns 8 output rows: warp w takes the rows 4 (w % 2) .. + 4 (8
// lanes a row, as moe_down_row) and the experts j = w / 2 and w / 2 + 8, so
// the k experts of a row are spread over the warps and a lane has at most
// 2 experts x 3 chunks (16-byte loads) in flight per round; for T = 1,
// H = 2048 the grid is 256 blocks, two per SM (<= 64 registers): one wave
// with ~32 warps per SM. The blob addresses and the first round of code
// loads are issued before the act rows are staged. Each warp leaves its
// per-expert partial (w_j g_j down_j . act_j for its 4 rows) in red[j]; after
// the barrier 8 threads add red[0..k) in j order (fixed order: deterministic).
#define MOE_DN_RW 2   // row warps per block (4 rows each)
#define MOE_DN_JW 8   // expert warps per row warp
#define MOE_DN_ROWS (MOE_DN_RW * MOE_DOWN_ROWS_PER_WARP)
#define MOE_DN_EXP ((MOE_MAX_TOP_K + MOE_DN_JW - 1) / MOE_DN_JW)
extern "C" __global__ void __launch_bounds__(MOE_DN_RW * MOE_DN_JW * 32, 2)
    moe_down_gemv(const float* __restrict__ act, const uint32_t* __restrict__ ids, const float* __restrict__ weights,
                  const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k, float* __restrict__ out,
                  int accumulate, const float* __restrict__ logits, int num_experts, int norm_topk_prob) {
    extern __shared__ float4 moe_down_acts[];
    __shared__ float red[MOE_MAX_TOP_K][MOE_DN_ROWS];
    __shared__ float coefs[MOE_MAX_TOP_K];
    // The token's ids and the table (its first MOE_FUSED_ROUTE_MAX entries)
    // read at once into shared memory: a blob address is one L2 round trip
    // after the wait, not two dependent ones.
    __shared__ uint64_t table_s[MOE_FUSED_ROUTE_MAX];
    __shared__ uint32_t ids_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    // Programmatic dependent launch: the routing, the blob addresses and the
    // first round of code loads (constant weights) come before the wait when
    // the kernel routes itself (logits non-null, see moe_down_route).
    strata_pdl_trigger();
    const int t = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate, nchunk = I >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane & (MOE_DOWN_LANES - 1);
    const int rw = warp % MOE_DN_RW, jw = warp / MOE_DN_RW;
    const int local = rw * MOE_DOWN_ROWS_PER_WARP + lane / MOE_DOWN_LANES;
    const int row = blockIdx.y * MOE_DN_ROWS + local;
    // 32-bit row offsets (registers): the wrapper checks H * I / 2 < 2^32.
    const uint32_t rrow = (uint32_t)min(row, H - 1);
    const uint32_t code_off = rrow * ((uint32_t)I >> 1), scale_off = rrow * ((uint32_t)I >> 4);

    // This warp's experts: j = jw + q * MOE_DN_JW (q < MOE_DN_EXP), the same
    // in all lanes; blob nullptr: no expert (j >= k) or a bad expert id.
    moe_down_route(logits, num_experts, norm_topk_prob, ids, weights, table, table_len, t, top_k, ids_s, w_s,
                   table_s);
    const uint8_t* bq[MOE_DN_EXP];
#pragma unroll
    for (int q = 0; q < MOE_DN_EXP; ++q) {
        const int j = jw + q * MOE_DN_JW;
        bq[q] = j < top_k ? moe_table_blob(ids_s[j], table, table_len, table_s) : nullptr;
    }
    uint4 cd[MOE_DN_EXP][MOE_DOWN_CHUNKS];
    uint32_t sd[MOE_DN_EXP][MOE_DOWN_CHUNKS];
    // Chunks cb, cb + 8, cb + 16 of each of this warp's experts (zeros past the row).
    auto load = [&](int cb) {
#pragma unroll
        for (int q = 0; q < MOE_DN_EXP; ++q) {
#pragma unroll
            for (int u = 0; u < MOE_DOWN_CHUNKS; ++u) {
                const int c = cb + u * MOE_DOWN_LANES;
                if (bq[q] != nullptr && c < nchunk) {
                    cd[q][u] = moe_ld_codes(bq[q] + L.down_codes + code_off + 16 * c);
                    sd[q][u] = moe_ld_scales2(bq[q] + L.down_scales + scale_off + 2 * c);
                } else {
                    cd[q][u] = make_uint4(0, 0, 0, 0);
                    sd[q][u] = 0;
                }
            }
        }
    };
    load(sub);
    // coefs[j] = w_j * g_down_j * 2^14, NaN for a bad expert id (a visible
    // NaN row, never a wild read); written by lane 0 of the row-0 warps.
    if (rw == 0 && lane == 0) {
#pragma unroll
        for (int q = 0; q < MOE_DN_EXP; ++q) {
            const int j = jw + q * MOE_DN_JW;
            if (j < top_k)
                coefs[j] = bq[q] != nullptr ? w_s[j] * moe_tail(bq[q], L, 2) * 16384.0f : __int_as_float(0x7fc00000);
        }
    }
    if (logits != nullptr) strata_pdl_wait();  // the act rows are the gate/up GEMV's
    // The residual a writer thread adds to, requested now (after the wait)
    // into shared memory: after the reduction it was a dependent read at the
    // end of the block's chain.
    __shared__ float prev[MOE_DN_ROWS];
    const int orow = blockIdx.y * MOE_DN_ROWS + threadIdx.x;
    const bool writer = threadIdx.x < MOE_DN_ROWS && orow < H;
    if (accumulate && writer) strata_cp_async4(prev + threadIdx.x, out + (size_t)t * H + orow);
    moe_stage_rows<3>(moe_down_acts, act + (size_t)t * top_k * I, I, top_k);
    __syncthreads();

    float part[MOE_DN_EXP] = {};
    for (int cb = sub;;) {
#pragma unroll
        for (int q = 0; q < MOE_DN_EXP; ++q) {
            if (bq[q] != nullptr) {
                const float4* xs = moe_down_acts + (size_t)(jw + q * MOE_DN_JW) * (I >> 2);
#pragma unroll
                for (int u = 0; u < MOE_DOWN_CHUNKS; ++u) {
                    const int c = cb + u * MOE_DOWN_LANES;
                    if (c < nchunk) part[q] = moe_chunk_dot_s(cd[q][u], sd[q][u], xs, nchunk, c, part[q]);
                }
            }
        }
        cb += MOE_DOWN_LANES * MOE_DOWN_CHUNKS;
        if (cb - sub >= nchunk) break;  // the same trip count in every lane
        load(cb);
    }
#pragma unroll
    for (int q = 0; q < MOE_DN_EXP; ++q) {
        float v = part[q];
#pragma unroll
        for (int o = MOE_DOWN_LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        const int j = jw + q * MOE_DN_JW;
        if (j < top_k && sub == 0) red[j][local] = v;
    }
    strata_cp_async_wait_all();  // prev
    __syncthreads();
    if (writer) {
        float v = 0.0f;
        for (int j = 0; j < top_k; ++j) v = fmaf(coefs[j], red[j][threadIdx.x], v);
        out[(size_t)t * H + orow] = accumulate ? prev[threadIdx.x] + v : v;
    }
}

// ---------------------------------------------------------------------------
// 2b. The decode GEMVs on tensor cores (sm_80+): moe_gate_up_gemv_tc and
// moe_down_gemv_tc, the same results as moe_gate_up_gemv / moe_down_gemv
// (up to f32 rounding) with ~2 instructions per weight instead of ~3.4.
//
// The CUDA-core GEMVs spend ~3.4 instructions per NVFP4 weight (integer
// decode, a conversion and an FMA per code) and are bound by that chain, not
// by memory. Here a warp multiplies a 16-row tile of weights by x with
// mma.sync m16n8k16 (f16 in, f32 accumulate):
// - A holds e2m1(code) * e4m3(block scale) * 2^-7 as an f16, which is EXACT:
//   the product has at most 6 significant bits (2 and 4) and lies in
//   [2^-17, 21] (2^-17 as an f16 subnormal, all its bits above 2^-24); it is
//   one HMUL2 of moe_e2m1x8_h's pairs (value * 2^-14) by the scale * 2^7
//   (moe_e4m3x2_x128). With the scale inside A, the order of k inside a tile
//   is free: thread (g, t) of the mma puts into its k slots the pairs
//   (element i, element i + 4) of its own 8-code words, and B takes x in
//   the same order, so every load is a plain 16-byte code load.
// - B column 0 holds f16(x'), column 1 f16(x' - column 0), columns 2..7 are
//   zero (x' = x * 2^-E per 256-element slice, E such that max |x'| is in
//   [2^13, 2^14), E clamped to [-110, 110]: so for a slice whose largest |x|
//   is in [2^-97, 2^124); larger ones overflow f16 from about 2^126). The
//   pair keeps ~22 bits of each x within 2^-16 of the slice's largest, and
//   an absolute error below 2^(E - 25) for smaller ones.
//   Row r's result is D[r][0] + D[r][1], times 2^E * 2^7 * the global scale.
// Code map: a warp slice is 256 elements of K (128 bytes of a code row);
// thread (g, t) loads the 16 bytes at 16 t and 64 + 16 t of rows g and g + 8
// (a group's 4 threads read each row's 64-byte halves), i.e. words
// 16 u + 4 t + j (u, j < 4: uint4 u, word j) of the slice, and their two
// block scales (u16 at 8 u + 2 t: word j's scale is byte j / 2).
// x is staged per warp (no block barrier): lane L converts word L of the
// slice into the hi and lo pairs (moe_tc_stage).
#define MOE_TC_GU_WARPS 8
#define MOE_TC_SLICE 256
#define MOE_TC_DN_MAX_PARTS 64  // (expert, K slice) partials of a down block (top_k * I / 256)
#define MOE_TC_DN_MAX_WARPS 24  // warps of a down block (up to 85 registers: its 512-expert routing unspilled)

// f16x2 (s0 * 2^7, s1 * 2^7) of the two E4M3 scales in the low 16 bits of v,
// exact: the bytes shifted into f16s give s * 2^-8 (as moe_e4m3_to_f32), and
// s * 2^7 <= 57344 fits an f16.
static __device__ __forceinline__ __half2 moe_e4m3x2_x128(uint32_t v) {
    const uint32_t b = __byte_perm(v, 0u, 0x4140);  // bytes s0, 0, s1, 0
    const uint32_t h = ((b & 0x00800080u) << 8) | ((b & 0x007F007Fu) << 7);
    __half2 r, k;
    const uint32_t k15 = 0x78007800u;  // (2^15, 2^15)
    memcpy(&r, &h, 4);
    memcpy(&k, &k15, 4);
    return __hmul2(r, k);
}

// The four A pairs of an 8-code word, each times the word's scale pair sc
// (e2m1 * 2^-14 * s * 2^7: exact, see the section comment).
static __device__ __forceinline__ void moe_tc_word(uint32_t w, __half2 sc, uint32_t (&a)[4]) {
    uint32_t h[4];
    moe_e2m1x8_h(w, h);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        __half2 v;
        memcpy(&v, &h[k], 4);
        v = __hmul2(v, sc);
        memcpy(&a[k], &v, 4);
    }
}

static __device__ __forceinline__ void moe_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                   uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Stages the slice x[0, 256) for one warp: lane L writes word L's pairs
// (x[8L + i], x[8L + i + 4]), i < 4, as f16 hi (xs[L]) and lo (xs[32 + L])
// of x * 2^-E, and returns 2^E (see the section comment; E = 0 for a zero
// slice or one holding an infinity; fmaxf skips NaN, which reaches the
// result as it is).
// moe_tc_stage_v takes lane L's eight values x[8L .. 8L + 8) as p and q
// (moe_fused_decode_tc stages from shared memory).
static __device__ __forceinline__ float moe_tc_stage_v(const float4 p, const float4 q, uint4* xs, int lane) {
    float m = fmaxf(fmaxf(fmaxf(fabsf(p.x), fabsf(p.y)), fmaxf(fabsf(p.z), fabsf(p.w))),
                    fmaxf(fmaxf(fabsf(q.x), fabsf(q.y)), fmaxf(fabsf(q.z), fabsf(q.w))));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    // E = floor(log2 m) - 13, within [-110, 110] (2^±E normal floats).
    const int E = (m > 0.0f && m <= 3.402823466e38f) ? min(max(((__float_as_int(m) >> 23) & 0xFF) - 127 - 13, -110), 110) : 0;
    const float down = __int_as_float((127 - E) << 23);
    const float xa[4] = {p.x * down, p.y * down, p.z * down, p.w * down};
    const float xb[4] = {q.x * down, q.y * down, q.z * down, q.w * down};
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(xa[i], xb[i]);
        const __half2 l = __floats2half2_rn(xa[i] - __low2float(h), xb[i] - __high2float(h));
        memcpy(&hi[i], &h, 4);
        memcpy(&lo[i], &l, 4);
    }
    xs[lane] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    xs[32 + lane] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    return __int_as_float((127 + E) << 23);
}

static __device__ __forceinline__ float moe_tc_stage(const float* __restrict__ x, uint4* xs, int lane) {
    const float4 p = __ldg(reinterpret_cast<const float4*>(x) + 2 * lane);
    const float4 q = __ldg(reinterpret_cast<const float4*>(x) + 2 * lane + 1);
    return moe_tc_stage_v(p, q, xs, lane);
}

// One warp slice of a 16-row tile of NM matrices: matrix m's codes c[m][r][u]
// (r: rows g and g + 8) and scale pairs s[m][r][u] times the staged x (xs:
// hi, then lo), accumulated into d[m][word parity % NACC]. Lanes g >= 2 give
// the zero B columns.
template <int NM, int NACC>
static __device__ __forceinline__ void moe_tc_slice(const uint4 (&c)[NM][2][2], const uint32_t (&s)[NM][2][2],
                                                    const uint4* xs, int g, int t4, float (&d)[NM][NACC][4]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        __half2 sc[NM][2];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            sc[m][0] = moe_e4m3x2_x128(s[m][0][u]);
            sc[m][1] = moe_e4m3x2_x128(s[m][1][u]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4 b = g < 2 ? xs[32 * g + 16 * u + 4 * t4 + j] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                uint32_t a0[4], a1[4];
                moe_tc_word(moe_u4_word(c[m][0][u], j), j < 2 ? __low2half2(sc[m][0]) : __high2half2(sc[m][0]), a0);
                moe_tc_word(moe_u4_word(c[m][1][u], j), j < 2 ? __low2half2(sc[m][1]) : __high2half2(sc[m][1]), a1);
                moe_mma_f16(d[m][j % NACC], a0[0], a1[0], a0[1], a1[1], b.x, b.y);
                moe_mma_f16(d[m][j % NACC], a0[2], a1[2], a0[3], a1[3], b.z, b.w);
            }
        }
    }
}

// Row g's and row g + 8's sums of a slice's accumulators (lanes t4 == 0:
// columns 0 and 1, hi and lo), times pe.
template <int NACC>
static __device__ __forceinline__ float2 moe_tc_rows(const float (&d)[NACC][4], float pe) {
    float r0 = 0.0f, r1 = 0.0f;
#pragma unroll
    for (int k = 0; k < NACC; ++k) {
        r0 += d[k][0] + d[k][1];
        r1 += d[k][2] + d[k][3];
    }
    return make_float2(r0 * pe, r1 * pe);
}

// Rows g and g + 8 of a 16-row tile for one slice: codes at code_row_g (row
// g's slice start; row g + 8 is 8 code rows on), scales likewise.
static __device__ __forceinline__ void moe_tc_load(const uint8_t* codes, const uint8_t* scales, size_t code_row,
                                                   size_t scale_row, int t4, uint4 (&c)[2][2], uint32_t (&s)[2][2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            c[r][u] = moe_ld_codes_s(codes + r * 8 * code_row + 64 * u + 16 * t4);
            s[r][u] = moe_ld_scales2_s(scales + r * 8 * scale_row + 8 * u + 2 * t4);
        }
    }
}

// A gate/up warp's products of one slice (codes c, scale pairs sc of gate
// and up; x staged in xs, 2^E = pe) added to its row sums acc [gate, up][row
// g, g + 8] (lanes t4 == 0).
static __device__ __forceinline__ void moe_tc_gu_slice(const uint4 (&c)[2][2][2], const uint32_t (&sc)[2][2][2],
                                                       const uint4* xs, int g, int t4, float pe,
                                                       float (&acc)[2][2]) {
    float d[2][1][4] = {};
    moe_tc_slice<2, 1>(c, sc, xs, g, t4, d);
    __syncwarp();  // xs is rewritten by the next slice
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const float2 r = moe_tc_rows(d[m], pe);
        acc[m][0] += r.x;
        acc[m][1] += r.y;
    }
}

// The end of a gate/up block: the warps' row sums (acc) through red, added
// in warp order by 16 threads, times the global scales gsc (requested with
// cp.async), silu(gate) * up into act_row [16].
static __device__ __forceinline__ void moe_tc_gu_end(const float (&acc)[2][2], float (*red)[2][16],
                                                     const float* gsc, float* act_row, int warp, int g, int t4) {
    if (t4 == 0) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            red[warp][m][g] = acc[m][0];
            red[warp][m][g + 8] = acc[m][1];
        }
    }
    strata_cp_async_wait_all();  // gsc
    __syncthreads();
    if (threadIdx.x < 16) {
        float sg = 0.0f, su = 0.0f;
#pragma unroll
        for (int w = 0; w < MOE_TC_GU_WARPS; ++w) {
            sg += red[w][0][threadIdx.x];
            su += red[w][1][threadIdx.x];
        }
        const float gate = sg * (gsc[0] * 128.0f), up = su * (gsc[1] * 128.0f);
        act_row[threadIdx.x] = moe_silu(gate) * up;
    }
}

// A down warp's products of part q (codes c, scale pairs s; act staged in
// xs, 2^E = pe): its 16 row sums into red[q] (lanes t4 == 0).
static __device__ __forceinline__ void moe_tc_dn_part(const uint4 (&c)[1][2][2], const uint32_t (&s)[1][2][2],
                                                      const uint4* xs, int g, int t4, float pe, float* red_q) {
    float d[1][2][4] = {};
    moe_tc_slice<1, 2>(c, s, xs, g, t4, d);
    __syncwarp();  // xs is rewritten by the next part
    if (t4 == 0) {
        const float2 r = moe_tc_rows(d[0], pe);
        red_q[g] = r.x;
        red_q[g + 8] = r.y;
    }
}

// The end of a down block: 16 threads write out_row[i] (+ prev[i] when
// accumulating; prev requested with cp.async) = sum_j coefs[j] sum_p red[j
// parts + p][i], in (j, p) order.
static __device__ __forceinline__ void moe_tc_dn_end(const float (*red)[16], const float* coefs, const float* prev,
                                                     float* out_row, int top_k, int parts, int accumulate) {
    strata_cp_async_wait_all();  // prev
    __syncthreads();
    if (threadIdx.x < 16) {
        float v = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            float sj = 0.0f;
            for (int p = 0; p < parts; ++p) sj += red[j * parts + p][threadIdx.x];
            v = fmaf(coefs[j], sj, v);
        }
        out_row[threadIdx.x] = accumulate ? prev[threadIdx.x] + v : v;
    }
}

// grid (T * k, I / 16), block 256 (8 warps), no dynamic smem; H % 256 == 0,
// I % 16 == 0 (the wrapper's checks). Arguments and results as
// moe_gate_up_gemv. Block (a, y): rows 16 y .. 16 y + 15 of gate and up of
// assignment a's expert; warp w takes the K slices w, w + 8, ... and leaves
// its partial sums of the 32 rows in red; 32 threads add the 8 warps' in warp
// order (deterministic). For T = 1, I = 768 the grid is 384 blocks of 8
// warps, one wave at 3 blocks per SM (<= 85 registers), each warp with its
// 8 code loads (128 bytes a lane) issued before it stages its x slice.
extern "C" __global__ void __launch_bounds__(MOE_TC_GU_WARPS * 32, 3)
    moe_gate_up_gemv_tc(const float* __restrict__ x, const uint32_t* __restrict__ ids,
                        const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                        float* __restrict__ act, const float* __restrict__ logits, int num_experts,
                        int norm_topk_prob, uint32_t* __restrict__ ids_out, float* __restrict__ weights_out,
                        int late_trigger) {
    __shared__ uint4 xs[MOE_TC_GU_WARPS][64];
    __shared__ float red[MOE_TC_GU_WARPS][2][16];
    if (!late_trigger) strata_pdl_trigger();  // as moe_gate_up_gemv
    strata_pdl_wait();
    if (late_trigger) strata_pdl_trigger();
    const int a = blockIdx.x, t = a / top_k;
    const int H = (int)L.hidden, I = (int)L.intermediate;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const uint8_t* blob =
        moe_gemv_blob(ids, table, table_len, a, top_k, logits, num_experts, norm_topk_prob, ids_out, weights_out);
    float* act_row = act + (size_t)a * I + 16 * blockIdx.y;
    if (blob == nullptr) {  // a bad expert id: a visible NaN, never a wild read
        if (threadIdx.x < 16) act_row[threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    // The gate and up global scales, requested now into shared memory (read
    // after the reduction, they were a dependent read from HBM at the end of
    // the block's chain).
    __shared__ float gsc[2];
    if (threadIdx.x < 2) strata_cp_async4(gsc + threadIdx.x, reinterpret_cast<const float*>(blob + L.tail) + threadIdx.x);
    const size_t code_row = (size_t)H >> 1, scale_row = (size_t)H >> 4;
    const size_t row = (size_t)16 * blockIdx.y + g;
    float acc[2][2] = {};  // [gate, up][row g, g + 8], lanes t4 == 0
    for (int sl = warp; sl < H / MOE_TC_SLICE; sl += MOE_TC_GU_WARPS) {
        uint4 c[2][2][2];  // [gate, up][row g, g + 8][u]
        uint32_t sc[2][2][2];
        const size_t co = row * code_row + 128 * sl, so = row * scale_row + 16 * sl;
        moe_tc_load(blob + L.gate_codes + co, blob + L.gate_scales + so, code_row, scale_row, t4, c[0], sc[0]);
        moe_tc_load(blob + L.up_codes + co, blob + L.up_scales + so, code_row, scale_row, t4, c[1], sc[1]);
        const float pe = moe_tc_stage(x + (size_t)t * H + MOE_TC_SLICE * sl, xs[warp], lane);
        __syncwarp();
        moe_tc_gu_slice(c, sc, xs[warp], g, t4, pe, acc);
    }
    moe_tc_gu_end(acc, red, gsc, act_row, warp, g, t4);
}

// grid (T, H / 16), block 32 * min(top_k * I / 256, 24) threads, dynamic
// smem 1 KB a warp; I % 256 == 0, H % 16 == 0, top_k * I / 256 <=
// MOE_TC_DN_MAX_PARTS (the wrapper's checks). Arguments and results as
// moe_down_gemv. Block (t, y): output rows 16 y .. 16 y + 15 of token t; its
// warps take the (expert j, K slice p) parts q = j * (I / 256) + p in turn,
// each leaving the part's 16 sums (times 2^E) in red[q]; then 16 threads add
// sum_j coef_j sum_p red[j, p] in (j, p) order (deterministic), coef_j =
// w_j * g_down_j * 2^7 (NaN for a bad expert id: a visible NaN row, never a
// wild read).
extern "C" __global__ void __launch_bounds__(MOE_TC_DN_MAX_WARPS * 32)
    moe_down_gemv_tc(const float* __restrict__ act, const uint32_t* __restrict__ ids, const float* __restrict__ weights,
                     const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                     float* __restrict__ out, int accumulate, const float* __restrict__ logits, int num_experts,
                     int norm_topk_prob) {
    extern __shared__ uint4 moe_dn_tc_xs[];
    __shared__ float red[MOE_TC_DN_MAX_PARTS][16];
    __shared__ float coefs[MOE_MAX_TOP_K];
    __shared__ uint64_t blobs[MOE_MAX_TOP_K];
    __shared__ uint32_t ids_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    // Programmatic dependent launch: as moe_down_gemv, the routing and each
    // warp's first part of code loads come before the wait when the kernel
    // routes itself (logits non-null).
    strata_pdl_trigger();
    const int t = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate, parts = I / MOE_TC_SLICE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int nwarps = blockDim.x >> 5;
    moe_down_route(logits, num_experts, norm_topk_prob, ids, weights, nullptr, 0, t, top_k, ids_s, w_s, nullptr);
    if (threadIdx.x < top_k) {  // (one L2 read per expert: no table copy in shared memory)
        const int j = threadIdx.x;
        const uint32_t e = ids_s[j];
        const uint8_t* b = e < (uint32_t)table_len ? reinterpret_cast<const uint8_t*>(__ldg(table + e)) : nullptr;
        blobs[j] = reinterpret_cast<uint64_t>(b);
        coefs[j] = b != nullptr ? w_s[j] * moe_tail(b, L, 2) * 128.0f : __int_as_float(0x7fc00000);
    }
    __syncthreads();
    const size_t code_row = (size_t)I >> 1, scale_row = (size_t)I >> 4;
    const size_t row = (size_t)16 * blockIdx.y + g;
    uint4* xs = moe_dn_tc_xs + 64 * warp;
    uint4 c[1][2][2];
    uint32_t s[1][2][2];
    // Part q's codes and scales (none for a bad expert id: coefs[j] is NaN).
    auto load_part = [&](int q) {
        const int j = q / parts, p = q - j * parts;
        const uint8_t* blob = reinterpret_cast<const uint8_t*>(blobs[j]);
        if (blob != nullptr)
            moe_tc_load(blob + L.down_codes + row * code_row + 128 * p, blob + L.down_scales + row * scale_row + 16 * p,
                        code_row, scale_row, t4, c[0], s[0]);
    };
    if (warp < top_k * parts) load_part(warp);
    if (logits != nullptr) strata_pdl_wait();  // the act rows are the gate/up GEMV's
    // The residual a writer thread adds to, requested now (as moe_down_gemv).
    __shared__ float prev[16];
    if (accumulate && threadIdx.x < 16) strata_cp_async4(prev + threadIdx.x, out + (size_t)t * H + 16 * blockIdx.y + threadIdx.x);
    for (int q = warp; q < top_k * parts; q += nwarps) {
        const int j = q / parts, p = q - j * parts;
        if (blobs[j] == 0) {  // coefs[j] is NaN; red[q] is still read (0 * NaN: NaN)
            if (t4 == 0) red[q][g] = red[q][g + 8] = 0.0f;
            continue;
        }
        if (q != warp) load_part(q);  // the first part was loaded before the wait
        const float pe = moe_tc_stage(act + ((size_t)t * top_k + j) * I + MOE_TC_SLICE * p, xs, lane);
        __syncwarp();
        moe_tc_dn_part(c, s, xs, g, t4, pe, red[q]);
    }
    moe_tc_dn_end(red, coefs, prev, out + (size_t)t * H + 16 * blockIdx.y, top_k, parts, accumulate);
}

// ---------------------------------------------------------------------------
// 2c. The decode MoE of one token in one launch (sm_90+):
// moe_fused_decode_tc, the results of moe_gate_up_gemv_tc then
// moe_down_gemv_tc bit for bit (the same operations in the same order).
//
// Two kernels leave HBM idle between them: the down GEMV's blocks find room
// only as the gate/up GEMV's end, and only then request their weights. Here
// a thread-block cluster of CS blocks (8 or 16, one block an SM) takes one
// routed expert j (grid top_k * CS blocks), and block r of it computes act
// rows [r I / CS, (r + 1) I / CS) of expert j as moe_gate_up_gemv_tc does
// (tiles of 16 rows, warp w over the K slices w, w + 8, ..., the warps'
// sums in warp order); the cluster exchanges act through distributed shared
// memory (a hardware cluster barrier, not a kernel boundary), and block r
// computes its down rows [r H / CS, (r + 1) H / CS) over the expert's I as
// moe_down_gemv_tc does (a warp per (tile, K slice) part, the parts summed in
// slice order). Each warp streams its weights (its gate/up units, then its
// down parts) through its own ring of `ring` slots in shared memory with
// cp.async, one group a unit: right after the routing it requests its first
// `ring` units, and each unit it reads frees a slot for the next, so the
// down weights are in flight while the gate/up products run. The top_k
// experts' sums meet in `part [k, H]`: the last of the k clusters to finish
// a row range (an arrival counter per range: __threadfence, atomicAdd) adds
// them in j order, times coef_j = w_j * g_down_j * 2^7, onto the residual, as
// moe_down_gemv_tc's writer threads do, and resets the counter for the next
// launch. counters: CS u32, zero before the launch (and after it). The
// wrapper picks CS and ring so that the k clusters run at once.
//
// Without clusters (xchg non-null): `group` blocks an expert exchange act
// through global memory instead (each adds 1 to xchg[j] once its act rows
// are written and waits for the launch's `group` arrivals), with ring 0:
// every unit of a warp has its own place (`warp_bytes` a warp: its gate/up
// units, then its down parts at half a slot), all requested at once. The
// wrapper launches it so only where every block of the grid is resident at
// once, so the waits end.
//
// A unit (one 16-row tile of one 256-element K slice) in its slot: the codes
// of each matrix as 16 rows of 128 bytes, the 16-byte chunks of an odd row
// stored with their halves swapped (chunk c at c ^ 4), so the two rows a
// quarter warp reads (g and g + 1) fall in different banks; then each
// matrix's 16 rows of 16 scale bytes (gate/up: 4608 bytes, down: 2304).
// Bad expert id (past the table): that expert's act rows are NaN and its
// coefficient is NaN (the output rows are NaN, as moe_down_gemv_tc's).
#define MOE_FU_WARPS 8
#define MOE_FU_MAX_TG 6   // gate/up tiles a block: I <= 16 * CS * 6
#define MOE_FU_MAX_TD 16  // down tiles a block: H <= 16 * CS * 16
#define MOE_FU_MAX_P 4    // K slices of a down row: I <= 1024
#define MOE_FU_SLOT 4608  // a ring slot: a gate/up unit (a down unit uses half)

static __device__ __forceinline__ void moe_fu_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most `pending` of this thread's cp.async groups are in
// flight (more than 7 pending: waits for 7, which is stricter).
static __device__ __forceinline__ void moe_fu_wait(int pending) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    switch (pending < 0 ? 0 : pending) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
#endif
}

// One unit's requests by the 32 lanes of a warp: NM matrices of 16 rows
// (rows `row0 ..`, `row_bytes` of codes a row, `srow_bytes` of scales),
// K slice `sl` (128 code bytes and 16 scale bytes of each row).
template <int NM>
static __device__ __forceinline__ void moe_fu_request(uint8_t* unit, const uint8_t* blob, uint64_t codes0,
                                                      uint64_t codes1, uint64_t scales0, uint64_t scales1,
                                                      size_t row0, size_t row_bytes, size_t srow_bytes, int sl,
                                                      int lane, uint64_t pol) {
    constexpr int PER = 16 * 8 + 16;  // 16-byte chunks of one matrix
    for (int i = lane; i < NM * PER; i += 32) {
        const int m = i / PER, q = i - m * PER;
        if (q < 128) {
            const int row = q >> 3, c = q & 7;
            strata_cp_async16(unit + m * 2048 + row * 128 + 16 * (c ^ ((row & 1) << 2)),
                        blob + (m ? codes1 : codes0) + (row0 + row) * row_bytes + 128 * sl + 16 * c, pol);
        } else {
            const int row = q - 128;
            strata_cp_async16(unit + NM * 2048 + m * 256 + row * 16,
                        blob + (m ? scales1 : scales0) + (row0 + row) * srow_bytes + 16 * sl, pol);
        }
    }
    moe_fu_commit();
}

// Matrix m's codes and scale pairs of a unit for thread (g, t4): what
// moe_tc_load reads from the blob.
template <int NM>
static __device__ __forceinline__ void moe_fu_read(const uint8_t* unit, int m, int g, int t4, uint4 (&c)[2][2],
                                                   uint32_t (&s)[2][2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            c[r][u] = *reinterpret_cast<const uint4*>(unit + m * 2048 + row * 128 + 16 * ((4 * u + t4) ^ ((row & 1) << 2)));
            s[r][u] = *reinterpret_cast<const unsigned short*>(unit + NM * 2048 + m * 256 + row * 16 + 8 * u + 2 * t4);
        }
    }
}

// grid (top_k * CS), cluster (CS) with CS in {8, 16}, block MOE_FU_WARPS *
// 32, dynamic smem MOE_FU_WARPS * ring * MOE_FU_SLOT; one token; H and I
// multiples of 16 * CS and 256, TG = I / (16 CS) <= MOE_FU_MAX_TG, TD = H /
// (16 CS) <= MOE_FU_MAX_TD, I / 256 <= MOE_FU_MAX_P, E <= MOE_FUSED_ROUTE_MAX,
// ring >= 1 (the wrapper's checks). Routes the token from `logits`
// (moe_topk_warp_n: the ids and weights moe_route_topk gives), publishes
// them (ids_out, weights_out), writes act [k, I] as moe_gate_up_gemv_tc,
// and out [H] (+)= the experts' sum as moe_down_gemv_tc.
extern "C" __global__ void __launch_bounds__(MOE_FU_WARPS * 32, 1)
    moe_fused_decode_tc(const float* __restrict__ x, const uint64_t* __restrict__ table, int table_len,
                        MoeBlobLayout L, int top_k, const float* __restrict__ logits, int num_experts,
                        int norm_topk_prob, uint32_t* __restrict__ ids_out, float* __restrict__ weights_out,
                        float* __restrict__ act, float* __restrict__ part, unsigned int* __restrict__ counters,
                        float* __restrict__ out, int accumulate, int ring, int group,
                        unsigned int* __restrict__ xchg, int warp_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t moe_fu_smem[];
    __shared__ uint4 xs[MOE_FU_WARPS][64];
    __shared__ float red_gu[MOE_FU_MAX_TG][MOE_FU_WARPS][2][16];
    __shared__ float red_dn[MOE_FU_MAX_TD][MOE_FU_MAX_P][16];
    __shared__ __align__(16) float act_mine[MOE_FU_MAX_TG * 16];
    __shared__ __align__(16) float act_all[MOE_FU_MAX_P * MOE_TC_SLICE];
    __shared__ uint64_t table_s[MOE_FUSED_ROUTE_MAX];
    __shared__ uint32_t ids_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    __shared__ float gdn[MOE_MAX_TOP_K];
    __shared__ float gsc[2];
    __shared__ float prev[MOE_FU_MAX_TD * 16];
    __shared__ int last;
    // The next kernel touches only constants before its own wait.
    strata_pdl_trigger();
    strata_pdl_wait();
    // xchg null: clusters of CS blocks; else `group` blocks an expert without clusters.
    const int H = (int)L.hidden, I = (int)L.intermediate, CS = xchg != nullptr ? group : (int)strata_cluster_size();
    const int TG = I / (16 * CS), S = H / MOE_TC_SLICE, TD = H / (16 * CS), P = I / MOE_TC_SLICE;
    const unsigned int r = xchg != nullptr ? blockIdx.x % CS : strata_cluster_rank();
    const int j = blockIdx.x / CS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;

    // The routing (warp 0) while the other warps copy the table.
    const int table_s_len = min(table_len, MOE_FUSED_ROUTE_MAX);
    if (threadIdx.x < 32) {
        if (num_experts <= 128)
            moe_topk_warp_n<4>(logits, num_experts, top_k, norm_topk_prob, ids_s, w_s);
        else
            moe_topk_warp_n<MOE_FUSED_ROUTE_MAX / 32>(logits, num_experts, top_k, norm_topk_prob, ids_s, w_s);
    } else {
        for (int i = threadIdx.x - 32; i < table_s_len; i += blockDim.x - 32) table_s[i] = __ldg(table + i);
    }
    __syncthreads();
    const uint8_t* blob = moe_table_blob(ids_s[j], table, table_len, table_s);
    if (r == 0 && threadIdx.x == 0) {
        ids_out[j] = ids_s[j];
        weights_out[j] = w_s[j];
    }
    // Every expert's down global scale, for the last arriver (waited for
    // before the merge).
    if (threadIdx.x < top_k) {
        const uint8_t* b = moe_table_blob(ids_s[threadIdx.x], table, table_len, table_s);
        if (b != nullptr) strata_cp_async4(gdn + threadIdx.x, reinterpret_cast<const float*>(b + L.tail) + 2);
    }
    // This warp's units, in the order it consumes them: the gate/up units
    // (tile tg, slice sl) tile by tile with its slices sl = warp, warp + 8,
    // ... in order, then the down parts q = warp, warp + 8, ... (tile q / P,
    // slice q % P). Unit u sits in ring slot u % ring of this warp; unit
    // u + ring is requested once unit u is read.
    const int nsl = (S - warp + MOE_FU_WARPS - 1) / MOE_FU_WARPS;
    const int gu_units = TG * nsl;
    const int units = blob != nullptr ? gu_units + (TD * P - warp + MOE_FU_WARPS - 1) / MOE_FU_WARPS : 0;
    // ring 0: every unit has its own place (gate/up units, then the down
    // parts at half the size), all requested at once.
    uint8_t* slots = moe_fu_smem + (size_t)warp * warp_bytes;
    const uint64_t pol = strata_stream_policy();
    auto slot_of = [&](int u) -> uint8_t* {
        if (ring == 0)
            return slots + (u < gu_units ? (size_t)u * MOE_FU_SLOT
                                         : (size_t)gu_units * MOE_FU_SLOT + (size_t)(u - gu_units) * (MOE_FU_SLOT / 2));
        return slots + (size_t)(u % ring) * MOE_FU_SLOT;
    };
    auto request = [&](int u) {
        uint8_t* slot = slot_of(u);
        if (u < gu_units) {
            const int tg = u / nsl, sl = warp + MOE_FU_WARPS * (u - tg * nsl);
            moe_fu_request<2>(slot, blob, L.gate_codes, L.up_codes, L.gate_scales, L.up_scales,
                              (size_t)r * 16 * TG + 16 * tg, (size_t)H >> 1, (size_t)H >> 4, sl, lane, pol);
        } else {
            const int q = warp + MOE_FU_WARPS * (u - gu_units), td = q / P, p = q - td * P;
            moe_fu_request<1>(slot, blob, L.down_codes, 0, L.down_scales, 0, (size_t)r * 16 * TD + 16 * td,
                              (size_t)I >> 1, (size_t)I >> 4, p, lane, pol);
        }
    };
    if (blob != nullptr) {
        // In this thread's first group: the global scales (the act rows) and
        // the residual (the last arriver's rows).
        if (threadIdx.x < 2) strata_cp_async4(gsc + threadIdx.x, reinterpret_cast<const float*>(blob + L.tail) + threadIdx.x);
        if (accumulate)
            for (int i = threadIdx.x; i < 16 * TD; i += blockDim.x) strata_cp_async4(prev + i, out + (size_t)r * 16 * TD + i);
    }
    int issued = 0;
    for (; issued < units && (ring == 0 || issued < ring); ++issued) request(issued);
    // Unit u's slot: waited for, then (once every lane has read it) refilled.
    auto take = [&](int u) -> const uint8_t* {
        moe_fu_wait(issued - 1 - u);
        __syncwarp();
        return slot_of(u);
    };
    auto refill = [&]() {
        __syncwarp();
        if (issued < units) request(issued++);
    };

    // Gate/up: tile by tile, this warp's slices in order (moe_gate_up_gemv_tc's sums).
    int u = 0;
    for (int tg = 0; tg < TG; ++tg) {
        float acc[2][2] = {};
        if (blob != nullptr) {
            for (int sl = warp; sl < S; sl += MOE_FU_WARPS, ++u) {
                const uint8_t* unit = take(u);
                uint4 c[2][2][2];
                uint32_t sc[2][2][2];
                moe_fu_read<2>(unit, 0, g, t4, c[0], sc[0]);
                moe_fu_read<2>(unit, 1, g, t4, c[1], sc[1]);
                refill();
                const float pe = moe_tc_stage(x + MOE_TC_SLICE * sl, xs[warp], lane);
                __syncwarp();
                float d[2][1][4] = {};
                moe_tc_slice<2, 1>(c, sc, xs[warp], g, t4, d);
                __syncwarp();
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const float2 rr = moe_tc_rows(d[m], pe);
                    acc[m][0] += rr.x;
                    acc[m][1] += rr.y;
                }
            }
        }
        if (t4 == 0) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                red_gu[tg][warp][m][g] = acc[m][0];
                red_gu[tg][warp][m][g + 8] = acc[m][1];
            }
        }
    }
    moe_fu_wait(issued - gu_units);  // every gate/up group (with gsc and prev) of this thread
    __syncthreads();
    if (threadIdx.x < 16 * TG) {
        const int tg = threadIdx.x >> 4, row = threadIdx.x & 15;
        float a = __int_as_float(0x7fc00000);
        if (blob != nullptr) {
            float sg = 0.0f, su = 0.0f;
#pragma unroll
            for (int w = 0; w < MOE_FU_WARPS; ++w) {
                sg += red_gu[tg][w][0][row];
                su += red_gu[tg][w][1][row];
            }
            const float gate = sg * (gsc[0] * 128.0f), up = su * (gsc[1] * 128.0f);
            a = moe_silu(gate) * up;
        }
        act_mine[threadIdx.x] = a;
        act[(size_t)j * I + (size_t)r * 16 * TG + threadIdx.x] = a;
    }
    if (xchg != nullptr) {
        // The expert's act rows through global memory: every block of the
        // expert adds 1 to xchg[j] once its rows are written, then waits
        // until this launch's `group` arrivals are in (xchg[j] only grows:
        // this launch's target is the next multiple of group; compared as a
        // wrapping difference). Every block of the grid is resident at once
        // (the wrapper's check), so the wait ends.
        if (threadIdx.x < 16 * TG) __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned int old = atomicAdd(xchg + j, 1u);
            const unsigned int target = old - old % (unsigned int)group + (unsigned int)group;
            unsigned int now;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(xchg + j) : "memory");
            } while ((int)(now - target) < 0);
            __threadfence();
        }
        __syncthreads();
        for (int i = threadIdx.x; i < I; i += blockDim.x) act_all[i] = __ldcg(act + (size_t)j * I + i);
    } else {
        // The cluster's act rows -> act_all (each block's rows from its shared memory).
        strata_cluster_arrive();
        strata_cluster_wait();
        for (int i = threadIdx.x; i < I; i += blockDim.x) {
            const int q = i / (16 * TG);
            act_all[i] = strata_cluster_ld_f32(act_mine + (i - q * 16 * TG), (unsigned int)q);
        }
        strata_cluster_arrive();  // done reading the others' act_mine (waited for before exit)
    }
    __syncthreads();

    // Down: this warp's parts (moe_down_gemv_tc's part sums).
    for (int q = warp; q < TD * P; q += MOE_FU_WARPS, ++u) {
        const int td = q / P, p = q - td * P;
        float2 rr = make_float2(0.0f, 0.0f);
        if (blob != nullptr) {
            const uint8_t* unit = take(u);
            uint4 c[1][2][2];
            uint32_t s[1][2][2];
            moe_fu_read<1>(unit, 0, g, t4, c[0], s[0]);
            refill();
            const float4* a4 = reinterpret_cast<const float4*>(act_all + MOE_TC_SLICE * p);
            const float pe = moe_tc_stage_v(a4[2 * lane], a4[2 * lane + 1], xs[warp], lane);
            __syncwarp();
            float d[1][2][4] = {};
            moe_tc_slice<1, 2>(c, s, xs[warp], g, t4, d);
            __syncwarp();
            rr = moe_tc_rows(d[0], pe);
        }
        if (t4 == 0) {
            red_dn[td][p][g] = rr.x;
            red_dn[td][p][g + 8] = rr.y;
        }
    }
    __syncthreads();
    if (threadIdx.x < 16 * TD) {
        const int td = threadIdx.x >> 4, row = threadIdx.x & 15;
        float sj = 0.0f;
        for (int p = 0; p < P; ++p) sj += red_dn[td][p][row];
        part[(size_t)j * H + (size_t)r * 16 * TD + threadIdx.x] = sj;
        __threadfence();
    }
    strata_cp_async_wait_all();  // gdn (the threads of a block without an expert committed no group)
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int arrived = atomicAdd(counters + r, 1u);
        last = arrived == (unsigned int)top_k - 1u;
        if (last) counters[r] = 0u;
    }
    __syncthreads();
    if (last && threadIdx.x < 16 * TD) {
        __threadfence();
        const size_t o = (size_t)r * 16 * TD + threadIdx.x;
        float v = 0.0f;
        for (int jj = 0; jj < top_k; ++jj) {
            // coef_j = w_j * g_down_j * 2^7 (NaN for an id past the table), as moe_down_gemv_tc.
            const bool ok = ids_s[jj] < (uint32_t)table_len;
            const float coef = ok ? w_s[jj] * gdn[jj] * 128.0f : __int_as_float(0x7fc00000);
            v = fmaf(coef, __ldcg(part + (size_t)jj * H + o), v);
        }
        out[o] = accumulate ? prev[threadIdx.x] + v : v;
    }
    if (xchg == nullptr) strata_cluster_wait();
#endif
}

// ---------------------------------------------------------------------------
// 2d. The decode GEMVs with their weights staged in shared memory (sm_80+):
// moe_gate_up_gemv_tc_st and moe_down_gemv_tc_st, the results of
// moe_gate_up_gemv_tc and moe_down_gemv_tc bit for bit (the same products
// in the same order), for the routed decode path only.
//
// The register-staged pair cannot overlap: the gate/up GEMV's loads in
// flight live in registers (3 blocks an SM hold ~all of them), so the down
// GEMV's blocks find room only as the gate/up blocks end, and route and
// request their weights after that. Here every warp requests its weights
// with cp.async into shared memory (2c's units: moe_fu_request /
// moe_fu_read), so both kernels hold few registers: a down block fits
// beside three gate/up blocks, routes the token from the logits and
// requests ALL of its weights before its programmatic wait, while the
// gate/up GEMV still runs (the gate/up GEMV triggers after its wait, as for
// moe_down_gemv_tc's routing before the wait).
#define MOE_DN_ST_WARPS 8

// grid (T * k, I / 16), block 256, dynamic smem MOE_TC_GU_WARPS *
// ceil(H / 256 / MOE_TC_GU_WARPS) * MOE_FU_SLOT; as moe_gate_up_gemv_tc
// (H % 256 == 0, I % 16 == 0), routed (logits non-null) or not.
extern "C" __global__ void __launch_bounds__(MOE_TC_GU_WARPS * 32, 4)
    moe_gate_up_gemv_tc_st(const float* __restrict__ x, const uint32_t* __restrict__ ids,
                           const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                           float* __restrict__ act, const float* __restrict__ logits, int num_experts,
                           int norm_topk_prob, uint32_t* __restrict__ ids_out, float* __restrict__ weights_out,
                           int late_trigger) {
    extern __shared__ __align__(16) uint8_t moe_gu_st[];  // [warp][its n-th slice] units
    __shared__ uint4 xs[MOE_TC_GU_WARPS][64];
    __shared__ float red[MOE_TC_GU_WARPS][2][16];
    __shared__ float gsc[2];
    if (!late_trigger) strata_pdl_trigger();
    strata_pdl_wait();
    if (late_trigger) strata_pdl_trigger();
    const int a = blockIdx.x, t = a / top_k;
    const int H = (int)L.hidden, I = (int)L.intermediate;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const uint8_t* blob =
        moe_gemv_blob(ids, table, table_len, a, top_k, logits, num_experts, norm_topk_prob, ids_out, weights_out);
    float* act_row = act + (size_t)a * I + 16 * blockIdx.y;
    if (blob == nullptr) {
        if (threadIdx.x < 16) act_row[threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    if (threadIdx.x < 2) strata_cp_async4(gsc + threadIdx.x, reinterpret_cast<const float*>(blob + L.tail) + threadIdx.x);
    const size_t code_row = (size_t)H >> 1, scale_row = (size_t)H >> 4;
    const int nsl = H / MOE_TC_SLICE, per_warp = (nsl + MOE_TC_GU_WARPS - 1) / MOE_TC_GU_WARPS;
    const int mine = (nsl - warp + MOE_TC_GU_WARPS - 1) / MOE_TC_GU_WARPS;  // this warp's slices
    uint8_t* units = moe_gu_st + (size_t)warp * per_warp * MOE_FU_SLOT;
    const uint64_t pol = strata_stream_policy();
    for (int n = 0; n < mine; ++n)
        moe_fu_request<2>(units + n * MOE_FU_SLOT, blob, L.gate_codes, L.up_codes, L.gate_scales, L.up_scales,
                          (size_t)16 * blockIdx.y, code_row, scale_row, warp + n * MOE_TC_GU_WARPS, lane, pol);
    float acc[2][2] = {};
    for (int n = 0; n < mine; ++n) {
        const int sl = warp + n * MOE_TC_GU_WARPS;
        const float pe = moe_tc_stage(x + (size_t)t * H + MOE_TC_SLICE * sl, xs[warp], lane);
        moe_fu_wait(mine - n - 1);
        __syncwarp();  // every lane's copies of unit n, and xs
        uint4 c[2][2][2];
        uint32_t sc[2][2][2];
        moe_fu_read<2>(units + n * MOE_FU_SLOT, 0, g, t4, c[0], sc[0]);
        moe_fu_read<2>(units + n * MOE_FU_SLOT, 1, g, t4, c[1], sc[1]);
        moe_tc_gu_slice(c, sc, xs[warp], g, t4, pe, acc);
    }
    moe_tc_gu_end(acc, red, gsc, act_row, warp, g, t4);
}

// grid (T, H / 16), block MOE_DN_ST_WARPS * 32, dynamic smem top_k * (I /
// 256) * MOE_FU_SLOT / 2 (a unit per (expert, K slice) part); as
// moe_down_gemv_tc with logits non-null (the wrapper's checks: I % 256 ==
// 0, H % 16 == 0, top_k * I / 256 <= MOE_TC_DN_MAX_PARTS, E <=
// MOE_FUSED_ROUTE_MAX). Routes the token and requests every part of its
// rows before the programmatic wait; warp w then takes parts w, w + 8, ...
// as moe_down_gemv_tc's warps do.
extern "C" __global__ void __launch_bounds__(MOE_DN_ST_WARPS * 32, 4)
    moe_down_gemv_tc_st(const float* __restrict__ act, const uint32_t* __restrict__ ids,
                        const float* __restrict__ weights, const uint64_t* __restrict__ table, int table_len,
                        MoeBlobLayout L, int top_k, float* __restrict__ out, int accumulate,
                        const float* __restrict__ logits, int num_experts, int norm_topk_prob) {
    extern __shared__ __align__(16) uint8_t moe_dn_st[];  // units [q]
    __shared__ uint4 xs_all[MOE_DN_ST_WARPS][64];
    __shared__ float red[MOE_TC_DN_MAX_PARTS][16];
    __shared__ float coefs[MOE_MAX_TOP_K];
    __shared__ uint64_t blobs[MOE_MAX_TOP_K];
    __shared__ uint32_t ids_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    __shared__ float prev[16];
    strata_pdl_trigger();
    const int t = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate, parts = I / MOE_TC_SLICE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    constexpr int unit_bytes = MOE_FU_SLOT / 2;
    moe_down_route(logits, num_experts, norm_topk_prob, ids, weights, nullptr, 0, t, top_k, ids_s, w_s, nullptr);
    if (threadIdx.x < top_k) {
        const int j = threadIdx.x;
        const uint32_t e = ids_s[j];
        const uint8_t* b = e < (uint32_t)table_len ? reinterpret_cast<const uint8_t*>(__ldg(table + e)) : nullptr;
        blobs[j] = reinterpret_cast<uint64_t>(b);
        coefs[j] = b != nullptr ? w_s[j] * moe_tail(b, L, 2) * 128.0f : __int_as_float(0x7fc00000);
    }
    __syncthreads();
    const size_t code_row = (size_t)I >> 1, scale_row = (size_t)I >> 4;
    const int nparts = top_k * parts;
    const uint64_t pol = strata_stream_policy();
    int mine = 0;  // this warp's parts (one cp.async group each; none requested for a bad id)
    for (int q = warp; q < nparts; q += MOE_DN_ST_WARPS, ++mine) {
        const int j = q / parts, p = q - j * parts;
        const uint8_t* blob = reinterpret_cast<const uint8_t*>(blobs[j]);
        if (blob != nullptr)
            moe_fu_request<1>(moe_dn_st + (size_t)q * unit_bytes, blob, L.down_codes, L.down_codes, L.down_scales,
                              L.down_scales, (size_t)16 * blockIdx.y, code_row, scale_row, p, lane, pol);
        else
            moe_fu_commit();  // an empty group keeps the count
    }
    strata_pdl_wait();  // the act rows are the gate/up GEMV's
    if (accumulate && threadIdx.x < 16) strata_cp_async4(prev + threadIdx.x, out + (size_t)t * H + 16 * blockIdx.y + threadIdx.x);
    uint4* xs = xs_all[warp];
    int n = 0;
    for (int q = warp; q < nparts; q += MOE_DN_ST_WARPS, ++n) {
        const int j = q / parts, p = q - j * parts;
        if (blobs[j] == 0) {  // coefs[j] is NaN; red[q] is still read (0 * NaN: NaN)
            if (t4 == 0) red[q][g] = red[q][g + 8] = 0.0f;
            continue;
        }
        const float pe = moe_tc_stage(act + ((size_t)t * top_k + j) * I + MOE_TC_SLICE * p, xs, lane);
        moe_fu_wait(mine - n - 1);
        __syncwarp();  // every lane's copies of part q, and xs
        uint4 c[1][2][2];
        uint32_t s[1][2][2];
        moe_fu_read<1>(moe_dn_st + (size_t)q * unit_bytes, 0, g, t4, c[0], s[0]);
        moe_tc_dn_part(c, s, xs, g, t4, pe, red[q]);
    }
    moe_tc_dn_end(red, coefs, prev, out + (size_t)t * H + 16 * blockIdx.y, top_k, parts, accumulate);
}

// ---------------------------------------------------------------------------
// 3. Prefill: grouping by expert (one block, deterministic, no atomics).
// Assignment a = t * k + j. Outputs: offsets[E+1] (exclusive scan of the
// counts), tile_offsets[E+1] (exclusive scan of ceil(count / MOE_TILE_M)),
// rows[slot] = a sorted by (expert, a), slot_of[a], slot_expert[slot].
// Each of the 16 warps owns a contiguous range of assignments: it counts its
// range per expert, a scan gives every (warp, expert) its first slot, then the
// warp walks its range again and places each assignment at its rank.
// dynamic smem: (16 + 1) * E * 4 bytes.
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(MOE_GROUP_WARPS * 32)
    moe_group_by_expert(const uint32_t* __restrict__ ids, int n, int num_experts, uint32_t* __restrict__ offsets,
                        uint32_t* __restrict__ tile_offsets, uint32_t* __restrict__ rows,
                        uint32_t* __restrict__ slot_of, uint32_t* __restrict__ slot_expert) {
    extern __shared__ uint32_t moe_hist[];  // [16][E] per-warp counts, then per-warp cursors
    uint32_t* base = moe_hist + MOE_GROUP_WARPS * num_experts;  // [E] first slot of each expert
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = num_experts;
    for (int i = tid; i < MOE_GROUP_WARPS * E; i += blockDim.x) moe_hist[i] = 0;
    __syncthreads();
    const int seg = (n + MOE_GROUP_WARPS - 1) / MOE_GROUP_WARPS;
    const int lo = min(n, warp * seg), hi = min(n, lo + seg);
    uint32_t* my = moe_hist + warp * E;
    for (int b = lo; b < hi; b += 32) {
        const int i = b + lane;
        const uint32_t e = i < hi ? ids[i] : 0xffffffffu;
        const uint32_t peers = __match_any_sync(0xffffffffu, e);
        if (e < (uint32_t)E && lane == __ffs(peers) - 1) my[e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // Per expert: the warps' counts become their starting ranks; base = count.
    for (int e = tid; e < E; e += blockDim.x) {
        uint32_t s = 0;
        for (int w = 0; w < MOE_GROUP_WARPS; ++w) {
            const uint32_t c = moe_hist[w * E + e];
            moe_hist[w * E + e] = s;
            s += c;
        }
        base[e] = s;
    }
    __syncthreads();
    // Exclusive scans over experts by warp 0 (each lane a contiguous run of experts).
    if (warp == 0) {
        const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
        uint32_t cnt = 0, tiles = 0;
        for (int e = e0; e < e1; ++e) {
            cnt += base[e];
            tiles += (base[e] + MOE_TILE_M - 1) / MOE_TILE_M;
        }
        uint32_t ic = cnt, it = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t vc = __shfl_up_sync(0xffffffffu, ic, o), vt = __shfl_up_sync(0xffffffffu, it, o);
            if (lane >= o) {
                ic += vc;
                it += vt;
            }
        }
        uint32_t oc = ic - cnt, ot = it - tiles;
        for (int e = e0; e < e1; ++e) {
            const uint32_t c = base[e];
            offsets[e] = oc;
            tile_offsets[e] = ot;
            base[e] = oc;
            oc += c;
            ot += (c + MOE_TILE_M - 1) / MOE_TILE_M;
        }
        if (lane == 31) {
            offsets[E] = ic;
            tile_offsets[E] = it;
        }
    }
    __syncthreads();
    for (int b = lo; b < hi; b += 32) {
        const int i = b + lane;
        const uint32_t e = i < hi ? ids[i] : 0xffffffffu;
        const uint32_t peers = __match_any_sync(0xffffffffu, e);
        const uint32_t lt = (1u << lane) - 1u;
        uint32_t slot = 0;
        if (e < (uint32_t)E) slot = base[e] + my[e] + __popc(peers & lt);
        __syncwarp();
        if (e < (uint32_t)E) {
            rows[slot] = (uint32_t)i;
            slot_of[i] = slot;
            slot_expert[slot] = e;
            if (lane == __ffs(peers) - 1) my[e] += __popc(peers);
        } else if (i < hi) {
            slot_of[i] = 0xffffffffu;  // a bad expert id: moe_combine writes NaN for its token
        }
        __syncwarp();
    }
}

// ---------------------------------------------------------------------------
// Simple grouped expert FFN (SIMT, the decode GEMV code per slot): the
// reference path on sm_75 and the fallback. Slots in [0, n).
// ---------------------------------------------------------------------------

// grid (n slots, ceil(I / 16)), block 256, dynamic smem H * 4. act[slot] =
// silu(gate_e x_t) * (up_e x_t) with a = rows[slot], t = a / k, e = slot_expert[slot];
// filled = &offsets[E], the number of slots placed.
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32)
    moe_gate_up_grouped_simple(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                               const uint32_t* __restrict__ slot_expert, const uint32_t* __restrict__ filled,
                               const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                               float* __restrict__ act) {
    extern __shared__ float4 moe_gus_xs[];
    const int s = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate;
    if ((uint32_t)s >= *filled) return;  // slots past offsets[E] (only with ids >= E) hold nothing
    const int t = (int)(rows[s] / (uint32_t)top_k);
    const uint32_t e = slot_expert[s];
    float* act_row = act + (size_t)s * I;
    const int row0 = (blockIdx.y * MOE_GU_WARPS + (threadIdx.x >> 5)) * MOE_GEMV_ROWS;
    if (e >= (uint32_t)table_len) {
        if ((threadIdx.x & 31) < MOE_GEMV_ROWS && row0 + (threadIdx.x & 31) < I) act_row[row0 + (threadIdx.x & 31)] = __int_as_float(0x7fc00000);
        return;
    }
    moe_stage_row(moe_gus_xs, x + (size_t)t * H, H);
    __syncthreads();
    if (row0 >= I) return;
    moe_gate_up_rows(moe_gus_xs, reinterpret_cast<const uint8_t*>(table[e]), L, row0, act_row);
}

// grid (n slots, ceil(H / 16)), block 128, dynamic smem I * 4. y[slot] = g_down * down_e act[slot].
extern "C" __global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
    moe_down_grouped_simple(const float* __restrict__ act, const uint32_t* __restrict__ slot_expert,
                            const uint32_t* __restrict__ filled, const uint64_t* __restrict__ table, int table_len,
                            MoeBlobLayout L, float* __restrict__ y) {
    extern __shared__ float4 moe_downs_acts[];
    const int s = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate;
    if ((uint32_t)s >= *filled) return;
    const uint32_t e = slot_expert[s];
    const int row0 = (blockIdx.y * MOE_DOWN_WARPS + (threadIdx.x >> 5)) * MOE_DOWN_ROWS_PER_WARP;
    const int lane = threadIdx.x & 31, row = row0 + lane / MOE_DOWN_LANES;
    float* yrow = y + (size_t)s * H;
    if (e >= (uint32_t)table_len) {
        if (lane % MOE_DOWN_LANES == 0 && row < H) yrow[row] = __int_as_float(0x7fc00000);
        return;
    }
    moe_stage_row(moe_downs_acts, act + (size_t)s * I, I);
    __shared__ const uint8_t* blob[1];
    __shared__ float cf[1];
    if (threadIdx.x == 0) {
        blob[0] = reinterpret_cast<const uint8_t*>(table[e]);
        cf[0] = moe_tail(blob[0], L, 2) * 16384.0f;
    }
    __syncthreads();
    if (row0 >= H) return;
    const float res = moe_down_row(moe_downs_acts, blob, cf, 1, L, row0, 0, 4);
    if (lane % MOE_DOWN_LANES == 0 && row < H) yrow[row] = res;
}

// ---------------------------------------------------------------------------
// Generic path: hidden and intermediate any positive multiples of 16 (the
// NVFP4 block). The kernels above read 32-element chunks with 16-byte code
// loads, so they need the dimension they reduce over (H for gate/up, I for
// down) to be a multiple of 32: a code row is cols / 2 bytes, only 8-byte
// aligned when cols = 16 (mod 32). These kernels read one 16-element block at
// a time: 8 code bytes (one uint2) and its one scale byte. Same grids, same
// NaN rows for bad ids, f32 throughout; the wrappers choose them when the
// reduced dimension is not a multiple of 32 (the fixture models' 48 and 16).
// ---------------------------------------------------------------------------

static __device__ __forceinline__ uint2 moe_ld_codes8(const uint8_t* p) {
    return __ldg(reinterpret_cast<const uint2*>(p));
}
static __device__ __forceinline__ uint32_t moe_ld_scale1(const uint8_t* p) { return (uint32_t)__ldg(p); }

// One 16-element block of an NVFP4 row (codes c: element i is nibble i of
// c.x, then of c.y; block scale byte s) dotted with its 16 x values (4 float4
// xq[0..4)), added to acc in units of 2^-14.
static __device__ __forceinline__ float moe_block16_dot(uint2 c, uint32_t s, const float4 (&xq)[4], float acc) {
    float p = moe_dot8(c.x, xq[0], xq[1], 0.0f);
    p = moe_dot8(c.y, xq[2], xq[3], p);
    return fmaf(p, moe_e4m3_to_f32(s), acc);
}

// Copies a row of n floats (n % 16 == 0) into shared memory "block
// transposed": float4 q (0..3) of 16-element block b goes to dst[q * (n / 16)
// + b], so lane b reading its block's q-th float4 is conflict-free.
static __device__ __forceinline__ void moe_stage_row16(float4* dst, const float* src, int n) {
    const int nblk = n >> 4;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (int f = threadIdx.x; f < (n >> 2); f += blockDim.x) dst[(f & 3) * nblk + (f >> 2)] = s4[f];
}

static __device__ __forceinline__ void moe_load_xq16(const float4* xs, int nblk, int b, float4 (&xq)[4]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) xq[q] = xs[q * nblk + b];
}

// moe_gate_up_rows with 16-element blocks: rows [row0, row0 + 2) of
// silu(gate x) * (up x), x staged by moe_stage_row16; one warp, lane b takes
// blocks b, b + 32, ... Rows >= I are computed on row I - 1 and not written.
static __device__ __forceinline__ void moe_gate_up_rows16(const float4* xs, const uint8_t* blob,
                                                          const MoeBlobLayout& L, int row0, float* act_row) {
    const int H = (int)L.hidden, I = (int)L.intermediate, nblk = H >> 4, lane = threadIdx.x & 31;
    const size_t code_row = (size_t)H >> 1, scale_row = (size_t)H >> 4;
    size_t co[MOE_GEMV_ROWS], so[MOE_GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
        const size_t row = (size_t)min(row0 + r, I - 1);
        co[r] = row * code_row;
        so[r] = row * scale_row;
    }
    const uint8_t* gc = blob + L.gate_codes;
    const uint8_t* gs = blob + L.gate_scales;
    const uint8_t* uc = blob + L.up_codes;
    const uint8_t* us = blob + L.up_scales;
    float ag[MOE_GEMV_ROWS] = {}, au[MOE_GEMV_ROWS] = {};
    for (int b = lane; b < nblk; b += 32) {
        uint2 cg[MOE_GEMV_ROWS], cu[MOE_GEMV_ROWS];
        uint32_t sg[MOE_GEMV_ROWS], su[MOE_GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
            cg[r] = moe_ld_codes8(gc + co[r] + 8 * (size_t)b);
            cu[r] = moe_ld_codes8(uc + co[r] + 8 * (size_t)b);
            sg[r] = moe_ld_scale1(gs + so[r] + b);
            su[r] = moe_ld_scale1(us + so[r] + b);
        }
        float4 xq[4];
        moe_load_xq16(xs, nblk, b, xq);
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
            ag[r] = moe_block16_dot(cg[r], sg[r], xq, ag[r]);
            au[r] = moe_block16_dot(cu[r], su[r], xq, au[r]);
        }
    }
    const float gg = moe_tail(blob, L, 0) * 16384.0f, gu = moe_tail(blob, L, 1) * 16384.0f;
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; ++r) {
        const float g = moe_warp_sum(ag[r]) * gg;
        const float u = moe_warp_sum(au[r]) * gu;
        if (lane == 0 && row0 + r < I) act_row[row0 + r] = moe_silu(g) * u;
    }
}

// moe_down_row with 16-element blocks: row row0 + lane / 8 of
// sum_j coef[j] * (down_{blob j} act_j), j = 0 .. nexp - 1 in order, act_j
// staged by moe_stage_row16 at acts + j * I / 4; coef[j] holds
// w_j * g_down_j * 2^14. One warp, 8 lanes a row (lane % 8 takes blocks
// lane % 8, + 8, ...); the result is valid in lanes with lane % 8 == 0.
static __device__ __forceinline__ float moe_down_row16(const float4* acts, const uint8_t* const* blobs,
                                                       const float* coef, int nexp, const MoeBlobLayout& L,
                                                       int row0) {
    const int H = (int)L.hidden, I = (int)L.intermediate, nblk = I >> 4, lane = threadIdx.x & 31;
    const int sub = lane & (MOE_DOWN_LANES - 1);
    const size_t row = (size_t)min(row0 + lane / MOE_DOWN_LANES, H - 1);
    const size_t code_off = row * ((size_t)I >> 1), scale_off = row * ((size_t)I >> 4);
    float acc = 0.0f;
    for (int j = 0; j < nexp; ++j) {
        const uint8_t* bc = blobs[j] + L.down_codes + code_off;
        const uint8_t* bs = blobs[j] + L.down_scales + scale_off;
        const float4* xa = acts + (size_t)j * (I >> 2);
        float part = 0.0f;
        for (int b = sub; b < nblk; b += MOE_DOWN_LANES) {
            const uint2 c = moe_ld_codes8(bc + 8 * (size_t)b);
            const uint32_t s = moe_ld_scale1(bs + b);
            float4 xq[4];
            moe_load_xq16(xa, nblk, b, xq);
            part = moe_block16_dot(c, s, xq, part);
        }
        acc = fmaf(coef[j], part, acc);
    }
#pragma unroll
    for (int o = MOE_DOWN_LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// moe_gate_up_gemv for H % 16 == 0. grid (T * k, ceil(I / 16)), block 256,
// dynamic smem H * 4.
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32)
    moe_gate_up_gemv16(const float* __restrict__ x, const uint32_t* __restrict__ ids,
                       const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                       float* __restrict__ act) {
    extern __shared__ float4 moe_gu16_xs[];
    const int a = blockIdx.x, t = a / top_k;
    const int H = (int)L.hidden, I = (int)L.intermediate, lane = threadIdx.x & 31;
    const uint32_t e = ids[a];
    float* act_row = act + (size_t)a * I;
    const int row0 = (blockIdx.y * MOE_GU_WARPS + (threadIdx.x >> 5)) * MOE_GEMV_ROWS;
    if (e >= (uint32_t)table_len) {  // a bad expert id: a visible NaN, never a wild read
        if (lane < MOE_GEMV_ROWS && row0 + lane < I) act_row[row0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    moe_stage_row16(moe_gu16_xs, x + (size_t)t * H, H);
    __syncthreads();
    if (row0 >= I) return;
    moe_gate_up_rows16(moe_gu16_xs, reinterpret_cast<const uint8_t*>(table[e]), L, row0, act_row);
}

// moe_down_gemv for I % 16 == 0. grid (T, ceil(H / 16)), block 128 (4 warps
// of 4 rows), dynamic smem k * I * 4. out[t] (+)= sum_j weights[t*k+j] *
// down_{ids[t*k+j]} act[t*k+j], j in order.
extern "C" __global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
    moe_down_gemv16(const float* __restrict__ act, const uint32_t* __restrict__ ids,
                    const float* __restrict__ weights, const uint64_t* __restrict__ table, int table_len,
                    MoeBlobLayout L, int top_k, float* __restrict__ out, int accumulate) {
    extern __shared__ float4 moe_down16_acts[];
    __shared__ const uint8_t* blobs[MOE_MAX_TOP_K];
    __shared__ float coef[MOE_MAX_TOP_K];
    __shared__ int bad;
    const int t = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    if (threadIdx.x < top_k) {
        const int a = t * top_k + threadIdx.x;
        const uint32_t e = ids[a];
        if (e < (uint32_t)table_len) {
            const uint8_t* b = reinterpret_cast<const uint8_t*>(table[e]);
            blobs[threadIdx.x] = b;
            coef[threadIdx.x] = weights[a] * moe_tail(b, L, 2) * 16384.0f;
        } else {
            blobs[threadIdx.x] = nullptr;
            coef[threadIdx.x] = 0.0f;
            bad = 1;
        }
    }
    for (int j = 0; j < top_k; ++j)
        moe_stage_row16(moe_down16_acts + (size_t)j * (I >> 2), act + ((size_t)t * top_k + j) * I, I);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.y * MOE_DOWN_WARPS + (threadIdx.x >> 5)) * MOE_DOWN_ROWS_PER_WARP;
    const int row = row0 + lane / MOE_DOWN_LANES;
    if (row0 >= H) return;
    float res = 0.0f;
    if (!bad) res = moe_down_row16(moe_down16_acts, blobs, coef, top_k, L, row0);
    if (lane % MOE_DOWN_LANES == 0 && row < H) {
        float* orow = out + (size_t)t * H;
        orow[row] = bad ? __int_as_float(0x7fc00000) : accumulate ? orow[row] + res : res;
    }
}

// moe_gate_up_grouped_simple for H % 16 == 0. grid (n slots, ceil(I / 16)),
// block 256, dynamic smem H * 4.
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32)
    moe_gate_up_grouped16(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                          const uint32_t* __restrict__ slot_expert, const uint32_t* __restrict__ filled,
                          const uint64_t* __restrict__ table, int table_len, MoeBlobLayout L, int top_k,
                          float* __restrict__ act) {
    extern __shared__ float4 moe_gu16g_xs[];
    const int s = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate, lane = threadIdx.x & 31;
    if ((uint32_t)s >= *filled) return;  // slots past offsets[E] (only with ids >= E) hold nothing
    const int t = (int)(rows[s] / (uint32_t)top_k);
    const uint32_t e = slot_expert[s];
    float* act_row = act + (size_t)s * I;
    const int row0 = (blockIdx.y * MOE_GU_WARPS + (threadIdx.x >> 5)) * MOE_GEMV_ROWS;
    if (e >= (uint32_t)table_len) {
        if (lane < MOE_GEMV_ROWS && row0 + lane < I) act_row[row0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    moe_stage_row16(moe_gu16g_xs, x + (size_t)t * H, H);
    __syncthreads();
    if (row0 >= I) return;
    moe_gate_up_rows16(moe_gu16g_xs, reinterpret_cast<const uint8_t*>(table[e]), L, row0, act_row);
}

// moe_down_grouped_simple for I % 16 == 0. grid (n slots, ceil(H / 16)),
// block 128, dynamic smem I * 4. y[slot] = g_down * down_e act[slot].
extern "C" __global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
    moe_down_grouped16(const float* __restrict__ act, const uint32_t* __restrict__ slot_expert,
                       const uint32_t* __restrict__ filled, const uint64_t* __restrict__ table, int table_len,
                       MoeBlobLayout L, float* __restrict__ y) {
    extern __shared__ float4 moe_down16g_acts[];
    __shared__ const uint8_t* blob[1];
    __shared__ float cf[1];
    const int s = blockIdx.x, H = (int)L.hidden, I = (int)L.intermediate;
    if ((uint32_t)s >= *filled) return;
    const uint32_t e = slot_expert[s];
    const int row0 = (blockIdx.y * MOE_DOWN_WARPS + (threadIdx.x >> 5)) * MOE_DOWN_ROWS_PER_WARP;
    const int lane = threadIdx.x & 31, row = row0 + lane / MOE_DOWN_LANES;
    float* yrow = y + (size_t)s * H;
    if (e >= (uint32_t)table_len) {
        if (lane % MOE_DOWN_LANES == 0 && row < H) yrow[row] = __int_as_float(0x7fc00000);
        return;
    }
    moe_stage_row16(moe_down16g_acts, act + (size_t)s * I, I);
    if (threadIdx.x == 0) {
        blob[0] = reinterpret_cast<const uint8_t*>(table[e]);
        cf[0] = moe_tail(blob[0], L, 2) * 16384.0f;
    }
    __syncthreads();
    if (row0 >= H) return;
    const float res = moe_down_row16(moe_down16g_acts, blob, cf, 1, L, row0);
    if (lane % MOE_DOWN_LANES == 0 && row < H) yrow[row] = res;
}

// ---------------------------------------------------------------------------
// Combine: out[t] (+)= sum_j w[t*k+j] * y[slot_of[t*k+j]], j in order.
// grid (T, ceil(H / 4 / 256)), block 256; H % 4 == 0.
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ y, const uint32_t* __restrict__ slot_of, const float* __restrict__ weights,
                int hidden, int top_k, float* __restrict__ out, int accumulate) {
    const int t = blockIdx.x, f = blockIdx.y * blockDim.x + threadIdx.x;
    if (4 * f >= hidden) return;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < top_k; ++j) {
        const uint32_t s = slot_of[(size_t)t * top_k + j];
        const float w = weights[(size_t)t * top_k + j];
        if (s == 0xffffffffu) {
            acc.x = acc.y = acc.z = acc.w = __int_as_float(0x7fc00000);
            continue;
        }
        const float4 v = reinterpret_cast<const float4*>(y + (size_t)s * hidden)[f];
        acc.x = fmaf(w, v.x, acc.x);
        acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z);
        acc.w = fmaf(w, v.w, acc.w);
    }
    float4* o = reinterpret_cast<float4*>(out + (size_t)t * hidden) + f;
    if (accumulate) {
        const float4 p = *o;
        acc.x += p.x;
        acc.y += p.y;
        acc.z += p.z;
        acc.w += p.w;
    }
    *o = acc;
}

// ---------------------------------------------------------------------------
// Grouped GEMM on tensor cores (sm_80+): one block per (row tile of one
// expert, feature tile). Rows are the slots [offsets[e], offsets[e+1]) of
// expert e, MOE_TILE_M at a time; the block finds its (expert, tile) from
// tile_offsets on the device (binary search), blocks past the last tile exit.
// Per K step of 64: the A tile (64 rows x 64, f32 -> bf16) and the W tile
// (256 smem rows x 64: gate rows then up rows for gate/up, 256 down rows for
// down) are decoded in registers (e2m1 * e4m3 is exact in bf16) into shared
// memory, then 8 warps (2 x 4) run mma.m16n8k16 bf16 with f32 accumulators,
// each warp 32 rows x 8 n8-tiles. The next K step's global loads are issued
// before the MMAs of the current one. Global scales go in the f32 epilogue.
// SPLIT (the *_split kernels, GroupedPrecision::Split): the A operand as bf16
// hi + lo, two MMA passes per K step into the same f32 accumulators: the hi
// tile is stored with W and the lo parts packed into 8 registers, the next K
// step's loads are issued, the hi pass runs, then the lo parts overwrite the
// A tile and the lo pass runs (both passes overlap the loads). Same shared
// memory as the bf16 kernels (a second A tile would pass the 48 KB of static
// shared memory). Inf in x gives NaN there (inf - inf).
// ---------------------------------------------------------------------------

#define MOE_MMA_BK 64
#define MOE_MMA_WROWS 256
#define MOE_MMA_PITCH (MOE_MMA_BK + 8)  // bf16 elements per smem row (+16 bytes: no ldmatrix bank conflicts)
#define MOE_MMA_THREADS 256

static __device__ __attribute__((unused)) __forceinline__ uint32_t moe_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// The low parts of the bf16 hi/lo split of (lo, hi): bf16(x - float(bf16(x))) for each
// (x - hi is exact in f32; hi + lo carries ~16 significant bits of x).
static __device__ __attribute__((unused)) __forceinline__ uint32_t moe_bf16x2_rem(float lo, float hi) {
    const float2 h = __bfloat1622float2(__floats2bfloat162_rn(lo, hi));
    return moe_bf16x2(lo - h.x, hi - h.y);
}

// 8 E2M1 codes (word w, element i = nibble i) times scale sf (= e4m3 * 2^14)
// as 8 bf16 in element order.
static __device__ __attribute__((unused)) __forceinline__ uint4 moe_dequant8_bf16(uint32_t w, float sf) {
    const float2 p0 = moe_e2m1x2_scaled(w);        // elements 0, 4
    const float2 p1 = moe_e2m1x2_scaled(w >> 4);   // 1, 5
    const float2 p2 = moe_e2m1x2_scaled(w >> 8);   // 2, 6
    const float2 p3 = moe_e2m1x2_scaled(w >> 12);  // 3, 7
    uint4 r;
    r.x = moe_bf16x2(p0.x * sf, p1.x * sf);
    r.y = moe_bf16x2(p2.x * sf, p3.x * sf);
    r.z = moe_bf16x2(p0.y * sf, p1.y * sf);
    r.w = moe_bf16x2(p2.y * sf, p3.y * sf);
    return r;
}

static __device__ __attribute__((unused)) __forceinline__ void moe_ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#if __CUDA_ARCH__ >= 800
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

static __device__ __attribute__((unused)) __forceinline__ void moe_mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// GU = true: act[slot, n0 + f] = silu(g_gate * gate . x_t) * (g_up * up . x_t), 128 features per block.
// GU = false: y[slot, n0 + f] = g_down * down . act[slot], 256 features per block.
template <bool GU, bool SPLIT>
static __device__ __forceinline__ void moe_grouped_mma(const float* __restrict__ a_src,
                                                       const uint32_t* __restrict__ rows,
                                                       const uint32_t* __restrict__ offsets,
                                                       const uint32_t* __restrict__ tile_offsets, int num_experts,
                                                       const uint64_t* __restrict__ table, const MoeBlobLayout& L,
                                                       int top_k, float* __restrict__ dst) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) __nv_bfloat16 As[MOE_TILE_M * MOE_MMA_PITCH];
    __shared__ __align__(16) __nv_bfloat16 Ws[MOE_MMA_WROWS * MOE_MMA_PITCH];
    const int tile = blockIdx.x;
    if (tile >= (int)tile_offsets[num_experts]) return;
    int lo = 0, hi = num_experts;  // the expert e with tile_offsets[e] <= tile < tile_offsets[e + 1]
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((int)tile_offsets[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    const int e = lo;
    const int m0 = (int)offsets[e] + (tile - (int)tile_offsets[e]) * MOE_TILE_M;
    const int m_valid = min(MOE_TILE_M, (int)offsets[e + 1] - m0);
    const int H = (int)L.hidden, I = (int)L.intermediate;
    const int K = GU ? H : I, N = GU ? I : H;
    const int n0 = blockIdx.y * (GU ? MOE_MMA_WROWS / 2 : MOE_MMA_WROWS);
    const uint8_t* blob = reinterpret_cast<const uint8_t*>(table[e]);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;

    // This thread's A row (16 floats per K step) and W rows (one 32-element chunk of each).
    const int ar = tid >> 2, ac = (tid & 3) * 16;
    const float* arow = nullptr;
    if (ar < m_valid) {
        const int s = m0 + ar;
        arow = GU ? a_src + (size_t)(rows[s] / (uint32_t)top_k) * K : a_src + (size_t)s * K;
    }
    const int wr = tid >> 1, wc = tid & 1;
    const int f0 = n0 + wr, f1 = GU ? n0 + wr : n0 + 128 + wr;
    const bool v0 = f0 < N, v1 = f1 < N;
    const size_t crow = (size_t)K >> 1, srow = (size_t)K >> 4;
    const uint8_t* c0p = blob + (GU ? L.gate_codes : L.down_codes) + (size_t)(v0 ? f0 : 0) * crow;
    const uint8_t* s0p = blob + (GU ? L.gate_scales : L.down_scales) + (size_t)(v0 ? f0 : 0) * srow;
    // down: row f1 = f0 + 128 (only read when valid, so also f0 is).
    const uint8_t* c1p = GU ? blob + L.up_codes + (size_t)(v1 ? f1 : 0) * crow : c0p + 128 * crow;
    const uint8_t* s1p = GU ? blob + L.up_scales + (size_t)(v1 ? f1 : 0) * srow : s0p + 128 * srow;

    float4 ra[4];
    uint4 rc0, rc1;
    uint32_t rs0, rs1;
    auto load = [&](int kt) {
        const int ka = kt * MOE_MMA_BK + ac;
#pragma unroll
        for (int q = 0; q < 4; ++q)
            ra[q] = (arow && ka < K) ? __ldg(reinterpret_cast<const float4*>(arow + ka) + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        const int kw = kt * MOE_MMA_BK + wc * 32;
        const bool kv = kw < K;
        rc0 = (v0 && kv) ? moe_ld_codes(c0p + (kw >> 1)) : make_uint4(0, 0, 0, 0);
        rs0 = (v0 && kv) ? moe_ld_scales2(s0p + (kw >> 4)) : 0u;
        rc1 = (v1 && kv) ? moe_ld_codes(c1p + (kw >> 1)) : make_uint4(0, 0, 0, 0);
        rs1 = (v1 && kv) ? moe_ld_scales2(s1p + (kw >> 4)) : 0u;
    };
    auto store = [&]() {
        uint4* pa = reinterpret_cast<uint4*>(As + ar * MOE_MMA_PITCH + ac);
        pa[0] = make_uint4(moe_bf16x2(ra[0].x, ra[0].y), moe_bf16x2(ra[0].z, ra[0].w), moe_bf16x2(ra[1].x, ra[1].y),
                           moe_bf16x2(ra[1].z, ra[1].w));
        pa[1] = make_uint4(moe_bf16x2(ra[2].x, ra[2].y), moe_bf16x2(ra[2].z, ra[2].w), moe_bf16x2(ra[3].x, ra[3].y),
                           moe_bf16x2(ra[3].z, ra[3].w));
        uint4* pw0 = reinterpret_cast<uint4*>(Ws + wr * MOE_MMA_PITCH + wc * 32);
        uint4* pw1 = reinterpret_cast<uint4*>(Ws + (128 + wr) * MOE_MMA_PITCH + wc * 32);
        const float s00 = moe_e4m3_to_f32(rs0 & 0xFFu) * 16384.0f, s01 = moe_e4m3_to_f32((rs0 >> 8) & 0xFFu) * 16384.0f;
        const float s10 = moe_e4m3_to_f32(rs1 & 0xFFu) * 16384.0f, s11 = moe_e4m3_to_f32((rs1 >> 8) & 0xFFu) * 16384.0f;
        pw0[0] = moe_dequant8_bf16(rc0.x, s00);
        pw0[1] = moe_dequant8_bf16(rc0.y, s00);
        pw0[2] = moe_dequant8_bf16(rc0.z, s01);
        pw0[3] = moe_dequant8_bf16(rc0.w, s01);
        pw1[0] = moe_dequant8_bf16(rc1.x, s10);
        pw1[1] = moe_dequant8_bf16(rc1.y, s10);
        pw1[2] = moe_dequant8_bf16(rc1.z, s11);
        pw1[3] = moe_dequant8_bf16(rc1.w, s11);
    };
    // SPLIT: this thread's A chunk as the lo parts, packed before the hi pass (8 registers, not ra's 16).
    uint4 rl0, rl1;
    auto split_lo = [&]() {
        rl0 = make_uint4(moe_bf16x2_rem(ra[0].x, ra[0].y), moe_bf16x2_rem(ra[0].z, ra[0].w),
                         moe_bf16x2_rem(ra[1].x, ra[1].y), moe_bf16x2_rem(ra[1].z, ra[1].w));
        rl1 = make_uint4(moe_bf16x2_rem(ra[2].x, ra[2].y), moe_bf16x2_rem(ra[2].z, ra[2].w),
                         moe_bf16x2_rem(ra[3].x, ra[3].y), moe_bf16x2_rem(ra[3].z, ra[3].w));
    };
    auto store_lo = [&]() {
        uint4* pa = reinterpret_cast<uint4*>(As + ar * MOE_MMA_PITCH + ac);
        pa[0] = rl0;
        pa[1] = rl1;
    };

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < 8; ++nj)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][nj][c] = 0.0f;

    // acc += A tile (As) x W tile (Ws)^T over one K step.
    // SPLIT runs two passes per K step: unrolled by 2 (sm_90 ptxas: 32 spilled bytes, loop-invariant
    // blob pointers reloaded once per K step; the full unroll spills 56).
    constexpr int kUnroll = SPLIT ? 2 : MOE_MMA_BK / 16;
    auto mma_pass = [&]() {
#pragma unroll kUnroll
        for (int kk = 0; kk < MOE_MMA_BK / 16; ++kk) {
            uint32_t af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                moe_ldmatrix_x4(af[mi], As + (wm * 32 + mi * 16 + (lane & 15)) * MOE_MMA_PITCH + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int nbase = GU ? (p < 2 ? 32 * wn + 16 * p : 128 + 32 * wn + 16 * (p - 2)) : 64 * wn + 16 * p;
                uint32_t bf[4];
                moe_ldmatrix_x4(bf, Ws + (nbase + (lane & 7) + (lane >> 4) * 8) * MOE_MMA_PITCH + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    moe_mma_bf16(acc[mi][2 * p], af[mi], bf[0], bf[1]);
                    moe_mma_bf16(acc[mi][2 * p + 1], af[mi], bf[2], bf[3]);
                }
            }
        }
    };

    const int nk = (K + MOE_MMA_BK - 1) / MOE_MMA_BK;
    load(0);
    for (int kt = 0; kt < nk; ++kt) {
        __syncthreads();  // the previous step's MMAs are done with the tiles
        store();
        __syncthreads();
        if (SPLIT) {
            split_lo();  // from ra before the next step's loads overwrite it
            if (kt + 1 < nk) load(kt + 1);
            mma_pass();       // hi
            __syncthreads();  // the hi pass is done with As
            store_lo();
            __syncthreads();
            mma_pass();  // lo
        } else {
            if (kt + 1 < nk) load(kt + 1);
            mma_pass();
        }
    }

    const int g = lane >> 2, q = lane & 3;
    if (GU) {
        const float gg = moe_tail(blob, L, 0), gu = moe_tail(blob, L, 1);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm * 32 + mi * 16 + g + 8 * h;
                if (r >= m_valid) continue;
                float* orow = dst + (size_t)(m0 + r) * I;
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) {
                    const int f = n0 + 32 * wn + 8 * nj + 2 * q;
                    if (f < N) {
                        const float a0 = moe_silu(acc[mi][nj][2 * h] * gg) * (acc[mi][nj + 4][2 * h] * gu);
                        const float a1 = moe_silu(acc[mi][nj][2 * h + 1] * gg) * (acc[mi][nj + 4][2 * h + 1] * gu);
                        *reinterpret_cast<float2*>(orow + f) = make_float2(a0, a1);
                    }
                }
            }
    } else {
        const float gd = moe_tail(blob, L, 2);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm * 32 + mi * 16 + g + 8 * h;
                if (r >= m_valid) continue;
                float* orow = dst + (size_t)(m0 + r) * H;
#pragma unroll
                for (int nj = 0; nj < 8; ++nj) {
                    const int f = n0 + 64 * wn + 8 * nj + 2 * q;
                    if (f < N) *reinterpret_cast<float2*>(orow + f) = make_float2(acc[mi][nj][2 * h] * gd, acc[mi][nj][2 * h + 1] * gd);
                }
            }
    }
#endif
}

// grid (max row tiles, ceil(I / 128)), block 256. act [n, I] in slot order.
extern "C" __global__ void __launch_bounds__(MOE_MMA_THREADS, 2)
    moe_gate_up_grouped_mma(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                            const uint32_t* __restrict__ offsets, const uint32_t* __restrict__ tile_offsets,
                            int num_experts, const uint64_t* __restrict__ table, MoeBlobLayout L, int top_k,
                            float* __restrict__ act) {
    moe_grouped_mma<true, false>(x, rows, offsets, tile_offsets, num_experts, table, L, top_k, act);
}

// grid (max row tiles, ceil(H / 256)), block 256. y [n, H] in slot order.
extern "C" __global__ void __launch_bounds__(MOE_MMA_THREADS, 2)
    moe_down_grouped_mma(const float* __restrict__ act, const uint32_t* __restrict__ offsets,
                         const uint32_t* __restrict__ tile_offsets, int num_experts,
                         const uint64_t* __restrict__ table, MoeBlobLayout L, float* __restrict__ y) {
    moe_grouped_mma<false, false>(act, nullptr, offsets, tile_offsets, num_experts, table, L, 1, y);
}

// moe_gate_up_grouped_mma with x as bf16 hi + lo (GroupedPrecision::Split); same grid and arguments.
extern "C" __global__ void __launch_bounds__(MOE_MMA_THREADS, 2)
    moe_gate_up_grouped_mma_split(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                  const uint32_t* __restrict__ offsets, const uint32_t* __restrict__ tile_offsets,
                                  int num_experts, const uint64_t* __restrict__ table, MoeBlobLayout L, int top_k,
                                  float* __restrict__ act) {
    moe_grouped_mma<true, true>(x, rows, offsets, tile_offsets, num_experts, table, L, top_k, act);
}

// moe_down_grouped_mma with act as bf16 hi + lo (GroupedPrecision::Split); same grid and arguments.
extern "C" __global__ void __launch_bounds__(MOE_MMA_THREADS, 2)
    moe_down_grouped_mma_split(const float* __restrict__ act, const uint32_t* __restrict__ offsets,
                               const uint32_t* __restrict__ tile_offsets, int num_experts,
                               const uint64_t* __restrict__ table, MoeBlobLayout L, float* __restrict__ y) {
    moe_grouped_mma<false, true>(act, nullptr, offsets, tile_offsets, num_experts, table, L, 1, y);
}
