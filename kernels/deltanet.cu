// deltanet kernels (see kernels/README.md for conventions): the Gated DeltaNet
// mixer core of Qwen3-Next between in_proj_qkvz / in_proj_ba and out_proj,
// mirroring src/backend/cpu/deltanet.rs (formats-and-math.md section 3).
//
// Inputs are the in_proj outputs exactly as the CPU holds them:
//   mixed_qkvz [T, qkvz_dim], each row Hk groups [q dk | k dk | v gv | z gv] (gv = Hv/Hk * dv)
//   mixed_ba   [T, 2*Hv],     each row Hk groups [b Hv/Hk | a Hv/Hk]
// State (f32, CPU layouts): conv [conv_dim, K-1] (oldest first), recurrent [Hv, dk, dv].
//
// Pipeline (src/backend/cuda/deltanet.rs drives it):
//   dn_conv_silu (+ dn_conv_state)  split + depthwise causal conv + SiLU -> qkv [T, conv_dim]
//   decode / token loop:  dn_rule_recurrent_r{16,32}   gates + l2norm + delta rule -> core [T, Hv*dv]
//   chunked prefill:      dn_qk_l2norm, dn_chunk_prep, dn_chunk_state_r{16,32}     -> core
//   dn_gated_rmsnorm      core, z -> out [T, Hv*dv]
#include "common.cuh"

// Largest conv kernel width the conv kernels hold in registers (Qwen3-Next: 4).
#define DN_MAX_CONV_K 8
// Tokens per chunk of the chunked delta rule (torch_chunk_gated_delta_rule).
#define DN_CHUNK 64
// Warps of the recurrent / chunk-state blocks; each block owns 32 value columns of one head.
#define DN_WARPS 8
#define DN_COLS 32
#define DN_THREADS (DN_WARPS * 32)

static __device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }
static __device__ __forceinline__ float dn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch softplus, beta 1, threshold 20.
static __device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static __device__ __forceinline__ float dn_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Offset of conv channel c (of cat(q, k, v)) within a row of mixed_qkvz.
static __device__ __forceinline__ int dn_qkv_src(int c, int dk, int gv, int kd) {
    const int grp = 2 * dk + 2 * gv;
    if (c < kd) return (c / dk) * grp + c % dk;
    if (c < 2 * kd) {
        const int e = c - kd;
        return (e / dk) * grp + dk + e % dk;
    }
    const int e = c - 2 * kd;
    return (e / gv) * grp + 2 * dk + e % gv;
}

// The gates of value head h at one token: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias).
static __device__ __forceinline__ void dn_gates(const float* __restrict__ ba_row, int h, int group,
                                                float a_exp, float dt_bias, float& beta, float& g) {
    const int bi = (h / group) * 2 * group + (h % group);
    beta = dn_sigmoid(ba_row[bi]);
    g = -a_exp * dn_softplus(ba_row[bi + group] + dt_bias);
}

// ---------------------------------------------------------------------------
// Split + depthwise causal conv1d + SiLU (causal_conv1d). Thread = channel c of
// cat(q, k, v); blockIdx.y = a tile of `tile` tokens. x' = cat(state, x) over time:
// out[t, c] = silu(sum_j w[c, j] x'[t + j, c]). When update_state (one tile covers
// all T), the thread also writes its channel's new state x'[T .. T+K-2] (it read
// the old one first, so there is no hazard); otherwise dn_conv_state does that
// after this kernel.
extern "C" __global__ void __launch_bounds__(128) dn_conv_silu(
    const float* __restrict__ mixed, const float* __restrict__ weight, float* __restrict__ state,
    float* __restrict__ out, int T, int tile, int dk, int gv, int kd, int conv_dim, int qkvz_dim, int K,
    int update_state) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim) return;
    const int past = K - 1;
    const int t0 = blockIdx.y * tile;
    const int t1 = min(T, t0 + tile);
    const float* xs = mixed + dn_qkv_src(c, dk, gv, kd);
    float w[DN_MAX_CONV_K];
    float win[DN_MAX_CONV_K];
