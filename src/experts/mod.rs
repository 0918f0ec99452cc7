//! The expert cache: where each (layer, expert) blob lives while the model
//! runs, and which copies move it (docs/expert-cache.md).
//!
//! Three tiers, fastest first: device **slots** (a fixed count, each holding
//! one blob as laid out in the pack), **host** buffers (page-locked RAM under
//! a byte budget) and the **mapped pack** for the rest. A prefill chunk that
//! needs most experts of a layer streams the missing ones through a **ring**
//! of slots instead of churning the cache.
//!
//! The split is the one a GPU needs: `tiers::Planner` decides residency and
//! copies (device-agnostic, deterministic, no clocks), an executor carries
//! the copies out. `cpu::CpuExpertCache` is the executor of the CPU backend:
//! slots, host buffers and ring are owned byte buffers (simulated
//! capacities), so the same planner runs in CI and its logits can be
//! compared bit for bit with the all-mapped engine.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod policy;
pub mod profile;
pub mod tiers;

use std::ops::Range;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::model::ModelConfig;

pub use cpu::CpuExpertCache;
pub use policy::Policy;
pub use profile::ExpertProfile;
pub use tiers::{Planner, StepPlan};

/// One routed expert of one layer (`layer` counts the engine's main layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExpertKey {
    pub layer: usize,
    pub expert: usize,
}

impl ExpertKey {
    pub fn new(layer: usize, expert: usize) -> ExpertKey {
        ExpertKey { layer, expert }
    }
}

/// How the engine places experts. The default (no `slots`, no
/// `vram_budget`) is no cache: every expert is read from the mapped pack,
/// as before the cache existed.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertCacheOptions {
    /// Device slots, explicitly (`--expert-cache N`). With `vram_budget`
    /// too, the slots and the ring must fit in the budget.
    pub slots: Option<usize>,
    /// Bytes of device memory the cache may use (slots and ring); the slot
    /// count is what fits after `vram_reserve`.
    pub vram_budget: Option<u64>,
    /// Bytes of `vram_budget` kept free for everything else.
    pub vram_reserve: u64,
    /// Slots of the prefill ring (at least 1), counted in the VRAM budget;
    /// `None` (the default) sizes it from the cache (`default_ring`).
    pub ring_slots: Option<usize>,
    /// A step whose distinct experts exceed this fraction of the layer's
    /// experts streams its misses through the ring (0, the default: every
    /// planned step with a miss streams; above 1 only overflow uses it);
    /// otherwise its misses are copied into slots before it computes. The
    /// default is the measured crossover: on the H200 streaming was faster
    /// at every fraction a planned step reached (63-100% of 30b-a3b's
    /// experts, and skewed steps below half), and hot streamed experts are
    /// promoted into slots anyway (docs/expert-cache.md).
    pub ring_threshold: f64,
    /// Page-locked host RAM for experts (`--resident-budget`), in bytes,
    /// `pool_workers` staging blobs included; `None`: no host tier.
    pub host_budget: Option<u64>,
    /// Page-locked staging blobs for reads of the mapped pack, each held
    /// in the host budget: a batch of up to this many blobs is read at
    /// once (GPU: in pieces on the thread pool), then sent.
    pub pool_workers: usize,
    /// Adaptive swaps every this many tokens (0: never; streamed steps
    /// still promote, `adapt_swaps`).
    pub adapt_every: usize,
    /// At most this many swaps per tier per interval, and promotions of
    /// streamed experts into slots per step (0: neither).
    pub adapt_swaps: usize,
    /// Per-token decay of the use counts that rank experts (0 < d <= 1).
    pub adapt_decay: f64,
    /// Initial placement; `None`: the pack's `expert-profile.json` if it
    /// ships one, else every layer's low expert ids first.
    pub profile: Option<PathBuf>,
    /// GPU: when every expert has a page-locked host buffer (or a slot),
    /// decode steps read the experts not in a slot in place from host
    /// memory (the kernels reach it over the host link): no copy and no
    /// host round trip per layer, so the step is replayed from a CUDA
    /// graph; slots change only by adaptive swaps, off the critical path.
    /// False: decode steps are planned as prefill's are (misses streamed
    /// or copied into slots, `ring_threshold`).
    pub mapped_decode: bool,
}

