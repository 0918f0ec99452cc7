//! Token sampling: greedy, or temperature then top-k, top-p and min-p
//! filters and a seeded draw (the crate's xoshiro256** `Rng`, so a seed
//! gives the same tokens on every platform).

use crate::error::{Error, Result};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the k most probable tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-probable set whose mass reaches top_p; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * p_max`; 0 = off.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy.
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

/// Index of the largest value; the lowest index on ties. `values` must be
/// non-empty and finite.
fn argmax(values: &[f32]) -> usize {
    // Per block of 64, the largest value in 8 independent lanes
    // (vectorized: a decode step scans the whole vocabulary); the first
    // block whose maximum is strictly larger than every earlier one holds
    // the answer, found there by position. The same result as a scan that
    // keeps the first strictly larger value, for finite input (callers
    // check that first).
    const B: usize = 64;
    let (mut best, mut block) = (f32::NEG_INFINITY, 0usize);
    for (bi, c) in values.chunks(B).enumerate() {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let eights = c.chunks_exact(8);
        let tail = eights.remainder();
        for q in eights {
            for (m, &v) in lanes.iter_mut().zip(q) {
                *m = if v > *m { v } else { *m };
            }
        }
        let m = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        if m > best {
            (best, block) = (m, bi);
        }
    }
    let c = &values[(block * B).min(values.len())..(block * B + B).min(values.len())];
    block * B + c.iter().position(|&v| v == best).unwrap_or(0)
}

/// Logits a sampler can draw from: not empty, every value finite.
pub(crate) fn check_samplable(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::InvalidArgument("no logits to sample from".into()));
    }
    if let Some(i) = first_nonfinite(logits) {
        let v = logits[i];
        return Err(Error::InvalidArgument(format!("logit {i} is {v}: cannot sample from non-finite logits")));
    }
    Ok(())
}

/// The index of the first NaN or infinity in `values`, if any: checked 64
/// at a time (vectorized), the exact index found only in a failing block.
pub(crate) fn first_nonfinite(values: &[f32]) -> Option<usize> {
    const B: usize = 64;
    values
        .chunks(B)
        .enumerate()
        .find(|(_, c)| !c.iter().fold(true, |ok, v| ok & v.is_finite()))
        .and_then(|(b, c)| c.iter().position(|v| !v.is_finite()).map(|i| b * B + i))
}

impl Sampler {
    /// Checks the parameters: temperature finite and >= 0, top_p in (0, 1],
    /// min_p in [0, 1].
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        let p = &params;
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            return Err(Error::InvalidArgument(format!("temperature {} must be a finite number >= 0", p.temperature)));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!("top_p {} must be in (0, 1]", p.top_p)));
        }
        if !(p.min_p >= 0.0 && p.min_p <= 1.0) {
            return Err(Error::InvalidArgument(format!("min_p {} must be in [0, 1]", p.min_p)));
        }
        Ok(Sampler { rng: Rng::new(params.seed), params })
    }

    /// A sampler with `params` whose random stream continues from `rng`
    /// (a saved session state).
    pub fn with_rng(params: SamplingParams, rng: Rng) -> Result<Sampler> {
        Ok(Sampler { rng, ..Sampler::new(params)? })
    }

    /// The random stream; `rng().state()` saves it.
    pub fn rng(&self) -> &Rng {
        &self.rng
    }

    /// Greedy sampling (the default parameters).
    pub fn greedy() -> Sampler {
        Sampler::new(SamplingParams::default()).expect("default parameters are valid")
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The distribution a draw picks from: `(token, probability)` after the
    /// temperature and the filters, renormalized, most probable first (ties:
    /// lower token first). Greedy gives the argmax with probability 1.
    pub fn probabilities(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        check_samplable(logits)?;
        Ok(self.probabilities_of_finite(logits))
    }

    /// `probabilities` of logits already checked (`check_samplable`).
    fn probabilities_of_finite(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let p = &self.params;
        if p.temperature == 0.0 || p.top_k == 1 {
            return vec![(argmax(logits) as u32, 1.0)];
        }

        // softmax(logits / temperature), in f64.
        let t = p.temperature as f64;
        let max = logits[argmax(logits)] as f64;
        let mut cand: Vec<(u32, f64)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l as f64 - max) / t).exp())).collect();
        let sum: f64 = cand.iter().map(|c| c.1).sum();
        for c in &mut cand {
            c.1 /= sum;
        }
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));

        // top-k: the k most probable, sorted.
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
        }
        cand.sort_by(order);

        // top-p over the kept tokens' renormalized mass.
        if p.top_p < 1.0 {
            let kept: f64 = cand.iter().map(|c| c.1).sum();
            let mut cum = 0.0;
            let mut n = 0;
            for c in &cand {
                cum += c.1 / kept;
                n += 1;
                if cum >= p.top_p as f64 {
                    break;
                }
            }
            cand.truncate(n);
        }

        // min-p relative to the most probable token.
        if p.min_p > 0.0 {
            let floor = p.min_p as f64 * cand[0].1;
            cand.retain(|c| c.1 >= floor);
        }

        let kept: f64 = cand.iter().map(|c| c.1).sum();
        for c in &mut cand {
            c.1 /= kept;
        }
        cand
    }

    /// Picks the next token from `logits` (one row, `vocab` values).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        check_samplable(logits)?;
        Ok(self.sample_checked(logits))
    }

    /// `sample` of logits known to be finite and not empty (a session's:
    /// the engine checked them): one scan of the vocabulary fewer per
    /// decode step.
    pub(crate) fn sample_checked(&mut self, logits: &[f32]) -> u32 {
        debug_assert!(check_samplable(logits).is_ok(), "sample_checked of unchecked logits");
        let cand = self.probabilities_of_finite(logits);
        if cand.len() == 1 {
            return cand[0].0;
        }
        let u = self.rng.next_f64();
        let mut cum = 0.0;
        for &(tok, p) in &cand {
            cum += p;
            if u < cum {
                return tok;
            }
        }
        // Rounding left the sum just below u: the last candidate. (No
        // candidate only if the logits were not finite after all: token 0
        // rather than a panic; debug builds assert above.)
        cand.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_first_nonfinite_match_plain_scans() {
        let mut rng = crate::rng::Rng::new(3);
        for n in [1usize, 7, 8, 9, 63, 64, 65, 1000, 151_936] {
            let mut x: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 1000) as f32 - 500.0).collect();
            let plain = |x: &[f32]| {
                let mut best = 0;
                for (i, &v) in x.iter().enumerate() {
                    if v > x[best] {
                        best = i;
                    }
                }
                best
            };
            // Many ties (1000 distinct values): the first index of the maximum wins.
            assert_eq!(argmax(&x), plain(&x), "n = {n}");
            assert_eq!(first_nonfinite(&x), None);
            for (bad, v) in [(n - 1, f32::NAN), (n / 2, f32::INFINITY), (n / 3, f32::NEG_INFINITY)] {
                x[bad] = v;
                let want = x.iter().position(|v| !v.is_finite());
                assert_eq!(first_nonfinite(&x), want, "n = {n}, bad at {bad}");
            }
        }
        assert_eq!(argmax(&[f32::NEG_INFINITY; 5]), 0);
    }

    fn sampler(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams { temperature, top_k, top_p, min_p, seed }).unwrap()
    }

    /// Logits whose softmax at temperature 1 is `probs`.
    fn logits_for(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let mut s = Sampler::greedy();
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 3.0]).unwrap(), 1);
        assert_eq!(s.sample(&[-5.0]).unwrap(), 0);
        assert_eq!(s.sample(&[-1.0, -1.0]).unwrap(), 0);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let logits = [0.5, 1.0, 0.99, -3.0, 1.0];
        for seed in 0..20 {
            let mut s = sampler(5.0, 1, 1.0, 0.0, seed);
            assert_eq!(s.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let run = |seed| {
            let mut s = sampler(1.0, 0, 1.0, 0.0, seed);
            (0..64).map(|_| s.sample(&logits).unwrap()).collect::<Vec<u32>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // Not degenerate: a flat-ish distribution gives many distinct tokens.
        let mut distinct = run(42);
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 10);
    }

    #[test]
    fn draws_follow_the_softmax() {
        let probs = [0.5, 0.3, 0.2];
        let logits = logits_for(&probs);
        let mut s = sampler(1.0, 0, 1.0, 0.0, 7);
        let n = 20_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        for (c, p) in counts.iter().zip(probs) {
            assert!((*c as f64 / n as f64 - p).abs() < 0.015, "{counts:?}");
        }
        // Temperature 2 flattens: p ~ sqrt(probs), renormalized.
        let s2 = sampler(2.0, 0, 1.0, 0.0, 7);
        let d = s2.probabilities(&logits).unwrap();
        let z: f64 = probs.iter().map(|p| p.sqrt()).sum();
        assert!((d[0].1 - 0.5f64.sqrt() / z).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_the_k_most_probable() {
        let logits = logits_for(&[0.1, 0.4, 0.05, 0.3, 0.15]);
        let d = sampler(1.0, 2, 1.0, 0.0, 0).probabilities(&logits).unwrap();
        let toks: Vec<u32> = d.iter().map(|c| c.0).collect();
        assert_eq!(toks, vec![1, 3]);
        assert!((d[0].1 - 4.0 / 7.0).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        let toks = |top_p| -> Vec<u32> {
            sampler(1.0, 0, top_p, 0.0, 0).probabilities(&logits).unwrap().iter().map(|c| c.0).collect()
        };
        assert_eq!(toks(0.75), vec![0, 1]);
        assert_eq!(toks(0.9), vec![0, 1, 2]);
        assert_eq!(toks(0.4), vec![0]);
        // A tiny top_p is argmax, whatever the seed.
        for seed in 0..10 {
            let mut s = sampler(1.5, 0, 1e-6, 0.0, seed);
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        // min_p 0.5: keep p >= 0.25 -> tokens 0 and 1, renormalized 5/8, 3/8.
        let s = sampler(1.0, 0, 1.0, 0.5, 3);
        let d = s.probabilities(&logits).unwrap();
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!((d[0].1 - 0.625).abs() < 1e-6 && (d[1].1 - 0.375).abs() < 1e-6);
        let mut s = s;
        let draws: Vec<u32> = (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert!(draws.iter().all(|&t| t < 2));
        assert!(draws.contains(&0) && draws.contains(&1));
    }

    #[test]
    fn invalid_params_are_rejected_with_their_value() {
        let base = SamplingParams::default();
        let cases = [
            (SamplingParams { temperature: -0.5, ..base.clone() }, "temperature -0.5"),
            (SamplingParams { temperature: f32::NAN, ..base.clone() }, "temperature NaN"),
            (SamplingParams { temperature: f32::INFINITY, ..base.clone() }, "temperature inf"),
            (SamplingParams { top_p: 0.0, ..base.clone() }, "top_p 0"),
            (SamplingParams { top_p: 1.5, ..base.clone() }, "top_p 1.5"),
            (SamplingParams { top_p: f32::NAN, ..base.clone() }, "top_p NaN"),
            (SamplingParams { min_p: -0.1, ..base.clone() }, "min_p -0.1"),
            (SamplingParams { min_p: 1.01, ..base.clone() }, "min_p 1.01"),
        ];
        for (p, want) in cases {
            match Sampler::new(p) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(want), "{m} lacks {want}"),
                other => panic!("{want}: {:?}", other.map(|s| s.params().clone())),
            }
        }
        assert!(Sampler::new(SamplingParams { min_p: 1.0, top_p: 1.0, ..base }).is_ok());
    }

    #[test]
    fn non_finite_or_empty_logits_are_errors() {
        let mut g = Sampler::greedy();
        let e = g.sample(&[0.0, f32::NAN, 1.0]).unwrap_err().to_string();
        assert!(e.contains("logit 1 is NaN"), "{e}");
        let e = sampler(1.0, 0, 1.0, 0.0, 0).sample(&[f32::INFINITY, 0.0]).unwrap_err().to_string();
        assert!(e.contains("logit 0 is inf"), "{e}");
        assert!(g.sample(&[]).is_err());
    }
}
