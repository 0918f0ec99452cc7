// attention kernels (see kernels/README.md for conventions).
//
// KV cache on the device (src/backend/cuda/attention.rs, DeviceKv): K and V
// each [capacity, kv_heads, head_dim], row-major, position-major.
//   int8: i8 values plus one f32 scale per (position, kv_head) block:
//         scale = amax / 127, value = rint(x / scale) clamped to [-127, 127],
//         scale 0 -> all values 0; dequantized value = (float)value * scale.
//   bf16: __nv_bfloat16 values (round to nearest even), no scales.
// Queries and outputs are f32 [T, heads * head_dim]; query head h reads kv
// head h / (heads / kv_heads); row t sits at position start_pos + t and sees
// keys 0 ..= start_pos + t. Scores: dot(q, k) * head_dim^-0.5, softmax with
// expf, max-subtracted, f32 throughout.
//
// Kernels:
//   attn_kv_append_i8 / attn_kv_append_bf16: write T rows into the cache.
//   attn_simt_hd{16,32,64,128,256}_{i8,bf16}_q{8,32,64}: tiled flash attention
//     (online softmax) on CUDA cores. One block = one kv head x a tile of up
//     to MAXQ query vectors (row-major over (row, head of the group), so the
//     heads of one GQA group share every K/V load) x one split of the key
//     range. With one split it writes the normalized output; with several
//     (flash-decoding) it writes per-split partials (max, sum, acc) that
//     attn_combine merges in split order (deterministic).
//   attn_combine: merges split partials.
//   attn_mma_* (prefill) and attn_dec_* (a few rows): tensor cores, sm_80+.
//   attn_row_hd{HD}_{i8,bf16}_g{1,2,4}: one row (batch-1 decode), f32
//     on CUDA cores, the split merge fused in (see its section).
//   attn_qkv_prep_{i8,bf16}: q/k norm + RoPE, gate split and KV append of
//     one qkv projection in one launch (see its section).
//
// Step pointer (CUDA-graph replay of a decode step): every kernel takes a
// last argument `const int* step`. Null: the launch's own start_pos and
// chunk (and for the split kernels: one output when gridDim.x == 1). Non-null:
// start_pos = step[0], chunk = step[1] are read on the device; the grid keeps
// a fixed split count, splits past the key range are empty and write neutral
// partials (max -inf, sum 0, acc 0) that attn_combine skips, and when the
// whole key range fits split 0 (start_pos + rows <= chunk) split 0 writes the
// normalized output, the other blocks exit and attn_combine does nothing:
// the same operations, in the same order, as the null-step launch with
// ceil(kend / chunk) splits (bit-identical results).
#include "common.cuh"

#define ATTN_NEG_INF (-__int_as_float(0x7f800000))

// ---------------------------------------------------------------- append --

// One (position, kv head) block of head_dim values -> the cache, by one warp
// (the single definition of the cache's rounding: attn_kv_append_* and
// attn_qkv_prep_* both call it). int8: amax over the block, scale = amax /
// 127, value = rint(x / scale) clamped to +-127 (0 when the scale is 0);
// bf16: round to nearest even.
static __device__ __forceinline__ void attn_append_row(const float* src, int8_t* __restrict__ cache,
                                                       float* __restrict__ scales, size_t block, int head_dim,
                                                       int lane) {
    float amax = 0.0f;
    for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(src[d]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax / 127.0f;
    int8_t* dst = cache + block * (size_t)head_dim;
    for (int d = lane; d < head_dim; d += 32) {
        float qv = 0.0f;
        if (scale > 0.0f) qv = fminf(fmaxf(rintf(src[d] / scale), -127.0f), 127.0f);
        dst[d] = (int8_t)(int)qv;
    }
    if (lane == 0) scales[block] = scale;
}

static __device__ __forceinline__ void attn_append_row(const float* src, __nv_bfloat16* __restrict__ cache, float*,
                                                       size_t block, int head_dim, int lane) {
    __nv_bfloat16* dst = cache + block * (size_t)head_dim;
    for (int d = lane; d < head_dim; d += 32) dst[d] = __float2bfloat16_rn(src[d]);
}

// One warp per (row, kv head, K or V): amax over head_dim, scale, quantize.
extern "C" __global__ void attn_kv_append_i8(const float* __restrict__ k, const float* __restrict__ v,
                                             int8_t* __restrict__ kc, int8_t* __restrict__ vc,
                                             float* __restrict__ ks, float* __restrict__ vs, int start_pos,
                                             int rows, int kv_heads, int head_dim, const int* __restrict__ step) {
    if (step != nullptr) start_pos = step[0];
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)rows * kv_heads * 2) return;
    const int which = (int)(warp & 1);  // 0: K, 1: V
    const long long rh = warp >> 1;     // t * kv_heads + h
    const float* src = (which ? v : k) + rh * head_dim;
    const long long t = rh / kv_heads, h = rh % kv_heads;
    const size_t block = (size_t)(start_pos + t) * (size_t)kv_heads + (size_t)h;
    attn_append_row(src, which ? vc : kc, which ? vs : ks, block, head_dim, lane);
}

// Elementwise: row t of k/v -> position start_pos + t (rows are contiguous).
extern "C" __global__ void attn_kv_append_bf16(const float* __restrict__ k, const float* __restrict__ v,
                                               __nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc,
                                               int start_pos, int rows, int kv_dim, const int* __restrict__ step) {
    if (step != nullptr) start_pos = step[0];
    const size_t n = (size_t)rows * (size_t)kv_dim;
    const size_t base = (size_t)start_pos * (size_t)kv_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        kc[base + i] = __float2bfloat16_rn(k[i]);
        vc[base + i] = __float2bfloat16_rn(v[i]);
    }
}

// --------------------------------------------------------------- helpers --

// 16 bytes of cache values -> floats (16 int8 times scale, or 8 bf16).
// Four int8 (one word, element b in byte b) -> exact floats without I2F
// (quarter rate): byte ^ 0x80 = v + 128 as u in [0, 255]; the float with
// bits 0x4B0000uu is 2^23 + u, so subtracting 2^23 + 128 gives v exactly.
static __device__ __forceinline__ void attn_i8x4_to_f32(uint32_t w, float* out) {
    const uint32_t x = w ^ 0x80808080u;
    out[0] = __int_as_float((int)__byte_perm(x, 0x4B000000u, 0x7540)) - 8388736.0f;
    out[1] = __int_as_float((int)__byte_perm(x, 0x4B000000u, 0x7541)) - 8388736.0f;
    out[2] = __int_as_float((int)__byte_perm(x, 0x4B000000u, 0x7542)) - 8388736.0f;
    out[3] = __int_as_float((int)__byte_perm(x, 0x4B000000u, 0x7543)) - 8388736.0f;
}

static __device__ __forceinline__ void attn_dequant16(const int8_t*, uint4 raw, float scale, float* out) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
        attn_i8x4_to_f32(w[i], f);
#pragma unroll
        for (int b = 0; b < 4; ++b) out[i * 4 + b] = f[b] * scale;
    }
}

