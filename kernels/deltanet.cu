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
//   chunked prefill:      dn_qk_l2norm, dn_chunk_prep, dn_chunk_state_r{16,32}     -> core (WY form)
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
// Chunked form (gated_delta_rule_chunked, chunk 64), in the WY/UT formulation. With, per
// chunk and value head, c the cumulative log decay, Tm = (I + A)^-1 (A_ij = beta_i k_i.k_j
// e^(c_i-c_j), j < i), attn_ij = q_i.k_j e^(c_i-c_j) (j <= i) and P = attn Tm:
//   W  = Tm (beta e^c k)            U  = Tm (beta v)                 (the CPU's W, U)
//   Q' = e^c q - P (beta e^c k)     O0 = P (beta v)
// the chunk's output and state update are
//   V' = U - W S      o = O0 + Q' S      S = e^(c_n) S + (e^(c_n - c) k)^T V'
// (o = e^c q S + attn V' = e^c q S + P (beta v) - P (beta e^c k) S). Everything but the
// three products with S is independent of the state, so it runs in parallel over chunks:
//  dn_qk_l2norm:   q, k of qkv in place: k = l2norm(k), q = l2norm(q) * scale (dk^-0.5).
//  dn_chunk_prep:  per (chunk, value head): c, Tm, attn, P, then W, Q', U and O0 (O0 straight
//                  into the output, which dn_chunk_state adds Q' S to).
//  dn_chunk_state: per (value head, 16 columns), sequential over chunks, the state slice in
//                  shared memory: two fused passes over S (V' and o), one update.
// Rows past the end of the last chunk are zero (k = W = Q' = U = 0), which adds exact zeros.

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

// Row stride of the 64x64 matrices of dn_chunk_prep read as float4s (X, P).
#define DN_ML4 (DN_CHUNK + 4)

// acc[m][x] = sum_{l < n} M[i][l] B[l][col] for the rows i = warp + 8m (m < 8) and the columns
// col = c0 + lane + 32x (x < 4; zero where col >= ncols) of a 64-row block: M [64][DN_ML4]
// (16-byte aligned), B [64][ldb] with rows >= n zero (the sum runs to n rounded up to 4).
// Per 4 l: 8 broadcast float4 reads of M and 16 conflict-free reads of B for 128 multiply-adds.
static __device__ __forceinline__ void dn_prep_mm(const float* __restrict__ M, const float* __restrict__ B,
                                                  int ldb, int c0, int ncols, int n, int warp, int lane,
                                                  float (&acc)[8][4]) {
#pragma unroll
    for (int m = 0; m < 8; ++m)
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[m][x] = 0.0f;
    const int n4 = (n + 3) & ~3;
    for (int l = 0; l < n4; l += 4) {
        float b[4][4];
#pragma unroll
        for (int y = 0; y < 4; ++y)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int col = c0 + lane + 32 * x;
                b[y][x] = col < ncols ? B[(l + y) * ldb + col] : 0.0f;
            }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float4 mv = *reinterpret_cast<const float4*>(M + (warp + 8 * m) * DN_ML4 + l);
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                acc[m][x] += mv.x * b[0][x];
                acc[m][x] += mv.y * b[1][x];
                acc[m][x] += mv.z * b[2][x];
                acc[m][x] += mv.w * b[3][x];
            }
        }
    }
}

