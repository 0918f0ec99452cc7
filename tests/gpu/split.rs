//! The path-equivalence matrix on two (and three) logical devices of one
//! GPU (architecture invariant 1; tests/split_matrix.rs is the same matrix
//! on CPU devices): {one device; a layer split at every layer; those
//! splits with prefill help forced on; three stages with help; a split
//! with an expert cache per stage, its prefill streaming, with help off
//! and on (help while experts stream)} x
//! {qwen3_moe, qwen3_next} x {prefill lengths, a 1100-token turn after a
//! reused prefix} x {chunk sizes}, on the tiny synthetic NVFP4 packs whose
//! global scales are far from 1.
//!
//! Every path runs the same kernels on the same rows (a stage's layers, a
//! hand-off that copies the hidden state exactly, a helper that computes
//! whole row tiles of its experts), so every split path must give the
//! one-device GPU run's logits BITWISE; that run must be within the GPU
//! tolerance of the CPU reference. The cached split computes a streamed
//! step in waves and routes decode rows outside the fused GEMV, as the
//! one-device cache does (tests/gpu/experts.rs): within `CACHE_TOL` of the
//! one-device run. The decode tokens are the CPU's greedy
//! tokens, fed to every GPU run, so all runs read the same conversation.
//! On a machine with two GPUs or more, splits over `cuda:0` and `cuda:1`
//! (peer copies, help reading the peer's memory) join the matrix.
//!
//! Tiny kernels finish before the next stream starts, so a missing
//! cross-stream wait would mostly pass by timing: run the suite a second
//! time with `STRATA_SPLIT_STRESS=1` (a `test-hooks` build), which delays
//! every producing stream before each event another stream waits on.

use std::path::Path;
use std::sync::Arc;

use strata::backend::cuda::Gpu;
use strata::engine::{Engine, EngineOptions, Help};
use strata::experts::ExpertCacheOptions;
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};
use strata::sampling::Sampler;
use strata::session::{KvType, SessionOptions};

use super::common::{check_close, e, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("split_matrix_on_logical_devices", matrix),
    ("split_field_report_on_logical_devices", field_report),
    #[cfg(feature = "test-hooks")]
    ("split_nan_guard_on_every_stage", nan_guard),
];

/// As tests/gpu/model.rs: GPU logits against the CPU's, relative to
/// max |logit| (bf16 KV on both, the accurate precision).
const TOL: f32 = 5e-3;
/// A cached path against the one-device run (tests/gpu/experts.rs's).
const CACHE_TOL: f32 = 1e-4;
const DECODE_STEPS: usize = 4;

fn synth_pack(dir: &Path, arch: Arch) -> Result<usize, String> {
    let c = synth::preset(arch, "tiny").map_err(e)?;
    synth::synth(&c, dir, &SynthOptions { seed: 11, ..Default::default() }).map_err(e)?;
    let p = strata::pack::Pack::open(dir).map_err(e)?;
    let x = p.expert(0, 0).map_err(e)?;
    let g = [x.gate.global_scale, x.up.global_scale, x.down.global_scale];
    if g.iter().any(|s| (0.1..=10.0).contains(s)) {
        return Err(format!("global scales {g:?} are not far from 1"));
    }
    Ok(c.num_hidden_layers)
}

#[derive(Clone, Debug)]
struct GpuPath {
    devices: Vec<&'static str>,
    split: Option<Vec<usize>>,
    help: Help,
    /// An expert cache on each stage: the fewest slots, a ring of 4 that
    /// every miss streams through, every expert in page-locked host memory.
    cache: bool,
}