static __device__ __forceinline__ void attn_dequant16(const __nv_bfloat16*, uint4 raw, float, float* out) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[i * 2] = __uint_as_float(w[i] << 16);
        out[i * 2 + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

static __device__ __forceinline__ float attn_scale_of(const int8_t*, const float* scales, size_t block) {
    return scales[block];
}
static __device__ __forceinline__ float attn_scale_of(const __nv_bfloat16*, const float*, size_t) { return 1.0f; }

static __device__ __forceinline__ float attn_warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
static __device__ __forceinline__ float attn_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ------------------------------------------------------ SIMT flash kernel --

#define ATTN_SIMT_THREADS 256
#define ATTN_SIMT_TK 32  // keys per tile (one per lane in the score phase)

// Dynamic shared memory (floats) of attn_simt<HD, MAXQ>: mirrored by the
// Rust wrapper (simt_smem_bytes).
template <int HD, int MAXQ>
struct AttnSimtSmem {
    static constexpr int kQ = MAXQ * HD;
    static constexpr int kK = ATTN_SIMT_TK * (HD + 4);  // +4: conflict-free float4 rows
    static constexpr int kV = ATTN_SIMT_TK * HD;
    static constexpr int kP = MAXQ * (ATTN_SIMT_TK + 1);
    static constexpr int kFloats = kQ + kK + kV + kP + 2 * MAXQ;
};

// grid: (splits, kv_heads, query tiles); block: ATTN_SIMT_THREADS.
// chunk: keys per split (a multiple of ATTN_SIMT_TK); split s covers keys
// [s * chunk, (s + 1) * chunk) cut at the tile's causal end.
template <int HD, typename KV, int MAXQ>
static __device__ __forceinline__ void attn_simt(const float* __restrict__ q, const KV* __restrict__ kc,
                                                 const KV* __restrict__ vc, const float* __restrict__ ks,
                                                 const float* __restrict__ vs, float* __restrict__ out,
                                                 float* __restrict__ part_acc, float* __restrict__ part_ml, int heads,
                                                 int kv_heads, int start_pos, int rows, int chunk, float scale,
                                                const int* __restrict__ step) {
    constexpr int TK = ATTN_SIMT_TK;
    constexpr int NW = ATTN_SIMT_THREADS / 32;
    static_assert(MAXQ % NW == 0, "MAXQ must be a multiple of the warp count");
    constexpr int QW = MAXQ / NW;  // queries per warp in the score phase
    constexpr int DQ = HD / 4;     // float4 columns of a row
    constexpr int NG = ATTN_SIMT_THREADS / DQ;
    constexpr int QPT = (MAXQ + NG - 1) / NG;  // queries per thread in the PV phase
    constexpr int EPV = 16 / (int)sizeof(KV);  // cache values per 16-byte vector
    constexpr int VR = HD / EPV;               // vectors per cache row
    using S = AttnSimtSmem<HD, MAXQ>;
    if (step != nullptr) {
        start_pos = step[0];
        chunk = step[1];
    }
    // One normalized output from split 0, or partials of every split (see the file comment).
    const bool single = step != nullptr ? start_pos + rows <= chunk : gridDim.x == 1;
    if (single && blockIdx.x != 0) return;  // (step only) empty splits of a one-split range

    extern __shared__ float4 attn_smem4[];
    float* smem = reinterpret_cast<float*>(attn_smem4);
    float* q_s = smem;
    float* k_s = q_s + S::kQ;
    float* v_s = k_s + S::kK;
    float* p_s = v_s + S::kV;
    float* corr_s = p_s + S::kP;
    float* l_s = corr_s + MAXQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, kvh = blockIdx.y;
    const int qtile = gridDim.z - 1 - blockIdx.z;  // longest causal ranges first
    const int group = heads / kv_heads;
    const int nq_total = rows * group;
    const int q0 = qtile * MAXQ;
    const int nq = min(MAXQ, nq_total - q0);
    const int t_last = (q0 + nq - 1) / group;
    const int kend = start_pos + t_last + 1;  // keys this tile can see
    const int kbeg = split * chunk;
    const int kstop = min(kbeg + chunk, kend);

    // Queries of the tile -> q_s (zeros past nq).
    for (int i = tid; i < MAXQ * DQ; i += ATTN_SIMT_THREADS) {
        const int qi = i / DQ, c = i % DQ;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (qi < nq) {
            const int f = q0 + qi, t = f / group, h = kvh * group + f % group;
            val = reinterpret_cast<const float4*>(q + ((size_t)t * heads + h) * HD)[c];
        }
        reinterpret_cast<float4*>(q_s)[i] = val;
    }

    // Per-query softmax state, held by the warp that owns the query.
    float m[QW], l[QW];
    int qend[QW];  // keys < qend are visible to the query
#pragma unroll
    for (int i = 0; i < QW; ++i) {
        const int qi = warp + NW * i;
        m[i] = ATTN_NEG_INF;
        l[i] = 0.0f;
        qend[i] = qi < nq ? start_pos + (q0 + qi) / group + 1 : 0;
    }
    const int dq = tid % DQ, qg = tid / DQ;
    float acc[QPT][4];
#pragma unroll
    for (int i = 0; i < QPT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int k0 = kbeg; k0 < kstop; k0 += TK) {
        __syncthreads();  // previous tile fully consumed (and q_s written)
        // Stage K and V tiles, dequantized to f32; rows past kstop are zero.
        for (int i = tid; i < TK * VR; i += ATTN_SIMT_THREADS) {
            const int j = i / VR, c = i % VR;
            const int kg = k0 + j;
            float kf[EPV], vf[EPV];
            if (kg < kstop) {
                const size_t blk = (size_t)kg * (size_t)kv_heads + (size_t)kvh;
                const uint4 kr = reinterpret_cast<const uint4*>(kc + blk * HD)[c];
                const uint4 vr = reinterpret_cast<const uint4*>(vc + blk * HD)[c];
                attn_dequant16(kc, kr, attn_scale_of(kc, ks, blk), kf);
                attn_dequant16(vc, vr, attn_scale_of(vc, vs, blk), vf);
            } else {
#pragma unroll
                for (int e = 0; e < EPV; ++e) kf[e] = vf[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < EPV; e += 4) {
                *reinterpret_cast<float4*>(k_s + j * (HD + 4) + c * EPV + e) =
                    make_float4(kf[e], kf[e + 1], kf[e + 2], kf[e + 3]);
                *reinterpret_cast<float4*>(v_s + j * HD + c * EPV + e) =
                    make_float4(vf[e], vf[e + 1], vf[e + 2], vf[e + 3]);
            }
        }
        __syncthreads();

        // Scores: lane = key, warp's queries; online softmax update in registers.
        {
            float s[QW];
#pragma unroll
            for (int i = 0; i < QW; ++i) s[i] = 0.0f;
            const float* krow = k_s + lane * (HD + 4);
#pragma unroll 4
            for (int d = 0; d < HD; d += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(krow + d);
#pragma unroll
                for (int i = 0; i < QW; ++i) {
                    const float4 q4 = *reinterpret_cast<const float4*>(q_s + (warp + NW * i) * HD + d);
                    s[i] = fmaf(q4.x, k4.x, s[i]);
                    s[i] = fmaf(q4.y, k4.y, s[i]);
                    s[i] = fmaf(q4.z, k4.z, s[i]);
                    s[i] = fmaf(q4.w, k4.w, s[i]);
                }
            }
            const int kg = k0 + lane;
#pragma unroll
            for (int i = 0; i < QW; ++i) {
                const int qi = warp + NW * i;
                const bool valid = kg < kstop && kg < qend[i];
                const float sc = valid ? s[i] * scale : ATTN_NEG_INF;
                const float m_new = fmaxf(m[i], attn_warp_max(sc));
                const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;
                const float corr = expf(m[i] - m_use);
                const float p = valid ? expf(sc - m_use) : 0.0f;
                l[i] = l[i] * corr + attn_warp_sum(p);
                m[i] = m_new;
                p_s[qi * (TK + 1) + lane] = p;
                if (lane == 0) corr_s[qi] = corr;
            }
        }
        __syncthreads();

        // acc = acc * corr + P V (thread: 4 columns x its queries).
#pragma unroll
        for (int i = 0; i < QPT; ++i) {
            const int qi = qg + NG * i;
            if (qi < MAXQ) {
                const float c = corr_s[qi];
                acc[i][0] *= c;
                acc[i][1] *= c;
                acc[i][2] *= c;
                acc[i][3] *= c;
            }
        }
#pragma unroll 4
        for (int j = 0; j < TK; ++j) {
            const float4 v4 = *reinterpret_cast<const float4*>(v_s + j * HD + dq * 4);
#pragma unroll
            for (int i = 0; i < QPT; ++i) {
                const int qi = qg + NG * i;
                if (qi < MAXQ) {
                    const float p = p_s[qi * (TK + 1) + j];
                    acc[i][0] = fmaf(p, v4.x, acc[i][0]);
                    acc[i][1] = fmaf(p, v4.y, acc[i][1]);
                    acc[i][2] = fmaf(p, v4.z, acc[i][2]);
                    acc[i][3] = fmaf(p, v4.w, acc[i][3]);
                }
            }
        }
    }

    // Results: the normalized output (one split) or this split's partials.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < QW; ++i) {
        const int qi = warp + NW * i;
        if (lane == 0) {
            l_s[qi] = l[i];
            if (!single && qi < nq) {
                const int f = q0 + qi, t = f / group, h = kvh * group + f % group;
                const size_t row = (size_t)split * ((size_t)rows * heads) + (size_t)t * heads + h;
                part_ml[row * 2] = m[i];
                part_ml[row * 2 + 1] = l[i];
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
        const int qi = qg + NG * i;
        if (qi < nq) {
            const int f = q0 + qi, t = f / group, h = kvh * group + f % group;
            float4 r = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
            float* dst;
            if (single) {
                const float inv = 1.0f / l_s[qi];
                r.x *= inv;
                r.y *= inv;
                r.z *= inv;
                r.w *= inv;
                dst = out + ((size_t)t * heads + h) * HD;
            } else {
                dst = part_acc + ((size_t)split * ((size_t)rows * heads) + (size_t)t * heads + h) * HD;
            }
            reinterpret_cast<float4*>(dst)[dq] = r;
        }
    }
}

#define ATTN_SIMT_INSTANCE(HD, KVNAME, KV, MAXQ)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATTN_SIMT_THREADS, 1) attn_simt_hd##HD##_##KVNAME##_q##MAXQ(          \
        const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,                          \
        const float* __restrict__ ks, const float* __restrict__ vs, float* __restrict__ out,                        \
        float* __restrict__ part_acc, float* __restrict__ part_ml, int heads, int kv_heads, int start_pos, int rows, \
        int chunk, float scale, const int* __restrict__ step) {                                                     \
        attn_simt<HD, KV, MAXQ>(q, kc, vc, ks, vs, out, part_acc, part_ml, heads, kv_heads, start_pos, rows, chunk, \
                                scale, step);                                                                       \
    }

#define ATTN_SIMT_INSTANCES(HD, MAXQ)                 \
    ATTN_SIMT_INSTANCE(HD, i8, int8_t, MAXQ)          \
    ATTN_SIMT_INSTANCE(HD, bf16, __nv_bfloat16, MAXQ)

// head_dim 16 and 32 (the tiny test models): SIMT only, the tensor-core
// kernels are built for 64, 128 and 256 (the wrapper's Auto picks SIMT).
ATTN_SIMT_INSTANCES(16, 8)
ATTN_SIMT_INSTANCES(16, 32)
ATTN_SIMT_INSTANCES(16, 64)
ATTN_SIMT_INSTANCES(32, 8)
ATTN_SIMT_INSTANCES(32, 32)
ATTN_SIMT_INSTANCES(32, 64)
ATTN_SIMT_INSTANCES(64, 8)
ATTN_SIMT_INSTANCES(64, 32)
ATTN_SIMT_INSTANCES(64, 64)
ATTN_SIMT_INSTANCES(128, 8)
ATTN_SIMT_INSTANCES(128, 32)
ATTN_SIMT_INSTANCES(128, 64)
ATTN_SIMT_INSTANCES(256, 8)
ATTN_SIMT_INSTANCES(256, 32)

// --------------------------------------------------------------- combine --

// grid: rows * heads (one query vector each); block: min(head_dim, 256)
// threads. Merges the splits' (max, sum, acc) in split order. rows: query
// rows of the launch (only read with a step pointer).
extern "C" __global__ void attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                        float* __restrict__ out, int splits, int n_queries, int head_dim, int rows,
                                        const int* __restrict__ step) {
    // (step) the whole key range fitted split 0, which wrote the output itself.
    if (step != nullptr && step[0] + rows <= step[1]) return;
    const size_t qidx = blockIdx.x;
    float mx = ATTN_NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[((size_t)s * n_queries + qidx) * 2]);
    // Split 0 always holds key 0, which every query sees: mx is finite.
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[((size_t)s * n_queries + qidx) * 2];
        if (ms != ATTN_NEG_INF) sum += part_ml[((size_t)s * n_queries + qidx) * 2 + 1] * expf(ms - mx);
    }
    const float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_ml[((size_t)s * n_queries + qidx) * 2];
            if (ms != ATTN_NEG_INF) o += part_acc[((size_t)s * n_queries + qidx) * head_dim + d] * expf(ms - mx);
        }
        out[qidx * head_dim + d] = o * inv;
    }
}

// ------------------------------------------------- tensor-core flash kernel --
//
// Prefill: flash attention with mma.sync m16n8k16 (bf16 in, f32 accumulate),
// sm_80 and later. Block: 4 warps, 64 query vectors (16 per warp), key tiles
// of 64 (32 for head_dim 256). K and V tiles are staged in shared memory as
// bf16: int8 cache values are integers in [-127, 127], exact in bf16, and
// their per-key scales are applied in f32 outside the products (the K scale
// on the score, the V scale folded into P). With SPLIT, Q and P are each
// split into bf16 hi + lo parts (two mma each), which keeps ~16 mantissa
// bits: the result matches the f32 reference to ~1e-5. Without SPLIT, Q and
// P are single bf16 (~3 significant digits).
//
// Shared memory (bytes), mirrored by the Rust wrapper (mma_smem_bytes):
//   q_hi, q_lo [64][HD + 8] bf16 (q_lo only with SPLIT), k_s, v_s [BK][HD + 8]
//   bf16, k/v scales [BK] f32 each. Fragments come through ldmatrix (V with
//   .trans); the +8 pads make its 8-row reads conflict-free.

#define ATTN_MMA_WARPS 4
#define ATTN_MMA_THREADS (ATTN_MMA_WARPS * 32)
#define ATTN_MMA_BQ (ATTN_MMA_WARPS * 16)

template <int HD>
struct AttnMmaTile {
    static constexpr int BK = HD == 256 ? 32 : 64;
    static constexpr int QS = HD + 8;  // bf16 row stride of the q/k/v tiles
};

template <int HD, bool SPLIT>
struct AttnMmaSmem {
    using T = AttnMmaTile<HD>;
    static constexpr int kQ = ATTN_MMA_BQ * T::QS * 2;  // bytes of one q part
    static constexpr int kK = T::BK * T::QS * 2;
    static constexpr int kV = T::BK * T::QS * 2;
    static constexpr int kBytes = kQ * (SPLIT ? 2 : 1) + kK + kV + 2 * T::BK * 4;
};

// (sm_80+ only: unused, and so left out, in the sm_75 pass.)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
static __device__ __forceinline__ uint32_t attn_ld32(const __nv_bfloat16* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

static __device__ __forceinline__ uint32_t attn_pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// hi = bf16(x0, x1); lo = bf16 of the remainders.
static __device__ __forceinline__ void attn_split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = attn_pack_bf16(x0 - hf.x, x1 - hf.y);
}

static __device__ __forceinline__ void attn_mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8x8 bf16 matrices: lanes 8i..8i+7 give the row addresses of matrix i;
// lane t receives, from each matrix, row t/4, columns 2(t%4) and 2(t%4)+1.
static __device__ __forceinline__ void attn_ldmatrix_x4(uint32_t* r, const __nv_bfloat16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same, transposed: lane t receives rows 2(t%4) and 2(t%4)+1 of column t/4.
static __device__ __forceinline__ void attn_ldmatrix_x4_trans(uint32_t* r, const __nv_bfloat16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Cache values of one 16-byte vector as bf16 (int8: exact integers; bf16: as is).
// An integer of magnitude <= 128 has at most 8 significant bits: its f32
// bits end in 16 zeros, and the high half is its exact bf16.
static __device__ __forceinline__ void attn_to_bf16(const int8_t*, uint4 raw, __nv_bfloat16* out) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
        attn_i8x4_to_f32(w[i], f);
        o[i * 2] = __byte_perm(__float_as_uint(f[0]), __float_as_uint(f[1]), 0x7632);
        o[i * 2 + 1] = __byte_perm(__float_as_uint(f[2]), __float_as_uint(f[3]), 0x7632);
    }
}
static __device__ __forceinline__ void attn_to_bf16(const __nv_bfloat16*, uint4 raw, __nv_bfloat16* out) {
    *reinterpret_cast<uint4*>(out) = raw;
}

#endif

