//! Whole-model tests of the CUDA engine against the CPU engine (the
//! reference): every fixture of both architectures (BF16 and NVFP4
//! checkpoints, converted to packs here), every prefill chunk size, both
//! KV types; rewinds, state round trips and the non-finite guard on the GPU.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata::backend::cuda::Gpu;
use strata::engine::{Engine, EngineOptions};
use strata::experts::ExpertCacheOptions;
use strata::pack::convert::{convert, ConvertOptions};
use strata::session::{KvType, Session, SessionOptions};

use super::common::{check_close, e, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("model_qwen3_moe_fixtures_match_the_cpu", qwen3_moe_fixtures),
    ("model_qwen3_next_fixtures_match_the_cpu", qwen3_next_fixtures),
    ("model_rewind_and_state_are_exact_on_the_gpu", rewind_and_state),
    ("model_sessions_on_threads_match_one_thread", sessions_on_threads),
    #[cfg(feature = "test-hooks")]
    ("model_nan_guard_on_the_gpu", nan_guard),
];

/// Logits of the GPU against the CPU, relative to max |logit|. The CPU
/// runs the same KV type (bf16 and int8 emulated: the same rounding of the
/// same values), and the engine uses the accurate precision (activations as
/// bf16 hi + lo, ~2^-17 relative); decode rows go through f32 GEMVs. What is
/// left is summation order and those ~1e-5 operand errors, amplified by the
/// tiny random models (they turn a 4e-3 perturbation into 20% of logits, so
/// the fast precision cannot be compared this way). A dropped scale changes
/// logits by O(1).
const TOL: f32 = 5e-3;

/// The fixtures under tests/data: relative to the working directory when
/// run from a repository root (a suite binary copied to another machine),
/// else in the tree it was built from.
fn fixture(set: &str, model: &str, layout: &str) -> PathBuf {
    let here = Path::new("tests/data");
    let root =
        if here.is_dir() { here.to_path_buf() } else { Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data") };
    root.join(set).join(model).join(layout)
}

/// The CPU engine and the GPU engine of one fixture checkpoint.
pub fn engines(set: &str, model: &str, layout: &str, dir: &Path) -> Result<(Engine, Engine), String> {
    let out = dir.join(format!("{set}-{model}-{layout}"));
    convert(&fixture(set, model, layout), &out, &ConvertOptions::default()).map_err(e)?;
    let cpu = Engine::load(&out, &EngineOptions::default()).map_err(e)?;
    let gpu = Engine::load(&out, &EngineOptions { devices: vec!["cuda".into()], ..Default::default() }).map_err(e)?;
    if gpu.backend_name() != "cuda" {
        return Err(format!("the engine runs on {}", gpu.backend_name()));
    }
    Ok((cpu, gpu))
}

pub fn prompt(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 131 + 7) % vocab) as u32).collect()
}

fn session(engine: &Engine, chunk: usize, kv: KvType) -> Result<Session, String> {
    engine.new_session(&SessionOptions { prefill_chunk: chunk, kv_type: kv, ..Default::default() }).map_err(e)
}

/// Every position's logits of a 150-token prompt (crossing several 64-token
/// chunks) for chunk sizes 0 (whole), 1, 16 and 64 and both KV types; then 8
/// greedy steps, the GPU choosing the CPU's token unless the two are within
/// the tolerance of each other.
/// The index of the largest logit (the first of equals).
fn argmax(l: &[f32]) -> usize {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b })
}

fn check_model(set: &str, model: &str, layout: &str) -> Result<(), String> {
    check_model_chunks(set, model, layout, &[0, 1, 16, 64])
}

