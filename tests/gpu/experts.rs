//! The GPU expert cache: path equivalence against the all-resident GPU
//! engine on the converted NVFP4 fixtures of both architectures (global
//! scales as the converter writes them), for every way an expert reaches a
//! kernel: a slot filled at load, a miss copied into a slot from the pack
//! or from page-locked host memory, the streaming ring (one slot, and
//! waves of several), adaptive swaps, and mapped decode (kernels reading
//! an expert in place in page-locked host memory, the step a CUDA graph). Each configuration must also show in
//! its statistics that it took the path it is there for.

use std::sync::Arc;

use strata::backend::cuda::Gpu;
use strata::engine::{Engine, EngineOptions};
use strata::experts::{ExpertCacheOptions, ExpertStats};
use strata::pack::convert::{convert, ConvertOptions};
use strata::session::SessionOptions;

use super::common::{check_close, e, GpuTest};

/// Holds each later batch of adaptive swap copies back `ms` milliseconds
/// (a `test-hooks` build; without, the held cases are skipped).
fn hold_swaps(ms: u64) {
    #[cfg(feature = "test-hooks")]
    strata::experts::gpu::hold_swaps_for(ms);
    #[cfg(not(feature = "test-hooks"))]
    let _ = ms;
}

pub const TESTS: &[GpuTest] = &[
    ("experts_cache_paths_match_the_resident_engine", cache_paths),
    ("experts_cache_budget_is_refused_by_name", budget_refused),
    ("experts_mapped_decode_in_slots_takes_the_resident_kernels", mapped_in_slots),
];

/// Relative to max |logit|. The cache runs the resident path's expert
/// kernels on the same bytes; only planned decode differs in how the top-k
/// reaches them (the routing kernel, not the routed GEMV's fused top-k, which
/// mapped decode keeps), which may reorder the softmax sum: ~1e-7, amplified
/// by the tiny random models.
const TOL: f32 = 1e-4;

fn prompt(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 131 + 7) % vocab) as u32).collect()
}

/// Prefill logits of every position (whole, and in 16-row chunks: the
/// grouped kernels) and 6 decode steps (one row: the GEMV kernels).
fn run(engine: &Engine, tokens: &[u32]) -> Result<Vec<Vec<f32>>, String> {
    let mut out = Vec::new();
    for chunk in [0, 16] {
        let opts = SessionOptions { prefill_chunk: chunk, ..Default::default() };
        out.push(engine.new_session(&opts).map_err(e)?.prefill_all(tokens).map_err(e)?);
    }
    let mut s = engine.new_session(&SessionOptions::default()).map_err(e)?;
    s.prefill(&tokens[..40]).map_err(e)?;
    for i in 0..6 {
        s.prefill(&[tokens[40 + i]]).map_err(e)?;
        out.push(s.logits().ok_or("no logits")?.to_vec());
    }
    Ok(out)
}

