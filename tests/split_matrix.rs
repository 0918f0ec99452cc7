//! The path-equivalence matrix on CPU devices (architecture invariant 1):
//! {one device; a layer split at every possible layer; those splits with
//! prefill help forced on; three stages, pipelined and helped; a split,
//! with and without help, while experts stream through the expert cache's
//! ring} x {qwen3_moe, qwen3_next} x
//! {prefill lengths, a 1024..3276-token turn after a reused prefix} x
//! {chunk sizes}. Tiny synthetic NVFP4 packs whose global scales are far
//! from 1 (`pack::synth`), so a dropped scale cannot hide. On the CPU every
//! row is computed by the same arithmetic whichever stage runs it, so the
//! logits must be BITWISE equal to the one-device engine's, the greedy
//! tokens identical, and nothing non-finite.

use std::path::Path;

use strata::engine::{Engine, EngineOptions, Help};
use strata::experts::ExpertCacheOptions;
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};
use strata::sampling::Sampler;
use strata::session::{Session, SessionOptions};

const DECODE_STEPS: usize = 4;

fn synth_pack(dir: &Path, arch: Arch) -> usize {
    let c = synth::preset(arch, "tiny").unwrap();
    synth::synth(&c, dir, &SynthOptions { seed: 11, ..Default::default() }).unwrap();
    let p = strata::pack::Pack::open(dir).unwrap();
    let e = p.expert(0, 0).unwrap();
    let g = [e.gate.global_scale, e.up.global_scale, e.down.global_scale];
    assert!(g.iter().all(|&s| !(0.1..=10.0).contains(&s)), "global scales {g:?} are not far from 1");
    c.num_hidden_layers
}

/// A path of the matrix: devices, split points, help, and whether experts
/// go through the expert cache (top_k slots, every miss streamed through a
/// ring of two).
#[derive(Clone, Debug)]
struct ExecPath {
    devices: usize,
    split: Option<Vec<usize>>,
    help: Help,
    cache: bool,
}

fn paths(layers: usize) -> Vec<ExecPath> {
    let path = |devices, split: Option<Vec<usize>>, help, cache| ExecPath { devices, split, help, cache };
    let mut p = vec![path(1, None, Help::Off, false)];
    for at in 1..layers {
        p.push(path(2, Some(vec![at]), Help::Off, false));
        p.push(path(2, Some(vec![at]), Help::On, false));
    }
    if layers >= 3 {
        // Three stages: pipelined (a middle stage both receives and sends),
        // and helped.
        p.push(path(3, None, Help::Off, false));
        p.push(path(3, None, Help::On, false));
    }
    p.push(path(2, Some(vec![layers / 2]), Help::Off, true));
    p.push(path(2, Some(vec![layers / 2]), Help::On, true));
    p
}

fn engine(dir: &Path, path: &ExecPath) -> Engine {
    let opts = EngineOptions {
        devices: vec!["cpu".into(); path.devices],
        layer_split: path.split.clone(),
        prefill_help: path.help,
        threads: Some(2),
        expert_cache: if path.cache {
            let top_k = strata::pack::Pack::open(dir).unwrap().config().num_experts_per_tok;
            ExpertCacheOptions { slots: Some(top_k), ring_slots: Some(2), ring_threshold: 0.0, ..Default::default() }
        } else {
            ExpertCacheOptions::default()
        },
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % 256).collect()
}

/// Everything a run produced: per prefill or step, the logits and the token.
#[derive(Debug, PartialEq)]
struct Trace {
    logits: Vec<Vec<f32>>,
    tokens: Vec<u32>,
}

fn decode(s: &mut Session, trace: &mut Trace) {
    let mut greedy = Sampler::greedy();
    for _ in 0..DECODE_STEPS {
        trace.tokens.push(s.step(&mut greedy).unwrap());
        trace.logits.push(s.logits().unwrap().to_vec());
    }
}

/// A multi-turn conversation through `prefill_conversation`: each turn is
/// the whole conversation so far (reused prefix) plus `turn` new tokens,
/// then greedy decoding.
fn conversation(e: &Engine, chunk: usize, turns: &[usize]) -> Trace {
    let mut s = e.new_session(&SessionOptions { prefill_chunk: chunk, ..Default::default() }).unwrap();
    let mut trace = Trace { logits: vec![], tokens: vec![] };
    let mut conv: Vec<u32> = Vec::new();
    for (i, &n) in turns.iter().enumerate() {
        conv = s.tokens().to_vec();
        let reused = conv.len();
        conv.extend(tokens(n, i as u32 + 1));
        let report = s.prefill_conversation(&conv).unwrap();
        assert_eq!((report.reused, report.read), (reused, n), "turn {i}");
        trace.logits.push(s.logits().unwrap().to_vec());
        decode(&mut s, &mut trace);
    }
    assert!(s.len() > conv.len());
    trace
}

