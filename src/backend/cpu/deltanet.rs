//! The Gated DeltaNet mixer of Qwen3-Next ("linear_attention" layers), one
//! function per step (formats-and-math.md section 3; transformers 5.17
//! `Qwen3NextGatedDeltaNet` in `models/qwen3_next/modeling_qwen3_next.py`):
//!
//! in_proj_qkvz, in_proj_ba -> `split_qkvz`, `split_ba` -> `causal_conv1d`
//! (+SiLU) over cat(q, k, v) -> `deltanet_gates` -> `gated_delta_rule_*`
//! -> `gated_rmsnorm` with z -> out_proj; `gated_deltanet_layer` runs them all.
//!
//! Layouts: activations row-major `[T, width]`; a layer's state is the conv
//! state `[conv_dim, K-1]` and the recurrent state `[Hv, dk, dv]`, both f32
//! and zero before the first token.

use rayon::prelude::*;

use super::next_ops::{inv_rms, sigmoid};
use super::ops::{dot, matmul, silu};
use crate::backend::Matrix;

/// chunk_size of `torch_chunk_gated_delta_rule`, the prefill form.
pub const DELTA_RULE_CHUNK: usize = 64;

/// eps of transformers' `l2norm` (inside the rsqrt, added to the sum of squares).
const L2NORM_EPS: f32 = 1e-6;

/// softplus returns its input above this (torch's default threshold, beta 1).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Head counts and sizes of one Gated DeltaNet layer: Hk key heads of dk,
/// Hv value heads of dv (Hv a multiple of Hk; value head j reads key head
/// `j / (Hv / Hk)`), and the depthwise conv kernel width K.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaNetShape {
    /// Hk * dk: the width of q and of k.
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }

    /// Hv * dv: the width of v, z and the mixer output.
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }

    /// Channels of the conv: cat(q, k, v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Rows of in_proj_qkvz.
    pub fn qkvz_dim(&self) -> usize {
        2 * self.key_dim() + 2 * self.value_dim()
    }

    /// Rows of in_proj_ba.
    pub fn ba_dim(&self) -> usize {
        2 * self.value_heads
    }

    /// Value heads per key head.
    pub fn group(&self) -> usize {
        self.value_heads / self.key_heads
    }

    /// Length of the conv state `[conv_dim, K-1]`.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
    }

    /// Length of the recurrent state `[Hv, dk, dv]`.
    pub fn recurrent_state_len(&self) -> usize {
        self.value_heads * self.key_head_dim * self.value_head_dim
    }

    fn check(&self) {
        assert!(
            self.key_heads > 0 && self.value_heads % self.key_heads == 0,
            "DeltaNetShape: value_heads {} is not a multiple of key_heads {}",
            self.value_heads,
            self.key_heads
        );
        assert!(self.conv_kernel >= 1, "DeltaNetShape: conv_kernel 0");
    }
}

/// Splits the in_proj_qkvz output `mixed [T, qkvz_dim]` as
/// `fix_query_key_value_ordering` does: each row is Hk groups, group g being
/// `[q_g (dk) | k_g (dk) | v (Hv/Hk * dv) | z (Hv/Hk * dv)]`, and the v, z of
/// group g are value heads `g * Hv/Hk ..`. Writes `q, k [T, Hk*dk]` and
/// `v, z [T, Hv*dv]`.
pub fn split_qkvz(mixed: &[f32], shape: DeltaNetShape, q: &mut [f32], k: &mut [f32], v: &mut [f32], z: &mut [f32]) {
    shape.check();
    let (dk, gv) = (shape.key_head_dim, shape.group() * shape.value_head_dim);
    let (kd, vd) = (shape.key_dim(), shape.value_dim());
    let rows = mixed.len() / shape.qkvz_dim();
    assert_eq!(mixed.len(), rows * shape.qkvz_dim(), "split_qkvz: mixed is not [T, {}]", shape.qkvz_dim());
    assert!(q.len() == rows * kd && k.len() == q.len(), "split_qkvz: q, k");
    assert!(v.len() == rows * vd && z.len() == v.len(), "split_qkvz: v, z");
    for (idx, src) in mixed.chunks(2 * dk + 2 * gv).enumerate() {
        let (t, g) = (idx / shape.key_heads, idx % shape.key_heads);
        q[t * kd + g * dk..][..dk].copy_from_slice(&src[..dk]);
        k[t * kd + g * dk..][..dk].copy_from_slice(&src[dk..2 * dk]);
        v[t * vd + g * gv..][..gv].copy_from_slice(&src[2 * dk..2 * dk + gv]);
        z[t * vd + g * gv..][..gv].copy_from_slice(&src[2 * dk + gv..]);
    }
}

/// Splits the in_proj_ba output `mixed [T, 2*Hv]` as
/// `fix_query_key_value_ordering` does: each row is Hk groups of
/// `[b (Hv/Hk) | a (Hv/Hk)]`. Writes `b, a [T, Hv]`.
pub fn split_ba(mixed: &[f32], shape: DeltaNetShape, b: &mut [f32], a: &mut [f32]) {
    shape.check();
    let r = shape.group();
    let rows = mixed.len() / shape.ba_dim();
    assert_eq!(mixed.len(), rows * shape.ba_dim(), "split_ba: mixed is not [T, {}]", shape.ba_dim());
    assert!(b.len() == rows * shape.value_heads && a.len() == b.len(), "split_ba: b, a");
    for (idx, src) in mixed.chunks(2 * r).enumerate() {
        b[idx * r..][..r].copy_from_slice(&src[..r]);
        a[idx * r..][..r].copy_from_slice(&src[r..]);
    }
}

