//! The expert cache on the CPU backend (docs/expert-cache.md): the same
//! logits, bit for bit, whether each expert came from a slot, a miss copy,
//! a host buffer or the streaming ring, on both architectures; hard
//! budgets; stats; profiles from `strata profile` driving placement.

use std::path::Path;
use std::process::Command;

use strata::engine::{Engine, EngineOptions};
use strata::experts::{ExpertCacheOptions, ExpertProfile, ExpertStats};
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};
use strata::pack::Pack;
use strata::sampling::SamplingParams;
use strata::session::SessionOptions;
use strata::Error;

fn synth_pack(dir: &Path, arch: Arch, zipf: f64) {
    let c = synth::preset(arch, "tiny").unwrap();
    synth::synth(&c, dir, &SynthOptions { seed: 5, zipf, ..Default::default() }).unwrap();
}

/// Every prefill row's logits (prompt read in chunks of `chunk`), then the
/// logits of `steps` greedy decode steps; and the cache's stats.
fn run(dir: &Path, cache: ExpertCacheOptions, chunk: usize, steps: usize) -> (Vec<f32>, Vec<f32>, Option<ExpertStats>) {
    let e = Engine::load(dir, &EngineOptions { expert_cache: cache, ..Default::default() }).unwrap();
    let mut s = e.new_session(&SessionOptions { prefill_chunk: chunk, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % 250).collect();
    let prefill = s.prefill_all(&prompt).unwrap();
    let mut decode = Vec::new();
    for _ in 0..steps {
        s.step_with(&SamplingParams::default()).unwrap();
        decode.extend_from_slice(s.logits().unwrap());
    }
    (prefill, decode, e.expert_stats())
}

fn pairs(arch: Arch) -> usize {
    let c = synth::preset(arch, "tiny").unwrap();
    c.num_hidden_layers * c.num_experts
}

#[test]
fn path_equivalence_at_every_slot_count_and_through_the_ring() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let d = tempfile::tempdir().unwrap();
        synth_pack(d.path(), arch, 0.0);
        let stride = Pack::open(d.path()).unwrap().layout().stride;
        let (base_p, base_d, none) = run(d.path(), ExpertCacheOptions::default(), 8, 5);
        assert!(none.is_none(), "no cache by default");
        let n = pairs(arch);
        for pct in [100, 50, 25, 10] {
            let slots = (n * pct / 100).max(2);
            for (what, cache) in [
                (
                    "slots",
                    // A threshold above 0: steps that route to at most half the experts copy
                    // their misses into slots while there are slots to evict.
                    ExpertCacheOptions {
                        slots: Some(slots),
                        adapt_every: 4,
                        adapt_swaps: 2,
                        ring_threshold: 0.5,
                        ..Default::default()
                    },
                ),
                (
                    "slots + host",
                    ExpertCacheOptions {
                        slots: Some(slots),
                        host_budget: Some(stride * (1 + 3 * n as u64 / 4)),
                        pool_workers: 1,
                        ring_threshold: 0.5,
                        ..Default::default()
                    },
                ),
                (
                    "ring forced",
                    ExpertCacheOptions {
                        slots: Some(slots),
                        ring_slots: Some(2),
                        ring_threshold: 0.0,
                        ..Default::default()
                    },
                ),
            ] {
                let (p, dec, stats) = run(d.path(), cache, 8, 5);
                let s = stats.unwrap();
                let tag = format!("{arch:?} {pct}% ({slots} slots) {what}: {s:?}");
                assert_eq!(p, base_p, "prefill logits, {tag}");
                assert_eq!(dec, base_d, "decode logits, {tag}");
                // The paths were taken: not everything was a hit.
                match (pct, what) {
                    (100, _) => assert_eq!(s.misses, 0, "{tag}"),
                    // Hot streamed experts move from the ring into slots (whose later hits read
                    // those copies).
                    (_, "ring forced") => {
                        assert!(s.streamed > 0 && s.streamed == s.misses && s.promoted > 0, "{tag}")
                    }
                    (10, _) => assert!(s.misses > 0 && s.evictions > 0 && s.streamed > 0, "{tag}"),
                    _ => assert!(s.misses > 0, "{tag}"),
                }
                if what == "slots + host" && pct < 100 {
                    assert!(s.bytes_from_host > 0, "{tag}");
                }
                if what == "slots" && pct < 100 {
                    assert!(s.swaps > 0, "{tag}");
                }
                assert_eq!(s.tokens, 21 + 5, "{tag}");
            }
        }
    }
}