impl Default for ExpertCacheOptions {
    fn default() -> Self {
        ExpertCacheOptions {
            slots: None,
            vram_budget: None,
            vram_reserve: 0,
            ring_slots: None,
            ring_threshold: 0.0,
            host_budget: None,
            pool_workers: 4,
            adapt_every: 64,
            adapt_swaps: 16,
            adapt_decay: 0.99,
            profile: None,
            mapped_decode: true,
        }
    }
}

impl ExpertCacheOptions {
    /// Whether the cache is on (slots or a VRAM budget given).
    pub fn enabled(&self) -> bool {
        self.slots.is_some() || self.vram_budget.is_some()
    }

    /// The options other than `slots` and `vram_budget` that differ from
    /// their defaults, by field name: a cache's own settings, which mean
    /// nothing without one (the engine refuses them then).
    pub fn set_without_cache(&self) -> Vec<&'static str> {
        let d = ExpertCacheOptions::default();
        [
            ("vram_reserve", self.vram_reserve != d.vram_reserve),
            ("ring_slots", self.ring_slots != d.ring_slots),
            ("ring_threshold", self.ring_threshold.to_bits() != d.ring_threshold.to_bits()),
            ("host_budget", self.host_budget != d.host_budget),
            ("pool_workers", self.pool_workers != d.pool_workers),
            ("adapt_every", self.adapt_every != d.adapt_every),
            ("adapt_swaps", self.adapt_swaps != d.adapt_swaps),
            ("adapt_decay", self.adapt_decay.to_bits() != d.adapt_decay.to_bits()),
            ("profile", self.profile != d.profile),
            ("mapped_decode", self.mapped_decode != d.mapped_decode),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }

    /// The policy part of the options, checked.
    pub fn policy(&self) -> Result<Policy> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("expert cache: {m}")));
        if !(self.adapt_decay > 0.0 && self.adapt_decay <= 1.0) {
            return bad(format!("adapt_decay {} is not in (0, 1]", self.adapt_decay));
        }
        if self.ring_threshold.is_nan() || self.ring_threshold < 0.0 {
            return bad(format!("ring_threshold {} is not a fraction >= 0", self.ring_threshold));
        }
        Ok(Policy {
            adapt_every: self.adapt_every,
            adapt_swaps: self.adapt_swaps,
            decay: self.adapt_decay,
            ring_threshold: self.ring_threshold,
        })
    }
}

/// A ring of a quarter of `slots`, at least AUTO_RING_MIN, at most one
/// layer's experts: the default's share of a cache (`default_ring`).
/// Measured on the H200 with 30b-a3b (128 experts a layer;
/// docs/performance.md), a 4096-token prefill with 614 slots (10% of the
/// experts): 0.328 s with a ring of 64, 0.333 s with 76, 0.294 s with 128;
/// with 1536 slots (25%): 0.695 s with 4, 0.313 s with 64, 0.296 s with 96,
/// 0.274 s with 128. A ring of one layer's experts holds every miss of a
/// layer, so the next layer's copies start under this one's compute.
pub fn auto_ring_slots(num_experts: usize, slots: usize) -> usize {
    num_experts.min((slots / AUTO_RING_SHARE).max(AUTO_RING_MIN)).max(1)
}

/// The share of the slots `auto_ring_slots` gives the ring (1 / this)...
const AUTO_RING_SHARE: usize = 4;
/// ... and its least size (the fixed default before).
const AUTO_RING_MIN: usize = 4;

/// The ring a cache gets when `ring_slots` is None, for `pairs` (layer,
/// expert) pairs, `explicit` slots and/or `fit` blobs of VRAM budget:
/// `auto_ring_slots` of the slots (of the budget's blobs), never more than
/// the experts the slots leave out (1 when every expert has a slot: nothing
/// streams), and within a budget never more than it leaves beside the slots
/// (the explicit ones, or at least `min_slots`). At least 1.
pub(crate) fn default_ring(
    num_experts: usize,
    pairs: usize,
    min_slots: usize,
    explicit: Option<usize>,
    fit: Option<usize>,
) -> usize {
    let ring = match (explicit.map(|n| n.min(pairs)), fit) {
        (Some(s), _) if s >= pairs => 1,
        (None, Some(f)) if f > pairs => 1,
        (Some(s), Some(f)) => auto_ring_slots(num_experts, f).min(f.saturating_sub(s.max(min_slots))).min(pairs - s),
        (None, Some(f)) => auto_ring_slots(num_experts, f).min(f.saturating_sub(min_slots)),
        (Some(s), None) => auto_ring_slots(num_experts, s).min(pairs - s),
        (None, None) => AUTO_RING_MIN, // no cache (refused by the caller)
    };
    ring.max(1)
}