#pragma unroll
    for (int j = 0; j < DN_MAX_CONV_K; ++j) w[j] = j < K ? weight[(size_t)c * K + j] : 0.0f;
    // win[j] = x'[t0 + j] for j < past.
#pragma unroll
    for (int j = 0; j < DN_MAX_CONV_K; ++j) {
        win[j] = 0.0f;
        if (j < past) {
            const int i = t0 + j;
            win[j] = i < past ? state[(size_t)c * past + i] : xs[(size_t)(i - past) * qkvz_dim];
        }
    }
    for (int t = t0; t < t1; ++t) {
        const float x = xs[(size_t)t * qkvz_dim];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < DN_MAX_CONV_K; ++j)
            if (j < past) acc += w[j] * win[j];
        float wl = 0.0f;
#pragma unroll
        for (int j = 0; j < DN_MAX_CONV_K; ++j)
            if (j == past) wl = w[j];
        acc += wl * x;
        out[(size_t)t * conv_dim + c] = dn_silu(acc);
#pragma unroll
        for (int j = 0; j < DN_MAX_CONV_K - 1; ++j)
            if (j + 1 < past) win[j] = win[j + 1];
#pragma unroll
        for (int j = 0; j < DN_MAX_CONV_K; ++j)
            if (j == past - 1) win[j] = x;
    }
    if (update_state) {
#pragma unroll
        for (int j = 0; j < DN_MAX_CONV_K; ++j)
            if (j < past) state[(size_t)c * past + j] = win[j];
    }
}

// The conv state after T tokens, new[c, j] = x'[T + j, c], for the multi-tile
// case; runs after dn_conv_silu (which read the old state). Thread = channel.
extern "C" __global__ void __launch_bounds__(128) dn_conv_state(
    const float* __restrict__ mixed, float* __restrict__ state, int T, int dk, int gv, int kd, int conv_dim,
    int qkvz_dim, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim) return;
    const int past = K - 1;
    const float* xs = mixed + dn_qkv_src(c, dk, gv, kd);
    float nx[DN_MAX_CONV_K];
#pragma unroll
    for (int j = 0; j < DN_MAX_CONV_K; ++j) {
        nx[j] = 0.0f;
        if (j < past) {
            const int i = T + j;
            nx[j] = i < past ? state[(size_t)c * past + i] : xs[(size_t)(i - past) * qkvz_dim];
        }
    }
#pragma unroll
    for (int j = 0; j < DN_MAX_CONV_K; ++j)
        if (j < past) state[(size_t)c * past + j] = nx[j];
}

