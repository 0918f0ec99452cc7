// chain-bench: what a dependent step costs in a chain of BF16 GEMVs, and
// whether a persistent kernel can hide it behind the weight stream.
//
// Issue 6's unmet line (decode within 1.5x of its floor with every expert
// resident) needs the weights of each decode stage read while the stage
// before it is still running (docs/performance.md, "What limits it now").
// The eleventh session's persistent chain lost to programmatic launches
// (4.6 us a dependent step against 1.35 us), but its barrier was five
// dependent L2 round trips long (a read of the generation, two fences, an
// atomic, a reset, a poll) and every thread both issued and consumed the
// weight copies. This program measures the two mechanisms a persistent
// decode would rest on, against the launches, in one process:
//
//   launches  one kernel a GEMV, a warp a row, its weights loaded into
//             registers before griddepcontrol.wait (after it for a routed
//             step, as the engine's expert GEMVs do); programmatic
//             dependent launches in one CUDA graph (the engine's decode
//             design)
//   counter   one persistent kernel, a block an SM: a producer warp streams
//             the block's rows of every matrix, in chain order, into a ring
//             of shared memory with bulk copies (cp.async.bulk, an mbarrier
//             a slot) and waits on the chain only before a routed step's
//             weights; eight consumer warps wait for their input, dot the
//             ring's rows with it and write their rows. A step's output is
//             complete when a per-step counter (red.release, polled with
//             ld.acquire) reaches the number of blocks: one dependent round
//             trip, then the input read
//   ll        the same kernel, each output value written with its run's
//             epoch as one 8-byte word (the low-latency protocol of NCCL's
//             LL): the input read is the wait, with no counter
//   counter2  (a chain with routed steps) counter with two rings, as ll2
//   ll2       (a chain with routed steps) ll with two rings: routed steps
//             stream through 4 slots of their own, filled by a second
//             producer warp that waits for the gate, so that the first
//             streams the dense steps' weights (8 slots) on past a routed
//             step whose routing is not known yet
//   rows      counter with consumers that keep up with the stream: a warp
//             takes whole rows and reduces once a row, the input read in
//             one round trip (persist_rows)
//   rows16    rows with 16 consumer warps
//   rowsx     rows whose consumers compute nothing (wait, release, store
//             0): the rate of the ring, the copies and the hand-offs alone;
//             unchecked
//   rowsi, rowsxi  rows and rowsx with the ring chunks of a matrix dealt
//             to the blocks in turn (chunk j to block j % nb) instead of a
//             contiguous run of rows a block
//   rowsim, rowsxim  rowsi and rowsxi that deal only the dense steps'
//             chunks (a routed step's rows contiguous, as rows)
//   rowsxn, rowsxin  rowsx and rowsxi whose consumers do not wait for
//             their input either: the ring's stream alone, no hand-off
//   rowsr     rows whose consumer lanes hold their share of the input in
//             registers for k <= 2048 (read from shared memory once a step,
//             not once a row); k = 4096 as rows
//   rows2, rows16x2  (a chain with routed steps) rows and rows16 with two
//             rings, as counter2
//   rowspf, rowspfa, rowspfo  (a chain with routed steps) rows whose
//             producer, on reaching a layer's first routed step (before it
//             waits for the router), asks L2 to fetch its block's rows of
//             the dense steps after the routed ones (cp.async.bulk.prefetch):
//             the next layer's q/k/v; and its prep and attention; and its
//             o_proj too (160, 240, 330 KB a block): HBM streams them while
//             the routed steps wait, and the ring later fills from L2
//   rowsh, rowspfh  rows and rowspf with L2 eviction hints: the prefetches
//             evict_last, every bulk copy of the ring evict_first
//   rowsng    rows whose routed steps' weights do not wait for the router
//             (as if the routing were predicted): a bound, not a schedule;
//             rowsngi: and dealt as rowsi
//
// Chains (distinct weights for every GEMV; a step reads the first k values
// of an earlier step's output, and waits for all of it):
//   small   48 of 0.5 MB, [512, 512]: a step with no bytes to speak of
//   big     48 of 16.8 MB, [4096, 2048] and [2048, 4096] alternating (the
//           eleventh session's)
//   decode  48 layers of 30b-a3b's 7 dependent decode stages, each a GEMV
//           with the stage's bytes: q/k/v [5120, 2048] (21 MB), prep
//           [512, 512] (weightless in the engine: latency only), attention
//           [4096, 512] (4.2 MB, the int8 KV at 4K context), o_proj [2048,
//           4096], router [128, 2048], the routed gate/up [3584, 2048]
//           (14.7 MB, the 8 experts' NVFP4 bytes as BF16 rows; it reads
//           o_proj's output, and its weights are requested only once the
//           router's output is complete, as expert addresses would be) and
//           the routed down [2048, 1536] (6.3 MB). 64 MB a layer.
//
// Each GEMV's output is checked against the host's double-precision product
// of its weights with the input the GPU read (relative to the output's rms:
// at most 1e-4; NaN fails), for every mode, before timing. The floor is the
// weight bytes over the bandwidth of a 1 GiB device-to-device copy (bytes
// read + written), as `strata bench` measures it. After the timed runs, one
// traced run per mode stamps (%globaltimer, whose tick is printed) each
// step's first input-ready and last output-written time over its blocks
// (input-ready: the programmatic wait's return, the count seen, or thread
// 0's LL words fresh; output-written: after a block's barrier that follows
// its stores): "increment" is a step's last write minus the step before's
// (what it adds to the chain, per stage kind; medians over the chain),
// "hand-off" is a step's first input-ready minus its input step's last
// write (steps that read the step just before; median). The stamps' atomics
// (one per block and step, on one address) slow a traced run a little;
// the timed runs have none, and a spin kernel ahead of each keeps the
// host's submission out of its interval.
//
// Build and run on the device (nvcc 13.0 there; sm_90a for cp.async.bulk):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Xcompiler -fopenmp -o chain-bench scripts/chain-bench.cu
//   ./chain-bench [small|big|decode|all] [timed runs a mode, default 20] [modes, e.g. rows,rowsx]
// (Here, without a GPU: add -L.cuda/site/nvidia/cu13/lib after
// scripts/install-nvcc.sh; the binary then reports the missing driver.)
// Exit status: 0 when every check passed, 1 when one failed, 2 on a CUDA
// error or bad arguments (a persistent block that waits 2 s for anything
// traps: a protocol slip fails instead of hanging). First run: an H100,
// every check passed (docs/performance.md, twentieth session); the rows
// modes: an H200, every check passed (twenty-first session); rowspf*,
// rowsh, rowspfh, rowsng and rowsr on an H100, rowsr and rowsx on an H200,
// every checked mode passed (twenty-second session); rowsi, rowsxi,
// rowsxn, rowsxin, rowsim, rowsxim and rowsngi on an H100, every checked
// mode passed (twenty-third session).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

// ---- shared by the kernels ------------------------------------------------

struct Step {
    const __nv_bfloat16* w;  // [n, k] row-major
    int n, k;
    int in;    // the step whose output's first k values are the input; -1: y0
    int gate;  // -1, or a step whose output must be complete before the weights are read
};