fn check_trace(trace: &Trace, reference: &Trace, what: &str) {
    for l in &trace.logits {
        assert!(l.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    }
    assert_eq!(trace.tokens, reference.tokens, "{what}: greedy tokens");
    for (i, (a, b)) in trace.logits.iter().zip(&reference.logits).enumerate() {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: logits {i} are not bitwise equal");
    }
    assert_eq!(trace.logits.len(), reference.logits.len());
}

/// The matrix for one architecture: every path against the one-device
/// engine, for several prompt lengths and chunk sizes.
fn matrix(arch: Arch) {
    let dir = tempfile::tempdir().unwrap();
    let layers = synth_pack(dir.path(), arch);
    let paths = paths(layers);
    let engines: Vec<Engine> = paths.iter().map(|p| engine(dir.path(), p)).collect();
    let scenarios: &[&[usize]] = &[&[1], &[17], &[300], &[40, 1100]];
    for &turns in scenarios {
        for chunk in [0, 64, 1000] {
            let reference = conversation(&engines[0], chunk, turns);
            for (path, e) in paths.iter().zip(&engines).skip(1) {
                let what = format!("{arch:?} {path:?} turns {turns:?} chunk {chunk}");
                check_trace(&conversation(e, chunk, turns), &reference, &what);
            }
        }
    }
    for (path, e) in paths.iter().zip(&engines).skip(1) {
        let stats = e.split_stats().expect("a split engine has split stats");
        assert_eq!(stats.stages.len(), path.devices, "{path:?}");
        assert!(stats.handoffs > 0 && stats.handoff_bytes > 0, "{path:?}: {stats:?}");
        assert_eq!(stats.helped_layers > 0, path.help == Help::On, "{path:?}: {stats:?}");
        assert_eq!(stats.helper_rows > 0, path.help == Help::On, "{path:?}: {stats:?}");
        // Without forced help or the cache, the chunked prefills ran pipelined.
        assert_eq!(stats.pipelined_windows > 0, path.help != Help::On && !path.cache, "{path:?}: {stats:?}");
        // Help measured the speeds of the stages it paired (the share follows them).
        let measured = stats.stages.iter().filter(|s| s.expert_rows_per_second.is_some_and(|r| r > 0.0)).count();
        assert_eq!(measured >= 2, path.help == Help::On, "{path:?}: {stats:?}");
        let cache = e.expert_stats();
        assert_eq!(cache.is_some_and(|c| c.streamed > 0), path.cache, "{path:?}: {cache:?}");
    }
    assert!(engines[0].split_stats().is_none());
}

#[test]
fn split_matrix_qwen3_moe() {
    matrix(Arch::Qwen3Moe);
}

#[test]
fn split_matrix_qwen3_next() {
    matrix(Arch::Qwen3Next);
}

/// The field report's scenario: a multi-turn conversation on a split with
/// prefill help on, each new turn adding 1024..3276 tokens after a reused
/// prefix: no non-finite value, the one-device engine's tokens and logits.
#[test]
fn field_report_multi_turn_on_a_split_with_help() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let dir = tempfile::tempdir().unwrap();
        let layers = synth_pack(dir.path(), arch);
        let one = engine(dir.path(), &ExecPath { devices: 1, split: None, help: Help::Off, cache: false });
        let split =
            engine(dir.path(), &ExecPath { devices: 2, split: Some(vec![layers / 2]), help: Help::On, cache: false });
        let turns = [1024, 1500, 1200];
        let reference = conversation(&one, 0, &turns);
        check_trace(&conversation(&split, 0, &turns), &reference, &format!("{arch:?} field report"));
        let stats = split.split_stats().unwrap();
        assert!(stats.helper_rows > 0, "{stats:?}");
        // One hand-off per forward (2 stages): 3 prefills plus the decode steps.
        assert_eq!(stats.handoffs, (turns.len() * (1 + DECODE_STEPS)) as u64, "{stats:?}");
    }
}