// ---------------------------------------------------------------------------
// The gated delta rule, token by token (gated_delta_rule_recurrent), with the
// gates and the l2norm of q, k folded in. Block = (value head h, 32 value
// columns j0..j0+31); thread (warp w, lane) owns column j0+lane and the state
// rows i = w + 8r (r < MAXR), kept in registers over all T tokens: the state
// is read and written once per call. Per token, one pass over the rows gives
// the raw sums S^T k, S^T q, k.k, q.q, k.q; with kn = k rk, qn = q rq/sqrt(dk):
//   delta_j = beta (v_j - e^g rk (S^T k)_j)
//   o_j     = e^g rq' (S^T q)_j + delta_j rk rq' (k.q)     (= (e^g S + kn delta^T)^T qn)
//   S_ij    = e^g S_ij + kn_i delta_j
// qkv [T, conv_dim] (conv output), mixed_ba [T, 2Hv], state [Hv, dk, dv], o [T, Hv*dv].
template <int MAXR>
static __device__ __forceinline__ void dn_rule_recurrent_body(
    const float* __restrict__ qkv, const float* __restrict__ mixed_ba, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ state, float* __restrict__ o, int T, int Hk, int Hv,
    int dk, int dv) {
    __shared__ float red_sk[2][DN_WARPS][DN_COLS];
    __shared__ float red_sq[2][DN_WARPS][DN_COLS];
    __shared__ float red_sc[2][DN_WARPS][3];
    const int h = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.y * DN_COLS + lane;
    const bool jok = j < dv;
    const int group = Hv / Hk, kh = h / group;
    const int kd = Hk * dk, vd = Hv * dv, cd = 2 * kd + vd;
    float* S = state + (size_t)h * dk * dv;

    float s[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        const int i = warp + r * DN_WARPS;
        s[r] = (i < dk && jok) ? S[(size_t)i * dv + j] : 0.0f;
    }
    const float a_exp = expf(a_log[h]);
    const float bias = dt_bias[h];
    const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);

    for (int t = 0; t < T; ++t) {
        const float* row = qkv + (size_t)t * cd;
        const float* qrow = row + kh * dk;
        const float* krow = row + kd + kh * dk;
        float kr[MAXR];
        float sk = 0.0f, sq = 0.0f, kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            const int i = warp + r * DN_WARPS;
            kr[r] = 0.0f;
            if (i < dk) {
                const float q = qrow[i], k = krow[i];
                kr[r] = k;
                sk += s[r] * k;
                sq += s[r] * q;
                kk += k * k;
                qq += q * q;
                kq += k * q;
            }
        }
        const float v = jok ? row[2 * kd + h * dv + j] : 0.0f;
        float beta, g;
        dn_gates(mixed_ba + (size_t)t * 2 * Hv, h, group, a_exp, bias, beta, g);
        const int buf = t & 1;  // double-buffered: one barrier per token
        red_sk[buf][warp][lane] = sk;
        red_sq[buf][warp][lane] = sq;
        if (lane == 0) {
            red_sc[buf][warp][0] = kk;
            red_sc[buf][warp][1] = qq;
            red_sc[buf][warp][2] = kq;
        }
        __syncthreads();
        float SK = 0.0f, SQ = 0.0f, KK = 0.0f, QQ = 0.0f, KQ = 0.0f;
#pragma unroll
        for (int w = 0; w < DN_WARPS; ++w) {
            SK += red_sk[buf][w][lane];
            SQ += red_sq[buf][w][lane];
            KK += red_sc[buf][w][0];
            QQ += red_sc[buf][w][1];
            KQ += red_sc[buf][w][2];
        }
        const float decay = expf(g);
        const float rk = 1.0f / sqrtf(KK + 1e-6f);
        const float rq = (1.0f / sqrtf(QQ + 1e-6f)) * inv_sqrt_dk;
        const float delta = beta * (v - decay * (SK * rk));
        const float out = decay * (SQ * rq) + delta * (KQ * rk * rq);
#pragma unroll
        for (int r = 0; r < MAXR; ++r) s[r] = decay * s[r] + (kr[r] * rk) * delta;
        if (warp == 0 && jok) o[(size_t)t * vd + h * dv + j] = out;
    }
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        const int i = warp + r * DN_WARPS;
        if (i < dk && jok) S[(size_t)i * dv + j] = s[r];
    }
}

// dk <= 128.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_rule_recurrent_r16(
    const float* __restrict__ qkv, const float* __restrict__ mixed_ba, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ state, float* __restrict__ o, int T, int Hk, int Hv,
    int dk, int dv) {
    dn_rule_recurrent_body<16>(qkv, mixed_ba, a_log, dt_bias, state, o, T, Hk, Hv, dk, dv);
}

// dk <= 256.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_rule_recurrent_r32(
    const float* __restrict__ qkv, const float* __restrict__ mixed_ba, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ state, float* __restrict__ o, int T, int Hk, int Hv,
    int dk, int dv) {
    dn_rule_recurrent_body<32>(qkv, mixed_ba, a_log, dt_bias, state, o, T, Hk, Hv, dk, dv);
}