/// Depthwise causal conv1d over time, then SiLU, with a carried state:
/// `out[t, c] = silu(sum_j weight[c, j] * x'[t + j, c])` where `x'` is the
/// input with the state's K-1 columns in front (no bias; Qwen3-Next has none).
/// `x, out [T, C]`, `weight [C, K]` (the checkpoint's `[C, 1, K]`),
/// `state [C, K-1]` in/out: the last K-1 PRE-conv inputs of each channel,
/// oldest first, zero before the first token. Afterwards it holds the last
/// K-1 columns of `x'`, so one call over T tokens equals T calls of one.
///
/// Mirrors `causal_conv1d_fn` (prefill: zero left padding) and
/// `causal_conv1d_update` (decode: cat(state, x), keep the tail). transformers
/// keeps K columns of state; the oldest never reaches an output.
pub fn causal_conv1d(x: &[f32], weight: &[f32], state: &mut [f32], out: &mut [f32]) {
    // The weight has one column per channel more than the state.
    let channels = weight.len() - state.len();
    assert!(channels > 0 && weight.len() % channels == 0, "causal_conv1d: weight [C, K] and state [C, K-1] disagree");
    let kernel = weight.len() / channels;
    let past = kernel - 1;
    let rows = x.len() / channels;
    assert!(x.len() == rows * channels && out.len() == x.len(), "causal_conv1d: x, out are not [T, {channels}]");
    // Column i of channel c of x' = cat(state, x) over time.
    let input = |c: usize, i: usize| if i < past { state[c * past + i] } else { x[(i - past) * channels + c] };
    out.par_chunks_mut(channels).enumerate().for_each(|(t, o)| {
        for (c, oc) in o.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for j in 0..kernel {
                acc += weight[c * kernel + j] * input(c, t + j);
            }
            *oc = silu(acc);
        }
    });
    let mut next = vec![0.0f32; state.len()];
    for c in 0..channels {
        for j in 0..past {
            next[c * past + j] = input(c, rows + j);
        }
    }
    state.copy_from_slice(&next);
}

/// `log(1 + exp(x))`, returning `x` above 20: torch.nn.functional.softplus
/// with beta 1 and threshold 20.
pub fn softplus(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The per-token, per-value-head gates of the delta rule, over `[T, Hv]`:
/// `beta = sigmoid(b)` (the write strength) and
/// `g = -exp(A_log) * softplus(a + dt_bias)` (the log of the state decay),
/// as in `Qwen3NextGatedDeltaNet.forward`.
pub fn deltanet_gates(b: &[f32], a: &[f32], a_log: &[f32], dt_bias: &[f32], beta: &mut [f32], g: &mut [f32]) {
    let hv = a_log.len();
    assert!(dt_bias.len() == hv && a.len() % hv.max(1) == 0, "deltanet_gates: shapes");
    assert!(b.len() == a.len() && beta.len() == a.len() && g.len() == a.len(), "deltanet_gates: lengths");
    for i in 0..a.len() {
        let h = i % hv;
        beta[i] = sigmoid(b[i]);
        g[i] = -a_log[h].exp() * softplus(a[i] + dt_bias[h]);
    }
}

/// `x *= 1 / sqrt(sum(x^2) + 1e-6)` (transformers' `l2norm`, as FLA does it).
pub fn l2norm(x: &mut [f32]) {
    let mut sum_sq = 0.0f32;
    for &v in x.iter() {
        sum_sq += v * v;
    }
    let inv = 1.0 / (sum_sq + L2NORM_EPS).sqrt();
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// One value head's inputs to the delta rule, gathered to contiguous rows:
/// q, k `[T, dk]` (from key head `h / (Hv/Hk)`: repeat_interleave), l2-normed,
/// q also scaled; v `[T, dv]`; g, beta `[T]`.
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// Inputs of the delta rule for all heads (see `gated_delta_rule_recurrent`).
struct RuleInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    shape: DeltaNetShape,
    rows: usize,
}

impl<'a> RuleInputs<'a> {
    fn new(
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        g: &'a [f32],
        beta: &'a [f32],
        shape: DeltaNetShape,
    ) -> RuleInputs<'a> {
        shape.check();
        let rows = v.len() / shape.value_dim();
        assert_eq!(v.len(), rows * shape.value_dim(), "gated_delta_rule: v is not [T, Hv*dv]");
        assert!(q.len() == rows * shape.key_dim() && k.len() == q.len(), "gated_delta_rule: q, k are not [T, Hk*dk]");
        assert!(g.len() == rows * shape.value_heads && beta.len() == g.len(), "gated_delta_rule: g, beta");
        RuleInputs { q, k, v, g, beta, shape, rows }
    }

    /// Value head `h`'s rows; `scale_q` applies dk^-0.5 the way the mirrored
    /// transformers function writes it.
    fn head(&self, h: usize, scale_q: impl Fn(f32) -> f32) -> HeadInputs {
        let s = self.shape;
        let (dk, dv, kh) = (s.key_head_dim, s.value_head_dim, h / s.group());
        let mut x = HeadInputs {
            q: Vec::with_capacity(self.rows * dk),
            k: Vec::with_capacity(self.rows * dk),
            v: Vec::with_capacity(self.rows * dv),
            g: Vec::with_capacity(self.rows),
            beta: Vec::with_capacity(self.rows),
        };
        for t in 0..self.rows {
            x.q.extend_from_slice(&self.q[t * s.key_dim() + kh * dk..][..dk]);
            x.k.extend_from_slice(&self.k[t * s.key_dim() + kh * dk..][..dk]);
            x.v.extend_from_slice(&self.v[t * s.value_dim() + h * dv..][..dv]);
            x.g.push(self.g[t * s.value_heads + h]);
            x.beta.push(self.beta[t * s.value_heads + h]);
        }
        for (qt, kt) in x.q.chunks_mut(dk).zip(x.k.chunks_mut(dk)) {
            l2norm(qt);
            l2norm(kt);
            for e in qt.iter_mut() {
                *e = scale_q(*e);
            }
        }
        x
    }

    /// Runs `head_fn(inputs, state of the head) -> out [T, dv]` for every
    /// value head in parallel and writes the results into `out [T, Hv*dv]`.
    fn run(&self, state: &mut [f32], out: &mut [f32], head_fn: impl Fn(usize, &mut [f32]) -> Vec<f32> + Sync + Send) {
        let (dk, dv) = (self.shape.key_head_dim, self.shape.value_head_dim);
        assert_eq!(state.len(), self.shape.recurrent_state_len(), "gated_delta_rule: state is not [Hv, dk, dv]");
        assert_eq!(out.len(), self.v.len(), "gated_delta_rule: out");
        let per_head: Vec<Vec<f32>> = state.par_chunks_mut(dk * dv).enumerate().map(|(h, s)| head_fn(h, s)).collect();
        let vd = self.shape.value_dim();
        for (h, o) in per_head.iter().enumerate() {
            for t in 0..self.rows {
                out[t * vd + h * dv..][..dv].copy_from_slice(&o[t * dv..][..dv]);
            }
        }
    }
}

