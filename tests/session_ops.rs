//! Random sequences of every session operation (prefill, step, checkpoint,
//! rewind, rewind_to, truncate, prefill_conversation, state save and load,
//! and calls that must fail and change nothing) on both architectures and three engines (one device, a layer
//! split with prefill help, an expert cache that misses and streams),
//! against a model of what the session must hold: after each operation its
//! tokens are the model's, its logits (when it has them) those of a fresh
//! session of the one-device engine fed the same tokens, and every
//! explicit checkpoint at or below its length still rewinds exactly.

use std::collections::BTreeMap;

use strata::engine::{Engine, EngineOptions, Help};
use strata::experts::ExpertCacheOptions;
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};
use strata::rng::Rng;
use strata::sampling::SamplingParams;
use strata::session::{KvType, Session, SessionOptions};

/// Logits of a fresh session (of the same KV type) fed `tokens` in one prefill.
fn reference(engine: &Engine, kv_type: KvType, tokens: &[u32]) -> Vec<f32> {
    let mut s = engine.new_session(&SessionOptions { kv_type, ..Default::default() }).unwrap();
    s.prefill(tokens).unwrap().to_vec()
}

/// Logits within `tol` of the largest reference logit (at least 1).
#[track_caller]
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let diff = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= tol * scale, "{what}: logits differ by {diff} (scale {scale})");
}

/// The engines a sequence runs on: one device; a layer split over two CPU
/// devices with prefill help; an expert cache with one token's slots and a
/// two-slot ring (misses, evictions and streaming at every step).
fn engine_options(path: usize, top_k: usize) -> EngineOptions {
    match path {
        0 => EngineOptions { threads: Some(2), ..Default::default() },
        1 => EngineOptions {
            devices: vec!["cpu".into(); 2],
            layer_split: Some(vec![1]),
            prefill_help: Help::On,
            threads: Some(2),
            ..Default::default()
        },
        _ => EngineOptions {
            expert_cache: ExpertCacheOptions {
                slots: Some(top_k),
                ring_slots: Some(2),
                ring_threshold: 0.0,
                ..Default::default()
            },
            threads: Some(2),
            ..Default::default()
        },
    }
}

