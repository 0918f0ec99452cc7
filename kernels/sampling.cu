// A sampled decode step's draw on the device (src/backend/cuda/sampling.rs):
// the token src/sampling.rs's `Sampler` picks from one row of logits, with
// the same arithmetic, so the same token. Token i's weight is the f32
// exp_neg((l_i - max) / T) from IEEE operations only (no contraction: the
// __f*_rn intrinsics), its mass the integer floor(w_i * 2^40); masses add
// exactly in u64 whatever the order. The order is logit descending, then
// token ascending; tokens of zero mass are out. Three launches:
// samp_max (the largest logit and its lowest index), samp_weights (the
// weights and a histogram of count and mass per weight bucket, 16 an
// octave), samp_pick (one block: the filters' cuts and the draw, each a
// query on the buckets' prefix sums and, inside the one bucket it falls
// in, a radix descent on a 64-bit key of the order: no sort).

#define SAMP_MASS_BITS 40
#define SAMP_KEY_SHIFT 19
// f32 bits of 1.0 and of 2^-40, shifted by SAMP_KEY_SHIFT.
#define SAMP_KEY_ONE (0x3f800000u >> SAMP_KEY_SHIFT)
#define SAMP_KEY_MIN (((127u - SAMP_MASS_BITS) << 23) >> SAMP_KEY_SHIFT)
#define SAMP_BUCKETS (SAMP_KEY_ONE - SAMP_KEY_MIN + 1)
#define SAMP_WEIGHT_THREADS 256
#define SAMP_PICK_THREADS 1024
// Copies of the radix histogram (by warp), so that a crowded digit's
// atomics spread over several addresses.
#define SAMP_COPIES 8
// samp_pick's result: the token (SAMP_NONE when the input was not finite
// logits), whether the draw used the random number.
#define SAMP_NONE 0xffffffffu

// The state the three launches share (zeroed before samp_max).
struct SampState {
    unsigned long long max_key;  // samp_order(max) << 32 | ~index, the largest
    unsigned int count[SAMP_BUCKETS];
    unsigned long long mass[SAMP_BUCKETS];
};

// A finite logit's bits, monotone as an unsigned integer (-0 as +0).
static __device__ __forceinline__ unsigned int samp_order(float v) {
    const unsigned int b = v == 0.0f ? 0u : __float_as_uint(v);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// sampling.rs's exp_neg, operation for operation.
static __device__ __forceinline__ float samp_exp_neg(float x) {
    const float ROUND = 12582912.0f;
    x = x > -87.0f ? x : -87.0f;
    const float t = __fadd_rn(__fmul_rn(x, 1.44269504088896340736f), ROUND);
    const float n = __fsub_rn(t, ROUND);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.6933594f)), __fmul_rn(n, -2.1219444e-4f));
    float p = 1.9875692e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 0.16666665f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    const int n_int = (int)__float_as_uint(t) - (int)__float_as_uint(ROUND);
    return __fmul_rn(y, __uint_as_float((unsigned int)(n_int + 127) << 23));
}

static __device__ __forceinline__ unsigned long long samp_mass(unsigned int bits) {
    const unsigned int e = bits >> 23;
    const unsigned long long m = (bits & 0x7fffffu) | 0x800000u;
    const unsigned int sh = e >= 133u ? 0u : min(133u - e, 63u);
    return (m << 23) >> sh;
}

// The weight's bucket (0: the most probable), SAMP_BUCKETS without mass.
static __device__ __forceinline__ unsigned int samp_bucket(unsigned int bits) {
    const unsigned int key = bits >> SAMP_KEY_SHIFT;
    return key >= SAMP_KEY_MIN ? SAMP_KEY_ONE - min(key, SAMP_KEY_ONE) : SAMP_BUCKETS;
}

// The key of token i in the order: smaller is more probable.
static __device__ __forceinline__ unsigned long long samp_key(float logit, unsigned int i) {
    return (unsigned long long)(~samp_order(logit)) << 32 | i;
}