// Grid (chunk, value head), 256 threads. Dynamic shared memory:
//   kv [64][max(dk, dv) + 1]: k (scaled in place to beta e^c k), then beta v at stride dv+1
//   qs [64][max(dk + 1, 68)]: q, then X = Tm at stride 68 (DN_ML4)
//   am [64][68]: A, then P = attn Tm
//   pa [64][65]: attn
//   cum [64], bet [64]
// Outputs: cum_out [Hv, T]; w_out, qp_out [Hv, T, dk4] (dk4 = dk rounded up to 4, the
// padding columns zero); u_out [Hv, T, dv]; o [T, Hv*dv] (O0).
extern "C" __global__ void __launch_bounds__(256, 2) dn_chunk_prep(
    const float* __restrict__ qkv, const float* __restrict__ mixed_ba, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ cum_out, float* __restrict__ w_out,
    float* __restrict__ qp_out, float* __restrict__ u_out, float* __restrict__ o, int T, int Hk, int Hv, int dk,
    int dv) {
    extern __shared__ float4 dn_prep_smem4[];
    float* dn_prep_smem = reinterpret_cast<float*>(dn_prep_smem4);
    const int ld = dk + 1, lv = dv + 1;
    const int MLD = DN_CHUNK + 1, ML4 = DN_ML4;
    float* ks = dn_prep_smem;
    float* qs = ks + DN_CHUNK * max(ld, lv);
    float* am = qs + DN_CHUNK * max(ld, ML4);
    float* pa = am + DN_CHUNK * ML4;
    float* cum = pa + DN_CHUNK * MLD;
    float* bet = cum + DN_CHUNK;
    const int ch = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x;
    const int t0 = ch * DN_CHUNK;
    const int n = min(DN_CHUNK, T - t0);
    const int group = Hv / Hk, kh = h / group;
    const int kd = Hk * dk, vd = Hv * dv, cd = 2 * kd + vd;
    const int dk4 = (dk + 3) & ~3;

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
    if (tid < n) cum_out[(size_t)h * T + t0 + tid] = cum[tid];
    // A and attn, register-blocked: warp w owns rows i = w + 8m (m < 8; broadcast reads),
    // lane the columns j = lane, lane + 32 (rows j at stride dk+1: no bank conflicts).
    const int warp = tid >> 5, lane = tid & 31;
    {
        float sa[8][2], sp[8][2];
#pragma unroll
        for (int m = 0; m < 8; ++m) sa[m][0] = sa[m][1] = sp[m][0] = sp[m][1] = 0.0f;
        for (int r = 0; r < dk; ++r) {
            const float k0 = ks[lane * ld + r], k1 = ks[(lane + 32) * ld + r];
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int i = warp + 8 * m;
                const float ki = ks[i * ld + r], qi = qs[i * ld + r];
                sa[m][0] += ki * k0;
                sa[m][1] += ki * k1;
                sp[m][0] += qi * k0;
                sp[m][1] += qi * k1;
            }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int j = lane + 32 * x;
                float a = 0.0f, p = 0.0f;
                if (j <= i && i < n) {
                    const float d = expf(cum[i] - cum[j]);
                    a = j < i ? (bet[i] * sa[m][x]) * d : 0.0f;
                    p = sp[m][x] * d;
                }
                am[i * ML4 + j] = a;
                pa[i * MLD + j] = p;
            }
        }
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
                const float* ai = am + i * ML4;
                int l = c;
                for (; l + 3 < i; l += 4) {
                    p0 += ai[l] * xs[l * ML4 + c];
                    p1 += ai[l + 1] * xs[(l + 1) * ML4 + c];
                    p2 += ai[l + 2] * xs[(l + 2) * ML4 + c];
                    p3 += ai[l + 3] * xs[(l + 3) * ML4 + c];
                }
                for (; l < i; ++l) p0 += ai[l] * xs[l * ML4 + c];
                x = (i == c ? 1.0f : 0.0f) - ((p0 + p1) + (p2 + p3));
            }
            xs[i * ML4 + c] = x;
        }
    }
    __syncthreads();
    // P = attn X (lower triangular with its diagonal) over A in am; k scaled to beta e^c k.
    for (int e = tid; e < DN_CHUNK * DN_CHUNK; e += blockDim.x) {
        const int i = e / DN_CHUNK, j = e % DN_CHUNK;
        float p = 0.0f;
        for (int l = j; l <= i; ++l) p += pa[i * MLD + l] * xs[l * ML4 + j];
        am[i * ML4 + j] = p;
    }
    for (int idx = tid; idx < DN_CHUNK * dk; idx += blockDim.x) {
        const int i = idx / dk, r = idx % dk;
        ks[i * ld + r] *= bet[i] * expf(cum[i]);
    }
    __syncthreads();
    // W = X kt, Q' = e^c q - P kt in passes of 128 columns (dn_prep_mm; X and P are zero
    // above the diagonal, so the sums run over all l < n). Padding columns dk <= r < dk4: zeros.
    for (int r0 = 0; r0 < dk4; r0 += 128) {
        float acc[8][4];
        dn_prep_mm(xs, ks, ld, r0, dk, n, warp, lane, acc);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int r = r0 + lane + 32 * x;
                if (i < n && r < dk4) w_out[((size_t)h * T + t0 + i) * dk4 + r] = r < dk ? acc[m][x] : 0.0f;
            }
        }
        dn_prep_mm(am, ks, ld, r0, dk, n, warp, lane, acc);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int r = r0 + lane + 32 * x;
                if (i < n && r < dk4)
                    qp_out[((size_t)h * T + t0 + i) * dk4 + r] =
                        r < dk ? expf(cum[i]) * qkv[(size_t)(t0 + i) * cd + kh * dk + r] - acc[m][x] : 0.0f;
            }
        }
    }
    __syncthreads();  // every read of kt is done
    for (int idx = tid; idx < DN_CHUNK * dv; idx += blockDim.x) {
        const int i = idx / dv, jj = idx % dv;
        ks[i * lv + jj] = i < n ? bet[i] * qkv[(size_t)(t0 + i) * cd + 2 * kd + h * dv + jj] : 0.0f;
    }
    __syncthreads();
    // U = X (beta v), O0 = P (beta v), as W and Q'.
    for (int j0 = 0; j0 < dv; j0 += 128) {
        float acc[8][4];
        dn_prep_mm(xs, ks, lv, j0, dv, n, warp, lane, acc);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int jj = j0 + lane + 32 * x;
                if (i < n && jj < dv) u_out[((size_t)h * T + t0 + i) * dv + jj] = acc[m][x];
            }
        }
        dn_prep_mm(am, ks, lv, j0, dv, n, warp, lane, acc);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = warp + 8 * m;
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int jj = j0 + lane + 32 * x;
                if (i < n && jj < dv) o[(size_t)(t0 + i) * vd + h * dv + jj] = acc[m][x];
            }
        }
    }
}