// grid: (splits, kv_heads, query tiles of 64); block: ATTN_MMA_THREADS.
// Same arguments and outputs as attn_simt.
template <int HD, typename KV, bool SPLIT>
static __device__ __forceinline__ void attn_mma(const float* __restrict__ q, const KV* __restrict__ kc,
                                                const KV* __restrict__ vc, const float* __restrict__ ks,
                                                const float* __restrict__ vs, float* __restrict__ out,
                                                float* __restrict__ part_acc, float* __restrict__ part_ml, int heads,
                                                int kv_heads, int start_pos, int rows, int chunk, float scale,
                                                const int* __restrict__ step) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using T = AttnMmaTile<HD>;
    using S = AttnMmaSmem<HD, SPLIT>;
    if (step != nullptr) {
        start_pos = step[0];
        chunk = step[1];
    }
    // One normalized output from split 0, or partials of every split (see the file comment).
    const bool single = step != nullptr ? start_pos + rows <= chunk : gridDim.x == 1;
    if (single && blockIdx.x != 0) return;  // (step only) empty splits of a one-split range
    constexpr int BK = T::BK, QS = T::QS;
    constexpr int EPV = 16 / (int)sizeof(KV);  // cache values per 16-byte vector
    constexpr int VR = HD / EPV;               // vectors per cache row
    constexpr int NB = BK / 8;                 // score n-blocks per warp
    constexpr int ND = HD / 8;                 // output n-blocks per warp

    extern __shared__ float4 attn_smem4[];
    unsigned char* base = reinterpret_cast<unsigned char*>(attn_smem4);
    __nv_bfloat16* q_hi = reinterpret_cast<__nv_bfloat16*>(base);
    __nv_bfloat16* q_lo = reinterpret_cast<__nv_bfloat16*>(base + S::kQ);  // only with SPLIT
    __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(base + S::kQ * (SPLIT ? 2 : 1));
    __nv_bfloat16* v_s = k_s + BK * QS;
    float* ksc = reinterpret_cast<float*>(v_s + BK * QS);
    float* vsc = ksc + BK;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int split = blockIdx.x, kvh = blockIdx.y;
    const int qtile = gridDim.z - 1 - blockIdx.z;  // longest causal ranges first
    const int group = heads / kv_heads;
    const int nq_total = rows * group;
    const int q0 = qtile * ATTN_MMA_BQ;
    const int nq = min(ATTN_MMA_BQ, nq_total - q0);
    const int t_last = (q0 + nq - 1) / group;
    const int kend = start_pos + t_last + 1;
    const int kbeg = split * chunk;
    const int kstop = min(kbeg + chunk, kend);

    // Q tile -> bf16 hi (and lo) parts; zero rows past nq.
    for (int i = tid; i < ATTN_MMA_BQ * (HD / 4); i += ATTN_MMA_THREADS) {
        const int qi = i / (HD / 4), c = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (qi < nq) {
            const int f = q0 + qi, t = f / group, h = kvh * group + f % group;
            x = reinterpret_cast<const float4*>(q + ((size_t)t * heads + h) * HD)[c];
        }
        uint2 hi, lo;
        if (SPLIT) {
            attn_split_bf16(x.x, x.y, hi.x, lo.x);
            attn_split_bf16(x.z, x.w, hi.y, lo.y);
            *reinterpret_cast<uint2*>(q_lo + qi * QS + c * 4) = lo;
        } else {
            hi.x = attn_pack_bf16(x.x, x.y);
            hi.y = attn_pack_bf16(x.z, x.w);
        }
        *reinterpret_cast<uint2*>(q_hi + qi * QS + c * 4) = hi;
    }

    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's two query rows (local)
    const int qend0 = r0 < nq ? start_pos + (q0 + r0) / group + 1 : 0;
    const int qend1 = r1 < nq ? start_pos + (q0 + r1) / group + 1 : 0;
    float m0 = ATTN_NEG_INF, m1 = ATTN_NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int k0 = kbeg; k0 < kstop; k0 += BK) {
        __syncthreads();  // previous tile consumed (and the Q tile written)
        // Stage K and V as bf16 plus their scales; consecutive threads take
        // consecutive keys (conflict-free 16-byte stores).
        for (int i = tid; i < BK * VR; i += ATTN_MMA_THREADS) {
            const int j = i % BK, c = i / BK;
            const int kg = k0 + j;
            __align__(16) __nv_bfloat16 kb[EPV];
            __align__(16) __nv_bfloat16 vb[EPV];
            float kscale = 0.0f, vscale = 0.0f;
            if (kg < kstop) {
                const size_t blk = (size_t)kg * (size_t)kv_heads + (size_t)kvh;
                attn_to_bf16(kc, reinterpret_cast<const uint4*>(kc + blk * HD)[c], kb);
                attn_to_bf16(vc, reinterpret_cast<const uint4*>(vc + blk * HD)[c], vb);
                kscale = attn_scale_of(kc, ks, blk);
                vscale = attn_scale_of(vc, vs, blk);
            } else {
#pragma unroll
                for (int e = 0; e < EPV; ++e) kb[e] = vb[e] = __float2bfloat16_rn(0.0f);
            }
#pragma unroll
            for (int e = 0; e < EPV; e += 8) {
                *reinterpret_cast<uint4*>(k_s + j * QS + c * EPV + e) = *reinterpret_cast<const uint4*>(kb + e);
                *reinterpret_cast<uint4*>(v_s + j * QS + c * EPV + e) = *reinterpret_cast<const uint4*>(vb + e);
            }
            if (c == 0) {
                ksc[j] = kscale;
                vsc[j] = vscale;
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows x BK keys.
        float s[NB][4];
#pragma unroll
        for (int n = 0; n < NB; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        // ldmatrix row addresses: A (Q): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
        // in a0..a3 order; B (K, a pair of key n-blocks): (keys of n | n+1) x (cols 0-7 | 8-15).
        const int qrow = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, qcol = (lane >> 4) * 8;
        const int krow = (lane & 7) + (lane >> 4) * 8, kcol = ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            uint32_t ah[4], al[4];
            attn_ldmatrix_x4(ah, q_hi + qrow * QS + kk * 16 + qcol);
            if (SPLIT) attn_ldmatrix_x4(al, q_lo + qrow * QS + kk * 16 + qcol);
#pragma unroll
            for (int n = 0; n < NB; n += 2) {
                uint32_t b[4];  // b0, b1 of n-block n, then of n + 1
                attn_ldmatrix_x4(b, k_s + (n * 8 + krow) * QS + kk * 16 + kcol);
                attn_mma_bf16(s[n], ah, b[0], b[1]);
                attn_mma_bf16(s[n + 1], ah, b[2], b[3]);
                if (SPLIT) {
                    attn_mma_bf16(s[n], al, b[0], b[1]);
                    attn_mma_bf16(s[n + 1], al, b[2], b[3]);
                }
            }
        }

        // Scale, mask, online softmax (rows r0: s[.][0..1], r1: s[.][2..3]).
        float mx0 = ATTN_NEG_INF, mx1 = ATTN_NEG_INF;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = n * 8 + 2 * tig + (e & 1);
                const int kg = k0 + j;
                const bool valid = kg < kstop && kg < (e < 2 ? qend0 : qend1);
                s[n][e] = valid ? s[n][e] * ksc[j] * scale : ATTN_NEG_INF;
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == ATTN_NEG_INF ? 0.0f : mn0, mu1 = mn1 == ATTN_NEG_INF ? 0.0f : mn1;
        const float c0 = expf(m0 - mu0), c1 = expf(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            s[n][0] = expf(s[n][0] - mu0);
            s[n][1] = expf(s[n][1] - mu0);
            s[n][2] = expf(s[n][2] - mu1);
            s[n][3] = expf(s[n][3] - mu1);
            ps0 += s[n][0] + s[n][1];
            ps1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }

        // O += (P * v_scale) V, 16 keys per step.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const int na = 2 * kk, nb = 2 * kk + 1;
            const float va0 = vsc[na * 8 + 2 * tig], va1 = vsc[na * 8 + 2 * tig + 1];
            const float vb0 = vsc[nb * 8 + 2 * tig], vb1 = vsc[nb * 8 + 2 * tig + 1];
            uint32_t ah[4], al[4];
            if (SPLIT) {
                attn_split_bf16(s[na][0] * va0, s[na][1] * va1, ah[0], al[0]);
                attn_split_bf16(s[na][2] * va0, s[na][3] * va1, ah[1], al[1]);
                attn_split_bf16(s[nb][0] * vb0, s[nb][1] * vb1, ah[2], al[2]);
                attn_split_bf16(s[nb][2] * vb0, s[nb][3] * vb1, ah[3], al[3]);
            } else {
                ah[0] = attn_pack_bf16(s[na][0] * va0, s[na][1] * va1);
                ah[1] = attn_pack_bf16(s[na][2] * va0, s[na][3] * va1);
                ah[2] = attn_pack_bf16(s[nb][0] * vb0, s[nb][1] * vb1);
                ah[3] = attn_pack_bf16(s[nb][2] * vb0, s[nb][3] * vb1);
            }
            // B (V, transposed on load; a pair of d n-blocks): (keys 0-7 | 8-15) x (d of n | n+1).
            const __nv_bfloat16* vrow = v_s + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + (lane >> 4) * 8;
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                uint32_t b[4];  // b0, b1 of d n-block n, then of n + 1
                attn_ldmatrix_x4_trans(b, vrow + n * 8);
                attn_mma_bf16(o[n], ah, b[0], b[1]);
                attn_mma_bf16(o[n + 1], ah, b[2], b[3]);
                if (SPLIT) {
                    attn_mma_bf16(o[n], al, b[0], b[1]);
                    attn_mma_bf16(o[n + 1], al, b[2], b[3]);
                }
            }
        }
    }

    // Row sums over the 4 threads of a row (same result in each: + commutes).
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r1 : r0;
        if (r >= nq) continue;
        const float m = half ? m1 : m0, l = half ? l1 : l0;
        const int f = q0 + r, t = f / group, h = kvh * group + f % group;
        const size_t qrow = (size_t)t * heads + h;
        float* dst;
        float inv = 1.0f;
        if (single) {
            dst = out + qrow * HD;
            inv = 1.0f / l;
        } else {
            const size_t prow = (size_t)split * ((size_t)rows * heads) + qrow;
            dst = part_acc + prow * HD;
            if (tig == 0) {
                part_ml[prow * 2] = m;
                part_ml[prow * 2 + 1] = l;
            }
        }
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const float2 v = make_float2(o[n][half * 2] * inv, o[n][half * 2 + 1] * inv);
            *reinterpret_cast<float2*>(dst + n * 8 + 2 * tig) = v;
        }
    }
#else
    __trap();  // the wrapper launches these only on compute capability >= 8.0
#endif
}

#define ATTN_MMA_INSTANCE(HD, KVNAME, KV, SPLIT, PREC)                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_MMA_THREADS) attn_mma_hd##HD##_##KVNAME##_##PREC(             \
        const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,                          \
        const float* __restrict__ ks, const float* __restrict__ vs, float* __restrict__ out,                        \
        float* __restrict__ part_acc, float* __restrict__ part_ml, int heads, int kv_heads, int start_pos, int rows, \
        int chunk, float scale, const int* __restrict__ step) {                                                     \
        attn_mma<HD, KV, SPLIT>(q, kc, vc, ks, vs, out, part_acc, part_ml, heads, kv_heads, start_pos, rows, chunk,  \
                                scale, step);                                                                       \
    }

#define ATTN_MMA_INSTANCES(HD)                               \
    ATTN_MMA_INSTANCE(HD, i8, int8_t, true, f32)             \
    ATTN_MMA_INSTANCE(HD, bf16, __nv_bfloat16, true, f32)    \
    ATTN_MMA_INSTANCE(HD, i8, int8_t, false, bf16)           \
    ATTN_MMA_INSTANCE(HD, bf16, __nv_bfloat16, false, bf16)

ATTN_MMA_INSTANCES(64)
ATTN_MMA_INSTANCES(128)
ATTN_MMA_INSTANCES(256)

// ------------------------------------------------ tensor-core decode kernel --
//
// Decode (up to 16 query vectors per kv head: a GQA group of one or two
// rows): the keys are the M dimension of the mma, so a group of 8 query
// heads exactly fills N = 8. S^T = K Q^T (A = K tile, B = Q), then
// O^T += V^T P^T (A = V tile through ldmatrix.trans, B = P from shared
// memory). Q and P are bf16 hi + lo pairs (f32-level accuracy, as attn_mma).
// Each of the 4 warps streams its own key tiles (tile w, w + 4, ... of the
// block's split) through its own shared memory with only __syncwarp, and
// keeps its own (max, sum, O); the block merges the 4 warps in warp order.
//
// Shared memory (bytes), mirrored by the Rust wrapper (dec_smem_bytes):
//   q_hi, q_lo [NQ][HD + 8] bf16, then per warp: k_s, v_s [BKW][HD + 8] bf16,
//   p_hi, p_lo [NQ][BKW + 8] bf16, k/v scales [BKW] f32. After the key loop
//   the per-warp area holds the merge inputs: m, l [4][NQ], o [4][NQ][HD] f32.

#define ATTN_DEC_WARPS 4
#define ATTN_DEC_THREADS (ATTN_DEC_WARPS * 32)

template <int HD, int NQB>
struct AttnDecShape {
    static constexpr int NQ = NQB * 8;
    static constexpr int BKW = HD == 256 ? 16 : 32;  // keys per warp tile
    static constexpr int KS = HD + 8;                // bf16 row stride of q/k/v tiles
    static constexpr int PS = BKW + 8;               // bf16 row stride of P^T
    static constexpr int kQ = NQ * KS * 2;           // bytes of one q part
    static constexpr int kWarp = 2 * BKW * KS * 2 + 2 * NQ * PS * 2 + 2 * BKW * 4;
    static constexpr int kMerge = ATTN_DEC_WARPS * NQ * (HD + 2) * 4;
    static constexpr int kBytes = 2 * kQ + (ATTN_DEC_WARPS * kWarp > kMerge ? ATTN_DEC_WARPS * kWarp : kMerge);
};