#[test]
fn a_decode_step_looks_up_each_layers_top_k_once() {
    let d = tempfile::tempdir().unwrap();
    synth_pack(d.path(), Arch::Qwen3Next, 1.0);
    let c = synth::preset(Arch::Qwen3Next, "tiny").unwrap();
    let opts = ExpertCacheOptions { slots: Some(5), ..Default::default() };
    let e = Engine::load(d.path(), &EngineOptions { expert_cache: opts, ..Default::default() }).unwrap();
    let mut s = e.new_session(&SessionOptions::default()).unwrap();
    s.prefill(&[1, 2, 3]).unwrap();
    let before = e.expert_stats().unwrap();
    for _ in 0..4 {
        s.step_with(&SamplingParams::default()).unwrap();
    }
    let after = e.expert_stats().unwrap();
    let lookups = (after.hits + after.misses) - (before.hits + before.misses);
    assert_eq!(lookups as usize, 4 * c.num_hidden_layers * c.num_experts_per_tok);
    assert_eq!(after.steps - before.steps, 4 * c.num_hidden_layers as u64);
    assert_eq!(after.tokens, 3 + 4);
    // Every miss was copied in or streamed, each copy of `used` bytes.
    let used = Pack::open(d.path()).unwrap().layout().used_len();
    let copies = (after.bytes_copied - before.bytes_copied) / used;
    assert!(copies >= after.misses - before.misses, "{before:?} {after:?}");
    // The profile counts every routed token.
    let p = e.expert_profile().unwrap();
    let routed: u64 = p.counts.iter().flatten().sum();
    assert_eq!(routed, 7 * (c.num_hidden_layers * c.num_experts_per_tok) as u64);
}

#[test]
fn budgets_are_hard_and_a_small_one_names_budget_and_need() {
    let d = tempfile::tempdir().unwrap();
    synth_pack(d.path(), Arch::Qwen3Moe, 0.0);
    let stride = Pack::open(d.path()).unwrap().layout().stride;
    let load = |cache| Engine::load(d.path(), &EngineOptions { expert_cache: cache, ..Default::default() });
    // top_k 2 + ring 4 = 6 blobs is the minimum; 5 fit after the reserve.
    let cache = ExpertCacheOptions {
        vram_budget: Some(stride * 6),
        vram_reserve: stride,
        ring_slots: Some(4),
        ..Default::default()
    };
    let err = load(cache.clone()).err().unwrap();
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidArgument(_)), "{msg}");
    assert!(msg.contains("VRAM budget") && msg.contains(&format!("({} bytes)", stride * 6)), "{msg}");
    assert!(msg.contains("the minimum is 2 slots for one token's experts + the ring: "), "{msg}");
    // The default ring shrinks to fit instead: 2 slots + a ring of 3.
    let e = load(ExpertCacheOptions { ring_slots: None, ..cache }).unwrap();
    let tiers = e.expert_tiers();
    assert_eq!((tiers.len(), tiers[0].slots, tiers[0].ring_slots), (1, 2, 3));
    e.new_session(&SessionOptions::default()).unwrap().prefill(&[4, 5, 6]).unwrap();
    // Explicit slots beyond the budget are refused too.
    let cache = ExpertCacheOptions {
        slots: Some(8),
        vram_budget: Some(stride * 11),
        ring_slots: Some(4),
        ..Default::default()
    };
    let msg = load(cache).err().unwrap().to_string();
    assert!(msg.contains("8 slots + 4 ring slots") && msg.contains(&format!("({} bytes)", stride * 12)), "{msg}");
    let cache = ExpertCacheOptions { slots: Some(1), ..Default::default() };
    assert!(load(cache).err().unwrap().to_string().contains("1 slots; the minimum is 2"));
    let cache = ExpertCacheOptions { slots: Some(2), host_budget: Some(stride), pool_workers: 4, ..Default::default() };
    let msg = load(cache).err().unwrap().to_string();
    assert!(
        msg.contains("host budget") && msg.contains(&format!("({} bytes) for 4 staging blobs", stride * 4)),
        "{msg}"
    );
    // 6 blobs after the reserve load and run with 2 slots (and the default ring of 4).
    let cache = ExpertCacheOptions { vram_budget: Some(stride * 7), vram_reserve: stride, ..Default::default() };
    let e = load(cache).unwrap();
    e.new_session(&SessionOptions::default()).unwrap().prefill(&[4, 5, 6]).unwrap();
    // Each copy (2 initial slots, then one per miss) moves one blob's used bytes.
    let s = e.expert_stats().unwrap();
    let used = Pack::open(d.path()).unwrap().layout().used_len();
    assert!(s.misses > 0, "{s:?}");
    assert_eq!(s.bytes_copied, (2 + s.misses) * used, "{s:?}");
}

