//! Qwen3-Next ops outside the DeltaNet mixer: the zero-centered RMSNorm of
//! every Qwen3-Next norm and the output gate of the gated full-attention
//! layers (formats-and-math.md section 3; transformers 5.17
//! `models/qwen3_next/modeling_qwen3_next.py`). Partial rotary needs nothing
//! new: `ops::rope` rotates the first `Rope::rotary_dim` dims of each head
//! with rotate_half over those dims only, as `apply_rotary_pos_emb` does.

use rayon::prelude::*;

/// `1 / sqrt(mean(x^2) + eps)`, the RMSNorm scale of one row, in f32.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut sum_sq = 0.0f32;
    for &v in x {
        sum_sq += v * v;
    }
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Zero-centered RMSNorm of each row of `x` (row length `w.len()`):
/// `out = x * 1/sqrt(mean(x^2) + eps) * (1 + w)`.
/// Mirrors `Qwen3NextRMSNorm.forward` (weight initialized to 0, so the
/// stored weight is the offset from 1): the input layer, post-attention,
/// final and MTP norms and the q_norm/k_norm of full attention.
pub fn zero_centered_rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(x.len() % d == 0 && out.len() == x.len(), "zero_centered_rmsnorm: shapes");
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, xr)| {
        let s = inv_rms(xr, eps);
        for i in 0..d {
            o[i] = xr[i] * s * (1.0 + w[i]);
        }
    });
}

/// Splits the q_proj output of a gated attention layer,
/// `q_proj_out [T, heads * 2 * head_dim]`, into `q` and `gate`, both
/// `[T, heads * head_dim]`. The layout is per head `[q_h | gate_h]`
/// (interleaved by head, not two halves of the row): transformers views the
/// row as `[heads, 2 * head_dim]` and `torch.chunk`s the last dim in two
/// (`Qwen3NextAttention.forward`).
pub fn split_q_gate(q_proj_out: &[f32], heads: usize, head_dim: usize, q: &mut [f32], gate: &mut [f32]) {
    let width = heads * head_dim;
    assert_eq!(q_proj_out.len() % (2 * width), 0, "split_q_gate: q_proj_out is not [T, {}]", 2 * width);
    assert!(q.len() * 2 == q_proj_out.len() && gate.len() == q.len(), "split_q_gate: q, gate");
    for (idx, src) in q_proj_out.chunks(2 * head_dim).enumerate() {
        q[idx * head_dim..][..head_dim].copy_from_slice(&src[..head_dim]);
        gate[idx * head_dim..][..head_dim].copy_from_slice(&src[head_dim..]);
    }
}