impl GpuPath {
    fn new(devices: &[&'static str], split: Option<Vec<usize>>, help: Help) -> GpuPath {
        GpuPath { devices: devices.to_vec(), split, help, cache: false }
    }

    fn cached(self) -> GpuPath {
        GpuPath { cache: true, ..self }
    }
}

fn paths(layers: usize) -> Result<Vec<GpuPath>, String> {
    let path = GpuPath::new;
    let two = ["cuda:0", "cuda:0"];
    let mut p = vec![path(&["cuda:0"], None, Help::Off)];
    for at in 1..layers {
        p.push(path(&two, Some(vec![at]), Help::Off));
        p.push(path(&two, Some(vec![at]), Help::On));
    }
    if layers >= 3 {
        // Three stages: pipelined (a middle stage both receives and sends), and helped.
        p.push(path(&["cuda:0"; 3], None, Help::Off));
        p.push(path(&["cuda:0"; 3], None, Help::On));
    }
    // A cache per stage, prefill streaming through each stage's ring; and
    // help while experts stream (each wave divided with the helper).
    p.push(path(&two, Some(vec![layers / 2]), Help::Off).cached());
    p.push(path(&two, Some(vec![layers / 2]), Help::On).cached());
    if strata::backend::cuda::device_count().map_err(e)? >= 2 {
        p.push(path(&["cuda:0", "cuda:1"], Some(vec![layers / 2]), Help::Off));
        p.push(path(&["cuda:0", "cuda:1"], Some(vec![layers / 2]), Help::On));
        p.push(path(&["cuda:0", "cuda:1"], Some(vec![layers / 2]), Help::Off).cached());
        p.push(path(&["cuda:0", "cuda:1"], Some(vec![layers / 2]), Help::On).cached());
    }
    Ok(p)
}

fn gpu_engine(dir: &Path, path: &GpuPath) -> Result<Engine, String> {
    let expert_cache = if path.cache {
        let p = strata::pack::Pack::open(dir).map_err(e)?;
        let c = p.config();
        let blob = p.layout().stride;
        ExpertCacheOptions {
            slots: Some(c.num_experts_per_tok),
            ring_slots: Some(4),
            ring_threshold: 0.0,
            // Every expert of the model, and each stage's staging (4 blobs):
            // each stage gets its staging and its layers' share of the rest.
            host_budget: Some(blob * (c.num_hidden_layers * c.num_experts + 8) as u64),
            adapt_every: 0,
            ..Default::default()
        }
    } else {
        ExpertCacheOptions::default()
    };
    let opts = EngineOptions {
        devices: path.devices.iter().map(|d| d.to_string()).collect(),
        layer_split: path.split.clone(),
        prefill_help: path.help,
        expert_cache,
        ..Default::default()
    };
    let engine = Engine::load(dir, &opts).map_err(|x| format!("{path:?}: {x}"))?;
    match engine.backend_name() {
        "cuda" => Ok(engine),
        other => Err(format!("{path:?}: the engine runs on {other}")),
    }
}

/// An engine for each path.
fn gpu_engines(dir: &Path, paths: Vec<GpuPath>) -> Result<Vec<(GpuPath, Engine)>, String> {
    paths.into_iter().map(|p| gpu_engine(dir, &p).map(|g| (p, g))).collect()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % 256).collect()
}

fn session_opts(chunk: usize) -> SessionOptions {
    SessionOptions { prefill_chunk: chunk, kv_type: KvType::Bf16, ..Default::default() }
}

/// A run: the logits after each turn's prefill and each decode step, and
/// the decode tokens of each turn.
struct Run {
    logits: Vec<Vec<f32>>,
    decoded: Vec<Vec<u32>>,
}

/// The CPU reference: each turn the whole conversation so far (reused
/// prefix) plus `n` new tokens, then greedy decoding.
fn cpu_run(e: &Engine, chunk: usize, turns: &[usize]) -> Result<Run, String> {
    let mut s = e.new_session(&session_opts(chunk)).map_err(super::common::e)?;
    let mut run = Run { logits: vec![], decoded: vec![] };
    let mut greedy = Sampler::greedy();
    for (i, &n) in turns.iter().enumerate() {
        let mut conv = s.tokens().to_vec();
        conv.extend(tokens(n, i as u32 + 1));
        s.prefill_conversation(&conv).map_err(super::common::e)?;
        run.logits.push(s.logits().unwrap().to_vec());
        let mut decoded = Vec::new();
        for _ in 0..DECODE_STEPS {
            decoded.push(s.step(&mut greedy).map_err(super::common::e)?);
            run.logits.push(s.logits().unwrap().to_vec());
        }
        run.decoded.push(decoded);
    }
    Ok(run)
}

