//! The f32 KV cache of one session: per layer, keys and values of every
//! position, `[len, kv_heads * head_dim]` row-major. It grows as tokens are
//! appended (the session's capacity is a limit, not an allocation), so a
//! session with a large context costs only what it holds.
//!
//! Hybrid models (qwen3_next) keep no KV for their Gated DeltaNet layers:
//! those hold a `DeltaNetState` (conv + recurrent state) here instead. That
//! state cannot be truncated: `truncate` leaves it alone, and whoever
//! shortens a hybrid cache restores the states that match (a snapshot).

use std::borrow::Cow;

use crate::backend::{DeltaNetShape, DeltaNetState};

/// The layers of one stage of a `KvCache` (`KvCache::stage_views`): what
/// a stage's forward appends to and reads, by model layer index.
pub struct StageKv<'a> {
    /// The model layer of `layers[0]`.
    first: usize,
    kv_dim: usize,
    rounding: KvRounding,
    layers: &'a mut [LayerKv],
    delta: &'a mut [Option<DeltaNetState>],
}

impl StageKv<'_> {
    /// Appends the keys and values `[T, kv_dim]` of the rows being run to `layer`.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert!(k.len() == v.len() && k.len() % self.kv_dim == 0, "KvCache::append: k/v shapes");
        let rounding = self.rounding;
        let l = &mut self.layers[layer - self.first];
        for (dst, src) in [(&mut l.k, k), (&mut l.v, v)] {
            let at = dst.len();
            dst.extend_from_slice(src);
            rounding.apply(&mut dst[at..]);
        }
    }

    /// Keys and values of `layer` for every position appended so far.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let l = &self.layers[layer - self.first];
        (&l.k, &l.v)
    }

    /// Positions `layer` holds, committed or appended by the forward in
    /// progress: the position of the next row it runs.
    pub fn rows(&self, layer: usize) -> usize {
        self.layers[layer - self.first].k.len() / self.kv_dim
    }

    /// The recurrent state of Gated DeltaNet layer `layer`.
    pub fn delta_mut(&mut self, layer: usize) -> &mut DeltaNetState {
        self.delta[layer - self.first].as_mut().expect("StageKv::delta_mut: not a Gated DeltaNet layer")
    }
}

/// How the host cache stores keys and values: f32, or as the CUDA cache's
/// int8 / bf16 would hold them (values rounded on append and kept as f32),
/// so the CPU reference computes exactly what a quantized cache holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvRounding {
    #[default]
    None,
    Bf16,
    /// Int8 blocks of one head vector (`head_dim` values) each.
    Int8 {
        head_dim: usize,
    },
}

impl KvRounding {
    /// Rounds whole rows of keys or values in place, as the cache stores
    /// them.
    pub fn apply(self, rows: &mut [f32]) {
        match self {
            KvRounding::None => {}
            KvRounding::Bf16 => crate::quant::bf16_round_trip(rows),
            KvRounding::Int8 { head_dim } => {
                rows.chunks_exact_mut(head_dim).for_each(crate::quant::int8_block_round_trip)
            }
        }
    }
}

pub struct KvCache {
    kv_dim: usize,
    rounding: KvRounding,
    /// Positions every layer holds (a forward in progress may have appended
    /// more rows to some layers; `truncate` drops them).
    len: usize,
    layers: Vec<LayerKv>,
    /// Per layer: `Some` for a Gated DeltaNet layer (which appends no KV).
    delta: Vec<Option<DeltaNetState>>,
}

struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    #[cfg(test)]
    pub fn new(num_layers: usize, kv_dim: usize) -> KvCache {
        KvCache::new_hybrid(kv_dim, &vec![None; num_layers])
    }

    /// A cache whose layer `l` is a Gated DeltaNet layer of shape
    /// `linear[l]` when that is `Some` (its state starts at zero).
    pub fn new_hybrid(kv_dim: usize, linear: &[Option<DeltaNetShape>]) -> KvCache {
        KvCache {
            kv_dim,
            rounding: KvRounding::None,
            len: 0,
            layers: linear.iter().map(|_| LayerKv { k: Vec::new(), v: Vec::new() }).collect(),
            delta: linear.iter().map(|s| s.map(DeltaNetState::new)).collect(),
        }
    }

    /// Whether any layer holds a recurrent state.
    pub fn is_hybrid(&self) -> bool {
        self.delta.iter().any(Option::is_some)
    }

    /// A copy of every Gated DeltaNet layer's state, in layer order.
    pub fn deltas(&self) -> Vec<DeltaNetState> {
        self.delta.iter().flatten().cloned().collect()
    }

    /// Puts back states taken by `deltas` (of this cache's shapes).
    pub fn restore_deltas(&mut self, states: &[DeltaNetState]) {
        let mut it = states.iter();
        for d in self.delta.iter_mut().flatten() {
            let s = it.next().expect("KvCache::restore_deltas: too few states");
            assert!(s.conv.len() == d.conv.len() && s.recurrent.len() == d.recurrent.len(), "restore_deltas: shapes");
            d.clone_from(s);
        }
        assert!(it.next().is_none(), "KvCache::restore_deltas: too many states");
    }

    /// Zeroes every recurrent state (the state before the first token).
    pub fn reset_deltas(&mut self) {
        for d in self.delta.iter_mut().flatten() {
            d.conv.fill(0.0);
            d.recurrent.fill(0.0);
        }
    }

    /// A cache holding `len` positions (a restored session state): per
    /// layer, keys and values `[len, kv_dim]` (empty for the Gated DeltaNet
    /// layers of `linear`), and the recurrent states `deltas` in layer order.
    pub fn from_state(
        kv_dim: usize,
        len: usize,
        linear: &[Option<DeltaNetShape>],
        layers: Vec<(Vec<f32>, Vec<f32>)>,
        deltas: &[DeltaNetState],
    ) -> KvCache {
        assert_eq!(layers.len(), linear.len(), "KvCache::from_state: layers");
        assert!(
            layers.iter().zip(linear).all(|((k, v), s)| {
                let want = if s.is_some() { 0 } else { len * kv_dim };
                k.len() == want && v.len() == want
            }),
            "KvCache::from_state: layer shapes"
        );
        let mut kv = KvCache::new_hybrid(kv_dim, linear);
        kv.len = len;
        for (l, (k, v)) in kv.layers.iter_mut().zip(layers) {
            l.k = k;
            l.v = v;
        }
        kv.restore_deltas(deltas);
        kv
    }

    /// Whether `layer` holds keys and values (not a Gated DeltaNet layer).
    pub fn has_kv(&self, layer: usize) -> bool {
        self.delta[layer].is_none()
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// This cache with keys and values stored as `rounding` says.
    pub fn with_rounding(mut self, rounding: KvRounding) -> KvCache {
        if let KvRounding::Int8 { head_dim } = rounding {
            assert!(head_dim > 0 && self.kv_dim % head_dim == 0, "KvCache: int8 blocks of {head_dim}");
        }
        self.rounding = rounding;
        self
    }

    /// Keys and values of `layer` for every position appended so far.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let l = &self.layers[layer];
        (&l.k, &l.v)
    }

    /// `StageKv::append` on the whole cache.
    #[cfg(test)]
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let all = 0..self.layers.len();
        self.stage_views(&[all])[0].append(layer, k, v);
    }

    /// The layers `ranges[i]` of each stage of a layer split as views a
    /// stage can run its layers on while the others run theirs (pipelined
    /// windows); the ranges are consecutive from layer 0 and cover every
    /// layer. One range: the whole cache.
    pub fn stage_views(&mut self, ranges: &[std::ops::Range<usize>]) -> Vec<StageKv<'_>> {
        assert!(
            ranges.first().is_some_and(|r| r.start == 0)
                && ranges.windows(2).all(|w| w[0].end == w[1].start)
                && ranges.last().is_some_and(|r| r.end == self.layers.len()),
            "KvCache::stage_views: the ranges must cover the layers in order"
        );
        let (kv_dim, rounding) = (self.kv_dim, self.rounding);
        let (mut layers, mut delta) = (&mut self.layers[..], &mut self.delta[..]);
        let mut views = Vec::with_capacity(ranges.len());
        for r in ranges {
            let (l, rest) = std::mem::take(&mut layers).split_at_mut(r.len());
            let (d, drest) = std::mem::take(&mut delta).split_at_mut(r.len());
            (layers, delta) = (rest, drest);
            views.push(StageKv { first: r.start, kv_dim, rounding, layers: l, delta: d });
        }
        views
    }

    /// After a forward that stopped partway (some layers appended rows of
    /// later pieces than others): every attention layer keeps positions
    /// `0..n`, and `n` become the committed positions. Each must hold at
    /// least `n`. Recurrent states are left as they are.
    pub fn settle(&mut self, n: usize) {
        let want = n * self.kv_dim;
        for (l, d) in self.layers.iter_mut().zip(&self.delta) {
            if d.is_none() {
                assert!(l.k.len() >= want && l.v.len() >= want, "KvCache::settle: a layer holds fewer than {n} rows");
                l.k.truncate(want);
                l.v.truncate(want);
            }
        }
        self.len = n;
    }

    /// Marks `n` more positions as held by every layer (after a forward).
    pub fn commit(&mut self, n: usize) {
        let want = (self.len + n) * self.kv_dim;
        assert!(
            self.layers.iter().zip(&self.delta).all(|(l, d)| d.is_some() || (l.k.len() == want && l.v.len() == want)),
            "KvCache::commit: a layer did not append {n} rows"
        );
        self.len += n;
    }

    /// Keeps positions `0..n` (n <= len) and drops any uncommitted rows.
    /// Recurrent states are left as they are (see the module doc).
    pub fn truncate(&mut self, n: usize) {
        assert!(n <= self.len, "KvCache::truncate past its length");
        for l in &mut self.layers {
            l.k.truncate(n * self.kv_dim);
            l.v.truncate(n * self.kv_dim);
        }
        self.len = n;
    }

    /// Makes room for `n` more positions in every layer.
    pub fn reserve(&mut self, n: usize) {
        for l in &mut self.layers {
            l.k.reserve(n * self.kv_dim);
            l.v.reserve(n * self.kv_dim);
        }
    }
}

