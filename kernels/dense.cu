// Dense and elementwise kernels of the forward pass (see kernels/README.md):
// BF16 GEMV for decode (T <= 8 rows), x -> bf16 for the cuBLAS GEMM of
// prefill, RMSNorm (also per head), RoPE (NeoX pairs, partial rotary, YaRN
// through precomputed inverse frequencies), the elementwise ops of both
// architectures, the embedding gather, the non-finite guard and greedy argmax.
// The CPU reference is src/backend/cpu/{ops,next_ops}.rs; where it matters the
// arithmetic is spelled out with __fmul_rn / __fadd_rn so nvcc does not fuse
// into FMAs the CPU does not have.
#include "common.cuh"

// ---------------------------------------------------------------------------
// Helpers (file-local, dense_ prefix: one translation unit with the others).

static __device__ __forceinline__ float dense_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread
// gets the result. `scratch` holds 32 floats. Fixed order: deterministic.
static __device__ __forceinline__ float dense_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = dense_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float s = lane < warps ? scratch[lane] : 0.0f;
    return dense_warp_sum(s);
}

static __device__ __forceinline__ float dense_sigmoid_f(float x) {
    // next_ops::sigmoid: 1 / (1 + exp(-x))
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}

// 16 bytes of a weight row, read once: no L1 allocation (x stays in L1),
// under the L2 policy pol (dense_gemv_body's).
static __device__ __forceinline__ uint4 dense_ld_stream(const uint4* p, uint64_t pol) {
    return strata_ld_hint_u4<true>(p, pol);
}

// Matrices of at least this many weights are streamed (L2 evict-first, see
// common.cuh); smaller ones (a router: E x H) keep the default priority, so
// they can stay in L2 from one step to the next.
#define DENSE_STREAM_MIN_WEIGHTS (1ll << 20)

// Steps of the k loop whose weights a GEMV warp loads before its
// programmatic wait.
#ifndef DENSE_PRE_STEPS
#define DENSE_PRE_STEPS 1
#endif

// bf16 element 2j of a word is its low half (little endian).
static __device__ __forceinline__ float dense_bf16_lo(unsigned int u) { return __uint_as_float(u << 16); }
static __device__ __forceinline__ float dense_bf16_hi(unsigned int u) { return __uint_as_float(u & 0xffff0000u); }

// ---------------------------------------------------------------------------
// GEMV: out[t, n] (+)= sum_k x[t, k] * W[n, k] for t < T <= 8 (accumulate != 0:
// added to out, the residual add of o_proj / down), W bf16 [N, K],
// K % 8 == 0. A block is DENSE_GEMV_WARPS warps; `ksplit` consecutive warps
// share ROWS rows of W and split K between them (ksplit in {1, 2, 4, 8}, so
// small N still fills the SMs); each lane reads 16 bytes (8 weights) of each
// of its ROWS rows per step, consecutive lanes consecutive 16 bytes
// (coalesced 512 B per row per warp), and applies them to all T rows of x
// (read as float4 from L1/L2). Partial sums: per lane in k order, then a warp
// butterfly, then the ksplit warps in warp order through shared memory.
//
// STAGED (T == 1; dense_gemv_staged_*): every step of a warp's weights is
// requested into shared memory (cp.async, dynamic smem DENSE_GEMV_WARPS *
// steps * ROWS * 512 bytes, steps = ceil(K / 8 / (32 ksplit))) before the
// programmatic wait, so a grid that fits one wave has every weight of the
// matrix in flight at once while the kernel before it ends; registers then
// hold one row's 16 bytes at a time, not a step's ROWS. Same sums in the
// same order as the unstaged body.

#define DENSE_GEMV_WARPS 8

// The input RMSNorm a GEMV may apply itself (NORM; T == 1): x is the raw
// residual row, and the product uses rmsnorm(x) = x * inv * g, inv =
// 1 / sqrt(mean(x^2) + eps) computed by every block (x is a few KB, read
// through L2), in dense_rmsnorm_vec's operations per element. Block 0 also
// writes the normed row to `normed` (non-null: later kernels read it) and
// sets the non-finite guard of x (flags non-null: flags[slot] = min flat
// index of a NaN/inf, as dense_first_nonfinite).
struct DenseNormIn {
    const float* g;
    float eps;
    unsigned int* flags;
    int slot;
    float* normed;
};

