//! The tier planner: which expert is in which slot and host buffer, and the
//! copies that change it. It moves no bytes; an executor (the CPU's
//! `CpuExpertCache`, later a GPU's) carries out the copies it plans and
//! reports them done. Device-agnostic and deterministic.
//!
//! Protocol, per forward of `T` tokens:
//! `begin_forward(T)`; per MoE layer `plan_step(layer, routed experts)`,
//! whose `fills` the executor completes before computing the step and whose
//! `ring` it streams, copying each entry with a `promote` slot from its ring
//! slot into that slot after computing it (a step that fails before a
//! promotion's copy reports it with `forget_slot`); `end_forward(T)`,
//! which may return adaptive swaps for the executor to carry out between
//! steps, off the critical path, each reported with `slot_fill_done` /
//! `host_fill_done`. A slot being filled by a swap is not evicted; a step
//! that needs its expert gets `Place::Slot { ready: false }` and must wait
//! for that copy.

use std::cmp::Ordering;

use super::policy::{plan_swaps, Policy, UseCounts};
use super::{Capacity, ExpertKey, ExpertStats};

/// Where a copy reads from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A host buffer (page-locked RAM).
    Host(usize),
    /// The mapped pack (on a GPU: read by a pool worker into staging).
    Pack,
}

/// A copy of `key`'s blob into device slot `slot`, replacing `evicted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotFill {
    pub key: ExpertKey,
    pub slot: usize,
    pub from: Source,
    pub evicted: Option<ExpertKey>,
}

/// A copy of `key`'s blob from the pack into host buffer `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostFill {
    pub key: ExpertKey,
    pub host: usize,
    pub evicted: Option<ExpertKey>,
}

/// Copies off the critical path (initial placement, adaptive swaps): the
/// host fills first (a slot fill never reads a host buffer being filled).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fills {
    pub host: Vec<HostFill>,
    pub slots: Vec<SlotFill>,
}

/// Where a step computes one of its experts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A device slot; `ready: false` while an adaptive swap fills it (wait
    /// for that copy).
    Slot { slot: usize, ready: bool },
    /// Entry `i` of the step's ring.
    Ring(usize),
}

/// One expert streamed through the ring: it occupies ring slot
/// `ring_slot` (= its index modulo the ring size), so its copy may start
/// once the entry `ring_slots` before it has been computed. (The GPU
/// executor may move it to another slot of its ring half,
/// `match_ring_holds`: its copy then waits for the wave two before.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingEntry {
    pub expert: usize,
    pub ring_slot: usize,
    pub from: Source,
    /// The slot this expert takes after its wave computes (a promotion,
    /// `Planner::plan_step`): the executor copies it there from its ring
    /// slot, device memory to device memory, before a later wave reuses the
    /// ring slot.
    pub promote: Option<usize>,
}

/// The plan of one MoE step (one layer of one forward).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    pub layer: usize,
    /// Every routed expert, ascending, with where it is computed from.
    pub experts: Vec<(usize, Place)>,
    /// Misses copied into slots (evicting experts the step does not need);
    /// done before the step computes.
    pub fills: Vec<SlotFill>,
    /// Misses streamed, in order (ascending expert); empty unless the step
    /// needs more than the ring threshold or its misses outnumber the slots
    /// it may evict.
    pub ring: Vec<RingEntry>,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: Option<ExpertKey>,
    ready: bool,
    last_use: u64,
}

impl Entry {
    const EMPTY: Entry = Entry { key: None, ready: true, last_use: 0 };
}

/// The residency bookkeeper of one device's expert cache.
#[derive(Clone, Debug)]
pub struct Planner {
    experts: usize,
    cap: Capacity,
    policy: Policy,
    slots: Vec<Entry>,
    host: Vec<Entry>,
    /// Per `counts.index(key)`.
    slot_of: Vec<Option<usize>>,
    host_of: Vec<Option<usize>>,
    counts: UseCounts,
    /// Routed tokens per `counts.index(key)`, undecayed (profiles).
    routed: Vec<u64>,
    tokens: u64,
    next_adapt: u64,
    step: u64,
    stats: ExpertStats,
}

impl Planner {
    /// A planner for `layers x experts` with tiers of `cap`; initial
    /// placement follows `ranking` (hottest first): the first `cap.slots`
    /// keys in slots, the first `cap.host_blobs` in host buffers. Returns
    /// the copies that place them.
    pub fn new(
        layers: usize,
        experts: usize,
        cap: Capacity,
        policy: Policy,
        ranking: &[ExpertKey],
    ) -> (Planner, Fills) {
        let n = layers * experts;
        let mut p = Planner {
            experts,
            cap,
            policy,
            slots: vec![Entry::EMPTY; cap.slots],
            host: vec![Entry::EMPTY; cap.host_blobs],
            slot_of: vec![None; n],
            host_of: vec![None; n],
            counts: UseCounts::new(layers, experts, policy.decay),
            routed: vec![0; n],
            tokens: 0,
            next_adapt: policy.adapt_every as u64,
            step: 0,
            stats: ExpertStats::default(),
        };
        let mut fills = Fills::default();
        for (h, &key) in ranking.iter().take(cap.host_blobs).enumerate() {
            fills.host.push(p.place_host(h, key));
        }
        for (s, &key) in ranking.iter().take(cap.slots).enumerate() {
            fills.slots.push(p.place_slot(s, key));
        }
        (p, fills)
    }

    fn index(&self, k: ExpertKey) -> usize {
        self.counts.index(k)
    }

    /// Where a copy of `key` reads from: a ready host buffer, else the pack.
    fn source(&self, key: ExpertKey) -> Source {
        match self.host_of[self.index(key)] {
            Some(h) if self.host[h].ready => Source::Host(h),
            _ => Source::Pack,
        }
    }