/// The sizes of the tiers, in blobs, after the budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub slots: usize,
    pub ring_slots: usize,
    /// Host buffers for experts (staging excluded).
    pub host_blobs: usize,
    pub staging_blobs: usize,
    /// Bytes one slot or host buffer takes: the pack's blob stride.
    pub blob_bytes: u64,
    /// Bytes one copy moves: the blob's used bytes.
    pub copy_bytes: u64,
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB ({b} bytes)", b as f64 / (1u64 << 20) as f64)
}

impl Capacity {
    /// The tier sizes `opts` gives a model of `c` whose blobs take
    /// `blob_bytes` (stride) and copy `copy_bytes`; refuses budgets below
    /// the minimum, naming the budget and the need. The minimum: one
    /// token's experts (`num_experts_per_tok` slots) plus the ring, and
    /// the staging blobs when there is a host budget. Slots beyond one per
    /// (layer, expert) are not allocated.
    pub fn plan(opts: &ExpertCacheOptions, c: &ModelConfig, blob_bytes: u64, copy_bytes: u64) -> Result<Capacity> {
        Capacity::plan_layers(opts, c, c.num_hidden_layers, opts.host_budget, blob_bytes, copy_bytes)
    }

    /// `plan` for a cache of `layers` of the model's layers (one stage of a
    /// layer split) with `host_budget` of the host RAM.
    fn plan_layers(
        opts: &ExpertCacheOptions,
        c: &ModelConfig,
        layers: usize,
        host_budget: Option<u64>,
        blob_bytes: u64,
        copy_bytes: u64,
    ) -> Result<Capacity> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("expert cache: {m}")));
        let pairs = layers * c.num_experts;
        let top_k = c.num_experts_per_tok;
        if opts.ring_slots == Some(0) {
            return bad("ring_slots 0: the prefill ring needs at least 1 slot".into());
        }
        if let Some(r) = opts.ring_slots.filter(|&r| r > c.num_experts) {
            return bad(format!(
                "ring_slots {r} is more than one layer's {} experts (the most a ring streams)",
                c.num_experts
            ));
        }
        let min_slots = top_k;
        let avail = opts.vram_budget.map(|b| b.saturating_sub(opts.vram_reserve));
        let fit = avail.map(|a| (a / blob_bytes) as usize);
        let ring = opts.ring_slots.unwrap_or_else(|| default_ring(c.num_experts, pairs, min_slots, opts.slots, fit));
        let need = (min_slots + ring) as u64 * blob_bytes;
        let slots = match (opts.slots, opts.vram_budget) {
            (None, None) => return bad("neither slots nor vram_budget is set".into()),
            (explicit, Some(budget)) => {
                let (avail, fit) = (avail.unwrap_or(0), fit.unwrap_or(0));
                let wanted = explicit.unwrap_or(fit.saturating_sub(ring)).min(pairs);
                let used = (wanted + ring) as u64 * blob_bytes;
                if avail < need || used > avail {
                    return bad(format!(
                        "VRAM budget {} minus reserve {} leaves {}; {} slots + {ring} ring slots of {} need {} \
                         (the minimum is {min_slots} slots for one token's experts + the ring: {})",
                        mib(budget),
                        mib(opts.vram_reserve),
                        mib(avail),
                        wanted.max(min_slots),
                        mib(blob_bytes),
                        mib(used.max(need)),
                        mib(need)
                    ));
                }
                wanted
            }
            (Some(n), None) => {
                if n < min_slots {
                    return bad(format!(
                        "{n} slots; the minimum is {min_slots} (one token's experts, num_experts_per_tok)"
                    ));
                }
                n.min(pairs)
            }
        };
        let (host_blobs, staging_blobs) = match host_budget {
            None => (0, 0),
            Some(budget) => {
                let staging = opts.pool_workers as u64 * blob_bytes;
                if budget < staging {
                    return bad(format!(
                        "host budget {} is below its need of {} for {} staging blobs of {} (pool_workers)",
                        mib(budget),
                        mib(staging),
                        opts.pool_workers,
                        mib(blob_bytes)
                    ));
                }
                (((budget - staging) / blob_bytes).min(pairs as u64) as usize, opts.pool_workers)
            }
        };
        Ok(Capacity { slots, ring_slots: ring, host_blobs, staging_blobs, blob_bytes, copy_bytes })
    }
}