/// Keys and values of one layer as f32, borrowed or downloaded.
pub type KvRows<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// A session's cache on the device that runs its engine: the host `KvCache`
/// of the CPU backend, or the device cache of the CUDA backend. The session
/// and the engine call the same operations on either.
///
/// The device cache's operations that cannot fail on the host
/// (`deltas`, `restore_deltas`, `reset_deltas`) panic on a CUDA error: the
/// device is then unusable, and the C API reports it as an internal error.
pub enum Cache {
    Host(KvCache),
    #[cfg(feature = "cuda")]
    Device(Box<crate::engine::gpu::DeviceCache>),
}

impl Cache {
    /// The host cache (tests).
    #[cfg(test)]
    pub fn host(&self) -> Option<&KvCache> {
        match self {
            Cache::Host(kv) => Some(kv),
            #[cfg(feature = "cuda")]
            Cache::Device(_) => None,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Cache::Host(kv) => kv.len(),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.len(),
        }
    }

    pub fn is_hybrid(&self) -> bool {
        match self {
            Cache::Host(kv) => kv.is_hybrid(),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.is_hybrid(),
        }
    }

    /// A host copy of every Gated DeltaNet layer's state, in layer order.
    pub fn deltas(&self) -> Vec<DeltaNetState> {
        match self {
            Cache::Host(kv) => kv.deltas(),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.deltas().expect("CUDA: copying the recurrent states to the host"),
        }
    }

    /// Puts back states taken by `deltas`.
    pub fn restore_deltas(&mut self, states: &[DeltaNetState]) {
        match self {
            Cache::Host(kv) => kv.restore_deltas(states),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.restore_deltas(states).expect("CUDA: copying the recurrent states to the device"),
        }
    }

    /// Zeroes every recurrent state.
    pub fn reset_deltas(&mut self) {
        match self {
            Cache::Host(kv) => kv.reset_deltas(),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.reset_deltas().expect("CUDA: zeroing the recurrent states"),
        }
    }

    /// Keeps positions `0..n`; recurrent states are left as they are.
    pub fn truncate(&mut self, n: usize) {
        match self {
            Cache::Host(kv) => kv.truncate(n),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.truncate(n),
        }
    }