// Value columns per block of dn_chunk_state.
#define DN_SCOLS 16

// Grid (value head, ceil(dv/16)), 256 threads, MAXDK = 128 or 256 (>= dk). Thread
// (grp = tid / 16, c = tid % 16) owns column j0+c: chunk rows i = grp + 16m (m < 4) in
// the passes over S, state rows r = grp*RPT + x (x < RPT = MAXDK/16) in the update.
// Dynamic shared memory: ss [MAXDK][16] (the state slice, rows >= dk zero),
// wb [64][MAXDK+4] (W, then e^(c_n - c) k), qb [64][MAXDK+4] (Q'), vb [64][16] (V'), kdec [64].
template <int MAXDK>
static __device__ __forceinline__ void dn_chunk_state_body(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ w_in,
    const float* __restrict__ qp_in, const float* __restrict__ u_in, float* __restrict__ state,
    float* __restrict__ o, int T, int Hk, int Hv, int dk, int dv) {
    constexpr int LDW = MAXDK + 4;  // float4 rows; rows i, i+1 four banks apart
    constexpr int RPT = MAXDK / 16;
    constexpr int SC = DN_SCOLS;
    extern __shared__ float4 dn_state_smem4[];
    float* ss = reinterpret_cast<float*>(dn_state_smem4);
    float* wb = ss + MAXDK * SC;
    float* qb = wb + DN_CHUNK * LDW;
    float* vb = qb + DN_CHUNK * LDW;
    float* kdec = vb + DN_CHUNK * SC;
    const int h = blockIdx.x;
    const int tid = threadIdx.x;
    const int c = tid % SC, grp = tid / SC;
    const int j = blockIdx.y * SC + c;
    const bool jok = j < dv;
    const int group = Hv / Hk, kh = h / group;
    const int kd = Hk * dk, vd = Hv * dv, cd = 2 * kd + vd;
    const int dk4 = (dk + 3) & ~3;
    const int nch = (T + DN_CHUNK - 1) / DN_CHUNK;
    float* S = state + (size_t)h * dk * dv;

    for (int idx = tid; idx < MAXDK * SC; idx += blockDim.x) {
        const int r = idx / SC, cc = idx % SC;
        const int jj = blockIdx.y * SC + cc;
        ss[idx] = (r < dk && jj < dv) ? S[(size_t)r * dv + jj] : 0.0f;
    }

    for (int ch = 0; ch < nch; ++ch) {
        const int t0 = ch * DN_CHUNK;
        const int n = min(DN_CHUNK, T - t0);
        const float* wblk = w_in + ((size_t)h * T + t0) * dk4;
        const float* qblk = qp_in + ((size_t)h * T + t0) * dk4;
        __syncthreads();  // the previous chunk is done with wb, vb, kdec and its ss update
        const float c_last = cum_in[(size_t)h * T + t0 + n - 1];
        if (tid < DN_CHUNK) {
            const bool ok = tid < n;
            kdec[tid] = ok ? expf(c_last - cum_in[(size_t)h * T + t0 + tid]) : 0.0f;
        }
        // W, Q' rows (global stride dk4, 16-byte aligned) as float4s; zeros past n and dk4.
        for (int idx = tid; idx < DN_CHUNK * (MAXDK / 4); idx += blockDim.x) {
            const int i = idx / (MAXDK / 4), r = (idx % (MAXDK / 4)) * 4;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
            if (i < n && r < dk4) {
                a = *reinterpret_cast<const float4*>(wblk + (size_t)i * dk4 + r);
                b = *reinterpret_cast<const float4*>(qblk + (size_t)i * dk4 + r);
            }
            *reinterpret_cast<float4*>(wb + i * LDW + r) = a;
            *reinterpret_cast<float4*>(qb + i * LDW + r) = b;
        }
        __syncthreads();

        // V'_i = U_i - W_i S and o_i = O0_i + Q'_i S, in one pass over S.
        float av[4], ao[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) av[m] = ao[m] = 0.0f;
        for (int r = 0; r < dk4; r += 4) {
            const float s0 = ss[r * SC + c], s1 = ss[(r + 1) * SC + c];
            const float s2 = ss[(r + 2) * SC + c], s3 = ss[(r + 3) * SC + c];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int i = grp + 16 * m;
                const float4 w4 = *reinterpret_cast<const float4*>(wb + i * LDW + r);
                const float4 q4 = *reinterpret_cast<const float4*>(qb + i * LDW + r);
                av[m] = fmaf(w4.x, s0, av[m]);
                ao[m] = fmaf(q4.x, s0, ao[m]);
                av[m] = fmaf(w4.y, s1, av[m]);
                ao[m] = fmaf(q4.y, s1, ao[m]);
                av[m] = fmaf(w4.z, s2, av[m]);
                ao[m] = fmaf(q4.z, s2, ao[m]);
                av[m] = fmaf(w4.w, s3, av[m]);
                ao[m] = fmaf(q4.w, s3, ao[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int i = grp + 16 * m;
            const bool ok = i < n && jok;
            const float u = ok ? u_in[((size_t)h * T + t0 + i) * dv + j] : 0.0f;
            vb[i * SC + c] = u - av[m];
            if (ok) {
                float* op = o + (size_t)(t0 + i) * vd + h * dv + j;
                *op = *op + ao[m];
            }
        }
        __syncthreads();  // every read of wb (W) and ss is done
        // e^(c_n - c_i) k_i into wb (zeros past n and dk).
        for (int idx = tid; idx < DN_CHUNK * MAXDK; idx += blockDim.x) {
            const int i = idx / MAXDK, r = idx % MAXDK;
            wb[i * LDW + r] =
                (i < n && r < dk) ? kdec[i] * qkv[(size_t)(t0 + i) * cd + kd + kh * dk + r] : 0.0f;
        }
        __syncthreads();
        // S_r = e^(c_n) S_r + sum_i kd_ir V'_i (own entries only; rows >= dk stay zero).
        const float chunk_decay = expf(c_last);
        const int r0 = grp * RPT;
        float su[RPT];
#pragma unroll
        for (int x = 0; x < RPT; ++x) su[x] = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float vv = vb[i * SC + c];
            const float* kr = wb + i * LDW + r0;
#pragma unroll
            for (int x = 0; x < RPT; x += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(kr + x);
                su[x] = fmaf(k4.x, vv, su[x]);
                su[x + 1] = fmaf(k4.y, vv, su[x + 1]);
                su[x + 2] = fmaf(k4.z, vv, su[x + 2]);
                su[x + 3] = fmaf(k4.w, vv, su[x + 3]);
            }
        }
#pragma unroll
        for (int x = 0; x < RPT; ++x) {
            const int r = r0 + x;
            if (r < dk) ss[r * SC + c] = chunk_decay * ss[r * SC + c] + su[x];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < MAXDK * SC; idx += blockDim.x) {
        const int r = idx / SC, cc = idx % SC;
        const int jj = blockIdx.y * SC + cc;
        if (r < dk && jj < dv) S[(size_t)r * dv + jj] = ss[idx];
    }
}

// dk <= 128.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_chunk_state_r16(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ w_in,
    const float* __restrict__ qp_in, const float* __restrict__ u_in, float* __restrict__ state,
    float* __restrict__ o, int T, int Hk, int Hv, int dk, int dv) {
    dn_chunk_state_body<128>(qkv, cum_in, w_in, qp_in, u_in, state, o, T, Hk, Hv, dk, dv);
}

// dk <= 256.
extern "C" __global__ void __launch_bounds__(DN_THREADS) dn_chunk_state_r32(
    const float* __restrict__ qkv, const float* __restrict__ cum_in, const float* __restrict__ w_in,
    const float* __restrict__ qp_in, const float* __restrict__ u_in, float* __restrict__ state,
    float* __restrict__ o, int T, int Hk, int Hv, int dk, int dv) {
    dn_chunk_state_body<256>(qkv, cum_in, w_in, qp_in, u_in, state, o, T, Hk, Hv, dk, dv);
}