fn run(arch: Arch, seed: u64, ops: usize) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("pack");
    synth::synth(&synth::preset(arch, "tiny").unwrap(), &p, &SynthOptions::default()).unwrap();
    // Two threads everywhere: the sums' order, and so the bits, do not
    // depend on the machine's cores (see the note on ties below).
    let plain = Engine::load(&p, &engine_options(0, 0)).unwrap();
    let vocab = plain.config().vocab_size as u64;
    let mut rng = Rng::new(seed);
    let below = |n: usize, rng: &mut Rng| (rng.next_u64() % n as u64) as usize;
    let path = below(3, &mut rng);
    let engine = Engine::load(&p, &engine_options(path, plain.config().num_experts_per_tok)).unwrap();
    let opts = SessionOptions {
        context_size: 256,
        prefill_chunk: [0, 3, 7][below(3, &mut rng)],
        checkpoint_every: [0, 5][below(2, &mut rng)],
        keep_all_logits: below(2, &mut rng) == 1,
        kv_type: [KvType::Auto, KvType::Int8][below(2, &mut rng)],
        // The default (1 GiB), or a few of the tiny hybrid's checkpoints:
        // automatic ones are then evicted.
        checkpoint_budget: [0, 48 << 10][below(2, &mut rng)],
    };
    let budget = if opts.checkpoint_budget == 0 { usize::MAX } else { opts.checkpoint_budget };
    let hybrid = arch == Arch::Qwen3Next;
    #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
    let mut nans = 0;
    let mut s: Session = engine.new_session(&opts).unwrap();
    // The model: tokens, and explicit checkpoints (id -> tokens, logits).
    let mut tokens: Vec<u32> = Vec::new();
    let mut checkpoints: BTreeMap<u64, (Vec<u32>, Option<Vec<f32>>)> = BTreeMap::new();
    // Whether the session may lack logits: after a truncate that could not
    // know them (not on a hybrid: there it is a rewind_to), after a failed
    // prefill_conversation or rewind_to, and after a rewind to a
    // checkpoint taken then.
    let mut cut = false;
    let random_tokens =
        |n: usize, rng: &mut Rng| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    for i in 0..ops {
        // Operation 10, a forward that fails on a non-finite value, needs
        // the test hooks (`cargo test --features test-hooks --test session_ops`).
        let mut op = below(if cfg!(feature = "test-hooks") { 11 } else { 10 }, &mut rng);
        if tokens.len() > opts.context_size - 20 {
            op = 5; // room for what the other operations add
        }
        let what = format!("{arch:?} seed {seed} engine {path} op {i} ({op}) at {} tokens", tokens.len());
        match op {
            0 => {
                let t = random_tokens(1 + below(9, &mut rng), &mut rng);
                if tokens.len() + t.len() > 200 {
                    continue;
                }
                s.prefill(&t).unwrap();
                tokens.extend(t);
                cut = false;
            }
            1 | 2 if s.logits().is_some() => {
                let params =
                    SamplingParams { temperature: if op == 1 { 0.0 } else { 0.9 }, seed: 7, ..Default::default() };
                let before = s.logits().unwrap().to_vec();
                let t = s.step_with(&params).unwrap();
                if op == 1 {
                    let best = before.iter().enumerate().fold(0, |b, (j, &x)| if x > before[b] { j } else { b });
                    assert_eq!(t as usize, best, "{what}: greedy step");
                }
                tokens.push(t);
                cut = false;
            }
            3 if !tokens.is_empty() => {
                let id = s.checkpoint();
                checkpoints.insert(id, (tokens.clone(), s.logits().map(<[f32]>::to_vec)));
            }
            4 if !checkpoints.is_empty() => {
                let id = *checkpoints.keys().nth(below(checkpoints.len(), &mut rng)).unwrap();
                s.rewind(id).unwrap_or_else(|e| panic!("{what}: rewind {id}: {e}"));
                let (t, l) = checkpoints[&id].clone();
                assert_eq!(s.logits(), l.as_deref(), "{what}: logits after rewind are the checkpoint's");
                cut = l.is_none();
                tokens = t;
            }
            5 | 6 if !tokens.is_empty() => {
                let n = 1 + below(tokens.len(), &mut rng);
                if op == 5 {
                    s.rewind_to(n).unwrap();
                    cut = false;
                } else {
                    s.truncate(n).unwrap();
                    cut = s.logits().is_none() && !hybrid;
                }
                tokens.truncate(n);
            }
            7 => {
                // The whole conversation: a kept prefix, then a new tail.
                let keep = if tokens.is_empty() { 0 } else { below(tokens.len() + 1, &mut rng) };
                let mut conv = tokens[..keep].to_vec();
                conv.extend(random_tokens(1 + below(6, &mut rng), &mut rng));
                let common = tokens.iter().zip(&conv).take_while(|(a, b)| a == b).count();
                let r = s.prefill_conversation(&conv).unwrap();
                assert_eq!(r.reused + r.read, conv.len(), "{what}: counts");
                assert!(r.reused <= common, "{what}: reused {} of a common prefix of {common}", r.reused);
                if common < tokens.len() {
                    // Diverged: the session went back to the common prefix.
                    checkpoints.retain(|_, (t, _)| t.len() <= common);
                }
                tokens = conv;
                cut = false;
            }
            8 => {
                // Into a new session, which carries on.
                let state = s.save_state();
                let mut t = engine.new_session(&opts).unwrap();
                t.load_state(&state).unwrap();
                assert!(t.save_state() == state, "{what}: save(load(x)) != x");
                s = t;
                cut = cut && s.logits().is_none();
                // A load drops the checkpoints.
                checkpoints.clear();
            }
            9 => {
                // A bad call fails and changes nothing: the saved state (tokens,
                // KV, logits, sampler) and the checkpoints are as before.
                let (before, ids) = (s.save_state(), s.checkpoint_ids());
                let err = match below(6, &mut rng) {
                    0 => s.prefill(&[1, vocab as u32, 2]).err(),
                    1 => s.prefill(&vec![1; opts.context_size + 1 - tokens.len()]).err(),
                    2 => s.rewind(u64::MAX).err(),
                    3 => s.rewind_to(tokens.len() + 1).err(),
                    4 => s.step_with(&SamplingParams { temperature: f32::NAN, ..Default::default() }).err(),
                    _ => {
                        let mut bad = before.clone();
                        let at = below(bad.len(), &mut rng);
                        bad[at] ^= 0x40;
                        s.load_state(&bad).err()
                    }
                };
                assert!(err.is_some(), "{what}: a bad call succeeded");
                assert!(
                    s.save_state() == before && s.checkpoint_ids() == ids,
                    "{what}: a failed call changed the session"
                );
            }
            #[cfg(feature = "test-hooks")]
            10 if !tokens.is_empty() => {
                // A NaN at a random layer of a position the call runs. prefill
                // and step are all or nothing; prefill_conversation and
                // rewind_to keep a consistent prefix (checked below: tokens
                // and logits as a fresh session's).
                let layer = below(engine.config().num_hidden_layers, &mut rng);
                let (before, ids) = (s.save_state(), s.checkpoint_ids());
                // prefill, step (a rewind_to when there are no logits to step
                // from), prefill_conversation, rewind_to.
                let kind = match below(4, &mut rng) {
                    1 if s.logits().is_none() => 3,
                    k => k,
                };
                let mut conv = Vec::new();
                let r = match kind {
                    0 => {
                        let t = random_tokens(1 + below(6, &mut rng), &mut rng);
                        engine.inject_nan_at(layer, tokens.len() + below(t.len(), &mut rng));
                        s.prefill(&t).map(|_| t)
                    }
                    1 => {
                        engine.inject_nan_at(layer, tokens.len());
                        s.step_with(&SamplingParams::default()).map(|t| vec![t])
                    }
                    2 => {
                        let keep = below(tokens.len() + 1, &mut rng);
                        conv = tokens[..keep].to_vec();
                        conv.extend(random_tokens(1 + below(6, &mut rng), &mut rng));
                        engine.inject_nan_at(layer, conv.len() - 1);
                        let common = tokens.iter().zip(&conv).take_while(|(a, b)| a == b).count();
                        let r = s.prefill_conversation(&conv);
                        if r.is_err() && common < tokens.len() {
                            checkpoints.retain(|_, (t, _)| t.len() <= common);
                        }
                        r.map(|_| conv.clone())
                    }
                    _ => {
                        let n = 1 + below(tokens.len(), &mut rng);
                        engine.inject_nan_at(layer, n - 1);
                        s.rewind_to(n).map(|_| tokens[..n].to_vec())
                    }
                };
                engine.inject_nan_at(0, usize::MAX); // disarmed if it did not fire

                // prefill and step run the poisoned position: they must fail.
                assert!(kind >= 2 || r.is_err(), "{what}: kind {kind}: the NaN did not fail the call");
                match r {
                    Ok(t) if kind < 2 => {
                        tokens.extend(t);
                        cut = false;
                    }
                    Ok(t) => {
                        tokens = t;
                        cut = false;
                    }
                    Err(e) => {
                        assert!(matches!(e, strata::Error::NonFinite(_)), "{what}: {e}");
                        nans += 1;
                        if kind < 2 {
                            // Automatic checkpoints the call took may have
                            // evicted older automatic ones (the budget is
                            // hard); the explicit ones are all there.
                            let explicit = |s: &Session, ids: &[u64]| -> Vec<u64> {
                                ids.iter()
                                    .copied()
                                    .filter(|&id| s.checkpoint_info(id).is_some_and(|c| !c.automatic))
                                    .collect()
                            };
                            assert!(
                                s.save_state() == before && explicit(&s, &s.checkpoint_ids()) == explicit(&s, &ids),
                                "{what}: kind {kind} changed"
                            );
                        } else {
                            let of = if kind == 2 { &conv } else { &tokens };
                            assert!(of.starts_with(s.tokens()), "{what}: kind {kind} left no prefix of its tokens");
                            tokens = s.tokens().to_vec();
                            cut = s.logits().is_none();
                        }
                    }
                }
            }
            _ => continue,
        }
        // Explicit checkpoints past the session's length are gone.
        checkpoints.retain(|_, (t, _)| t.len() <= tokens.len());
        assert_eq!(s.tokens(), &tokens[..], "{what}: tokens");
        if let Some(l) = s.logits() {
            // An f32 cache differs from one prefill only in the order of sums
            // (chunks, steps); int8 also in which keys a chunk read quantized
            // (1.7e-4 at most over 40 seeds).
            let tol = if opts.kv_type == KvType::Int8 { 2e-3 } else { 1e-4 };
            close(l, &reference(&plain, opts.kv_type, &tokens), tol, &what);
        } else {
            assert!(tokens.is_empty() || cut, "{what}: no logits");
        }
        // Every explicit checkpoint at or below the length is still there,
        // none is past the length, and the budget holds unless only
        // explicit checkpoints are left.
        let ids = s.checkpoint_ids();
        for &id in checkpoints.keys() {
            assert!(ids.contains(&id), "{what}: checkpoint {id} lost");
        }
        let infos: Vec<_> = ids.iter().map(|&id| s.checkpoint_info(id).unwrap()).collect();
        assert!(infos.iter().all(|c| c.position <= tokens.len()), "{what}: a checkpoint past the session's length");
        assert!(
            s.checkpoints_size() <= budget || infos.iter().all(|c| !c.automatic),
            "{what}: {} bytes of checkpoints over the budget of {budget}",
            s.checkpoints_size()
        );
    }
    // With the test hooks, some injected NaNs failed their calls.
    assert!(!cfg!(feature = "test-hooks") || ops < 100 || nans > 0, "{arch:?} seed {seed}: no NaN fired");
}

#[test]
fn random_operation_sequences_keep_tokens_logits_and_checkpoints() {
    // More with STRATA_SESSION_OPS_SEEDS=N (and _OPS=M, _FIRST=K): the
    // suite runs a few. A longer run can meet a token whose two best experts' router
    // logits differ by about one rounding (the random tiny model has such
    // near-ties; seed 107 with the test hooks does): paths that sum in
    // another order then route it differently and its logits differ by
    // ~1e-2. Check a failure for that before taking it for a bug.
    // (`cargo test --features test-hooks` adds failing forwards.)
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (seeds, ops) = (env("STRATA_SESSION_OPS_SEEDS", 4) as u64, env("STRATA_SESSION_OPS_OPS", 150));
    for seed in env("STRATA_SESSION_OPS_FIRST", 1) as u64..=seeds {
        run(Arch::Qwen3Moe, seed, ops);
        run(Arch::Qwen3Next, seed, ops);
    }
}