template <int T, int ROWS, int UNROLL, bool NORM, bool STAGED = false>
static __device__ __forceinline__ void dense_gemv_body(const float* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ w,
                                                       float* __restrict__ out, int N, int K, int ksplit,
                                                       int accumulate, DenseNormIn nin) {
    static_assert(!NORM || T == 1, "the fused norm is for one row");
    static_assert(!STAGED || T == 1, "the staged weights are for one row");
    extern __shared__ uint4 dense_stage[];  // STAGED: [warp][step][row][lane]
    __shared__ float red[DENSE_GEMV_WARPS][ROWS * T];
    __shared__ float norm_scratch[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = DENSE_GEMV_WARPS / ksplit;
    const int group = warp / ksplit, part = warp % ksplit;
    const long long row0 = ((long long)blockIdx.x * groups + group) * ROWS;

    // Row r's 16-byte vectors: rows past N read row N-1 (in bounds) and are
    // never stored. (STAGED: one base pointer and offsets; ROWS 64-bit
    // pointers cost its wider variants registers.)
    const uint4* wrow_p[STAGED ? 1 : ROWS];
#pragma unroll
    for (int r = 0; r < (STAGED ? 0 : ROWS); ++r) {
        const long long n = min(row0 + r, (long long)N - 1);
        wrow_p[r] = reinterpret_cast<const uint4*>(w + n * (long long)K);
    }
    const uint4* wbase = reinterpret_cast<const uint4*>(w + min(row0, (long long)N - 1) * (long long)K);
    const int rows_here = (int)min((long long)ROWS, (long long)N - min(row0, (long long)N - 1));
    auto wrow = [&](int r) {
        return STAGED ? wbase + (size_t)min(r, rows_here - 1) * (size_t)(K >> 3) : wrow_p[STAGED ? 0 : r];
    };
    float acc[ROWS][T];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

    const int kvec = K >> 3;  // groups of 8 weights per row
    const int v_first = part * 32 + lane, v_step = ksplit * 32;
    // A matrix this large is read once a step: its loads are L2 evict-first
    // (common.cuh). Launched as a programmatic dependent launch, and W is
    // constant: this warp's first DENSE_PRE_STEPS steps of weights are loaded
    // into registers before waiting for the kernel that writes x (under
    // NORM, their latency then also overlaps the norm). A small matrix (a
    // router) is also requested into L2 whole, one prefetch per 128-byte
    // line; a large one is not: those prefetches made a decode step slower
    // (docs/performance.md, fifteenth session).
    const bool streamed = (long long)N * K >= DENSE_STREAM_MIN_WEIGHTS;
    const uint64_t pol = streamed ? strata_l2_policy<true>() : strata_l2_policy<false>();
    strata_pdl_trigger();
    if (!streamed && (lane & 7) == 0) {
        for (int v = v_first; v < kvec; v += v_step) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow(r) + v));
        }
    }
    const int steps = (kvec + v_step - 1) / v_step;  // of the block's warps (a warp may have one fewer)
    uint4* stage = dense_stage + (size_t)warp * steps * ROWS * 32 + lane;
    if (STAGED) {
        for (int p = 0, v = v_first; v < kvec; ++p, v += v_step)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) strata_cp_async16(stage + (p * ROWS + r) * 32, wrow(r) + v, pol);
    }
    uint4 w_pre[STAGED ? 1 : DENSE_PRE_STEPS][ROWS];