/// The same conversation on a GPU engine, the reference's decode tokens
/// fed one at a time (each a one-row forward: the decode graph).
fn gpu_run(e: &Engine, chunk: usize, turns: &[usize], reference: &Run, what: &str) -> Result<Vec<Vec<f32>>, String> {
    let fail = |x: strata::Error| format!("{what}: {x}");
    let mut s = e.new_session(&session_opts(chunk)).map_err(fail)?;
    let mut logits = Vec::new();
    for (i, &n) in turns.iter().enumerate() {
        let mut conv = s.tokens().to_vec();
        let reused = conv.len();
        conv.extend(tokens(n, i as u32 + 1));
        let report = s.prefill_conversation(&conv).map_err(fail)?;
        if (report.reused, report.read) != (reused, n) {
            return Err(format!("{what}: turn {i} reused {} and read {}", report.reused, report.read));
        }
        logits.push(s.logits().unwrap().to_vec());
        for &t in &reference.decoded[i] {
            s.prefill(&[t]).map_err(fail)?;
            logits.push(s.logits().unwrap().to_vec());
        }
    }
    Ok(logits)
}

fn bitwise_equal(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits()))
}

/// Checks one scenario on every path; the one-device GPU run against the
/// CPU within TOL, the split paths against it bitwise.
fn check_scenario(
    cpu: &Engine,
    gpus: &[(GpuPath, Engine)],
    arch: Arch,
    chunk: usize,
    turns: &[usize],
) -> Result<(), String> {
    let reference = cpu_run(cpu, chunk, turns)?;
    let base = format!("{arch:?} turns {turns:?} chunk {chunk}");
    let one = gpu_run(&gpus[0].1, chunk, turns, &reference, &base)?;
    for (i, (g, c)) in one.iter().zip(&reference.logits).enumerate() {
        check_close(&format!("{base}: one GPU vs the CPU, logits {i}"), g, c, TOL)?;
    }
    for (path, engine) in &gpus[1..] {
        let what = format!("{base} {path:?}");
        let got = gpu_run(engine, chunk, turns, &reference, &what)?;
        if path.cache {
            for (i, (g, o)) in got.iter().zip(&one).enumerate() {
                check_close(&format!("{what}: logits {i} against the one-GPU run"), g, o, CACHE_TOL)?;
            }
            continue;
        }
        if let Some(i) = bitwise_equal(&got, &one) {
            let detail =
                check_close("", &got[i.min(got.len() - 1)], &one[i.min(one.len() - 1)], 0.0).err().unwrap_or_default();
            return Err(format!("{what}: logits {i} differ from the one-GPU run{detail}"));
        }
    }
    Ok(())
}

/// The split statistics of every path of a model of `layers` layers.
fn check_stats(gpus: &[(GpuPath, Engine)], layers: usize) -> Result<(), String> {
    for (path, engine) in &gpus[1..] {
        let stats = engine.split_stats().ok_or_else(|| format!("{path:?}: a split engine has no split stats"))?;
        let helped = path.help == Help::On;
        // Chunked prefills run pipelined unless help is forced on or the
        // stages have caches (whose steps wait for routed ids on the host).
        let pipelined = (stats.pipelined_windows > 0) != (helped || path.cache);
        let ok = pipelined
            && stats.stages.len() == path.devices.len()
            && stats.handoffs > 0
            && stats.handoff_bytes > 0
            && stats.stages.iter().all(|s| s.seconds > 0.0)
            && (stats.helped_layers > 0) == helped
            && (stats.helper_rows > 0) == helped
            // Helped steps without the cache measure both stages' speeds.
            && stats.stages.iter().all(|s| s.expert_rows_per_second.is_some() == (helped && !path.cache));
        if !ok {
            return Err(format!("{path:?}: split stats {stats:?}"));
        }
        // Each stage's cache streams from host buffers; a stage of two
        // layers or more prefetches its next layer's ring copies.
        let at = path.split.as_ref().and_then(|s| s.first().copied()).unwrap_or(layers / 2);
        let prefetching = at >= 2 || layers - at >= 2;
        match (path.cache, engine.expert_stats()) {
            (false, None) => {}
            (true, Some(x))
                if x.streamed > 0 && (x.prefetched > 0) == prefetching && x.bytes_from_host > 0 && x.hits > 0 => {}
            (_, x) => return Err(format!("{path:?}: expert cache stats {x:?}")),
        }
    }
    if gpus[0].1.split_stats().is_some() {
        return Err("the one-device engine reports split stats".into());
    }
    Ok(())
}

