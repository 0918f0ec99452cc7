//! GPU tests of the draw on the device (kernels/sampling.cu): the same
//! token as the host's sampler (`sampling::pick_with`) for every parameter
//! set, logit shape and random number tried, and sampled sessions whose
//! steps take the device's draws.

use std::sync::Arc;

use strata::backend::cuda::sampling::{draw, DrawScratch, DRAW_NONE};
use strata::backend::cuda::Gpu;
use strata::rng::Rng;
use strata::sampling::{pick_with, Sampler, SamplingParams};
use strata::session::SessionOptions;

use super::common::{e, rand_f32};
use super::model::{engines, prompt};

pub const TESTS: &[GpuTest] = &[
    ("sampling_device_draw_matches_the_host", device_draw_matches_the_host),
    ("sampling_sessions_take_the_device_draws", sessions_take_the_device_draws),
];

use super::common::GpuTest;

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, seed: 0 }
}

/// Logit rows of several shapes: a random model's (a Gaussian, crowded
/// buckets), a trained model's (a bulk and a few far above it), flat,
/// ties and signed zeros, a very wide range, and tiny vocabularies.
fn shapes() -> Vec<(&'static str, Vec<f32>)> {
    let big = 151_936;
    let mut rng = Rng::new(5);
    let model_like: Vec<f32> =
        (0..big).map(|i| if i % 7919 == 0 { 14.0 + 4.0 * rng.next_f32() } else { rng.normal() * 2.5 }).collect();
    let flat: Vec<f32> = (0..big).map(|_| 20.0 * rng.next_f32() - 10.0).collect();
    // Few distinct values: long runs of equal logits (the order falls to the token).
    let ties: Vec<f32> = (0..50_000).map(|i| ((i * 7919) % 13) as f32 * 0.25 - 1.0).collect();
    let zeros: Vec<f32> = (0..4099)
        .map(|i| {
            if i % 3 == 0 {
                -0.0
            } else if i % 3 == 1 {
                0.0
            } else {
                -3.0
            }
        })
        .collect();
    let wide: Vec<f32> = (0..70_001).map(|_| (rng.next_f32() - 0.9) * 400.0).collect();
    vec![
        ("synth", rand_f32(3, big, 0.9)),
        ("model-like", model_like),
        ("flat", flat),
        ("ties", ties),
        ("signed zeros", zeros),
        ("wide", wide),
        ("one token", vec![1.5]),
        ("two tokens", vec![0.25, 0.5]),
        ("seven", rand_f32(9, 7, 2.0)),
    ]
}

/// Every shape with every parameter set and several random numbers (the
/// ends of [0, 1) among them): the device's token and its use of u are
/// the host's. A dropped temperature, a cut off by one token or a draw off
/// by one unit of mass changes tokens here.
fn device_draw_matches_the_host(gpu: &Arc<Gpu>) -> Result<(), String> {
    let sets = [
        params(0.0, 0, 1.0, 0.0),
        params(0.7, 1, 1.0, 0.0),
        params(1.0, 0, 1.0, 0.0),
        params(0.7, 0, 0.9, 0.0),
        params(0.7, 40, 0.95, 0.0),
        params(0.7, 0, 1.0, 0.05),
        params(1.3, 5, 0.5, 0.2),
        params(0.05, 0, 0.999, 0.0),
        params(1000.0, 0, 1.0, 0.0),
        params(1000.0, 0, 0.9, 0.0),
        params(2.0, 1_000_000, 1.0, 1.0),
        params(0.9, 3, 1.0, 0.0),
    ];
    let mut rng = Rng::new(17);
    let (mut cases, mut used) = (0, 0);
    for (name, logits) in shapes() {
        let d_logits = gpu.upload(&logits).map_err(e)?;
        let mut scratch = DrawScratch::new(gpu, logits.len()).map_err(e)?;
        for p in &sets {
            for u in [0.0, 0.5, 1.0 - f64::EPSILON, rng.next_f64(), rng.next_f64()] {
                let (want, want_used) = pick_with(p, &logits, u).map_err(e)?;
                draw(gpu, &d_logits, p, u, &mut scratch).map_err(e)?;
                let out = gpu.download(&scratch.out).map_err(e)?;
                if out[0] == DRAW_NONE {
                    return Err(format!("{name}, {p:?}, u {u}: the device found no token"));
                }
                if (out[0], out[1] != 0) != (want, want_used) {
                    return Err(format!(
                        "{name}, {p:?}, u {u}: the device drew {} (u used: {}), the host {want} (u used: {want_used})",
                        out[0],
                        out[1] != 0
                    ));
                }
                cases += 1;
                used += want_used as usize;
            }
        }
    }
    // Most cases draw (not a run of argmaxes that would match anyway).
    if used * 2 < cases {
        return Err(format!("only {used} of {cases} cases used u"));
    }
    Ok(())
}

/// Sampled sessions on the GPU (both architectures' fixtures): every step
/// but the first after the prefill takes the device's draw, and every
/// token is the one a host sampler with the same seed picks from the
/// session's logits; a change of parameters mid-run falls back to the
/// host for one step.
fn sessions_take_the_device_draws(_gpu: &Arc<Gpu>) -> Result<(), String> {
    const STEPS: usize = 24;
    let dir = tempfile::tempdir().map_err(e)?;
    for (set, model) in [("fixtures", "a"), ("fixtures_next", "b")] {
        let (_, gpu) = engines(set, model, "nvfp4_modelopt", dir.path())?;
        let tokens = prompt(gpu.config().vocab_size, 40);
        for p in [
            SamplingParams { temperature: 1.0, seed: 3, ..Default::default() },
            SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.9, seed: 4, ..Default::default() },
            SamplingParams::default(),
        ] {
            let mut s = gpu.new_session(&SessionOptions::default()).map_err(e)?;
            s.prefill(&tokens).map_err(e)?;
            let mut shadow = Sampler::new(p.clone()).map_err(e)?;
            let mut distinct = std::collections::BTreeSet::new();
            for i in 0..STEPS {
                let want = shadow.sample(s.logits().ok_or("no logits")?).map_err(e)?;
                let got = s.step_with(&p).map_err(e)?;
                if got != want {
                    return Err(format!("{set}/{model}, {p:?}, step {i}: the session drew {got}, the host {want}"));
                }
                distinct.insert(got);
            }
            if s.device_draws() != STEPS as u64 - 1 {
                return Err(format!("{set}/{model}: {} of {STEPS} steps took the device's draw", s.device_draws()));
            }
            if !p.is_greedy() && distinct.len() < 4 {
                return Err(format!("{set}/{model}, {p:?}: only {} distinct tokens", distinct.len()));
            }
            // New parameters: the draw made for the old ones is not taken.
            let q = SamplingParams { temperature: 0.5, seed: 9, ..Default::default() };
            let mut shadow = Sampler::new(q.clone()).map_err(e)?;
            let before = s.device_draws();
            let want = shadow.sample(s.logits().ok_or("no logits")?).map_err(e)?;
            if s.step_with(&q).map_err(e)? != want || s.device_draws() != before {
                return Err(format!("{set}/{model}: a change of parameters took a stale draw"));
            }
        }
    }
    Ok(())
}