#pragma unroll
    for (int p = 0; p < (STAGED ? 0 : DENSE_PRE_STEPS); ++p) {
        const int v = v_first + p * v_step;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w_pre[p][r] = v < kvec ? dense_ld_stream(wrow(r) + v, pol) : make_uint4(0u, 0u, 0u, 0u);
    }
    strata_pdl_wait();
    // Thread i < groups * ROWS * T writes output i of the block (at most one
    // a thread); its residual (accumulate) is requested now, after the wait,
    // into shared memory: after the reduction it was a dependent read at the
    // end of the block's chain.
    // (One row, a decode step: with more, the T - 1 more outputs' state
    // costs the loop registers.)
    static_assert(ROWS * T <= 32, "one output a thread");
    constexpr bool EARLY = T == 1;
    __shared__ float prev[EARLY ? DENSE_GEMV_WARPS * ROWS : 1];
    auto item_out = [&](int i) -> float* {
        const int g = i / (ROWS * T), rt = i % (ROWS * T);
        const long long n = ((long long)blockIdx.x * groups + g) * ROWS + rt / T;
        return n < N ? out + (long long)(rt % T) * N + n : nullptr;
    };
    if (EARLY && accumulate && threadIdx.x < groups * ROWS * T) {
        float* o = item_out(threadIdx.x);
        if (o != nullptr) strata_cp_async4(prev + threadIdx.x, o);
    }
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int xstride4 = K >> 2;
    float inv = 1.0f;
    if (NORM) {
        float ss = 0.0f;
        unsigned int bad = 0xffffffffu;
        for (int i = threadIdx.x; i < xstride4; i += blockDim.x) {
            const float4 v = x4[i];
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
            if (bad == 0xffffffffu) {
                const unsigned int base = 4u * (unsigned int)i;
                if (!isfinite(v.x)) bad = base;
                else if (!isfinite(v.y)) bad = base + 1u;
                else if (!isfinite(v.z)) bad = base + 2u;
                else if (!isfinite(v.w)) bad = base + 3u;
            }
        }
        if (nin.flags != nullptr && blockIdx.x == 0 && bad != 0xffffffffu) atomicMin(nin.flags + nin.slot, bad);
        ss = dense_block_sum(ss, norm_scratch);
        inv = strata_rms_inv(ss, K, nin.eps);
        if (nin.normed != nullptr && blockIdx.x == 0) {
            const float4* g4 = reinterpret_cast<const float4*>(nin.g);
            for (int i = threadIdx.x; i < xstride4; i += blockDim.x) {
                const float4 v = x4[i], g = __ldg(g4 + i);
                reinterpret_cast<float4*>(nin.normed)[i] = strata_normed4(v, inv, g);
            }
        }
    }
    // acc += W[rows, 8 v .. 8 v + 8) x[8 v .. 8 v + 8) (normalized under
    // NORM); row r's 16 bytes are wv(r).
    auto step = [&](int v, auto&& wv) {
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float4 xa = __ldg(x4 + (long long)t * xstride4 + 2 * v);
            float4 xb = __ldg(x4 + (long long)t * xstride4 + 2 * v + 1);
            if (NORM) {
                const float4 ga = __ldg(reinterpret_cast<const float4*>(nin.g) + 2 * v);
                const float4 gb = __ldg(reinterpret_cast<const float4*>(nin.g) + 2 * v + 1);
                xa = strata_normed4(xa, inv, ga);
                xb = strata_normed4(xb, inv, gb);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const uint4 u = wv(r);
                float a = acc[r][t];
                a = fmaf(dense_bf16_lo(u.x), xa.x, a);
                a = fmaf(dense_bf16_hi(u.x), xa.y, a);
                a = fmaf(dense_bf16_lo(u.y), xa.z, a);
                a = fmaf(dense_bf16_hi(u.y), xa.w, a);
                a = fmaf(dense_bf16_lo(u.z), xb.x, a);
                a = fmaf(dense_bf16_hi(u.z), xb.y, a);
                a = fmaf(dense_bf16_lo(u.w), xb.z, a);
                a = fmaf(dense_bf16_hi(u.w), xb.w, a);
                acc[r][t] = a;
            }
        }
    };
    if (STAGED) {
        strata_cp_async_wait_all();  // this thread's own copies (and prev)
        for (int p = 0, v = v_first; v < kvec; ++p, v += v_step)
            step(v, [&](int r) { return stage[(p * ROWS + r) * 32]; });
    } else {
        int v = v_first;
#pragma unroll
        for (int p = 0; p < DENSE_PRE_STEPS; ++p) {
            if (v < kvec) step(v, [&](int r) { return w_pre[STAGED ? 0 : p][r]; });
            v += v_step;
        }
#pragma unroll UNROLL
        for (; v < kvec; v += v_step) {
            uint4 wv[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wv[r] = dense_ld_stream(wrow(r) + v, pol);
            step(v, [&](int r) { return wv[r]; });
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float s = dense_warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r * T + t] = s;
        }
    strata_cp_async_wait_all();  // prev
    __syncthreads();
    if (threadIdx.x < groups * ROWS * T) {
        float* o = item_out(threadIdx.x);
        if (o != nullptr) {
            const int g = threadIdx.x / (ROWS * T), rt = threadIdx.x % (ROWS * T);
            float s = 0.0f;
            for (int p = 0; p < ksplit; ++p) s += red[g * ksplit + p][rt];
            *o = accumulate ? __fadd_rn(EARLY ? prev[threadIdx.x] : *o, s) : s;
        }
    }
}

