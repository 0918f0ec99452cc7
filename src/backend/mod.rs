//! What a device can do, as one trait. The engine and the MoE pipeline call
//! these ops and never ask which backend they hold (architecture.md).
//!
//! Activations are row-major f32 slices `[rows, width]`; every op writes its
//! result into a caller-provided `out` of the right length. The CPU backend
//! (`cpu`) is the f32 reference; a CUDA backend implements the same list.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod rope;

pub use cpu::deltanet::{DeltaNetShape, DeltaNetState, GatedDeltaNetWeights};
pub use cpu::CpuBackend;
pub use rope::Rope;

use crate::pack::ExpertView;

/// A dense row-major f32 matrix `[rows, cols]`, e.g. a linear weight `[out, in]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    /// Wraps `data`; panics if its length is not `rows * cols` (a caller bug).
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(data.len(), rows * cols, "Matrix::new: data length");
        Matrix { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Head counts of one attention layer (grouped-query: `heads` is a multiple
/// of `kv_heads`; query head `h` reads kv head `h / (heads / kv_heads)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One expert's weights and how many consecutive rows of the grouped input
/// it owns (the rows routed to it, already gathered by the MoE pipeline).
#[derive(Clone, Copy, Debug)]
pub struct ExpertRows<'a> {
    /// gate/up/down with their own global scales: no call can drop them.
    pub weights: ExpertView<'a>,
    pub rows: usize,
}

/// The ops of a forward pass. Row counts follow from slice lengths.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// `out[t, n] = sum_k x[t, k] * w[n, k]` for `x [T, K]`, `w [N, K]`, `out [T, N]`.
    fn matmul(&self, x: &[f32], w: &Matrix, out: &mut [f32]);

    /// RMSNorm of each row of `x` (row length `w.len()`):
    /// `out = x * 1/sqrt(mean(x^2) + eps) * w`.
    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]);

    /// Rotary embedding in place on `x [T, heads, head_dim]`; row `t` sits at
    /// position `start_pos + t`. Rotates the first `rope.rotary_dim` dims of
    /// each head, NeoX style (pairs `(i, i + rotary_dim/2)`).
    fn rope(&self, x: &mut [f32], heads: usize, head_dim: usize, start_pos: usize, rope: &Rope);

    /// Causal attention of `q [T, heads * head_dim]` over a KV cache
    /// `k, v [L, kv_heads * head_dim]` that already holds the keys of these
    /// T rows; query row `t` is position `start_pos + t` and sees keys
    /// `0..=start_pos + t`. Scale `head_dim^-0.5`. `out [T, heads * head_dim]`.
    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], shape: AttentionShape, start_pos: usize, out: &mut [f32]);

    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]);

    /// Grouped expert FFN: rows of `x [R, hidden]` are consecutive per group
    /// (in `groups` order); row r of group g gives
    /// `out[r] = down(silu(gate x[r]) * up x[r])` with g's weights.
    fn expert_ffn(&self, groups: &[ExpertRows<'_>], x: &[f32], out: &mut [f32]);

    /// A whole Gated DeltaNet mixer over `x [T, hidden]` (already normed),
    /// continuing from `state` and updating it (qwen3_next linear layers;
    /// `cpu::deltanet::gated_deltanet_layer`). `out [T, hidden]`.
    fn gated_deltanet(
        &self,
        x: &[f32],
        w: &GatedDeltaNetWeights<'_>,
        shape: DeltaNetShape,
        eps: f32,
        state: &mut DeltaNetState,
        out: &mut [f32],
    );

    /// Gated attention's output gate, in place: `attn *= sigmoid(gate)`.
    fn output_gate(&self, attn: &mut [f32], gate: &[f32]);
}