fn cache_paths(_gpu: &Arc<Gpu>) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    for (set, model) in [("fixtures", "a"), ("fixtures_next", "a")] {
        let root = std::path::Path::new("tests/data");
        let root = if root.is_dir() {
            root.to_path_buf()
        } else {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
        };
        let pack = dir.path().join(format!("{set}-{model}"));
        convert(&root.join(set).join(model).join("nvfp4_modelopt"), &pack, &ConvertOptions::default()).map_err(e)?;
        let cuda = || EngineOptions { devices: vec!["cuda".into()], ..Default::default() };
        let resident = Engine::load(&pack, &cuda()).map_err(e)?;
        let c = resident.config().clone();
        let (pairs, k) = (c.num_hidden_layers * c.num_experts, c.num_experts_per_tok);
        let tokens = prompt(c.vocab_size, 150);
        let want = run(&resident, &tokens)?;
        let blob = strata::pack::Pack::open(&pack).map_err(e)?.layout().stride;
        type Check = fn(&ExpertStats) -> bool;
        let swaps_half_in_host = ExpertCacheOptions {
            slots: Some(2 * k),
            ring_threshold: 2.0,
            host_budget: Some(blob * (pairs as u64 / 2 + 4)),
            adapt_every: 4,
            adapt_swaps: 2,
            ..Default::default()
        };
        let mapped_swaps = ExpertCacheOptions {
            slots: Some(2 * k),
            ring_threshold: 2.0,
            host_budget: Some(blob * (pairs as u64 + 4)),
            adapt_every: 2,
            adapt_swaps: 2,
            ..Default::default()
        };
        // (what, options, the statistics the path shows, ms each batch of swaps is held back)
        let cases: [(&str, ExpertCacheOptions, Check, u64); 9] = [
            (
                "every expert in a slot",
                ExpertCacheOptions { slots: Some(pairs), ..Default::default() },
                |s| s.misses == 0 && s.hits > 0,
                0,
            ),
            (
                "minimum slots, misses from the pack",
                ExpertCacheOptions { slots: Some(k), ring_threshold: 2.0, adapt_every: 0, ..Default::default() },
                // Prefill steps needing more experts than the slots overflow into the ring.
                |s| s.misses > s.streamed && s.evictions > 0 && s.bytes_from_pack > 0,
                0,
            ),
            (
                "a ring of one slot for every miss",
                ExpertCacheOptions { slots: Some(k), ring_slots: Some(1), ring_threshold: 0.0, ..Default::default() },
                // Hot streamed experts move from the ring into slots (device to device).
                |s| s.streamed > 0 && s.promoted > 0,
                0,
            ),
            (
                "ring waves from page-locked host memory",
                ExpertCacheOptions {
                    slots: Some(k + 1),
                    ring_slots: Some(4),
                    ring_threshold: 0.0,
                    host_budget: Some(blob * (pairs as u64 + 4)),
                    // Decode misses copied too (not read in place).
                    mapped_decode: false,
                    ..Default::default()
                },
                // Each layer's first ring waves are prefetched while the layer
                // before computes (a wrong guess, for a decode step, is
                // overwritten: both paths).
                |s| s.streamed > 0 && s.bytes_from_host > 0 && s.mapped == 0 && s.prefetched > 0,
                0,
            ),
            (
                "mapped decode: misses read in place from host memory, swaps off the critical path",
                mapped_swaps.clone(),
                |s| s.mapped > 0 && s.bytes_mapped > 0 && s.swaps > 0 && s.hits > 0,
                0,
            ),
            (
                "every expert in a slot and host swaps (mapped decode through the slots)",
                ExpertCacheOptions {
                    slots: Some(pairs),
                    host_budget: Some(blob * (pairs as u64 / 2 + 4)),
                    adapt_every: 2,
                    adapt_swaps: 2,
                    ..Default::default()
                },
                |s| s.misses == 0 && s.mapped == 0 && s.host_swaps > 0,
                0,
            ),
            (
                "adaptive swaps, half the experts in host memory",
                swaps_half_in_host.clone(),
                |s| s.swaps > 0 && s.misses > 0 && s.bytes_from_host > 0,
                0,
            ),
            // Swap copies and host fills held back 100 ms a batch (a slow
            // link, a slow disk): the next forwards start while they are in
            // flight, a step that needs a swapped-in expert waits on the
            // device for its copy alone (`swap_waits`), and copies read the
            // pack for an expert whose host buffer is still being filled. A
            // step that read a slot or a host buffer early would compute
            // with the evicted expert's weights. Slot swaps of experts in
            // no host buffer are read and queued by the filler thread (the
            // trace, STRATA_TRACE_FORWARD=1, counts them).
            (
                "adaptive swaps held in flight, planned steps",
                swaps_half_in_host,
                |s| s.swaps > 0 && s.host_swaps > 0 && s.swap_waits > 0 && s.bytes_from_host > 0,
                100,
            ),
            (
                "adaptive swaps held in flight, mapped decode and planned prefill",
                mapped_swaps,
                |s| s.swaps > 0 && s.swap_waits > 0 && s.mapped > 0,
                100,
            ),
        ];
        for (what, opts, check, hold_ms) in cases {
            let what = format!("{set}/{model}: {what}");
            if hold_ms > 0 && !cfg!(feature = "test-hooks") {
                println!("    {what}: skipped (needs a test-hooks build to hold the swaps)");
                continue;
            }
            let engine = Engine::load(&pack, &EngineOptions { expert_cache: opts, ..cuda() })
                .map_err(|x| format!("{what}: {x}"))?;
            hold_swaps(hold_ms);
            let got = run(&engine, &tokens);
            hold_swaps(0);
            let got = got?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                check_close(&format!("{what}, run {i}"), g, w, TOL)?;
            }
            let stats = engine.expert_stats().ok_or_else(|| format!("{what}: no statistics"))?;
            if !check(&stats) {
                return Err(format!("{what}: the statistics do not show the path: {stats:?}"));
            }
            // The link's copying time: measured wherever bytes were copied (the placement's at load), at a
            // rate a link can have: a unit slip gives 1000x less. (Only a lower bound: runs still in flight
            // when the statistics are read have their bytes counted but not yet their time.)
            let copied = stats.bytes_copied > 0;
            if copied != (stats.copy_ns > 0) {
                return Err(format!("{what}: {} bytes copied in {} ns", stats.bytes_copied, stats.copy_ns));
            }
            if copied && stats.bytes_copied as f64 / (stats.copy_ns as f64 * 1e-9) < 1e8 {
                return Err(format!(
                    "{what}: {} bytes copied in {} ns: too slow to be a link",
                    stats.bytes_copied, stats.copy_ns
                ));
            }
            println!("    {what}: logits within {TOL:.0e}; {stats:?}");
        }
    }
    Ok(())
}