    fn count_copy(&mut self, from: Source) {
        let b = self.cap.copy_bytes;
        self.stats.bytes_copied += b;
        match from {
            Source::Host(_) => self.stats.bytes_from_host += b,
            Source::Pack => self.stats.bytes_from_pack += b,
        }
    }

    /// Puts `key` in slot `s` (pending until `slot_fill_done`).
    fn place_slot(&mut self, s: usize, key: ExpertKey) -> SlotFill {
        let evicted = self.slots[s].key;
        if let Some(old) = evicted {
            let i = self.index(old);
            self.slot_of[i] = None;
        }
        let from = self.source(key);
        let i = self.index(key);
        self.slot_of[i] = Some(s);
        self.slots[s] = Entry { key: Some(key), ready: false, last_use: self.step };
        self.count_copy(from);
        SlotFill { key, slot: s, from, evicted }
    }

    /// Puts `key` in host buffer `h` (a copy from the pack; pending until
    /// `host_fill_done`).
    fn place_host(&mut self, h: usize, key: ExpertKey) -> HostFill {
        let evicted = self.host[h].key;
        if let Some(old) = evicted {
            let i = self.index(old);
            self.host_of[i] = None;
        }
        let i = self.index(key);
        self.host_of[i] = Some(h);
        self.host[h] = Entry { key: Some(key), ready: false, last_use: self.step };
        self.count_copy(Source::Pack);
        HostFill { key, host: h, evicted }
    }

    /// Slot `slot` does not hold what the plan put there (a promotion whose
    /// copy never ran: its step failed first): it becomes empty. Its old
    /// expert's eviction stands, so nothing else refers to it.
    pub fn forget_slot(&mut self, slot: usize) {
        if let Some(key) = self.slots[slot].key {
            let i = self.index(key);
            if self.slot_of[i] == Some(slot) {
                self.slot_of[i] = None;
            }
        }
        self.slots[slot] = Entry::EMPTY;
    }

    /// The copy into slot `slot` is complete.
    pub fn slot_fill_done(&mut self, slot: usize) {
        self.slots[slot].ready = true;
    }

    /// The copy into host buffer `host` is complete.
    pub fn host_fill_done(&mut self, host: usize) {
        self.host[host].ready = true;
    }

    /// A forward of `tokens` tokens starts: use counts decay.
    pub fn begin_forward(&mut self, tokens: usize) {
        self.counts.decay(tokens);
    }

    /// Plans one MoE step of `layer`: `routed` lists each expert the step
    /// routes to (ascending, distinct) with its token count.
    pub fn plan_step(&mut self, layer: usize, routed: &[(usize, usize)]) -> StepPlan {
        debug_assert!(routed.windows(2).all(|w| w[0].0 < w[1].0), "plan_step: experts not ascending");
        self.step += 1;
        self.stats.steps += 1;
        let needed = |k: Option<ExpertKey>| {
            k.is_some_and(|k| k.layer == layer && routed.binary_search_by_key(&k.expert, |r| r.0).is_ok())
        };
        let mut places = Vec::with_capacity(routed.len());
        let mut misses = Vec::new();
        for &(e, _) in routed {
            let key = ExpertKey::new(layer, e);
            match self.slot_of[self.index(key)] {
                Some(s) => {
                    self.slots[s].last_use = self.step;
                    places.push(Some(Place::Slot { slot: s, ready: self.slots[s].ready }));
                }
                None => {
                    misses.push(places.len());
                    places.push(None);
                }
            }
        }
        self.stats.hits += (routed.len() - misses.len()) as u64;
        self.stats.misses += misses.len() as u64;
        // Empty slots, or ready ones whose expert this step does not need
        // (a step without misses needs none: no scan of every slot).
        let mut victims: Vec<usize> = if misses.is_empty() {
            Vec::new()
        } else {
            (0..self.slots.len()).filter(|&s| self.slots[s].ready && !needed(self.slots[s].key)).collect()
        };
        let by_fraction = routed.len() as f64 > self.policy.ring_threshold * self.experts as f64;
        let stream = !misses.is_empty() && (by_fraction || misses.len() > victims.len());
        let (mut fills, mut ring) = (Vec::new(), Vec::new());
        if stream {
            for (n, &m) in misses.iter().enumerate() {
                let key = ExpertKey::new(layer, routed[m].0);
                let from = self.source(key);
                self.count_copy(from);
                ring.push(RingEntry { expert: key.expert, ring_slot: n % self.cap.ring_slots, from, promote: None });
                places[m] = Some(Place::Ring(n));
            }
            self.stats.streamed += misses.len() as u64;
        } else {
            self.keep_coldest(&mut victims, misses.len());
            for (&m, &s) in misses.iter().zip(&victims) {
                let fill = self.place_slot(s, ExpertKey::new(layer, routed[m].0));
                // The executor completes it before the step computes.
                self.slots[s].ready = true;
                self.stats.evictions += fill.evicted.is_some() as u64;
                places[m] = Some(Place::Slot { slot: s, ready: true });
                fills.push(fill);
            }
        }
        for &(e, rows) in routed {
            let key = ExpertKey::new(layer, e);
            self.counts.add(key, rows);
            let i = self.index(key);
            self.routed[i] += rows as u64;
        }
        if stream {
            self.plan_promotions(layer, &mut ring, victims);
        }
        let experts = routed.iter().zip(places).map(|(r, p)| (r.0, p.expect("every expert placed"))).collect();
        StepPlan { layer, experts, fills, ring }
    }

    /// Keeps the `n` coldest of `slots`, in eviction order (a total order:
    /// the same slots as a full sort, without sorting every slot).
    fn keep_coldest(&self, slots: &mut Vec<usize>, n: usize) {
        if n == 0 {
            slots.clear();
            return;
        }
        if n < slots.len() {
            slots.select_nth_unstable_by(n - 1, |&a, &b| self.colder_slot(a, b));
            slots.truncate(n);
        }
        slots.sort_by(|&a, &b| self.colder_slot(a, b));
    }