    /// Makes room for `n` more positions (the device cache grows its KV).
    pub fn reserve(&mut self, n: usize) -> crate::error::Result<()> {
        match self {
            Cache::Host(kv) => {
                kv.reserve(n);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.reserve(n),
        }
    }

    pub fn num_layers(&self) -> usize {
        match self {
            Cache::Host(kv) => kv.num_layers(),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.num_layers(),
        }
    }

    pub fn has_kv(&self, layer: usize) -> bool {
        match self {
            Cache::Host(kv) => kv.has_kv(layer),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => d.has_kv(layer),
        }
    }

    /// Keys and values of `layer`, positions `0..len`, as f32 (the device
    /// cache dequantizes its int8 or bf16 rows).
    pub fn layer_f32(&self, layer: usize) -> crate::error::Result<KvRows<'_>> {
        match self {
            Cache::Host(kv) => {
                let (k, v) = kv.layer(layer);
                Ok((Cow::Borrowed(k), Cow::Borrowed(v)))
            }
            #[cfg(feature = "cuda")]
            Cache::Device(d) => {
                let (k, v) = d.layer_f32(layer)?;
                Ok((Cow::Owned(k), Cow::Owned(v)))
            }
        }
    }

    /// A cache of the same kind holding a restored session state (see
    /// `KvCache::from_state`).
    pub fn restored(
        &self,
        kv_dim: usize,
        len: usize,
        linear: &[Option<DeltaNetShape>],
        layers: Vec<(Vec<f32>, Vec<f32>)>,
        deltas: &[DeltaNetState],
    ) -> crate::error::Result<Cache> {
        match self {
            Cache::Host(kv) => {
                // Stored as an append stores them (the device cache's restore
                // appends them through its kernel): a state saved by a
                // session of another KV type holds other values.
                let mut layers = layers;
                for (k, v) in &mut layers {
                    kv.rounding.apply(k);
                    kv.rounding.apply(v);
                }
                Ok(Cache::Host(KvCache::from_state(kv_dim, len, linear, layers, deltas).with_rounding(kv.rounding)))
            }
            #[cfg(feature = "cuda")]
            Cache::Device(d) => Ok(Cache::Device(Box::new(d.restored(len, layers, deltas)?))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_commit_truncate() {
        let mut kv = KvCache::new(2, 3);
        for l in 0..2 {
            kv.append(l, &[1.0; 6], &[2.0; 6]);
        }
        kv.commit(2);
        assert_eq!(kv.len(), 2);
        // An uncommitted append to one layer is dropped by truncate.
        kv.append(0, &[3.0; 3], &[4.0; 3]);
        assert_eq!(kv.layer(0).0.len(), 9);
        kv.truncate(2);
        assert_eq!(kv.layer(0).0.len(), 6);
        kv.truncate(1);
        assert_eq!((kv.len(), kv.layer(1).1), (1, &[2.0; 3][..]));
    }

    #[test]
    fn stage_views_split_the_layers_and_settle_keeps_the_common_rows() {
        let mut kv = KvCache::new(3, 2);
        {
            let mut views = kv.stage_views(&[0..1, 1..3]);
            let (a, b) = views.split_at_mut(1);
            // Stage 0 ran two pieces of one row, stage 1 only the first.
            a[0].append(0, &[1.0, 1.0], &[1.0, 1.0]);
            a[0].append(0, &[2.0, 2.0], &[2.0, 2.0]);
            b[0].append(1, &[3.0, 3.0], &[3.0, 3.0]);
            b[0].append(2, &[4.0, 4.0], &[4.0, 4.0]);
            assert_eq!((a[0].rows(0), b[0].rows(1), b[0].rows(2)), (2, 1, 1));
            assert_eq!(b[0].layer(2).0, &[4.0, 4.0]);
        }
        assert_eq!(kv.layer(0).0, &[1.0, 1.0, 2.0, 2.0]);
        kv.settle(1);
        assert_eq!((kv.len(), kv.layer(0).0, kv.layer(1).1), (1, &[1.0, 1.0][..], &[3.0, 3.0][..]));
    }

    #[test]
    #[should_panic(expected = "cover the layers")]
    fn stage_views_must_cover_the_layers() {
        KvCache::new(3, 1).stage_views(&[0..1, 2..3]);
    }

    #[test]
    #[should_panic(expected = "did not append")]
    fn commit_checks_every_layer() {
        let mut kv = KvCache::new(2, 1);
        kv.append(0, &[1.0], &[1.0]);
        kv.commit(1);
    }
}
