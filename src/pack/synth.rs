//! Synthetic packs: real model geometries with random weights, deterministic
//! from a seed and streamed to disk one layer at a time, for tests, benches
//! and cache studies.
//!
//! Dense weights are BF16 normal(0, 0.02); norm weights sit at their neutral
//! value (1 for plain norms, 0 for qwen3_next's zero-centered `1 + w` norms,
//! 1 for the DeltaNet gated norm's plain weight). Expert codes are uniform
//! random bytes, block scales E4M3 in [0.5, 1], and each matrix gets its own
//! global scale (gate, up and down differ, far from 1); qwen3_next's shared
//! expert is NVFP4 made the same way. qwen3_next DeltaNet parameters follow
//! the usual initialization: `A_log = ln U(1, 16)` and `dt_bias =
//! softplus^-1(dt)` with `dt` log-uniform in [0.001, 0.1] (both F32), so the
//! per-token decays `exp(-exp(A_log) * softplus(a + dt_bias))` lie in (0, 1),
//! mostly near 1; conv1d weights have std `1 / sqrt(3 K)` (uniform
//! `±1/sqrt(K)`'s).
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
use crate::model::config::Qwen3NextConfig;
use crate::model::weights::{layer_of_tensor, required_dense_tensors, Role};
use crate::model::{Arch, ModelConfig};
use crate::quant::{f32_to_bf16_bytes, Nvfp4Matrix};
use crate::rng::Rng;

/// The preset names of `arch`.
pub fn presets(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::Qwen3Moe => &["tiny", "30b-a3b"],
        Arch::Qwen3Next => &["tiny", "80b-a3b"],
    }
}

/// The config of a named preset.
pub fn preset(arch: Arch, name: &str) -> Result<ModelConfig> {
    let unknown = || {
        Error::InvalidArgument(format!("unknown {} preset {name:?} (known: {})", arch.name(), presets(arch).join(", ")))
    };
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
        qwen3_next: None,
    };
    match (arch, name) {
        (Arch::Qwen3Moe, "tiny") => Ok(base),
        // Qwen3-30B-A3B geometry.
        (Arch::Qwen3Moe, "30b-a3b") => Ok(ModelConfig {
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
        // The geometry of reference fixture `a` (tests/fixtures/README.md):
        // three DeltaNet layers, then one full-attention layer, and MTP.
        (Arch::Qwen3Next, "tiny") => Ok(ModelConfig {
            vocab_size: 384,
            num_hidden_layers: 4,
            head_dim: 32,
            rope_theta: 10_000.0,
            partial_rotary_factor: 0.25,
            qwen3_next: Some(Qwen3NextConfig {
                full_attention_interval: 4,
                linear_num_key_heads: 2,
                linear_num_value_heads: 4,
                linear_key_head_dim: 16,
                linear_value_head_dim: 16,
                linear_conv_kernel_dim: 4,
                shared_expert_intermediate_size: 48,
                mtp_num_hidden_layers: 1,
            }),
            ..base
        }),
        // Qwen3-Next-80B-A3B geometry.
        (Arch::Qwen3Next, "80b-a3b") => Ok(ModelConfig {
            vocab_size: 151_936,
            hidden_size: 2048,
            num_hidden_layers: 48,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            num_experts: 512,
            num_experts_per_tok: 10,
            moe_intermediate_size: 512,
            rope_theta: 10_000_000.0,
            partial_rotary_factor: 0.25,
            max_position_embeddings: 262_144,
            qwen3_next: Some(Qwen3NextConfig {
                full_attention_interval: 4,
                linear_num_key_heads: 16,
                linear_num_value_heads: 32,
                linear_key_head_dim: 128,
                linear_value_head_dim: 128,
                linear_conv_kernel_dim: 4,
                shared_expert_intermediate_size: 512,
                mtp_num_hidden_layers: 1,
            }),
            ..base
        }),
        _ => Err(unknown()),
    }
}

#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub seed: u64,
    /// Zipf exponent of expert popularity; 0 = uniform routing.
    pub zipf: f64,
    /// Embedding rows `SPREAD_EMBED_SCALE` times larger, so that each
    /// token's own embedding dominates its residual stream at every depth
    /// and routing stays spread over the experts in deep layers too (see
    /// `SPREAD_EMBED_SCALE`). For cache benches: the layers then barely
    /// change the logits, so tests keep it off.
    pub spread_routing: bool,
    pub overwrite: bool,
    /// Print a line per layer to stderr.
    pub progress: bool,
    /// Keep only the first N main layers of the geometry (MTP layers are
    /// kept); qwen3_next needs at least one full-attention layer among them.
    pub layers: Option<usize>,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self { seed: 1, zipf: 0.0, spread_routing: false, overwrite: false, progress: false, layers: None }
    }
}