/// A VRAM budget below one token's experts plus the ring fails at load,
/// naming the budget and the need, through Rust and the C API.
fn budget_refused(_gpu: &Arc<Gpu>) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    let c = strata::pack::synth::preset(strata::model::Arch::Qwen3Moe, "tiny").map_err(e)?;
    strata::pack::synth::synth(&c, dir.path(), &Default::default()).map_err(e)?;
    let opts = EngineOptions {
        devices: vec!["cuda".into()],
        expert_cache: ExpertCacheOptions { vram_budget: Some(1024), ..Default::default() },
        ..Default::default()
    };
    match Engine::load(dir.path(), &opts) {
        Ok(_) => return Err("a 1 KiB VRAM budget was accepted".into()),
        Err(x) if x.to_string().contains("VRAM budget") && x.to_string().contains("minimum") => {}
        Err(x) => return Err(format!("the refusal does not name the budget and the need: {x}")),
    }
    // The same through the C API's vram_budget_bytes; a budget that fits loads a cached engine.
    use std::ffi::{CStr, CString};
    use strata::ffi::{self, strata_status};
    let path = CString::new(dir.path().to_str().ok_or("path")?).map_err(e)?;
    let cuda = CString::new("cuda").map_err(e)?;
    let devices = [cuda.as_ptr(), std::ptr::null()];
    for (budget, ok) in [(1024u64, false), (64 << 20, true)] {
        // SAFETY: params is written by default_params before use; every pointer outlives the calls.
        unsafe {
            let mut p = std::mem::zeroed::<ffi::strata_engine_params>();
            let size = std::mem::size_of::<ffi::strata_engine_params>() as u32;
            if ffi::strata_engine_default_params(&mut p, size) != strata_status::STRATA_OK {
                return Err("default params".into());
            }
            p.devices = devices.as_ptr();
            p.vram_budget_bytes = budget;
            let mut engine = std::ptr::null_mut();
            let status = ffi::strata_engine_load(path.as_ptr(), &p, &mut engine);
            let msg = CStr::from_ptr(ffi::strata_last_error()).to_string_lossy().into_owned();
            ffi::strata_engine_free(engine);
            match (ok, status) {
                (true, strata_status::STRATA_OK) => {}
                (false, strata_status::STRATA_ERR_INVALID_ARGUMENT) if msg.contains("VRAM budget") => {}
                _ => return Err(format!("C API, vram_budget_bytes {budget}: {status:?} ({msg})")),
            }
        }
    }
    Ok(())
}