// grid: (splits, kv_heads, 1); block: ATTN_DEC_THREADS; rows * (heads /
// kv_heads) <= NQB * 8. Same arguments and outputs as attn_simt.
template <int HD, typename KV, int NQB>
static __device__ __forceinline__ void attn_dec(const float* __restrict__ q, const KV* __restrict__ kc,
                                                const KV* __restrict__ vc, const float* __restrict__ ks,
                                                const float* __restrict__ vs, float* __restrict__ out,
                                                float* __restrict__ part_acc, float* __restrict__ part_ml, int heads,
                                                int kv_heads, int start_pos, int rows, int chunk, float scale,
                                                const int* __restrict__ step) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using D = AttnDecShape<HD, NQB>;
    if (step != nullptr) {
        start_pos = step[0];
        chunk = step[1];
    }
    // One normalized output from split 0, or partials of every split (see the file comment).
    const bool single = step != nullptr ? start_pos + rows <= chunk : gridDim.x == 1;
    if (single && blockIdx.x != 0) return;  // (step only) empty splits of a one-split range
    constexpr int NQ = D::NQ, BKW = D::BKW, KS = D::KS, PS = D::PS;
    constexpr int EPV = 16 / (int)sizeof(KV);  // cache values per 16-byte vector
    constexpr int VR = HD / EPV;               // vectors per cache row
    constexpr int NV = BKW * VR / 32;          // vectors per lane per tile (K, and V)
    constexpr int CH = (HD == 256 || sizeof(KV) == 2) ? 4 : 8;  // vectors in flight per lane and tensor
    static_assert(NV % CH == 0 || NV < CH, "staging chunks");
    constexpr int CHUNK = NV < CH ? NV : CH;
    constexpr int MT = BKW / 16;  // key m-tiles per warp tile
    constexpr int MD = HD / 16;   // d m-tiles of O^T

    extern __shared__ float4 attn_smem4[];
    unsigned char* base = reinterpret_cast<unsigned char*>(attn_smem4);
    __nv_bfloat16* q_hi = reinterpret_cast<__nv_bfloat16*>(base);
    __nv_bfloat16* q_lo = reinterpret_cast<__nv_bfloat16*>(base + D::kQ);
    unsigned char* area = base + 2 * D::kQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    unsigned char* wbase = area + warp * D::kWarp;
    __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(wbase);
    __nv_bfloat16* v_s = k_s + BKW * KS;
    __nv_bfloat16* p_hi = v_s + BKW * KS;
    __nv_bfloat16* p_lo = p_hi + NQ * PS;
    float* ksc = reinterpret_cast<float*>(p_lo + NQ * PS);
    float* vsc = ksc + BKW;

    const int split = blockIdx.x, kvh = blockIdx.y;
    const int group = heads / kv_heads;
    const int nq = rows * group;  // <= NQ (checked by the wrapper)
    const int kend = start_pos + rows;
    const int kbeg = split * chunk;
    const int kstop = min(kbeg + chunk, kend);

    // Q -> bf16 hi/lo [NQ][KS]; zero rows past nq.
    for (int i = tid; i < NQ * (HD / 4); i += ATTN_DEC_THREADS) {
        const int qi = i / (HD / 4), c = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (qi < nq) {
            const int t = qi / group, h = kvh * group + qi % group;
            x = reinterpret_cast<const float4*>(q + ((size_t)t * heads + h) * HD)[c];
        }
        uint2 hi, lo;
        attn_split_bf16(x.x, x.y, hi.x, lo.x);
        attn_split_bf16(x.z, x.w, hi.y, lo.y);
        *reinterpret_cast<uint2*>(q_hi + qi * KS + c * 4) = hi;
        *reinterpret_cast<uint2*>(q_lo + qi * KS + c * 4) = lo;
    }
    __syncthreads();

    // This thread's queries: nb * 8 + 2 * tig + e (e = 0, 1).
    int qend[NQB][2];
    float m[NQB][2], l[NQB][2];
#pragma unroll
    for (int nb = 0; nb < NQB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int qi = nb * 8 + 2 * tig + e;
            qend[nb][e] = qi < nq ? start_pos + qi / group + 1 : 0;
            m[nb][e] = ATTN_NEG_INF;
            l[nb][e] = 0.0f;
        }
    }
    float o[MD][NQB][4];
#pragma unroll
    for (int md = 0; md < MD; ++md)
#pragma unroll
        for (int nb = 0; nb < NQB; ++nb) o[md][nb][0] = o[md][nb][1] = o[md][nb][2] = o[md][nb][3] = 0.0f;

    for (int k0 = kbeg + warp * BKW; k0 < kstop; k0 += ATTN_DEC_WARPS * BKW) {
        // Stage this warp's tile: rows contiguous across lanes (coalesced).
#pragma unroll
        for (int c0 = 0; c0 < NV; c0 += CHUNK) {
            uint4 kr[CHUNK], vr[CHUNK];
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                const int i = lane + 32 * (c0 + u);
                const int j = i / VR, c = i % VR;
                const int kg = k0 + j;
                kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
                if (kg < kstop) {
                    const size_t blk = (size_t)kg * (size_t)kv_heads + (size_t)kvh;
                    kr[u] = reinterpret_cast<const uint4*>(kc + blk * HD)[c];
                    vr[u] = reinterpret_cast<const uint4*>(vc + blk * HD)[c];
                }
            }
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                const int i = lane + 32 * (c0 + u);
                const int j = i / VR, c = i % VR;
                __align__(16) __nv_bfloat16 kb[EPV];
                __align__(16) __nv_bfloat16 vb[EPV];
                attn_to_bf16(kc, kr[u], kb);
                attn_to_bf16(vc, vr[u], vb);
#pragma unroll
                for (int e = 0; e < EPV; e += 8) {
                    *reinterpret_cast<uint4*>(k_s + j * KS + c * EPV + e) = *reinterpret_cast<const uint4*>(kb + e);
                    *reinterpret_cast<uint4*>(v_s + j * KS + c * EPV + e) = *reinterpret_cast<const uint4*>(vb + e);
                }
            }
        }
        if (lane < BKW) {
            const int kg = k0 + lane;
            float kscale = 0.0f, vscale = 0.0f;
            if (kg < kstop) {
                const size_t blk = (size_t)kg * (size_t)kv_heads + (size_t)kvh;
                kscale = attn_scale_of(kc, ks, blk);
                vscale = attn_scale_of(vc, vs, blk);
            }
            ksc[lane] = kscale;
            vsc[lane] = vscale;
        }
        __syncwarp();

        // S^T [BKW keys x NQ queries] = K Q^T.
        float s[MT][NQB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nb = 0; nb < NQB; ++nb) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const int col = kk * 16 + 2 * tig;
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const __nv_bfloat16* kr0 = k_s + (mt * 16 + g) * KS + col;
                a[mt][0] = attn_ld32(kr0);
                a[mt][1] = attn_ld32(kr0 + 8 * KS);
                a[mt][2] = attn_ld32(kr0 + 8);
                a[mt][3] = attn_ld32(kr0 + 8 * KS + 8);
            }
#pragma unroll
            for (int nb = 0; nb < NQB; ++nb) {
                const int qoff = (nb * 8 + g) * KS + col;
                const uint32_t bh0 = attn_ld32(q_hi + qoff), bh1 = attn_ld32(q_hi + qoff + 8);
                const uint32_t bl0 = attn_ld32(q_lo + qoff), bl1 = attn_ld32(q_lo + qoff + 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    attn_mma_bf16(s[mt][nb], a[mt], bh0, bh1);
                    attn_mma_bf16(s[mt][nb], a[mt], bl0, bl1);
                }
            }
        }

        // Scale, mask, online softmax per query (column of S^T): element e
        // of s[mt][nb] is key mt*16 + g + 8*(e >= 2), query nb*8 + 2*tig + (e & 1).
#pragma unroll
        for (int nb = 0; nb < NQB; ++nb) {
            float mx[2] = {ATTN_NEG_INF, ATTN_NEG_INF};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = mt * 16 + g + ((e >> 1) << 3);
                    const int kg = k0 + j;
                    const bool valid = kg < kstop && kg < qend[nb][e & 1];
                    s[mt][nb][e] = valid ? s[mt][nb][e] * ksc[j] * scale : ATTN_NEG_INF;
                    mx[e & 1] = fmaxf(mx[e & 1], s[mt][nb][e]);
                }
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
#pragma unroll
                for (int o2 = 4; o2 <= 16; o2 <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o2));
                const float mn = fmaxf(m[nb][e], mx[e]);
                const float mu = mn == ATTN_NEG_INF ? 0.0f : mn;
                const float corr = expf(m[nb][e] - mu);
                m[nb][e] = mn;
                float ps = 0.0f;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    s[mt][nb][e] = expf(s[mt][nb][e] - mu);
                    s[mt][nb][e + 2] = expf(s[mt][nb][e + 2] - mu);
                    ps += s[mt][nb][e] + s[mt][nb][e + 2];
                }
                l[nb][e] = l[nb][e] * corr + ps;
#pragma unroll
                for (int md = 0; md < MD; ++md) {
                    o[md][nb][e] *= corr;
                    o[md][nb][e + 2] *= corr;
                }
            }
            // P^T (times the V scale of each key) -> p_hi/p_lo [query][key].
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = mt * 16 + g + ((e >> 1) << 3);
                    const int qi = nb * 8 + 2 * tig + (e & 1);
                    const float x = s[mt][nb][e] * vsc[j];
                    const __nv_bfloat16 h = __float2bfloat16_rn(x);
                    p_hi[qi * PS + j] = h;
                    p_lo[qi * PS + j] = __float2bfloat16_rn(x - __bfloat162float(h));
                }
            }
        }
        __syncwarp();

        // O^T [HD x NQ] += V^T P^T, 16 keys per step.
#pragma unroll
        for (int kk = 0; kk < BKW / 16; ++kk) {
            uint32_t bh[NQB][2], bl[NQB][2];
#pragma unroll
            for (int nb = 0; nb < NQB; ++nb) {
                const int poff = (nb * 8 + g) * PS + kk * 16 + 2 * tig;
                bh[nb][0] = attn_ld32(p_hi + poff);
                bh[nb][1] = attn_ld32(p_hi + poff + 8);
                bl[nb][0] = attn_ld32(p_lo + poff);
                bl[nb][1] = attn_ld32(p_lo + poff + 8);
            }
            // ldmatrix rows: keys kk*16 + (lane & 7) + 8 * (lane >= 16), at d + 8 * ((lane >> 3) & 1).
            const __nv_bfloat16* vrow = v_s + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * KS + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int md = 0; md < MD; ++md) {
                uint32_t a[4];
                attn_ldmatrix_x4_trans(a, vrow + md * 16);
#pragma unroll
                for (int nb = 0; nb < NQB; ++nb) {
                    attn_mma_bf16(o[md][nb], a, bh[nb][0], bh[nb][1]);
                    attn_mma_bf16(o[md][nb], a, bl[nb][0], bl[nb][1]);
                }
            }
        }
        __syncwarp();  // the tile's shared memory is read before the next staging
    }

    // Sums over the 8 lanes of a query column (xor butterfly: same bits in each).
#pragma unroll
    for (int nb = 0; nb < NQB; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int o2 = 4; o2 <= 16; o2 <<= 1) l[nb][e] += __shfl_xor_sync(0xffffffffu, l[nb][e], o2);

    // Merge the 4 warps in warp order.
    __syncthreads();  // every warp is done with its staging area
    float* m_s = reinterpret_cast<float*>(area);
    float* l_s = m_s + ATTN_DEC_WARPS * NQ;
    float* o_s = l_s + ATTN_DEC_WARPS * NQ;  // [warp][NQ][HD]