/// `check_model` for the given prefill chunk sizes.
fn check_model_chunks(set: &str, model: &str, layout: &str, chunks: &[usize]) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    let (cpu, gpu) = engines(set, model, layout, dir.path())?;
    let vocab = cpu.config().vocab_size;
    let tokens = prompt(vocab, 150);
    for kv in [KvType::Bf16, KvType::Int8] {
        let tol = TOL;
        let want = session(&cpu, 0, kv)?.prefill_all(&tokens).map_err(e)?;
        for &chunk in chunks {
            let what = format!("{set}/{model}/{layout} kv {kv:?} chunk {chunk}");
            let got = session(&gpu, chunk, kv)?.prefill_all(&tokens).map_err(|x| format!("{what}: {x}"))?;
            check_close(&what, &got, &want, tol)?;
        }
        // Decode: the GPU's GEMV path, one token at a time.
        // Decode after a prompt read in the last (largest) chunk size.
        let chunk = chunks[chunks.len() - 1];
        let (mut c, mut g) = (session(&cpu, chunk, kv)?, session(&gpu, chunk, kv)?);
        c.prefill(&tokens[..40]).map_err(e)?;
        g.prefill(&tokens[..40]).map_err(e)?;
        for step in 0..8 {
            let (cl, gl) = (c.logits().unwrap().to_vec(), g.logits().unwrap().to_vec());
            let what = format!("{set}/{model}/{layout} kv {kv:?} step {step}");
            check_close(&what, &gl, &cl, tol)?;
            let (ct, gt) = (argmax(&cl), argmax(&gl));
            let scale = cl.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if ct != gt && cl[ct] - cl[gt] > 2.0 * tol * scale {
                return Err(format!(
                    "{what}: greedy token {gt} on the GPU, {ct} on the CPU (margin {})",
                    cl[ct] - cl[gt]
                ));
            }
            c.prefill(&[ct as u32]).map_err(e)?;
            g.prefill(&[ct as u32]).map_err(e)?;
        }
    }
    println!("    {set}/{model}/{layout}: logits within {TOL:.0e} of the CPU for bf16 and int8 KV, chunks {chunks:?}, 8 steps");
    Ok(())
}

/// qwen3_moe fixture b is chaotic under any perturbation of its f32
/// arithmetic: its routing has near-ties that a 1e-5 relative change of the
/// CPU's own matmul outputs flips (measured: 2 to 88 of 150 rows then move
/// by more than 1e-3 of max |logit|, depending on the noise). The GPU's f32
/// GEMV path (pieces of up to 8 rows) reproduces it within 5e-3; the
/// tensor-core paths of larger pieces (hi/lo operands, ~1e-5) cannot, so b
/// is compared at chunks 1 and 8 and in decode, a at every chunk size.
fn qwen3_moe_fixtures(_gpu: &Arc<Gpu>) -> Result<(), String> {
    for layout in ["bf16", "nvfp4_modelopt", "nvfp4_ct"] {
        check_model("fixtures", "a", layout)?;
        check_model_chunks("fixtures", "b", layout, &[1, 8])?;
    }
    Ok(())
}

fn qwen3_next_fixtures(_gpu: &Arc<Gpu>) -> Result<(), String> {
    for model in ["a", "b"] {
        for layout in ["bf16", "nvfp4_modelopt"] {
            check_model("fixtures_next", model, layout)?;
        }
    }
    Ok(())
}