// ---------------------------------------------------------------------------
// Gated RMSNorm (gated_rmsnorm): out = (w * (o / sqrt(mean(o^2) + eps))) * silu(z)
// per (token, value head) row of dv; z read from mixed_qkvz. One warp per row.
extern "C" __global__ void __launch_bounds__(256) dn_gated_rmsnorm(
    const float* __restrict__ o, const float* __restrict__ mixed, const float* __restrict__ w,
    float* __restrict__ out, int rows, int Hv, int dk, int dv, int group, int qkvz_dim, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int t = row / Hv, h = row % Hv;
    const int gv = group * dv;
    const float* orow = o + (size_t)row * dv;
    const float* z = mixed + (size_t)t * qkvz_dim + (h / group) * (2 * dk + 2 * gv) + 2 * dk + gv + (h % group) * dv;
    float ss = 0.0f;
    for (int e = lane; e < dv; e += 32) ss += orow[e] * orow[e];
    ss = dn_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int e = lane; e < dv; e += 32) out[(size_t)row * dv + e] = w[e] * (orow[e] * inv) * dn_silu(z[e]);
}

// ---------------------------------------------------------------------------
// Chunked form (gated_delta_rule_chunked, chunk 64). Three steps:
//  dn_qk_l2norm:   q, k of qkv in place: k = l2norm(k), q = l2norm(q) * scale (dk^-0.5).
//  dn_chunk_prep:  per (chunk, value head), everything that does not depend on the state:
//                  c (cumulative g), beta, Tm = (I + A)^-1 with A_ij = beta_i k_i.k_j e^(c_i-c_j)
//                  (j < i), attn_ij = q_i.k_j e^(c_i-c_j) (j <= i); zero elsewhere.
//  dn_chunk_state: per (value head, 32 columns), sequential over chunks, state in shared memory:
//                  R  = beta v - (beta e^c k) S          V' = Tm R     (= U - W S of the CPU)
//                  o  = e^c (q S) + attn V'
//                  S  = e^(c_n) S + (e^(c_n - c) k)^T V'
// Rows past the end of the last chunk are zero (k = q = v = beta = 0), which adds exact zeros.

// One warp per (token, key head, q|k) row of dk.
extern "C" __global__ void __launch_bounds__(256) dn_qk_l2norm(float* __restrict__ qkv, int T, int Hk, int dk,
                                                                 int conv_dim, float q_scale) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= T * Hk * 2) return;
    const int which = row % 2, kh = (row / 2) % Hk, t = row / (2 * Hk);
    float* x = qkv + (size_t)t * conv_dim + which * Hk * dk + kh * dk;
    float ss = 0.0f;
    for (int e = lane; e < dk; e += 32) ss += x[e] * x[e];
    ss = dn_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    const float scale = which == 0 ? q_scale : 1.0f;
    for (int e = lane; e < dk; e += 32) x[e] = (x[e] * inv) * scale;
}