#pragma unroll
    for (int nb = 0; nb < NQB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int qi = nb * 8 + 2 * tig + e;
            if (g == 0) {
                m_s[warp * NQ + qi] = m[nb][e];
                l_s[warp * NQ + qi] = l[nb][e];
            }
#pragma unroll
            for (int md = 0; md < MD; ++md) {
                float* orow = o_s + ((size_t)warp * NQ + qi) * HD + md * 16 + g;
                orow[0] = o[md][nb][e];
                orow[8] = o[md][nb][e + 2];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < nq * HD; i += ATTN_DEC_THREADS) {
        const int qi = i / HD, d = i % HD;
        float mx = ATTN_NEG_INF;
#pragma unroll
        for (int w = 0; w < ATTN_DEC_WARPS; ++w) mx = fmaxf(mx, m_s[w * NQ + qi]);
        float sum = 0.0f, acc = 0.0f;
        if (mx != ATTN_NEG_INF) {
#pragma unroll
            for (int w = 0; w < ATTN_DEC_WARPS; ++w) {
                const float mw = m_s[w * NQ + qi];
                if (mw != ATTN_NEG_INF) {
                    const float f = expf(mw - mx);
                    sum += l_s[w * NQ + qi] * f;
                    acc += o_s[((size_t)w * NQ + qi) * HD + d] * f;
                }
            }
        }
        const int t = qi / group, h = kvh * group + qi % group;
        const size_t qrow = (size_t)t * heads + h;
        if (single) {
            out[qrow * HD + d] = acc / sum;
        } else {
            const size_t prow = (size_t)split * ((size_t)rows * heads) + qrow;
            part_acc[prow * HD + d] = acc;
            if (d == 0) {
                part_ml[prow * 2] = mx;
                part_ml[prow * 2 + 1] = sum;
            }
        }
    }
#else
    __trap();  // the wrapper launches these only on compute capability >= 8.0
#endif
}

#define ATTN_DEC_INSTANCE(HD, KVNAME, KV, NQB)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_DEC_THREADS) attn_dec_hd##HD##_##KVNAME##_n##NQB(             \
        const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,                          \
        const float* __restrict__ ks, const float* __restrict__ vs, float* __restrict__ out,                        \
        float* __restrict__ part_acc, float* __restrict__ part_ml, int heads, int kv_heads, int start_pos, int rows, \
        int chunk, float scale, const int* __restrict__ step) {                                                     \
        attn_dec<HD, KV, NQB>(q, kc, vc, ks, vs, out, part_acc, part_ml, heads, kv_heads, start_pos, rows, chunk,    \
                              scale, step);                                                                         \
    }

#define ATTN_DEC_INSTANCES(HD)                           \
    ATTN_DEC_INSTANCE(HD, i8, int8_t, 1)                 \
    ATTN_DEC_INSTANCE(HD, bf16, __nv_bfloat16, 1)        \
    ATTN_DEC_INSTANCE(HD, i8, int8_t, 2)                 \
    ATTN_DEC_INSTANCE(HD, bf16, __nv_bfloat16, 2)

ATTN_DEC_INSTANCES(64)
ATTN_DEC_INSTANCES(128)
ATTN_DEC_INSTANCES(256)

// ------------------------------------------------ one-row decode (split-K) --
//
// attn_row_hd{HD}_{i8,bf16}_g{GB}: batch-1 decode (rows == 1), f32 on CUDA
// cores, any compute capability. grid (splits, kv_heads, parts); block
// ATTN_ROW_THREADS, at most ATTN_ROW_MINB blocks per SM (launch bounds). The
// `group` = heads / kv_heads query heads of a kv head are cut into
// gridDim.z parts of qpb = ceil(group / parts) (<= GB, checked by the
// wrapper; the last part may hold fewer, none empty); one block = the qn
// query heads of one part over the keys [split * chunk, min((split + 1) *
// chunk, start_pos + 1)). The parts of a kv head read the same K/V bytes
// (the second read hits L2). Blocks past the key range exit at once.
//
// A block streams its keys in tiles of TK (16 KB of K and 16 KB of V): each
// thread issues its 16-byte loads of the next tile (and, first of all, of q)
// before it computes on the current one. Per tile: K bytes -> shared memory
// (K rows cut into DSQ segments, each padded by 16 bytes: conflict-free
// 16-byte reads; the next tile's K is stored at the end of this one's P V);
// scores: thread = (key, segment), the dot products of its DPT dims with
// every query, summed over the DSQ threads of the key (xor shuffles), times
// the key's int8 scale and head_dim^-0.5; V -> shared memory; the block's
// online softmax (the tile max per query over the warps in warp order,
// computed by every thread alike; the sums over the warps in warp order); P
// (times the key's V scale) -> shared memory; P V: thread = (key subset, DV
// dims), every query. Then the key subsets are summed in subset order.
// Cache values enter exactly (int8 integers and bf16 are exact in f32); the
// int8 scales multiply the dot product (K) and the probability (V) instead of
// each value: the same products up to one f32 rounding.
//
// Several splits: each writes its partial (max, sum, acc) to part_ml /
// part_acc rows `split * heads + h` (h the query head: the parts' rows are
// disjoint); the splits are merged in a tree fixed by the split index
// (deterministic: the same operations whatever the arrival order). At most
// `one_level` splits (the wrapper's ROW_ONE_LEVEL): one level, the
// last-arriving block of the (kv head, part) (an arrival counter:
// __threadfence, atomicAdd) merges all splits into `out`. More: groups of ATTN_ROW_GS splits, whose last-arriving
// block merges the group into a group partial (rows `(gridDim.x + group) *
// heads + h`), and the last-arriving group merger of the (kv head, part)
// merges the groups in group order into `out`. A merge: P threads per float4
// column of a query's row, each folding its rows (r, r + P, ...) in row
// order (online: max, rescale), then the P threads' results combined by a
// fixed xor tree. Each merger resets its counter to 0 for the next launch.
// counters: kv_heads * parts * (1 + ceil(gridDim.x / GS)) u32 (counter
// block (kv head * parts + part)), zero before the launch (and after it).
// One split: the block writes `out`.
//
// attn_rowc_hd{HD}_{i8,bf16}_g{GB} (sm_90+): the same kernel launched in
// thread-block clusters of C blocks along x (the grid's x a multiple of C;
// C <= 16). A cluster with a split in the key range runs whole: its blocks
// past the range hold no keys and help merge; the other clusters exit. The
// splits of a cluster merge in distributed shared memory (attn_rowc_merge),
// the clusters in one level through global memory (cnt[0]; partial rows
// `cluster * heads + h`). Not the same bits as attn_row_* (another merge
// tree); the same operations in the same order for a fixed C and chunk.
//
// Step pointer (non-null): start_pos = step[0], chunk = step[1]; the grid has
// a fixed split count and the splits past ceil((start_pos + 1) / chunk) exit:
// the same operations, in the same order, as the null-step launch with
// gridDim.x = ceil((start_pos + 1) / chunk) (bit-identical results).

#define ATTN_ROW_THREADS 256
#define ATTN_ROW_WARPS (ATTN_ROW_THREADS / 32)
#define ATTN_ROW_MINB 2        // blocks per SM the launch bounds ask for (<= 128 registers)
#define ATTN_ROW_GS 8          // splits of a first-level merge group

// Tiles, thread maps and the dynamic shared memory (bytes) of attn_row:
// mirrored by the Rust wrapper (row_smem_bytes).
template <int HD, typename KV, int GB>
struct AttnRowShape {
    static constexpr int NT = ATTN_ROW_THREADS;
    static constexpr int NW = ATTN_ROW_WARPS;
    static constexpr int VB = (int)sizeof(KV);
    static constexpr int TK0 = 16384 / (HD * VB);
    static constexpr int TK = TK0 < NT ? TK0 : NT;  // keys per tile
    static constexpr int DSQ = NT / TK;              // score threads per key
    static constexpr int DPT = HD / DSQ;             // dims of one score thread
    static constexpr int SEGB = DPT * VB;            // bytes of a K segment (16, 32 or 64)
    static constexpr int CPS = SEGB / 16;            // 16-byte vectors per segment
    static constexpr int KRS = DSQ * (SEGB + 16);    // bytes of a K row in shared memory
    static constexpr int EPV = 16 / VB;              // values per 16-byte vector
    static constexpr int ROWV = HD / EPV;            // vectors per cache row
    static constexpr int NLD = TK * ROWV / NT;       // vectors per thread per tile (K, and V)
    static constexpr int DV = HD >= 128 ? 4 : 2;     // dims of one P V thread
    static constexpr int LPR = HD / DV;              // P V threads per V row
    static constexpr int KSUB = NT / LPR;            // key subsets of P V
    static constexpr int QGS = DSQ * (DPT + 4);      // floats of one query in shared memory
    static constexpr int oK = GB * QGS * 4;
    static constexpr int oV = oK + TK * KRS;
    static constexpr int oP = oV + TK * HD * VB;
    static constexpr int oSc = oP + TK * GB * 4;
    static constexpr int kTile = oSc + 2 * TK * 4;
    static constexpr int kRed = KSUB * GB * HD * 4;
    static constexpr int oStat = kTile > kRed ? kTile : kRed;
    // Stats: tile max and sum per (warp, query), final max and sum per query, the merge flag.
    static constexpr int kBytes = oStat + (2 * NW * GB + 2 * GB + 4) * 4;
    static_assert(GB == 1 || GB == 2 || GB == 4, "query heads per block");
    static_assert(DSQ * TK == NT && NLD * NT == TK * ROWV && NLD >= 1, "tile map");
    static_assert(SEGB % 16 == 0 && DPT % 4 == 0 && HD % DV == 0, "segments");
    static_assert(LPR <= 32 ? 32 % LPR == 0 : LPR % 32 == 0, "P V map");
    static_assert(oStat % 16 == 0, "stats alignment");
};

// 16 bytes of cache values -> exact floats (16 int8 integers, unscaled, or 8 bf16).
static __device__ __forceinline__ void attn_row_vals16(const int8_t*, uint4 raw, float* out) {
    attn_i8x4_to_f32(raw.x, out);
    attn_i8x4_to_f32(raw.y, out + 4);
    attn_i8x4_to_f32(raw.z, out + 8);
    attn_i8x4_to_f32(raw.w, out + 12);
}
static __device__ __forceinline__ void attn_row_vals16(const __nv_bfloat16* p, uint4 raw, float* out) {
    attn_dequant16(p, raw, 1.0f, out);
}

// DV values of a V row in shared memory -> exact floats.
template <int DV>
static __device__ __forceinline__ void attn_row_vals(const int8_t*, const unsigned char* src, float* out) {
    if (DV == 4) {
        attn_i8x4_to_f32(*reinterpret_cast<const uint32_t*>(src), out);
    } else {
        float f[4];
        attn_i8x4_to_f32((uint32_t)*reinterpret_cast<const uint16_t*>(src), f);
        out[0] = f[0];
        out[1] = f[1];
    }
}
template <int DV>
static __device__ __forceinline__ void attn_row_vals(const __nv_bfloat16*, const unsigned char* src, float* out) {
    if (DV == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(src);
        out[0] = __uint_as_float(w.x << 16);
        out[1] = __uint_as_float(w.x & 0xffff0000u);
        out[2] = __uint_as_float(w.y << 16);
        out[3] = __uint_as_float(w.y & 0xffff0000u);
    } else {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(src);
        out[0] = __uint_as_float(w << 16);
        out[1] = __uint_as_float(w & 0xffff0000u);
    }
}

// N (1, 2 or 4) consecutive floats from / to shared memory in one access (16-, 8- or 4-byte aligned).
template <int N>
static __device__ __forceinline__ void attn_row_st(float* dst, const float* v) {
    if (N == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    } else if (N == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
    } else {
        dst[0] = v[0];
    }
}
template <int N>
static __device__ __forceinline__ void attn_row_ld(const float* src, float* v) {
    if (N == 4) {
        const float4 x = *reinterpret_cast<const float4*>(src);
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    } else if (N == 2) {
        const float2 x = *reinterpret_cast<const float2*>(src);
        v[0] = x.x;
        v[1] = x.y;
    } else {
        v[0] = src[0];
    }
}

// (m, l, a) <- the merge of (m, l, a) and (mo, lo, ao): weights exp(m - max), an empty side (m = -inf) weight 0.
static __device__ __forceinline__ void attn_row_fold(float& m, float& l, float4& a, float mo, float lo, float4 ao) {
    const float mn = fmaxf(m, mo);
    const float w = m == ATTN_NEG_INF ? 0.0f : expf(m - mn);
    const float wo = mo == ATTN_NEG_INF ? 0.0f : expf(mo - mn);
    l = fmaf(lo, wo, l * w);
    a.x = fmaf(ao.x, wo, a.x * w);
    a.y = fmaf(ao.y, wo, a.y * w);
    a.z = fmaf(ao.z, wo, a.z * w);
    a.w = fmaf(ao.w, wo, a.w * w);
    m = mn;
}