#[test]
fn strata_profile_writes_counts_that_drive_placement() {
    let d = tempfile::tempdir().unwrap();
    let pack = d.path().join("pack");
    synth_pack(&pack, Arch::Qwen3Moe, 1.2);
    let prompts = d.path().join("prompts.txt");
    std::fs::write(&prompts, "1,2,3,4,5,6,7,8\n\n9, 10, 11, 12\n200,100,50\n").unwrap();
    let out = d.path().join("profile.json");
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["profile", "--pack", pack.to_str().unwrap(), "--prompts", prompts.to_str().unwrap()])
        .args(["-n", "4", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c = synth::preset(Arch::Qwen3Moe, "tiny").unwrap();
    let p = ExpertProfile::load(&out, &c).unwrap();
    assert_eq!(p.tokens, 8 + 4 + 3 + 3 * 4);
    for layer in &p.counts {
        assert_eq!(layer.iter().sum::<u64>(), p.tokens * c.num_experts_per_tok as u64);
    }
    // The same prompts again: placed by the profile, the cache hits more
    // than placed by its opposite (no adaptive swaps to repair either).
    let max = *p.counts.iter().flatten().max().unwrap();
    let anti =
        ExpertProfile { counts: p.counts.iter().map(|l| l.iter().map(|&n| max - n).collect()).collect(), ..p.clone() };
    let anti_path = d.path().join("anti.json");
    anti.save(&anti_path).unwrap();
    let hits = |profile: Option<&Path>| {
        let cache = ExpertCacheOptions {
            slots: Some(4),
            adapt_every: 0,
            profile: profile.map(Into::into),
            ..Default::default()
        };
        let e = Engine::load(&pack, &EngineOptions { expert_cache: cache, ..Default::default() }).unwrap();
        for prompt in [&[1u32, 2, 3, 4, 5, 6, 7, 8][..], &[9, 10, 11, 12], &[200, 100, 50]] {
            let mut s = e.new_session(&SessionOptions::default()).unwrap();
            s.prefill(prompt).unwrap();
            for _ in 0..4 {
                s.step_with(&SamplingParams::default()).unwrap();
            }
        }
        e.expert_stats().unwrap().hits
    };
    let (good, bad, default) = (hits(Some(&out)), hits(Some(&anti_path)), hits(None));
    assert!(good > bad, "profile placement {good} hits, opposite {bad}");
    assert_ne!(good, default, "the default placement differs");
    // A pack that ships a profile uses it when none is given.
    std::fs::copy(&out, pack.join("expert-profile.json")).unwrap();
    assert_eq!(hits(None), good);
}