/// The gated delta rule, one token at a time (`torch_recurrent_gated_delta_rule`
/// with `use_qk_l2norm_in_kernel=True`, the decode form).
///
/// `q, k [T, Hk*dk]`, `v [T, Hv*dv]`, `g, beta [T, Hv]`, `out [T, Hv*dv]`,
/// `state [Hv, dk, dv]` in/out (zero for a fresh sequence). Per value head,
/// with q, k of key head `h / (Hv/Hk)`, `q = l2norm(q) / sqrt(dk)`,
/// `k = l2norm(k)`, and for each token t:
///
/// ```text
/// S = exp(g_t) S;   d = beta_t (v_t - S^T k_t);   S = S + k_t d^T;   o_t = S^T q_t
/// ```
///
/// All in f32; parallel over value heads.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: DeltaNetShape,
    state: &mut [f32],
    out: &mut [f32],
) {
    let inputs = RuleInputs::new(q, k, v, g, beta, shape);
    let (dk, dv) = (shape.key_head_dim, shape.value_head_dim);
    let sqrt_dk = (dk as f32).sqrt();
    inputs.run(state, out, |h, s| {
        let x = inputs.head(h, |e| e / sqrt_dk);
        let mut o = vec![0.0f32; inputs.rows * dv];
        let mut delta = vec![0.0f32; dv];
        for t in 0..inputs.rows {
            let (qt, kt, vt) = (&x.q[t * dk..][..dk], &x.k[t * dk..][..dk], &x.v[t * dv..][..dv]);
            let decay = x.g[t].exp();
            for e in s.iter_mut() {
                *e *= decay;
            }
            // delta = beta (v - S^T k)
            delta.fill(0.0);
            for i in 0..dk {
                for j in 0..dv {
                    delta[j] += s[i * dv + j] * kt[i];
                }
            }
            for j in 0..dv {
                delta[j] = (vt[j] - delta[j]) * x.beta[t];
            }
            // S += k delta^T
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += kt[i] * delta[j];
                }
            }
            // o = S^T q
            let ot = &mut o[t * dv..][..dv];
            for i in 0..dk {
                for j in 0..dv {
                    ot[j] += s[i * dv + j] * qt[i];
                }
            }
        }
        o
    });
}

/// The gated delta rule in chunks of `chunk` tokens (`torch_chunk_gated_delta_rule`
/// with `use_qk_l2norm_in_kernel=True`, the prefill form; chunk 64 there). Same
/// arguments and, up to rounding, the same outputs and final state as
/// `gated_delta_rule_recurrent` (here `q = l2norm(q) * dk^-0.5`).
///
/// Within a chunk of n tokens, with `c_i = g_1 + .. + g_i` (cumulative log
/// decay) and `D_ij = exp(c_i - c_j)` for `j <= i`:
///
/// ```text
/// A_ij = (beta_i k_i . k_j) D_ij  (j < i)         L = I + A (unit lower triangular)
/// U = L^-1 (beta v)               W = L^-1 (beta k exp(c))   (forward substitution)
/// V' = U - W S                    (the part of v the old state does not predict)
/// o_i = exp(c_i) q_i^T S + sum_{j<=i} (q_i . k_j) D_ij V'_j
/// S = exp(c_n) S + sum_j exp(c_n - c_j) k_j V'_j^T
/// ```
///
/// transformers zero-pads T to a multiple of the chunk; padded tokens have
/// k = v = beta = g = 0, so they add exact zeros to every real output and to
/// the state. Here the last chunk is simply shorter, which is the same sum.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: DeltaNetShape,
    chunk: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(chunk > 0, "gated_delta_rule_chunked: chunk 0");
    let inputs = RuleInputs::new(q, k, v, g, beta, shape);
    let (dk, dv) = (shape.key_head_dim, shape.value_head_dim);
    let scale = (dk as f64).powf(-0.5) as f32;
    inputs.run(state, out, |h, s| {
        let x = inputs.head(h, |e| e * scale);
        let mut o = vec![0.0f32; inputs.rows * dv];
        for start in (0..inputs.rows).step_by(chunk) {
            let n = chunk.min(inputs.rows - start);
            let q = &x.q[start * dk..][..n * dk];
            let k = &x.k[start * dk..][..n * dk];
            let v = &x.v[start * dv..][..n * dv];
            let beta = &x.beta[start..][..n];
            delta_rule_chunk(q, k, v, &x.g[start..][..n], beta, dk, dv, s, &mut o[start * dv..][..n * dv]);
        }
        o
    });
}

