//! The f32 reference ops, one function per op, plain loops. Parallel loops
//! split work only across independent outputs (a row, a head, an expert
//! row), so every value is computed the same way whatever the batch size or
//! thread count: chunked and whole-prompt prefill agree bit for bit.

use rayon::prelude::*;

use crate::backend::{AttentionShape, ExpertRows, Matrix, Rope};
use crate::pack::ExpertView;

/// Output columns per parallel work item of a matmul.
const MATMUL_COLS_PER_TASK: usize = 64;

/// `sum_i a[i] * b[i]`, accumulated in eight interleaved lanes (so the
/// compiler can vectorize it), then summed in a fixed order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            lanes[l] += xa[l] * xb[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let pairs = [lanes[0] + lanes[1], lanes[2] + lanes[3], lanes[4] + lanes[5], lanes[6] + lanes[7]];
    ((pairs[0] + pairs[1]) + (pairs[2] + pairs[3])) + tail
}

/// `out [T, N] = x [T, K] * w^T` for `w [N, K]`; parallel over rows and
/// blocks of output columns.
pub fn matmul(x: &[f32], w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len() % k, 0, "matmul: x is not [T, {k}]");
    assert_eq!(out.len(), x.len() / k * n, "matmul: out is not [T, {n}]");
    out.par_chunks_mut(n).zip(x.par_chunks(k)).for_each(|(out_row, x_row)| {
        out_row.par_chunks_mut(MATMUL_COLS_PER_TASK).enumerate().for_each(|(block, out_cols)| {
            for (j, o) in out_cols.iter_mut().enumerate() {
                *o = dot(x_row, w.row(block * MATMUL_COLS_PER_TASK + j));
            }
        });
    });
}

/// `out = x * 1/sqrt(mean(x^2) + eps) * w` for each row of `x` (row length `w.len()`).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(x.len() % d == 0 && out.len() == x.len(), "rmsnorm: shapes");
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, xr)| rmsnorm_row(xr, w, eps, o));
}

fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut sum_sq = 0.0f32;
    for &v in x {
        sum_sq += v * v;
    }
    let inv_rms = 1.0 / (sum_sq / x.len() as f32 + eps).sqrt();
    for i in 0..x.len() {
        out[i] = x[i] * inv_rms * w[i];
    }
}

