//! The sampling flags `strata generate` and `strata bench` share.

use clap::Args;

use strata::sampling::{Sampler, SamplingParams};
use strata::Result;

#[derive(Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than min_p times the most likely (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed of the random draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }

    /// A sampler of these parameters (an error names a bad one). Filters or
    /// a seed given without a temperature change nothing (decoding is
    /// greedy): a note on stderr says so.
    pub fn sampler(&self) -> Result<Sampler> {
        let sampler = Sampler::new(self.params())?;
        let unused: Vec<&str> = [
            ("--top-k", self.top_k != 0),
            ("--top-p", self.top_p != 1.0),
            ("--min-p", self.min_p != 0.0),
            ("--seed", self.seed != 0),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect();
        if self.temperature == 0.0 && !unused.is_empty() {
            eprintln!("strata: {} without --temperature: decoding is greedy, they change nothing", unused.join(", "));
        }
        Ok(sampler)
    }
}
