//! Rotary position embedding parameters: the inverse frequencies of the
//! rotated pairs and the factor that multiplies cos and sin, with YaRN when
//! the config asks for it (formats-and-math.md section 4, transformers
//! `_compute_yarn_parameters`). Backends compute the angles from these.

use crate::model::ModelConfig;

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Leading dims of each head that are rotated (even).
    pub rotary_dim: usize,
    /// `rotary_dim / 2` inverse frequencies; pair i is `(i, i + rotary_dim/2)`.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 without scaling).
    pub attention_factor: f32,
}

impl Rope {
    pub fn new(c: &ModelConfig) -> Rope {
        let dim = c.rotary_dim();
        let base = c.rope_theta;
        // base^(2i/dim), the period growth of pair i.
        let pos_freq: Vec<f64> = (0..dim / 2).map(|i| base.powf((2 * i) as f64 / dim as f64)).collect();
        let Some(y) = &c.rope_scaling else {
            return Rope {
                rotary_dim: dim,
                inv_freq: pos_freq.iter().map(|p| (1.0 / p) as f32).collect(),
                attention_factor: 1.0,
            };
        };
        let s = y.factor;
        // The dimension whose wavelength makes `r` full rotations over L0.
        let corr = |r: f64| {
            dim as f64 * (y.original_max_position_embeddings as f64 / (2.0 * std::f64::consts::PI * r)).ln()
                / (2.0 * base.ln())
        };
        // beta_fast (many rotations) bounds the extrapolated, high-frequency end.
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min((dim - 1) as f64);
        if high == low {
            high += 0.001; // transformers' guard against a zero-width ramp
        }
        let inv_freq = pos_freq
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let interpolated = 1.0 / (s * p);
                let extrapolated = 1.0 / p;
                (interpolated * (1.0 - extrapolation) + extrapolated * extrapolation) as f32
            })
            .collect();
        let attention_factor = match y.attention_factor {
            Some(a) => a,
            None if s > 1.0 => 0.1 * s.ln() + 1.0,
            None => 1.0,
        };
        Rope { rotary_dim: dim, inv_freq, attention_factor: attention_factor as f32 }
    }

    /// `(cos, sin)` of pair `i` at `pos`, both scaled by the attention factor.
    /// The angle is an f32 product, as transformers computes it.
    pub fn cos_sin(&self, pos: usize, i: usize) -> (f32, f32) {
        let angle = pos as f32 * self.inv_freq[i];
        (angle.cos() * self.attention_factor, angle.sin() * self.attention_factor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, RopeScaling};

    fn config(head_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen3Moe,
            vocab_size: 32,
            hidden_size: 64,
            num_hidden_layers: 1,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            head_dim,
            num_experts: 2,
            num_experts_per_tok: 1,
            moe_intermediate_size: 16,
            norm_topk_prob: true,
            rms_norm_eps: 1e-6,
            rope_theta: theta,
            partial_rotary_factor: 1.0,
            rope_scaling: scaling,
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            qwen3_next: None,
        }
    }

    fn yarn(factor: f64, l0: usize) -> RopeScaling {
        RopeScaling {
            factor,
            original_max_position_embeddings: l0,
            attention_factor: None,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }
    }

    #[test]
    fn default_inv_freq_is_theta_power() {
        let r = Rope::new(&config(16, 10000.0, None));
        assert_eq!(r.rotary_dim, 16);
        assert_eq!(r.inv_freq.len(), 8);
        assert_eq!(r.inv_freq[0], 1.0);
        // theta^(-2*3/16) = 10000^-0.375
        assert!((r.inv_freq[3] - 0.031_622_775).abs() < 1e-8);
        assert_eq!(r.attention_factor, 1.0);
    }

    #[test]
    fn partial_rotary_uses_fewer_pairs() {
        let mut c = config(16, 10000.0, None);
        c.partial_rotary_factor = 0.25;
        let r = Rope::new(&c);
        assert_eq!((r.rotary_dim, r.inv_freq.len()), (4, 2));
        // base^(-2/4) with dim = 4, not 16.
        assert!((r.inv_freq[1] - 0.01).abs() < 1e-9);
    }

    /// A line-by-line transcription of transformers' `_compute_yarn_parameters`.
    fn yarn_reference(dim: usize, base: f64, factor: f64, l0: f64, fast: f64, slow: f64) -> (Vec<f64>, f64) {
        let find_correction_dim = |num_rotations: f64| {
            (dim as f64 * (l0 / (num_rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
        };
        let low = find_correction_dim(fast).floor();
        let high = find_correction_dim(slow).ceil();
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        let mut out = vec![];
        for i in 0..dim / 2 {
            let pos_freqs = base.powf((2 * i) as f64 / dim as f64);
            let inv_freq_extrapolation = 1.0 / pos_freqs;
            let inv_freq_interpolation = 1.0 / (factor * pos_freqs);
            let linear = (i as f64 - low) / (high - low);
            let ramp = linear.clamp(0.0, 1.0);
            let inv_freq_extrapolation_factor = 1.0 - ramp;
            out.push(
                inv_freq_interpolation * (1.0 - inv_freq_extrapolation_factor)
                    + inv_freq_extrapolation * inv_freq_extrapolation_factor,
            );
        }
        (out, 0.1 * factor.ln() + 1.0)
    }

    #[test]
    fn yarn_matches_transcription_and_ramps() {
        // dim 64, base 1e6, L0 4096: low = floor(6.98) = 6, high = ceil(15.01) = 16.
        let r = Rope::new(&config(64, 1e6, Some(yarn(4.0, 4096))));
        let (want, af) = yarn_reference(64, 1e6, 4.0, 4096.0, 32.0, 1.0);
        for (i, (g, w)) in r.inv_freq.iter().zip(&want).enumerate() {
            assert!(((*g as f64) - w).abs() <= 1e-7 * w, "pair {i}: {g} vs {w}");
        }
        assert!((r.attention_factor as f64 - af).abs() < 1e-7);
        assert!((r.attention_factor - 1.138_629_4).abs() < 1e-6);
        // High-frequency pairs (i <= low) are unchanged, low-frequency pairs
        // (i >= high) are interpolated by the factor, the ones between blend.
        let plain = Rope::new(&config(64, 1e6, None));
        for i in 0..=6 {
            assert_eq!(r.inv_freq[i], plain.inv_freq[i], "pair {i}");
        }
        for i in 16..32 {
            assert!((r.inv_freq[i] - plain.inv_freq[i] / 4.0).abs() <= 1e-6 * plain.inv_freq[i]);
        }
        let mid = r.inv_freq[11] / plain.inv_freq[11];
        assert!(mid > 0.25 && mid < 1.0, "{mid}");
    }

    #[test]
    fn yarn_explicit_attention_factor_and_zero_width_guard() {
        let mut y = yarn(2.0, 6);
        y.attention_factor = Some(0.75);
        // L0 = 6 < 2*pi: both correction dims are <= 0, so low == high == 0
        // and only the +0.001 guard avoids 0/0 at pair 0.
        let r = Rope::new(&config(16, 10000.0, Some(y)));
        assert_eq!(r.attention_factor, 0.75);
        let plain = Rope::new(&config(16, 10000.0, None));
        assert!(r.inv_freq.iter().all(|f| f.is_finite()));
        assert_eq!(r.inv_freq[0], plain.inv_freq[0]);
        for i in 1..8 {
            assert!((r.inv_freq[i] - plain.inv_freq[i] / 2.0).abs() <= 1e-6 * plain.inv_freq[i]);
        }
        let (want, _) = yarn_reference(16, 10000.0, 2.0, 6.0, 32.0, 1.0);
        for (g, w) in r.inv_freq.iter().zip(&want) {
            assert!(((*g as f64) - w).abs() <= 1e-7 * w);
        }
    }
}