// Four rows of W per warp group (GEMV_ROWS_PER_GROUP in dense.rs). T <= 2:
// two steps of the k loop in flight, 4 / 3 blocks per SM; T >= 3: one step
// (the T x-loads per step already fill the registers), at most 128
// registers so two blocks fit an SM.
#define DENSE_GEMV_KERNEL(T, ROWS, UNROLL, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(DENSE_GEMV_WARPS * 32, MINB)                                \
        dense_gemv_t##T(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,                    \
                        float* __restrict__ out, int N, int K, int ksplit, int accumulate) {                 \
        dense_gemv_body<T, ROWS, UNROLL, false>(x, w, out, N, K, ksplit, accumulate, DenseNormIn{});          \
    }
DENSE_GEMV_KERNEL(1, 4, 2, 4)
DENSE_GEMV_KERNEL(2, 4, 2, 3)
DENSE_GEMV_KERNEL(3, 4, 1, 2)
DENSE_GEMV_KERNEL(4, 4, 1, 2)
DENSE_GEMV_KERNEL(5, 4, 1, 2)
DENSE_GEMV_KERNEL(6, 4, 1, 2)
DENSE_GEMV_KERNEL(7, 4, 1, 2)
DENSE_GEMV_KERNEL(8, 4, 1, 2)

// dense_gemv_t1 of rmsnorm(x) (DenseNormIn above): a decode step's input
// norm costs no launch of its own.
extern "C" __global__ void __launch_bounds__(DENSE_GEMV_WARPS * 32, 4)
    dense_gemv_norm_t1(const float* __restrict__ x, const float* __restrict__ g, float eps,
                       unsigned int* __restrict__ flags, int slot, float* __restrict__ normed,
                       const __nv_bfloat16* __restrict__ w, float* __restrict__ out, int N, int K, int ksplit,
                       int accumulate) {
    dense_gemv_body<1, 4, 2, true>(x, w, out, N, K, ksplit, accumulate, DenseNormIn{g, eps, flags, slot, normed});
}

// The STAGED bodies (see there) for one row, ROWS rows a warp group; dynamic
// smem DENSE_GEMV_WARPS * steps * ROWS * 512 bytes (dense.rs:
// gemv_staged_smem). Arguments as dense_gemv_t1 / dense_gemv_norm_t1.
#define DENSE_GEMV_STAGED(ROWS, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(DENSE_GEMV_WARPS * 32, MINB)                                  \
        dense_gemv_staged_t1_r##ROWS(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,         \
                                     float* __restrict__ out, int N, int K, int ksplit, int accumulate) {      \
        dense_gemv_body<1, ROWS, 1, false, true>(x, w, out, N, K, ksplit, accumulate, DenseNormIn{});          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DENSE_GEMV_WARPS * 32, MINB) dense_gemv_staged_norm_t1_r##ROWS( \
        const float* __restrict__ x, const float* __restrict__ g, float eps, unsigned int* __restrict__ flags,  \
        int slot, float* __restrict__ normed, const __nv_bfloat16* __restrict__ w, float* __restrict__ out,     \
        int N, int K, int ksplit, int accumulate) {                                                            \
        dense_gemv_body<1, ROWS, 1, true, true>(x, w, out, N, K, ksplit, accumulate,                           \
                                                DenseNormIn{g, eps, flags, slot, normed});                     \
    }