    /// Promotions of a streamed step (after its use counts are added): its
    /// hottest streamed experts take the coldest `victims` (ready slots the
    /// step does not need, empty ones first; of this layer or one before it)
    /// while strictly hotter, at most `adapt_swaps` a step. The executor
    /// copies each from its ring slot after its wave (device memory to
    /// device memory: no host link), so a
    /// streamed prefill leaves its hot experts in slots, as copying its
    /// misses into slots would, without waiting for those copies. The slot
    /// counts as ready at once: nothing reads it before the copy in stream
    /// order (the step does not need it; later steps come after).
    fn plan_promotions(&mut self, layer: usize, ring: &mut [RingEntry], mut victims: Vec<usize>) {
        // Only slots of this layer and the layers before it (or empty): a
        // forward plans its layers in ascending order, and a later layer's
        // count has not yet grown by this forward's tokens, so beside this
        // step's fresh counts it would always look colder, and the forward
        // would then stream the expert it just evicted.
        victims.retain(|&s| self.slots[s].key.is_none_or(|k| k.layer <= layer));
        let n = ring.len().min(victims.len()).min(self.policy.adapt_swaps);
        if n == 0 {
            return;
        }
        let key = |r: &RingEntry| ExpertKey::new(layer, r.expert);
        let mut hot: Vec<usize> = (0..ring.len()).collect();
        hot.sort_by(|&a, &b| self.counts.colder(key(&ring[b]), key(&ring[a])));
        self.keep_coldest(&mut victims, n);
        for (&r, &s) in hot.iter().zip(&victims) {
            let k = key(&ring[r]);
            if let Some(old) = self.slots[s].key {
                if self.counts.get(k) <= self.counts.get(old) {
                    break;
                }
                let i = self.index(old);
                self.slot_of[i] = None;
                self.stats.evictions += 1;
            }
            let i = self.index(k);
            self.slot_of[i] = Some(s);
            self.slots[s] = Entry { key: Some(k), ready: true, last_use: self.step };
            ring[r].promote = Some(s);
            self.stats.promoted += 1;
        }
    }

    /// Records a decode step of `layer` that read every routed expert where
    /// it was (mapped decode): from its slot when that slot is ready (a
    /// hit), else in place from its host buffer (a miss, `mapped`). No
    /// copy is planned; use counts grow as in `plan_step`, so adaptive
    /// swaps follow the routing. `routed` as in `plan_step`.
    pub fn record_mapped(&mut self, layer: usize, routed: &[(usize, usize)]) {
        self.step += 1;
        self.stats.steps += 1;
        for &(e, rows) in routed {
            let key = ExpertKey::new(layer, e);
            let i = self.index(key);
            match self.slot_of[i] {
                Some(s) if self.slots[s].ready => {
                    self.slots[s].last_use = self.step;
                    self.stats.hits += 1;
                }
                _ => {
                    self.stats.misses += 1;
                    self.stats.mapped += 1;
                    self.stats.bytes_mapped += self.cap.copy_bytes;
                }
            }
            self.counts.add(key, rows);
            self.routed[i] += rows as u64;
        }
    }

    /// Whether every expert is always readable where the planner keeps it
    /// without a copy: in a slot, or in a host buffer (every expert has one,
    /// so an expert evicted from a slot is still in host memory).
    pub fn all_mapped(&self) -> bool {
        let n = self.slot_of.len();
        let all_host = self.cap.host_blobs >= n && self.host.iter().all(|h| h.ready && h.key.is_some());
        let all_slots = self.cap.slots >= n && self.slots.iter().take(n).all(|s| s.ready && s.key.is_some());
        all_host || all_slots
    }

    /// Eviction order of slots: empty first, then the lower use count, the
    /// less recently used, the lower slot.
    fn colder_slot(&self, a: usize, b: usize) -> Ordering {
        let (x, y) = (&self.slots[a], &self.slots[b]);
        match (x.key, y.key) {
            (None, None) => a.cmp(&b),
            (None, Some(_)) => Ordering::Less,
            (Some(_), None) => Ordering::Greater,
            (Some(p), Some(q)) => {
                self.counts.get(p).total_cmp(&self.counts.get(q)).then(x.last_use.cmp(&y.last_use)).then(a.cmp(&b))
            }
        }
    }

    /// A forward of `tokens` tokens ended. Every `adapt_every` tokens,
    /// returns the adaptive swaps (at most `adapt_swaps` per tier): the
    /// hottest experts outside a tier replace its coldest, while strictly
    /// hotter.
    pub fn end_forward(&mut self, tokens: usize) -> Fills {
        self.tokens += tokens as u64;
        self.stats.tokens += tokens as u64;
        let every = self.policy.adapt_every as u64;
        if every == 0 || self.tokens < self.next_adapt {
            return Fills::default();
        }
        self.next_adapt = (self.tokens / every + 1) * every;
        self.adapt()
    }

    fn adapt(&mut self) -> Fills {
        let mut fills = Fills::default();
        let max = self.policy.adapt_swaps;
        let held: Vec<_> = self.host.iter().map(|e| (e.key, e.ready)).collect();
        for (h, key) in plan_swaps(&self.counts, &held, |k| self.host_of[self.index(k)].is_some(), max) {
            fills.host.push(self.place_host(h, key));
            self.stats.host_swaps += 1;
        }
        let held: Vec<_> = self.slots.iter().map(|e| (e.key, e.ready)).collect();
        for (s, key) in plan_swaps(&self.counts, &held, |k| self.slot_of[self.index(k)].is_some(), max) {
            fills.slots.push(self.place_slot(s, key));
            self.stats.swaps += 1;
        }
        fills
    }

    /// A copy the executor made that no plan asked for (a ring prefetch,
    /// counted when queued: the link carries it whether or not a step uses
    /// it).
    pub fn record_unplanned_copy(&mut self, from: Source) {
        self.count_copy(from);
    }