fn matrix(_gpu: &Arc<Gpu>) -> Result<(), String> {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let dir = tempfile::tempdir().map_err(e)?;
        let layers = synth_pack(dir.path(), arch)?;
        let cpu = Engine::load(dir.path(), &EngineOptions::default()).map_err(e)?;
        let gpus = gpu_engines(dir.path(), paths(layers)?)?;
        let scenarios: &[&[usize]] = &[&[1], &[17], &[300], &[40, 1100]];
        for &turns in scenarios {
            for chunk in [0, 64, 1000] {
                check_scenario(&cpu, &gpus, arch, chunk, turns)?;
            }
        }
        check_stats(&gpus, layers)?;
        println!("    {arch:?}: {} paths x {} scenarios x 3 chunk sizes", gpus.len(), scenarios.len());
    }
    Ok(())
}

/// The field report's scenario on two logical devices: a multi-turn
/// conversation on a split with help on, each turn adding 1024..3276
/// tokens after a reused prefix: no non-finite value, the one-GPU run's
/// logits bitwise, within the tolerance of the CPU's.
fn field_report(_gpu: &Arc<Gpu>) -> Result<(), String> {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let dir = tempfile::tempdir().map_err(e)?;
        let layers = synth_pack(dir.path(), arch)?;
        let cpu = Engine::load(dir.path(), &EngineOptions::default()).map_err(e)?;
        let gpus = gpu_engines(
            dir.path(),
            vec![
                GpuPath::new(&["cuda:0"], None, Help::Off),
                GpuPath::new(&["cuda:0", "cuda:0"], Some(vec![layers / 2]), Help::On),
            ],
        )?;
        check_scenario(&cpu, &gpus, arch, 0, &[1024, 1500, 1200])?;
        check_stats(&gpus, layers)?;
    }
    Ok(())
}

/// A NaN injected in a layer of either stage of a split fails the forward
/// with NONFINITE naming the layer and the position (the flags of the
/// stages merged), prefill and decode, and the session is as before.
#[cfg(feature = "test-hooks")]
fn nan_guard(_gpu: &Arc<Gpu>) -> Result<(), String> {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let dir = tempfile::tempdir().map_err(e)?;
        let layers = synth_pack(dir.path(), arch)?;
        let path = GpuPath::new(&["cuda:0", "cuda:0"], Some(vec![layers / 2]), Help::Off);
        let engine = gpu_engine(dir.path(), &path)?;
        let prompt = tokens(20, 3);
        for layer in [0, layers / 2 - 1, layers / 2, layers - 1] {
            let mut s = engine.new_session(&session_opts(4)).map_err(e)?;
            s.prefill(&prompt[..6]).map_err(e)?;
            let before = s.save_state();
            // Prefill (pieces of 4), then one token (a decode-size forward).
            for (pos, input) in [(9, &prompt[6..]), (6, &prompt[6..7])] {
                engine.inject_nan_at(layer, pos);
                let what = format!("{arch:?} layer {layer} position {pos}");
                let err = s.prefill(input).expect_err("an injected NaN must fail");
                let place = format!("at layer {layer}, position {pos}");
                if !matches!(err, strata::Error::NonFinite(_)) || !err.to_string().contains(&place) {
                    return Err(format!("{what}: {err}"));
                }
                if s.save_state() != before {
                    return Err(format!("{what}: the failed call changed the session"));
                }
            }
            // A later piece of a pipelined run fails: prefill_conversation
            // keeps the pieces before it, and reading on gives the bits of
            // an unbroken session.
            let mut whole = engine.new_session(&session_opts(4)).map_err(e)?;
            whole.prefill_conversation(&prompt).map_err(e)?;
            let mut s = engine.new_session(&session_opts(4)).map_err(e)?;
            engine.inject_nan_at(layer, 15);
            let what = format!("{arch:?} layer {layer}, a later piece");
            if !matches!(s.prefill_conversation(&prompt), Err(strata::Error::NonFinite(_))) {
                return Err(format!("{what}: no NONFINITE"));
            }
            if s.len() != 12 {
                return Err(format!("{what}: the session holds {} tokens, not the 12 before the piece", s.len()));
            }
            s.prefill_conversation(&prompt).map_err(e)?;
            if bitwise_equal(&[s.logits().unwrap().to_vec()], &[whole.logits().unwrap().to_vec()]).is_some() {
                return Err(format!("{what}: reading on differs from an unbroken session"));
            }
        }
    }
    Ok(())
}