// Grid-stride: the largest logit, lowest index on ties, into st->max_key.
extern "C" __global__ void __launch_bounds__(SAMP_WEIGHT_THREADS)
    samp_max(const float* __restrict__ logits, unsigned int V, SampState* __restrict__ st) {
    strata_pdl_wait();
    unsigned long long best = 0;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        const unsigned long long k = (unsigned long long)samp_order(logits[i]) << 32 | (0xffffffffu - i);
        best = k > best ? k : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) atomicMax(&st->max_key, best);
}

// Grid-stride: bits[i] = the weight of token i, and the buckets' counts
// and masses (per block in shared memory, then added to st).
extern "C" __global__ void __launch_bounds__(SAMP_WEIGHT_THREADS)
    samp_weights(const float* __restrict__ logits, unsigned int V, float temperature, SampState* __restrict__ st,
                 unsigned int* __restrict__ bits) {
    __shared__ unsigned int count[SAMP_BUCKETS];
    __shared__ unsigned long long mass[SAMP_BUCKETS];
    for (unsigned int b = threadIdx.x; b < SAMP_BUCKETS; b += blockDim.x) {
        count[b] = 0;
        mass[b] = 0;
    }
    strata_pdl_wait();
    const unsigned int ord = (unsigned int)(st->max_key >> 32);
    // Back from the order to the float (the largest logit).
    const float max = __uint_as_float(ord & 0x80000000u ? ord & 0x7fffffffu : ~ord);
    __syncthreads();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        const unsigned int w = __float_as_uint(samp_exp_neg(__fdiv_rn(__fsub_rn(logits[i], max), temperature)));
        bits[i] = w;
        const unsigned int b = samp_bucket(w);
        if (b < SAMP_BUCKETS) {
            atomicAdd(&count[b], 1u);
            atomicAdd(&mass[b], samp_mass(w));
        }
    }
    __syncthreads();
    for (unsigned int b = threadIdx.x; b < SAMP_BUCKETS; b += blockDim.x) {
        if (count[b] != 0) {
            atomicAdd(&st->count[b], count[b]);
            atomicAdd(&st->mass[b], mass[b]);
        }
    }
}

// samp_pick's shared state.
struct SampPick {
    unsigned int start[SAMP_BUCKETS + 1];  // bucket b: positions start[b]..start[b + 1]
    unsigned long long cum[SAMP_BUCKETS + 1];  // the mass of the buckets before b
    unsigned int hist_count[SAMP_COPIES][256];
    unsigned long long hist_mass[SAMP_COPIES][256];
    unsigned int n;  // entries in the current list
    unsigned int n_next;
    unsigned long long lo, hi;  // the least and the largest key of the list
    unsigned long long lo_next, hi_next;
    unsigned int digit;
    int done;
    unsigned long long need, before_mass;
    unsigned int before_count;
    unsigned int counted;
};

// What samp_select found: an entry of a bucket, the entries of that bucket
// before it in the order, and their mass.
struct SampFound {
    unsigned int id;
    unsigned int before;
    unsigned long long before_mass;
    bool ok;
};

// Warp-wide (every lane calls it): appends k to list[*n++] where take,
// one shared atomic a warp (in any order: the key sets the order).
static __device__ __forceinline__ void samp_append(bool take, unsigned long long k, unsigned long long* list,
                                                   unsigned int* n) {
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int mask = __ballot_sync(0xffffffffu, take);
    unsigned int base = 0;
    if (lane == 0 && mask != 0) base = atomicAdd(n, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (take) list[base + __popc(mask & ((1u << lane) - 1u))] = k;
}

static __device__ __forceinline__ unsigned long long samp_block_min_max(unsigned long long v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? (other > v ? other : v) : (other < v ? other : v);
    }
    return v;
}