// The fold of each group of P adjacent lanes' (m, l, a) (P a power of two <= 32) by a fixed xor tree: every
// lane of the group ends with the group's merge (lane 0's in a fixed order).
template <int P>
static __device__ __forceinline__ void attn_row_fold_lanes(float& m, float& l, float4& a) {
#pragma unroll
    for (int o = 1; o < P; o <<= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o);
        const float lo = __shfl_xor_sync(0xffffffffu, l, o);
        float4 ao;
        ao.x = __shfl_xor_sync(0xffffffffu, a.x, o);
        ao.y = __shfl_xor_sync(0xffffffffu, a.y, o);
        ao.z = __shfl_xor_sync(0xffffffffu, a.z, o);
        ao.w = __shfl_xor_sync(0xffffffffu, a.w, o);
        attn_row_fold(m, l, a, mo, lo, ao);
    }
}

// A merged float4 column d of query head h: the output (acc / sum) when final, else partial row `row`'s
// (acc, and with column 0 its max and sum).
template <int HD>
static __device__ __forceinline__ void attn_row_put(bool final_out, float* __restrict__ out,
                                                    float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                    int row, int heads, size_t h, int d, float m, float l, float4 a) {
    if (final_out) {
        const float inv = 1.0f / l;
        *reinterpret_cast<float4*>(out + h * HD + d) = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    } else {
        const size_t r = (size_t)row * heads + h;
        *reinterpret_cast<float4*>(part_acc + r * HD + d) = a;
        if (d == 0) {
            part_ml[r * 2] = m;
            part_ml[r * 2 + 1] = l;
        }
    }
}

// Merges the partial rows r0 .. r0 + n - 1 of the block's qn queries (heads hb .. hb + qn - 1): P adjacent
// threads per float4 column of a query's row, thread `sub` folding the rows sub, sub + P, ... in row order
// (loads issued 8 rows at a time), then the P threads' results combined by an xor tree (a fixed order).
// Writes out = acc / sum (final) or the partial row dst_row. Partials are read through L2 (__ldcg): other
// blocks wrote them.
template <int HD, int GB>
static __device__ __forceinline__ void attn_row_merge(float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                      int r0, int n, int heads, int hb, int qn, bool final_out,
                                                      float* __restrict__ out, int dst_row) {
    constexpr int NT = ATTN_ROW_THREADS;
    constexpr int C = HD / 4;    // float4 columns of a query's row
    constexpr int NI = GB * C;   // columns of the block (queries past qn: idle)
    constexpr int P0 = NI >= NT ? 1 : NT / NI;
    constexpr int P = P0 > 32 ? 32 : P0;  // threads per column (adjacent lanes of one warp)
    constexpr int RB = 8;                 // rows loaded at once
    const int sub = threadIdx.x % P;
    // (warp-uniform: NI and P are powers of two, so a warp's columns are all < NI or none is)
    for (int item = threadIdx.x / P; item < NI; item += NT / P) {
        const int g = item / C, d = (item % C) * 4;
        const bool live = g < qn;
        const size_t h = (size_t)(hb + g);
        float m = ATTN_NEG_INF, l = 0.0f;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int i0 = sub; i0 < n; i0 += RB * P) {
            float mm[RB], ll[RB];
            float4 aa[RB];
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                mm[j] = ATTN_NEG_INF;
                ll[j] = 0.0f;
                aa[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (live && i0 + j * P < n) {
                    const size_t row = (size_t)(r0 + i0 + j * P) * heads + h;
                    mm[j] = __ldcg(part_ml + row * 2);
                    ll[j] = __ldcg(part_ml + row * 2 + 1);
                    aa[j] = __ldcg(reinterpret_cast<const float4*>(part_acc + row * HD + d));
                }
            }
#pragma unroll
            for (int j = 0; j < RB; ++j)
                if (live && i0 + j * P < n) attn_row_fold(m, l, a, mm[j], ll[j], aa[j]);
        }
        attn_row_fold_lanes<P>(m, l, a);
        if (live && sub == 0) attn_row_put<HD>(final_out, out, part_acc, part_ml, dst_row, heads, h, d, m, l, a);
    }
}

// The arrival protocol of a merge level: every thread's partial stores are
// made visible (fence), then one atomicAdd on `counter`; true in every thread
// of the block that arrived last of `expected` (which resets the counter).
static __device__ __forceinline__ bool attn_row_arrive(unsigned int* counter, unsigned int expected, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int ticket = atomicAdd(counter, 1u);
        const int last = ticket == expected - 1u;
        if (last) {
            atomicExch(counter, 0u);  // ready for the next launch
            __threadfence();          // the others' partials are read after their arrivals
        }
        *flag = last;
    }
    __syncthreads();
    return *flag != 0;
}

// The arrival counters of the block's (kv head, part): 1 + ceil(gridDim.x / ATTN_ROW_GS) of them.
static __device__ __forceinline__ unsigned int* attn_row_counters(unsigned int* counters, int kvh, int part) {
    return counters + (size_t)(kvh * (int)gridDim.z + part) * (1 + (gridDim.x + ATTN_ROW_GS - 1) / ATTN_ROW_GS);
}

// The merge of attn_rowc (clusters of C blocks along the splits): block `split` of the cluster holds its
// partial in its shared memory (o_s [GB][HD] summed over the key subsets, m_s and l_s [GB]; none of its own
// past the key range). After the cluster's barrier, block `rank` folds the columns rank, rank + C, ... of the
// qn queries' rows (float4 columns, one warp each): lane j reads block j's partial (j < the cluster's blocks
// with keys, at most 16), then the lanes' results are combined by a fixed xor tree. One cluster in the key
// range: the result is `out`. More: each cluster's is its partial row `cluster * heads + h`, and the last
// cluster to arrive (its rank 0 block: a count on cnt[0]) merges the clusters' rows in cluster order into `out`
// (attn_row_merge). A second barrier keeps every block until the others have read its shared memory.
template <int HD, int GB>
static __device__ __forceinline__ void attn_rowc_merge(const float* o_s, const float* m_s, const float* l_s,
                                                       int split, int nsplit, int heads, int hb, int qn,
                                                       float* __restrict__ out, float* __restrict__ part_acc,
                                                       float* __restrict__ part_ml, unsigned int* __restrict__ cnt,
                                                       int* flag_s) {
    constexpr int NC = HD / 4, NW = ATTN_ROW_WARPS;
    const int cs = (int)strata_cluster_size();
    const unsigned int rank = strata_cluster_rank();
    const int cl = split / cs;
    const int na = min(cs, nsplit - cl * cs);  // the cluster's blocks with keys (>= 1: the kernel's entry)
    const int ncl = (nsplit + cs - 1) / cs;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    strata_cluster_arrive();
    strata_cluster_wait();  // every block's partial in its shared memory
    for (int item = (int)rank + cs * warp; item < qn * NC; item += cs * NW) {
        const int g = item / NC, d = (item % NC) * 4;
        float m = ATTN_NEG_INF, l = 0.0f;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (lane < na) {
            m = strata_cluster_ld_f32(m_s + g, (unsigned int)lane);
            l = strata_cluster_ld_f32(l_s + g, (unsigned int)lane);
            a = strata_cluster_ld_f4(o_s + g * HD + d, (unsigned int)lane);
        }
        attn_row_fold_lanes<32>(m, l, a);
        if (lane == 0) attn_row_put<HD>(ncl == 1, out, part_acc, part_ml, cl, heads, (size_t)(hb + g), d, m, l, a);
    }
    if (ncl > 1) __threadfence();  // this block's share of the cluster's row, before rank 0 counts the cluster
    strata_cluster_arrive();        // done reading the others' shared memory
    strata_cluster_wait();
    if (ncl == 1 || rank != 0) return;
    if (!attn_row_arrive(cnt, (unsigned int)ncl, flag_s)) return;
    attn_row_merge<HD, GB>(part_acc, part_ml, 0, ncl, heads, hb, qn, true, out, 0);
}

template <int HD, typename KV, int GB, bool CL>
static __device__ __forceinline__ void attn_row(const float* __restrict__ q, const KV* __restrict__ kc,
                                                const KV* __restrict__ vc, const float* __restrict__ ks,
                                                const float* __restrict__ vs, float* __restrict__ out,
                                                float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                unsigned int* __restrict__ counters, int heads, int kv_heads,
                                                int start_pos, int chunk, float scale, const int* __restrict__ step,
                                                int one_level, int prewait) {
    using S = AttnRowShape<HD, KV, GB>;
    constexpr int NT = ATTN_ROW_THREADS, NW = ATTN_ROW_WARPS;
    constexpr int TK = S::TK, DSQ = S::DSQ, DPT = S::DPT, SEGB = S::SEGB, CPS = S::CPS, KRS = S::KRS;
    constexpr int EPV = S::EPV, ROWV = S::ROWV, NLD = S::NLD, DV = S::DV, LPR = S::LPR, KSUB = S::KSUB;
    constexpr int QGS = S::QGS;
    constexpr bool I8 = sizeof(KV) == 1;
    constexpr int QV = GB * HD / 4;          // float4 of the block's queries
    constexpr int QPT = (QV + NT - 1) / NT;  // per thread

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int group = heads / kv_heads;
    const int qpb = (group + (int)gridDim.z - 1) / (int)gridDim.z;  // <= GB (checked by the wrapper)
    const int qn = min(qpb, group - part * qpb);                      // this block's queries (>= 1: the wrapper)
    if (qn <= 0) return;
    const int hb = kvh * group + part * qpb;  // its first query head

    if (!prewait) strata_pdl_wait();
    if (step != nullptr) {
        start_pos = step[0];
        chunk = step[1];
    }
    const int kend = start_pos + 1;
    // Non-empty splits (a chunk too small for the grid drops the keys past it:
    // the caller's duty, kept from corrupting the counters).
    const int nsplit = min((kend + chunk - 1) / chunk, (int)gridDim.x);
    if (CL) {
        // A cluster with a split in the key range runs whole (its blocks past the range hold no keys, and
        // take part in the merge); the others exit (every block of theirs alike).
        const int cs = (int)strata_cluster_size();
        if (split / cs * cs >= nsplit) return;
    } else if (split >= nsplit) {
        return;
    }
    const int kbeg = split * chunk;
    const int kstop = min(kbeg + chunk, kend);

    extern __shared__ float4 attn_smem4[];
    unsigned char* base = reinterpret_cast<unsigned char*>(attn_smem4);
    float* q_s = reinterpret_cast<float*>(base);
    unsigned char* k_s = base + S::oK;
    unsigned char* v_s = base + S::oV;
    float* p_s = reinterpret_cast<float*>(base + S::oP);  // [TK][GB]
    float* ksc_s = reinterpret_cast<float*>(base + S::oSc);
    float* vsc_s = ksc_s + TK;
    float* red_o = reinterpret_cast<float*>(base);             // after the keys: [KSUB][GB][HD]
    float* redm_s = reinterpret_cast<float*>(base + S::oStat);  // [NW][GB] tile max
    float* reds_s = redm_s + NW * GB;                           // [NW][GB] tile sum
    float* m_s = reds_s + NW * GB;
    float* l_s = m_s + GB;
    int* flag_s = reinterpret_cast<int*>(l_s + GB);
    int* keep_s = flag_s + 1;  // nsplit, hb, qn: kept here across the key loop (not in registers)

    // Raw K/V vectors (and int8 scales) of one tile, loaded ahead of their use.
    uint4 kr[NLD], vr[NLD];
    float ksr = 1.0f, vsr = 1.0f;
    // The keys [max(k0, lo), min(k0 + TK, hi)) of the tile at k0 (zeros
    // elsewhere when lo == k0), read through L2 (as __ldcg: also before the
    // wait, see below), evict-first: a step reads its KV once.
    auto load_keys = [&](int k0, int lo, int hi) {
#pragma unroll
        for (int j = 0; j < NLD; ++j) {  // K first: the scores need it first
            const int i = tid + NT * j;
            const int r = i / ROWV, c = i % ROWV;
            if (lo == k0) kr[j] = make_uint4(0u, 0u, 0u, 0u);
            if (k0 + r >= lo && k0 + r < hi)
                kr[j] = strata_ldcg_stream_u4(reinterpret_cast<const uint4*>(kc + ((size_t)(k0 + r) * (size_t)kv_heads + kvh) * HD) + c);
        }
        if (I8 && tid < TK) {
            if (lo == k0) ksr = 0.0f;
            if (k0 + tid >= lo && k0 + tid < hi) ksr = strata_ldcg_stream_f32(ks + (size_t)(k0 + tid) * (size_t)kv_heads + kvh);
        }
#pragma unroll
        for (int j = 0; j < NLD; ++j) {
            const int i = tid + NT * j;
            const int r = i / ROWV, c = i % ROWV;
            if (lo == k0) vr[j] = make_uint4(0u, 0u, 0u, 0u);
            if (k0 + r >= lo && k0 + r < hi)
                vr[j] = strata_ldcg_stream_u4(reinterpret_cast<const uint4*>(vc + ((size_t)(k0 + r) * (size_t)kv_heads + kvh) * HD) + c);
        }
        if (I8 && tid < TK) {
            if (lo == k0) vsr = 0.0f;
            if (k0 + tid >= lo && k0 + tid < hi) vsr = strata_ldcg_stream_f32(vs + (size_t)(k0 + tid) * (size_t)kv_heads + kvh);
        }
    };
    auto load_tile = [&](int k0) { load_keys(k0, k0, kstop); };
    // K registers -> k_s (rows cut into DSQ padded segments), its scales -> ksc_s.
    auto store_k = [&]() {
#pragma unroll
        for (int j = 0; j < NLD; ++j) {
            const int i = tid + NT * j;
            const int r = i / ROWV, c = i % ROWV;
            *reinterpret_cast<uint4*>(k_s + r * KRS + (c / CPS) * (SEGB + 16) + (c % CPS) * 16) = kr[j];
        }
        if (tid < TK) ksc_s[tid] = ksr;
    };
    // Programmatic dependent launch (prewait): the first tile's keys before
    // start_pos are in the cache before the kernel before this one
    // (attn_qkv_prep, which triggers only after its own wait) starts, so
    // they are read before the wait; the key at start_pos (appended by that
    // kernel) and the queries after it.
    if (prewait) {
        load_keys(kbeg, kbeg, min(kstop, start_pos));
        strata_pdl_wait();
        if (start_pos < kbeg + TK) load_keys(kbeg, start_pos, kstop);  // (a no-op when kstop <= start_pos)
    } else {
        load_tile(kbeg);
    }
    float4 qr[QPT];
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
        const int idx = tid + NT * i;
        qr[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (idx < QV && idx / (HD / 4) < qn) qr[i] = reinterpret_cast<const float4*>(q + (size_t)hb * HD)[idx];
    }

    // Queries -> q_s [GB][DSQ][DPT + 4] (the padding makes the DSQ segments' reads conflict-free).
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
        const int idx = tid + NT * i;
        if (idx < QV) {
            const int g = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
            *reinterpret_cast<float4*>(q_s + g * QGS + (d / DPT) * (DPT + 4) + d % DPT) = qr[i];
        }
    }
    if (tid < GB) l_s[tid] = 0.0f;
    if (tid == 0) {
        keep_s[0] = nsplit;
        keep_s[1] = hb;
        keep_s[2] = qn;
    }
    store_k();

    const int kk = tid / DSQ, seg = tid % DSQ;         // scores: key of the tile, K segment
    const int ksb = tid / LPR, d0 = (tid % LPR) * DV;  // P V: key subset, first dim
    float m_run[GB];                                   // running max per query (the same in every thread)
    float acc[GB][DV];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        m_run[g] = ATTN_NEG_INF;