constexpr int MAX_M = 512;        // steps of a chain
constexpr int MAX_K = 4096;       // widest input
constexpr int MAX_IN = 5120;      // longest output a step waits for
constexpr int MAX_GATE = 256;     // longest output a routed step's weights wait for
constexpr int MAX_ROWS = 64;      // rows of one matrix a block owns
constexpr int CONSUMERS = 8;      // consumer warps of a persistent block
constexpr int CT = CONSUMERS * 32;
constexpr int P_THREADS = CT + 64;  // and two producer warps
constexpr int CHUNK = 16384;      // bytes of a ring slot (whole rows)
constexpr int STAGES = 12;        // ring slots: 192 KB
constexpr int SLOTS_A = 8;        // of them the dense ring's, with two rings
constexpr int MAX_PARTS = MAX_K / 512;
constexpr unsigned long long SPIN_LIMIT_NS = 2000000000ull;

// Dynamic shared memory of a persistent block, in bytes from its start.
constexpr int OFF_RING = 0;
constexpr int OFF_YS = OFF_RING + STAGES * CHUNK;                // f32 [2][MAX_K / 2]
constexpr int OFF_RED = OFF_YS + MAX_K * 4;                      // f32 [MAX_ROWS][MAX_PARTS]
constexpr int OFF_STEPS = OFF_RED + MAX_ROWS * MAX_PARTS * 4;    // Step [MAX_M]
constexpr int OFF_BARS = OFF_STEPS + MAX_M * (int)sizeof(Step);  // u64 [2 STAGES]
constexpr int OFF_OUT = OFF_BARS + 2 * STAGES * 8;               // int [MAX_M]: output offsets
constexpr int P_SMEM = OFF_OUT + MAX_M * 4;
static_assert(sizeof(Step) == 24, "Step packs in 24 bytes");
static_assert(OFF_BARS % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(MAX_ROWS * MAX_PARTS * 4 >= 64, "persist_rows' yb4 fits in OFF_RED");
static_assert(P_SMEM <= 232448, "a persistent block fits an SM's shared memory");

__host__ __device__ inline int row0(int n, int b, int nb) { return (int)((long long)n * b / nb); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 8 products of BF16 weights (one 16-byte piece) with f32 inputs.
__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b, float acc) {
    acc = fmaf(__uint_as_float(w.x << 16), a.x, acc);
    acc = fmaf(__uint_as_float(w.x & 0xffff0000u), a.y, acc);
    acc = fmaf(__uint_as_float(w.y << 16), a.z, acc);
    acc = fmaf(__uint_as_float(w.y & 0xffff0000u), a.w, acc);
    acc = fmaf(__uint_as_float(w.z << 16), b.x, acc);
    acc = fmaf(__uint_as_float(w.z & 0xffff0000u), b.y, acc);
    acc = fmaf(__uint_as_float(w.w << 16), b.z, acc);
    acc = fmaf(__uint_as_float(w.w & 0xffff0000u), b.w, acc);
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A wait that has lasted SPIN_LIMIT_NS is a bug of the protocol: trap.
__device__ __forceinline__ void spin_guard(unsigned long long t0, int step, const char* what) {
    if (globaltimer() - t0 > SPIN_LIMIT_NS) {
        printf("chain-bench: block %d thread %d waited 2 s for %s of step %d\n", blockIdx.x, threadIdx.x, what, step);
        __trap();
    }
}

// The smallest step of %globaltimer seen in a busy loop.
__global__ void timer_tick(unsigned long long* out) {
    unsigned long long prev = globaltimer(), best = ~0ull;
    for (int i = 0; i < 200000; ++i) {
        const unsigned long long t = globaltimer();
        if (t != prev) {
            best = t - prev < best ? t - prev : best;
            prev = t;
        }
    }
    *out = best;
}

// Keeps the GPU busy for about ns nanoseconds.
__global__ void spin(unsigned long long ns) {
    const unsigned long long t0 = globaltimer();
    while (globaltimer() - t0 < ns) {
    }
}

// ---- launches: the engine's design ---------------------------------------

// A warp a row, 8 rows a block; the row's weights into registers before the
// programmatic wait (EARLY) or after it (a routed step), the input after it.
// ready/done (a traced run; else null): the step's first wait return and
// last block end.
template <int K, bool EARLY>
__global__ void __launch_bounds__(256)
    gemv_pdl(const __nv_bfloat16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int step,
             unsigned long long* __restrict__ ready, unsigned long long* __restrict__ done) {
    constexpr int V = K / 256;  // 16-byte pieces a lane
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = blockIdx.x * 8 + warp;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)min(row, n - 1) * K);
    uint4 wv[V];
    if (EARLY) {
#pragma unroll
        for (int v = 0; v < V; ++v) wv[v] = ld_stream(wr + lane + 32 * v);
    }
    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (ready != nullptr && threadIdx.x == 0) atomicMin(ready + step, globaltimer());
    if (!EARLY) {
#pragma unroll
        for (int v = 0; v < V; ++v) wv[v] = ld_stream(wr + lane + 32 * v);
    }
    float acc = 0.0f;
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int p = lane + 32 * v;
        acc = dot8(wv[v], __ldcg(x4 + 2 * p), __ldcg(x4 + 2 * p + 1), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0 && row < n) y[row] = acc;
    if (done != nullptr) {
        __syncthreads();
        if (threadIdx.x == 0) atomicMax(done + step, globaltimer());
    }
}