/// The cache `opts` asks for over `pack`'s layers `layers`: `None` when it
/// is off (a host budget or profile without it is refused); else its tier
/// sizes and the planner, with the copies of the initial placement (from
/// the profile `opts` names, else the one the pack ships, else the default
/// ranking) for an executor to carry out. The planner numbers the layers
/// from 0 (`layers.start` is its layer 0). A cache of part of the layers
/// (one stage of a split over CUDA devices: each has its own) takes the
/// budgets of `opts` as its own: the caller gives each stage its share of
/// the host budget (`stage_host_budgets`).
pub(crate) fn plan_cache(
    pack: &crate::pack::Pack,
    opts: &ExpertCacheOptions,
    layers: Range<usize>,
) -> Result<Option<(Capacity, Planner, tiers::Fills)>> {
    if !opts.enabled() {
        let set = opts.set_without_cache();
        if !set.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "expert cache: {} need a cache (slots or vram_budget)",
                set.join(", ")
            )));
        }
        return Ok(None);
    }
    let c = pack.config();
    let layout = pack.layout();
    let policy = opts.policy()?;
    if layers.is_empty() || layers.end > c.num_hidden_layers {
        return Err(Error::InvalidArgument(format!("expert cache of layers {layers:?} of {}", c.num_hidden_layers)));
    }
    let cap = Capacity::plan_layers(opts, c, layers.len(), opts.host_budget, layout.stride, layout.used_len())?;
    let shipped = pack.dir().join(profile::PACK_PROFILE_FILE);
    let profile = match &opts.profile {
        Some(p) => Some(ExpertProfile::load(p, c)?),
        None if shipped.is_file() => Some(ExpertProfile::load(&shipped, c)?),
        None => None,
    };
    let counts = profile.as_ref().map(|p| &p.counts[layers.clone()]);
    let rank = policy::ranking(layers.len(), c.num_experts, counts);
    let (planner, fills) = Planner::new(layers.len(), c.num_experts, cap, policy, &rank);
    Ok(Some((cap, planner, fills)))
}

/// The host budget of each stage's cache on a split over CUDA devices
/// (`ranges`, of a model of `layers` layers) from the engine's `total`:
/// every stage its staging blobs (`staging` bytes, `pool_workers` blobs),
/// the rest divided in proportion to the stages' layers, the rounding
/// remainder to the last stage, so that the budgets sum to `total`. (A
/// total that holds every expert and one stage's staging on one device
/// needs each further stage's staging more on a split.) A total below
/// every stage's staging is divided by layers alone (each stage's load then
/// names its shortfall).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // (CPU stages share one cache)
pub(crate) fn stage_host_budgets(total: u64, ranges: &[Range<usize>], layers: usize, staging: u64) -> Vec<u64> {
    let n = ranges.len() as u64;
    let share = |amount: u64, r: &Range<usize>| (amount as u128 * r.len() as u128 / layers.max(1) as u128) as u64;
    let (base, rest) = match total.checked_sub(n * staging) {
        Some(rest) => (staging, rest),
        None => (0, total),
    };
    let mut budgets: Vec<u64> = ranges.iter().map(|r| base + share(rest, r)).collect();
    let given: u64 = budgets.iter().sum();
    if let Some(last) = budgets.last_mut() {
        *last += total - given;
    }
    budgets
}