/// On the GPU, for both architectures: rewind_to between checkpoints equals
/// a fresh session fed the same tokens, and a state saved and loaded (bf16
/// KV, which round-trips exactly) continues bit for bit.
fn rewind_and_state(_gpu: &Arc<Gpu>) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    for (set, model) in [("fixtures", "a"), ("fixtures_next", "b")] {
        let (_, gpu) = engines(set, model, "nvfp4_modelopt", dir.path())?;
        let tokens = prompt(gpu.config().vocab_size, 60);
        let opts =
            SessionOptions { prefill_chunk: 16, checkpoint_every: 24, kv_type: KvType::Bf16, ..Default::default() };
        let mut s = gpu.new_session(&opts).map_err(e)?;
        s.prefill(&tokens[..10]).map_err(e)?;
        s.prefill(&tokens[10..]).map_err(e)?;
        s.rewind_to(30).map_err(e)?;
        let mut fresh = gpu.new_session(&opts).map_err(e)?;
        fresh.prefill(&tokens[..10]).map_err(e)?;
        fresh.prefill(&tokens[10..30]).map_err(e)?;
        // The rewound position may run in a piece of another size than in
        // the fresh session (qwen3_moe recomputes the last token alone):
        // other GPU kernels, the same math.
        check_close(
            &format!("{set}/{model}: rewind_to(30) vs a fresh session"),
            s.logits().unwrap(),
            fresh.logits().unwrap(),
            1e-4,
        )?;
        let state = s.save_state();
        let mut t = gpu.new_session(&opts).map_err(e)?;
        t.load_state(&state).map_err(e)?;
        let a = s.prefill(&tokens[30..45]).map_err(e)?.to_vec();
        let b = t.prefill(&tokens[30..45]).map_err(e)?.to_vec();
        if a != b {
            return Err(format!("{set}/{model}: a loaded state continues differently"));
        }
    }
    Ok(())
}

/// One session's work in `sessions_on_threads`: a prompt of its own, then
/// greedy decode steps (each a replay of a captured CUDA graph, captured
/// again when the KV grows past its first 256 positions), every step's
/// logits.
fn session_run(engine: &Engine, kv: KvType, seed: usize, steps: usize) -> Result<Vec<Vec<f32>>, String> {
    let vocab = engine.config().vocab_size;
    let tokens: Vec<u32> = (0..240 + seed).map(|i| ((i * 97 + seed * 31 + 5) % vocab) as u32).collect();
    let mut s = session(engine, 0, kv)?;
    let mut out = vec![s.prefill(&tokens).map_err(e)?.to_vec()];
    for _ in 0..steps {
        let l = &out[out.len() - 1];
        let next = argmax(l) as u32;
        out.push(s.prefill(&[next]).map_err(e)?.to_vec());
    }
    Ok(out)
}