// ---- persistent: a producer warp and a ring ------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int step) {
    uint32_t ok;
    unsigned long long t0 = 0;
    for (int i = 0;; ++i) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(ok)
            : "r"(bar), "r"(parity)
            : "memory");
        if (ok) return;
        if (i == 0) t0 = globaltimer();
        else if ((i & 1023) == 0) spin_guard(t0, step, "a ring slot");
    }
}
// bytes from global memory into this block's shared memory; the mbarrier's
// transaction count falls by them when they have landed.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// bulk_g2s with an L2 eviction policy for what it reads.
__device__ __forceinline__ void bulk_g2s_hint(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                              uint64_t pol) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(pol)
        : "memory");
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_u64(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned int ld_acquire_u32(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(unsigned int* p, unsigned int v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// The consumer warps' barrier (the producer warps never join it).
template <int N>
__device__ __forceinline__ void bar_sync_n() {
    asm volatile("bar.sync 1, %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void consumers_sync() { bar_sync_n<CT>(); }

__device__ __forceinline__ bool fresh(unsigned long long word, unsigned int epoch) {
    return (unsigned int)(word >> 32) == epoch;
}

// The word thread t of nt holds in place j of wait_words: i = t + nt j,
// rotated by rot (< n) so that the blocks spin on different L2 lines.
__device__ __forceinline__ int word_at(int t, int nt, int j, int rot, int n) {
    const int i = t + nt * j + rot;
    return i < n ? i : i - n;
}

// Waits until words [0, n) of src (LL words) carry `epoch`; thread t of nt
// holds words word_at(t, nt, j, rot, n) for t + nt j < n, j < W. Spins on
// one stale word at a time (one load in flight: as light on L2 as a flag),
// but once it turns fresh reloads every later stale word at once (one by
// one would cost a serial L2 round trip each), napping `nap` ns between
// polls. Returns with the words in v.
template <int W>
__device__ __forceinline__ void wait_words(const unsigned long long* src, int n, int t, int nt, int rot,
                                           unsigned int epoch, unsigned long long (&v)[W], int step, unsigned int nap) {
#pragma unroll
    for (int j = 0; j < W; ++j) {
        if (t + nt * j < n) v[j] = ld_relaxed_u64(src + word_at(t, nt, j, rot, n));
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
        if (t + nt * j < n && !fresh(v[j], epoch)) {
            const unsigned long long t0 = globaltimer();
            do {
                __nanosleep(nap);
                v[j] = ld_relaxed_u64(src + word_at(t, nt, j, rot, n));
                spin_guard(t0, step, "an input word");
            } while (!fresh(v[j], epoch));
#pragma unroll
            for (int q = j + 1; q < W; ++q) {
                if (t + nt * q < n && !fresh(v[q], epoch)) v[q] = ld_relaxed_u64(src + word_at(t, nt, q, rot, n));
            }
        }
    }
}

__device__ __forceinline__ void wait_count(const unsigned int* c, unsigned int target, int step) {
    const unsigned long long t0 = globaltimer();
    while (ld_acquire_u32(c) < target) {
        __nanosleep(32);
        spin_guard(t0, step, "a counter");
    }
}

// Input value i into the two halves of ys: elements 8c..8c+3 at ysa[4c..],
// 8c+4..8c+7 at ysb[4c..], so that a warp's float4 reads of either are
// contiguous (no bank conflicts).
__device__ __forceinline__ void ys_put(float* ysa, float* ysb, int i, float v) {
    const int c = i >> 3, e = i & 7;
    (e < 4 ? ysa : ysb)[4 * c + (e & 3)] = v;
}

// Bytes of dense weights a producer asks L2 to fetch ahead at each routed
// block (the `rowspf*` modes; 0 in every other mode): when the producer
// reaches the first routed step of a layer (its weights wait for the
// router), it first asks L2 for this block's rows of the dense steps after
// the routed ones (the next layer's q/k/v, ...) up to this many bytes, whole
// steps, so that HBM streams them while the routed steps wait and the ring
// later fills from L2.
__device__ unsigned int g_l2_ahead;
// With g_l2_hints (the `rowsh` and `rowspfh` modes): the prefetches ask L2 to
// keep their lines (evict_last) and every bulk copy of the ring marks what
// it reads evict_first, so that the routed steps' stream does not push the
// prefetched rows out before their step reads them.
__device__ unsigned int g_l2_hints;
// With g_no_gate (the `rowsng` mode) the producer streams a routed step's
// rows without waiting for its gate, as if the routing were known ahead
// (predicted): the bound that any early expert fetch could reach.
__device__ unsigned int g_no_gate;
// With g_no_dot (the `rowsx` mode, persist_rows) the consumers compute
// nothing: each waits for every slot of its step and releases it, and
// stores 0 for its rows. What is left is the ring, the producer's copies
// and the hand-offs: the rate this design streams at with free consumers.
// Its outputs are wrong by design (unchecked).
__device__ unsigned int g_no_dot;
// With g_interleave (the `rowsi` and `rowsxi` modes, persist_rows: 1) a block
// takes every nb-th ring chunk of a matrix (chunk j of rpc rows is block
// j % nb's) instead of one contiguous run of rows, so that at any moment
// the SMs read neighbouring addresses, as a launch's blocks do; 2 (`rowsim`,
// `rowsxim`): the dense steps' chunks only, a routed step's as rows.
__device__ unsigned int g_interleave;
// With g_no_wait (the `rowsxn` and `rowsxin` modes, with g_no_dot) the
// consumers do not wait for a step's input to be complete: no hand-off is
// left, only the ring's stream of the chain's weights (and a routed step's
// producer wait for its gate). Unchecked, as rowsx.
__device__ unsigned int g_no_wait;

// The i-th ring chunk of a block's rows of an [n, k] matrix, rpc rows a
// chunk: its first row and row count; false past the block's last.
__device__ __forceinline__ bool block_chunk(bool inter, int n, int rpc, int b, int nb, int i, int& start, int& count) {
    if (inter) {
        start = (b + i * nb) * rpc;
        count = min(rpc, n - start);
        return start < n;
    }
    const int r0 = row0(n, b, nb), rows = row0(n, b + 1, nb) - r0;
    start = r0 + i * rpc;
    count = min(rpc, rows - i * rpc);
    return i * rpc < rows;
}

__device__ __forceinline__ uint64_t l2_policy(bool keep) {
    uint64_t p;
    if (keep) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    else asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes, bool hint, uint64_t pol) {
    if (hint)
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src), "r"(bytes), "l"(pol)
                     : "memory");
    else asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// The producer warps of a persistent block (p 0, and p 1 with TWO): the
// block's rows of their ring's matrices in chain order, whole rows a slot,
// as fast as slots free up; a routed step's only once its gate's output is
// complete (the whole warp waits for it, lane 0 issues the copies). A gate
// is complete at `target` (counter) or when its LL words carry `epoch`.
template <bool LL, bool TWO>
__device__ __forceinline__ void produce(int p, int lane, int b, int nb, const Step* steps, const int* out_off,
                                        int m_count, uint32_t ring, uint32_t full, uint32_t empty,
                                        const unsigned long long* ll, const unsigned int* counters,
                                        unsigned int target, unsigned int epoch) {
    const int first = p == 1 ? SLOTS_A : 0, nslots = TWO ? (p == 1 ? STAGES - SLOTS_A : SLOTS_A) : STAGES;
    const unsigned int l2_ahead = g_l2_ahead;
    const bool hints = g_l2_hints != 0, no_gate = g_no_gate != 0;
    const unsigned int inter = g_interleave;
    const uint64_t keep = l2_policy(true), stream = l2_policy(false);
    int s = 0;
    for (int m = 0; m < m_count; ++m) {
        const Step g = steps[m];
        if (TWO && (g.gate >= 0) != (p == 1)) continue;
        if (l2_ahead > 0 && lane == 0 && g.gate >= 0 && m > 0 && steps[m - 1].gate < 0) {
            unsigned int left = l2_ahead;
            bool dense = false;
            for (int q = m + 1; q < m_count; ++q) {
                const Step h = steps[q];
                if (h.gate >= 0) {
                    if (dense) break;  // the next routed block
                    continue;          // this one's later routed steps
                }
                dense = true;
                const int hr0 = row0(h.n, b, nb);
                const uint32_t bytes = (uint32_t)((row0(h.n, b + 1, nb) - hr0) * 2 * h.k);
                if (bytes > left) break;
                left -= bytes;
                for (uint32_t o = 0; o < bytes; o += CHUNK)
                    prefetch_l2(reinterpret_cast<const unsigned char*>(h.w + (size_t)hr0 * h.k) + o,
                                min((uint32_t)CHUNK, bytes - o), hints, keep);
            }
        }
        if (g.gate >= 0 && !no_gate) {
            // Lanes 1..31 skip the copies and would reach the gate early:
            // hold them until lane 0 has issued every earlier step's, so
            // that the warp polls only from when it must (not through the
            // whole stages before, on the same few L2 lines).
            __syncwarp();
            if (LL) {
                unsigned long long v[MAX_GATE / 32];
                const int n = steps[g.gate].n;
                wait_words(ll + out_off[g.gate], n, lane, 32, (b * 32) % n, epoch, v, m, 128);
            } else if (lane == 0) {
                wait_count(counters + g.gate, target, m);
            }
            __syncwarp();
        }
        if (lane != 0) continue;
        const int rpc = CHUNK / (2 * g.k);
        int start, count;
        const bool dealt = inter == 1 || (inter == 2 && g.gate < 0);
        for (int c = 0; block_chunk(dealt, g.n, rpc, b, nb, c, start, count); ++c, ++s) {
            const int slot = first + s % nslots;
            if (s >= nslots) mbar_wait(empty + 8 * slot, ((s / nslots) - 1) & 1, m);
            const uint32_t bytes = (uint32_t)(count * 2 * g.k);
            mbar_expect_tx(full + 8 * slot, bytes);
            const void* src = g.w + (size_t)start * g.k;
            if (hints) bulk_g2s_hint(ring + slot * CHUNK, src, bytes, full + 8 * slot, stream);
            else bulk_g2s(ring + slot * CHUNK, src, bytes, full + 8 * slot);
        }
    }
}

// A persistent block's start: the chain's steps and output offsets into
// shared memory, the ring's mbarriers initialised (a full one completes
// with its producer's copies, an empty one with every consumer warp's
// arrival).
__device__ __forceinline__ void persist_setup(int tid, int nthreads, int consumers, const Step* steps_g,
                                              const int* out_off_g, int m_count, Step* steps, int* out_off,
                                              uint32_t full, uint32_t empty) {
    for (int i = tid; i < m_count; i += nthreads) {
        steps[i] = steps_g[i];
        out_off[i] = out_off_g[i];
    }
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, consumers);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// grid: the SM count, one block each, launched cooperatively (the blocks
// wait on each other, so all must be resident). steps/out_off: m_count
// steps and the offset of each one's output in ll (LL) or yf (counter).
// y0: the chain's input. counters: m_count u32 (counter mode), never reset:
// the epoch-th run (1, 2, ...) of this mode waits for epoch x gridDim.x.
// LL words are (f32 bits, epoch); the buffer starts zeroed. ready/done: a
// traced run's stamps (else null), [m_count], ~0 / 0 before it: ready when
// the first block's thread 0 has its input (LL: its words; counter: the
// count), done when the last block has stored its rows. TWO: routed steps
// (gate >= 0) stream through a ring of their own (slots SLOTS_A..), filled
// by the second producer warp, so that the first one streams the dense
// steps' weights on past a routed step whose gate is not complete.
template <bool LL, bool TWO>
__global__ void __launch_bounds__(P_THREADS, 1)
    persist_chain(const Step* __restrict__ steps_g, const int* __restrict__ out_off_g, int m_count,
                  const float* __restrict__ y0, unsigned long long* __restrict__ ll, float* __restrict__ yf,
                  unsigned int* __restrict__ counters, unsigned int epoch, unsigned long long* __restrict__ ready,
                  unsigned long long* __restrict__ done) {
    extern __shared__ __align__(128) unsigned char smem[];
    Step* steps = reinterpret_cast<Step*>(smem + OFF_STEPS);
    int* out_off = reinterpret_cast<int*>(smem + OFF_OUT);
    const uint32_t ring = smem_addr(smem + OFF_RING);
    const uint32_t full = smem_addr(smem + OFF_BARS), empty = full + 8 * STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, b = blockIdx.x, nb = gridDim.x;
    const unsigned int target = epoch * (unsigned int)nb;
    persist_setup(tid, P_THREADS, CONSUMERS, steps_g, out_off_g, m_count, steps, out_off, full, empty);

    if (warp >= CONSUMERS) {
        const int p = warp - CONSUMERS;  // 1: the routed ring (TWO)
        if (TWO || p == 0)
            produce<LL, TWO>(p, lane, b, nb, steps, out_off, m_count, ring, full, empty, ll, counters, target, epoch);
        return;
    }

    // The consumers.
    float* ysa = reinterpret_cast<float*>(smem + OFF_YS);
    float* ysb = ysa + MAX_K / 2;
    const float4* ya4 = reinterpret_cast<const float4*>(ysa);
    const float4* yb4 = reinterpret_cast<const float4*>(ysb);
    float* red = reinterpret_cast<float*>(smem + OFF_RED);
    int sa = 0, sb = 0;  // chunks consumed from each ring
    for (int m = 0; m < m_count; ++m) {
        const Step g = steps[m];
        const int k = g.k, r0 = row0(g.n, b, nb), rows = row0(g.n, b + 1, nb) - r0;
        // The input: y0, or the first k values of step g.in's output once
        // all of it is complete.
        if (g.in < 0) {
            for (int i = tid; i < k; i += CT) ys_put(ysa, ysb, i, y0[i]);
            if (ready != nullptr && tid == 0) atomicMin(ready + m, globaltimer());
        } else if (LL) {
            unsigned long long v[MAX_IN / CT];
            const int n = steps[g.in].n, rot = (b * CT) % n;
            wait_words(ll + out_off[g.in], n, tid, CT, rot, epoch, v, m, 32);
            if (ready != nullptr && tid == 0) atomicMin(ready + m, globaltimer());
#pragma unroll
            for (int j = 0; j < MAX_IN / CT; ++j) {
                const int i = word_at(tid, CT, j, rot, n);
                if (tid + CT * j < n && i < k) ys_put(ysa, ysb, i, __uint_as_float((unsigned int)v[j]));
            }
        } else {
            if (tid == 0) {
                wait_count(counters + g.in, target, m);
                if (ready != nullptr) atomicMin(ready + m, globaltimer());
            }
            consumers_sync();
            const float* src = yf + out_off[g.in];
            for (int i = tid; i < k; i += CT) ys_put(ysa, ysb, i, __ldcg(src + i));
        }
        consumers_sync();  // ys complete; red free (every thread has summed the last step's)
        // The products: warp w dots 512-element parts of the slot's rows.
        const bool routed_ring = TWO && g.gate >= 0;
        int s = routed_ring ? sb : sa;  // a copy (a reference put sa, sb in local memory)
        const int first = routed_ring ? SLOTS_A : 0, nslots = TWO ? (routed_ring ? STAGES - SLOTS_A : SLOTS_A) : STAGES;
        const int kv = k / 8, rpc = CHUNK / (2 * k);
        for (int c = 0; c * rpc < rows; ++c, ++s) {
            const int slot = first + s % nslots, rc = min(rpc, rows - c * rpc);
            mbar_wait(full + 8 * slot, (s / nslots) & 1, m);
            const uint4* sl = reinterpret_cast<const uint4*>(smem + OFF_RING + slot * CHUNK);
            for (int base = warp * 64; base < rc * kv; base += CONSUMERS * 64) {
                // kv is a multiple of 64: the 64 pieces lie in one row.
                const int rr = base / kv, col0 = base - rr * kv;
                float acc = 0.0f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = col0 + lane + 32 * h;
                    acc = dot8(sl[base + lane + 32 * h], ya4[col], yb4[col], acc);
                }
                acc = warp_sum(acc);
                if (lane == 0) red[(c * rpc + rr) * MAX_PARTS + col0 / 64] = acc;
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * slot);
        }
        if (routed_ring) sb = s;
        else sa = s;
        consumers_sync();  // red complete
        const int parts = kv / 64;
        for (int r = tid; r < rows; r += CT) {
            float v = 0.0f;
            for (int p = 0; p < parts; ++p) v += red[r * MAX_PARTS + p];
            if (LL)
                st_relaxed_u64(ll + out_off[m] + r0 + r,
                               ((unsigned long long)epoch << 32) | (unsigned long long)__float_as_uint(v));
            else
                yf[out_off[m] + r0 + r] = v;
        }
        if (!LL) {
            consumers_sync();  // every row of the block stored before the release
            if (tid == 0) red_release_add(counters + m, 1u);
        }
        if (done != nullptr) {
            consumers_sync();
            if (tid == 0) atomicMax(done + m, globaltimer());
        }
    }
}

// One row of a ring slot dotted with the block's input (ys, split as
// ys_put writes it) by one warp: lane l takes the row's 16-byte pieces l,
// l + 32, ... (V of them), four accumulators, one reduction a row.
template <int V>
__device__ __forceinline__ float row_dot(const uint4* w, const float4* ya4, const float4* yb4, int lane) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int p = lane + 32 * v;
        acc[v & 3] = dot8(w[p], ya4[p], yb4[p], acc[v & 3]);
    }
    return warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

__device__ __forceinline__ float row_dot_k(int k, const uint4* w, const float4* ya4, const float4* yb4, int lane) {
    switch (k) {
        case 512: return row_dot<2>(w, ya4, yb4, lane);
        case 1536: return row_dot<6>(w, ya4, yb4, lane);
        case 2048: return row_dot<8>(w, ya4, yb4, lane);
        default: return row_dot<16>(w, ya4, yb4, lane);  // 4096 (the host checks the shapes)
    }
}

// persist_chain's counter hand-off with consumers that keep up with the
// stream (the twentieth session's counter consumers held a 16.8 MB GEMV to
// 7.51 us on the H200, against 5.96 us for the engine's launches): a warp
// takes whole rows (row j of the block's rows of a step is warp j % NC's)
// and reduces once a row, where persist_chain's reduce once 64 pieces;
// each row's lane 0 stores it; thread 0 waits for the input and every
// consumer thread reads its share of it (float4s, one round trip), so a
// step has three barriers of the consumers (count seen; input read; rows
// stored, before the release) where persist_chain's has four. NC consumer
// warps (8 as persist_chain's, or more). Same arguments and counters as
// persist_chain<false, TWO> (ll is not read); its signature and preamble
// repeat persist_chain's (a kernel's parameters cannot be shared).
template <bool TWO, int NC, bool REG = false>
__global__ void __launch_bounds__(NC * 32 + 64, 1)
    persist_rows(const Step* __restrict__ steps_g, const int* __restrict__ out_off_g, int m_count,
                 const float* __restrict__ y0, unsigned long long* __restrict__ ll, float* __restrict__ yf,
                 unsigned int* __restrict__ counters, unsigned int epoch, unsigned long long* __restrict__ ready,
                 unsigned long long* __restrict__ done) {
    extern __shared__ __align__(128) unsigned char smem[];
    Step* steps = reinterpret_cast<Step*>(smem + OFF_STEPS);
    int* out_off = reinterpret_cast<int*>(smem + OFF_OUT);
    const uint32_t ring = smem_addr(smem + OFF_RING);
    const uint32_t full = smem_addr(smem + OFF_BARS), empty = full + 8 * STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, b = blockIdx.x, nb = gridDim.x;
    const unsigned int target = epoch * (unsigned int)nb;
    persist_setup(tid, NC * 32 + 64, NC, steps_g, out_off_g, m_count, steps, out_off, full, empty);

    if (warp >= NC) {
        const int p = warp - NC;
        if (TWO || p == 0)
            produce<false, TWO>(p, lane, b, nb, steps, out_off, m_count, ring, full, empty, ll, counters, target,
                                epoch);
        return;
    }

    float4* ya4 = reinterpret_cast<float4*>(smem + OFF_YS);
    // yb4 64 bytes past ya4's end (into OFF_RED, which this kernel does not
    // use): the input's stores to ya4[i] and yb4[i] by neighbouring lanes
    // fall in different banks.
    float4* yb4 = ya4 + MAX_K / 8 + 4;
    const bool no_dot = g_no_dot != 0, no_wait = g_no_wait != 0;
    const unsigned int inter = g_interleave;
    int sa = 0, sb = 0;  // chunks consumed from each ring
    for (int m = 0; m < m_count; ++m) {
        const Step g = steps[m];
        const int k = g.k;
        // The input: y0, or the first k values of step g.in's output once its
        // count is complete; thread 0 waits, then every consumer thread reads
        // its share at once (one L2 round trip: at most MAX_K / 4 / (NC 32)
        // float4s a thread). Float4 q holds elements 4q..4q+3, ya4's when q
        // is even (ys_put's layout).
        const float* src = g.in < 0 ? y0 : yf + out_off[g.in];
        if (g.in >= 0 && !no_wait) {
            if (tid == 0) wait_count(counters + g.in, target, m);
            bar_sync_n<NC * 32>();  // the count seen (thread 0's acquire orders the reads below)
        }
        if (ready != nullptr && tid == 0) atomicMin(ready + m, globaltimer());
        {
            constexpr int QT = MAX_K / 4 / (NC * 32);
            const float4* s4 = reinterpret_cast<const float4*>(src);
            float4 v[QT];
#pragma unroll
            for (int j = 0; j < QT; ++j) {
                const int q = tid + NC * 32 * j;
                if (q < k / 4) v[j] = __ldcg(s4 + q);
            }
#pragma unroll
            for (int j = 0; j < QT; ++j) {
                const int q = tid + NC * 32 * j;
                if (q < k / 4) ((q & 1) ? yb4 : ya4)[q >> 1] = v[j];
            }
        }
        bar_sync_n<NC * 32>();  // ys complete
        const bool routed_ring = TWO && g.gate >= 0;
        int s = routed_ring ? sb : sa;
        const int first = routed_ring ? SLOTS_A : 0, nslots = TWO ? (routed_ring ? STAGES - SLOTS_A : SLOTS_A) : STAGES;
        const int kv = k / 8, rpc = CHUNK / (2 * k);
        // The step's rows from the ring. V > 0 (REG, k = 256 V): each lane
        // first takes its V pieces of the input into registers, once a step,
        // and dots every row with them (only the weights are read from
        // shared memory); V = 0: row_dot_k reads the input for every row.
        auto from_ring = [&](auto vt, int s) {
            constexpr int V = decltype(vt)::value;
            float4 xa[V > 0 ? V : 1], xb[V > 0 ? V : 1];
#pragma unroll
            for (int v = 0; v < V; ++v) {
                xa[v] = ya4[lane + 32 * v];
                xb[v] = yb4[lane + 32 * v];
            }
            int start, rc;
            const bool dealt = inter == 1 || (inter == 2 && g.gate < 0);
            for (int c = 0; block_chunk(dealt, g.n, rpc, b, nb, c, start, rc); ++c, ++s) {
                const int slot = first + s % nslots;
                // Every warp waits for the slot, so that its arrival below is
                // this fill's and never the next one's.
                mbar_wait(full + 8 * slot, (s / nslots) & 1, m);
                const uint4* sl = reinterpret_cast<const uint4*>(smem + OFF_RING + slot * CHUNK);
                for (int rr = ((warp - c * rpc) % NC + NC) % NC; rr < rc; rr += NC) {
                    float y;
                    if (no_dot) {
                        y = 0.0f;
                    } else if constexpr (V > 0) {
                        const uint4* w = sl + rr * kv;
                        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int v = 0; v < V; ++v) acc[v & 3] = dot8(w[lane + 32 * v], xa[v], xb[v], acc[v & 3]);
                        y = warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
                    } else {
                        y = row_dot_k(k, sl + rr * kv, ya4, yb4, lane);
                    }
                    if (lane == 0) yf[out_off[m] + start + rr] = y;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + 8 * slot);
            }
            return s;
        };
        if (REG && k == 512) s = from_ring(std::integral_constant<int, 2>{}, s);
        else if (REG && k == 1536) s = from_ring(std::integral_constant<int, 6>{}, s);
        else if (REG && k == 2048) s = from_ring(std::integral_constant<int, 8>{}, s);
        else s = from_ring(std::integral_constant<int, 0>{}, s);
        if (routed_ring) sb = s;
        else sa = s;
        bar_sync_n<NC * 32>();  // every row of the block stored; ys free
        if (tid == 0) {
            red_release_add(counters + m, 1u);
            if (done != nullptr) atomicMax(done + m, globaltimer());
        }
    }
}

// ---- host -----------------------------------------------------------------

struct Chain {
    std::string name;
    std::vector<int> n, k, in, gate;
    std::vector<std::string> kinds;  // stage names, repeating
};

static Chain make_chain(const std::string& name) {
    Chain c{name, {}, {}, {}, {}, {}};
    auto add = [&](int n, int k, int in_back, int gate_back) {
        const int m = (int)c.n.size();
        c.n.push_back(n);
        c.k.push_back(k);
        c.in.push_back(m - in_back);  // -1 for the first step
        c.gate.push_back(gate_back > 0 ? m - gate_back : -1);
    };
    for (int l = 0; l < 48; ++l) {
        if (name == "small") {
            add(512, 512, 1, 0);
        } else if (name == "big") {
            if (l % 2 == 0) add(4096, 2048, 1, 0); else add(2048, 4096, 1, 0);
        } else {
            add(5120, 2048, 1, 0);  // q/k/v, from the last layer's down
            add(512, 512, 1, 0);    // prep
            add(4096, 512, 1, 0);   // attention
            add(2048, 4096, 1, 0);  // o_proj
            add(128, 2048, 1, 0);   // router
            add(3584, 2048, 2, 1);  // gate/up: o_proj's output, weights after the router
            add(2048, 1536, 1, 2);  // down: its experts' weights after the router too
        }
    }
    c.in[0] = -1;
    if (name == "small") c.kinds = {"512x512"};
    else if (name == "big") c.kinds = {"4096x2048", "2048x4096"};
    else c.kinds = {"q/k/v", "prep", "attention", "o_proj", "router", "gate/up", "down"};
    return c;
}

static uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double median(std::vector<double> v) {
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// GB/s of a 1 GiB device-to-device copy, bytes read + written, median of 5.
static double copy_bandwidth() {
    const size_t bytes = 1ull << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> gbs;
    for (int i = 0; i < 6; ++i) {
        CK(cudaEventRecord(e0));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i > 0) gbs.push_back(2.0 * bytes / (ms * 1e6));
    }
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return median(gbs);
}

struct Run {
    const Chain& c;
    int M;
    std::vector<std::vector<uint16_t>> hw;  // host weights
    std::vector<float> hy0;
    std::vector<int> off;       // output offset of each step
    std::vector<size_t> woff;   // weight offset of each step, in elements
    int total_out = 0;
    double bytes = 0;
    __nv_bfloat16* dw = nullptr;
    Step* dsteps = nullptr;
    int* doff = nullptr;
    float *dy0 = nullptr, *dyf = nullptr;
    unsigned long long *dll = nullptr, *dready = nullptr, *ddone = nullptr;
    unsigned int* dcnt = nullptr;

    Run(const Chain& ch) : c(ch), M((int)ch.n.size()) {
        size_t wtotal = 0;
        for (int m = 0; m < M; ++m) {
            off.push_back(total_out);
            woff.push_back(wtotal);
            total_out += c.n[m];
            wtotal += (size_t)c.n[m] * c.k[m];
            bytes += 2.0 * c.n[m] * c.k[m];
        }
        hw.resize(M);
#pragma omp parallel for schedule(dynamic)
        for (int m = 0; m < M; ++m) {
            // Uniform in +-sqrt(3 / k): a GEMV keeps its input's scale.
            uint64_t s = 0x5eed0000ull + (uint64_t)m * 7919u;
            const float a = std::sqrt(3.0f / c.k[m]);
            hw[m].resize((size_t)c.n[m] * c.k[m]);
            for (auto& v : hw[m]) v = to_bf16(a * (2.0f * (float)(splitmix(s) >> 40) / 16777216.0f - 1.0f));
        }
        uint64_t s = 42;
        hy0.resize(c.k[0]);
        for (auto& v : hy0) v = 2.0f * (float)(splitmix(s) >> 40) / 16777216.0f - 1.0f;
        CK(cudaMalloc(&dw, wtotal * 2));
        std::vector<Step> steps(M);
        for (int m = 0; m < M; ++m) {
            CK(cudaMemcpy(dw + woff[m], hw[m].data(), hw[m].size() * 2, cudaMemcpyHostToDevice));
            steps[m] = Step{dw + woff[m], c.n[m], c.k[m], c.in[m], c.gate[m]};
        }
        CK(cudaMalloc(&dsteps, M * sizeof(Step)));
        CK(cudaMemcpy(dsteps, steps.data(), M * sizeof(Step), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&doff, M * sizeof(int)));
        CK(cudaMemcpy(doff, off.data(), M * sizeof(int), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dy0, c.k[0] * 4));
        CK(cudaMemcpy(dy0, hy0.data(), c.k[0] * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dyf, (size_t)total_out * 4));
        CK(cudaMalloc(&dll, (size_t)total_out * 8));
        CK(cudaMemset(dll, 0, (size_t)total_out * 8));
        CK(cudaMalloc(&dcnt, M * 4));
        CK(cudaMemset(dcnt, 0, M * 4));
        CK(cudaMalloc(&dready, M * 8));
        CK(cudaMalloc(&ddone, M * 8));
    }
    ~Run() {
        cudaFree(dw);
        cudaFree(dsteps);
        cudaFree(doff);
        cudaFree(dy0);
        cudaFree(dyf);
        cudaFree(dll);
        cudaFree(dcnt);
        cudaFree(dready);
        cudaFree(ddone);
    }

    // Every step's output against the host's product of its weights with
    // the input the GPU read; the worst error relative to the output's rms.
    double check(const std::vector<float>& out) const {
        double worst = 0.0;
        for (int m = 0; m < M; ++m) {
            const float* x = c.in[m] < 0 ? hy0.data() : out.data() + off[c.in[m]];
            const float* y = out.data() + off[m];
            const int n = c.n[m], k = c.k[m];
            std::vector<double> ref(n);
#pragma omp parallel for
            for (int r = 0; r < n; ++r) {
                double acc = 0.0;
                const uint16_t* wr = hw[m].data() + (size_t)r * k;
                for (int j = 0; j < k; ++j) acc += (double)from_bf16(wr[j]) * (double)x[j];
                ref[r] = acc;
            }
            double ss = 0.0, err = 0.0;
            for (int r = 0; r < n; ++r) {
                ss += ref[r] * ref[r];
                err = std::isnan(y[r]) ? INFINITY : std::max(err, std::fabs((double)y[r] - ref[r]));
            }
            const double rms = std::sqrt(ss / n);
            worst = std::max(worst, rms > 0 ? err / rms : INFINITY);
        }
        return worst;
    }

    // A traced run's stamps: increments per stage kind and the hand-off.
    std::string trace_summary() const {
        std::vector<unsigned long long> ready(M), done(M);
        CK(cudaMemcpy(ready.data(), dready, M * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(done.data(), ddone, M * 8, cudaMemcpyDeviceToHost));
        const size_t kinds = c.kinds.size();
        std::vector<std::vector<double>> inc(kinds);
        std::vector<double> hand;
        for (int m = 1; m < M; ++m) {
            // Differences in integers first: %globaltimer is ~1.7e18 ns, where
            // a double's step is 256 ns.
            inc[m % kinds].push_back((double)(long long)(done[m] - done[m - 1]) / 1e3);
            if (c.in[m] == m - 1) hand.push_back((double)(long long)(ready[m] - done[m - 1]) / 1e3);
        }
        std::string s = "    traced: increments";
        char buf[96];
        for (size_t i = 0; i < kinds; ++i) {
            snprintf(buf, sizeof buf, " %s %.2f", c.kinds[i].c_str(), median(inc[i]));
            s += buf;
        }
        snprintf(buf, sizeof buf, " us; hand-off %.2f us", median(hand));
        return s + buf;
    }
    void trace_reset(cudaStream_t st) const {
        CK(cudaMemsetAsync(dready, 0xff, M * 8, st));
        CK(cudaMemsetAsync(ddone, 0, M * 8, st));
    }
};

typedef void (*GemvFn)(const __nv_bfloat16*, const float*, float*, int, int, unsigned long long*,
                       unsigned long long*);

static GemvFn gemv_for(int k, bool early) {
    switch (k) {
        case 512: return early ? gemv_pdl<512, true> : gemv_pdl<512, false>;
        case 1536: return early ? gemv_pdl<1536, true> : gemv_pdl<1536, false>;
        case 2048: return early ? gemv_pdl<2048, true> : gemv_pdl<2048, false>;
        case 4096: return early ? gemv_pdl<4096, true> : gemv_pdl<4096, false>;
        default: return nullptr;
    }
}

// The chain as one graph of programmatic launches; stamps when traced.
static cudaGraphExec_t capture(const Run& run, cudaStream_t st, bool traced) {
    const Chain& c = run.c;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int m = 0; m < run.M; ++m) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((c.n[m] + 7) / 8);
        cfg.blockDim = dim3(256);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = m == 0 ? 0 : 1;
        const __nv_bfloat16* w = run.dw + run.woff[m];
        const float* x = c.in[m] < 0 ? run.dy0 : run.dyf + run.off[c.in[m]];
        float* y = run.dyf + run.off[m];
        unsigned long long* ready = traced ? run.dready : nullptr;
        unsigned long long* done = traced ? run.ddone : nullptr;
        CK(cudaLaunchKernelEx(&cfg, gemv_for(c.k[m], c.gate[m] < 0), w, x, y, c.n[m], m, ready, done));
    }
    cudaGraph_t graph;
    CK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphDestroy(graph));
    return exec;
}