    /// A ring entry of a plan that the executor did not copy: its ring slot
    /// already held the expert (`prefetched`: put there by a prefetch, which
    /// was counted when queued; else left by an earlier step). Takes back
    /// the copy `plan_step` counted for it.
    pub fn record_copy_skipped(&mut self, from: Source, prefetched: bool) {
        let b = self.cap.copy_bytes;
        self.stats.bytes_copied -= b;
        match from {
            Source::Host(_) => self.stats.bytes_from_host -= b,
            Source::Pack => self.stats.bytes_from_pack -= b,
        }
        self.stats.prefetched += u64::from(prefetched);
    }

    /// Adds time a step waited on copies (executors measure it).
    pub fn record_wait(&mut self, ns: u64) {
        self.stats.wait_ns += ns;
    }

    /// A step found its expert in a slot still pending (an adaptive swap
    /// filling it), and its kernels wait for that copy (GPU executor).
    pub fn record_swap_wait(&mut self) {
        self.stats.swap_waits += 1;
    }

    /// Adds time the host link spent copying (executors measure it).
    pub fn record_copy_time(&mut self, ns: u64) {
        self.stats.copy_ns += ns;
    }

    pub fn stats(&self) -> ExpertStats {
        self.stats
    }

    pub fn capacity(&self) -> Capacity {
        self.cap
    }

    /// The slot holding `key` and whether its copy is complete.
    pub fn slot_of(&self, key: ExpertKey) -> Option<(usize, bool)> {
        self.slot_of[self.index(key)].map(|s| (s, self.slots[s].ready))
    }

    /// The ready host buffer holding `key`.
    pub fn host_of(&self, key: ExpertKey) -> Option<usize> {
        match self.source(key) {
            Source::Host(h) => Some(h),
            Source::Pack => None,
        }
    }

    /// The expert slot `slot` holds (or is being filled with).
    pub fn slot_key(&self, slot: usize) -> Option<ExpertKey> {
        self.slots[slot].key
    }

    /// What each slot holds.
    pub fn slot_keys(&self) -> Vec<Option<ExpertKey>> {
        self.slots.iter().map(|e| e.key).collect()
    }

    /// The decayed use count of `key`.
    pub fn use_count(&self, key: ExpertKey) -> f64 {
        self.counts.get(key)
    }

    /// Routed tokens per layer and expert since load (undecayed).
    pub fn routed_counts(&self) -> Vec<Vec<u64>> {
        self.routed.chunks(self.experts).map(|c| c.to_vec()).collect()
    }
}

/// Moves each ring entry of a step to a ring slot that already holds its
/// expert (`holds[s]`: what ring slot `s` holds, or will once queued
/// copies land) when one of the same ring half does, the others to the
/// half's remaining slots in order. The planner puts entry `n` in ring slot
/// `n mod ring` (wave `n / (ring / 2)`, which uses ring half `wave mod 2`);
/// a prefetch guesses the next step's entries by position, and a step that
/// skips an expert shifts every later one. Matching within the half keeps
/// each wave's slots its own: the copy and compute ordering of the waves
/// (`GpuExpertCache::stream_wave`) is unchanged. Only for an even ring of
/// at least 2 (the waves are halves); `layer` in the planner's numbering.
pub fn match_ring_holds(layer: usize, ring: &mut [RingEntry], holds: &[Option<ExpertKey>]) {
    let rs = holds.len();
    if rs < 2 || rs % 2 == 1 {
        return;
    }
    let per_wave = rs / 2;
    for (w, wave) in ring.chunks_mut(per_wave).enumerate() {
        let base = (w % 2) * per_wave;
        let mut taken = vec![false; per_wave];
        let mut found = vec![None; wave.len()];
        for (f, entry) in found.iter_mut().zip(wave.iter()) {
            let key = ExpertKey::new(layer, entry.expert);
            if let Some(j) = (0..per_wave).find(|&j| !taken[j] && holds[base + j] == Some(key)) {
                taken[j] = true;
                *f = Some(base + j);
            }
        }
        let mut free = (0..per_wave).filter(|&j| !taken[j]).map(|j| base + j);
        for (entry, f) in wave.iter_mut().zip(found) {
            entry.ring_slot = f.or_else(|| free.next()).expect("a wave has at most half the ring's entries");
        }
    }
}

/// Which entries of a mapped decode's tables point into host memory (read
/// in place) rather than at a slot, counted per layer: a layer with none
/// takes the all-resident engine's expert kernels. `epoch` changes
/// whenever a layer starts or stops pointing into host memory, so that a
/// decode step captured before (with the other kernels) is captured again.
#[derive(Clone, Debug)]
pub struct HostEntries {
    experts: usize,
    in_host: Vec<bool>,
    per_layer: Vec<usize>,
    epoch: u64,
}

impl HostEntries {
    /// `layers` tables of `experts` entries, none pointing into host memory.
    pub fn new(layers: usize, experts: usize) -> HostEntries {
        HostEntries { experts, in_host: vec![false; layers * experts], per_layer: vec![0; layers], epoch: 0 }
    }

    /// Entry `key` now points into host memory (`in_host`) or at a slot.
    pub fn set(&mut self, key: ExpertKey, in_host: bool) {
        let at = key.layer * self.experts + key.expert;
        if std::mem::replace(&mut self.in_host[at], in_host) == in_host {
            return;
        }
        let n = &mut self.per_layer[key.layer];
        let before = *n > 0;
        if in_host {
            *n += 1;
        } else {
            *n -= 1;
        }
        if before != (*n > 0) {
            self.epoch += 1;
        }
    }