/// Sessions of one GPU engine on several threads at once (each captures
/// its decode step while the others queue theirs on the same stream), and
/// a thread that makes, saves, loads and drops sessions meanwhile: every
/// session's logits are bit for bit those it has alone on one thread, for
/// both architectures (int8 KV on one, bf16 on the other), on one stream,
/// with an expert cache (decode mapped, swaps by its filler thread) and
/// split over two logical devices of the GPU.
fn sessions_on_threads(_gpu: &Arc<Gpu>) -> Result<(), String> {
    const THREADS: usize = 4;
    const STEPS: usize = 24;
    let dir = tempfile::tempdir().map_err(e)?;
    for (set, model, kv) in [("fixtures", "a", KvType::Int8), ("fixtures_next", "a", KvType::Bf16)] {
        let pack = dir.path().join(format!("{set}-{model}"));
        convert(&fixture(set, model, "nvfp4_modelopt"), &pack, &ConvertOptions::default()).map_err(e)?;
        let p = strata::pack::Pack::open(&pack).map_err(e)?;
        let (c, blob) = (p.config().clone(), p.layout().stride);
        let cuda = |devices: &[&str]| EngineOptions {
            devices: devices.iter().map(|d| d.to_string()).collect(),
            ..Default::default()
        };
        let cache = ExpertCacheOptions {
            slots: Some(2 * c.num_experts_per_tok),
            host_budget: Some(blob * (c.num_hidden_layers * c.num_experts + 8) as u64),
            adapt_every: 4,
            ..Default::default()
        };
        let variants = [
            ("one stream", cuda(&["cuda"])),
            ("an expert cache", EngineOptions { expert_cache: cache, ..cuda(&["cuda"]) }),
            ("a split on one GPU", cuda(&["cuda:0", "cuda:0"])),
        ];
        for (variant, opts) in variants {
            let what = format!("{set}/{model}, {variant}");
            let gpu = Engine::load(&pack, &opts).map_err(|x| format!("{what}: {x}"))?;
            let alone = (0..THREADS).map(|t| session_run(&gpu, kv, t, STEPS)).collect::<Result<Vec<_>, _>>()?;
            for round in 0..3 {
                let start = std::sync::Barrier::new(THREADS + 1);
                let done = std::sync::atomic::AtomicBool::new(false);
                let (runs, churned) = std::thread::scope(|scope| {
                    let runs: Vec<_> = (0..THREADS)
                        .map(|t| {
                            let (gpu, start) = (&gpu, &start);
                            scope.spawn(move || {
                                start.wait();
                                session_run(gpu, kv, t, STEPS)
                            })
                        })
                        .collect();
                    let churn = scope.spawn(|| -> Result<usize, String> {
                        start.wait();
                        let tokens = prompt(gpu.config().vocab_size, 9);
                        let mut n = 0;
                        while !done.load(std::sync::atomic::Ordering::Relaxed) {
                            let mut s = session(&gpu, 0, kv)?;
                            s.prefill(&tokens).map_err(e)?;
                            let mut t = session(&gpu, 0, kv)?;
                            t.load_state(&s.save_state()).map_err(e)?;
                            n += 1;
                        }
                        Ok(n)
                    });
                    let runs: Vec<_> = runs.into_iter().map(|h| h.join().expect("a session thread panicked")).collect();
                    done.store(true, std::sync::atomic::Ordering::Relaxed);
                    (runs, churn.join().expect("the churning thread panicked"))
                });
                let churned = churned.map_err(|x| format!("{what}, round {round}, the churning thread: {x}"))?;
                for (t, (run, want)) in runs.into_iter().zip(&alone).enumerate() {
                    let run = run.map_err(|x| format!("{what}, round {round}, thread {t}: {x}"))?;
                    if let Some(step) = (0..want.len()).find(|&i| run[i] != want[i]) {
                        return Err(format!(
                            "{what}, round {round}, thread {t}: step {step}'s logits differ from the same \
                             session run alone (max |diff| {})",
                            run[step].iter().zip(&want[step]).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
                        ));
                    }
                }
                println!(
                    "    {what}, round {round}: {THREADS} threads x {STEPS} steps as alone; {churned} sessions \
                     made, saved, loaded meanwhile"
                );
            }
        }
    }
    Ok(())
}

/// A NaN injected at a layer and position fails the GPU forward with
/// NONFINITE naming both, and the session is as before the call.
#[cfg(feature = "test-hooks")]
fn nan_guard(_gpu: &Arc<Gpu>) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    for (set, model) in [("fixtures", "a"), ("fixtures_next", "a")] {
        let (_, gpu) = engines(set, model, "bf16", dir.path())?;
        let tokens = prompt(gpu.config().vocab_size, 20);
        let mut s = session(&gpu, 4, KvType::Int8)?;
        s.prefill(&tokens[..6]).map_err(e)?;
        let (before, logits) = (s.save_state(), s.logits().unwrap().to_vec());
        gpu.inject_nan_at(1, 9);
        let err = s.prefill(&tokens[6..]).expect_err("an injected NaN must fail the prefill");
        let msg = err.to_string();
        if !matches!(err, strata::Error::NonFinite(_)) || !msg.contains("at layer 1, position 9") {
            return Err(format!("{set}/{model}: {msg}"));
        }
        if s.save_state() != before || s.logits() != Some(&logits[..]) {
            return Err(format!("{set}/{model}: the failed call changed the session"));
        }
        let got = s.prefill(&tokens[6..]).map_err(e)?.to_vec();
        let mut fresh = session(&gpu, 4, KvType::Int8)?;
        fresh.prefill(&tokens[..6]).map_err(e)?;
        if got != fresh.prefill(&tokens[6..]).map_err(e)? {
            return Err(format!("{set}/{model}: the retry differs from a fresh session"));
        }
    }
    Ok(())
}
