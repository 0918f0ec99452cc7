//! THE MoE pipeline, as separate steps with plain data between them:
//!
//! 1. `route`: router logits -> per token, its top-k experts and weights;
//! 2. `group_by_expert`: the routed (token, weight) pairs of each expert;
//! 3. `gather`: each group's token rows, consecutive, in group order;
//! 4. expert compute: `Backend::expert_ffn` over the groups, each with its
//!    expert's weights (an `ExpertView`, which carries the global scales);
//! 5. `combine`: every token's output is the weighted sum of its experts'.
//!
//! Placement is a parameter, never a second copy of these steps: where
//! expert weights come from is an `ExpertSource`, and which device computes
//! is a `Backend`.

use std::collections::BTreeMap;

use crate::backend::cpu::ops::softmax;
use crate::backend::{Backend, ExpertRows, Matrix};
use crate::error::Result;
use crate::pack::{ExpertView, Pack};

/// Where expert weights come from: the mapped pack today; a cache tier or a
/// streamed copy later.
pub trait ExpertSource: Sync {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertView<'_>>;
}

impl ExpertSource for Pack {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertView<'_>> {
        Pack::expert(self, layer, expert)
    }
}

/// The routing decision of a batch of tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[tokens, top_k]` expert ids, highest probability first.
    pub experts: Vec<usize>,
    /// `[tokens, top_k]` the weights that scale those experts' outputs.
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.top_k
    }

    /// Token `t`'s experts and weights.
    pub fn token(&self, t: usize) -> (&[usize], &[f32]) {
        let r = t * self.top_k..(t + 1) * self.top_k;
        (&self.experts[r.clone()], &self.weights[r])
    }
}

/// Routes each token: softmax in f32 over its `num_experts` router logits,
/// the `top_k` largest probabilities (ties: the lower expert index first),
/// renormalized to sum to 1 only when `norm_topk_prob`.
pub fn route(router_logits: &[f32], num_experts: usize, top_k: usize, norm_topk_prob: bool) -> Routing {
    assert!(top_k >= 1 && top_k <= num_experts, "route: top_k {top_k} of {num_experts} experts");
    assert_eq!(router_logits.len() % num_experts, 0, "route: logits are not [T, {num_experts}]");
    let mut experts = Vec::with_capacity(router_logits.len() / num_experts * top_k);
    let mut weights = Vec::with_capacity(experts.capacity());
    for logits in router_logits.chunks_exact(num_experts) {
        let mut probs = logits.to_vec();
        softmax(&mut probs);
        let mut order: Vec<usize> = (0..num_experts).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let sum: f32 = chosen.iter().map(|&e| probs[e]).sum();
        for &e in chosen {
            experts.push(e);
            weights.push(if norm_topk_prob { probs[e] / sum } else { probs[e] });
        }
    }
    Routing { top_k, experts, weights }
}

/// The tokens routed to one expert, with the weight of each.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertGroup {
    pub expert: usize,
    /// Token rows (indices into the batch), ascending.
    pub tokens: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Groups the routing by expert: ascending expert id, each group's tokens
/// ascending. Experts that no token chose have no group.
pub fn group_by_expert(routing: &Routing) -> Vec<ExpertGroup> {
    let mut groups: BTreeMap<usize, ExpertGroup> = BTreeMap::new();
    for t in 0..routing.tokens() {
        let (experts, weights) = routing.token(t);
        for (&e, &w) in experts.iter().zip(weights) {
            let g =
                groups.entry(e).or_insert_with(|| ExpertGroup { expert: e, tokens: Vec::new(), weights: Vec::new() });
            g.tokens.push(t);
            g.weights.push(w);
        }
    }
    groups.into_values().collect()
}

/// The rows of `h [T, hidden]` each group needs, consecutive in group order.
pub fn gather(h: &[f32], hidden: usize, groups: &[ExpertGroup]) -> Vec<f32> {
    let mut x = Vec::with_capacity(groups.iter().map(|g| g.tokens.len()).sum::<usize>() * hidden);
    for g in groups {
        for &t in &g.tokens {
            x.extend_from_slice(&h[t * hidden..(t + 1) * hidden]);
        }
    }
    x
}

