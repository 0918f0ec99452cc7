//! The CPU engine on Qwen3-Next (hybrid Gated DeltaNet / gated attention,
//! shared expert) against transformers: tests/data/fixtures_next/{a,b},
//! both checkpoint layouts converted to packs. `logits` of the reference is
//! the NVFP4-experts model, which both layouts become after our converter.
//!
//! Tolerance: max |ours - reference| <= 5e-4 * max |reference| (transformers'
//! own f32 error vs f64 is about 5e-5 absolute).

mod common;

use std::path::{Path, PathBuf};

use common::max_diff;

use safetensors::SafeTensors;
use strata::engine::{Engine, EngineOptions};
use strata::pack::convert::{convert, ConvertOptions};
use strata::quant::f32_bytes_to_f32;
use strata::sampling::Sampler;
use strata::session::SessionOptions;

const REL_TOL: f32 = 5e-4;
const LAYOUTS: [&str; 2] = ["bf16", "nvfp4_modelopt"];

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    turn2_tokens: Vec<u32>,
    turn2_logits: Vec<f32>,
    generated: Vec<u32>,
    margins: Vec<f64>,
}

fn fixture(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures_next").join(model)
}

fn reference(model: &str) -> Reference {
    let bytes = std::fs::read(fixture(model).join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        let t = st.tensor(name).unwrap();
        match t.dtype() {
            safetensors::Dtype::I64 => {
                t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
            }
            _ => t.data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32).collect(),
        }
    };
    let floats = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        let mut v = vec![0.0; t.data().len() / 4];
        f32_bytes_to_f32(t.data(), &mut v);
        v
    };
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(model).join("reference.json")).unwrap()).unwrap();
    Reference {
        tokens: ints("tokens"),
        logits: floats("logits"),
        turn2_tokens: ints("turn2_tokens"),
        turn2_logits: floats("turn2_logits"),
        generated: json["generated"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect(),
        margins: json["generated_top2_margin"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect(),
    }
}

fn pack_of(model: &str, layout: &str, dir: &Path) -> Engine {
    let out = dir.join(format!("{model}-{layout}"));
    convert(&fixture(model).join(layout), &out, &ConvertOptions::default()).unwrap();
    Engine::load(&out, &EngineOptions::default()).unwrap()
}

fn check_logits(model: &str) {
    let r = reference(model);
    let dir = tempfile::tempdir().unwrap();
    for layout in LAYOUTS {
        let engine = pack_of(model, layout, dir.path());
        let mut s = engine.new_session(&SessionOptions::default()).unwrap();
        let logits = s.prefill_all(&r.tokens).unwrap();
        let (d, m) = max_diff(&logits, &r.logits);
        eprintln!("next {model}/{layout}: prompt max |diff| {d:.3e}, max |logit| {m:.2}, relative {:.2e}", d / m);
        assert!(d <= REL_TOL * m, "{model}/{layout}: max |diff| {d} > {REL_TOL} * {m}");
        let t2 = s.prefill_all(&r.turn2_tokens).unwrap();
        let (d2, m2) = max_diff(&t2, &r.turn2_logits);
        eprintln!("next {model}/{layout}: turn 2 max |diff| {d2:.3e}, max |logit| {m2:.2}, relative {:.2e}", d2 / m2);
        assert!(d2 <= REL_TOL * m2, "{model}/{layout} turn 2: max |diff| {d2} > {REL_TOL} * {m2}");
    }
}

#[test]
fn next_model_a_matches_transformers() {
    check_logits("a");
}

#[test]
fn next_model_b_matches_transformers() {
    check_logits("b");
}

/// Chunked prefill (1, 7, 64 tokens per forward) gives the logits of one
/// forward; greedy generation follows transformers while its margins allow.
fn check_chunks_and_greedy(model: &str) {
    let r = reference(model);
    let dir = tempfile::tempdir().unwrap();
    let engine = pack_of(model, "nvfp4_modelopt", dir.path());
    let mut whole = engine.new_session(&SessionOptions { keep_all_logits: true, ..Default::default() }).unwrap();
    let all = whole.prefill_all(&r.tokens).unwrap();
    let m = all.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for chunk in [1, 7, 64] {
        let mut s = engine.new_session(&SessionOptions { prefill_chunk: chunk, ..Default::default() }).unwrap();
        let l = s.prefill_all(&r.tokens).unwrap();
        let (d, _) = max_diff(&l, &all);
        eprintln!("next {model}: chunk {chunk} max |diff| {d:.3e} vs one forward");
        assert!(d <= 1e-5 * m, "{model}: chunk {chunk} differs by {d}");
    }
    let max_logit = r.logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut steps = r.generated.len();
    if let Some(i) = r.margins.iter().position(|&mg| mg < 2.0 * (REL_TOL * max_logit) as f64) {
        steps = steps.min(i);
    }
    eprintln!("next {model}: comparing {steps} greedy steps");
    let mut s = engine.new_session(&SessionOptions::default()).unwrap();
    s.prefill(&r.tokens).unwrap();
    let mut sampler = Sampler::greedy();
    let out: Vec<u32> = (0..steps).map(|_| s.step(&mut sampler).unwrap()).collect();
    assert_eq!(out, r.generated[..steps], "{model}: greedy tokens differ from transformers");
}

#[test]
fn next_model_a_chunks_and_greedy() {
    check_chunks_and_greedy("a");
}

#[test]
fn next_model_b_chunks_and_greedy() {
    check_chunks_and_greedy("b");
}

/// A session fed `segments` one prefill call each.
fn fed(engine: &Engine, opts: &SessionOptions, segments: &[&[u32]]) -> strata::session::Session {
    let mut s = engine.new_session(opts).unwrap();
    for seg in segments {
        s.prefill(seg).unwrap();
    }
    s
}

/// Rewinding (to a checkpoint id, or to positions on and between
/// checkpoints) and continuing gives logits bit for bit equal to a fresh
/// session fed the same tokens in the same calls.
fn check_rewind_exact(engine: &Engine, tokens: &[u32], chunk: usize) {
    let opts = SessionOptions { prefill_chunk: chunk, ..Default::default() };
    let (a, rest) = tokens.split_at(30);
    let (b, c) = rest.split_at(25);
    let mut s = fed(engine, &opts, &[a]);
    let cp = s.checkpoint();
    s.prefill(b).unwrap();
    s.prefill(c).unwrap();
    let tail = [c[0], c[3], c[1]];
    // rewind(id) then continue with b == the original run.
    s.rewind(cp).unwrap();
    assert_eq!(s.len(), 30);
    let l = s.prefill(b).unwrap().to_vec();
    assert_eq!(l, fed(engine, &opts, &[a, b]).logits().unwrap(), "rewind(id) then continue");
    s.prefill(c).unwrap();
    // Positions on a checkpoint (30, 55), between (40, 70), at 0 and the end.
    for pos in [70, 55, 40, 30, 0] {
        let mut r = fed(engine, &opts, &[a, b, c]);
        r.rewind_to(pos).unwrap();
        assert_eq!(r.len(), pos);
        let segments: Vec<&[u32]> = match pos {
            0 => vec![],
            30 => vec![a],
            40 => vec![a, &b[..10]],
            55 => vec![a, b],
            _ => vec![a, b, &c[..15]],
        };
        if pos > 0 {
            let fresh = fed(engine, &opts, &segments);
            assert_eq!(r.logits().unwrap(), fresh.logits().unwrap(), "rewind_to({pos}) logits");
        }
        let got = r.prefill(&tail).unwrap().to_vec();
        let mut fresh = fed(engine, &opts, &segments);
        assert_eq!(got, fresh.prefill(&tail).unwrap(), "rewind_to({pos}) then continue");
        let mut g = Sampler::greedy();
        let mut h = Sampler::greedy();
        for _ in 0..3 {
            assert_eq!(r.step(&mut g).unwrap(), fresh.step(&mut h).unwrap());
            assert_eq!(r.logits().unwrap(), fresh.logits().unwrap(), "rewind_to({pos}) step");
        }
    }
}

#[test]
fn next_rewind_is_exact() {
    let r = reference("a");
    let dir = tempfile::tempdir().unwrap();
    let engine = pack_of("a", "nvfp4_modelopt", dir.path());
    check_rewind_exact(&engine, &r.tokens[..100], 0);
    check_rewind_exact(&engine, &r.tokens[..100], 7);
}

#[test]
fn qwen3_moe_rewind_is_exact() {
    use strata::model::Arch;
    use strata::pack::synth::{preset, synth, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let cfg = preset(Arch::Qwen3Moe, "tiny").unwrap();
    synth(&cfg, dir.path(), &SynthOptions::default()).unwrap();
    let engine = Engine::load(dir.path(), &EngineOptions::default()).unwrap();
    let tokens: Vec<u32> = (0..100).map(|i| (i * 37 + 11) % cfg.vocab_size as u32).collect();
    check_rewind_exact(&engine, &tokens, 0);
}

#[test]
fn next_automatic_checkpoints_fit_the_budget_and_are_sized() {
    let r = reference("b");
    let dir = tempfile::tempdir().unwrap();
    let engine = pack_of("b", "nvfp4_modelopt", dir.path());
    // One automatic checkpoint (at the end of a prefill) and one explicit
    // at position 0 (no logits) give the sizes; a budget for the explicit
    // one and 8 automatic ones then keeps the 8 most recent.
    let mut probe = engine.new_session(&SessionOptions::default()).unwrap();
    let at0 = probe.checkpoint();
    probe.prefill(&r.tokens[..10]).unwrap();
    let (explicit_size, size) = (probe.checkpoint_size(at0).unwrap(), probe.checkpoint_size(at0 + 1).unwrap());
    eprintln!("next b: automatic checkpoint {size} bytes");
    let vocab = engine.config().vocab_size;
    assert_eq!(size, explicit_size + vocab * 4);
    let budget = explicit_size + 8 * size;
    let mut s = engine.new_session(&SessionOptions { checkpoint_budget: budget, ..Default::default() }).unwrap();
    let explicit = s.checkpoint();
    for t in r.tokens.chunks(10) {
        s.prefill(t).unwrap();
    }
    let ids = s.checkpoint_ids();
    assert_eq!(ids.len(), 1 + 8, "{ids:?}");
    assert_eq!(ids[0], explicit);
    let positions: Vec<usize> = ids[1..].iter().map(|&i| s.checkpoint_info(i).unwrap().position).collect();
    assert_eq!(positions, (13..=20).map(|k| k * 10).collect::<Vec<_>>());
    assert_eq!(s.checkpoints_size(), budget);
    assert_eq!(s.checkpoint_size(explicit).unwrap(), s.checkpoint_info(explicit).unwrap().size_bytes());
    // rewind_to inside the last prefill restores the automatic checkpoint
    // before it and re-reads 5 tokens: equal to a fresh session fed so.
    s.rewind_to(195).unwrap();
    let mut fresh = engine.new_session(&SessionOptions::default()).unwrap();
    for t in r.tokens[..190].chunks(10) {
        fresh.prefill(t).unwrap();
    }
    fresh.prefill(&r.tokens[190..195]).unwrap();
    assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());
}

#[test]
fn next_state_round_trip_continues_identically() {
    let r = reference("a");
    let dir = tempfile::tempdir().unwrap();
    let engine = pack_of("a", "bf16", dir.path());
    let mut s = engine.new_session(&SessionOptions::default()).unwrap();
    s.prefill(&r.tokens[..150]).unwrap();
    let state = s.save_state();
    assert_eq!(u32::from_le_bytes(state[8..12].try_into().unwrap()), strata::session::state::STATE_VERSION);
    let mut t = engine.new_session(&SessionOptions::default()).unwrap();
    t.load_state(&state).unwrap();
    assert_eq!(t.save_state(), state);
    // Loading takes an automatic checkpoint at the loaded position.
    let ids = t.checkpoint_ids();
    assert_eq!(ids.len(), 1);
    assert_eq!(t.checkpoint_info(ids[0]).unwrap().position, 150);
    let a = s.prefill(&r.tokens[150..]).unwrap().to_vec();
    let b = t.prefill(&r.tokens[150..]).unwrap().to_vec();
    assert_eq!(a, b);
    let (mut g, mut h) = (Sampler::greedy(), Sampler::greedy());
    for _ in 0..4 {
        assert_eq!(s.step(&mut g).unwrap(), t.step(&mut h).unwrap());
        assert_eq!(s.logits().unwrap(), t.logits().unwrap());
    }
    // A corrupted or version-1 header is refused and changes nothing.
    let mut v1 = state.clone();
    v1[8] = 1;
    let before = t.save_state();
    let e = t.load_state(&v1).unwrap_err().to_string();
    assert!(e.contains("version 1"), "{e}");
    assert_eq!(t.save_state(), before);
}
