//! Synthetic packs: real model geometries with random weights, deterministic
//! from a seed and streamed to disk one layer at a time, for tests, benches
//! and cache studies.
//!
//! Dense weights are BF16 normal(0, 0.02) (norm weights 1.0); expert codes
//! are uniform random bytes, block scales E4M3 in [0.5, 1], and each matrix
//! gets its own global scale (gate, up and down differ, far from 1).
//! With `zipf > 0`, every embedding row shares a direction `u` and router row
//! `e` gets `-sqrt(2) * zipf * ln(rank_e) * u / hidden`, which biases router
//! logits by about `-zipf * ln(rank)`: expert popularity then follows a
//! Zipf-like law with exponent `zipf` over a seeded random ranking.

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;

use super::format::Manifest;
use super::writer::{DenseTensor, PackWriter};
use crate::error::{Error, Result};
use crate::model::weights::{required_dense_tensors, Role};
use crate::model::{Arch, ModelConfig};
use crate::quant::{f32_to_bf16_bytes, Nvfp4Matrix};
use crate::rng::Rng;

pub const PRESETS: &[&str] = &["tiny", "30b-a3b"];

/// The config of a named preset.
pub fn preset(arch: Arch, name: &str) -> Result<ModelConfig> {
    if arch != Arch::Qwen3Moe {
        return Err(Error::Unsupported(format!("synth --arch {} (this build makes qwen3_moe)", arch.name())));
    }
    let base = ModelConfig {
        arch,
        vocab_size: 256,
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        num_experts: 8,
        num_experts_per_tok: 2,
        moe_intermediate_size: 32,
        norm_topk_prob: true,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        partial_rotary_factor: 1.0,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
    };
    match name {
        "tiny" => Ok(base),
        // Qwen3-30B-A3B geometry.
        "30b-a3b" => Ok(ModelConfig {
            vocab_size: 151_936,
            hidden_size: 2048,
            num_hidden_layers: 48,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: 128,
            num_experts: 128,
            num_experts_per_tok: 8,
            moe_intermediate_size: 768,
            max_position_embeddings: 40_960,
            ..base
        }),
        other => Err(Error::InvalidArgument(format!("unknown preset {other:?} (known: {})", PRESETS.join(", ")))),
    }
}

#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub seed: u64,
    /// Zipf exponent of expert popularity; 0 = uniform routing.
    pub zipf: f64,
    pub overwrite: bool,
    /// Print a line per layer to stderr.
    pub progress: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self { seed: 1, zipf: 0.0, overwrite: false, progress: false }
    }
}

const STD: f32 = 0.02;
/// Elements per parallel work item of a dense tensor.
const CHUNK: usize = 1 << 16;

fn normal_tensor(seed: u64, id: u64, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, c)| {
        let mut r = Rng::derive(seed, &[1, id, ci as u64]);
        for x in c {
            *x = r.normal() * std;
        }
    });
    v
}

/// Random NVFP4 codes and E4M3 block scales in [0.5, 1] (the caller picks
/// the global scale).
fn random_nvfp4(r: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut codes = vec![0u8; rows * cols / 2];
    r.fill_bytes(&mut codes);
    // E4M3 0x30 = 0.5 ... 0x38 = 1.0.
    let scales = (0..rows * cols / 16).map(|_| 0x30 + r.below(9) as u8).collect();
    (codes, scales)
}

/// Random expert blobs of one layer, built in parallel, written in order.
fn write_layer_experts(w: &mut PackWriter, c: &ModelConfig, seed: u64, layer: usize) -> Result<()> {
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    let blobs: Vec<Result<Vec<u8>>> = (0..c.num_experts)
        .into_par_iter()
        .map(|e| {
            let mut r = Rng::derive(seed, &[3, layer as u64, e as u64]);
            let (gc, gs) = random_nvfp4(&mut r, i, h);
            let (uc, us) = random_nvfp4(&mut r, i, h);
            let (dc, ds) = random_nvfp4(&mut r, h, i);
            // Element RMS of random codes with scales ~0.75 is about 2.2;
            // global scales bring weights to ~STD, each matrix its own.
            let g = STD / 2.2;
            let m = |rows, cols, codes, scales, global_scale| Nvfp4Matrix { rows, cols, codes, scales, global_scale };
            let gate = m(i, h, &gc, &gs, g * (0.5 + r.next_f32()));
            let up = m(i, h, &uc, &us, g * (1.5 + r.next_f32()));
            let down = m(h, i, &dc, &ds, g * (0.25 + r.next_f32()));
            w.expert_blob(layer, e, gate, up, down)
        })
        .collect();
    for (e, blob) in blobs.into_iter().enumerate() {
        w.write_expert_blob(layer, e, &blob?)?;
    }
    Ok(())
}