DENSE_GEMV_STAGED(4, 5)
DENSE_GEMV_STAGED(8, 5)
DENSE_GEMV_STAGED(16, 4)

// The simple path for any K (K % 8 != 0): one warp per output (t, n), lanes
// stride over k, scalar loads. grid = (ceil(N / 8), T), block = 256.
extern "C" __global__ void dense_matmul_simple(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                               float* __restrict__ out, int N, int K, int accumulate) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long n = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
    const int t = blockIdx.y;
    if (n >= N) return;
    const float* xr = x + (long long)t * K;
    const __nv_bfloat16* wr = w + n * (long long)K;
    float s = 0.0f;
    for (int k = lane; k < K; k += 32) s = fmaf(__bfloat162float(wr[k]), xr[k], s);
    s = dense_warp_sum(s);
    if (lane == 0) {
        float* o = out + (long long)t * N + n;
        *o = accumulate ? __fadd_rn(*o, s) : s;
    }
}

// out[i] = bf16(x[i]), round to nearest even (half::bf16::from_f32).
extern "C" __global__ void dense_f32_to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                             unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __float2bfloat16_rn(x[i]);
}

// x as a pair of bf16: hi = bf16(x), lo = bf16(x - hi) (about 16 significant
// bits together; the accurate GEMM multiplies both and adds).
extern "C" __global__ void dense_split_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ hi,
                                            __nv_bfloat16* __restrict__ lo, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        const __nv_bfloat16 h = __float2bfloat16_rn(v);
        hi[i] = h;
        lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
    }
}

// ---------------------------------------------------------------------------
// RMSNorm: out = x * (1 / sqrt(mean(x^2) + eps)) * w, per row of `width`
// (ops::rmsnorm; zero-centered norms arrive with 1 already added to w).

// One warp per row, DENSE_GEMV_WARPS rows per block: small widths (per-head norms).
extern "C" __global__ void dense_rmsnorm_warp(const float* __restrict__ x, const float* __restrict__ w,
                                              float* __restrict__ out, int rows, int width, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* xr = x + row * width;
    float* orow = out + row * width;
    float ss = 0.0f;
    for (int i = lane; i < width; i += 32) ss = fmaf(xr[i], xr[i], ss);
    ss = dense_warp_sum(ss);
    const float inv = strata_rms_inv(ss, width, eps);
    for (int i = lane; i < width; i += 32) orow[i] = strata_normed(xr[i], inv, w[i]);
}

// One block per row (wide rows: hidden 2048 .. 8192).
extern "C" __global__ void dense_rmsnorm_block(const float* __restrict__ x, const float* __restrict__ w,
                                               float* __restrict__ out, int rows, int width, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float* xr = x + row * width;
    float* orow = out + row * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = dense_block_sum(ss, scratch);
    const float inv = strata_rms_inv(ss, width, eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) orow[i] = strata_normed(xr[i], inv, w[i]);
}

// Wide rows, width % 4 == 0, width <= 4 * 8 * blockDim.x (blockDim.x <= 512):
// one block per row,
// every thread's float4s of x and w loaded before the first use (one memory
// round trip, not a chain of dependent loads). flags != null: also the
// non-finite guard of x (dense_first_nonfinite's flags[slot] = min flat
// index of a NaN/inf), fused so a decode step spends no launch on it.
#define DENSE_NORM_VEC 8
#define DENSE_NORM_VEC_THREADS 512
extern "C" __global__ void __launch_bounds__(DENSE_NORM_VEC_THREADS) dense_rmsnorm_vec(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ out, int width, float eps,
                                             unsigned int* __restrict__ flags, int slot) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + row * width);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* orow = reinterpret_cast<float4*>(out + row * width);
    const int n4 = width >> 2;
    float4 v[DENSE_NORM_VEC], g[DENSE_NORM_VEC];
    // Programmatic dependent launch: the (constant) norm weights are read
    // before waiting for the kernel that writes x.
    strata_pdl_trigger();
#pragma unroll
    for (int u = 0; u < DENSE_NORM_VEC; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n4) g[u] = __ldg(w4 + i);
    }
    strata_pdl_wait();
