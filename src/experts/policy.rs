//! The placement policy: decayed use counts rank experts; a miss evicts the
//! coldest slot the step does not need; every `adapt_every` tokens the
//! hottest experts outside a tier swap with its coldest. Every decision is
//! a function of the routing alone (no clocks), ties broken by key.

use std::cmp::Ordering;

use super::ExpertKey;

/// The policy options (`ExpertCacheOptions::policy`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub adapt_every: usize,
    pub adapt_swaps: usize,
    pub decay: f64,
    pub ring_threshold: f64,
}

/// Per (layer, expert) use counts, each routed token adding 1 and every
/// token multiplying all by `decay`.
#[derive(Clone, Debug, PartialEq)]
pub struct UseCounts {
    experts: usize,
    counts: Vec<f64>,
    decay: f64,
}

impl UseCounts {
    pub fn new(layers: usize, experts: usize, decay: f64) -> UseCounts {
        UseCounts { experts, counts: vec![0.0; layers * experts], decay }
    }

    pub fn index(&self, k: ExpertKey) -> usize {
        k.layer * self.experts + k.expert
    }

    pub fn key(&self, i: usize) -> ExpertKey {
        ExpertKey::new(i / self.experts, i % self.experts)
    }

    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    pub fn get(&self, k: ExpertKey) -> f64 {
        self.counts[self.index(k)]
    }

    /// `tokens` tokens pass: every count decays by `decay^tokens`.
    pub fn decay(&mut self, tokens: usize) {
        if self.decay < 1.0 {
            let f = self.decay.powi(tokens.min(i32::MAX as usize) as i32);
            self.counts.iter_mut().for_each(|c| *c *= f);
        }
    }

    pub fn add(&mut self, k: ExpertKey, uses: usize) {
        let i = self.index(k);
        self.counts[i] += uses as f64;
    }

    /// Colder first: lower count, then the higher key (so that of equals the
    /// lower key, ranked hotter, stays).
    pub fn colder(&self, a: ExpertKey, b: ExpertKey) -> Ordering {
        self.get(a).total_cmp(&self.get(b)).then(b.cmp(&a))
    }
}

/// The placement ranking of every (layer, expert): hottest first by
/// `counts` (ties: lower layer, then lower expert); without counts, every
/// layer's expert 0, then every layer's expert 1, ... so that each layer
/// gets an equal share of a tier.
pub fn ranking(layers: usize, experts: usize, counts: Option<&[Vec<u64>]>) -> Vec<ExpertKey> {
    let mut keys: Vec<ExpertKey> = (0..experts).flat_map(|e| (0..layers).map(move |l| ExpertKey::new(l, e))).collect();
    if let Some(c) = counts {
        keys.sort_by(|a, b| c[b.layer][b.expert].cmp(&c[a.layer][a.expert]).then(a.cmp(b)));
    }
    keys
}

/// Swaps for one tier of `held` entries (`None`: empty; the flag: whether
/// it may be replaced now): pairs the hottest keys not held (with a count
/// above zero) with the coldest replaceable entries, while the newcomer is
/// strictly hotter, at most `max` pairs. Returns `(entry, newcomer)`.
pub fn plan_swaps(
    counts: &UseCounts,
    held: &[(Option<ExpertKey>, bool)],
    is_held: impl Fn(ExpertKey) -> bool,
    max: usize,
) -> Vec<(usize, ExpertKey)> {
    if max == 0 {
        return Vec::new();
    }
    let mut hot: Vec<ExpertKey> =
        (0..counts.len()).map(|i| counts.key(i)).filter(|&k| !is_held(k) && counts.get(k) > 0.0).collect();
    hot.sort_by(|&a, &b| counts.colder(b, a));
    let mut cold: Vec<usize> = (0..held.len()).filter(|&i| held[i].1).collect();
    // Empty entries first, then coldest held (ties: the lower index).
    cold.sort_by(|&a, &b| match (held[a].0, held[b].0) {
        (None, None) => a.cmp(&b),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (Some(x), Some(y)) => counts.colder(x, y).then(a.cmp(&b)),
    });
    hot.into_iter()
        .zip(cold)
        .take(max)
        .take_while(|&(k, i)| held[i].0.is_none_or(|old| counts.get(k) > counts.get(old)))
        .map(|(k, i)| (i, k))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(l: usize, e: usize) -> ExpertKey {
        ExpertKey::new(l, e)
    }

    #[test]
    fn counts_decay_per_token_and_add_per_use() {
        let mut c = UseCounts::new(2, 4, 0.5);
        c.add(k(1, 3), 4);
        c.decay(2);
        c.add(k(1, 3), 1);
        c.add(k(0, 0), 1);
        assert_eq!(c.get(k(1, 3)), 4.0 * 0.25 + 1.0);
        assert_eq!(c.get(k(0, 0)), 1.0);
        assert_eq!(c.index(k(1, 3)), 7);
        assert_eq!(c.key(7), k(1, 3));
        // Equal counts: the higher key is the colder.
        assert_eq!(c.colder(k(0, 1), k(0, 2)), Ordering::Greater);
        assert_eq!(c.colder(k(0, 0), k(1, 3)), Ordering::Less);
    }

    #[test]
    fn ranking_spreads_layers_without_counts_and_sorts_hot_first_with_them() {
        assert_eq!(ranking(2, 3, None)[..4], [k(0, 0), k(1, 0), k(0, 1), k(1, 1)]);
        let counts = vec![vec![1, 9, 0], vec![9, 2, 5]];
        assert_eq!(ranking(2, 3, Some(&counts)), vec![k(0, 1), k(1, 0), k(1, 2), k(1, 1), k(0, 0), k(0, 2)]);
    }

    #[test]
    fn swaps_pair_hottest_outsiders_with_coldest_replaceable_entries() {
        let mut c = UseCounts::new(1, 6, 1.0);
        for (e, n) in [(0, 5), (1, 1), (2, 3), (3, 9), (4, 2), (5, 0)] {
            c.add(k(0, e), n);
        }
        // Held: e0 (5), e1 (1, not replaceable now), e4 (2); outside: e3 (9), e2 (3), e5 (0).
        let held = [(Some(k(0, 0)), true), (Some(k(0, 1)), false), (Some(k(0, 4)), true)];
        let is_held = |x: ExpertKey| [0, 1, 4].contains(&x.expert);
        // e3 replaces e4 (coldest replaceable), e2 (3) does not beat e0 (5): one swap.
        assert_eq!(plan_swaps(&c, &held, is_held, 8), vec![(2, k(0, 3))]);
        assert_eq!(plan_swaps(&c, &held, is_held, 0), vec![]);
        // An empty entry takes the hottest first; zero counts never enter.
        let held = [(None, true), (Some(k(0, 0)), true)];
        let is_held = |x: ExpertKey| x.expert == 0;
        assert_eq!(plan_swaps(&c, &held, is_held, 8), vec![(0, k(0, 3))]);
    }
}