#pragma unroll
        for (int j = 0; j < DV; ++j) acc[g][j] = 0.0f;
    }

    for (int k0 = kbeg; k0 < kstop; k0 += TK) {
        __syncthreads();  // this tile's K (and q_s, l_s) stored; the previous tile's P V done (v_s, p_s free)
        const int nvalid = min(TK, kstop - k0);
        const bool more = k0 + TK < kstop;

        // Scores of key kk: this thread's DPT dims, then the sum over the key's DSQ threads.
        float s[GB];
#pragma unroll
        for (int g = 0; g < GB; ++g) s[g] = 0.0f;
        if (warp * (32 / DSQ) < nvalid) {  // (warp-uniform) a warp whose keys are all past the range skips this
            const unsigned char* krow = k_s + kk * KRS + seg * (SEGB + 16);
            const float* qb = q_s + seg * (DPT + 4);
#pragma unroll
            for (int c = 0; c < CPS; ++c) {
                float kf[EPV];
                attn_row_vals16(kc, *reinterpret_cast<const uint4*>(krow + c * 16), kf);
#pragma unroll
                for (int e = 0; e < EPV; e += 4) {
#pragma unroll
                    for (int g = 0; g < GB; ++g) {
                        const float4 q4 = *reinterpret_cast<const float4*>(qb + g * QGS + c * EPV + e);
                        s[g] = fmaf(q4.x, kf[e], s[g]);
                        s[g] = fmaf(q4.y, kf[e + 1], s[g]);
                        s[g] = fmaf(q4.z, kf[e + 2], s[g]);
                        s[g] = fmaf(q4.w, kf[e + 3], s[g]);
                    }
                }
            }
        }
#pragma unroll
        for (int o = 1; o < DSQ; o <<= 1)
#pragma unroll
            for (int g = 0; g < GB; ++g) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
        const bool valid = kk < nvalid;
        const float kscale = ksc_s[kk];
        float red[GB];
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            s[g] = valid ? s[g] * kscale * scale : ATTN_NEG_INF;
            red[g] = s[g];
        }
        // Max over the tile: the warp's keys (lanes DSQ apart), then (below) the warps in order.
#pragma unroll
        for (int o = DSQ; o < 32; o <<= 1)
#pragma unroll
            for (int g = 0; g < GB; ++g) red[g] = fmaxf(red[g], __shfl_xor_sync(0xffffffffu, red[g], o));
        if (lane == 0) attn_row_st<GB>(redm_s + warp * GB, red);
#pragma unroll
        for (int j = 0; j < NLD; ++j) {
            const int i = tid + NT * j;
            *reinterpret_cast<uint4*>(v_s + i * 16) = vr[j];  // row i / ROWV, vector i % ROWV
        }
        if (tid < TK) vsc_s[tid] = vsr;
        __syncthreads();
        if (more) load_tile(k0 + TK);  // the next tile, in flight during this one's math
        // The new max per query (every thread alike: the warps' maxima in warp order) and the rescale.
        float corr[GB];
        {
            float t[GB];
            attn_row_ld<GB>(redm_s, t);
#pragma unroll
            for (int w = 1; w < NW; ++w) {
                float x[GB];
                attn_row_ld<GB>(redm_s + w * GB, x);
#pragma unroll
                for (int g = 0; g < GB; ++g) t[g] = fmaxf(t[g], x[g]);
            }
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                const float m_new = fmaxf(m_run[g], t[g]);  // finite: the tile has a valid key
                corr[g] = expf(m_run[g] - m_new);
                m_run[g] = m_new;
            }
        }
#pragma unroll
        for (int g = 0; g < GB; ++g) red[g] = valid ? expf(s[g] - m_run[g]) : 0.0f;
        if (seg == 0) {
            const float vscale = vsc_s[kk];
            float pv[GB];
#pragma unroll
            for (int g = 0; g < GB; ++g) pv[g] = red[g] * vscale;
            attn_row_st<GB>(p_s + kk * GB, pv);
        }
#pragma unroll
        for (int o = DSQ; o < 32; o <<= 1)
#pragma unroll
            for (int g = 0; g < GB; ++g) red[g] += __shfl_xor_sync(0xffffffffu, red[g], o);
        if (lane == 0) attn_row_st<GB>(reds_s + warp * GB, red);
        __syncthreads();
        if (tid < GB) {
            float t = reds_s[tid], c = corr[0];
#pragma unroll
            for (int w = 1; w < NW; ++w) t += reds_s[w * GB + tid];
#pragma unroll
            for (int g = 1; g < GB; ++g)
                if (tid == g) c = corr[g];
            l_s[tid] = l_s[tid] * c + t;
        }

        // acc = acc * corr + P V over this thread's key subset.
#pragma unroll
        for (int g = 0; g < GB; ++g)
#pragma unroll
            for (int j = 0; j < DV; ++j) acc[g][j] *= corr[g];
#pragma unroll 4
        for (int k = ksb; k < nvalid; k += KSUB) {
            float vf[DV];
            attn_row_vals<DV>(vc, v_s + (k * HD + d0) * S::VB, vf);
            float pk[GB];
            attn_row_ld<GB>(p_s + k * GB, pk);
#pragma unroll
            for (int g = 0; g < GB; ++g)
#pragma unroll
                for (int j = 0; j < DV; ++j) acc[g][j] = fmaf(pk[g], vf[j], acc[g][j]);
        }
        if (more) store_k();  // k_s is free since the scores (the barrier after them)
    }

    // Sum of the key subsets (in subset order); then the output (one split) or this split's partial.
    __syncthreads();  // the tile is consumed (red_o overlays it); l_s final
    if (tid == 0)
#pragma unroll
        for (int g = 0; g < GB; ++g) m_s[g] = m_run[g];
#pragma unroll
    for (int g = 0; g < GB; ++g) attn_row_st<DV>(red_o + (ksb * GB + g) * HD + d0, acc[g]);
    __syncthreads();
    const int nsplit_b = keep_s[0], hb_b = keep_s[1], qn_b = keep_s[2];
    const bool single = nsplit_b == 1;
    const bool keys = !CL || split < nsplit_b;  // (CL: a block past the key range writes nothing of its own)
    for (int item = tid; item < GB * (HD / 4); item += NT) {
        const int g = item / (HD / 4), d = (item % (HD / 4)) * 4;
        if (g >= qn_b) continue;
        float4 o = *reinterpret_cast<const float4*>(red_o + g * HD + d);
#pragma unroll
        for (int sb = 1; sb < KSUB; ++sb) {
            const float4 x = *reinterpret_cast<const float4*>(red_o + (sb * GB + g) * HD + d);
            o.x += x.x;
            o.y += x.y;
            o.z += x.z;
            o.w += x.w;
        }
        const size_t h = (size_t)(hb_b + g);
        if (single) {
            const float inv = 1.0f / l_s[g];
            if (keys)
                *reinterpret_cast<float4*>(out + h * HD + d) =
                    make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        } else if (CL) {
            // The block's partial stays in its shared memory (the first key subset's rows: each column is
            // read and written by this thread alone) for the cluster's merge.
            *reinterpret_cast<float4*>(red_o + g * HD + d) = o;
        } else {
            const size_t row = (size_t)split * heads + h;
            *reinterpret_cast<float4*>(part_acc + row * HD + d) = o;
            if (d == 0) {
                part_ml[row * 2] = m_s[g];
                part_ml[row * 2 + 1] = l_s[g];
            }
        }
    }
    if (single) return;
    if (CL) {
        attn_rowc_merge<HD, GB>(red_o, m_s, l_s, split, nsplit_b, heads, hb_b, qn_b, out, part_acc, part_ml,
                                attn_row_counters(counters, kvh, part), flag_s);
        return;
    }

    // Merge: one level (few splits): the (kv head, part)'s last block merges every split; else the group's
    // last block merges its splits, the (kv head, part)'s last group merger the groups.
    const int one = nsplit_b <= one_level;
    const int gsz = one ? nsplit_b : ATTN_ROW_GS;
    const int ngroups = (nsplit_b + gsz - 1) / gsz;
    const int grp = split / gsz;
    const int gbeg = grp * gsz, gn = min(gsz, nsplit_b - gbeg);
    unsigned int* cnt = attn_row_counters(counters, kvh, part);
    if (!attn_row_arrive(cnt + 1 + grp, (unsigned int)gn, flag_s)) return;
    attn_row_merge<HD, GB>(part_acc, part_ml, gbeg, gn, heads, hb_b, qn_b, ngroups == 1, out, gridDim.x + grp);
    if (ngroups == 1) return;
    if (!attn_row_arrive(cnt, (unsigned int)ngroups, flag_s)) return;
    attn_row_merge<HD, GB>(part_acc, part_ml, gridDim.x, ngroups, heads, hb_b, qn_b, true, out, 0);
}

#define ATTN_ROW_INSTANCE(HD, KVNAME, KV, GB, NAME, CL)                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_ROW_THREADS, ATTN_ROW_MINB)                                 \
        NAME##_hd##HD##_##KVNAME##_g##GB(                                                                         \
            const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,                    \
            const float* __restrict__ ks, const float* __restrict__ vs, float* __restrict__ out,                  \
            float* __restrict__ part_acc, float* __restrict__ part_ml, unsigned int* __restrict__ counters,       \
            int heads, int kv_heads, int start_pos, int chunk, float scale, const int* __restrict__ step,         \
            int one_level, int prewait) {                                                                         \
        strata_pdl_trigger(); /* attn_row waits (strata_pdl_wait) */                                              \
        attn_row<HD, KV, GB, CL>(q, kc, vc, ks, vs, out, part_acc, part_ml, counters, heads, kv_heads, start_pos, \
                                 chunk, scale, step, one_level, prewait);                                         \
    }

#define ATTN_ROW_INSTANCES(HD, NAME, CL)                    \
    ATTN_ROW_INSTANCE(HD, i8, int8_t, 1, NAME, CL)          \
    ATTN_ROW_INSTANCE(HD, i8, int8_t, 2, NAME, CL)          \
    ATTN_ROW_INSTANCE(HD, i8, int8_t, 4, NAME, CL)          \
    ATTN_ROW_INSTANCE(HD, bf16, __nv_bfloat16, 1, NAME, CL) \
    ATTN_ROW_INSTANCE(HD, bf16, __nv_bfloat16, 2, NAME, CL) \
    ATTN_ROW_INSTANCE(HD, bf16, __nv_bfloat16, 4, NAME, CL)

