// persist kernels (see kernels/README.md): persistent grids. Every block of
// the grid stays resident across a chain of dependent steps, the steps meet
// at a barrier across the grid, and each block streams the weights of the
// steps ahead into shared memory (cp.async) while it waits or computes, so
// the weight reads of a chain overlap its dependency latencies instead of
// following them kernel after kernel.
//
//   persist_gemv_chain   y_{m+1} = W_m y_m for m < M (BF16 W, f32 y): the
//                        measurement of that design against a chain of
//                        dense_gemv_t1 launches (the GPU suite's
//                        persist_gemv_chain_timing)
#include "common.cuh"

#define PERSIST_THREADS 512
#define PERSIST_WARPS (PERSIST_THREADS / 32)
#define PERSIST_CHUNK 16384   // bytes of a ring slot
#define PERSIST_STAGES 11     // ring slots (176 KB)
#define PERSIST_MAX_M 64      // matrices of a chain (MAX_CHAIN in persist.rs)
#define PERSIST_MAX_K 4096    // the widest input (MAX_K in persist.rs)
#define PERSIST_MAX_ROWS 64   // rows of a matrix one block owns (MAX_ROWS in persist.rs)

// One matrix of a chain (16 bytes, as persist.rs packs it in two u64).
struct PersistGemv {
    const __nv_bfloat16* w;  // [n, k] row-major
    int n, k;
};

static __device__ __forceinline__ void persist_cp16(uint32_t smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
#endif
}

static __device__ __forceinline__ void persist_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's commit groups are pending.
template <int N>
static __device__ __forceinline__ void persist_wait_pending() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

