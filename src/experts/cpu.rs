//! The CPU executor of the tier planner: slots, host buffers and the ring
//! are owned byte buffers of the simulated capacities, filled by copying
//! blobs exactly as a GPU would (from a host buffer or the mapped pack),
//! and experts are computed from those copies. The arithmetic is the
//! backend's, so the logits equal the all-mapped engine's bit for bit.

use std::time::Instant;

use super::tiers::{Fills, Place, Planner, SlotFill, Source, StepPlan};
use super::{ExpertCacheOptions, ExpertKey, ExpertStats};
use crate::backend::{Backend, ExpertRows};
use crate::error::Result;
use crate::moe::{self, ExpertCompute, ExpertGroup, ExpertSource, MoeLayer, Routing};
use crate::pack::{ExpertLayout, ExpertView, Pack};

/// One engine's expert cache on the CPU backend.
pub struct CpuExpertCache {
    planner: Planner,
    layout: ExpertLayout,
    /// Each `layout.used_len()` bytes: a blob as laid out in the pack.
    slots: Vec<Vec<u8>>,
    host: Vec<Vec<u8>>,
    ring: Vec<Vec<u8>>,
}

/// The bytes a copy from `from` reads.
fn read<'a>(host: &'a [Vec<u8>], pack: &'a Pack, key: ExpertKey, from: Source) -> Result<&'a [u8]> {
    match from {
        Source::Host(h) => Ok(&host[h]),
        Source::Pack => Ok(pack.expert(key.layer, key.expert)?.blob),
    }
}

impl CpuExpertCache {
    /// The cache `opts` asks for over `pack` (`None` when it is off), with
    /// the initial placement copied in. Fails when a budget is below the
    /// minimum (`Capacity::plan`) or a profile does not fit the model.
    pub fn load(pack: &Pack, opts: &ExpertCacheOptions) -> Result<Option<CpuExpertCache>> {
        let Some((cap, planner, fills)) = super::plan_cache(pack, opts, 0..pack.config().num_hidden_layers)? else {
            return Ok(None);
        };
        let layout = pack.layout();
        let used = layout.used_len() as usize;
        let mut cache = CpuExpertCache {
            planner,
            layout,
            slots: vec![vec![0; used]; cap.slots],
            host: vec![vec![0; used]; cap.host_blobs],
            ring: vec![vec![0; used]; cap.ring_slots],
        };
        cache.apply(pack, &fills)?;
        Ok(Some(cache))
    }

    /// Carries out copies planned off the critical path.
    fn apply(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        for f in &fills.host {
            self.host[f.host].copy_from_slice(read(&[], pack, f.key, Source::Pack)?);
            self.planner.host_fill_done(f.host);
        }
        for f in &fills.slots {
            self.fill_slot(pack, f)?;
            self.planner.slot_fill_done(f.slot);
        }
        Ok(())
    }

    fn fill_slot(&mut self, pack: &Pack, f: &SlotFill) -> Result<()> {
        self.slots[f.slot].copy_from_slice(read(&self.host, pack, f.key, f.from)?);
        Ok(())
    }

    /// A forward of `tokens` tokens starts.
    pub fn begin_forward(&mut self, tokens: usize) {
        self.planner.begin_forward(tokens);
    }

    /// A forward ended: carries out the adaptive swaps it triggers (on a
    /// CPU they complete before the next step).
    pub fn end_forward(&mut self, pack: &Pack, tokens: usize) -> Result<()> {
        let fills = self.planner.end_forward(tokens);
        self.apply(pack, &fills)
    }

    /// The experts as the tiers hold them (slot, else host, else pack),
    /// without changing residency.
    pub fn source<'a>(&'a self, pack: &'a Pack) -> TieredSource<'a> {
        TieredSource { cache: self, pack }
    }

    /// `moe::forward` with the experts placed by the planner (`CacheCompute`).
    /// With a `helper` (another backend and the share of rows it takes),
    /// each wave's groups are cut as `moe::help_cut` cuts them and the two
    /// parts computed at the same time (prefill help while experts stream).
    /// Returns the routing and what each side of the help computed.
    pub fn moe_forward(
        &mut self,
        backend: &dyn Backend,
        helper: Option<(&dyn Backend, f64)>,
        pack: &Pack,
        layer: &MoeLayer<'_>,
        h: &[f32],
        out: &mut [f32],
    ) -> Result<(Routing, moe::HelpTiming)> {
        let mut compute = CacheCompute { cache: self, pack, helper, timing: moe::HelpTiming::default() };
        let routing = moe::forward_with(backend, &mut compute, layer, h, out)?;
        Ok((routing, compute.timing))
    }