/// Mapped decode of a layer whose every expert is in a slot runs the
/// all-resident engine's expert kernels (the tensor-core GEMVs, where the
/// shape allows them), so its decode logits equal the resident engine's
/// bit for bit; with some experts read in place from host memory (the
/// CUDA-core GEMVs) and adaptive swaps moving them between layers (each
/// move captures the decode step again), they stay within `TOL`. A
/// synthetic pack with H and I of 256, the tensor-core GEMVs' shape.
fn mapped_in_slots(gpu: &Arc<Gpu>) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(e)?;
    let tiny = strata::pack::synth::preset(strata::model::Arch::Qwen3Moe, "tiny").map_err(e)?;
    let c = strata::model::ModelConfig { hidden_size: 256, moe_intermediate_size: 256, ..tiny };
    strata::pack::synth::synth(&c, dir.path(), &Default::default()).map_err(e)?;
    let cuda = |expert_cache| EngineOptions { devices: vec!["cuda".into()], expert_cache, ..Default::default() };
    let pairs = c.num_hidden_layers * c.num_experts;
    let blob = strata::pack::Pack::open(dir.path()).map_err(e)?.layout().stride;
    let tokens = prompt(c.vocab_size, 64);
    // 40 prompt tokens, then 24 decode steps: the logits of each.
    let decode = |engine: &Engine| -> Result<Vec<Vec<f32>>, String> {
        let mut s = engine.new_session(&SessionOptions::default()).map_err(e)?;
        s.prefill(&tokens[..40]).map_err(e)?;
        let mut out = Vec::new();
        for &t in &tokens[40..] {
            s.prefill(&[t]).map_err(e)?;
            out.push(s.logits().ok_or("no logits")?.to_vec());
        }
        Ok(out)
    };
    let want = decode(&Engine::load(dir.path(), &cuda(Default::default())).map_err(e)?)?;
    let in_slots = ExpertCacheOptions { slots: Some(pairs), ..Default::default() };
    let engine = Engine::load(dir.path(), &cuda(in_slots)).map_err(e)?;
    let got = decode(&engine)?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if let Some(j) = (0..w.len()).find(|&j| g[j].to_bits() != w[j].to_bits()) {
            return Err(format!(
                "every expert in a slot, decode step {i}: logit {j} is {} where the resident engine gives {} \
                 (tensor-core GEMVs: {})",
                g[j],
                w[j],
                gpu.tc_gemv()
            ));
        }
    }
    let stats = engine.expert_stats().ok_or("no statistics")?;
    if stats.misses != 0 || stats.hits == 0 {
        return Err(format!("every expert in a slot: {stats:?}"));
    }
    // All but three experts in slots, every expert in host memory (and room for the staging blobs), swaps
    // every 2 tokens.
    let swapping = ExpertCacheOptions {
        slots: Some(pairs - 3),
        host_budget: Some(blob * (pairs as u64 + 4)),
        adapt_every: 2,
        adapt_swaps: 2,
        ..Default::default()
    };
    let engine = Engine::load(dir.path(), &cuda(swapping)).map_err(e)?;
    let got = decode(&engine)?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        check_close(&format!("three experts in host memory, decode step {i}"), g, w, TOL)?;
    }
    let stats = engine.expert_stats().ok_or("no statistics")?;
    if stats.mapped == 0 || stats.swaps == 0 {
        return Err(format!("three experts in host memory: the path is not shown: {stats:?}"));
    }
    println!("    every expert in a slot: bit for bit; three in host memory: within {TOL:.0e}; {stats:?}");
    Ok(())
}