/// One chunk of `gated_delta_rule_chunked` for one head: `q, k [n, dk]`
/// (normalized, q scaled), `v [n, dv]`, `g, beta [n]`, `s [dk, dv]` in/out,
/// `out [n, dv]`.
#[allow(clippy::too_many_arguments)]
fn delta_rule_chunk(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    s: &mut [f32],
    out: &mut [f32],
) {
    let n = g.len();
    // c_i: the cumulative log decay from the chunk start through token i.
    let mut cum = vec![0.0f32; n];
    let mut acc = 0.0f32;
    for i in 0..n {
        acc += g[i];
        cum[i] = acc;
    }
    let decay = |i: usize, j: usize| (cum[i] - cum[j]).exp();
    let (qi, ki, vi) = (|i: usize| &q[i * dk..][..dk], |i: usize| &k[i * dk..][..dk], |i: usize| &v[i * dv..][..dv]);

    let kb: Vec<f32> = (0..n * dk).map(|e| k[e] * beta[e / dk]).collect();

    // The intra-chunk systems: a (strictly lower part of L) and attn
    // (q_i . k_j D_ij for j <= i), both [n, n], zero above the diagonal.
    let mut a = vec![0.0f32; n * n];
    let mut attn = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let d = decay(i, j);
            if j < i {
                a[i * n + j] = dot(&kb[i * dk..][..dk], ki(j)) * d;
            }
            attn[i * n + j] = dot(qi(i), ki(j)) * d;
        }
    }

    // Forward substitution through L = I + a: U = L^-1 (beta v), W = L^-1 (beta k exp(c)).
    let mut u = vec![0.0f32; n * dv];
    let mut w = vec![0.0f32; n * dk];
    for i in 0..n {
        for e in 0..dv {
            u[i * dv + e] = vi(i)[e] * beta[i];
        }
        let ec = cum[i].exp();
        for e in 0..dk {
            w[i * dk + e] = kb[i * dk + e] * ec;
        }
        for j in 0..i {
            let l = a[i * n + j];
            for e in 0..dv {
                u[i * dv + e] -= l * u[j * dv + e];
            }
            for e in 0..dk {
                w[i * dk + e] -= l * w[j * dk + e];
            }
        }
    }

    // V' = U - W S.
    let mut v_new = u;
    for i in 0..n {
        for r in 0..dk {
            let wr = w[i * dk + r];
            for e in 0..dv {
                v_new[i * dv + e] -= wr * s[r * dv + e];
            }
        }
    }

    // o_i = exp(c_i) q_i^T S + sum_{j <= i} attn_ij V'_j.
    for i in 0..n {
        let o = &mut out[i * dv..][..dv];
        let ec = cum[i].exp();
        for r in 0..dk {
            let qr = qi(i)[r] * ec;
            for e in 0..dv {
                o[e] += qr * s[r * dv + e];
            }
        }
        for j in 0..=i {
            let p = attn[i * n + j];
            for e in 0..dv {
                o[e] += p * v_new[j * dv + e];
            }
        }
    }

    // S = exp(c_n) S + sum_j exp(c_n - c_j) k_j V'_j^T.
    let last = cum[n - 1];
    let chunk_decay = last.exp();
    for e in s.iter_mut() {
        *e *= chunk_decay;
    }
    for j in 0..n {
        let kd = (last - cum[j]).exp();
        for r in 0..dk {
            let kr = ki(j)[r] * kd;
            for e in 0..dv {
                s[r * dv + e] += kr * v_new[j * dv + e];
            }
        }
    }
}

/// Gated RMSNorm of each row of `o` (row length `w.len()`, one value head):
/// `out = (w * (o * 1/sqrt(mean(o^2) + eps))) * silu(z)`, with the plain
/// weight `w` (not 1 + w). Mirrors `Qwen3NextRMSNormGated` (norm before gate,
/// all in f32).
pub fn gated_rmsnorm(o: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(o.len() % d == 0 && z.len() == o.len() && out.len() == o.len(), "gated_rmsnorm: shapes");
    out.par_chunks_mut(d).zip(o.par_chunks(d).zip(z.par_chunks(d))).for_each(|(y, (or, zr))| {
        let s = inv_rms(or, eps);
        for i in 0..d {
            y[i] = w[i] * (or[i] * s) * silu(zr[i]);
        }
    });
}

/// The weights of one Gated DeltaNet layer, as transformers names them
/// (`linear_attn.*`), dequantized to f32.
#[derive(Clone, Copy, Debug)]
pub struct GatedDeltaNetWeights<'a> {
    /// `[2*Hk*dk + 2*Hv*dv, hidden]`, rows grouped per key head (`split_qkvz`).
    pub in_proj_qkvz: &'a Matrix,
    /// `[2*Hv, hidden]`, rows grouped per key head (`split_ba`).
    pub in_proj_ba: &'a Matrix,
    /// `conv1d.weight` `[conv_dim, K]` (stored `[conv_dim, 1, K]`).
    pub conv1d: &'a [f32],
    /// `[Hv]`.
    pub dt_bias: &'a [f32],
    /// `A_log` `[Hv]`.
    pub a_log: &'a [f32],
    /// `norm.weight` `[dv]` of the gated RMSNorm.
    pub norm: &'a [f32],
    /// `[hidden, Hv*dv]`.
    pub out_proj: &'a Matrix,
}

/// What a Gated DeltaNet layer carries from one call to the next.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetState {
    /// `[conv_dim, K-1]`: the last K-1 pre-conv inputs, oldest first.
    pub conv: Vec<f32>,
    /// `[Hv, dk, dv]`.
    pub recurrent: Vec<f32>,
}

impl DeltaNetState {
    /// The state before the first token: all zeros.
    pub fn new(shape: DeltaNetShape) -> DeltaNetState {
        DeltaNetState { conv: vec![0.0; shape.conv_state_len()], recurrent: vec![0.0; shape.recurrent_state_len()] }
    }
}