/// NeoX rotary embedding (transformers `rotate_half`) in place on
/// `x [T, heads, head_dim]`, row `t` at position `start_pos + t`:
/// for pair `(i, i + half)`: `x_i' = x_i cos - x_{i+half} sin`,
/// `x_{i+half}' = x_{i+half} cos + x_i sin`. Dims past `rotary_dim` pass through.
pub fn rope(x: &mut [f32], heads: usize, head_dim: usize, start_pos: usize, rope: &Rope) {
    assert!(rope.rotary_dim <= head_dim, "rope: rotary_dim > head_dim");
    assert_eq!(x.len() % (heads * head_dim), 0, "rope: x is not [T, heads, head_dim]");
    let half = rope.rotary_dim / 2;
    x.par_chunks_mut(head_dim).enumerate().for_each(|(idx, head)| {
        let pos = start_pos + idx / heads;
        for i in 0..half {
            let (cos, sin) = rope.cos_sin(pos, i);
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    });
}

/// Causal grouped-query attention over a KV cache (see `Backend::attention`);
/// parallel over (row, head).
pub fn attention(q: &[f32], k: &[f32], v: &[f32], shape: AttentionShape, start_pos: usize, out: &mut [f32]) {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    let (q_dim, kv_dim) = (shape.q_dim(), shape.kv_dim());
    let rows = q.len() / q_dim;
    assert_eq!(q.len(), rows * q_dim, "attention: q is not [T, {q_dim}]");
    assert_eq!(out.len(), q.len(), "attention: out");
    assert!(
        k.len() >= (start_pos + rows) * kv_dim && v.len() == k.len(),
        "attention: the KV cache does not hold positions 0..{}",
        start_pos + rows
    );
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_mut(head_dim).enumerate().for_each(|(idx, out_head)| {
        let (t, h) = (idx / heads, idx % heads);
        let pos = start_pos + t;
        let kvh = h / group;
        let qh = &q[t * q_dim + h * head_dim..][..head_dim];
        let key = |j: usize| &k[j * kv_dim + kvh * head_dim..][..head_dim];
        let value = |j: usize| &v[j * kv_dim + kvh * head_dim..][..head_dim];

        let mut scores: Vec<f32> = (0..=pos).map(|j| dot(qh, key(j)) * scale).collect();
        softmax(&mut scores);
        out_head.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            for (o, &vv) in out_head.iter_mut().zip(value(j)) {
                *o += p * vv;
            }
        }
    });
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add: lengths");
    x.par_iter_mut().zip(y.par_iter()).for_each(|(a, b)| *a += b);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One row through one expert: `out = down(silu(gate x) * up x)`. Each
/// matrix's `row_dot` applies its block scales and its own global scale.
pub fn expert_ffn_row(e: &ExpertView<'_>, x: &[f32], out: &mut [f32]) {
    let inter = e.gate.rows;
    let mut act = vec![0.0f32; inter];
    for (i, a) in act.iter_mut().enumerate() {
        *a = silu(e.gate.row_dot(i, x)) * e.up.row_dot(i, x);
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = e.down.row_dot(j, &act);
    }
}

/// Grouped expert FFN (see `Backend::expert_ffn`); parallel over all rows
/// of all groups, so decode spreads over experts and prefill over tokens.
pub fn expert_ffn(groups: &[ExpertRows<'_>], x: &[f32], out: &mut [f32]) {
    let rows: usize = groups.iter().map(|g| g.rows).sum();
    let Some(first) = groups.first() else {
        assert!(x.is_empty() && out.is_empty(), "expert_ffn: rows without groups");
        return;
    };
    let hidden = first.weights.gate.cols;
    assert_eq!(x.len(), rows * hidden, "expert_ffn: x is not [{rows}, {hidden}]");
    assert_eq!(out.len(), x.len(), "expert_ffn: out");
    // The group of every row, in row order.
    let row_group: Vec<usize> =
        groups.iter().enumerate().flat_map(|(g, grp)| std::iter::repeat_n(g, grp.rows)).collect();
    out.par_chunks_mut(hidden)
        .zip(x.par_chunks(hidden))
        .zip(row_group.par_iter())
        .for_each(|((o, xr), &g)| expert_ffn_row(&groups[g].weights, xr, o));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nvfp4::quantize;
    use crate::rng::Rng;

    fn close(a: f32, b: f32, tol: f32) -> bool {
        (a - b).abs() <= tol * b.abs().max(1.0)
    }

    fn rope_plain(dim: usize, theta: f32) -> Rope {
        Rope {
            rotary_dim: dim,
            inv_freq: (0..dim / 2).map(|i| theta.powf(-((2 * i) as f32) / dim as f32)).collect(),
            attention_factor: 1.0,
        }
    }

    #[test]
    fn dot_matches_naive_sum_on_odd_lengths() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..19).map(|i| (i as f32).sin()).collect();
        let naive: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64) * (*y as f64)).sum();
        assert!((dot(&a, &b) as f64 - naive).abs() < 1e-5);
        assert_eq!(dot(&[2.0], &[3.0]), 6.0);
    }

    #[test]
    fn matmul_hand_computed() {
        // x [2, 3], w [2, 3]: out[t, n] = x[t] . w[n]
        let x = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
        let w = Matrix::new(2, 3, vec![1.0, 0.0, -1.0, 0.5, 0.5, 0.5]);
        let mut out = [0.0; 4];
        matmul(&x, &w, &mut out);
        assert_eq!(out, [-2.0, 3.0, -3.0, 0.75]);
    }

    #[test]
    fn matmul_wide_output_spans_several_tasks() {
        let (n, k) = (150, 5);
        let w = Matrix::new(n, k, (0..n * k).map(|i| (i % 7) as f32).collect());
        let x = [1.0, -1.0, 2.0, 0.0, 1.0];
        let mut out = vec![0.0; n];
        matmul(&x, &w, &mut out);
        for (r, got) in out.iter().enumerate() {
            let want: f32 = w.row(r).iter().zip(&x).map(|(a, b)| a * b).sum();
            assert_eq!(*got, want, "row {r}");
        }
    }

    #[test]
    fn rmsnorm_hand_computed() {
        // x = [3, 4]: mean(x^2) = 12.5, 1/sqrt(12.5) = 0.2828427
        let x = [3.0, 4.0, 0.0, 2.0];
        let w = [1.0, 0.5];
        let mut out = [0.0; 4];
        rmsnorm(&x, &w, 0.0, &mut out);
        assert!(close(out[0], 0.848_528_1, 1e-6), "{}", out[0]);
        assert!(close(out[1], 0.565_685_4, 1e-6), "{}", out[1]);
        // Second row [0, 2]: mean 2, 1/sqrt(2): [0, 2 * 0.7071 * 0.5]
        assert_eq!(out[2], 0.0);
        assert!(close(out[3], std::f32::consts::FRAC_1_SQRT_2, 1e-6));
        // eps enters inside the square root.
        rmsnorm(&[1.0, 1.0], &[1.0, 1.0], 3.0, &mut out[..2]);
        assert!(close(out[0], 0.5, 1e-7));
    }

    #[test]
    fn rope_identity_at_zero_and_preserves_pair_norms() {
        let r = rope_plain(8, 10000.0);
        let orig: Vec<f32> = (0..2 * 2 * 8).map(|i| (i as f32 * 0.37).cos()).collect();
        // Two rows of two heads; start at position 0: row 0 is unchanged.
        let mut x = orig.clone();
        rope(&mut x, 2, 8, 0, &r);
        assert_eq!(&x[..16], &orig[..16]);
        assert_ne!(&x[16..], &orig[16..]);
        // Row 1 (position 1): each pair (i, i + 4) keeps its norm.
        for head in 2..4 {
            for i in 0..4 {
                let (a, b) = (orig[head * 8 + i], orig[head * 8 + i + 4]);
                let (c, d) = (x[head * 8 + i], x[head * 8 + i + 4]);
                assert!(close(a * a + b * b, c * c + d * d, 1e-6));
            }
        }
        // Pair 0 rotates by exactly pos * 1 rad: (1, 0) at position 3.
        let mut y = vec![0.0; 8];
        y[0] = 1.0;
        rope(&mut y, 1, 8, 3, &r);
        assert!(close(y[0], 3.0f32.cos(), 1e-6) && close(y[4], 3.0f32.sin(), 1e-6));
    }

    #[test]
    fn rope_partial_passes_tail_and_scales_by_attention_factor() {
        let mut r = rope_plain(4, 10000.0);
        r.attention_factor = 2.0;
        let mut x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        rope(&mut x, 1, 8, 0, &r);
        // Position 0: cos = 1 * 2, sin = 0 -> rotated dims double, the rest pass.
        assert_eq!(x, vec![2.0, 4.0, 6.0, 8.0, 5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn attention_of_one_token_is_v() {
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 4 };
        let q: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let v: Vec<f32> = (0..8).map(|i| i as f32 + 10.0).collect();
        let mut out = vec![0.0; 16];
        attention(&q, &k, &v, shape, 0, &mut out);
        // Heads 0, 1 read kv head 0; heads 2, 3 read kv head 1.
        assert_eq!(&out[0..4], &v[0..4]);
        assert_eq!(&out[4..8], &v[0..4]);
        assert_eq!(&out[8..12], &v[4..8]);
        assert_eq!(&out[12..16], &v[4..8]);
    }

    #[test]
    fn attention_is_causal_and_scaled() {
        let shape = AttentionShape { heads: 1, kv_heads: 1, head_dim: 4 };
        // Two rows at positions 0 and 1; keys 0 and 1.
        let q = [1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0];
        let k = [1.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0];
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut out = [0.0; 8];
        attention(&q, &k, &v, shape, 0, &mut out);
        // Row 0 sees only key 0 (a later key must not leak in).
        assert_eq!(&out[..4], &v[..4]);
        // Row 1: scores 2 * 0.5 = 1 and -2 * 0.5 = -1.
        let p0 = 1.0 / (1.0 + (-2.0f32).exp());
        for d in 0..4 {
            let want = p0 * v[d] + (1.0 - p0) * v[4 + d];
            assert!(close(out[4 + d], want, 1e-6), "{} {want}", out[4 + d]);
        }
        // The same row computed alone at start_pos 1 gives the same numbers.
        let mut alone = [0.0; 4];
        attention(&q[4..], &k, &v, shape, 1, &mut alone);
        assert_eq!(alone, out[4..]);
    }

    #[test]
    fn softmax_sums_to_one_and_survives_large_logits() {
        let mut x = [1000.0, 1000.0, 0.0];
        softmax(&mut x);
        assert_eq!(x[0], 0.5);
        assert_eq!(x[2], 0.0);
        let mut y = [0.0, (2.0f32).ln()];
        softmax(&mut y);
        assert!(close(y[0], 1.0 / 3.0, 1e-6) && close(y[1], 2.0 / 3.0, 1e-6));
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!(close(silu(1.0), 0.731_058_6, 1e-6));
        assert!(silu(-100.0).abs() < 1e-40);
    }

    fn random(r: &mut Rng, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| r.normal() * std).collect()
    }

    #[test]
    fn expert_ffn_matches_dequantized_dense_math() {
        let (h, i) = (32, 16);
        let mut r = Rng::new(5);
        // Different magnitudes give each matrix a different global scale.
        let gate = quantize(&random(&mut r, i * h, 0.1), i, h);
        let up = quantize(&random(&mut r, i * h, 0.03), i, h);
        let down = quantize(&random(&mut r, h * i, 0.3), h, i);
        assert!(gate.global_scale != up.global_scale && up.global_scale != down.global_scale);
        let ev = ExpertView { gate: gate.view(), up: up.view(), down: down.view(), blob: &[] };
        let x = random(&mut r, 3 * h, 1.0);
        let (gd, ud, dd) = (gate.view().dequantize(), up.view().dequantize(), down.view().dequantize());
        let mut out = vec![0.0; 3 * h];
        expert_ffn(&[ExpertRows { weights: ev, rows: 3 }], &x, &mut out);
        for t in 0..3 {
            let xr = &x[t * h..(t + 1) * h];
            let act: Vec<f64> = (0..i)
                .map(|n| {
                    let g: f64 = (0..h).map(|c| gd[n * h + c] as f64 * xr[c] as f64).sum();
                    let u: f64 = (0..h).map(|c| ud[n * h + c] as f64 * xr[c] as f64).sum();
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for j in 0..h {
                let want: f64 = (0..i).map(|n| dd[j * i + n] as f64 * act[n]).sum();
                let got = out[t * h + j] as f64;
                assert!((got - want).abs() <= 1e-4 * want.abs().max(1e-3), "row {t} col {j}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn expert_ffn_routes_each_row_to_its_group() {
        let (h, i) = (16, 16);
        let mut r = Rng::new(9);
        let mats: Vec<_> = (0..6).map(|_| quantize(&random(&mut r, h * i, 0.2), i, h)).collect();
        let e0 = ExpertView { gate: mats[0].view(), up: mats[1].view(), down: mats[2].view(), blob: &[] };
        let e1 = ExpertView { gate: mats[3].view(), up: mats[4].view(), down: mats[5].view(), blob: &[] };
        let x = random(&mut r, 3 * h, 1.0);
        let mut grouped = vec![0.0; 3 * h];
        let groups = [ExpertRows { weights: e0, rows: 1 }, ExpertRows { weights: e1, rows: 2 }];
        expert_ffn(&groups, &x, &mut grouped);
        let mut single = vec![0.0; h];
        for (row, e) in [(0, &e0), (1, &e1), (2, &e1)] {
            expert_ffn_row(e, &x[row * h..(row + 1) * h], &mut single);
            assert_eq!(&grouped[row * h..(row + 1) * h], &single[..], "row {row}");
        }
        let mut empty: [f32; 0] = [];
        expert_ffn(&[], &[], &mut empty);
    }
}