    /// Whether some entry of `layer`'s table points into host memory.
    pub fn any(&self, layer: usize) -> bool {
        self.per_layer[layer] > 0
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::policy::ranking;
    use crate::rng::Rng;

    fn k(l: usize, e: usize) -> ExpertKey {
        ExpertKey::new(l, e)
    }

    fn cap(slots: usize, ring_slots: usize, host_blobs: usize) -> Capacity {
        Capacity { slots, ring_slots, host_blobs, staging_blobs: 0, blob_bytes: 4096, copy_bytes: 1000 }
    }

    fn policy(adapt_every: usize, ring_threshold: f64) -> Policy {
        Policy { adapt_every, adapt_swaps: 2, decay: 1.0, ring_threshold }
    }

    /// A planner whose initial copies are already done.
    fn planner(layers: usize, experts: usize, cap: Capacity, p: Policy, rank: &[ExpertKey]) -> Planner {
        let (mut pl, fills) = Planner::new(layers, experts, cap, p, rank);
        complete(&mut pl, &fills);
        pl
    }

    fn complete(pl: &mut Planner, f: &Fills) {
        f.host.iter().for_each(|h| pl.host_fill_done(h.host));
        f.slots.iter().for_each(|s| pl.slot_fill_done(s.slot));
    }

    fn ones(experts: &[usize]) -> Vec<(usize, usize)> {
        experts.iter().map(|&e| (e, 1)).collect()
    }

    /// Slots and `slot_of` agree, and no key is held twice.
    fn check_consistent(pl: &Planner) {
        let keys = pl.slot_keys();
        for (s, key) in keys.iter().enumerate() {
            if let Some(key) = key {
                assert_eq!(pl.slot_of(*key).map(|x| x.0), Some(s), "{key:?}");
            }
        }
        let mut held: Vec<_> = keys.iter().flatten().collect();
        let n = held.len();
        held.sort();
        held.dedup();
        assert_eq!(held.len(), n, "a key in two slots: {keys:?}");
    }

    #[test]
    fn initial_placement_puts_the_hottest_in_slots_and_the_next_in_host() {
        let counts = vec![vec![0, 7, 1, 9], vec![5, 0, 0, 2]];
        let rank = ranking(2, 4, Some(&counts));
        let (mut pl, fills) = Planner::new(2, 4, cap(2, 1, 3), policy(0, 1.0), &rank);
        assert_eq!(fills.slots.iter().map(|f| f.key).collect::<Vec<_>>(), vec![k(0, 3), k(0, 1)]);
        assert_eq!(fills.host.iter().map(|f| f.key).collect::<Vec<_>>(), vec![k(0, 3), k(0, 1), k(1, 0)]);
        // Host buffers were not ready when the slots were planned: those read the pack.
        assert!(fills.slots.iter().all(|f| f.from == Source::Pack && f.evicted.is_none()));
        assert_eq!(pl.slot_of(k(0, 3)), Some((0, false)));
        assert_eq!(pl.host_of(k(1, 0)), None, "pending");
        complete(&mut pl, &fills);
        assert_eq!(pl.slot_of(k(0, 3)), Some((0, true)));
        assert_eq!(pl.host_of(k(1, 0)), Some(2));
        assert_eq!(pl.stats().bytes_copied, 5 * 1000);
        assert_eq!(pl.stats().bytes_from_pack, 5 * 1000);
    }

    #[test]
    fn a_miss_evicts_the_coldest_slot_the_step_does_not_need() {
        // 3 slots over 1 layer of 8 experts, holding 0, 1, 2.
        let rank = ranking(1, 8, None);
        let mut pl = planner(1, 8, cap(3, 2, 2), policy(0, 1.0), &rank);
        pl.begin_forward(4);
        // Heat expert 1 and 2; expert 0 stays coldest.
        let p = pl.plan_step(0, &[(1, 3), (2, 1)]);
        assert_eq!(
            p.experts,
            vec![(1, Place::Slot { slot: 1, ready: true }), (2, Place::Slot { slot: 2, ready: true })]
        );
        assert!(p.fills.is_empty() && p.ring.is_empty());
        // Needs 0 (coldest, but needed) and 5: 5 must evict 2 (count 1), not 0.
        let p = pl.plan_step(0, &ones(&[0, 5]));
        assert_eq!(
            p.experts,
            vec![(0, Place::Slot { slot: 0, ready: true }), (5, Place::Slot { slot: 2, ready: true })]
        );
        // Host holds 0 and 1 only: 5 comes from the pack.
        assert_eq!(p.fills, vec![SlotFill { key: k(0, 5), slot: 2, from: Source::Pack, evicted: Some(k(0, 2)) }]);
        let p = pl.plan_step(0, &ones(&[3]));
        assert_eq!(p.fills[0].evicted, Some(k(0, 0)), "0 and 5: count 1, last used by the same step; the lower slot");
        pl.plan_step(0, &ones(&[1, 3, 5]));
        // 0 is in host buffer 0: its miss reads the host.
        let p = pl.plan_step(0, &ones(&[0, 6]));
        let fills: Vec<_> = p.fills.iter().map(|f| (f.key, f.from, f.evicted)).collect();
        assert_eq!(fills, vec![(k(0, 0), Source::Host(0), Some(k(0, 3))), (k(0, 6), Source::Pack, Some(k(0, 5)))]);
        pl.end_forward(4);
        let s = pl.stats();
        assert_eq!((s.hits, s.misses, s.evictions, s.streamed), (6, 4, 4, 0));
        assert_eq!(s.hits + s.misses, 2 + 2 + 1 + 3 + 2);
        assert_eq!((s.bytes_from_host, s.bytes_from_pack), (1000, 5000 + 3000));
        check_consistent(&pl);
    }

    #[test]
    fn the_ring_streams_misses_above_the_threshold_or_beyond_the_slots() {
        let rank = ranking(1, 8, None);
        // Threshold 0.5 of 8 experts: more than 4 distinct experts stream.
        let mut pl = planner(1, 8, cap(2, 3, 0), policy(0, 0.5), &rank);
        let p = pl.plan_step(0, &ones(&[0, 2, 3, 4, 5, 7]));
        assert!(p.fills.is_empty());
        assert_eq!(p.experts[0], (0, Place::Slot { slot: 0, ready: true }));
        let ring: Vec<(usize, usize)> = p.ring.iter().map(|r| (r.expert, r.ring_slot)).collect();
        assert_eq!(ring, vec![(2, 0), (3, 1), (4, 2), (5, 0), (7, 1)]);
        assert_eq!(p.experts[5], (7, Place::Ring(4)));
        // The hottest streamed expert (of equal counts the lowest, 2) is promoted into the one
        // slot the step does not need (1, count 0); the others are not kept.
        let promoted: Vec<Option<usize>> = p.ring.iter().map(|r| r.promote).collect();
        assert_eq!(promoted, vec![Some(1), None, None, None, None]);
        assert_eq!(pl.slot_keys(), vec![Some(k(0, 0)), Some(k(0, 2))]);
        assert_eq!(pl.slot_of(k(0, 2)), Some((1, true)));
        check_consistent(&pl);
        // 4 experts (not above the threshold) but 3 misses and 1 evictable slot: streamed too;
        // 3 (count 2) is hotter than 2 (count 1) and takes its slot.
        let p = pl.plan_step(0, &ones(&[0, 3, 5, 6]));
        assert_eq!(p.ring.len(), 3);
        assert_eq!(p.ring.iter().map(|r| r.promote).collect::<Vec<_>>(), vec![Some(1), None, None]);
        // 1 miss and 1 evictable slot: copied in, nothing streamed.
        let p = pl.plan_step(0, &ones(&[3, 5]));
        assert_eq!((p.fills.len(), p.ring.len()), (1, 0));
        assert_eq!(p.experts[0], (3, Place::Slot { slot: 1, ready: true }));
        let s = pl.stats();
        assert_eq!((s.hits, s.misses, s.streamed, s.promoted, s.evictions), (3, 9, 8, 2, 3));
        // No bytes for a promotion: only the fill crossed the host link.
        assert_eq!(s.bytes_copied, (2 + 8 + 1) * pl.capacity().copy_bytes);
        // Threshold 0 forces the ring for any miss.
        let mut pl = planner(1, 8, cap(2, 3, 0), policy(0, 0.0), &rank);
        assert_eq!(pl.plan_step(0, &ones(&[5])).ring.len(), 1);
        assert!(pl.plan_step(0, &ones(&[1])).ring.is_empty(), "a hit streams nothing");
    }

    #[test]
    fn adaptive_swaps_come_every_interval_and_pending_slots_are_not_evicted() {
        let rank = ranking(1, 8, None);
        let mut pl = planner(
            1,
            8,
            cap(2, 1, 1),
            Policy { adapt_every: 4, adapt_swaps: 1, decay: 0.5, ring_threshold: 1.0 },
            &rank,
        );
        // Both slots (0, 1) are needed by each step, so 6 and 7 stream.
        for _ in 0..3 {
            pl.begin_forward(1);
            pl.plan_step(0, &ones(&[0, 1, 6, 7]));
            assert!(pl.end_forward(1).slots.is_empty(), "before the interval");
        }
        pl.begin_forward(1);
        pl.plan_step(0, &[(0, 1), (1, 1), (6, 1), (7, 5)]);
        let f = pl.end_forward(1);
        // Counts: 0, 1 and 6 equal, 7 hotter: one swap per tier (adapt_swaps 1).
        assert_eq!(f.slots.len(), 1);
        assert_eq!(f.slots[0].key, k(0, 7));
        assert_eq!(f.slots[0].evicted, Some(k(0, 1)), "of equal counts the higher key is colder");
        assert_eq!(f.host, vec![HostFill { key: k(0, 7), host: 0, evicted: Some(k(0, 0)) }]);
        assert_eq!(pl.stats().swaps, 1);
        assert_eq!(pl.stats().host_swaps, 1);
        // Not yet done: a step needing 7 waits; a miss never evicts the pending slot.
        let p = pl.plan_step(0, &ones(&[3, 7]));
        assert_eq!(p.experts[1], (7, Place::Slot { slot: 1, ready: false }));
        assert_eq!(p.fills.iter().map(|f| f.slot).collect::<Vec<_>>(), vec![0]);
        let p = pl.plan_step(0, &ones(&[4, 5]));
        assert_eq!(p.ring.len(), 2, "only slot 0 may be evicted");
        complete(&mut pl, &f);
        assert_eq!(pl.slot_of(k(0, 7)), Some((1, true)));
        assert_eq!(pl.host_of(k(0, 7)), Some(0));
        check_consistent(&pl);
    }

    /// Zipf-like routing of `tokens` decode tokens over `layers`: the same
    /// seed gives the same decisions, and the bookkeeping stays consistent.
    fn run_synthetic(seed: u64, slots: usize) -> (ExpertStats, Vec<Option<ExpertKey>>, Vec<StepPlan>) {
        let (layers, experts, top_k) = (3, 16, 4);
        let rank = ranking(layers, experts, None);
        let p = Policy { adapt_every: 8, adapt_swaps: 3, decay: 0.9, ring_threshold: 0.5 };
        let mut pl = planner(layers, experts, cap(slots, 2, 6), p, &rank);
        let mut r = Rng::new(seed);
        let mut plans = Vec::new();
        let mut assignments = 0;
        for t in 0..60 {
            let tokens = if t % 20 == 0 { 9 } else { 1 };
            pl.begin_forward(tokens);
            for l in 0..layers {
                let mut routed = std::collections::BTreeMap::new();
                for _ in 0..tokens {
                    let mut chosen = std::collections::BTreeSet::new();
                    while chosen.len() < top_k {
                        // Skewed: expert ~ 16 * u^3.
                        let u = (r.normal().abs() / 3.0).min(0.999) as f64;
                        chosen.insert(((u * u * experts as f64) as usize + l) % experts);
                    }
                    for e in chosen {
                        *routed.entry(e).or_insert(0) += 1;
                    }
                }
                let routed: Vec<(usize, usize)> = routed.into_iter().collect();
                assignments += routed.len() as u64;
                plans.push(pl.plan_step(l, &routed));
                check_consistent(&pl);
            }
            let f = pl.end_forward(tokens);
            complete(&mut pl, &f);
        }
        let s = pl.stats();
        assert_eq!(s.hits + s.misses, assignments);
        assert_eq!(s.tokens, 3 * 9 + 57);
        (s, pl.slot_keys(), plans)
    }

    #[test]
    fn synthetic_routing_is_deterministic_and_counted_right() {
        let a = run_synthetic(11, 12);
        let b = run_synthetic(11, 12);
        assert_eq!(a, b);
        let (s, _, plans) = &a;
        assert!(s.hits > 0 && s.misses > 0 && s.swaps > 0 && s.streamed > 0, "{s:?}");
        // Every fill's and ring entry's copy is counted once, with the initial placement.
        let copies: u64 = plans.iter().map(|p| (p.fills.len() + p.ring.len()) as u64).sum();
        assert_eq!(s.bytes_copied, (copies + 12 + 6 + s.swaps + s.host_swaps) * 1000);
        assert_eq!(s.bytes_copied, s.bytes_from_host + s.bytes_from_pack);
        // More slots, more hits.
        let (big, _, _) = run_synthetic(11, 36);
        assert!(big.hits > s.hits, "{} vs {}", big.hits, s.hits);
        assert_ne!(run_synthetic(12, 12).0, *s, "another seed routes differently");
    }

    #[test]
    fn mapped_steps_count_slot_hits_and_in_place_reads_and_feed_the_swaps() {
        // 2 layers x 4 experts, every one in host memory, 2 slots (0/0, 1/0).
        let rank = ranking(2, 4, None);
        let mut pl = planner(2, 4, cap(2, 1, 8), policy(2, 1.0), &rank);
        assert!(pl.all_mapped());
        pl.begin_forward(1);
        pl.record_mapped(0, &ones(&[0, 3]));
        pl.record_mapped(1, &ones(&[2, 3]));
        let s = pl.stats();
        assert_eq!((s.steps, s.hits, s.misses, s.mapped), (2, 1, 3, 3));
        assert_eq!((s.bytes_mapped, s.bytes_copied), (3 * 1000, 8 * 1000 + 2 * 1000), "nothing copied by the steps");
        // Expert 1/3, read in place twice more, replaces the coldest slot (1/0: never used); the
        // others read in place once are not hotter than 0/0.
        pl.record_mapped(1, &[(3, 2)]);
        let fills = pl.end_forward(2);
        assert_eq!(fills.slots.len(), 1, "{fills:?}");
        let f = &fills.slots[0];
        assert_eq!((f.key, f.slot, f.evicted, f.from), (k(1, 3), 1, Some(k(1, 0)), Source::Host(7)));
        // Until its copy is done it is still read in place; then it is a hit.
        pl.record_mapped(1, &ones(&[3]));
        assert_eq!(pl.stats().mapped, 5);
        complete(&mut pl, &fills);
        pl.record_mapped(1, &ones(&[3]));
        assert_eq!((pl.stats().hits, pl.stats().mapped), (2, 5));
        check_consistent(&pl);
        // Not every expert in host memory nor in a slot: not mappable.
        assert!(!planner(2, 4, cap(2, 1, 7), policy(0, 1.0), &rank).all_mapped());
        assert!(planner(1, 4, cap(4, 1, 0), policy(0, 1.0), &ranking(1, 4, None)).all_mapped());
    }

    #[test]
    fn ring_entries_move_to_the_slot_of_their_half_that_holds_them() {
        let entry = |expert| RingEntry { expert, ring_slot: 0, from: Source::Host(0), promote: None };
        let at = |ring: &[RingEntry]| ring.iter().map(|r| r.ring_slot).collect::<Vec<_>>();
        // A ring of 4: waves of 2, wave 0 in slots 0-1, wave 1 in 2-3, wave 2 in 0-1.
        let key = |e| Some(ExpertKey::new(3, e));
        // A prefetch guessed experts 1, 2 | 4, 5; the step skips expert 2.
        let holds = [key(1), key(2), key(4), key(5)];
        let mut ring: Vec<RingEntry> = [1, 4, 5, 7, 9].into_iter().map(entry).collect();
        match_ring_holds(3, &mut ring, &holds);
        // Wave 0 (1, 4): 1 stays in slot 0, 4 is held only by the other half, so takes slot 1.
        // Wave 1 (5, 7): 5 goes to slot 3, which holds it; 7 to the free slot 2.
        // Wave 2 (9): the first slot of half 0.
        assert_eq!(at(&ring), vec![0, 1, 3, 2, 0]);
        // Another layer's experts never match.
        let mut other: Vec<RingEntry> = [2, 1].into_iter().map(entry).collect();
        match_ring_holds(4, &mut other, &holds);
        assert_eq!(at(&other), vec![0, 1]);
        // An odd ring is left as planned.
        let mut odd = vec![RingEntry { expert: 2, ring_slot: 1, from: Source::Host(0), promote: None }];
        match_ring_holds(3, &mut odd, &[key(2), None, None]);
        assert_eq!(at(&odd), vec![1]);
    }

    #[test]
    fn streamed_experts_are_promoted_only_when_hotter_and_at_most_adapt_swaps_a_step() {
        // Two slots hold layer 0's experts 0 and 1; threshold 0: every miss streams.
        let mut pl = planner(1, 6, cap(2, 4, 0), policy(0, 0.0), &ranking(1, 6, None));
        for _ in 0..3 {
            pl.plan_step(0, &ones(&[0, 1]));
        }
        // Counts 0: 3, 1: 3. Streamed experts of count 1 are not hotter: nothing moves.
        let p = pl.plan_step(0, &[(2, 1), (3, 1)]);
        assert!(p.ring.iter().all(|r| r.promote.is_none()));
        assert_eq!(pl.slot_keys(), vec![Some(k(0, 0)), Some(k(0, 1))]);
        // Three streamed experts hotter than both slots: adapt_swaps (2) of them, hottest first,
        // into the colder slot first (equal counts: the one used longer ago, then the lower).
        let p = pl.plan_step(0, &[(2, 4), (4, 9), (5, 6)]);
        let promoted: Vec<(usize, Option<usize>)> = p.ring.iter().map(|r| (r.expert, r.promote)).collect();
        assert_eq!(promoted, vec![(2, None), (4, Some(0)), (5, Some(1))]);
        assert_eq!(pl.slot_keys(), vec![Some(k(0, 4)), Some(k(0, 5))]);
        check_consistent(&pl);
        // Promoted experts are hits from then on.
        let p = pl.plan_step(0, &ones(&[4, 5]));
        assert!(p.ring.is_empty() && p.fills.is_empty());
        assert_eq!(pl.stats().promoted, 2);
    }

    #[test]
    fn promotions_never_evict_a_later_layers_expert() {
        // Slots hold layer 0's expert 0 and layer 1's expert 0 (ranking: every layer's 0 first).
        let mut pl = planner(2, 4, cap(2, 2, 0), policy(0, 0.0), &ranking(2, 4, None));
        assert_eq!(pl.slot_keys(), vec![Some(k(0, 0)), Some(k(1, 0))]);
        // Layer 0 streams 1 and 2 (hotter than both slots' zero counts): only layer 0's slot
        // (not needed by this step) is a victim, not layer 1's.
        let p = pl.plan_step(0, &[(1, 3), (2, 1)]);
        assert_eq!(p.ring.iter().map(|r| r.promote).collect::<Vec<_>>(), vec![Some(0), None]);
        // Layer 1 may take layer 0's slot and its own.
        let p = pl.plan_step(1, &[(2, 5), (3, 4)]);
        assert_eq!(p.ring.iter().map(|r| r.promote).collect::<Vec<_>>(), vec![Some(1), Some(0)]);
        assert_eq!(pl.slot_keys(), vec![Some(k(1, 3)), Some(k(1, 2))]);
        check_consistent(&pl);
    }

    #[test]
    fn promotions_skip_pending_slots_stop_at_adapt_swaps_0_and_can_be_forgotten() {
        let rank = ranking(1, 6, None);
        // adapt_swaps 0: streamed experts are never promoted.
        let none = Policy { adapt_every: 0, adapt_swaps: 0, decay: 1.0, ring_threshold: 0.0 };
        let mut pl = planner(1, 6, cap(2, 4, 0), none, &rank);
        let p = pl.plan_step(0, &[(3, 9)]);
        assert!(p.ring[0].promote.is_none() && pl.stats().promoted == 0);
        // One promotion a step and one swap an interval (every token).
        let one = Policy { adapt_every: 1, adapt_swaps: 1, decay: 1.0, ring_threshold: 0.0 };
        let mut pl = planner(1, 6, cap(2, 4, 0), one, &rank);
        pl.begin_forward(1);
        let p = pl.plan_step(0, &[(4, 5), (5, 3)]);
        assert_eq!(p.ring.iter().map(|r| r.promote).collect::<Vec<_>>(), vec![Some(0), None]);
        // The swap puts 5 in slot 1 (expert 1, count 0): pending until its copy is done.
        let swaps = pl.end_forward(1);
        assert_eq!(swaps.slots.iter().map(|f| (f.slot, f.key)).collect::<Vec<_>>(), vec![(1, k(0, 5))]);
        // Only slot 0 (ready, not needed) may take a promotion; the pending slot keeps its swap.
        let p = pl.plan_step(0, &[(2, 7), (3, 6)]);
        assert_eq!(p.ring.iter().map(|r| r.promote).collect::<Vec<_>>(), vec![Some(0), None]);
        assert_eq!(pl.slot_of(k(0, 5)), Some((1, false)));
        // A promotion whose copy never ran is forgotten: the slot is empty, nothing maps to it.
        pl.forget_slot(0);
        assert_eq!(pl.slot_keys(), vec![None, Some(k(0, 5))]);
        assert_eq!(pl.slot_of(k(0, 2)), None);
        check_consistent(&pl);
    }

    /// The epoch moves only when a layer starts or stops pointing into
    /// host memory, not when a layer that already does gains or loses
    /// one more entry; setting an entry to what it holds changes nothing.
    #[test]
    fn host_entries_count_layers_and_move_the_epoch_on_changes_of_kernel() {
        let mut h = HostEntries::new(2, 4);
        assert!(!h.any(0) && !h.any(1));
        assert_eq!(h.epoch(), 0);
        h.set(k(0, 1), true);
        assert!(h.any(0) && !h.any(1));
        assert_eq!(h.epoch(), 1);
        h.set(k(0, 1), true);
        h.set(k(0, 3), true);
        assert_eq!(h.epoch(), 1, "a second host entry of the same layer");
        h.set(k(0, 1), false);
        assert!(h.any(0));
        assert_eq!(h.epoch(), 1);
        h.set(k(0, 3), false);
        assert!(!h.any(0));
        assert_eq!(h.epoch(), 2, "the layer's last host entry left");
        h.set(k(1, 0), false);
        assert_eq!(h.epoch(), 2, "an entry already at a slot");
        h.set(k(1, 0), true);
        assert!(h.any(1) && !h.any(0));
        assert_eq!(h.epoch(), 3);
    }
}