#pragma unroll
    for (int u = 0; u < DENSE_NORM_VEC; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n4) v[u] = xr[i];
    }
    float ss = 0.0f;
    unsigned int bad = 0xffffffffu;
#pragma unroll
    for (int u = 0; u < DENSE_NORM_VEC; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n4) {
            ss = fmaf(v[u].x, v[u].x, ss);
            ss = fmaf(v[u].y, v[u].y, ss);
            ss = fmaf(v[u].z, v[u].z, ss);
            ss = fmaf(v[u].w, v[u].w, ss);
            if (flags != nullptr && bad == 0xffffffffu) {
                const unsigned int base = (unsigned int)(row * width) + 4u * (unsigned int)i;
                if (!isfinite(v[u].x)) bad = base;
                else if (!isfinite(v[u].y)) bad = base + 1u;
                else if (!isfinite(v[u].z)) bad = base + 2u;
                else if (!isfinite(v[u].w)) bad = base + 3u;
            }
        }
    }
    // A thread's first bad element is its smallest index (i grows with u).
    if (bad != 0xffffffffu) atomicMin(flags + slot, bad);
    ss = dense_block_sum(ss, scratch);
    const float inv = strata_rms_inv(ss, width, eps);
#pragma unroll
    for (int u = 0; u < DENSE_NORM_VEC; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n4) {
            orow[i] = strata_normed4(v[u], inv, g[u]);
        }
    }
}

// x += y, then out = rmsnorm(x) (the residual add fused with the next norm).
// One block per row; each thread re-reads only the x it wrote itself.
extern "C" __global__ void dense_add_rmsnorm(float* __restrict__ x, const float* __restrict__ y,
                                             const float* __restrict__ w, float* __restrict__ out, int rows,
                                             int width, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    float* xr = x + row * width;
    const float* yr = y + row * width;
    float* orow = out + row * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = __fadd_rn(xr[i], yr[i]);
        xr[i] = v;
        ss = fmaf(v, v, ss);
    }
    ss = dense_block_sum(ss, scratch);
    const float inv = strata_rms_inv(ss, width, eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) orow[i] = strata_normed(xr[i], inv, w[i]);
}

// ---------------------------------------------------------------------------
// RoPE in place on x [T, heads, head_dim]: pair (i, i + half) of every head
// of row t, half = rotary_dim / 2, at pos = start_pos + t. The angle is the
// f32 product (float)pos * inv_freq[i] as Rope::cos_sin computes it; cos and
// sin (full-range precise cosf/sinf) are then scaled by attention_factor.
// One thread per pair: grid-stride over T * heads * half.
extern "C" __global__ void dense_rope(float* __restrict__ x, const float* __restrict__ inv_freq,
                                      unsigned long long pairs, int heads, int head_dim, int half,
                                      unsigned long long start_pos, float attention_factor) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; g < pairs; g += stride) {
        const int i = (int)(g % half);
        const unsigned long long head = g / half;  // t * heads + h
        const unsigned long long pos = start_pos + head / heads;
        float c, sn;
        strata_rope_cos_sin(inv_freq[i], pos, attention_factor, c, sn);
        float* hp = x + head * head_dim;
        float a = hp[i], b = hp[i + half];
        strata_rope_rotate(a, b, c, sn);
        hp[i] = a;
        hp[i + half] = b;
    }
}

// The per-head q/k norm and RoPE in one pass (decode: one launch instead of
// two): out = rope(rmsnorm(x)) for x [T, heads, head_dim] by
// strata_rmsnorm_rope_row (common.cuh; attn_qkv_prep shares it). One warp per head
// row, DENSE_GEMV_WARPS rows per block. step: null, or start_pos read from
// step[0] (see attn_* in attention.cu).
extern "C" __global__ void dense_rmsnorm_rope(const float* __restrict__ x, const float* __restrict__ w,
                                              float* __restrict__ out, int rows, int heads, int head_dim, float eps,
                                              const float* __restrict__ inv_freq, int half,
                                              unsigned long long start_pos, float attention_factor,
                                              const int* __restrict__ step) {
    if (step != nullptr) start_pos = (unsigned long long)step[0];  // (CUDA-graph replay) start_pos on the device
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const unsigned long long pos = start_pos + (unsigned long long)(row / heads);
    strata_rmsnorm_rope_row(x + row * head_dim, w, out + row * head_dim, head_dim, eps, inv_freq, half, pos,
                            attention_factor, lane);
}