/// The output gate of gated attention, in place: `attn *= sigmoid(gate)`
/// elementwise over `[T, heads * head_dim]` (before o_proj).
pub fn apply_output_gate(attn: &mut [f32], gate: &[f32]) {
    assert_eq!(attn.len(), gate.len(), "apply_output_gate: lengths");
    attn.par_iter_mut().zip(gate.par_iter()).for_each(|(a, &g)| *a *= sigmoid(g));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::deltanet::tests::{assert_close, Fixture};
    use crate::backend::cpu::ops;
    use crate::backend::{AttentionShape, Matrix, Rope};

    #[test]
    fn zero_centered_rmsnorm_hand_computed() {
        // Row [3, 4]: 1/sqrt(12.5) = 0.2828427; w = [0, -0.5] scales by [1, 0.5].
        let mut out = [0.0; 4];
        zero_centered_rmsnorm(&[3.0, 4.0, 0.0, 2.0], &[0.0, -0.5], 0.0, &mut out);
        assert!((out[0] - 0.848_528_1).abs() < 1e-6, "{}", out[0]);
        assert!((out[1] - 0.565_685_4).abs() < 1e-6, "{}", out[1]);
        assert_eq!(out[2], 0.0);
        assert!((out[3] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        // A zero weight is the identity scale, not a zero output.
        zero_centered_rmsnorm(&[1.0, 1.0], &[0.0, 0.0], 3.0, &mut out[..2]);
        assert!((out[0] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn split_q_gate_is_interleaved_per_head() {
        // 1 row, 2 heads of dim 2: [q0 q0 g0 g0 q1 q1 g1 g1].
        let row = [1.0, 2.0, 10.0, 20.0, 3.0, 4.0, 30.0, 40.0];
        let (mut q, mut g) = ([0.0; 4], [0.0; 4]);
        split_q_gate(&row, 2, 2, &mut q, &mut g);
        assert_eq!(q, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(g, [10.0, 20.0, 30.0, 40.0]);
    }

    #[test]
    fn output_gate_is_sigmoid() {
        let mut a = [2.0, 2.0, -4.0];
        apply_output_gate(&mut a, &[0.0, 100.0, (3.0f32).ln()]);
        assert_eq!(a[0], 1.0);
        assert_eq!(a[1], 2.0);
        assert!((a[2] + 3.0).abs() < 1e-6, "{}", a[2]); // sigmoid(ln 3) = 3/4
    }

    #[test]
    fn zero_centered_rmsnorm_matches_transformers() {
        let f = Fixture::load();
        let x = f.get("rmsnorm.x");
        let w = f.get("rmsnorm.weight");
        let mut out = vec![0.0; x.len()];
        zero_centered_rmsnorm(&x, &w, f.scalar("rms_norm_eps"), &mut out);
        assert_close(&out, &f.get("rmsnorm.out"), 1e-6, "Qwen3NextRMSNorm");
    }

    /// A whole `Qwen3NextAttention` forward (prefill, no cache) composed from
    /// the gated-attention helpers and the existing rope/attention ops: checks
    /// the q/gate layout, zero-centered q_norm/k_norm and partial rotary.
    #[test]
    fn gated_attention_layer_matches_transformers() {
        let f = Fixture::load();
        let (heads, kv_heads, head_dim) = (f.usize("attn.heads"), f.usize("attn.kv_heads"), f.usize("attn.head_dim"));
        let eps = f.scalar("rms_norm_eps");
        let x = f.get("attn.x");
        let hidden = f.usize("hidden_size");
        let rows = x.len() / hidden;
        let mat = |name: &str, n: usize| {
            let d = f.get(name);
            Matrix::new(n, d.len() / n, d)
        };
        let q_proj = mat("attn.q_proj", heads * head_dim * 2);
        let k_proj = mat("attn.k_proj", kv_heads * head_dim);
        let v_proj = mat("attn.v_proj", kv_heads * head_dim);
        let o_proj = mat("attn.o_proj", hidden);
        let inv_freq = f.get("attn.inv_freq");
        let rope = Rope { rotary_dim: inv_freq.len() * 2, inv_freq, attention_factor: 1.0 };
        assert!(rope.rotary_dim < head_dim, "the fixture must exercise partial rotary");

        let mut qg = vec![0.0; rows * heads * head_dim * 2];
        ops::matmul(&x, &q_proj, &mut qg);
        let (mut q, mut gate) = (vec![0.0; rows * heads * head_dim], vec![0.0; rows * heads * head_dim]);
        split_q_gate(&qg, heads, head_dim, &mut q, &mut gate);
        let mut k = vec![0.0; rows * kv_heads * head_dim];
        let mut v = vec![0.0; rows * kv_heads * head_dim];
        ops::matmul(&x, &k_proj, &mut k);
        ops::matmul(&x, &v_proj, &mut v);
        let (mut qn, mut kn) = (vec![0.0; q.len()], vec![0.0; k.len()]);
        zero_centered_rmsnorm(&q, &f.get("attn.q_norm"), eps, &mut qn);
        zero_centered_rmsnorm(&k, &f.get("attn.k_norm"), eps, &mut kn);
        ops::rope(&mut qn, heads, head_dim, 0, &rope);
        ops::rope(&mut kn, kv_heads, head_dim, 0, &rope);
        let mut attn = vec![0.0; q.len()];
        ops::attention(&qn, &kn, &v, AttentionShape { heads, kv_heads, head_dim }, 0, &mut attn);
        apply_output_gate(&mut attn, &gate);
        let mut out = vec![0.0; rows * hidden];
        ops::matmul(&attn, &o_proj, &mut out);
        assert_close(&out, &f.get("attn.out"), 1e-5, "Qwen3NextAttention");
    }
}