/// A whole Gated DeltaNet mixer (`Qwen3NextGatedDeltaNet.forward`) over
/// `x [T, hidden]` (already input-normed), continuing from `state`:
/// in_proj -> split -> conv+SiLU over cat(q, k, v) -> gates -> delta rule
/// -> gated RMSNorm with z -> out_proj into `out [T, hidden]`. A single
/// token takes the recurrent form, more take the chunked form (chunk 64), as
/// transformers does once a cache holds state.
pub fn gated_deltanet_layer(
    x: &[f32],
    w: &GatedDeltaNetWeights<'_>,
    shape: DeltaNetShape,
    eps: f32,
    state: &mut DeltaNetState,
    out: &mut [f32],
) {
    shape.check();
    let hidden = w.in_proj_qkvz.cols;
    let rows = x.len() / hidden;
    assert_eq!(x.len(), rows * hidden, "gated_deltanet_layer: x is not [T, {hidden}]");
    assert_eq!(out.len(), x.len(), "gated_deltanet_layer: out");
    assert_eq!(w.in_proj_qkvz.rows, shape.qkvz_dim(), "gated_deltanet_layer: in_proj_qkvz rows");
    assert_eq!((w.in_proj_ba.rows, w.in_proj_ba.cols), (shape.ba_dim(), hidden), "gated_deltanet_layer: in_proj_ba");
    assert_eq!(w.conv1d.len(), shape.conv_dim() * shape.conv_kernel, "gated_deltanet_layer: conv1d");
    assert_eq!((w.out_proj.rows, w.out_proj.cols), (hidden, shape.value_dim()), "gated_deltanet_layer: out_proj");
    let (kd, vd, cd, hv) = (shape.key_dim(), shape.value_dim(), shape.conv_dim(), shape.value_heads);

    let mut mixed_qkvz = vec![0.0; rows * shape.qkvz_dim()];
    let mut mixed_ba = vec![0.0; rows * shape.ba_dim()];
    matmul(x, w.in_proj_qkvz, &mut mixed_qkvz);
    matmul(x, w.in_proj_ba, &mut mixed_ba);
    let (mut q, mut k) = (vec![0.0; rows * kd], vec![0.0; rows * kd]);
    let (mut v, mut z) = (vec![0.0; rows * vd], vec![0.0; rows * vd]);
    let (mut b, mut a) = (vec![0.0; rows * hv], vec![0.0; rows * hv]);
    split_qkvz(&mixed_qkvz, shape, &mut q, &mut k, &mut v, &mut z);
    split_ba(&mixed_ba, shape, &mut b, &mut a);

    // The conv runs over the channels cat(q, k, v) of each row.
    let mut qkv = vec![0.0; rows * cd];
    for (t, r) in qkv.chunks_mut(cd).enumerate() {
        r[..kd].copy_from_slice(&q[t * kd..][..kd]);
        r[kd..2 * kd].copy_from_slice(&k[t * kd..][..kd]);
        r[2 * kd..].copy_from_slice(&v[t * vd..][..vd]);
    }
    let mut conv = vec![0.0; rows * cd];
    causal_conv1d(&qkv, w.conv1d, &mut state.conv, &mut conv);
    for (t, r) in conv.chunks(cd).enumerate() {
        q[t * kd..][..kd].copy_from_slice(&r[..kd]);
        k[t * kd..][..kd].copy_from_slice(&r[kd..2 * kd]);
        v[t * vd..][..vd].copy_from_slice(&r[2 * kd..]);
    }

    let (mut beta, mut g) = (vec![0.0; rows * hv], vec![0.0; rows * hv]);
    deltanet_gates(&b, &a, w.a_log, w.dt_bias, &mut beta, &mut g);
    let mut core = vec![0.0; rows * vd];
    if rows == 1 {
        gated_delta_rule_recurrent(&q, &k, &v, &g, &beta, shape, &mut state.recurrent, &mut core);
    } else {
        gated_delta_rule_chunked(&q, &k, &v, &g, &beta, shape, DELTA_RULE_CHUNK, &mut state.recurrent, &mut core);
    }
    let mut normed = vec![0.0; rows * vd];
    gated_rmsnorm(&core, &z, w.norm, eps, &mut normed);
    matmul(&normed, w.out_proj, out);
}

#[cfg(test)]
pub(crate) mod tests {
    use safetensors::{Dtype, SafeTensors};

    use super::*;
    use crate::rng::Rng;

    /// tests/data/deltanet_ops.safetensors, written by
    /// tests/fixtures/make_deltanet_ops.py from transformers' own functions.
    pub(crate) struct Fixture {
        bytes: Vec<u8>,
    }

    impl Fixture {
        pub(crate) fn load() -> Fixture {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deltanet_ops.safetensors");
            Fixture { bytes: std::fs::read(path).expect("run tests/fixtures/make_deltanet_ops.py") }
        }

        fn tensor(&self, name: &str) -> safetensors::tensor::TensorView<'_> {
            let st = SafeTensors::deserialize(&self.bytes).unwrap();
            st.tensor(name).unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"))
        }

        /// An f32 tensor, flattened row-major.
        pub(crate) fn get(&self, name: &str) -> Vec<f32> {
            let t = self.tensor(name);
            assert_eq!(t.dtype(), Dtype::F32, "{name}");
            t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
        }

        pub(crate) fn scalar(&self, name: &str) -> f32 {
            self.get(name)[0]
        }

        /// A one-element i64 tensor.
        pub(crate) fn usize(&self, name: &str) -> usize {
            let t = self.tensor(name);
            assert_eq!(t.dtype(), Dtype::I64, "{name}");
            i64::from_le_bytes(t.data()[..8].try_into().unwrap()) as usize
        }