// ---------------------------------------------------------------------------
// Elementwise (grid-stride over n).

#define DENSE_FOR_EACH(i, n)                                                                               \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);        \
         i += (unsigned long long)gridDim.x * blockDim.x)

// x += y (ops::add).
extern "C" __global__ void dense_add(float* __restrict__ x, const float* __restrict__ y, unsigned long long n) {
    DENSE_FOR_EACH(i, n) x[i] = __fadd_rn(x[i], y[i]);
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) (ops::silu).
extern "C" __global__ void dense_silu_mul(const float* __restrict__ gate, const float* __restrict__ up,
                                          float* __restrict__ out, unsigned long long n) {
    DENSE_FOR_EACH(i, n) {
        const float g = gate[i];
        out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    }
}

// attn *= sigmoid(gate) (next_ops::apply_output_gate).
extern "C" __global__ void dense_output_gate(float* __restrict__ attn, const float* __restrict__ gate,
                                             unsigned long long n) {
    DENSE_FOR_EACH(i, n) attn[i] = __fmul_rn(attn[i], dense_sigmoid_f(gate[i]));
}

// x = sigmoid(x) in place.
extern "C" __global__ void dense_sigmoid(float* __restrict__ x, unsigned long long n) {
    DENSE_FOR_EACH(i, n) x[i] = dense_sigmoid_f(x[i]);
}

// out[t, j] += sigmoid(logit[t]) * y[t, j] for y, out [rows, width] (the
// shared expert's gated add, engine::shared_expert).
extern "C" __global__ void dense_sigmoid_scale_add(float* __restrict__ out, const float* __restrict__ y,
                                                   const float* __restrict__ logit, unsigned long long n,
                                                   int width) {
    DENSE_FOR_EACH(i, n) {
        const float s = dense_sigmoid_f(logit[i / (unsigned long long)width]);
        out[i] = __fadd_rn(out[i], __fmul_rn(s, y[i]));
    }
}

// qg [T, heads, 2 * hd] -> q, gate [T, heads, hd]: per head [q_h | gate_h]
// (next_ops::split_q_gate). n = T * heads * hd.
extern "C" __global__ void dense_split_q_gate(const float* __restrict__ qg, float* __restrict__ q,
                                              float* __restrict__ gate, unsigned long long n, int hd) {
    DENSE_FOR_EACH(i, n) {
        const unsigned long long head = i / (unsigned long long)hd, d = i % (unsigned long long)hd;
        const float* src = qg + head * 2 * hd;
        q[i] = src[d];
        gate[i] = src[hd + d];
    }
}

// out[t, j] = float(table[ids[t], j]); an id >= vocab writes NaN (the
// non-finite guard reports it) instead of reading out of bounds.
extern "C" __global__ void dense_embed(const __nv_bfloat16* __restrict__ table, const unsigned int* __restrict__ ids,
                                       float* __restrict__ out, unsigned long long n, int hidden,
                                       unsigned int vocab) {
    DENSE_FOR_EACH(i, n) {
        const unsigned long long t = i / (unsigned long long)hidden, j = i % (unsigned long long)hidden;
        const unsigned int id = ids[t];
        out[i] = id < vocab ? __bfloat162float(table[(unsigned long long)id * hidden + j]) : __int_as_float(0x7fc00000);
    }
}

// ---------------------------------------------------------------------------
// Non-finite guard: flags[slot] = min(flags[slot], first flat index i with
// x[i] NaN or inf). flags start at 0xffffffff (dense_fill_u32).
extern "C" __global__ void dense_first_nonfinite(const float* __restrict__ x, unsigned long long n,
                                                 unsigned int* __restrict__ flags, int slot) {
    strata_pdl_trigger();
    strata_pdl_wait();
    DENSE_FOR_EACH(i, n) {
        // The lanes of a warp hold consecutive i: only the warp's first bad
        // lane competes (an all-NaN tensor costs one atomic per warp, not
        // one per element).
        const unsigned int bad = __ballot_sync(__activemask(), !isfinite(x[i]));
        if (bad != 0u && (int)(threadIdx.x & 31) == __ffs(bad) - 1) atomicMin(flags + slot, (unsigned int)i);
    }
}