// Grid (chunk, value head), 256 threads. Dynamic shared memory: ks [64][dk+1],
// qs [64][max(dk+1, 65)] (q, then X = Tm at stride 65), am [64][65], cum[64], beta[64].
// Outputs: cum_out, beta_out [Hv, T]; tm, attn [Hv, nchunks, 64, 64].
extern "C" __global__ void __launch_bounds__(256) dn_chunk_prep(
    const float* __restrict__ qkv, const float* __restrict__ mixed_ba, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ cum_out, float* __restrict__ beta_out,
    float* __restrict__ tm, float* __restrict__ attn, int T, int Hk, int Hv, int dk, int dv) {
    extern __shared__ float dn_prep_smem[];
    const int ld = dk + 1;
    float* ks = dn_prep_smem;
    float* qs = ks + DN_CHUNK * ld;
    float* am = qs + DN_CHUNK * max(ld, DN_CHUNK + 1);
    float* cum = am + DN_CHUNK * (DN_CHUNK + 1);
    float* bet = cum + DN_CHUNK;
    const int ch = blockIdx.x, h = blockIdx.y, nch = gridDim.x;
    const int tid = threadIdx.x;
    const int t0 = ch * DN_CHUNK;
    const int n = min(DN_CHUNK, T - t0);
    const int group = Hv / Hk, kh = h / group;
    const int kd = Hk * dk, cd = 2 * kd + Hv * dv;

    if (tid < DN_CHUNK) {
        float beta = 0.0f, g = 0.0f;
        if (tid < n) dn_gates(mixed_ba + (size_t)(t0 + tid) * 2 * Hv, h, group, expf(a_log[h]), dt_bias[h], beta, g);
        bet[tid] = beta;
        cum[tid] = g;
    }
    for (int idx = tid; idx < DN_CHUNK * dk; idx += blockDim.x) {
        const int i = idx / dk, r = idx % dk;
        const bool ok = i < n;
        const float* row = qkv + (size_t)(t0 + (ok ? i : 0)) * cd;
        ks[i * ld + r] = ok ? row[kd + kh * dk + r] : 0.0f;
        qs[i * ld + r] = ok ? row[kh * dk + r] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;  // sequential, as the CPU sums it
        for (int i = 0; i < DN_CHUNK; ++i) {
            acc += cum[i];
            cum[i] = acc;
        }
    }
    __syncthreads();
    if (tid < n) {
        cum_out[(size_t)h * T + t0 + tid] = cum[tid];
        beta_out[(size_t)h * T + t0 + tid] = bet[tid];
    }
    float* attn_blk = attn + ((size_t)h * nch + ch) * DN_CHUNK * DN_CHUNK;
    float* tm_blk = tm + ((size_t)h * nch + ch) * DN_CHUNK * DN_CHUNK;
    // Entry (i, j): a warp shares i (broadcast reads of row i) and spans 32 j (rows j
    // at stride dk+1: no bank conflicts).
    for (int e = tid; e < DN_CHUNK * DN_CHUNK; e += blockDim.x) {
        const int i = e / DN_CHUNK, j = e % DN_CHUNK;
        float a = 0.0f, p = 0.0f;
        if (j <= i && i < n) {
            const float* ki = ks + i * ld;
            const float* qi = qs + i * ld;
            const float* kj = ks + j * ld;
            float dkk = 0.0f, dqk = 0.0f;
            for (int r = 0; r < dk; ++r) {
                dkk += ki[r] * kj[r];
                dqk += qi[r] * kj[r];
            }
            const float d = expf(cum[i] - cum[j]);
            a = j < i ? (bet[i] * dkk) * d : 0.0f;
            p = dqk * d;
        }
        am[i * (DN_CHUNK + 1) + j] = a;
        attn_blk[e] = p;
    }
    __syncthreads();
    // Tm = (I + A)^-1 by forward substitution, one column c per thread:
    // X_ic = [i == c] - sum_{c <= l < i} A_il X_lc (X_lc = 0 for l < c). X lives in qs.
    float* xs = qs;
    if (tid < DN_CHUNK) {
        const int c = tid;
        for (int i = 0; i < DN_CHUNK; ++i) {
            float x = 0.0f;
            if (i >= c) {
                // Four partial sums: the chain of dependent multiply-adds is 4x shorter.
                float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
                const float* ai = am + i * (DN_CHUNK + 1);
                int l = c;
                for (; l + 3 < i; l += 4) {
                    p0 += ai[l] * xs[l * (DN_CHUNK + 1) + c];
                    p1 += ai[l + 1] * xs[(l + 1) * (DN_CHUNK + 1) + c];
                    p2 += ai[l + 2] * xs[(l + 2) * (DN_CHUNK + 1) + c];
                    p3 += ai[l + 3] * xs[(l + 3) * (DN_CHUNK + 1) + c];
                }
                for (; l < i; ++l) p0 += ai[l] * xs[l * (DN_CHUNK + 1) + c];
                x = (i == c ? 1.0f : 0.0f) - ((p0 + p1) + (p2 + p3));
            }
            xs[i * (DN_CHUNK + 1) + c] = x;
            tm_blk[i * DN_CHUNK + c] = x;
        }
    }
}