// Block-wide (every thread calls it): the first entry of bucket b, in the
// order, through which the running mass (by_mass) or count reaches `need`
// (>= 1). The bucket's keys are gathered into `a` (a pass over the
// weights), then each round histograms the 8 bits below the highest bit
// in which the list's least and largest keys differ, keeps the digit the
// answer lies in (gathered into the other list) and adds what lies
// before it. Keys are distinct (the token is in them), so it ends with
// one entry; at most 64 rounds. Not found (`ok` false) only if the
// bucket cannot hold the answer (input that was not finite logits).
static __device__ SampFound samp_select(const float* __restrict__ logits, const unsigned int* __restrict__ bits,
                                        unsigned int V, unsigned int b, bool by_mass, unsigned long long need,
                                        unsigned long long* __restrict__ a, unsigned long long* __restrict__ c,
                                        SampPick& sh) {
    const unsigned int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        sh.n = 0;
        sh.lo = ~0ull;
        sh.hi = 0;
        sh.need = need;
        sh.before_mass = 0;
        sh.before_count = 0;
        sh.done = 0;
    }
    __syncthreads();
    unsigned long long lo = ~0ull, hi = 0;
    for (unsigned int i0 = 0; i0 < V; i0 += blockDim.x) {
        const unsigned int i = i0 + tid;
        const bool take = i < V && samp_bucket(bits[i]) == b;
        const unsigned long long k = take ? samp_key(logits[i], i) : 0;
        samp_append(take, k, a, &sh.n);
        if (take) {
            lo = k < lo ? k : lo;
            hi = k > hi ? k : hi;
        }
    }
    lo = samp_block_min_max(lo, false);
    hi = samp_block_min_max(hi, true);
    if (lane == 0) {
        atomicMin(&sh.lo, lo);
        atomicMax(&sh.hi, hi);
    }
    __syncthreads();
    for (int round = 0; round < 64; ++round) {
        const unsigned int n = sh.n;
        if (n <= 1 || sh.done) break;
        const unsigned long long diff = sh.lo ^ sh.hi;
        const int top = 63 - __clzll(diff);  // highest differing bit (n > 1: keys differ)
        const int shift = top >= 7 ? top - 7 : 0;
        for (unsigned int j = tid; j < SAMP_COPIES * 256; j += blockDim.x) {
            (&sh.hist_count[0][0])[j] = 0;
            (&sh.hist_mass[0][0])[j] = 0;
        }
        __syncthreads();
        const unsigned int copy = warp % SAMP_COPIES;
        for (unsigned int j = tid; j < n; j += blockDim.x) {
            const unsigned long long k = a[j];
            const unsigned int d = (unsigned int)(k >> shift) & 255u;
            atomicAdd(&sh.hist_count[copy][d], 1u);
            atomicAdd(&sh.hist_mass[copy][d], samp_mass(bits[(unsigned int)k]));
        }
        __syncthreads();
        if (warp == 0) {
            // The digits in order, 8 a lane: the first whose running total reaches the need.
            unsigned long long m8[8];
            unsigned int c8[8];
            unsigned long long msum = 0;
            unsigned int csum = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const unsigned int d = lane * 8 + q;
                unsigned long long m = 0;
                unsigned int cn = 0;
#pragma unroll
                for (int cp = 0; cp < SAMP_COPIES; ++cp) {
                    m += sh.hist_mass[cp][d];
                    cn += sh.hist_count[cp][d];
                }
                m8[q] = m;
                c8[q] = cn;
                msum += m;
                csum += cn;
            }
            // Exclusive scan of the lanes' sums.
            unsigned long long mex = msum;
            unsigned int cex = csum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long mo = __shfl_up_sync(0xffffffffu, mex, o);
                const unsigned int co = __shfl_up_sync(0xffffffffu, cex, o);
                if (lane >= o) {
                    mex += mo;
                    cex += co;
                }
            }
            mex -= msum;
            cex -= csum;
            const unsigned long long want = sh.need;
            const unsigned long long reach = by_mass ? mex + msum : (unsigned long long)(cex + csum);
            const unsigned long long from = by_mass ? mex : (unsigned long long)cex;
            const bool here = from < want && reach >= want;
            const unsigned int ballot = __ballot_sync(0xffffffffu, here);
            if (ballot == 0) {
                if (lane == 0) sh.done = 2;  // the need lies past the list: not finite input
            } else if (lane == __ffs(ballot) - 1) {
                unsigned long long m = mex;
                unsigned int cn = cex;
                int q = 0;
                for (; q < 7; ++q) {
                    const unsigned long long next = by_mass ? m + m8[q] : (unsigned long long)(cn + c8[q]);
                    if (next >= want) break;
                    m += m8[q];
                    cn += c8[q];
                }
                sh.digit = lane * 8 + q;
                sh.need = want - (by_mass ? m : (unsigned long long)cn);
                sh.before_mass += m;
                sh.before_count += cn;
                sh.n_next = 0;
                sh.lo_next = ~0ull;
                sh.hi_next = 0;
            }
        }
        __syncthreads();
        if (sh.done) break;
        const unsigned int digit = sh.digit;
        lo = ~0ull;
        hi = 0;
        for (unsigned int j0 = 0; j0 < n; j0 += blockDim.x) {
            const unsigned int j = j0 + tid;
            const unsigned long long k = j < n ? a[j] : 0;
            const bool take = j < n && ((unsigned int)(k >> shift) & 255u) == digit;
            samp_append(take, k, c, &sh.n_next);
            if (take) {
                lo = k < lo ? k : lo;
                hi = k > hi ? k : hi;
            }
        }
        lo = samp_block_min_max(lo, false);
        hi = samp_block_min_max(hi, true);
        if (lane == 0) {
            atomicMin(&sh.lo_next, lo);
            atomicMax(&sh.hi_next, hi);
        }
        __syncthreads();
        if (tid == 0) {
            sh.n = sh.n_next;
            sh.lo = sh.lo_next;
            sh.hi = sh.hi_next;
        }
        unsigned long long* t = a;
        a = c;
        c = t;
        __syncthreads();
    }
    SampFound f;
    f.ok = sh.n == 1 && sh.done == 0;
    f.id = f.ok ? (unsigned int)a[0] : SAMP_NONE;
    f.before = sh.before_count;
    f.before_mass = sh.before_mass;
    // The last entry must itself reach the need.
    if (f.ok) {
        const unsigned long long own = by_mass ? samp_mass(bits[f.id]) : 1ull;
        f.ok = own >= sh.need && f.id < V;
    }
    __syncthreads();
    return f;
}