int main(int argc, char** argv) {
    const std::string which = argc > 1 ? argv[1] : "all";
    const int reps = std::max(1, argc > 2 ? atoi(argv[2]) : 20);
    // An optional third argument: the persistent modes to run, comma
    // separated (default: every one; the launches always run).
    const std::string only = argc > 3 ? "," + std::string(argv[3]) + "," : "";
    int dev = 0, nsm = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    CK(cudaFuncSetAttribute(persist_chain<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_chain<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_chain<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_chain<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_rows<false, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_rows<false, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_rows<true, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_rows<true, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    CK(cudaFuncSetAttribute(persist_rows<false, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, P_SMEM));
    const double bw = copy_bandwidth();
    unsigned long long* dtick;
    unsigned long long tick = 0;
    CK(cudaMalloc(&dtick, 8));
    timer_tick<<<1, 1>>>(dtick);
    CK(cudaMemcpy(&tick, dtick, 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(dtick));
    printf("%s, %d SMs; copy bandwidth %.0f GB/s (1 GiB, read + written); %%globaltimer ticks by %llu ns; "
           "%d timed runs a mode, medians\n",
           prop.name, nsm, bw, tick, reps);
    std::vector<std::string> names;
    if (which == "all") names = {"small", "big", "decode"};
    else names = {which};
    bool ok = true;
    for (const auto& name : names) {
        if (name != "small" && name != "big" && name != "decode") {
            fprintf(stderr, "unknown chain %s (small, big, decode, all)\n", name.c_str());
            return 2;
        }
        const Chain c = make_chain(name);
        // The kernels' shape limits (red, ys, the waits' registers, steps).
        const int M = (int)c.n.size();
        for (int m = 0; m < M; ++m) {
            const int in = c.in[m], gate = c.gate[m];
            if (M > MAX_M || c.k[m] % 512 || c.n[m] % 4 || c.k[m] > MAX_K || c.n[m] > MAX_IN || (c.n[m] + nsm - 1) / nsm > MAX_ROWS ||
                (in >= 0 && (in >= m || c.k[m] > c.n[in])) || (in < 0 && m != 0) ||
                (gate >= 0 && (gate >= m || c.n[gate] > MAX_GATE)) || !gemv_for(c.k[m], true)) {
                fprintf(stderr, "chain %s step %d [%d, %d] is outside the kernels' limits on %d SMs\n", name.c_str(),
                        m, c.n[m], c.k[m], nsm);
                return 2;
            }
        }
        Run run(c);
        const double floor_us = run.bytes / (bw * 1e3);
        printf("\n%s: %d GEMVs, %.1f MB of weights, floor %.2f us (%.3f us a GEMV)\n", name.c_str(), M,
               run.bytes / 1e6, floor_us, floor_us / M);
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        std::vector<float> out(run.total_out);
        auto time_it = [&](auto&& launch) {
            std::vector<double> us;
            for (int i = 0; i < reps + 3; ++i) {
                // The GPU busy while the host submits: the interval holds the
                // chain, not the submission.
                spin<<<1, 1, 0, st>>>(100000);
                CK(cudaGetLastError());
                CK(cudaEventRecord(e0, st));
                launch(false);
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 3) us.push_back(ms * 1e3);
            }
            return median(us);
        };
        // The outputs of the run just finished against the host's products:
        // yf, or (ll) the LL words, those not of `epoch` NaN.
        auto check_out = [&](bool ll, unsigned int epoch) {
            if (ll) {
                std::vector<unsigned long long> words(run.total_out);
                CK(cudaMemcpy(words.data(), run.dll, words.size() * 8, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < words.size(); ++i) {
                    const uint32_t v = (uint32_t)words[i];
                    memcpy(&out[i], &v, 4);
                    if ((uint32_t)(words[i] >> 32) != epoch) out[i] = NAN;  // a word not written this run
                }
            } else {
                CK(cudaMemcpy(out.data(), run.dyf, out.size() * 4, cudaMemcpyDeviceToHost));
            }
            return run.check(out);
        };
        // One run from NaN outputs (a step not run fails its check), checked:
        // the first, untimed run, and the traced run after the timed ones (a
        // race that shows only in warm runs would otherwise read the values
        // an earlier run left).
        auto checked = [&](auto&& launch, bool ll, const unsigned int& epoch, bool t) {
            CK(cudaMemsetAsync(run.dyf, 0xff, (size_t)run.total_out * 4, st));
            if (t) run.trace_reset(st);
            launch(t);
            CK(cudaStreamSynchronize(st));
            return check_out(ll, epoch);
        };
        auto report = [&](const char* mode, double err, double us, const std::string& trace) {
            const bool pass = err <= 1e-4;
            ok = ok && pass;
            printf("  %-8s %9.2f us (%.3f us a GEMV, %.2fx the floor)  check %.2e %s\n%s\n", mode, us, us / M,
                   us / floor_us, err, pass ? "ok" : "FAILED", trace.c_str());
            fflush(stdout);
        };

        // launches
        {
            cudaGraphExec_t plain = capture(run, st, false), stamped = capture(run, st, true);
            auto launch = [&](bool t) { CK(cudaGraphLaunch(t ? stamped : plain, st)); };
            const unsigned int no_epoch = 0;
            const double err = checked(launch, false, no_epoch, false);
            const double us = time_it(launch);
            const double err_t = checked(launch, false, no_epoch, true);
            report("launches", std::max(err, err_t), us, run.trace_summary());
            CK(cudaGraphExecDestroy(plain));
            CK(cudaGraphExecDestroy(stamped));
        }

        // the persistent kernels: counter, ll, rows, rows16, and (for a chain
        // with routed steps) ll2, counter2, rows2 and rows16x2, with a ring of
        // their own for the routed steps. The LL modes share the LL buffer, so their epochs
        // run on across both.
        const bool routed = std::any_of(c.gate.begin(), c.gate.end(), [](int g) { return g >= 0; });
        std::vector<std::string> modes = {"counter", "ll", "rows", "rows16", "rowsr", "rowsx", "rowsi", "rowsxi", "rowsxn", "rowsxin", "rowsim", "rowsxim"};
        if (routed) modes.insert(modes.end(), {"ll2", "counter2", "rows2", "rows16x2", "rowspf", "rowspfa", "rowspfo", "rowsh", "rowspfh", "rowsng", "rowsngi"});
        unsigned int ll_epoch = 0;
        for (const std::string& mode : modes) {
            if (!only.empty() && only.find("," + mode + ",") == std::string::npos) continue;
            const bool ll = mode.rfind("ll", 0) == 0, two = mode.back() == '2', rows = mode.rfind("rows", 0) == 0,
                       wide = mode.rfind("rows16", 0) == 0;
            unsigned int cnt_epoch = 0;
            unsigned int& epoch = ll ? ll_epoch : cnt_epoch;
            // rowspf: the next layer's q/k/v (156 KB a block on 132 SMs);
            // rowspfa: and prep and the attention (189 KB); rowspfo: and
            // o_proj (313 KB; the whole next layer's dense weights, 41 MB).
            const unsigned int l2_ahead = mode == "rowspf" || mode == "rowspfh" ? 160u << 10
                                          : mode == "rowspfa"                    ? 240u << 10
                                          : mode == "rowspfo"                    ? 330u << 10
                                                                                 : 0u;
            const unsigned int l2_hints = mode == "rowsh" || mode == "rowspfh";
            CK(cudaMemcpyToSymbol(g_l2_ahead, &l2_ahead, sizeof l2_ahead));
            CK(cudaMemcpyToSymbol(g_l2_hints, &l2_hints, sizeof l2_hints));
            const unsigned int no_gate = mode == "rowsng" || mode == "rowsngi", no_wait = mode == "rowsxn" || mode == "rowsxin",
                               no_dot = mode == "rowsx" || mode == "rowsxi" || mode == "rowsxim" || no_wait,
                               interleave = mode == "rowsi" || mode == "rowsxi" || mode == "rowsxin" || mode == "rowsngi" ? 1u
                                            : mode == "rowsim" || mode == "rowsxim"                   ? 2u
                                                                                                      : 0u;
            CK(cudaMemcpyToSymbol(g_interleave, &interleave, sizeof interleave));
            CK(cudaMemcpyToSymbol(g_no_wait, &no_wait, sizeof no_wait));
            CK(cudaMemcpyToSymbol(g_no_gate, &no_gate, sizeof no_gate));
            CK(cudaMemcpyToSymbol(g_no_dot, &no_dot, sizeof no_dot));
            auto launch = [&](bool t) {
                ++epoch;
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(nsm);
                cfg.blockDim = dim3(wide ? 16 * 32 + 64 : P_THREADS);
                cfg.dynamicSmemBytes = P_SMEM;
                cfg.stream = st;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeCooperative;  // an error, not a hang, if the grid cannot be resident
                at[0].val.cooperative = 1;
                cfg.attrs = at;
                cfg.numAttrs = 1;
                unsigned long long* ready = t ? run.dready : nullptr;
                unsigned long long* done = t ? run.ddone : nullptr;
                auto kernel = rows ? (two ? (wide ? persist_rows<true, 16> : persist_rows<true, 8>)
                                          : wide            ? persist_rows<false, 16>
                                          : mode == "rowsr" ? persist_rows<false, 8, true>
                                                            : persist_rows<false, 8>)
                              : two ? (ll ? persist_chain<true, true> : persist_chain<false, true>)
                              : ll  ? persist_chain<true, false>
                                    : persist_chain<false, false>;
                CK(cudaLaunchKernelEx(&cfg, kernel, (const Step*)run.dsteps,
                                      (const int*)run.doff, M, (const float*)run.dy0, run.dll, run.dyf, run.dcnt,
                                      epoch, ready, done));
            };
            if (!ll) CK(cudaMemsetAsync(run.dcnt, 0, M * 4, st));
            const double err = checked(launch, ll, epoch, false);
            const double us = time_it(launch);
            const double err_t = checked(launch, ll, epoch, true);
            if (no_dot) {
                printf("  %-8s %9.2f us (%.3f us a GEMV, %.2fx the floor)  unchecked (no products)\n%s\n",
                       mode.c_str(), us, us / M, us / floor_us, run.trace_summary().c_str());
                fflush(stdout);
            } else {
                report(mode.c_str(), std::max(err, err_t), us, run.trace_summary());
            }
        }
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
        CK(cudaStreamDestroy(st));
    }
    printf("\n%s\n", ok ? "every check passed" : "a check FAILED");
    return ok ? 0 : 1;
}