/// What the cache did, since load. `hits + misses` is the number of
/// (step, expert) lookups: one per distinct expert a MoE step routes to
/// (for one token, its `num_experts_per_tok` experts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    /// MoE steps planned (one per layer per forward).
    pub steps: u64,
    /// Tokens the forwards ran.
    pub tokens: u64,
    /// Lookups found in a slot.
    pub hits: u64,
    /// Lookups not in a slot: copied into one, or streamed.
    pub misses: u64,
    /// Misses streamed through the prefill ring (kept in a slot only when
    /// promoted).
    pub streamed: u64,
    /// Misses a decode step's kernels read in place from page-locked host
    /// memory (mapped decode: no copy, no host round trip).
    pub mapped: u64,
    /// Streamed misses whose ring copy was queued ahead, while the layer
    /// before computed (GPU ring prefetch). Every prefetch is in
    /// `bytes_copied` once, used or not.
    pub prefetched: u64,
    /// Streamed misses copied from their ring slot into a slot after
    /// computing (device to device; `Planner::plan_step`).
    pub promoted: u64,
    /// Slot contents replaced by a miss (copied in or promoted).
    pub evictions: u64,
    /// Slot swaps made by adaptive placement.
    pub swaps: u64,
    /// Host-buffer swaps made by adaptive placement.
    pub host_swaps: u64,
    /// Lookups found in a slot an adaptive swap was filling when the
    /// forward began (its copy not yet seen done): the step's kernels
    /// waited on the device for that copy alone, a no-op if it had
    /// finished meanwhile (GPU). Counted in `hits`.
    pub swap_waits: u64,
    /// Bytes copied into slots, the ring and host buffers (initial
    /// placement included).
    pub bytes_copied: u64,
    /// Of those, bytes read from host buffers...
    pub bytes_from_host: u64,
    /// ...and from the mapped pack.
    pub bytes_from_pack: u64,
    /// Bytes of expert blobs kernels read from host memory in place
    /// (`mapped`): over the host link, not counted in `bytes_copied`.
    pub bytes_mapped: u64,
    /// Time a step spent waiting on copies (misses and the ring), in ns.
    /// Measured, never used for a decision.
    pub wait_ns: u64,
    /// Time the host link spent copying, in ns: each run of copies queued
    /// together on the copy stream or the swap stream, from its first copy
    /// starting to its last ending (CUDA events; 0 on the CPU backend,
    /// whose copies are simulated; runs of both streams that overlap both
    /// count). `bytes_copied` over it is the link's rate while it
    /// streams. Measured, never used for a decision.
    pub copy_ns: u64,
}

