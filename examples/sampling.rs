//! Host time of one sampled token: `cargo run --release --example sampling`.
//!
//! A decode step's logits come to the host and `Sampler` picks the token
//! there, so this time adds to every sampled (not greedy) step. Prints the
//! median of 7 runs of 20 draws each, per parameter set, on a 151,936-token
//! vocabulary (Qwen3's) of three shapes: model-like (a Gaussian bulk, one
//! token in 7919 far above it), flat (uniform in [-10, 10]) and synth (a
//! Gaussian of standard deviation ~0.9, as a random model's logits).

use strata::rng::Rng;
use strata::sampling::{Sampler, SamplingParams};

fn main() {
    let vocab = 151_936;
    let mut rng = Rng::new(7);
    let mut uniform = move || rng.next_f64() as f32;
    let model_like: Vec<f32> = (0..vocab)
        .map(|i| {
            let bulk = (uniform() + uniform() + uniform() + uniform() - 2.0) * 4.25;
            if i % 7919 == 0 {
                14.0 + 4.0 * uniform()
            } else {
                bulk
            }
        })
        .collect();
    let flat: Vec<f32> = (0..vocab).map(|_| 20.0 * uniform() - 10.0).collect();
    // A random (synthetic) model's logits: a Gaussian of standard deviation
    // about 0.9 and nothing far above it, so the weights crowd into few
    // buckets near the top (`strata synth` packs: what `strata bench` samples).
    let synth: Vec<f32> = (0..vocab).map(|_| (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.56).collect();
    let sets = [
        ("greedy", 0.0, 0, 1.0, 0.0),
        ("T 0.7, top-p 0.9", 0.7, 0, 0.9, 0.0),
        ("T 0.7, top-k 40, top-p 0.95", 0.7, 40, 0.95, 0.0),
        ("T 1", 1.0, 0, 1.0, 0.0),
        ("T 0.7, min-p 0.05", 0.7, 0, 1.0, 0.05),
        // Near-flat weights: most of the vocabulary in one bucket.
        ("T 1000", 1000.0, 0, 1.0, 0.0),
        ("T 1000, top-p 0.9", 1000.0, 0, 0.9, 0.0),
    ];
    for (shape, logits) in [("model-like", &model_like), ("flat", &flat), ("synth", &synth)] {
        for (name, temperature, top_k, top_p, min_p) in sets {
            let params = SamplingParams { temperature, top_k, top_p, min_p, seed: 1 };
            let mut sampler = Sampler::new(params).expect("valid parameters");
            let mut runs: Vec<f64> = (0..7)
                .map(|_| {
                    let start = std::time::Instant::now();
                    for _ in 0..20 {
                        std::hint::black_box(sampler.sample(logits).expect("finite logits"));
                    }
                    start.elapsed().as_secs_f64() / 20.0
                })
                .collect();
            runs.sort_by(f64::total_cmp);
            println!("{shape:>10}  {name:<28} {:8.1} us a token", runs[3] * 1e6);
        }
    }
}