const STD: f32 = 0.02;
/// The embedding scale of `SynthOptions::spread_routing`. With random
/// weights at `STD`, attention averages over positions and the residual
/// stream soon carries mostly what every token shares: for 512 random
/// tokens of the 30b-a3b geometry, 126, 85 and 49 of the 128 experts were
/// routed to at layers 0, 1 and 2, fewer deeper. Embeddings this much
/// larger keep the router's input token-specific.
const SPREAD_EMBED_SCALE: f32 = 1000.0;
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

/// Element RMS of random codes with scales ~0.75 is about 2.2; a global
/// scale of `NVFP4_G * factor` brings weights to about `STD * factor`.
const NVFP4_G: f32 = STD / 2.2;

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
            // Each matrix its own global scale.
            let g = NVFP4_G;
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

/// `softplus^-1(y) = ln(exp(y) - 1)`, for y > 0.
fn inverse_softplus(y: f64) -> f64 {
    y + (-(-y).exp_m1()).ln()
}

/// A float dense tensor's values.
fn dense_values(c: &ModelConfig, seed: u64, id: u64, n: usize, role: Role) -> Vec<f32> {
    if let Some(neutral) = role.norm_neutral(c.arch) {
        return vec![neutral; n];
    }
    let mut r = Rng::derive(seed, &[4, id]);
    match role {
        // A = exp(A_log) in [1, 16].
        Role::LinearALog => (0..n).map(|_| (1.0 + 15.0 * r.next_f64()).ln() as f32).collect(),
        // dt log-uniform in [0.001, 0.1] at a = 0.
        Role::LinearDtBias => (0..n)
            .map(|_| {
                let dt = (0.001f64.ln() + r.next_f64() * (0.1f64.ln() - 0.001f64.ln())).exp();
                inverse_softplus(dt) as f32
            })
            .collect(),
        Role::LinearConv1d => {
            let k = c.linear_attn().expect("qwen3_next").conv_kernel as f32;
            normal_tensor(seed, id, n, 1.0 / (3.0 * k).sqrt())
        }
        _ => normal_tensor(seed, id, n, STD),
    }
}

