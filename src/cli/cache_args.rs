//! The expert-cache options of `strata generate` and `strata bench`
//! (`ExpertCacheOptions`; docs/expert-cache.md), named as the field report's
//! engine names them where it has them.

use std::path::PathBuf;

use clap::Args;

use strata::error::{Error, Result};
use strata::experts::{Capacity, ExpertCacheOptions, ExpertStats};

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

#[derive(Args, Clone, Debug, Default)]
pub struct ExpertCacheArgs {
    /// Expert slots on the device (the cache is off without this or
    /// --expert-vram-budget-mib).
    #[arg(long = "expert-cache")]
    slots: Option<usize>,
    /// Device memory for the slots and the prefill ring, in MiB; the slot
    /// count is what fits.
    #[arg(long)]
    expert_vram_budget_mib: Option<f64>,
    /// MiB of that budget kept free.
    #[arg(long, default_value_t = 0.0)]
    vram_reserve_mib: f64,
    /// Page-locked host RAM for experts, in GiB (the host tier).
    #[arg(long)]
    resident_budget_gib: Option<f64>,
    /// Slots of the prefill ring (default: a quarter of the cache's
    /// slots, at least 4, at most one layer's experts and the experts the
    /// slots leave out, within the budget).
    #[arg(long)]
    ring_slots: Option<usize>,
    /// A step routing to more than this fraction of a layer's experts
    /// streams its misses through the ring instead of copying them into
    /// slots before computing (0: every step with a miss streams, the
    /// measured crossover; hot streamed experts are promoted into slots).
    #[arg(long, default_value_t = ExpertCacheOptions::default().ring_threshold)]
    ring_threshold: f64,
    /// Page-locked staging blobs for reads of the mapped pack (each in the host budget).
    #[arg(long, default_value_t = 4)]
    pool_workers: usize,
    /// Tokens between adaptive swaps (0: never).
    #[arg(long, default_value_t = 64)]
    adapt_every: usize,
    /// Most swaps per tier per interval.
    #[arg(long, default_value_t = 16)]
    adapt_swaps: usize,
    /// Per-token decay of the use counts.
    #[arg(long, default_value_t = 0.99)]
    adapt_decay: f64,
    /// Initial placement from a profile written by `strata profile`.
    #[arg(long)]
    expert_profile: Option<PathBuf>,
    /// Plan decode steps as prefill's (misses streamed or copied into
    /// slots) even when every expert is in page-locked RAM (by default
    /// decode reads them there in place).
    #[arg(long)]
    copy_decode_misses: bool,
}

/// A size in bytes from a count of `unit`s given on the command line.
fn bytes(v: f64, unit: f64) -> u64 {
    (v.max(0.0) * unit) as u64
}

impl ExpertCacheArgs {
    /// Refuses a cache's own settings given without a cache (--expert-cache
    /// or --expert-vram-budget-mib), by flag, before anything loads.
    pub fn check(&self) -> Result<()> {
        let o = self.options();
        if o.enabled() {
            return Ok(());
        }
        let flag = |field: &str| match field {
            "vram_reserve" => "--vram-reserve-mib",
            "ring_slots" => "--ring-slots",
            "ring_threshold" => "--ring-threshold",
            "host_budget" => "--resident-budget-gib",
            "pool_workers" => "--pool-workers",
            "adapt_every" => "--adapt-every",
            "adapt_swaps" => "--adapt-swaps",
            "adapt_decay" => "--adapt-decay",
            "profile" => "--expert-profile",
            "mapped_decode" => "--copy-decode-misses",
            _ => "an expert-cache option",
        };
        let set: Vec<&str> = o.set_without_cache().into_iter().map(flag).collect();
        if set.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{} set the expert cache, which is off: add --expert-cache N or --expert-vram-budget-mib M",
            set.join(", ")
        )))
    }

    pub fn options(&self) -> ExpertCacheOptions {
        ExpertCacheOptions {
            slots: self.slots,
            vram_budget: self.expert_vram_budget_mib.map(|m| bytes(m, MIB)),
            vram_reserve: bytes(self.vram_reserve_mib, MIB),
            ring_slots: self.ring_slots,
            ring_threshold: self.ring_threshold,
            host_budget: self.resident_budget_gib.map(|g| bytes(g, GIB)),
            pool_workers: self.pool_workers,
            adapt_every: self.adapt_every,
            adapt_swaps: self.adapt_swaps,
            adapt_decay: self.adapt_decay,
            profile: self.expert_profile.clone(),
            mapped_decode: !self.copy_decode_misses,
        }
    }
}

/// The planned tiers of each cache (stages in order), for the log after a
/// load: `None` without a cache.
pub fn tiers_line(caps: &[Capacity]) -> Option<String> {
    let stage = |c: &Capacity| {
        let host = match (c.host_blobs, c.staging_blobs) {
            (0, 0) => String::new(),
            (h, s) => format!(", {h} host buffers (+{s} staging)"),
        };
        let blob = match c.blob_bytes as f64 {
            b if b < MIB => format!("{:.1} KiB", b / 1024.0),
            b => format!("{:.2} MiB", b / MIB),
        };
        format!("{} slots + {} ring slots of {blob}{host}", c.slots, c.ring_slots)
    };
    (!caps.is_empty()).then(|| format!("expert cache: {}", caps.iter().map(stage).collect::<Vec<_>>().join("; ")))
}

/// One line of cache statistics for stderr.
pub fn stats_line(s: &ExpertStats) -> String {
    let lookups = s.hits + s.misses;
    format!(
        "expert cache: {} hits, {} misses ({:.1}% hits; {} streamed, {} of them prefetched and {} promoted into slots, {} read in \
         place from host memory: {:.1} MB), {} evictions, {} swaps ({} slots waited for by a step), {:.1} MB copied ({:.1} from host buffers, {:.1} from the pack), {:.3} s waiting on \
         copies",
        s.hits,
        s.misses,
        100.0 * s.hits as f64 / lookups.max(1) as f64,
        s.streamed,
        s.prefetched,
        s.promoted,
        s.mapped,
        s.bytes_mapped as f64 / 1e6,
        s.evictions,
        s.swaps + s.host_swaps,
        s.swap_waits,
        s.bytes_copied as f64 / 1e6,
        s.bytes_from_host as f64 / 1e6,
        s.bytes_from_pack as f64 / 1e6,
        s.wait_ns as f64 / 1e9
    )
}