impl ExpertStats {
    /// Adds the statistics of another stage's cache (a split over CUDA
    /// devices has one per stage): counts add up; the tokens are the same
    /// forwards', so they do not.
    pub fn add_stage(&mut self, o: &ExpertStats) {
        self.steps += o.steps;
        self.tokens = self.tokens.max(o.tokens);
        self.hits += o.hits;
        self.misses += o.misses;
        self.streamed += o.streamed;
        self.mapped += o.mapped;
        self.prefetched += o.prefetched;
        self.promoted += o.promoted;
        self.evictions += o.evictions;
        self.swaps += o.swaps;
        self.host_swaps += o.host_swaps;
        self.swap_waits += o.swap_waits;
        self.bytes_copied += o.bytes_copied;
        self.bytes_from_host += o.bytes_from_host;
        self.bytes_from_pack += o.bytes_from_pack;
        self.bytes_mapped += o.bytes_mapped;
        self.wait_ns += o.wait_ns;
        self.copy_ns += o.copy_ns;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_comes_from_the_budgets_and_never_exceeds_them() {
        let c = crate::pack::synth::preset(crate::model::Arch::Qwen3Moe, "tiny").unwrap(); // 2 x 8, top 2
        let (blob, copy) = (8192, 5000);
        let plan = |o: ExpertCacheOptions| Capacity::plan(&o, &c, blob, copy);
        // (budget - reserve) / blob = 10 blobs: 4 ring + 6 slots.
        let o = ExpertCacheOptions { vram_budget: Some(11 * blob + 100), vram_reserve: blob, ..Default::default() };
        let cap = plan(o).unwrap();
        assert_eq!((cap.slots, cap.ring_slots, cap.host_blobs, cap.staging_blobs), (6, 4, 0, 0));
        assert!((cap.slots + cap.ring_slots) as u64 * blob <= 11 * blob + 100 - blob);
        // More than one slot per (layer, expert) is not allocated.
        let o = ExpertCacheOptions { vram_budget: Some(100 * blob), ring_slots: Some(1), ..Default::default() };
        assert_eq!(plan(o).unwrap().slots, 16);
        assert_eq!(plan(ExpertCacheOptions { slots: Some(40), ..Default::default() }).unwrap().slots, 16);
        // Host: staging first, then whole blobs.
        let o = ExpertCacheOptions {
            slots: Some(2),
            host_budget: Some(5 * blob + blob / 2),
            pool_workers: 2,
            ..Default::default()
        };
        assert_eq!((plan(o.clone()).unwrap().host_blobs, plan(o).unwrap().staging_blobs), (3, 2));
        for bad in [
            ExpertCacheOptions { ring_slots: Some(0), slots: Some(4), ..Default::default() },
            ExpertCacheOptions { vram_budget: Some(2 * blob), ..Default::default() },
            ExpertCacheOptions { vram_budget: Some(5 * blob), ring_slots: Some(4), ..Default::default() },
            ExpertCacheOptions::default(),
        ] {
            assert!(matches!(plan(bad), Err(Error::InvalidArgument(_))));
        }
        let o = ExpertCacheOptions { slots: Some(2), adapt_decay: 0.0, ..Default::default() };
        assert!(o.policy().unwrap_err().to_string().contains("adapt_decay 0"));
    }

    #[test]
    fn the_default_ring_is_a_quarter_of_the_cache_within_one_layer_and_the_budget() {
        // 30b-a3b's 128 experts a layer: 25%, 10% and 5% of 6144 in slots, and a small cache.
        assert_eq!(auto_ring_slots(128, 1536), 128);
        assert_eq!(auto_ring_slots(128, 614), 128);
        assert_eq!(auto_ring_slots(128, 307), 76);
        assert_eq!(auto_ring_slots(128, 16), 4);
        assert_eq!(auto_ring_slots(2, 16), 2);
        let c = crate::pack::synth::preset(crate::model::Arch::Qwen3Moe, "tiny").unwrap(); // 2 x 8, top 2
        let blob = 8192;
        let plan = |o: ExpertCacheOptions| Capacity::plan(&o, &c, blob, blob).unwrap();
        let sizes = |cap: Capacity| (cap.slots, cap.ring_slots);
        // Explicit slots: the ring comes beside them, no larger than the
        // experts they leave out (16 pairs), 1 when they leave none.
        let slots = |n: usize| ExpertCacheOptions { slots: Some(n), ..Default::default() };
        assert_eq!(sizes(plan(slots(12))), (12, 4));
        assert_eq!(sizes(plan(slots(14))), (14, 2));
        assert_eq!(sizes(plan(slots(40))), (16, 1));
        // A budget: the ring leaves it the explicit slots, or the minimum (top_k = 2).
        let budget = |n: u64, slots: Option<usize>| ExpertCacheOptions {
            vram_budget: Some(n * blob),
            slots,
            ..Default::default()
        };
        assert_eq!(sizes(plan(budget(10, None))), (6, 4));
        assert_eq!(sizes(plan(budget(10, Some(8)))), (8, 2));
        assert_eq!(sizes(plan(budget(5, None))), (2, 3));
        assert_eq!(sizes(plan(budget(3, None))), (2, 1));
        // A budget that holds every expert and more: a ring of 1.
        assert_eq!(sizes(plan(budget(100, None))), (16, 1));
        assert_eq!(sizes(plan(budget(17, None))), (16, 1));
        assert_eq!(sizes(plan(budget(16, None))), (12, 4));
        // An explicit ring is kept.
        let o = ExpertCacheOptions { ring_slots: Some(7), ..budget(10, None) };
        assert_eq!(sizes(plan(o)), (3, 7));
        // Below the minimum even with a ring of 1: the message of
        // docs/expert-cache.md (30b-a3b, 12 MiB).
        let c = crate::pack::synth::preset(crate::model::Arch::Qwen3Moe, "30b-a3b").unwrap();
        let o = ExpertCacheOptions { vram_budget: Some(12 << 20), ..Default::default() };
        let e = Capacity::plan(&o, &c, 2658304, 2658304).unwrap_err().to_string();
        assert!(
            e.contains("8 slots + 1 ring slots of 2.54 MiB (2658304 bytes) need 22.82 MiB (23924736 bytes)"),
            "{e}"
        );
    }

    #[test]
    fn a_stage_cache_plans_its_layers_with_its_share_of_the_host_budget() {
        let d = tempfile::tempdir().unwrap();
        let mut c = crate::pack::synth::preset(crate::model::Arch::Qwen3Moe, "tiny").unwrap();
        c.num_hidden_layers = 4; // x 8 experts
        crate::pack::synth::synth(&c, d.path(), &Default::default()).unwrap();
        let pack = crate::pack::Pack::open(d.path()).unwrap();
        let blob = pack.layout().stride;
        // Room for 32 blobs + 1 staging blob over the whole model.
        let o = ExpertCacheOptions {
            slots: Some(100),
            host_budget: Some(33 * blob),
            pool_workers: 1,
            ..Default::default()
        };
        let (cap, planner, fills) = plan_cache(&pack, &o, 0..4).unwrap().unwrap();
        assert_eq!((cap.slots, cap.host_blobs), (32, 32));
        assert!(fills.slots.len() == 32 && fills.host.len() == 32 && planner.slot_of(ExpertKey::new(3, 7)).is_some());
        // Layers 1..3 with 17 blobs of host budget (1 staging + 16): slots
        // and host buffers only for its 16 pairs, the planner's layers 0, 1.
        let o = ExpertCacheOptions { host_budget: Some(17 * blob), ..o };
        let (cap, planner, fills) = plan_cache(&pack, &o, 1..3).unwrap().unwrap();
        assert_eq!((cap.slots, cap.host_blobs), (16, 16));
        let layers = fills.slots.iter().map(|f| f.key.layer).chain(fills.host.iter().map(|f| f.key.layer));
        assert!(layers.max() == Some(1) && fills.slots.len() == 16);
        assert!(planner.slot_of(ExpertKey::new(1, 7)).is_some());
        for bad in [2..2, 3..5] {
            assert!(matches!(plan_cache(&pack, &o, bad), Err(Error::InvalidArgument(_))));
        }
    }

    #[test]
    fn stage_statistics_add_up_but_not_their_tokens() {
        let a = ExpertStats {
            steps: 3,
            tokens: 10,
            hits: 5,
            prefetched: 2,
            bytes_copied: 100,
            copy_ns: 20,
            ..Default::default()
        };
        let b = ExpertStats {
            steps: 4,
            tokens: 10,
            misses: 7,
            wait_ns: 9,
            bytes_copied: 50,
            copy_ns: 6,
            ..Default::default()
        };
        let mut s = a;
        s.add_stage(&b);
        let want = ExpertStats {
            steps: 7,
            tokens: 10,
            hits: 5,
            misses: 7,
            prefetched: 2,
            bytes_copied: 150,
            wait_ns: 9,
            copy_ns: 26,
            ..a
        };
        assert_eq!(s, want);
    }

    #[test]
    fn stage_host_budgets_give_each_stage_its_staging_and_its_layers_share() {
        // 48 layers, a budget of every blob (48 x 128 of 10 bytes) + one device's staging (4 x 10).
        let total = 48 * 128 * 10 + 40;
        assert_eq!(stage_host_budgets(total, std::slice::from_ref(&(0..48)), 48, 40), vec![total]);
        // Two stages: each its staging, then 24 layers' blobs; the second
        // stage's staging is what the split needs more.
        let b = stage_host_budgets(total + 40, &[0..24, 24..48], 48, 40);
        assert_eq!(b, vec![24 * 128 * 10 + 40; 2]);
        // Uneven layers and a remainder: the sum is the total, the last takes the rest.
        // (800 bytes past the staging: 266 and 533, one byte left over.)
        assert_eq!(stage_host_budgets(1000, &[0..1, 1..3], 3, 100), vec![366, 634]);
        // Below every stage's staging: by layers alone.
        assert_eq!(stage_host_budgets(150, &[0..1, 1..3], 3, 100), vec![50, 100]);
    }
}