/// `out[t] += weight * y[row]` for every routed row; `y` is in `gather`
/// order. A token's experts are added in ascending expert order whatever
/// the batch, so a token's output never depends on its neighbours.
pub fn combine(groups: &[ExpertGroup], y: &[f32], hidden: usize, out: &mut [f32]) {
    let mut row = 0;
    for g in groups {
        for (&t, &w) in g.tokens.iter().zip(&g.weights) {
            let src = &y[row * hidden..(row + 1) * hidden];
            for (o, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(src) {
                *o += w * v;
            }
            row += 1;
        }
    }
}

/// One MoE layer's parameters.
#[derive(Clone, Copy, Debug)]
pub struct MoeLayer<'a> {
    pub layer: usize,
    /// `[num_experts, hidden]`.
    pub router: &'a Matrix,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// Step 4 of the pipeline: `y` gets, group after group, the rows of `x`
/// (`gather` order) through each group's expert. Where the experts live is
/// the implementor's business: `SourceCompute` reads them from an
/// `ExpertSource` in one `expert_ffn`; the expert cache plans its copies
/// first and computes in waves (`experts::CpuExpertCache`).
pub trait ExpertCompute {
    fn compute(
        &mut self,
        backend: &dyn Backend,
        layer: usize,
        groups: &[ExpertGroup],
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()>;
}

/// `ExpertCompute` over an `ExpertSource`: every group in one `expert_ffn`.
pub struct SourceCompute<'a>(pub &'a dyn ExpertSource);

impl ExpertCompute for SourceCompute<'_> {
    fn compute(
        &mut self,
        backend: &dyn Backend,
        layer: usize,
        groups: &[ExpertGroup],
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()> {
        let work = groups
            .iter()
            .map(|g| Ok(ExpertRows { weights: self.0.expert(layer, g.expert)?, rows: g.tokens.len() }))
            .collect::<Result<Vec<_>>>()?;
        backend.expert_ffn(&work, x, y);
        Ok(())
    }
}

/// `ExpertCompute` with prefill help: the groups are cut in two contiguous
/// runs, the first computed on the pipeline's backend (the active stage)
/// and the rest on `helper` (an idle stage), at the same time, each into
/// its own slice of `y`. Every row is computed from its own input by the
/// same arithmetic whichever device computes it, so the result equals the
/// unhelped pipeline's.
pub struct HelpedCompute<'a> {
    source: &'a dyn ExpertSource,
    helper: &'a dyn Backend,
    /// The fraction of the rows the helper takes, in `0..=1`.
    share: f64,
    timing: HelpTiming,
}

impl<'a> HelpedCompute<'a> {
    pub fn new(source: &'a dyn ExpertSource, helper: &'a dyn Backend, share: f64) -> HelpedCompute<'a> {
        HelpedCompute { source, helper, share: share.clamp(0.0, 1.0), timing: HelpTiming::default() }
    }

    /// The expert rows the helper computed so far.
    pub fn helper_rows(&self) -> usize {
        self.timing.helper_rows
    }

    /// Rows and seconds of each side so far.
    pub fn timing(&self) -> HelpTiming {
        self.timing
    }
}

/// What helped expert computations did: the rows each side computed and
/// the seconds it took (the two sides run at the same time), the measure
/// the engine's model of the devices' speeds learns from.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HelpTiming {
    pub own_rows: usize,
    pub own_seconds: f64,
    pub helper_rows: usize,
    pub helper_seconds: f64,
}

impl HelpTiming {
    pub fn add(&mut self, o: HelpTiming) {
        self.own_rows += o.own_rows;
        self.own_seconds += o.own_seconds;
        self.helper_rows += o.helper_rows;
        self.helper_seconds += o.helper_seconds;
    }
}

