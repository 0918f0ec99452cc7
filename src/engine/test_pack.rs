//! Tiny random qwen3_moe packs for tests, written with `PackWriter`: BF16
//! dense weights (std 0.1, norms 1 + noise), experts quantized to NVFP4 with
//! `quantize` (global scales ~1e-4, far from 1, and different for gate, up
//! and down). Deterministic from the seed.

use std::path::Path;

use crate::error::Result;
use crate::model::weights::{required_dense_tensors, Role};
use crate::model::{Arch, ModelConfig};
use crate::pack::{DenseTensor, PackWriter};
use crate::quant::nvfp4::quantize;
use crate::quant::{f32_to_bf16_bytes, Nvfp4Matrix, Nvfp4Owned};
use crate::rng::Rng;

/// hidden 64, 2 layers, 4 heads / 2 kv heads of 16, 8 experts top 2,
/// moe_intermediate 32, vocab 97.
pub(crate) fn tiny_config() -> ModelConfig {
    // The synth preset with a vocab that is not a power of two and a short context.
    let base = crate::pack::synth::preset(Arch::Qwen3Moe, "tiny").expect("tiny preset exists");
    ModelConfig { vocab_size: 97, rope_theta: 10000.0, max_position_embeddings: 64, ..base }
}

/// How the large dense matrices (`Role::may_quantize`) are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DenseKind {
    Bf16,
    /// NVFP4 from `quantize` (as `pack --dense nvfp4`).
    Nvfp4,
    /// F32 holding exactly the dequantized values of `Nvfp4`.
    F32OfNvfp4,
}

#[derive(Clone, Debug)]
pub(crate) struct TinyPack {
    pub seed: u64,
    pub dense: DenseKind,
    /// Replaces every expert matrix's global scale (codes and block scales
    /// unchanged): a model whose scales are wrong.
    pub expert_global_scale: Option<f32>,
}

impl Default for TinyPack {
    fn default() -> Self {
        TinyPack { seed: 1, dense: DenseKind::Bf16, expert_global_scale: None }
    }
}

fn normal(r: &mut Rng, n: usize, mean: f32, std: f32) -> Vec<f32> {
    (0..n).map(|_| mean + r.normal() * std).collect()
}

/// The matrix with its global scale, or the override.
fn scaled<'a>(m: &'a Nvfp4Owned, opts: &TinyPack) -> Nvfp4Matrix<'a> {
    Nvfp4Matrix { global_scale: opts.expert_global_scale.unwrap_or(m.global_scale), ..m.view() }
}

pub(crate) fn write_tiny_pack(dir: &Path, c: &ModelConfig, opts: &TinyPack) -> Result<()> {
    let mut w = PackWriter::create(dir, c, &format!("test tiny seed {}", opts.seed), true)?;
    for (id, (name, shape, role)) in required_dense_tensors(c).into_iter().enumerate() {
        let mut r = Rng::derive(opts.seed, &[1, id as u64]);
        let n: usize = shape.iter().product();
        let is_norm =
            matches!(role, Role::InputNorm | Role::PostAttnNorm | Role::QNorm | Role::KNorm | Role::FinalNorm);
        let v = if is_norm { normal(&mut r, n, 1.0, 0.1) } else { normal(&mut r, n, 0.0, 0.1) };
        match (opts.dense, role.may_quantize()) {
            (DenseKind::Nvfp4, true) => {
                let q = quantize(&v, shape[0], shape[1]);
                w.add_tensor(&name, &shape, DenseTensor::Nvfp4(q.view()))?;
            }
            (DenseKind::F32OfNvfp4, true) => {
                let d = quantize(&v, shape[0], shape[1]).view().dequantize();
                let bytes: Vec<u8> = d.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_tensor(&name, &shape, DenseTensor::F32(&bytes))?;
            }
            _ => w.add_tensor(&name, &shape, DenseTensor::Bf16(&f32_to_bf16_bytes(&v)))?,
        }
    }
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    for layer in 0..c.num_hidden_layers {
        for e in 0..c.num_experts {
            let mut r = Rng::derive(opts.seed, &[2, layer as u64, e as u64]);
            // Different magnitudes: gate, up and down get different global scales.
            let gate = quantize(&normal(&mut r, i * h, 0.0, 0.15), i, h);
            let up = quantize(&normal(&mut r, i * h, 0.0, 0.1), i, h);
            let down = quantize(&normal(&mut r, h * i, 0.0, 0.2), h, i);
            w.add_expert(layer, e, scaled(&gate, opts), scaled(&up, opts), scaled(&down, opts))?;
        }
    }
    w.finish()?;
    Ok(())
}