static __device__ __forceinline__ unsigned int persist_ld_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid meets here (all must be resident). bar[0] counts
// arrivals, bar[1] is the generation: the last block to arrive resets the
// count and advances the generation, which the others wait for; a block
// reads the generation before it arrives, so it cannot miss the advance.
// Stores before the barrier are visible after it to loads through L2.
static __device__ __forceinline__ void persist_grid_sync(unsigned int* bar, unsigned int nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int gen = persist_ld_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == nblocks - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (persist_ld_acquire(bar + 1) == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// Rows [n b / nb, n (b + 1) / nb) of a matrix belong to block b.
static __device__ __forceinline__ int persist_row0(int n, int b, int nb) { return (int)((long long)n * b / nb); }

// grid: the SM count (one block per SM: the ring fills its shared memory);
// dynamic smem PERSIST_STAGES * PERSIST_CHUNK + PERSIST_MAX_K * 4. chain:
// m_count matrices, chain[m + 1].k == chain[m].n, k a multiple of 512 with
// 2 k dividing PERSIST_CHUNK, at most PERSIST_MAX_ROWS rows a block (the
// wrapper's checks). y_m is ya for even m, yb for odd (y_0 in ya; the last
// result in the other). bar: two u32, zero before the first launch.
//
// Block b's share of all the matrices, in chain order, is one stream of
// chunks (whole rows, up to PERSIST_CHUNK bytes); chunk s goes to ring slot
// s % PERSIST_STAGES, PERSIST_STAGES chunks ahead of the one being used,
// across the barriers. For matrix m: barrier (y_m complete), y_m staged in
// shared memory, then per chunk: warp w dots the chunk's 16-byte pieces
// [64 w, 64 w + 64) (one row, a 512-element part of it) with y_m, the parts
// summed per row in order at the end.
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 1)
    persist_gemv_chain(const PersistGemv* __restrict__ chain, int m_count, float* __restrict__ ya,
                       float* __restrict__ yb, unsigned int* __restrict__ bar) {
    extern __shared__ __align__(16) unsigned char persist_smem[];
    __shared__ PersistGemv mats[PERSIST_MAX_M];
    __shared__ int first_chunk[PERSIST_MAX_M + 1];
    __shared__ float red[PERSIST_MAX_ROWS][PERSIST_MAX_K / 512];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nb = gridDim.x, b = blockIdx.x;
    float* ys = reinterpret_cast<float*>(persist_smem + PERSIST_STAGES * PERSIST_CHUNK);
    if (tid == 0) {
        int total = 0;
        for (int m = 0; m < m_count; ++m) {
            const PersistGemv g = chain[m];
            mats[m] = g;
            first_chunk[m] = total;
            const int rows = persist_row0(g.n, b + 1, nb) - persist_row0(g.n, b, nb);
            const int rpc = PERSIST_CHUNK / (2 * g.k);
            total += (rows + rpc - 1) / rpc;
        }
        first_chunk[m_count] = total;
    }
    __syncthreads();
    const int total = first_chunk[m_count];
    const uint32_t ring = (uint32_t)__cvta_generic_to_shared(persist_smem);
    // Chunk s of the stream into its slot: one commit group (empty past the end).
    auto issue = [&](int s) {
        if (s < total) {
            int m = 0;
            while (first_chunk[m + 1] <= s) ++m;
            const PersistGemv g = mats[m];
            const int r0 = persist_row0(g.n, b, nb), rows = persist_row0(g.n, b + 1, nb) - r0;
            const int rpc = PERSIST_CHUNK / (2 * g.k), c = s - first_chunk[m];
            const int bytes = min(rpc, rows - c * rpc) * 2 * g.k;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(g.w + ((size_t)r0 + (size_t)c * rpc) * g.k);
            const uint32_t dst = ring + (uint32_t)(s % PERSIST_STAGES) * PERSIST_CHUNK;
            for (int o = tid * 16; o < bytes; o += PERSIST_THREADS * 16) persist_cp16(dst + o, src + o);
        }
        persist_commit();
    };
    for (int s = 0; s < PERSIST_STAGES; ++s) issue(s);

    for (int m = 0; m < m_count; ++m) {
        const PersistGemv g = mats[m];
        const float* yin = (m & 1) ? yb : ya;
        float* yout = (m & 1) ? ya : yb;
        if (m > 0) persist_grid_sync(bar, (unsigned int)nb);
        for (int i = tid; i < g.k / 4; i += PERSIST_THREADS)
            reinterpret_cast<float4*>(ys)[i] = __ldcg(reinterpret_cast<const float4*>(yin) + i);
        const int r0 = persist_row0(g.n, b, nb), rows = persist_row0(g.n, b + 1, nb) - r0;
        const int rpc = PERSIST_CHUNK / (2 * g.k), kv = g.k / 8, parts = kv / 64;
        const float4* ys4 = reinterpret_cast<const float4*>(ys);
        for (int s = first_chunk[m]; s < first_chunk[m + 1]; ++s) {
            persist_wait_pending<PERSIST_STAGES - 1>();
            __syncthreads();  // every thread's pieces of chunk s (and, the first time, y_m) are in
            const int c = s - first_chunk[m], rc = min(rpc, rows - c * rpc);
            const uint4* slot = reinterpret_cast<const uint4*>(persist_smem + (s % PERSIST_STAGES) * PERSIST_CHUNK);
            for (int base = warp * 64; base < rc * kv; base += PERSIST_WARPS * 64) {
                float acc = 0.0f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int idx = base + lane + 32 * h;
                    const uint4 w = slot[idx];
                    const int col4 = (idx % kv) * 2;
                    const float4 xa = ys4[col4], xb = ys4[col4 + 1];
                    acc = fmaf(__uint_as_float(w.x << 16), xa.x, acc);
                    acc = fmaf(__uint_as_float(w.x & 0xffff0000u), xa.y, acc);
                    acc = fmaf(__uint_as_float(w.y << 16), xa.z, acc);
                    acc = fmaf(__uint_as_float(w.y & 0xffff0000u), xa.w, acc);
                    acc = fmaf(__uint_as_float(w.z << 16), xb.x, acc);
                    acc = fmaf(__uint_as_float(w.z & 0xffff0000u), xb.y, acc);
                    acc = fmaf(__uint_as_float(w.w << 16), xb.z, acc);
                    acc = fmaf(__uint_as_float(w.w & 0xffff0000u), xb.w, acc);
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (lane == 0) red[c * rpc + base / kv][(base % kv) / 64] = acc;
            }
            __syncthreads();  // slot s is free, red complete for its rows
            issue(s + PERSIST_STAGES);
        }
        for (int r = tid; r < rows; r += PERSIST_THREADS) {
            float v = 0.0f;
            for (int p = 0; p < parts; ++p) v += red[r][p];
            yout[r0 + r] = v;
        }
    }
}