/// Where to cut `groups` so that the groups after the cut hold about
/// `share` of the rows (a group is never cut): the number of groups the
/// active device keeps (`help_cut_rows`).
pub fn help_cut(groups: &[ExpertGroup], share: f64) -> usize {
    help_cut_rows(groups.iter().map(|g| g.tokens.len()), share)
}

/// The rule of prefill help on every device: given the rows of each group
/// (expert) in order, the number of leading groups the active device keeps
/// so that the rest hold about `share` of all rows: the cut whose helper
/// rows are nearest the target, the first such cut on ties.
pub fn help_cut_rows(rows: impl Iterator<Item = usize> + Clone, share: f64) -> usize {
    let total: usize = rows.clone().sum();
    let keep = total as f64 * (1.0 - share.clamp(0.0, 1.0));
    let mut best = (0, keep);
    let mut kept = 0;
    for (k, r) in rows.enumerate() {
        kept += r;
        let miss = (kept as f64 - keep).abs();
        if miss < best.1 {
            best = (k + 1, miss);
        }
    }
    best.0
}

impl ExpertCompute for HelpedCompute<'_> {
    fn compute(
        &mut self,
        backend: &dyn Backend,
        layer: usize,
        groups: &[ExpertGroup],
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()> {
        let (source, helper) = (self.source, self.helper);
        let timing = compute_helped(
            groups,
            self.share,
            x,
            y,
            |own, x, y| SourceCompute(source).compute(backend, layer, own, x, y),
            |helped, x, y| SourceCompute(source).compute(helper, layer, helped, x, y),
        )?;
        self.timing.add(timing);
        Ok(())
    }
}