/// Writes a synthetic pack of `config` (cut to `opts.layers` layers) to `out`.
pub fn synth(config: &ModelConfig, out: &Path, opts: &SynthOptions) -> Result<Manifest> {
    if !(opts.zipf >= 0.0 && opts.zipf.is_finite()) {
        return Err(Error::InvalidArgument(format!("zipf exponent {} must be >= 0", opts.zipf)));
    }
    let c = &match opts.layers {
        Some(n) => config.with_layers(n)?,
        None => config.clone(),
    };
    let source = format!("synth seed {} zipf {} spread {}", opts.seed, opts.zipf, opts.spread_routing);
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

    // Dense tensors in model order; a layer's expert blobs follow its last
    // dense tensor.
    let tensors = required_dense_tensors(c);
    let layers: Vec<Option<usize>> = tensors.iter().map(|t| layer_of_tensor(c, &t.0)).collect();
    for (id, (name, shape, role)) in tensors.iter().enumerate() {
        let n: usize = shape.iter().product();
        if role.is_shared_expert() {
            let mut r = Rng::derive(seed, &[5, id as u64]);
            let (codes, scales) = random_nvfp4(&mut r, shape[0], shape[1]);
            let global_scale = NVFP4_G * (0.5 + r.next_f32());
            let m = Nvfp4Matrix { rows: shape[0], cols: shape[1], codes: &codes, scales: &scales, global_scale };
            w.add_tensor(name, shape, DenseTensor::Nvfp4(m))?;
        } else {
            let mut v = dense_values(c, seed, id as u64, n, *role);
            if opts.spread_routing && matches!(role, Role::Embedding) {
                v.par_iter_mut().for_each(|x| *x *= SPREAD_EMBED_SCALE);
            }
            if opts.zipf > 0.0 {
                let scale = if opts.spread_routing { SPREAD_EMBED_SCALE } else { 1.0 };
                match role {
                    Role::Embedding => v
                        .par_chunks_mut(h)
                        .for_each(|row| row.iter_mut().zip(&u).for_each(|(x, ui)| *x += scale * STD * ui)),
                    Role::Router => {
                        for (e, row) in v.chunks_mut(h).enumerate() {
                            let b = -(2.0f64).sqrt() * opts.zipf * ((ranks[e] + 1) as f64).ln();
                            row.iter_mut().zip(&u).for_each(|(x, ui)| *x += (b / h as f64) as f32 * ui);
                        }
                    }
                    _ => {}
                }
            }
            if role.keeps_f32() {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_tensor(name, shape, DenseTensor::F32(&bytes))?;
            } else {
                w.add_tensor(name, shape, DenseTensor::Bf16(&f32_to_bf16_bytes(&v)))?;
            }
        }
        if let Some(layer) = layers[id].filter(|&l| layers.get(id + 1) != Some(&Some(l))) {
            write_layer_experts(&mut w, c, seed, layer)?;
            if opts.progress {
                eprintln!(
                    "strata synth: layer {}/{} written ({:.1} s)",
                    layer + 1,
                    c.num_expert_layers(),
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

    /// Distinct experts each layer routes 128 random tokens to, on a
    /// 12-layer variant of the tiny geometry with 32 experts.
    fn distinct_routed(spread_routing: bool) -> Vec<usize> {
        use crate::engine::{Engine, EngineOptions};
        use crate::experts::ExpertCacheOptions;
        use crate::session::SessionOptions;
        let d = tempfile::tempdir().unwrap();
        let tiny = preset(Arch::Qwen3Moe, "tiny").unwrap();
        let c = ModelConfig { num_hidden_layers: 12, num_experts: 32, ..tiny };
        synth(&c, d.path(), &SynthOptions { spread_routing, ..Default::default() }).unwrap();
        // The smallest cache records the routing (as `strata profile`).
        let cache = ExpertCacheOptions { slots: Some(2), adapt_every: 0, ..Default::default() };
        let e = Engine::load(d.path(), &EngineOptions { expert_cache: cache, ..Default::default() }).unwrap();
        let mut r = Rng::derive(9, &[]);
        let prompt: Vec<u32> = (0..128).map(|_| r.below(c.vocab_size as u64) as u32).collect();
        e.new_session(&SessionOptions::default()).unwrap().prefill(&prompt).unwrap();
        let p = e.expert_profile().unwrap();
        p.counts.iter().map(|l| l.iter().filter(|&&n| n > 0).count()).collect()
    }

    #[test]
    fn spread_routing_keeps_every_layer_on_most_experts() {
        // 256 routings over 32 experts a layer: uniform routing misses
        // about 32 * (31/32)^256, i.e. none.
        let spread = distinct_routed(true);
        assert!(spread.iter().all(|&n| n >= 30), "{spread:?}");
        // Without it the deep layers collapse onto a few experts (seen:
        // 7 to 14 of 32 in the last four layers).
        let plain = distinct_routed(false);
        assert!(plain[8..].iter().sum::<usize>() < 4 * 24, "{plain:?}");
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
        assert!(preset(Arch::Qwen3Moe, "80b-a3b").unwrap_err().to_string().contains("30b-a3b"));
    }

    #[test]
    fn qwen3_next_tiny_pack() {
        use crate::pack::TensorData;
        let d = tempfile::tempdir().unwrap();
        let c = preset(Arch::Qwen3Next, "tiny").unwrap();
        let m = synth(&c, d.path(), &SynthOptions::default()).unwrap();
        assert_eq!(m.arch, "qwen3_next");
        assert_eq!(m.experts.entries.len(), 5 * 8);
        let p = Pack::open(d.path()).unwrap();
        p.verify(|_, _| {}).unwrap();
        // The MTP layer's experts are layer 4.
        let x = p.expert(4, 7).unwrap();
        assert!(x.gate.global_scale != x.up.global_scale);
        assert_ne!(p.expert(4, 0).unwrap().blob, p.expert(3, 0).unwrap().blob);
        assert!(p.expert(5, 0).is_err());

        let f = |name: &str| p.tensor(name).unwrap().to_f32();
        assert!(f("model.layers.0.input_layernorm.weight").iter().all(|&x| x == 0.0));
        assert!(f("mtp.pre_fc_norm_hidden.weight").iter().all(|&x| x == 0.0));
        assert!(f("model.layers.3.self_attn.q_norm.weight").iter().all(|&x| x == 0.0));
        assert!(f("model.layers.1.linear_attn.norm.weight").iter().all(|&x| x == 1.0));
        let a_log = p.tensor("model.layers.2.linear_attn.A_log").unwrap();
        assert!(matches!(a_log.data, TensorData::F32(_)));
        let dt_bias = f("model.layers.2.linear_attn.dt_bias");
        for (al, db) in a_log.to_f32().iter().zip(&dt_bias) {
            assert!((0.0..=16f32.ln()).contains(al), "A_log {al}");
            // The decay at a = 0: exp(-A * softplus(dt_bias)) = exp(-A * dt).
            let decay = (-al.exp() * (1.0 + db.exp()).ln()).exp();
            assert!(decay > 0.19 && decay < 0.9999, "decay {decay}");
        }
        let conv = p.tensor("model.layers.0.linear_attn.conv1d.weight").unwrap();
        assert_eq!(conv.shape, [128, 1, 4]);
        let std = (conv.to_f32().iter().map(|x| x * x).sum::<f32>() / 512.0).sqrt();
        assert!((0.2..0.4).contains(&std), "conv std {std}");
        let TensorData::Nvfp4(se) = p.tensor("mtp.layers.0.mlp.shared_expert.down_proj.weight").unwrap().data else {
            panic!("shared expert is not NVFP4")
        };
        assert_eq!((se.rows, se.cols), (64, 48));
        assert!(matches!(p.tensor("model.layers.0.mlp.shared_expert_gate.weight").unwrap().data, TensorData::Bf16(_)));
    }

    #[test]
    fn layers_option_cuts_the_geometry() {
        let d = tempfile::tempdir().unwrap();
        let c = preset(Arch::Qwen3Moe, "tiny").unwrap();
        let m = synth(&c, d.path(), &SynthOptions { layers: Some(1), ..Default::default() }).unwrap();
        assert_eq!((m.config.num_hidden_layers, m.experts.entries.len()), (1, 8));
        Pack::open(d.path()).unwrap();

        let c = preset(Arch::Qwen3Next, "tiny").unwrap();
        let out = d.path().join("next");
        let e = synth(&c, &out, &SynthOptions { layers: Some(2), ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("no full-attention layer"), "{e}");
        assert!(!out.exists());
    }

    #[test]
    fn qwen3_next_presets() {
        let c = preset(Arch::Qwen3Next, "80b-a3b").unwrap();
        c.validate().unwrap();
        assert_eq!((c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.rotary_dim()), (48, 512, 10, 64));
        let la = c.linear_attn().unwrap();
        assert_eq!((la.qkvz_dim(), la.conv_dim(), la.value_dim()), (12288, 8192, 4096));
        assert_eq!((c.num_expert_layers(), c.q_proj_dim()), (49, 8192));
        assert!(c.is_full_attention(3) && !c.is_full_attention(46) && c.is_full_attention(47));
        let four = c.with_layers(4).unwrap();
        assert_eq!(crate::model::weights::required_dense_tensors(&four).len(), 3 * 14 + 13 + 3 + 17);
        assert!(preset(Arch::Qwen3Next, "30b-a3b").unwrap_err().to_string().contains("80b-a3b"));
    }
}