extern "C" __global__ void dense_fill_u32(unsigned int* __restrict__ out, unsigned int value, unsigned long long n) {
    DENSE_FOR_EACH(i, n) out[i] = value;
}

// ---------------------------------------------------------------------------
// Greedy argmax per row of logits [rows, V] (sampling::argmax: the largest
// value, the lowest index on ties), in two deterministic passes so a
// 151936-wide row is read by ~37 blocks at once, not one SM: partials of
// DENSE_ARGMAX_CHUNK elements (16 independent loads in flight per thread),
// then one warp per row over the partials in chunk order.
#define DENSE_ARGMAX_THREADS 256
#define DENSE_ARGMAX_PER_THREAD 16
#define DENSE_ARGMAX_CHUNK (DENSE_ARGMAX_THREADS * DENSE_ARGMAX_PER_THREAD)

static __device__ __forceinline__ bool dense_better(float av, unsigned int ai, float bv, unsigned int bi) {
    return av > bv || (av == bv && ai < bi);
}

static __device__ __forceinline__ void dense_argmax_warp(float& bv, unsigned int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (dense_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// grid (chunks, rows): the best (value, index) of chunk blockIdx.x of row blockIdx.y.
extern "C" __global__ void __launch_bounds__(DENSE_ARGMAX_THREADS)
    dense_argmax_partial(const float* __restrict__ logits, float* __restrict__ part_v,
                         unsigned int* __restrict__ part_i, int V) {
    __shared__ float sv[DENSE_ARGMAX_THREADS / 32];
    __shared__ unsigned int si[DENSE_ARGMAX_THREADS / 32];
    const float* row = logits + (long long)blockIdx.y * V;
    const int base = blockIdx.x * DENSE_ARGMAX_CHUNK + threadIdx.x;
    float vals[DENSE_ARGMAX_PER_THREAD];
#pragma unroll
    for (int j = 0; j < DENSE_ARGMAX_PER_THREAD; ++j) {
        const int i = base + j * DENSE_ARGMAX_THREADS;
        vals[j] = i < V ? row[i] : -INFINITY;
    }
    // Increasing index within the thread: strict > keeps the lowest.
    float bv = -INFINITY;
    unsigned int bi = 0xffffffffu;
#pragma unroll
    for (int j = 0; j < DENSE_ARGMAX_PER_THREAD; ++j) {
        const int i = base + j * DENSE_ARGMAX_THREADS;
        if (i < V && (bi == 0xffffffffu || vals[j] > bv)) {
            bv = vals[j];
            bi = (unsigned int)i;
        }
    }
    dense_argmax_warp(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < DENSE_ARGMAX_THREADS / 32 ? sv[lane] : -INFINITY;
        bi = lane < DENSE_ARGMAX_THREADS / 32 ? si[lane] : 0xffffffffu;
        dense_argmax_warp(bv, bi);
        if (lane == 0) {
            const long long p = (long long)blockIdx.y * gridDim.x + blockIdx.x;
            part_v[p] = bv;
            part_i[p] = bi;
        }
    }
}

// One warp per row (8 rows per block): the best of the row's `chunks` partials.
extern "C" __global__ void dense_argmax_final(const float* __restrict__ part_v, const unsigned int* __restrict__ part_i,
                                              unsigned int* __restrict__ out, int rows, int chunks) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    float bv = -INFINITY;
    unsigned int bi = 0xffffffffu;
    for (int c = lane; c < chunks; c += 32) {
        const float v = part_v[row * chunks + c];
        const unsigned int i = part_i[row * chunks + c];
        if (dense_better(v, i, bv, bi) || bi == 0xffffffffu) {
            bv = v;
            bi = i;
        }
    }
    dense_argmax_warp(bv, bi);
    if (lane == 0) out[row] = bi;
}