/// Prefill help's split, for every `ExpertCompute` that helps: `groups`
/// (their rows of `x` and `y` in group order) are cut at `help_cut`, and
/// `mine` computes the first part while `theirs` (on another thread: the
/// helper) computes the rest. Returns each side's rows and seconds.
pub fn compute_helped<'g>(
    groups: &'g [ExpertGroup],
    share: f64,
    x: &[f32],
    y: &mut [f32],
    mine: impl FnOnce(&'g [ExpertGroup], &[f32], &mut [f32]) -> Result<()>,
    theirs: impl FnOnce(&'g [ExpertGroup], &[f32], &mut [f32]) -> Result<()> + Send,
) -> Result<HelpTiming> {
    let (own, helped) = groups.split_at(help_cut(groups, share));
    let rows = |gs: &[ExpertGroup]| gs.iter().map(|g| g.tokens.len()).sum::<usize>();
    let hidden = x.len().checked_div(rows(groups)).unwrap_or(0);
    let (x_own, x_helped) = x.split_at(rows(own) * hidden);
    let (y_own, y_helped) = y.split_at_mut(rows(own) * hidden);
    let (a, b) = std::thread::scope(|scope| {
        let b = scope.spawn(|| {
            let began = std::time::Instant::now();
            theirs(helped, x_helped, y_helped).map(|()| began.elapsed().as_secs_f64())
        });
        let began = std::time::Instant::now();
        let a = mine(own, x_own, y_own).map(|()| began.elapsed().as_secs_f64());
        (a, b.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    });
    Ok(HelpTiming { own_rows: rows(own), own_seconds: a?, helper_rows: rows(helped), helper_seconds: b? })
}

/// The whole pipeline for `h [T, hidden]` (already normalized): writes the
/// MoE output into `out [T, hidden]` and returns the routing.
pub fn forward(
    backend: &dyn Backend,
    experts: &dyn ExpertSource,
    moe: &MoeLayer<'_>,
    h: &[f32],
    out: &mut [f32],
) -> Result<Routing> {
    forward_with(backend, &mut SourceCompute(experts), moe, h, out)
}

/// `forward` with the expert step given as an `ExpertCompute`: the one
/// orchestration of route, group, gather, compute and combine.
pub fn forward_with(
    backend: &dyn Backend,
    experts: &mut dyn ExpertCompute,
    moe: &MoeLayer<'_>,
    h: &[f32],
    out: &mut [f32],
) -> Result<Routing> {
    let (num_experts, hidden) = (moe.router.rows, moe.router.cols);
    let tokens = h.len() / hidden;
    let mut logits = vec![0.0f32; tokens * num_experts];
    backend.matmul(h, moe.router, &mut logits);
    let routing = route(&logits, num_experts, moe.top_k, moe.norm_topk_prob);
    let groups = group_by_expert(&routing);
    let x = gather(h, hidden, &groups);
    let mut y = vec![0.0f32; x.len()];
    experts.compute(backend, moe.layer, &groups, &x, &mut y)?;
    out.fill(0.0);
    combine(&groups, &y, hidden, out);
    Ok(routing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ops::expert_ffn_row;
    use crate::backend::CpuBackend;
    use crate::error::Error;
    use crate::quant::nvfp4::{quantize, Nvfp4Owned};
    use crate::rng::Rng;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn route_softmax_topk_and_renormalization() {
        // Probabilities of [0, ln 2, ln 3, ln 4] are [1, 2, 3, 4] / 10.
        let logits = [0.0, 2f32.ln(), 3f32.ln(), 4f32.ln()];
        let plain = route(&logits, 4, 2, false);
        assert_eq!(plain.experts, vec![3, 2]);
        assert!(close(plain.weights[0], 0.4) && close(plain.weights[1], 0.3), "{:?}", plain.weights);
        let norm = route(&logits, 4, 2, true);
        assert_eq!(norm.experts, vec![3, 2]);
        assert!(close(norm.weights[0], 4.0 / 7.0) && close(norm.weights[1], 3.0 / 7.0));
        // top_k == num_experts with renormalization: the full softmax.
        let all = route(&logits, 4, 4, true);
        assert!(close(all.weights.iter().sum::<f32>(), 1.0));
        assert!(close(all.weights[3], 0.1));
    }

    #[test]
    fn route_ties_prefer_the_lower_expert_and_rows_are_independent() {
        let logits = [1.0, 5.0, 5.0, 5.0, /* token 1 */ 2.0, 0.0, 2.0, -1.0];
        let r = route(&logits, 4, 2, true);
        assert_eq!(r.tokens(), 2);
        assert_eq!(r.token(0).0, &[1, 2]);
        assert_eq!(r.token(1).0, &[0, 2]);
        assert!(close(r.token(0).1[0], 0.5) && close(r.token(1).1[1], 0.5));
        // Softmax is per token: shifting token 1's logits does not change token 0.
        let shifted = [1.0, 5.0, 5.0, 5.0, 102.0, 100.0, 102.0, 99.0];
        assert_eq!(route(&shifted, 4, 2, true), r);
    }

    #[test]
    fn group_by_expert_round_trips_the_routing() {
        let routing =
            Routing { top_k: 2, experts: vec![3, 1, 1, 0, 3, 2], weights: vec![0.6, 0.4, 0.7, 0.3, 0.55, 0.45] };
        let groups = group_by_expert(&routing);
        let ids: Vec<usize> = groups.iter().map(|g| g.expert).collect();
        assert_eq!(ids, vec![0, 1, 2, 3]);
        assert_eq!(groups[1].tokens, vec![0, 1]);
        assert_eq!(groups[1].weights, vec![0.4, 0.7]);
        assert_eq!(groups[3].tokens, vec![0, 2]);
        // Rebuild each token's (expert, weight) set from the groups.
        let mut rebuilt: Vec<Vec<(usize, f32)>> = vec![vec![]; 3];
        for g in &groups {
            for (&t, &w) in g.tokens.iter().zip(&g.weights) {
                rebuilt[t].push((g.expert, w));
            }
        }
        for (t, got) in rebuilt.iter().enumerate() {
            let (e, w) = routing.token(t);
            let mut want: Vec<(usize, f32)> = e.iter().copied().zip(w.iter().copied()).collect();
            want.sort_by_key(|p| p.0);
            assert_eq!(got, &want, "token {t}");
        }
        assert_eq!(groups.iter().map(|g| g.tokens.len()).sum::<usize>(), 6);
    }

    #[test]
    fn gather_and_combine_weight_each_row() {
        let hidden = 2;
        let h = [1.0, 2.0, 3.0, 4.0];
        let groups = vec![
            ExpertGroup { expert: 0, tokens: vec![1], weights: vec![0.5] },
            ExpertGroup { expert: 5, tokens: vec![0, 1], weights: vec![0.25, 2.0] },
        ];
        let x = gather(&h, hidden, &groups);
        assert_eq!(x, vec![3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
        // Pretend every expert output is (10 * row + 1, 10 * row + 2).
        let y = [1.0, 2.0, 11.0, 12.0, 21.0, 22.0];
        let mut out = vec![0.0; 4];
        combine(&groups, &y, hidden, &mut out);
        // token 0: 0.25 * (11, 12); token 1: 0.5 * (1, 2) + 2 * (21, 22)
        assert_eq!(out, vec![2.75, 3.0, 42.5, 45.0]);
    }

    #[test]
    fn help_cut_gives_the_helper_about_its_share_of_rows_without_cutting_a_group() {
        let g = |expert, rows: usize| ExpertGroup { expert, tokens: (0..rows).collect(), weights: vec![1.0; rows] };
        let groups = vec![g(0, 4), g(1, 1), g(2, 3), g(3, 2)];
        assert_eq!(help_cut(&groups, 0.0), 4);
        assert_eq!(help_cut(&groups, 1.0), 0);
        // 10 rows, half to the helper: keep 4 + 1 = 5.
        assert_eq!(help_cut(&groups, 0.5), 2);
        // A third (3.3 rows) to the helper: keeping 8 (helper 2) misses by 1.3, keeping 5 by 1.7.
        assert_eq!(help_cut(&groups, 1.0 / 3.0), 3);
        assert_eq!(help_cut(&[], 0.5), 0);
    }

    struct Experts(Vec<[Nvfp4Owned; 3]>);

    impl ExpertSource for Experts {
        fn expert(&self, layer: usize, expert: usize) -> Result<ExpertView<'_>> {
            let m = self.0.get(expert).ok_or_else(|| Error::InvalidArgument(format!("{layer}/{expert}")))?;
            Ok(ExpertView { gate: m[0].view(), up: m[1].view(), down: m[2].view(), blob: &[] })
        }
    }

    impl Experts {
        /// `n` experts of random NVFP4 gate, up and down matrices from `rand(len, std)`.
        fn random(rand: &mut impl FnMut(usize, f32) -> Vec<f32>, n: usize, hidden: usize, inter: usize) -> Experts {
            Experts(
                (0..n)
                    .map(|_| {
                        [
                            quantize(&rand(inter * hidden, 0.2), inter, hidden),
                            quantize(&rand(inter * hidden, 0.05), inter, hidden),
                            quantize(&rand(hidden * inter, 0.1), hidden, inter),
                        ]
                    })
                    .collect(),
            )
        }
    }

    #[test]
    fn forward_equals_per_token_weighted_sum() {
        let (hidden, inter, n_exp, top_k, tokens) = (32, 16, 4, 2, 5);
        let mut r = Rng::new(3);
        let mut rand = |n: usize, std: f32| (0..n).map(|_| r.normal() * std).collect::<Vec<f32>>();
        let experts = Experts::random(&mut rand, n_exp, hidden, inter);
        let router = Matrix::new(n_exp, hidden, rand(n_exp * hidden, 0.5));
        let h = rand(tokens * hidden, 1.0);
        let backend = CpuBackend::new(None).unwrap();
        for norm in [false, true] {
            let moe = MoeLayer { layer: 0, router: &router, top_k, norm_topk_prob: norm };
            let mut out = vec![0.0; tokens * hidden];
            let routing = forward(&backend, &experts, &moe, &h, &mut out).unwrap();
            let sums: Vec<f32> = (0..tokens).map(|t| routing.token(t).1.iter().sum()).collect();
            if norm {
                assert!(sums.iter().all(|&s| close(s, 1.0)), "{sums:?}");
            } else {
                assert!(sums.iter().all(|&s| s < 0.999), "{sums:?}");
            }
            for t in 0..tokens {
                let xr = &h[t * hidden..(t + 1) * hidden];
                let mut want = vec![0.0f32; hidden];
                let mut y = vec![0.0f32; hidden];
                let (es, ws) = routing.token(t);
                let mut pairs: Vec<(usize, f32)> = es.iter().copied().zip(ws.iter().copied()).collect();
                pairs.sort_by_key(|p| p.0);
                for (e, w) in pairs {
                    expert_ffn_row(&experts.expert(0, e).unwrap(), xr, &mut y);
                    for (o, v) in want.iter_mut().zip(&y) {
                        *o += w * v;
                    }
                }
                assert_eq!(&out[t * hidden..(t + 1) * hidden], &want[..], "token {t}");
            }
        }
    }

    #[test]
    fn helped_forward_equals_the_plain_forward_bit_for_bit() {
        let (hidden, inter, n_exp, top_k, tokens) = (32, 16, 6, 2, 9);
        let mut r = Rng::new(7);
        let mut rand = |n: usize, std: f32| (0..n).map(|_| r.normal() * std).collect::<Vec<f32>>();
        let experts = Experts::random(&mut rand, n_exp, hidden, inter);
        let router = Matrix::new(n_exp, hidden, rand(n_exp * hidden, 0.5));
        let h = rand(tokens * hidden, 1.0);
        let moe = MoeLayer { layer: 0, router: &router, top_k, norm_topk_prob: true };
        let (active, helper) = (CpuBackend::new(Some(1)).unwrap(), CpuBackend::new(Some(2)).unwrap());
        let mut plain = vec![0.0; tokens * hidden];
        forward(&active, &experts, &moe, &h, &mut plain).unwrap();
        for share in [0.0, 0.3, 0.5, 1.0] {
            let mut help = HelpedCompute::new(&experts, &helper, share);
            let mut out = vec![0.0; tokens * hidden];
            forward_with(&active, &mut help, &moe, &h, &mut out).unwrap();
            assert_eq!(out, plain, "share {share}");
            let want = if share == 0.0 {
                0
            } else if share == 1.0 {
                tokens * top_k
            } else {
                1
            };
            assert!(help.helper_rows() >= want && help.helper_rows() <= tokens * top_k, "share {share}");
        }
    }

    #[test]
    fn forward_reports_a_missing_expert() {
        let router = Matrix::new(8, 16, vec![0.0; 128]);
        let moe = MoeLayer { layer: 0, router: &router, top_k: 1, norm_topk_prob: true };
        let backend = CpuBackend::new(None).unwrap();
        let mut out = vec![0.0; 16];
        let e = forward(&backend, &Experts(vec![]), &moe, &[1.0; 16], &mut out).unwrap_err();
        assert!(e.to_string().contains("0/0"), "{e}");
    }

    #[test]
    fn help_cuts_where_the_helper_gets_nearest_its_share() {
        // Rows per expert 4, 0, 6, 2, 8 (20 in all); the cut is the number
        // of experts the active device keeps.
        let rows = [4usize, 0, 6, 2, 8];
        let cut = |share| help_cut_rows(rows.iter().copied(), share);
        // Half: experts 3.. have 10 rows, exactly half.
        assert_eq!(cut(0.5), 3);
        // A quarter (5 rows): expert 4 alone (8 rows, 3 off) beats experts
        // 3.. (10, 5 off) and none (0, 5 off).
        assert_eq!(cut(0.25), 4);
        // Nothing; everything.
        assert_eq!(cut(0.0), 5);
        assert_eq!(cut(1.0), 0);
        // 16 rows: cuts 1 and 2 tie (expert 1 is empty): the first.
        assert_eq!(cut(0.8), 1);
        // No rows at all: every cut ties, the first.
        assert_eq!(help_cut_rows([0usize, 0].into_iter(), 0.5), 0);
    }
}