ATTN_ROW_INSTANCES(16, attn_row, false)
ATTN_ROW_INSTANCES(32, attn_row, false)
ATTN_ROW_INSTANCES(64, attn_row, false)
ATTN_ROW_INSTANCES(128, attn_row, false)
ATTN_ROW_INSTANCES(256, attn_row, false)
// attn_rowc_*: in thread-block clusters, sm_90 and later only (the wrapper launches it nowhere else).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
ATTN_ROW_INSTANCES(16, attn_rowc, true)
ATTN_ROW_INSTANCES(32, attn_rowc, true)
ATTN_ROW_INSTANCES(64, attn_rowc, true)
ATTN_ROW_INSTANCES(128, attn_rowc, true)
ATTN_ROW_INSTANCES(256, attn_rowc, true)
#endif

// ------------------------------------------------- q / k / v preparation --
//
// attn_qkv_prep_{i8,bf16}: the attention block's per-row preparation in one
// launch, from one projection qkv [rows, W], row = [q' | k | v], W = q'dim +
// 2 * kv_heads * head_dim, q' = q [heads * head_dim] or (gated) per head
// [q_h | gate_h]:
//   qn [rows, heads, head_dim] = rope(rmsnorm(q, q_norm)),
//   gate [rows, heads * head_dim] = the gate halves (gated only),
//   K = rope(rmsnorm(k, k_norm)) and V appended at positions start_pos + t.
// One warp per (row, head): warps j < heads of a row take query head j,
// the others kv head j - heads (K through a per-warp shared row, then V).
// The norm and RoPE are strata_rmsnorm_rope_row (common.cuh), the function
// dense_rmsnorm_rope calls, and the append is attn_append_row (attn_kv_append_*'s): the
// same bits as split_q_gate + rmsnorm_rope (q, k) + kv_append.

#define ATTN_PREP_WARPS 8

// The register path of a prep warp (head_dim and half multiples of 32,
// head_dim <= 256: lane l holds elements l + 32 u, u < NV, and element i <
// half pairs with i + half in the same lane). Every value the warp needs is
// requested in one round trip (the norm weights, the RoPE frequencies and
// the position before the programmatic wait: nothing before this kernel
// writes them), then normed, roped and appended from registers: the
// operations of strata_rmsnorm_rope_row and attn_append_row in their order,
// so the same bits as the generic path below.
template <int NV, int HU>
static __device__ __forceinline__ void attn_prep_norm_rope(const float (&x)[NV], const float (&w)[NV],
                                                           const float (&f)[NV], int head_dim, float eps,
                                                           unsigned long long pos, float attention_factor,
                                                           float (&o)[NV]) {
    static_assert(HU >= 1 && 2 * HU <= NV, "rotary pairs within the head");
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < NV; ++u) ss = fmaf(x[u], x[u], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float inv = strata_rms_inv(ss, head_dim, eps);
#pragma unroll
    for (int u = 0; u < HU; ++u) {
        float a = strata_normed(x[u], inv, w[u]);
        float b = strata_normed(x[u + HU], inv, w[u + HU]);
        strata_rope_pair(a, b, f[u], pos, attention_factor);
        o[u] = a;
        o[u + HU] = b;
    }
#pragma unroll
    for (int u = 2 * HU; u < NV; ++u) o[u] = strata_normed(x[u], inv, w[u]);
}

// attn_append_row of the values a warp holds (element lane + 32 u in v[u]).
template <int NV>
static __device__ __forceinline__ void attn_prep_append(const float (&v)[NV], int8_t* __restrict__ cache,
                                                        float* __restrict__ scales, size_t block, int head_dim,
                                                        int lane) {
    float amax = 0.0f;
#pragma unroll
    for (int u = 0; u < NV; ++u) amax = fmaxf(amax, fabsf(v[u]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float scale = amax / 127.0f;
    int8_t* dst = cache + block * (size_t)head_dim;
#pragma unroll
    for (int u = 0; u < NV; ++u) {
        float qv = 0.0f;
        if (scale > 0.0f) qv = fminf(fmaxf(rintf(v[u] / scale), -127.0f), 127.0f);
        dst[lane + 32 * u] = (int8_t)(int)qv;
    }
    if (lane == 0) scales[block] = scale;
}

template <int NV>
static __device__ __forceinline__ void attn_prep_append(const float (&v)[NV], __nv_bfloat16* __restrict__ cache,
                                                        float*, size_t block, int head_dim, int lane) {
    __nv_bfloat16* dst = cache + block * (size_t)head_dim;
#pragma unroll
    for (int u = 0; u < NV; ++u) dst[lane + 32 * u] = __float2bfloat16_rn(v[u]);
}

template <typename KV, int NV, int HU>
static __device__ __forceinline__ void attn_qkv_prep_regs(
    const float* __restrict__ qkv, const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
    const float* __restrict__ inv_freq, int half, float attention_factor, float* __restrict__ qn,
    float* __restrict__ gate, KV* __restrict__ kc, KV* __restrict__ vc, float* __restrict__ ks,
    float* __restrict__ vs, int heads, int kv_heads, int head_dim, int gated, unsigned long long start_pos,
    const int* __restrict__ step, int late_trigger, long long t, int j, int lane) {
    const bool is_q = j < heads;
    const float* wn = is_q ? q_norm : k_norm;
    float w[NV], f[NV];
#pragma unroll
    for (int u = 0; u < NV; ++u) {
        w[u] = __ldg(wn + lane + 32 * u);
        f[u] = u < HU ? __ldg(inv_freq + lane + 32 * u) : 0.0f;
    }
    if (step != nullptr) start_pos = (unsigned long long)__ldg(step);  // set before the step's first kernel
    strata_pdl_wait();
    if (late_trigger) strata_pdl_trigger();
    const int qhd = gated ? 2 * head_dim : head_dim;  // floats of one query head in qkv
    const size_t qw = (size_t)heads * qhd, kv_dim = (size_t)kv_heads * head_dim;
    const float* row = qkv + (size_t)t * (qw + 2 * kv_dim);
    const unsigned long long pos = start_pos + (unsigned long long)t;
    const int kh = j - heads;
    const float* xr = is_q ? row + (size_t)j * qhd : row + qw + (size_t)kh * head_dim;
    // The second row: the gate half (gated query heads) or V (kv heads).
    const float* yr = is_q ? (gated ? xr + head_dim : nullptr) : row + qw + kv_dim + (size_t)kh * head_dim;
    float x[NV], y[NV], o[NV];
#pragma unroll
    for (int u = 0; u < NV; ++u) {
        x[u] = __ldcg(xr + lane + 32 * u);
        y[u] = yr != nullptr ? __ldcg(yr + lane + 32 * u) : 0.0f;
    }
    attn_prep_norm_rope<NV, HU>(x, w, f, head_dim, eps, pos, attention_factor, o);
    if (is_q) {
        const size_t orow = ((size_t)t * heads + j) * head_dim;
#pragma unroll
        for (int u = 0; u < NV; ++u) qn[orow + lane + 32 * u] = o[u];
        if (gated)
#pragma unroll
            for (int u = 0; u < NV; ++u) gate[orow + lane + 32 * u] = y[u];
    } else {
        const size_t block = (size_t)pos * (size_t)kv_heads + (size_t)kh;
        attn_prep_append<NV>(o, kc, ks, block, head_dim, lane);
        attn_prep_append<NV>(y, vc, vs, block, head_dim, lane);
    }
}

template <typename KV>
static __device__ __forceinline__ void attn_qkv_prep(const float* __restrict__ qkv, const float* __restrict__ q_norm,
                                                     const float* __restrict__ k_norm, float eps,
                                                     const float* __restrict__ inv_freq, int half,
                                                     float attention_factor, float* __restrict__ qn,
                                                     float* __restrict__ gate, KV* __restrict__ kc,
                                                     KV* __restrict__ vc, float* __restrict__ ks,
                                                     float* __restrict__ vs, int rows, int heads, int kv_heads,
                                                     int head_dim, int gated, unsigned long long start_pos,
                                                     const int* __restrict__ step, int late_trigger) {
    __shared__ float krow_s[ATTN_PREP_WARPS][256];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const long long warp = (long long)blockIdx.x * ATTN_PREP_WARPS + wib;
    const int per_row = heads + kv_heads;
    if (warp >= (long long)rows * per_row) {
        strata_pdl_wait();
        if (late_trigger) strata_pdl_trigger();
        return;
    }
    const long long t = warp / per_row;
    const int j = (int)(warp % per_row);
    // The register path for the common shapes (full RoPE, or a rotary
    // half of 32); any other takes the generic path below.
    const int nv = head_dim % 32 == 0 && half % 32 == 0 ? head_dim / 32 : 0, hu = half / 32;
#define ATTN_PREP_REGS(NV, HU)                                                                                 \
    if (nv == NV && hu == HU) {                                                                                \
        attn_qkv_prep_regs<KV, NV, HU>(qkv, q_norm, k_norm, eps, inv_freq, half, attention_factor, qn, gate, kc, \
                                       vc, ks, vs, heads, kv_heads, head_dim, gated, start_pos, step,          \
                                       late_trigger, t, j, lane);                                              \
        return;                                                                                                \
    }
    ATTN_PREP_REGS(2, 1)
    ATTN_PREP_REGS(4, 2)
    ATTN_PREP_REGS(4, 1)
    ATTN_PREP_REGS(8, 4)
    ATTN_PREP_REGS(8, 1)
    ATTN_PREP_REGS(8, 2)
#undef ATTN_PREP_REGS
    strata_pdl_wait();
    if (late_trigger) strata_pdl_trigger();
    if (step != nullptr) start_pos = (unsigned long long)step[0];  // (CUDA-graph replay) start_pos on the device
    const int qhd = gated ? 2 * head_dim : head_dim;  // floats of one query head in qkv
    const size_t qw = (size_t)heads * qhd, kv_dim = (size_t)kv_heads * head_dim;
    const float* row = qkv + (size_t)t * (qw + 2 * kv_dim);
    const unsigned long long pos = start_pos + (unsigned long long)t;
    if (j < heads) {
        const float* xr = row + (size_t)j * qhd;
        const size_t orow = ((size_t)t * heads + j) * head_dim;
        strata_rmsnorm_rope_row(xr, q_norm, qn + orow, head_dim, eps, inv_freq, half, pos, attention_factor, lane);
        if (gated)
            for (int d = lane; d < head_dim; d += 32) gate[orow + d] = xr[head_dim + d];
    } else {
        const int kh = j - heads;
        float* kb = krow_s[wib];
        strata_rmsnorm_rope_row(row + qw + (size_t)kh * head_dim, k_norm, kb, head_dim, eps, inv_freq, half, pos,
                              attention_factor, lane);
        __syncwarp();
        const size_t block = (size_t)pos * (size_t)kv_heads + (size_t)kh;
        attn_append_row(kb, kc, ks, block, head_dim, lane);
        attn_append_row(row + qw + kv_dim + (size_t)kh * head_dim, vc, vs, block, head_dim, lane);
    }
}

#define ATTN_PREP_INSTANCE(KVNAME, KV)                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_PREP_WARPS * 32) attn_qkv_prep_##KVNAME(                    \
        const float* __restrict__ qkv, const float* __restrict__ q_norm, const float* __restrict__ k_norm,        \
        float eps, const float* __restrict__ inv_freq, int half, float attention_factor, float* __restrict__ qn,  \
        float* __restrict__ gate, KV* __restrict__ kc, KV* __restrict__ vc, float* __restrict__ ks,               \
        float* __restrict__ vs, int rows, int heads, int kv_heads, int head_dim, int gated,                       \
        unsigned long long start_pos, const int* __restrict__ step, int late_trigger) {                           \
        /* late_trigger: the attention after it reads the cache before its wait, so it starts only after */       \
        /* this one's wait (every kernel before this one has finished then). attn_qkv_prep waits */               \
        /* (strata_pdl_wait) in every thread after its loads of constants, then triggers (late_trigger). */       \
        if (!late_trigger) strata_pdl_trigger();                                                                  \
        attn_qkv_prep<KV>(qkv, q_norm, k_norm, eps, inv_freq, half, attention_factor, qn, gate, kc, vc, ks, vs,   \
                          rows, heads, kv_heads, head_dim, gated, start_pos, step, late_trigger);                 \
    }

ATTN_PREP_INSTANCE(i8, int8_t)
ATTN_PREP_INSTANCE(bf16, __nv_bfloat16)