// One block of SAMP_PICK_THREADS: the token sampling.rs's `Sampler::pick`
// picks (top-k, then top-p, then min-p, then the draw with u), into
// out[0], and into out[1] whether the draw used u. `a` and `c` hold V keys
// each. top_k 0, top_p >= 1, min_p <= 0: off; greedy: the argmax.
extern "C" __global__ void __launch_bounds__(SAMP_PICK_THREADS)
    samp_pick(const float* __restrict__ logits, const unsigned int* __restrict__ bits, unsigned int V,
              const SampState* __restrict__ st, int greedy, unsigned int top_k, float top_p, float min_p, double u,
              unsigned long long* __restrict__ a, unsigned long long* __restrict__ c,
              unsigned int* __restrict__ out) {
    __shared__ SampPick sh;
    const unsigned int tid = threadIdx.x, lane = tid & 31;
    strata_pdl_wait();
    const unsigned int argmax = 0xffffffffu - (unsigned int)(st->max_key & 0xffffffffu);
    if (greedy) {
        if (tid == 0) {
            out[0] = argmax < V ? argmax : SAMP_NONE;
            out[1] = 0;
        }
        return;
    }
    // Prefix sums of the buckets (warp 0: a run of buckets a lane).
    if (tid < 32) {
        const unsigned int per = (SAMP_BUCKETS + 31) / 32;
        const unsigned int b0 = lane * per, b1 = min(b0 + per, (unsigned int)SAMP_BUCKETS);
        unsigned int cs = 0;
        unsigned long long ms = 0;
        for (unsigned int b = b0; b < b1; ++b) {
            cs += st->count[b];
            ms += st->mass[b];
        }
        unsigned int cex = cs;
        unsigned long long mex = ms;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned int co = __shfl_up_sync(0xffffffffu, cex, o);
            const unsigned long long mo = __shfl_up_sync(0xffffffffu, mex, o);
            if (lane >= o) {
                cex += co;
                mex += mo;
            }
        }
        cex -= cs;
        mex -= ms;
        for (unsigned int b = b0; b < b1; ++b) {
            sh.start[b] = cex;
            sh.cum[b] = mex;
            cex += st->count[b];
            mex += st->mass[b];
        }
        if (lane == 31) {
            sh.start[SAMP_BUCKETS] = cex;
            sh.cum[SAMP_BUCKETS] = mex;
        }
    }
    __syncthreads();
    const unsigned int len = sh.start[SAMP_BUCKETS];
    bool ok = len >= 1;
    unsigned int n = len;
    // A prefix's mass known without a selection: n -> its mass.
    unsigned int known_n = len;
    unsigned long long known_mass = sh.cum[SAMP_BUCKETS];
    // The bucket holding position i (< len): the last b with start[b] <= i.
    auto bucket_of = [&](unsigned int i) {
        unsigned int lo = 0, hi = SAMP_BUCKETS;  // start[lo] <= i < start[hi]
        while (hi - lo > 1) {
            const unsigned int mid = (lo + hi) / 2;
            if (sh.start[mid] <= i) lo = mid; else hi = mid;
        }
        return lo;
    };
    // The mass of the first m entries (1 <= m <= len).
    auto prefix_mass = [&](unsigned int m) -> unsigned long long {
        if (m == known_n) return known_mass;
        const unsigned int b = bucket_of(m - 1);
        if (m == sh.start[b + 1]) return sh.cum[b + 1];
        const SampFound f = samp_select(logits, bits, V, b, false, m - sh.start[b] + 1, a, c, sh);
        ok = ok && f.ok;
        return sh.cum[b] + f.before_mass;
    };
    // The smallest m whose prefix reaches `target` (1 <= target <= the
    // whole mass), with that prefix's mass (known_n), and its last entry.
    auto first_reaching = [&](unsigned long long target, unsigned int& id) -> unsigned int {
        unsigned int lo = 0, hi = SAMP_BUCKETS;  // cum[lo] < target <= cum[hi]
        while (hi - lo > 1) {
            const unsigned int mid = (lo + hi) / 2;
            if (sh.cum[mid] < target) lo = mid; else hi = mid;
        }
        const SampFound f = samp_select(logits, bits, V, lo, true, target - sh.cum[lo], a, c, sh);
        ok = ok && f.ok;
        id = f.id;
        known_n = sh.start[lo] + f.before + 1;
        known_mass = sh.cum[lo] + f.before_mass + (f.ok ? samp_mass(bits[f.id]) : 0);
        return known_n;
    };
    unsigned int id = SAMP_NONE;
    if (ok && top_k > 0) n = min(n, top_k);
    if (ok && top_p < 1.0f) {
        const unsigned long long m = prefix_mass(n);
        const double t = ceil(__dmul_rn(__ull2double_rn(m), (double)top_p));
        unsigned long long target = t >= 18446744073709551615.0 ? ~0ull : (unsigned long long)t;
        target = target < 1 ? 1 : (target > m ? m : target);
        if (ok) n = first_reaching(target, id);
    }
    if (ok && min_p > 0.0f) {
        const unsigned int w = __float_as_uint(min_p);
        unsigned int at_least = len;
        if (samp_bucket(w) < SAMP_BUCKETS) {
            if (tid == 0) sh.counted = 0;
            __syncthreads();
            unsigned int cn = 0;
            for (unsigned int i = tid; i < V; i += blockDim.x) cn += bits[i] >= w;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) cn += __shfl_xor_sync(0xffffffffu, cn, o);
            if (lane == 0) atomicAdd(&sh.counted, cn);
            __syncthreads();
            at_least = sh.counted;
        }
        n = min(n, at_least);
    }
    n = max(n, 1u);
    unsigned int token = argmax, used = 0;
    if (ok && n > 1) {
        const unsigned long long total = prefix_mass(n);
        unsigned long long below = (unsigned long long)__dmul_rn(u, __ull2double_rn(total));
        below = below < total - 1 ? below : total - 1;
        first_reaching(below + 1, id);
        token = id;
        used = 1;
    }
    if (tid == 0) {
        out[0] = ok && token < V ? token : SAMP_NONE;
        out[1] = used;
    }
}