/// Writes a synthetic pack of `config` to `out`.
pub fn synth(config: &ModelConfig, out: &Path, opts: &SynthOptions) -> Result<Manifest> {
    if !(opts.zipf >= 0.0 && opts.zipf.is_finite()) {
        return Err(Error::InvalidArgument(format!("zipf exponent {} must be >= 0", opts.zipf)));
    }
    let c = config;
    let source = format!("synth seed {} zipf {}", opts.seed, opts.zipf);
    let mut w = PackWriter::create(out, c, &source, opts.overwrite)?;
    let (h, seed) = (c.hidden_size, opts.seed);
    let start = Instant::now();

    // The shared direction for skewed routing, and each expert's rank.
    let u = normal_tensor(seed, u64::MAX, h, 1.0);
    let mut ranks: Vec<usize> = (0..c.num_experts).collect();
    let mut rr = Rng::derive(seed, &[2]);
    for i in (1..ranks.len()).rev() {
        ranks.swap(i, rr.below(i as u64 + 1) as usize);
    }

    // Dense tensors in model order; a layer's expert blobs follow its router.
    for (id, (name, shape, role)) in required_dense_tensors(c).iter().enumerate() {
        let n: usize = shape.iter().product();
        let mut v = match role {
            Role::InputNorm | Role::PostAttnNorm | Role::QNorm | Role::KNorm | Role::FinalNorm => vec![1.0; n],
            _ => normal_tensor(seed, id as u64, n, STD),
        };
        if opts.zipf > 0.0 {
            match role {
                Role::Embedding => {
                    v.par_chunks_mut(h).for_each(|row| row.iter_mut().zip(&u).for_each(|(x, ui)| *x += STD * ui))
                }
                Role::Router => {
                    for (e, row) in v.chunks_mut(h).enumerate() {
                        let b = -(2.0f64).sqrt() * opts.zipf * ((ranks[e] + 1) as f64).ln();
                        row.iter_mut().zip(&u).for_each(|(x, ui)| *x += (b / h as f64) as f32 * ui);
                    }
                }
                _ => {}
            }
        }
        w.add_tensor(name, shape, DenseTensor::Bf16(&f32_to_bf16_bytes(&v)))?;
        if *role == Role::Router {
            let layer: usize = name
                .split('.')
                .nth(2)
                .and_then(|x| x.parse().ok())
                .expect("router names are model.layers.N.mlp.gate.weight");
            write_layer_experts(&mut w, c, seed, layer)?;
            if opts.progress {
                eprintln!(
                    "strata synth: layer {}/{} written ({:.1} s)",
                    layer + 1,
                    c.num_hidden_layers,
                    start.elapsed().as_secs_f64()
                );
            }
        }
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::Pack;

    #[test]
    fn tiny_pack_is_deterministic_and_valid() {
        let d = tempfile::tempdir().unwrap();
        let c = preset(Arch::Qwen3Moe, "tiny").unwrap();
        let o = SynthOptions::default();
        let m1 = synth(&c, &d.path().join("a"), &o).unwrap();
        let m2 = synth(&c, &d.path().join("b"), &o).unwrap();
        let m3 = synth(&c, &d.path().join("c"), &SynthOptions { seed: 2, ..o.clone() }).unwrap();
        assert_eq!(m1.tensors, m2.tensors);
        assert_eq!(m1.experts.entries, m2.experts.entries);
        assert_ne!(m1.experts.entries, m3.experts.entries);
        let p = Pack::open(&d.path().join("a")).unwrap();
        p.verify(|_, _| {}).unwrap();
        let x = p.expert(1, 3).unwrap();
        let (g, u, dn) = (x.gate.global_scale, x.up.global_scale, x.down.global_scale);
        assert!(g != u && u != dn && g < 0.02 && u > g, "{g} {u} {dn}");
        // Refuses to overwrite without the flag.
        assert!(synth(&c, &d.path().join("a"), &o).is_err());
        assert!(synth(&c, &d.path().join("a"), &SynthOptions { overwrite: true, ..o }).is_ok());
    }

    #[test]
    fn zipf_skews_router_rows_along_the_shared_direction() {
        let d = tempfile::tempdir().unwrap();
        let c = preset(Arch::Qwen3Moe, "tiny").unwrap();
        synth(&c, d.path(), &SynthOptions { zipf: 1.5, ..Default::default() }).unwrap();
        let p = Pack::open(d.path()).unwrap();
        // An input along the shared direction: router logits ordered by rank.
        let emb = p.tensor("model.embed_tokens.weight").unwrap().to_f32();
        let mean: Vec<f32> = (0..c.hidden_size)
            .map(|j| (0..c.vocab_size).map(|t| emb[t * c.hidden_size + j]).sum::<f32>() / c.vocab_size as f32)
            .collect();
        let router = p.tensor("model.layers.0.mlp.gate.weight").unwrap().to_f32();
        let logits: Vec<f32> =
            router.chunks(c.hidden_size).map(|r| r.iter().zip(&mean).map(|(a, b)| a * b).sum()).collect();
        let spread = logits.iter().cloned().fold(f32::MIN, f32::max) - logits.iter().cloned().fold(f32::MAX, f32::min);
        let d2 = tempfile::tempdir().unwrap();
        synth(&c, d2.path(), &SynthOptions::default()).unwrap();
        let p2 = Pack::open(d2.path()).unwrap();
        let router2 = p2.tensor("model.layers.0.mlp.gate.weight").unwrap().to_f32();
        let logits2: Vec<f32> =
            router2.chunks(c.hidden_size).map(|r| r.iter().zip(&mean).map(|(a, b)| a * b).sum()).collect();
        let spread2 =
            logits2.iter().cloned().fold(f32::MIN, f32::max) - logits2.iter().cloned().fold(f32::MAX, f32::min);
        assert!(spread > 4.0 * spread2, "skewed spread {spread} vs uniform {spread2}");
    }

    #[test]
    fn presets() {
        let c = preset(Arch::Qwen3Moe, "30b-a3b").unwrap();
        assert_eq!((c.num_hidden_layers, c.num_experts, c.vocab_size), (48, 128, 151_936));
        assert!(preset(Arch::Qwen3Moe, "nope").unwrap_err().to_string().contains("tiny"));
        assert!(preset(Arch::Qwen3Next, "tiny").is_err());
    }
}
