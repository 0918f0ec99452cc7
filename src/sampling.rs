//! Token sampling: greedy, or temperature then top-k, top-p and min-p
//! filters and a seeded draw (the crate's xoshiro256** `Rng`; with the
//! integer arithmetic of `Ranked` below, a seed gives the same tokens on
//! every platform). A draw costs a few passes over the vocabulary, not a
//! sort of it.

use crate::error::{Error, Result};
use crate::rng::Rng;
use rayon::prelude::*;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the k most probable tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-probable set whose mass reaches top_p; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * p_max`; 0 = off.
    pub min_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    /// Whether every draw is the argmax (temperature 0, or top-k 1): no
    /// random numbers used.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

impl Default for SamplingParams {
    /// Greedy.
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

/// Index of the largest value; the lowest index on ties. `values` must be
/// non-empty and finite.
fn argmax(values: &[f32]) -> usize {
    // Per block of 64, the largest value in 8 independent lanes
    // (vectorized: a decode step scans the whole vocabulary); the first
    // block whose maximum is strictly larger than every earlier one holds
    // the answer, found there by position. The same result as a scan that
    // keeps the first strictly larger value, for finite input (callers
    // check that first).
    const B: usize = 64;
    let (mut best, mut block) = (f32::NEG_INFINITY, 0usize);
    for (bi, c) in values.chunks(B).enumerate() {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let eights = c.chunks_exact(8);
        let tail = eights.remainder();
        for q in eights {
            for (m, &v) in lanes.iter_mut().zip(q) {
                *m = if v > *m { v } else { *m };
            }
        }
        let m = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        if m > best {
            (best, block) = (m, bi);
        }
    }
    let c = &values[(block * B).min(values.len())..(block * B + B).min(values.len())];
    block * B + c.iter().position(|&v| v == best).unwrap_or(0)
}

/// The most logits a draw takes: their masses (each at most 2^40) add in
/// a u64. (A model's vocabulary is at most 2^22 tokens.)
pub const MAX_LOGITS: usize = 1 << 23;

/// Logits a sampler can draw from: not empty, at most `MAX_LOGITS`, every
/// value finite.
pub(crate) fn check_samplable(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::InvalidArgument("no logits to sample from".into()));
    }
    if logits.len() > MAX_LOGITS {
        return Err(Error::InvalidArgument(format!("{} logits: a draw takes at most {MAX_LOGITS}", logits.len())));
    }
    if let Some(i) = first_nonfinite(logits) {
        let v = logits[i];
        return Err(Error::InvalidArgument(format!("logit {i} is {v}: cannot sample from non-finite logits")));
    }
    Ok(())
}

/// The index of the first NaN or infinity in `values`, if any: checked 64
/// at a time (vectorized), the exact index found only in a failing block.
pub(crate) fn first_nonfinite(values: &[f32]) -> Option<usize> {
    const B: usize = 64;
    values
        .chunks(B)
        .enumerate()
        .find(|(_, c)| !c.iter().fold(true, |ok, v| ok & v.is_finite()))
        .and_then(|(b, c)| c.iter().position(|v| !v.is_finite()).map(|i| b * B + i))
}

impl Sampler {
    /// Checks the parameters: temperature finite and >= 0, top_p in (0, 1],
    /// min_p in [0, 1].
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        let p = &params;
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            return Err(Error::InvalidArgument(format!("temperature {} must be a finite number >= 0", p.temperature)));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!("top_p {} must be in (0, 1]", p.top_p)));
        }
        if !(p.min_p >= 0.0 && p.min_p <= 1.0) {
            return Err(Error::InvalidArgument(format!("min_p {} must be in [0, 1]", p.min_p)));
        }
        Ok(Sampler { rng: Rng::new(params.seed), params })
    }

    /// A sampler with `params` whose random stream continues from `rng`
    /// (a saved session state).
    pub fn with_rng(params: SamplingParams, rng: Rng) -> Result<Sampler> {
        Ok(Sampler { rng, ..Sampler::new(params)? })
    }

    /// The random stream; `rng().state()` saves it.
    pub fn rng(&self) -> &Rng {
        &self.rng
    }

    /// Greedy sampling (the default parameters).
    pub fn greedy() -> Sampler {
        Sampler::new(SamplingParams::default()).expect("default parameters are valid")
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The distribution a draw picks from: `(token, probability)` after the
    /// temperature and the filters, renormalized, most probable first (ties:
    /// lower token first). Greedy gives the argmax with probability 1.
    /// (The draw's arithmetic is the module's `Ranked`: probabilities below
    /// 2^-40 of the most probable token's are zero and not listed.)
    pub fn probabilities(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        check_samplable(logits)?;
        let p = &self.params;
        if p.is_greedy() {
            return Ok(vec![(argmax(logits) as u32, 1.0)]);
        }
        let mut r = Ranked::new(logits, p.temperature);
        let n = self.kept(&mut r);
        let total = r.prefix_mass(n) as f64;
        r.sort_prefix(n);
        Ok((0..n).map(|i| r.entry(i)).map(|e| (e.id(), mass(e.bits) as f64 / total)).collect())
    }

    /// How many of `r`'s entries (a prefix of its order) the filters keep:
    /// top-k, then top-p over the mass of what top-k kept, then min-p
    /// relative to the most probable token. At least 1.
    fn kept(&self, r: &mut Ranked<'_>) -> usize {
        let p = &self.params;
        let mut n = r.len();
        if p.top_k > 0 {
            n = n.min(p.top_k);
        }
        if p.top_p < 1.0 {
            // The shortest prefix whose mass reaches top_p of the kept mass.
            let m = r.prefix_mass(n);
            let target = ((m as f64 * p.top_p as f64).ceil() as u64).clamp(1, m);
            n = r.first_reaching(target);
        }
        if p.min_p > 0.0 {
            // The most probable token's weight is exactly 1 (e^0).
            n = n.min(r.count_at_least(p.min_p));
        }
        n.max(1)
    }

    /// Picks the next token from `logits` (one row, `vocab` values).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        check_samplable(logits)?;
        Ok(self.sample_checked(logits))
    }

    /// `sample` of logits known to be finite and not empty (a session's:
    /// the engine checked them): one scan of the vocabulary fewer per
    /// decode step. Costs a few scans of the vocabulary and a sort of the
    /// few tokens next to the cuts and the draw (a selection among them
    /// where they are many), not a sort of the vocabulary
    /// (docs/performance.md, nineteenth, twentieth and twenty-third sessions).
    pub(crate) fn sample_checked(&mut self, logits: &[f32]) -> u32 {
        debug_assert!(check_samplable(logits).is_ok(), "sample_checked of unchecked logits");
        let (token, used) = self.pick(logits, || self.rng.clone().next_f64());
        if used {
            self.rng.next_f64();
        }
        token
    }

    /// The token `sample_checked` picks from finite, non-empty `logits`
    /// with `u()` as the stream's next number, and whether it used that
    /// number (not for greedy parameters, nor when the filters keep one
    /// token). Changes nothing.
    fn pick(&self, logits: &[f32], u: impl FnOnce() -> f64) -> (u32, bool) {
        let p = &self.params;
        if p.is_greedy() {
            return (argmax(logits) as u32, false);
        }
        let mut r = Ranked::new(logits, p.temperature);
        let n = self.kept(&mut r);
        if n == 1 {
            return (r.entry(0).id(), false);
        }
        (draw(&mut r, n, u()), true)
    }

    /// What a device needs to make this sampler's next draw ahead of the
    /// step that asks for it (`Drawn`): the parameters, the random stream's
    /// state, and the number the draw would take from it.
    pub(crate) fn ahead(&self) -> DrawAhead {
        DrawAhead { params: self.params.clone(), rng: self.rng.state(), u: self.rng.clone().next_f64() }
    }

    /// The token of a draw made ahead (`ahead`), when it was made for this
    /// sampler as it is now (same parameters, same random state): the
    /// stream then moves on as `sample_checked` would have moved it.
    /// `None` leaves the sampler as it was.
    pub(crate) fn take_drawn(&mut self, d: &Drawn) -> Option<u32> {
        if d.params != self.params || d.rng != self.rng.state() {
            return None;
        }
        if d.used {
            self.rng.next_f64();
        }
        Some(d.token)
    }
}

/// A request to draw the next token on the device, right after the
/// forward that computes the logits it draws from: the sampler's state
/// when the request was made (`Sampler::ahead`).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DrawAhead {
    pub(crate) params: SamplingParams,
    pub(crate) rng: [u64; 4],
    /// The stream's next number: the draw's `u`.
    pub(crate) u: f64,
}

/// A draw made ahead on the device: the token `Sampler::sample_checked`
/// picks from the same logits for the sampler state of the request, and
/// whether it used the stream's next number. Held with the logits it was
/// drawn from (`HostLogits`), so it goes when they do.
#[derive(Clone, Debug)]
pub(crate) struct Drawn {
    pub(crate) params: SamplingParams,
    pub(crate) rng: [u64; 4],
    pub(crate) token: u32,
    pub(crate) used: bool,
}

/// The token a sampler of `params` picks from `logits` when `u` (in [0,
/// 1)) is its random stream's next number, and whether the pick uses `u`
/// (not for greedy parameters, nor when the filters keep one token): the
/// host's answer to a draw on the device (the GPU suite checks the device
/// against it).
pub fn pick_with(params: &SamplingParams, logits: &[f32], u: f64) -> Result<(u32, bool)> {
    if !(0.0..1.0).contains(&u) {
        return Err(Error::InvalidArgument(format!("u {u} must be in [0, 1)")));
    }
    check_samplable(logits)?;
    let s = Sampler::new(params.clone())?;
    Ok(s.pick(logits, || u))
}

/// The token `u` in [0, 1) picks among the first `n` (>= 1) of `r`: the
/// first whose running mass exceeds u times theirs (integers: no rounding
/// in the running sums).
fn draw(r: &mut Ranked<'_>, n: usize, u: f64) -> u32 {
    let total = r.prefix_mass(n);
    let below = ((u * total as f64) as u64).min(total - 1);
    let at = r.first_reaching(below + 1) - 1;
    r.entry(at).id()
}

// ---------------------------------------------------------------------------
// The arithmetic of a draw. Token i's weight is w_i = e^((l_i - max) / T) in
// f32 (`exp_neg`: a fixed sequence of IEEE operations, no libm, so the same
// bits on every platform), its mass the integer floor(w_i * 2^40); masses add
// exactly in u64 whatever the order, so the cuts and the draw do not
// depend on how the sums are grouped. The order is logit descending, then
// token ascending (so weight descending: ties of weight from distinct
// logits keep the logits' order, and the first token is the argmax). Tokens of zero mass (w < 2^-40) are out. Nothing sorts
// the vocabulary: one pass counts the tokens and their mass in buckets of
// weight (16 an octave, by the top bits of the f32), the cuts and the draw
// walk the buckets' masses, and only the tokens of a bucket in which one
// of them falls (and of the small buckets before it) are collected (a
// pass over the weights a placement) and sorted; a bucket of more than
// SORT_AT_MOST tokens (the bulk of a flat distribution, or near-flat
// weights at a very high temperature) is not sorted: a selection
// (expected linear) finds the entries there.

/// Fractional bits of a token's mass.
const MASS_BITS: i32 = 40;
/// The f32 bits of a weight shifted right by this: exponent and the top 4
/// bits of the mantissa, a key monotone in the (positive) weight.
const KEY_SHIFT: u32 = 19;
/// Key of the weight 1.0 (the largest) and of 2^-40 (the smallest with a mass).
const KEY_ONE: u32 = 1.0f32.to_bits() >> KEY_SHIFT;
const KEY_MIN: u32 = (1.0f32 / (1u64 << MASS_BITS) as f32).to_bits() >> KEY_SHIFT;
const BUCKETS: usize = (KEY_ONE - KEY_MIN + 1) as usize;
/// The largest bucket a cut or a draw sorts (the tests' value sends most
/// of their cases through the selection).
const SORT_AT_MOST: usize = if cfg!(test) { 64 } else { 1024 };
/// The most tokens a placement takes along from the buckets before the one
/// asked for (a later query often lands there; more would cost a step per
/// token for tokens no query may ask for). The tests' value makes their
/// queries place buckets in many small scans, in any order.
const PLACE_ALONG_AT_MOST: usize = if cfg!(test) { 256 } else { 4096 };

#[cfg(test)]
thread_local!(static SELECTIONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) });

/// Counts a query answered by selection (the tests bound how many a
/// caller makes: one a position would be quadratic).
#[inline(always)]
fn selecting() {
    #[cfg(test)]
    SELECTIONS.with(|c| c.set(c.get() + 1));
}

/// e^x for x <= 0, in f32 from IEEE operations only (Cephes' expf: x = n
/// ln2 + r, a degree-6 polynomial in r, times 2^n; rounding of n by the
/// 1.5 * 2^23 trick): about 1 ulp, and the same bits everywhere. x below -87
/// (or -inf) gives about 2^-126, below every mass.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    let x = if x > -87.0 { x } else { -87.0 };
    // t = ROUND + n exactly: n is also the difference of the bits.
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * 0.693_359_4) - n * -2.121_944_4e-4;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // n in [-126, 0]: 2^n is a normal f32.
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    y * f32::from_bits(((n_int + 127) as u32) << 23)
}

/// The weights of a piece of the logits (`out[i]`: the f32 bits of
/// exp_neg((l[i] - max) / temperature)) and their histogram: per bucket
/// (and `BUCKETS`: no mass) the count and the mass. On x86-64 with AVX2
/// (checked at run time) the arithmetic runs eight lanes wide, else as the
/// target's baseline vectorizes it: the same IEEE and integer operations
/// either way (nothing fused), so the same bits.
fn histogram(out: &mut [u32], l: &[f32], max: f32, temperature: f32) -> (Vec<usize>, Vec<u64>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked on the line above).
        return unsafe { histogram_avx2(out, l, max, temperature) };
    }
    histogram_any(out, l, max, temperature)
}

#[inline(always)]
fn histogram_any(out: &mut [u32], l: &[f32], max: f32, temperature: f32) -> (Vec<usize>, Vec<u64>) {
    // Two histograms, alternate tokens in each: a run of tokens in one
    // bucket (the bulk of a flat distribution) would otherwise wait on
    // the previous token's update of the same counters. Buckets and
    // masses first, in loops the compiler vectorizes, then the updates.
    const RUN: usize = 512;
    let mut count = [vec![0u32; BUCKETS + 1], vec![0u32; BUCKETS + 1]];
    let mut masses = [vec![0u64; BUCKETS + 1], vec![0u64; BUCKETS + 1]];
    let (mut bk, mut ms) = ([0u32; RUN], [0u64; RUN]);
    for (out, l) in out.chunks_mut(RUN).zip(l.chunks(RUN)) {
        for (o, &l) in out.iter_mut().zip(l) {
            *o = exp_neg((l - max) / temperature).to_bits();
        }
        for ((b, m), &w) in bk.iter_mut().zip(ms.iter_mut()).zip(out.iter()) {
            *b = bucket(w) as u32;
            *m = mass(w);
        }
        let n = out.len();
        for i in (0..n & !1).step_by(2) {
            let (b0, b1) = (bk[i] as usize, bk[i + 1] as usize);
            count[0][b0] += 1;
            masses[0][b0] += ms[i];
            count[1][b1] += 1;
            masses[1][b1] += ms[i + 1];
        }
        if n % 2 == 1 {
            count[0][bk[n - 1] as usize] += 1;
            masses[0][bk[n - 1] as usize] += ms[n - 1];
        }
    }
    (
        count[0].iter().zip(&count[1]).map(|(&a, &b)| a as usize + b as usize).collect(),
        masses[0].iter().zip(&masses[1]).map(|(&a, &b)| a + b).collect(),
    )
}

/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn histogram_avx2(out: &mut [u32], l: &[f32], max: f32, temperature: f32) -> (Vec<usize>, Vec<u64>) {
    histogram_any(out, l, max, temperature)
}

/// Per 64 weights, the mask of those whose key (`bits >> KEY_SHIFT`) lies
/// in [key_lo, key_hi]: on x86-64 with AVX2 (checked at run time) eight
/// compares at a time, else as the target's baseline vectorizes it.
fn hit_masks(bits: &[u32], key_lo: u32, key_hi: u32) -> Vec<u64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked on the line above).
        return unsafe { hit_masks_avx2(bits, key_lo, key_hi) };
    }
    hit_masks_any(bits, key_lo, key_hi)
}

#[inline(always)]
fn hit_masks_any(bits: &[u32], key_lo: u32, key_hi: u32) -> Vec<u64> {
    // key in [lo, hi] as one unsigned compare: key - lo <= hi - lo; a byte
    // (0 or 1) a weight, then each 8 bytes packed into 8 bits by one
    // multiply (byte i lands on bit 56 + i, nothing else reaches the top
    // byte, no carries).
    let span = key_hi.wrapping_sub(key_lo);
    bits.chunks(64)
        .map(|ws| {
            let mut hit = [0u8; 64];
            for (h, &w) in hit.iter_mut().zip(ws) {
                *h = ((w >> KEY_SHIFT).wrapping_sub(key_lo) <= span) as u8;
            }
            hit.chunks_exact(8).enumerate().fold(0u64, |m, (g, b)| {
                let x = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                m | (x.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * g)
            })
        })
        .collect()
}

/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hit_masks_avx2(bits: &[u32], key_lo: u32, key_hi: u32) -> Vec<u64> {
    hit_masks_any(bits, key_lo, key_hi)
}

/// A weight's mass, floor(w * 2^MASS_BITS) = floor(w * 2^40), from its f32 bits (w in (0, 1]: m *
/// 2^(e - 150) with m the mantissa and its implicit bit). At most 2^40, so
/// the masses of a vocabulary (at most 2^22 tokens) add in a u64.
#[inline(always)]
fn mass(bits: u32) -> u64 {
    // floor(m * 2^(e - 110)) = (m * 2^23) >> (133 - e); branch-free (the
    // histogram's loop would mispredict), 0 below 2^-40 (the shift capped).
    let (e, m) = (bits >> 23, ((bits & 0x7f_ffff) | 0x80_0000) as u64);
    (m << 23) >> 133u32.saturating_sub(e).min(63)
}

/// A weight's bucket (0: the most probable), or `BUCKETS` when it has no mass.
#[inline(always)]
fn bucket(bits: u32) -> usize {
    let key = bits >> KEY_SHIFT;
    debug_assert!(key <= KEY_ONE, "a weight above 1");
    if key >= KEY_MIN {
        (KEY_ONE - key.min(KEY_ONE)) as usize
    } else {
        BUCKETS
    }
}

/// A token of a bucket: its place in the order and its weight's bits.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// `order_key`: smaller is more probable.
    key: u64,
    bits: u32,
}

impl Entry {
    fn new(bits: u32, id: u32, logit: f32) -> Entry {
        Entry { key: order_key(logit, id), bits }
    }

    fn id(&self) -> u32 {
        self.key as u32
    }
}

/// The order: logit descending, then token ascending. Distinct logits can
/// round to one f32 weight (high temperatures, near-equal logits), and the
/// logit order keeps the argmax first and top-k nested. It refines the
/// weight order (exp_neg and the division are monotone), so the buckets
/// and the cuts by weight hold. As one integer (compares without
/// branches): the finite logit's bits made monotone as an unsigned number
/// (-0 as +0), inverted, above the token. kernels/sampling.cu's
/// `samp_key` is the same.
fn order_key(logit: f32, id: u32) -> u64 {
    let b = if logit == 0.0 { 0 } else { logit.to_bits() };
    let monotone = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (!monotone as u64) << 32 | id as u64
}

fn order(x: &Entry, y: &Entry) -> std::cmp::Ordering {
    x.key.cmp(&y.key)
}

/// The smallest j >= 1 whose first j entries of `run` (in `order`) have a
/// mass of at least `need` (1 <= need <= the mass of all of them), by
/// selection: each round puts the middle rank of the range in place, the
/// better ones before it, and keeps the half the answer lies in. Expected
/// linear in the length; `run` is left permuted, with the answer's last
/// entry in place. Returns j and the mass of the first j.
fn select_reaching(run: &mut [Entry], need: u64) -> (usize, u64) {
    debug_assert!(need >= 1 && need <= run.iter().map(|e| mass(e.bits)).sum::<u64>(), "need {need}");
    // The answer is in (lo, hi]; the first lo entries are the lo best, of
    // mass `above` < need.
    let (mut lo, mut hi, mut above) = (0, run.len(), 0u64);
    loop {
        let mid = lo + (hi - lo) / 2;
        run[lo..hi].select_nth_unstable_by(mid - lo, order);
        let left: u64 = run[lo..mid].iter().map(|e| mass(e.bits)).sum();
        if above + left >= need {
            hi = mid;
            continue;
        }
        let with = above + left + mass(run[mid].bits);
        if with >= need {
            return (mid + 1, with);
        }
        (above, lo) = (with, mid + 1);
    }
}

/// The tokens of non-zero mass by buckets of their weight, most probable
/// bucket first: per bucket its count and mass; its tokens once something
/// needs them (placed by a scan of the weights, with the small unplaced
/// buckets before it),
/// sorted (`order`) on first use unless there are more than SORT_AT_MOST.
struct Ranked<'a> {
    logits: &'a [f32],
    /// The weights' f32 bits, by token.
    bits: Vec<u32>,
    /// Bucket b holds the positions start[b]..start[b + 1] of the order.
    start: Vec<usize>,
    masses: Vec<u64>,
    /// Each bucket's tokens once placed, else empty (`placed`).
    runs: Vec<Vec<Entry>>,
    sorted: Vec<bool>,
    /// What the last selection found (facts of the order, whatever the
    /// permutations since): the entry at a position, and the mass of a
    /// prefix. A draw asks for both right after the selection that found
    /// them.
    known_entry: Option<(usize, Entry)>,
    known_prefix: Option<(usize, u64)>,
}

impl<'a> Ranked<'a> {
    /// Weights at `temperature` (> 0) of finite, non-empty `logits`.
    fn new(logits: &'a [f32], temperature: f32) -> Ranked<'a> {
        let max = logits[argmax(logits)];
        let mut bits = vec![0u32; logits.len()];
        // Pieces of PIECE tokens on rayon's threads, each with its own
        // histogram: the sums are integers, so the result does not depend
        // on how the pieces are shared out. Within a piece, runs that stay
        // in L1: the weights (a loop the compiler vectorizes: exp_neg is
        // branch-free), then their buckets.
        const PIECE: usize = 1 << 14;
        let histogram = |(out, l): (&mut [u32], &[f32])| histogram(out, l, max, temperature);
        let add = |mut x: (Vec<usize>, Vec<u64>), y: (Vec<usize>, Vec<u64>)| {
            x.0.iter_mut().zip(&y.0).for_each(|(a, b)| *a += b);
            x.1.iter_mut().zip(&y.1).for_each(|(a, b)| *a += b);
            x
        };
        let (count, masses) = if logits.len() > PIECE {
            bits.par_chunks_mut(PIECE).zip(logits.par_chunks(PIECE)).map(histogram).reduce_with(add)
        } else {
            None
        }
        .unwrap_or_else(|| histogram((&mut bits, logits)));
        let mut start = Vec::with_capacity(BUCKETS + 1);
        start.push(0usize);
        for c in &count[..BUCKETS] {
            start.push(start[start.len() - 1] + c);
        }
        let masses = masses[..BUCKETS].to_vec();
        Ranked {
            logits,
            bits,
            start,
            masses,
            runs: vec![Vec::new(); BUCKETS],
            sorted: vec![false; BUCKETS],
            known_entry: None,
            known_prefix: None,
        }
    }

    /// Tokens of non-zero mass (at least the most probable one).
    fn len(&self) -> usize {
        self.start[BUCKETS]
    }

    /// Whether bucket b is answered by selection, not by a sort.
    fn selects(&self, b: usize) -> bool {
        !self.sorted[b] && self.size(b) > SORT_AT_MOST
    }

    /// Bucket b's tokens in order.
    fn members(&mut self, b: usize) -> &[Entry] {
        self.placed_members(b);
        let sorted = std::mem::replace(&mut self.sorted[b], true);
        let run = &mut self.runs[b][..];
        if !sorted {
            run.sort_unstable_by(order);
        }
        run
    }

    /// Tokens in bucket b.
    fn size(&self, b: usize) -> usize {
        self.start[b + 1] - self.start[b]
    }

    /// Whether bucket b's tokens are in its run (a placement fills a run
    /// whole; an empty bucket has nothing to place).
    fn placed(&self, b: usize) -> bool {
        self.runs[b].len() == self.size(b)
    }

    /// Bucket b's tokens, in order if it has been sorted.
    fn placed_members(&mut self, b: usize) -> &mut [Entry] {
        if !self.placed(b) {
            // Place b, and with it the unplaced buckets before it (more
            // probable) while they hold few tokens: the needs after a cut
            // (the next cut, the draw) lie at or before it, so one scan
            // serves them. Not the bulk of a flat distribution, nor what
            // lies past b: a scan costs a pass over the weights and a step
            // per token placed.
            let (mut lo, hi, mut extra) = (b, b + 1, 0);
            while lo > 0 && !self.placed(lo - 1) && extra + self.size(lo - 1) <= PLACE_ALONG_AT_MOST {
                lo -= 1;
                extra += self.size(lo);
            }
            for k in lo..hi {
                self.runs[k] = Vec::with_capacity(self.size(k));
            }
            // Buckets lo..hi are the keys (KEY_ONE - hi, KEY_ONE - lo]: a
            // mask of the matches per 64 weights (a loop the compiler
            // vectorizes), then the few matches one by one, in token order.
            let (key_lo, key_hi) = (KEY_ONE - hi as u32 + 1, KEY_ONE - lo as u32);
            let masks = hit_masks(&self.bits, key_lo, key_hi);
            for (c, (ws, mut hits)) in self.bits.chunks(64).zip(masks).enumerate() {
                while hits != 0 {
                    let j = hits.trailing_zeros() as usize;
                    hits &= hits - 1;
                    let w = ws[j];
                    let id = c * 64 + j;
                    self.runs[bucket(w)].push(Entry::new(w, id as u32, self.logits[id]));
                }
            }
        }
        &mut self.runs[b][..]
    }

    /// Sorts the buckets of the first `n` entries (`entry` of each of them
    /// then costs no selection).
    fn sort_prefix(&mut self, n: usize) {
        if n > 0 {
            // Deepest first: each placement then takes the small buckets
            // before it along (one pass, not one a bucket).
            for b in (0..=self.bucket_of(n - 1)).rev() {
                self.members(b);
            }
        }
    }

    /// The bucket holding position `i` (< len).
    fn bucket_of(&self, i: usize) -> usize {
        self.start.partition_point(|&s| s <= i) - 1
    }

    /// The entry at position `i` of the order.
    fn entry(&mut self, i: usize) -> Entry {
        let b = self.bucket_of(i);
        let j = i - self.start[b];
        if self.selects(b) {
            if let Some((_, e)) = self.known_entry.filter(|k| k.0 == i) {
                return e;
            }
            selecting();
            let run = self.placed_members(b);
            let e = *run.select_nth_unstable_by(j, order).1;
            self.known_entry = Some((i, e));
            return e;
        }
        self.members(b)[j]
    }

    /// The mass of the first `n` entries.
    fn prefix_mass(&mut self, n: usize) -> u64 {
        if n == 0 {
            return 0;
        }
        let last = self.bucket_of(n - 1);
        let (whole, first): (u64, usize) = (self.masses[..last].iter().sum(), self.start[last]);
        if n == self.start[last + 1] {
            return whole + self.masses[last];
        }
        if let Some((_, m)) = self.known_prefix.filter(|k| k.0 == n) {
            return m;
        }
        let j = n - first;
        let sum = |run: &[Entry]| whole + run[..j].iter().map(|e| mass(e.bits)).sum::<u64>();
        if !self.selects(last) {
            return sum(self.members(last));
        }
        selecting();
        let run = self.placed_members(last);
        let at_n = *run.select_nth_unstable_by(j, order).1;
        let m = sum(run);
        (self.known_entry, self.known_prefix) = (Some((n, at_n)), Some((n, m)));
        m
    }

    /// The smallest n whose prefix has a mass of at least `target` (1 <=
    /// target <= the mass of all entries; else the length).
    fn first_reaching(&mut self, target: u64) -> usize {
        let mut acc = 0u64;
        for b in 0..BUCKETS {
            if acc + self.masses[b] >= target {
                let first = self.start[b];
                if self.selects(b) {
                    selecting();
                    let run = self.placed_members(b);
                    let (j, m) = select_reaching(run, target - acc);
                    self.known_entry = Some((first + j - 1, run[j - 1]));
                    self.known_prefix = Some((first + j, acc + m));
                    return first + j;
                }
                for (i, e) in self.members(b).iter().enumerate() {
                    acc += mass(e.bits);
                    if acc >= target {
                        return first + i + 1;
                    }
                }
                break;
            }
            acc += self.masses[b];
        }
        self.len()
    }

    /// How many entries weigh at least `w` (in (0, 1]).
    fn count_at_least(&mut self, w: f32) -> usize {
        let b = bucket(w.to_bits());
        if b >= BUCKETS {
            return self.len();
        }
        let first = self.start[b];
        if self.selects(b) {
            // The weight falls along the order: count, in any order.
            return first + self.placed_members(b).iter().filter(|e| f32::from_bits(e.bits) >= w).count();
        }
        first + self.members(b).partition_point(|e| f32::from_bits(e.bits) >= w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_first_nonfinite_match_plain_scans() {
        let mut rng = crate::rng::Rng::new(3);
        for n in [1usize, 7, 8, 9, 63, 64, 65, 1000, 151_936] {
            let mut x: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 1000) as f32 - 500.0).collect();
            let plain = |x: &[f32]| {
                let mut best = 0;
                for (i, &v) in x.iter().enumerate() {
                    if v > x[best] {
                        best = i;
                    }
                }
                best
            };
            // Many ties (1000 distinct values): the first index of the maximum wins.
            assert_eq!(argmax(&x), plain(&x), "n = {n}");
            assert_eq!(first_nonfinite(&x), None);
            for (bad, v) in [(n - 1, f32::NAN), (n / 2, f32::INFINITY), (n / 3, f32::NEG_INFINITY)] {
                x[bad] = v;
                let want = x.iter().position(|v| !v.is_finite());
                assert_eq!(first_nonfinite(&x), want, "n = {n}, bad at {bad}");
            }
        }
        assert_eq!(argmax(&[f32::NEG_INFINITY; 5]), 0);
    }

    fn sampler(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams { temperature, top_k, top_p, min_p, seed }).unwrap()
    }

    /// Logits whose softmax at temperature 1 is `probs`.
    fn logits_for(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let mut s = Sampler::greedy();
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 3.0]).unwrap(), 1);
        assert_eq!(s.sample(&[-5.0]).unwrap(), 0);
        assert_eq!(s.sample(&[-1.0, -1.0]).unwrap(), 0);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let logits = [0.5, 1.0, 0.99, -3.0, 1.0];
        for seed in 0..20 {
            let mut s = sampler(5.0, 1, 1.0, 0.0, seed);
            assert_eq!(s.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let run = |seed| {
            let mut s = sampler(1.0, 0, 1.0, 0.0, seed);
            (0..64).map(|_| s.sample(&logits).unwrap()).collect::<Vec<u32>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // Not degenerate: a flat-ish distribution gives many distinct tokens.
        let mut distinct = run(42);
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 10);
    }

    #[test]
    fn draws_follow_the_softmax() {
        let probs = [0.5, 0.3, 0.2];
        let logits = logits_for(&probs);
        let mut s = sampler(1.0, 0, 1.0, 0.0, 7);
        let n = 20_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        for (c, p) in counts.iter().zip(probs) {
            assert!((*c as f64 / n as f64 - p).abs() < 0.015, "{counts:?}");
        }
        // Temperature 2 flattens: p ~ sqrt(probs), renormalized.
        let s2 = sampler(2.0, 0, 1.0, 0.0, 7);
        let d = s2.probabilities(&logits).unwrap();
        let z: f64 = probs.iter().map(|p| p.sqrt()).sum();
        assert!((d[0].1 - 0.5f64.sqrt() / z).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_the_k_most_probable() {
        let logits = logits_for(&[0.1, 0.4, 0.05, 0.3, 0.15]);
        let d = sampler(1.0, 2, 1.0, 0.0, 0).probabilities(&logits).unwrap();
        let toks: Vec<u32> = d.iter().map(|c| c.0).collect();
        assert_eq!(toks, vec![1, 3]);
        assert!((d[0].1 - 4.0 / 7.0).abs() < 1e-6);
    }

    #[test]
    fn signed_zeros_are_one_logit_ordered_by_token() {
        // -0 == +0: the lower token first, whichever sign it has.
        let logits = [-1.0, 0.0, -0.0, -2.0, -0.0];
        let d = sampler(1.0, 3, 1.0, 0.0, 0).probabilities(&logits).unwrap();
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<u32>>(), vec![1, 2, 4]);
        let d = sampler(1.0, 2, 1.0, 0.0, 0).probabilities(&[-0.0, 0.0, -0.5]).unwrap();
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<u32>>(), vec![0, 1]);
        assert_eq!(Sampler::greedy().sample(&[-0.0, 0.0]).unwrap(), 0);
        assert_eq!(order_key(-0.0, 3), order_key(0.0, 3));
        assert!(order_key(1.0, 9) < order_key(0.0, 0) && order_key(0.0, 0) < order_key(-1.0e-30, 0));
        assert!(order_key(-1.0, 0) < order_key(-2.0, 0) && order_key(f32::MAX, 5) < order_key(1.0, 0));
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        let toks = |top_p| -> Vec<u32> {
            sampler(1.0, 0, top_p, 0.0, 0).probabilities(&logits).unwrap().iter().map(|c| c.0).collect()
        };
        assert_eq!(toks(0.75), vec![0, 1]);
        assert_eq!(toks(0.9), vec![0, 1, 2]);
        assert_eq!(toks(0.4), vec![0]);
        // A tiny top_p is argmax, whatever the seed.
        for seed in 0..10 {
            let mut s = sampler(1.5, 0, 1e-6, 0.0, seed);
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        // min_p 0.5: keep p >= 0.25 -> tokens 0 and 1, renormalized 5/8, 3/8.
        let s = sampler(1.0, 0, 1.0, 0.5, 3);
        let d = s.probabilities(&logits).unwrap();
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!((d[0].1 - 0.625).abs() < 1e-6 && (d[1].1 - 0.375).abs() < 1e-6);
        let mut s = s;
        let draws: Vec<u32> = (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert!(draws.iter().all(|&t| t < 2));
        assert!(draws.contains(&0) && draws.contains(&1));
    }

    #[test]
    fn invalid_params_are_rejected_with_their_value() {
        let base = SamplingParams::default();
        let cases = [
            (SamplingParams { temperature: -0.5, ..base.clone() }, "temperature -0.5"),
            (SamplingParams { temperature: f32::NAN, ..base.clone() }, "temperature NaN"),
            (SamplingParams { temperature: f32::INFINITY, ..base.clone() }, "temperature inf"),
            (SamplingParams { top_p: 0.0, ..base.clone() }, "top_p 0"),
            (SamplingParams { top_p: 1.5, ..base.clone() }, "top_p 1.5"),
            (SamplingParams { top_p: f32::NAN, ..base.clone() }, "top_p NaN"),
            (SamplingParams { min_p: -0.1, ..base.clone() }, "min_p -0.1"),
            (SamplingParams { min_p: 1.01, ..base.clone() }, "min_p 1.01"),
        ];
        for (p, want) in cases {
            match Sampler::new(p) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(want), "{m} lacks {want}"),
                other => panic!("{want}: {:?}", other.map(|s| s.params().clone())),
            }
        }
        assert!(Sampler::new(SamplingParams { min_p: 1.0, top_p: 1.0, ..base }).is_ok());
    }

    #[test]
    fn non_finite_or_empty_logits_are_errors() {
        let mut g = Sampler::greedy();
        let e = g.sample(&[0.0, f32::NAN, 1.0]).unwrap_err().to_string();
        assert!(e.contains("logit 1 is NaN"), "{e}");
        let e = sampler(1.0, 0, 1.0, 0.0, 0).sample(&[f32::INFINITY, 0.0]).unwrap_err().to_string();
        assert!(e.contains("logit 0 is inf"), "{e}");
        assert!(g.sample(&[]).is_err());
        let e = g.sample(&vec![0.0; MAX_LOGITS + 1]).unwrap_err().to_string();
        assert!(e.contains("8388609 logits"), "{e}");
    }

    /// The weights, histograms and placement masks of the AVX2 path (where
    /// this CPU has it) are those of the baseline path, bit for bit, on
    /// lengths that end mid-run and mid-mask.
    #[test]
    fn wide_and_baseline_paths_agree() {
        let mut rng = crate::rng::Rng::new(11);
        for n in [1usize, 7, 63, 64, 65, 511, 512, 513, 5000] {
            let logits: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 60.0).collect();
            let max = logits[argmax(&logits)];
            for t in [0.05f32, 0.7, 1.0, 30.0] {
                let (mut a, mut b) = (vec![0u32; n], vec![0u32; n]);
                let ha = histogram(&mut a, &logits, max, t);
                let hb = histogram_any(&mut b, &logits, max, t);
                assert_eq!(a, b, "weights, n {n}, T {t}");
                assert_eq!(ha, hb, "histogram, n {n}, T {t}");
                assert_eq!(ha.0.iter().sum::<usize>(), n, "every token counted, n {n}, T {t}");
                for (lo, hi) in [(KEY_MIN, KEY_ONE), (KEY_ONE - 20, KEY_ONE - 3), (KEY_ONE, KEY_ONE)] {
                    let want: Vec<u64> = a
                        .chunks(64)
                        .map(|ws| {
                            ws.iter().enumerate().fold(0, |m, (j, &w)| {
                                let k = w >> KEY_SHIFT;
                                m | (((lo..=hi).contains(&k) as u64) << j)
                            })
                        })
                        .collect();
                    assert_eq!(hit_masks(&a, lo, hi), want, "masks, n {n}, T {t}, keys {lo}..={hi}");
                    assert_eq!(hit_masks_any(&a, lo, hi), want, "baseline masks, n {n}, T {t}");
                }
            }
        }
    }

    #[test]
    fn exp_neg_is_exp_within_a_few_ulps_and_masses_are_exact() {
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(exp_neg(f32::NEG_INFINITY) < 1e-37 && exp_neg(-1000.0) < 1e-37);
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            worst = worst.max((exp_neg(x) as f64 - want).abs() / want);
            x -= 0.000_731;
        }
        // f32's ulp is 1.2e-7 relative at worst.
        assert!(worst < 3e-7, "relative error {worst}");
        let mut rng = crate::rng::Rng::new(11);
        for _ in 0..100_000 {
            let w = exp_neg(-(rng.next_f64() * 40.0) as f32);
            assert_eq!(mass(w.to_bits()), (w as f64 * 2f64.powi(40)).floor() as u64, "w = {w:e}");
        }
        assert_eq!(mass(1.0f32.to_bits()), 1 << 40);
        assert_eq!(mass(2f32.powi(-40).to_bits()), 1);
        assert_eq!(mass(2f32.powi(-41).to_bits()), 0);
    }

    /// The draw by its definition (module comment above `MASS_BITS`): every
    /// token's weight and mass, one sort of the vocabulary, the cuts by
    /// running sums. Returns the kept (token, mass) in order, and the token
    /// `u` picks (None when one token is kept: no draw).
    /// (`all`: `sorted_by_definition` of the logits at p's temperature.)
    fn by_definition(p: &SamplingParams, all: &[(u32, u32)], u: f64) -> (Vec<(u32, u64)>, Option<u32>) {
        let run = |n: usize, all: &[(u32, u32)]| -> Vec<u64> {
            all[..n]
                .iter()
                .scan(0u64, |acc, &(_, w)| {
                    *acc += mass(w);
                    Some(*acc)
                })
                .collect()
        };
        let mut n = all.len();
        if p.top_k > 0 {
            n = n.min(p.top_k);
        }
        if p.top_p < 1.0 {
            let cum = run(n, all);
            let m = cum[n - 1];
            let target = ((m as f64 * p.top_p as f64).ceil() as u64).clamp(1, m);
            n = cum.iter().position(|&c| c >= target).unwrap() + 1;
        }
        if p.min_p > 0.0 {
            n = n.min(all.iter().filter(|&&(_, w)| f32::from_bits(w) >= p.min_p).count());
        }
        let kept: Vec<(u32, u64)> = all[..n].iter().map(|&(t, w)| (t, mass(w))).collect();
        if n == 1 {
            return (kept, None);
        }
        let cum = run(n, all);
        let below = ((u * cum[n - 1] as f64) as u64).min(cum[n - 1] - 1);
        let at = cum.iter().position(|&c| c > below).unwrap();
        (kept, Some(all[at].0))
    }

    /// Every token of non-zero mass as (token, weight bits), by logit
    /// descending, then token ascending.
    fn sorted_by_definition(logits: &[f32], temperature: f32) -> Vec<(u32, u32)> {
        let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut all: Vec<(u32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, exp_neg((l - max) / temperature).to_bits()))
            .filter(|&(_, w)| mass(w) > 0)
            .collect();
        // (-0 and +0 are one logit: partial_cmp.)
        all.sort_by(|a, b| logits[b.0 as usize].partial_cmp(&logits[a.0 as usize]).unwrap().then(a.0.cmp(&b.0)));
        all
    }

    #[test]
    fn buckets_give_the_draw_of_a_full_sort() {
        let mut rng = crate::rng::Rng::new(5);
        let mut uniform = move |lo: f32, hi: f32| lo + (hi - lo) * (rng.next_f64() as f32);
        let mut cases: Vec<Vec<f32>> =
            vec![vec![0.0], vec![1.0, 1.0], vec![3.0, -1.0, 3.0], vec![f32::MAX, -f32::MAX, 0.0]];
        for &v in &[5usize, 64, 300, 4096] {
            cases.push((0..v).map(|_| uniform(-10.0, 10.0)).collect()); // flat
            cases.push((0..v).map(|_| uniform(-1.0, 1.0).round() * 2.0).collect()); // ties
            cases.push((0..v).map(|i| if i % 97 == 3 { uniform(12.0, 16.0) } else { uniform(-4.0, 4.0) }).collect());
            cases.push((0..v).map(|_| uniform(-0.001, 0.001)).collect()); // near-ties
        }
        // And a vocabulary of a model's size, on a few of the parameters.
        let big = cases.len();
        cases
            .push((0..151_936).map(|i| if i % 7919 == 0 { uniform(12.0, 16.0) } else { uniform(-6.0, 6.0) }).collect());
        cases.push((0..151_936).map(|_| uniform(-10.0, 10.0)).collect());
        let mut checked = (0, 0);
        for (c, logits) in cases.iter().enumerate() {
            let few = |x: &[f32]| if c >= big { x[1..3].to_vec() } else { x.to_vec() };
            let v = logits.len();
            for &temperature in &few(&[0.05f32, 0.7, 1.0, 3.0, 1e4]) {
                let all = sorted_by_definition(logits, temperature);
                for &top_k in &[0usize, 2, 40, 1, v, v + 5][..if c >= big { 3 } else { 6 }] {
                    for &top_p in &few(&[1.0f32, 0.95, 0.5, 1e-6]) {
                        for &min_p in &[0.0f32, 0.05, 1.0] {
                            let params = SamplingParams { temperature, top_k, top_p, min_p, seed: v as u64 };
                            let mut s = Sampler::new(params.clone()).unwrap();
                            let mut r = crate::rng::Rng::new(params.seed);
                            let what = format!("V {v} T {temperature} k {top_k} p {top_p} min_p {min_p}");
                            let (kept, _) = by_definition(&params, &all, 0.0);
                            let total: u64 = kept.iter().map(|k| k.1).sum();
                            let want: Vec<(u32, f64)> =
                                kept.iter().map(|&(t, m)| (t, m as f64 / total as f64)).collect();
                            assert_eq!(s.probabilities(logits).unwrap(), want, "{what}");
                            for _ in 0..8 {
                                let u = if kept.len() > 1 { r.next_f64() } else { 0.0 };
                                let (_, token) = by_definition(&params, &all, u);
                                assert_eq!(s.sample(logits).unwrap(), token.unwrap_or(kept[0].0), "{what}");
                                checked.0 += 1;
                            }
                            checked.1 += kept.len().min(2) - 1;
                        }
                    }
                }
            }
        }
        // Draws among several tokens, not only the single-token paths.
        assert!(checked.1 > 1000, "{checked:?}");
    }

    #[test]
    fn ranked_answers_any_sequence_of_queries_as_a_full_sort_does() {
        // Selection leaves a big bucket permuted: each query must hold
        // whatever the queries before it did. Near-flat weights put
        // hundreds of tokens in a bucket (the tests sort at most 64).
        let mut rng = crate::rng::Rng::new(11);
        // The last case: a crowded region (every other token, spread 0.5)
        // among many small buckets, so that placements come in many scans
        // and out of order.
        for (v, spread, temperature, mixed) in [
            (3000usize, 1.0f32, 50.0f32, false),
            (6000, 2.0, 1.0, false),
            (500, 0.001, 1e4, false),
            (6000, 16.0, 1.0, true),
        ] {
            let logits: Vec<f32> = (0..v)
                .map(|i| if mixed && i % 2 == 1 { 0.5 } else { spread } * (rng.next_f64() as f32 - 0.5))
                .collect();
            let all = sorted_by_definition(&logits, temperature);
            let mut r = Ranked::new(&logits, temperature);
            assert_eq!(r.len(), all.len());
            assert!((0..BUCKETS).any(|b| r.selects(b)), "V {v}: no bucket above {SORT_AT_MOST}");
            let cum: Vec<u64> = all
                .iter()
                .scan(0u64, |acc, &(_, w)| {
                    *acc += mass(w);
                    Some(*acc)
                })
                .collect();
            let n = all.len();
            // What the selections remember is a fact of the order.
            let facts = |r: &Ranked<'_>| {
                if let Some((p, e)) = r.known_entry {
                    assert_eq!(e.id(), all[p].0, "V {v} known entry {p}");
                }
                if let Some((m, mass)) = r.known_prefix {
                    assert_eq!(mass, cum[m - 1], "V {v} known prefix {m}");
                }
            };
            for q in 0..480 {
                let i = (rng.next_f64() * n as f64) as usize;
                if q >= 400 && q % 8 == 0 {
                    // A bucket the selections left permuted, sorted by
                    // `members`: in order, and the queries after it agree.
                    let b = r.bucket_of(i);
                    let (s, e) = (r.start[b], r.start[b + 1]);
                    let ids: Vec<u32> = r.members(b).iter().map(|x| x.id()).collect();
                    assert_eq!(ids, all[s..e].iter().map(|x| x.0).collect::<Vec<u32>>(), "V {v} members {b}");
                    continue;
                }
                match q % 4 {
                    0 => assert_eq!(r.entry(i).id(), all[i].0, "V {v} entry {i}"),
                    1 => {
                        assert_eq!(r.prefix_mass(i), if i == 0 { 0 } else { cum[i - 1] }, "V {v} prefix {i}");
                        facts(&r);
                        // What the selection found on the way (`known_entry`).
                        assert_eq!(r.entry(i).id(), all[i].0, "V {v} entry {i} after its prefix");
                    }
                    2 => {
                        // Random, or on a boundary of the running mass (or one past it).
                        let target = if q % 8 == 2 {
                            1 + (rng.next_f64() * cum[n - 1] as f64) as u64 % cum[n - 1]
                        } else {
                            (cum[i] + (q as u64 / 8) % 2).min(cum[n - 1])
                        };
                        let want = cum.iter().position(|&c| c >= target).unwrap() + 1;
                        assert_eq!(r.first_reaching(target), want, "V {v} reaching {target}");
                        facts(&r);
                        // What the selection found on the way (as a draw asks).
                        assert_eq!(r.entry(want - 1).id(), all[want - 1].0, "V {v} entry {} after reaching", want - 1);
                        assert_eq!(r.prefix_mass(want), cum[want - 1], "V {v} prefix {want} after reaching");
                    }
                    _ => {
                        let w = f32::from_bits(all[i].1);
                        let want = all.iter().filter(|&&(_, x)| f32::from_bits(x) >= w).count();
                        assert_eq!(r.count_at_least(w), want, "V {v} at least {w}");
                    }
                }
                facts(&r);
            }
        }
    }

    #[test]
    fn a_near_flat_vocabulary_costs_a_few_selections_not_one_a_token() {
        // One bucket of 20,000 tokens at T 1e4: the cuts and the draw select
        // in it a few times; `probabilities` sorts it once (`sort_prefix`)
        // instead of a selection per listed token.
        let mut rng = crate::rng::Rng::new(13);
        let logits: Vec<f32> = (0..20_000).map(|_| rng.next_f64() as f32).collect();
        for top_p in [1.0f32, 0.9] {
            let mut s = sampler(1e4, 0, top_p, 0.0, 1);
            SELECTIONS.with(|c| c.set(0));
            let d = s.probabilities(&logits).unwrap();
            assert!(d.len() > 10_000);
            s.sample(&logits).unwrap();
            let n = SELECTIONS.with(|c| c.get());
            assert!(n <= 8, "top_p {top_p}: {n} selections");
        }
    }

    #[test]
    fn equal_weights_of_distinct_logits_keep_the_logits_order() {
        // At T 1e4 these weights round to 0.99999994 or 1 in f32; the
        // filters must still rank by logit: top-1 inside top-2, argmax first.
        let logits = [0.0, 1e-4, 2e-4, 3e-4, 4e-4];
        let toks = |k, p: f32, m| -> Vec<u32> {
            sampler(1e4, k, p, m, 0).probabilities(&logits).unwrap().iter().map(|c| c.0).collect()
        };
        assert_eq!(toks(1, 1.0, 0.0), vec![4]);
        assert_eq!(toks(2, 1.0, 0.0), vec![4, 3]);
        assert_eq!(toks(0, 1e-6, 0.0), vec![4]);
        assert_eq!(toks(0, 1.0, 1.0)[0], 4);
        assert_eq!(sampler(1e4, 0, 1e-6, 0.0, 3).sample(&logits).unwrap(), 4);
    }

    #[test]
    fn a_draw_on_a_boundary_of_running_mass_takes_the_next_token() {
        // Two equal tokens: masses 2^40 each. u = 1/2 lands exactly on the
        // first token's end: the second; just below: the first.
        let logits = [0.0f32, 0.0];
        let mut r = Ranked::new(&logits, 1.0);
        assert_eq!(r.prefix_mass(2), 1 << 41);
        assert_eq!(draw(&mut r, 2, 0.5), 1);
        assert_eq!(draw(&mut r, 2, 0.5 - 2f64.powi(-45)), 0);
        assert_eq!(draw(&mut r, 2, 0.0), 0);
        assert_eq!(draw(&mut r, 2, 1.0 - f64::EPSILON), 1);
    }
}