    pub fn stats(&self) -> ExpertStats {
        self.planner.stats()
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }
}

/// The expert step of `moe::forward_with` through the cache: plans the
/// step, copies its misses into slots, then computes the groups in waves
/// (each shared with the helper, when there is one),
/// each holding at most `ring_slots` streamed experts (copied into the ring
/// before the wave computes). Without streamed experts that is one wave, the
/// pipeline's single `expert_ffn`; the backend computes each row on its own,
/// so waves give the same bits.
struct CacheCompute<'a> {
    cache: &'a mut CpuExpertCache,
    pack: &'a Pack,
    helper: Option<(&'a dyn Backend, f64)>,
    timing: moe::HelpTiming,
}

impl ExpertCompute for CacheCompute<'_> {
    fn compute(
        &mut self,
        backend: &dyn Backend,
        layer: usize,
        groups: &[ExpertGroup],
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()> {
        let routed: Vec<(usize, usize)> = groups.iter().map(|g| (g.expert, g.tokens.len())).collect();
        let plan = self.cache.planner.plan_step(layer, &routed);
        // The slots the plan fills or promotes into whose copies have not
        // run: a step that fails first leaves them empty, not holding what
        // the planner believes they hold.
        let mut pending: Vec<usize> =
            plan.fills.iter().map(|f| f.slot).chain(plan.ring.iter().filter_map(|r| r.promote)).collect();
        let r = self.compute_plan(backend, &plan, groups, x, y, &mut pending);
        if r.is_err() {
            pending.into_iter().for_each(|s| self.cache.planner.forget_slot(s));
        }
        r
    }
}

impl CacheCompute<'_> {
    /// `compute` after planning: fills, then the waves; removes each slot
    /// from `pending` once its copy is done.
    fn compute_plan(
        &mut self,
        backend: &dyn Backend,
        plan: &StepPlan,
        groups: &[ExpertGroup],
        x: &[f32],
        y: &mut [f32],
        pending: &mut Vec<usize>,
    ) -> Result<()> {
        let (cache, pack) = (&mut *self.cache, self.pack);
        let hidden = cache.layout.hidden as usize;
        let t = Instant::now();
        for f in &plan.fills {
            cache.fill_slot(pack, f)?;
            pending.retain(|&s| s != f.slot);
        }
        let mut wait = t.elapsed();
        let (mut g, mut row) = (0, 0);
        while g < groups.len() {
            let mut end = g;
            let mut streamed = 0;
            while end < groups.len() {
                if let Place::Ring(_) = plan.experts[end].1 {
                    if streamed == cache.ring.len() {
                        break;
                    }
                    streamed += 1;
                }
                end += 1;
            }
            let t = Instant::now();
            for &(e, place) in &plan.experts[g..end] {
                if let Place::Ring(n) = place {
                    let entry = plan.ring[n];
                    let key = ExpertKey::new(plan.layer, e);
                    cache.ring[entry.ring_slot].copy_from_slice(read(&cache.host, pack, key, entry.from)?);
                }
            }
            wait += t.elapsed();
            let src = cache.source(pack);
            let work = plan.experts[g..end]
                .iter()
                .zip(&groups[g..end])
                .map(|(&(e, place), grp)| {
                    let weights = match place {
                        Place::Slot { ready, .. } => {
                            assert!(ready, "CPU swaps complete between steps");
                            src.expert(plan.layer, e)?
                        }
                        Place::Ring(n) => {
                            let what =
                                format!("layer {} expert {e} in ring slot {}", plan.layer, plan.ring[n].ring_slot);
                            ExpertView::from_blob(&cache.layout, &cache.ring[plan.ring[n].ring_slot], &what)?
                        }
                    };
                    Ok(ExpertRows { weights, rows: grp.tokens.len() })
                })
                .collect::<Result<Vec<_>>>()?;
            let rows: usize = work.iter().map(|w| w.rows).sum();
            let span = row * hidden..(row + rows) * hidden;
            let (xs, ys) = (&x[span.clone()], &mut y[span]);
            match self.helper {
                None => backend.expert_ffn(&work, xs, ys),
                Some((helper, share)) => {
                    // The wave's groups and its work are in the same order.
                    let wave = &groups[g..end];
                    let (work, n) = (&work, wave.len());
                    let timing = moe::compute_helped(
                        wave,
                        share,
                        xs,
                        ys,
                        |own, x, y| {
                            backend.expert_ffn(&work[..own.len()], x, y);
                            Ok(())
                        },
                        |helped, x, y| {
                            helper.expert_ffn(&work[n - helped.len()..], x, y);
                            Ok(())
                        },
                    )?;
                    self.timing.add(timing);
                }
            }
            // Promoted experts move into their slots before a later wave
            // reuses their ring slots.
            for &(_, place) in &plan.experts[g..end] {
                if let Place::Ring(n) = place {
                    let entry = plan.ring[n];
                    if let Some(s) = entry.promote {
                        cache.slots[s].copy_from_slice(&cache.ring[entry.ring_slot]);
                        pending.retain(|&p| p != s);
                    }
                }
            }
            (g, row) = (end, row + rows);
        }
        cache.planner.record_wait(wait.as_nanos() as u64);
        Ok(())
    }
}