        fn matrix(&self, name: &str, rows: usize) -> Matrix {
            let d = self.get(name);
            Matrix::new(rows, d.len() / rows, d)
        }

        fn shape(&self) -> DeltaNetShape {
            DeltaNetShape {
                key_heads: self.usize("layer.key_heads"),
                value_heads: self.usize("layer.value_heads"),
                key_head_dim: self.usize("layer.key_head_dim"),
                value_head_dim: self.usize("layer.value_head_dim"),
                conv_kernel: self.usize("layer.conv_kernel"),
            }
        }
    }

    /// `max |got - want| <= rel * max |want|`.
    pub(crate) fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (i, err) = got.iter().zip(want).map(|(g, w)| (g - w).abs()).enumerate().fold((0, 0.0f32), |a, b| {
            if b.1 > a.1 {
                b
            } else {
                a
            }
        });
        assert!(
            err <= rel * scale,
            "{what}: max error {err} at {i} ({} vs {}), {} of max |want| {scale}",
            got[i],
            want[i],
            err / scale
        );
    }

    fn random(r: &mut Rng, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| r.normal() * std).collect()
    }

    /// The last K-1 columns of transformers' `[C, K]` conv state.
    fn conv_state_tail(full: &[f32], kernel: usize) -> Vec<f32> {
        full.chunks(kernel).flat_map(|c| c[1..].to_vec()).collect()
    }

    const HK2_HV4: DeltaNetShape =
        DeltaNetShape { key_heads: 2, value_heads: 4, key_head_dim: 16, value_head_dim: 8, conv_kernel: 4 };

    #[test]
    fn split_hand_computed_groups_per_key_head() {
        // Hk 2, Hv 4, dk = dv = 1: each key-head group is [q k v v z z] and [b b a a].
        let s = DeltaNetShape { key_heads: 2, value_heads: 4, key_head_dim: 1, value_head_dim: 1, conv_kernel: 4 };
        let mixed: Vec<f32> = (1..=12).map(|i| i as f32).collect();
        let (mut q, mut k, mut v, mut z) = ([0.0; 2], [0.0; 2], [0.0; 4], [0.0; 4]);
        split_qkvz(&mixed, s, &mut q, &mut k, &mut v, &mut z);
        assert_eq!((q, k), ([1.0, 7.0], [2.0, 8.0]));
        assert_eq!((v, z), ([3.0, 4.0, 9.0, 10.0], [5.0, 6.0, 11.0, 12.0]));
        let (mut b, mut a) = ([0.0; 4], [0.0; 4]);
        split_ba(&mixed[..8], s, &mut b, &mut a);
        assert_eq!((b, a), ([1.0, 2.0, 5.0, 6.0], [3.0, 4.0, 7.0, 8.0]));
    }

    #[test]
    fn split_matches_fix_query_key_value_ordering() {
        let f = Fixture::load();
        let s = f.shape();
        let mixed = f.get("split.qkvz");
        let rows = mixed.len() / s.qkvz_dim();
        let (mut q, mut k) = (vec![0.0; rows * s.key_dim()], vec![0.0; rows * s.key_dim()]);
        let (mut v, mut z) = (vec![0.0; rows * s.value_dim()], vec![0.0; rows * s.value_dim()]);
        split_qkvz(&mixed, s, &mut q, &mut k, &mut v, &mut z);
        let (mut b, mut a) = (vec![0.0; rows * s.value_heads], vec![0.0; rows * s.value_heads]);
        split_ba(&f.get("split.ba"), s, &mut b, &mut a);
        for (name, got) in [("q", q), ("k", k), ("v", v), ("z", z), ("b", b), ("a", a)] {
            assert_eq!(got, f.get(&format!("split.{name}")), "{name}");
        }
    }

    #[test]
    fn conv_hand_computed_and_state_holds_pre_conv_inputs() {
        // One channel, K 3, weight [0.5, -1, 2] (the last tap is the current token).
        let w = [0.5, -1.0, 2.0];
        let mut state = [0.0; 2];
        let mut out = [0.0; 3];
        causal_conv1d(&[1.0, 2.0, 3.0], &w, &mut state, &mut out);
        // Pre-activations: 2*1 = 2; -1*1 + 2*2 = 3; 0.5*1 - 1*2 + 2*3 = 4.5.
        for (o, pre) in out.iter().zip([2.0f32, 3.0, 4.5]) {
            assert!((o - silu(pre)).abs() < 1e-7, "{o} vs silu({pre})");
        }
        assert_eq!(state, [2.0, 3.0]);
        // Next token 10 sees [2, 3, 10]: 1 - 3 + 20 = 18.
        let mut one = [0.0];
        causal_conv1d(&[10.0], &w, &mut state, &mut one);
        assert!((one[0] - silu(18.0)).abs() < 1e-5);
        assert_eq!(state, [3.0, 10.0]);
    }

    #[test]
    fn conv_in_one_call_equals_token_by_token() {
        let (c, kernel, rows) = (5, 4, 9);
        let mut r = Rng::new(3);
        let w = random(&mut r, c * kernel, 0.5);
        let x = random(&mut r, rows * c, 1.0);
        let mut state_all = vec![0.0; c * (kernel - 1)];
        let mut out_all = vec![0.0; rows * c];
        causal_conv1d(&x, &w, &mut state_all, &mut out_all);
        let mut state = vec![0.0; c * (kernel - 1)];
        let mut out = vec![0.0; rows * c];
        for t in 0..rows {
            causal_conv1d(&x[t * c..][..c], &w, &mut state, &mut out[t * c..][..c]);
        }
        assert_eq!(out, out_all);
        assert_eq!(state, state_all);
    }

    #[test]
    fn conv_matches_transformers_prefill_continuation_decode() {
        let f = Fixture::load();
        let w = f.get("conv.weight");
        let x = f.get("conv.x");
        let want_state = f.get("conv.state");
        let kernel = 4;
        let c = w.len() / kernel;
        let mut state = vec![0.0; c * (kernel - 1)];
        let mut out = vec![0.0; x.len()];
        // As the fixture drives it: 2 tokens (fewer than K), 5, then 1 and 1.
        let mut t = 0;
        for n in [2, 5, 1, 1] {
            causal_conv1d(&x[t * c..][..n * c], &w, &mut state, &mut out[t * c..][..n * c]);
            t += n;
        }
        assert_close(&out, &f.get("conv.out"), 1e-6, "conv out");
        assert_eq!(state, conv_state_tail(&want_state, kernel), "conv state");
    }

    #[test]
    fn softplus_threshold_and_gates() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(20.5), 20.5);
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(-30.0) - (-30.0f32).exp()).abs() < 1e-20);
        let f = Fixture::load();
        let (b, a) = (f.get("gates.b"), f.get("gates.a"));
        assert!(a.iter().any(|&v| v > 20.0) && a.iter().any(|&v| v < 0.0), "fixture must cross the threshold");
        let (mut beta, mut g) = (vec![0.0; b.len()], vec![0.0; b.len()]);
        deltanet_gates(&b, &a, &f.get("layer.A_log"), &f.get("layer.dt_bias"), &mut beta, &mut g);
        assert_close(&beta, &f.get("gates.beta"), 1e-6, "beta");
        assert_close(&g, &f.get("gates.g"), 1e-6, "g");
    }

    #[test]
    fn gated_rmsnorm_hand_computed_and_matches_transformers() {
        // o [3, 4] / sqrt(12.5) = [0.8485281, 1.1313708]; w [1, 2]; z [0, 30]:
        // silu(0) = 0, silu(30) = 30 in f32.
        let mut out = [0.0; 2];
        gated_rmsnorm(&[3.0, 4.0], &[0.0, 30.0], &[1.0, 2.0], 0.0, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 * 1.131_370_8 * 30.0).abs() < 1e-4, "{}", out[1]);
        let f = Fixture::load();
        let o = f.get("gated_norm.o");
        let mut got = vec![0.0; o.len()];
        gated_rmsnorm(&o, &f.get("gated_norm.z"), &f.get("gated_norm.weight"), f.scalar("rms_norm_eps"), &mut got);
        assert_close(&got, &f.get("gated_norm.out"), 1e-6, "Qwen3NextRMSNormGated");
    }

    #[test]
    fn recurrent_rule_hand_computed() {
        // One head, dk 2, dv 1. l2norm's eps moves values by ~5e-7.
        let s = DeltaNetShape { key_heads: 1, value_heads: 1, key_head_dim: 2, value_head_dim: 1, conv_kernel: 4 };
        let q = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0];
        let k = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0];
        let v = [2.0, 4.0, 5.0];
        let g = [0.0, 0.5f32.ln(), 0.0];
        let beta = [1.0, 0.5, 1.0];
        let mut state = [0.0; 2];
        let mut out = [0.0; 3];
        gated_delta_rule_recurrent(&q, &k, &v, &g, &beta, s, &mut state, &mut out);
        // t0: S = k0 * 2 = [2, 0]; o = S.q/sqrt2 = 2/sqrt2.
        // t1: S = [1, 0]; S.k1 = 0 -> d = 0.5*4 = 2; S = [1, 2]; q = [0.5, 0.5]: o = 1.5.
        // t2: S.k0 = 1 -> d = 5 - 1 = 4; S = [5, 2] (beta 1 overwrites: S.k0 = v); o = 2/sqrt2.
        let want = [std::f32::consts::SQRT_2, 1.5, std::f32::consts::SQRT_2];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 5e-6, "{out:?} vs {want:?}");
        }
        assert!((state[0] - 5.0).abs() < 1e-5 && (state[1] - 2.0).abs() < 1e-5, "{state:?}");
    }

    fn rule_from_fixture(f: &Fixture, name: &str) -> (Vec<f32>, Vec<f32>) {
        let get = |k: &str| f.get(&format!("{name}.{k}"));
        let (q, k, v, g, beta) = (get("q"), get("k"), get("v"), get("g"), get("beta"));
        let mut state = get("state0");
        let mut out = vec![0.0; v.len()];
        if name == "rule_chunk" {
            gated_delta_rule_chunked(&q, &k, &v, &g, &beta, HK2_HV4, DELTA_RULE_CHUNK, &mut state, &mut out);
        } else {
            gated_delta_rule_recurrent(&q, &k, &v, &g, &beta, HK2_HV4, &mut state, &mut out);
        }
        (out, state)
    }

    #[test]
    fn delta_rules_match_transformers_from_an_initial_state() {
        let f = Fixture::load();
        for name in ["rule_chunk", "rule_recurrent"] {
            let (out, state) = rule_from_fixture(&f, name);
            assert_close(&out, &f.get(&format!("{name}.out")), 1e-5, name);
            assert_close(&state, &f.get(&format!("{name}.state")), 1e-5, name);
        }
    }

    /// Random delta-rule inputs with realistic gates: g from softplus of
    /// N(0, 1) scaled by A in [0.01, 16] (some heads forget fast), beta in (0, 1).
    fn rule_inputs(r: &mut Rng, s: DeltaNetShape, rows: usize) -> [Vec<f32>; 5] {
        let q = random(r, rows * s.key_dim(), 1.0);
        let k = random(r, rows * s.key_dim(), 1.0);
        let v = random(r, rows * s.value_dim(), 1.0);
        let a_log: Vec<f32> = (0..s.value_heads).map(|_| (0.01 + 16.0 * r.next_f32()).ln()).collect();
        let dt_bias = random(r, s.value_heads, 0.5);
        let (b, a) = (random(r, rows * s.value_heads, 2.0), random(r, rows * s.value_heads, 1.0));
        let (mut beta, mut g) = (vec![0.0; b.len()], vec![0.0; b.len()]);
        deltanet_gates(&b, &a, &a_log, &dt_bias, &mut beta, &mut g);
        [q, k, v, g, beta]
    }

    #[test]
    fn chunked_equals_recurrent() {
        let s = HK2_HV4;
        for rows in [1, 5, 63, 64, 65, 130, 200] {
            let mut r = Rng::new(rows as u64);
            let [q, k, v, g, beta] = rule_inputs(&mut r, s, rows);
            let state0 = random(&mut r, s.recurrent_state_len(), 0.5);
            let (mut s_rec, mut s_chunk) = (state0.clone(), state0);
            let (mut o_rec, mut o_chunk) = (vec![0.0; v.len()], vec![0.0; v.len()]);
            gated_delta_rule_recurrent(&q, &k, &v, &g, &beta, s, &mut s_rec, &mut o_rec);
            gated_delta_rule_chunked(&q, &k, &v, &g, &beta, s, DELTA_RULE_CHUNK, &mut s_chunk, &mut o_chunk);
            assert_close(&o_chunk, &o_rec, 1e-5, &format!("out, T {rows}"));
            assert_close(&s_chunk, &s_rec, 1e-5, &format!("state, T {rows}"));
        }
    }

    #[test]
    fn chunked_is_independent_of_chunk_size_and_call_split() {
        let s = HK2_HV4;
        let rows = 100;
        let mut r = Rng::new(11);
        let [q, k, v, g, beta] = rule_inputs(&mut r, s, rows);
        let mut s64 = vec![0.0; s.recurrent_state_len()];
        let mut o64 = vec![0.0; v.len()];
        gated_delta_rule_chunked(&q, &k, &v, &g, &beta, s, 64, &mut s64, &mut o64);
        // Chunk 7, and two calls (37 + 63 tokens) carrying the state.
        let mut s7 = vec![0.0; s.recurrent_state_len()];
        let mut o7 = vec![0.0; v.len()];
        gated_delta_rule_chunked(&q, &k, &v, &g, &beta, s, 7, &mut s7, &mut o7);
        assert_close(&o7, &o64, 1e-5, "chunk 7 out");
        assert_close(&s7, &s64, 1e-5, "chunk 7 state");
        let mut s2 = vec![0.0; s.recurrent_state_len()];
        let mut o2 = vec![0.0; v.len()];
        let (kd, vd, hv) = (s.key_dim(), s.value_dim(), s.value_heads);
        for (lo, hi) in [(0, 37), (37, rows)] {
            gated_delta_rule_chunked(
                &q[lo * kd..hi * kd],
                &k[lo * kd..hi * kd],
                &v[lo * vd..hi * vd],
                &g[lo * hv..hi * hv],
                &beta[lo * hv..hi * hv],
                s,
                64,
                &mut s2,
                &mut o2[lo * vd..hi * vd],
            );
        }
        assert_close(&o2, &o64, 1e-5, "split out");
        assert_close(&s2, &s64, 1e-5, "split state");
    }

    /// The most complete check: `Qwen3NextGatedDeltaNet.forward` with a
    /// DynamicCache over a 100-token prefill then 3 decode steps.
    #[test]
    fn layer_matches_transformers_prefill_then_decode() {
        let f = Fixture::load();
        let s = f.shape();
        let hidden = f.usize("hidden_size");
        let (qkvz, ba, out_proj) = (
            f.matrix("layer.in_proj_qkvz", s.qkvz_dim()),
            f.matrix("layer.in_proj_ba", s.ba_dim()),
            f.matrix("layer.out_proj", hidden),
        );
        let (conv1d, dt_bias, a_log, norm) =
            (f.get("layer.conv1d"), f.get("layer.dt_bias"), f.get("layer.A_log"), f.get("layer.norm"));
        let w = GatedDeltaNetWeights {
            in_proj_qkvz: &qkvz,
            in_proj_ba: &ba,
            conv1d: &conv1d,
            dt_bias: &dt_bias,
            a_log: &a_log,
            norm: &norm,
            out_proj: &out_proj,
        };
        let eps = f.scalar("rms_norm_eps");
        let x = f.get("layer.x");
        let want = f.get("layer.out");
        let mut state = DeltaNetState::new(s);
        let mut out = vec![0.0; x.len()];
        let mut t = 0;
        for n in [100, 1, 1, 1] {
            gated_deltanet_layer(
                &x[t * hidden..][..n * hidden],
                &w,
                s,
                eps,
                &mut state,
                &mut out[t * hidden..][..n * hidden],
            );
            let what = format!("layer out, tokens {t}..{}", t + n);
            assert_close(&out[t * hidden..][..n * hidden], &want[t * hidden..][..n * hidden], 1e-5, &what);
            t += n;
        }
        assert_close(&state.conv, &conv_state_tail(&f.get("layer.conv_state"), s.conv_kernel), 1e-6, "conv state");
        assert_close(&state.recurrent, &f.get("layer.recurrent_state"), 1e-5, "recurrent state");

        // A prefill split in two calls (60 + 40 tokens) carries the state across.
        let mut split_state = DeltaNetState::new(s);
        let mut split = vec![0.0; 100 * hidden];
        gated_deltanet_layer(&x[..60 * hidden], &w, s, eps, &mut split_state, &mut split[..60 * hidden]);
        gated_deltanet_layer(&x[60 * hidden..100 * hidden], &w, s, eps, &mut split_state, &mut split[60 * hidden..]);
        assert_close(&split, &want[..100 * hidden], 1e-5, "prefill in two calls");
    }
}
