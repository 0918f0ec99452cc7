// Device infrastructure kernels used by src/backend/cuda/mod.rs (see kernels/README.md).
#include "common.cuh"

// out[i] = value for i < n (Gpu::fill_f32: tests poison outputs with NaN).
extern "C" __global__ void infra_fill_f32(float* __restrict__ out, float value, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = value;
    }
}

// A 32-bit hash of (seed, i): SplitMix64's finalizer. Random data for the
// bandwidth and tensor-rate ceilings without a host upload.
static __device__ __forceinline__ unsigned int infra_hash(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (unsigned int)((z ^ (z >> 31)) >> 32);
}

// out[i] = a random non-zero word, for i < n.
extern "C" __global__ void infra_fill_random_u32(unsigned int* __restrict__ out, unsigned long long seed,
                                                 unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = infra_hash(seed, i) | 1u;
    }
}

// out[i] = uniform in [-1, 1) as bf16, for i < n.
extern "C" __global__ void infra_fill_uniform_bf16(__nv_bfloat16* __restrict__ out, unsigned long long seed,
                                                   unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = __float2bfloat16((float)(infra_hash(seed, i) >> 8) * (2.0f / 16777216.0f) - 1.0f);
    }
}

// One thread waits `cycles` SM clock cycles (Gpu::spin: tests delay a
// producer stream so that a missing cross-stream wait shows).
extern "C" __global__ void infra_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

// Reads x[0..n) once, 16 bytes a lane (512 contiguous bytes a warp load, as
// the CUDA-core expert GEMVs read an expert in place), four loads in flight
// a thread; each warp XORs what it read into *sink, so no load can be left
// out. The bench's ceiling of reads in place from page-locked host memory
// mapped into the device (ceilings::host_read_in_place_bandwidth).
extern "C" __global__ void infra_read_u4(const uint4* __restrict__ x, unsigned long long n,
                                         unsigned int* __restrict__ sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0u;
    for (; i + 3ull * stride < n; i += 4ull * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = x[i + (unsigned long long)u * stride];
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = x[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31u) == 0u) atomicXor(sink, acc);
}