/// `CpuExpertCache::source`: an `ExpertSource` reading a ready slot, else
/// a host buffer, else the mapped pack.
pub struct TieredSource<'a> {
    cache: &'a CpuExpertCache,
    pack: &'a Pack,
}

impl ExpertSource for TieredSource<'_> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertView<'_>> {
        let c = self.cache;
        let key = ExpertKey::new(layer, expert);
        let (bytes, tier) = match (c.planner.slot_of(key), c.planner.host_of(key)) {
            (Some((s, true)), _) => (&c.slots[s], "slot"),
            (_, Some(h)) => (&c.host[h], "host buffer"),
            _ => return self.pack.expert(layer, expert),
        };
        ExpertView::from_blob(&c.layout, bytes, &format!("layer {layer} expert {expert} in a {tier}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    fn within(inner: &[u8], outer: &[u8]) -> bool {
        let (a, b) = (outer.as_ptr() as usize, outer.as_ptr() as usize + outer.len());
        (a..b).contains(&(inner.as_ptr() as usize))
    }

    #[test]
    fn the_source_serves_copies_from_slots_and_host_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let c = crate::pack::synth::preset(Arch::Qwen3Moe, "tiny").unwrap();
        crate::pack::synth::synth(&c, dir.path(), &Default::default()).unwrap();
        let pack = Pack::open(dir.path()).unwrap();
        let stride = pack.layout().stride;
        let opts = ExpertCacheOptions {
            slots: Some(3),
            host_budget: Some(stride * (2 + 5)),
            pool_workers: 2,
            ..Default::default()
        };
        let cache = CpuExpertCache::load(&pack, &opts).unwrap().unwrap();
        assert_eq!(cache.planner().capacity().host_blobs, 5);
        let src = cache.source(&pack);
        // Default ranking: (0,0), (1,0), (0,1) in slots; those and (1,1), (0,2) in host.
        for (l, e, tier) in [(0, 0, "slot"), (0, 1, "slot"), (1, 1, "host"), (0, 2, "host"), (1, 2, "pack")] {
            let v = src.expert(l, e).unwrap();
            let p = pack.expert(l, e).unwrap();
            assert_eq!(v.blob, p.blob, "({l}, {e}) bytes");
            assert_eq!(v.down.global_scale, p.down.global_scale);
            let in_slot = cache.slots.iter().any(|s| within(v.blob, s));
            let in_host = cache.host.iter().any(|s| within(v.blob, s));
            assert_eq!((in_slot, in_host), (tier == "slot", tier == "host"), "({l}, {e}) from {tier}");
        }
        // Off by default; a profile without a cache is refused.
        assert!(CpuExpertCache::load(&pack, &ExpertCacheOptions::default()).unwrap().is_none());
        let bad = ExpertCacheOptions { profile: Some("p.json".into()), ..Default::default() };
        assert!(CpuExpertCache::load(&pack, &bad).is_err());
        // So is every other setting of a cache, by name.
        let bad =
            ExpertCacheOptions { ring_slots: Some(2), adapt_every: 1, mapped_decode: false, ..Default::default() };
        let e = CpuExpertCache::load(&pack, &bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("ring_slots, adapt_every, mapped_decode need a cache"), "{e}");
    }
}