// Grid (value head, ceil(dv/32)), 256 threads; thread (warp w, lane) owns column
// j0+lane and chunk rows i = w + 8m (m < 8) / state rows r = w + 8m (m < MAXR).
// Dynamic shared memory: ss [dk][32] (the state slice), buf [64][dk+1] (k or q),
// mat [64][65] (Tm or attn), rs [64][33] (R then V'), ec, kdec, bet [64].
template <int MAXR>
static __device__ __forceinline__ void dn_chunk_state_body(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ beta_in,
    const float* __restrict__ tm, const float* __restrict__ attn, float* __restrict__ state, float* __restrict__ o,
    int T, int Hk, int Hv, int dk, int dv) {
    extern __shared__ float dn_state_smem[];
    const int ld = dk + 1;
    const int MLD = DN_CHUNK + 1;
    float* ss = dn_state_smem;
    float* buf = ss + dk * DN_COLS;
    float* mat = buf + DN_CHUNK * ld;
    float* rs = mat + DN_CHUNK * MLD;
    float* ec = rs + DN_CHUNK * (DN_COLS + 1);
    float* kdec = ec + DN_CHUNK;
    float* bet = kdec + DN_CHUNK;
    const int h = blockIdx.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int j = blockIdx.y * DN_COLS + lane;
    const bool jok = j < dv;
    const int group = Hv / Hk, kh = h / group;
    const int kd = Hk * dk, vd = Hv * dv, cd = 2 * kd + vd;
    const int nch = (T + DN_CHUNK - 1) / DN_CHUNK;
    float* S = state + (size_t)h * dk * dv;

    for (int idx = tid; idx < dk * DN_COLS; idx += blockDim.x) {
        const int r = idx / DN_COLS, c = idx % DN_COLS;
        const int jj = blockIdx.y * DN_COLS + c;
        ss[idx] = jj < dv ? S[(size_t)r * dv + jj] : 0.0f;
    }

    for (int ch = 0; ch < nch; ++ch) {
        const int t0 = ch * DN_CHUNK;
        const int n = min(DN_CHUNK, T - t0);
        const float* tm_blk = tm + ((size_t)h * nch + ch) * DN_CHUNK * DN_CHUNK;
        const float* attn_blk = attn + ((size_t)h * nch + ch) * DN_CHUNK * DN_CHUNK;
        __syncthreads();  // the previous chunk is done with buf, mat, rs, ec, kdec, bet
        const float c_last = cum_in[(size_t)h * T + t0 + n - 1];
        if (tid < DN_CHUNK) {
            const bool ok = tid < n;
            const float c = ok ? cum_in[(size_t)h * T + t0 + tid] : 0.0f;
            ec[tid] = ok ? expf(c) : 0.0f;
            kdec[tid] = ok ? expf(c_last - c) : 0.0f;
            bet[tid] = ok ? beta_in[(size_t)h * T + t0 + tid] : 0.0f;
        }
        for (int idx = tid; idx < DN_CHUNK * dk; idx += blockDim.x) {
            const int i = idx / dk, r = idx % dk;
            buf[i * ld + r] = i < n ? qkv[(size_t)(t0 + i) * cd + kd + kh * dk + r] : 0.0f;
        }
        for (int idx = tid; idx < DN_CHUNK * DN_CHUNK; idx += blockDim.x)
            mat[(idx / DN_CHUNK) * MLD + idx % DN_CHUNK] = tm_blk[idx];
        __syncthreads();

        // R_i = beta_i v_i - beta_i e^(c_i) (k_i S).
        float acc[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
        for (int r = 0; r < dk; ++r) {
            const float sv = ss[r * DN_COLS + lane];
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[m] += buf[(warp + 8 * m) * ld + r] * sv;
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
            const float v = (i < n && jok) ? qkv[(size_t)(t0 + i) * cd + 2 * kd + h * dv + j] : 0.0f;
            rs[i * (DN_COLS + 1) + lane] = bet[i] * v - (bet[i] * ec[i]) * acc[m];
        }
        __syncthreads();
        // V' = Tm R. Tm is stored with its zeros above the diagonal, so the full
        // sum over l is the triangular one, with 8 independent chains a thread.
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
        for (int l = 0; l < DN_CHUNK; ++l) {
            const float rv = rs[l * (DN_COLS + 1) + lane];
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[m] += mat[(warp + 8 * m) * MLD + l] * rv;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < 8; ++m) rs[(warp + 8 * m) * (DN_COLS + 1) + lane] = acc[m];
        for (int idx = tid; idx < DN_CHUNK * dk; idx += blockDim.x) {
            const int i = idx / dk, r = idx % dk;
            buf[i * ld + r] = i < n ? qkv[(size_t)(t0 + i) * cd + kh * dk + r] : 0.0f;
        }
        for (int idx = tid; idx < DN_CHUNK * DN_CHUNK; idx += blockDim.x)
            mat[(idx / DN_CHUNK) * MLD + idx % DN_CHUNK] = attn_blk[idx];
        __syncthreads();

        // o_i = e^(c_i) (q_i S) + sum_{l <= i} attn_il V'_l (attn zero above the diagonal).
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
        for (int r = 0; r < dk; ++r) {
            const float sv = ss[r * DN_COLS + lane];
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[m] += buf[(warp + 8 * m) * ld + r] * sv;
        }
        float po[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) po[m] = 0.0f;
        for (int l = 0; l < DN_CHUNK; ++l) {
            const float rv = rs[l * (DN_COLS + 1) + lane];
#pragma unroll
            for (int m = 0; m < 8; ++m) po[m] += mat[(warp + 8 * m) * MLD + l] * rv;
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
            if (i < n && jok) o[(size_t)(t0 + i) * vd + h * dv + j] = ec[i] * acc[m] + po[m];
        }
        __syncthreads();  // every read of ss and buf (q) is done
        for (int idx = tid; idx < DN_CHUNK * dk; idx += blockDim.x) {
            const int i = idx / dk, r = idx % dk;
            buf[i * ld + r] = i < n ? qkv[(size_t)(t0 + i) * cd + kd + kh * dk + r] : 0.0f;
        }
        __syncthreads();
        // S_r = e^(c_n) S_r + sum_i e^(c_n - c_i) k_ir V'_i (own entries only).
        // Rows i >= n have kdec = 0 and zero k.
        const float chunk_decay = expf(c_last);
        float su[MAXR];
#pragma unroll
        for (int m = 0; m < MAXR; ++m) su[m] = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float kv = kdec[i] * rs[i * (DN_COLS + 1) + lane];
            const float* ki = buf + i * ld;
#pragma unroll
            for (int m = 0; m < MAXR; ++m)
                if (warp + 8 * m < dk) su[m] += ki[warp + 8 * m] * kv;
        }
#pragma unroll
        for (int m = 0; m < MAXR; ++m) {
            const int r = warp + 8 * m;
            if (r < dk) ss[r * DN_COLS + lane] = chunk_decay * ss[r * DN_COLS + lane] + su[m];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < dk * DN_COLS; idx += blockDim.x) {
        const int r = idx / DN_COLS, c = idx % DN_COLS;
        const int jj = blockIdx.y * DN_COLS + c;
        if (jj < dv) S[(size_t)r * dv + jj] = ss[idx];
    }
}

// dk <= 128.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_chunk_state_r16(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ beta_in,
    const float* __restrict__ tm, const float* __restrict__ attn, float* __restrict__ state, float* __restrict__ o,
    int T, int Hk, int Hv, int dk, int dv) {
    dn_chunk_state_body<16>(qkv, cum_in, beta_in, tm, attn, state, o, T, Hk, Hv, dk, dv);
}

// dk <= 256.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_chunk_state_r32(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ beta_in,
    const float* __restrict__ tm, const float* __restrict__ attn, float* __restrict__ state, float* __restrict__ o,
    int T, int Hk, int Hv, int dk, int dv) {
    dn_chunk_state_body<32>(qkv, cum_in, beta_in, tm, attn, state, o, T, Hk, Hv, dk, dv);
}
