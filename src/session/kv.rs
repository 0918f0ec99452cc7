//! The f32 KV cache of one session: per layer, keys and values of every
//! position, `[len, kv_heads * head_dim]` row-major. It grows as tokens are
//! appended (the session's capacity is a limit, not an allocation), so a
//! session with a large context costs only what it holds.

pub struct KvCache {
    kv_dim: usize,
    /// Positions every layer holds (a forward in progress may have appended
    /// more rows to some layers; `truncate` drops them).
    len: usize,
    layers: Vec<LayerKv>,
}

struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    pub fn new(num_layers: usize, kv_dim: usize) -> KvCache {
        KvCache { kv_dim, len: 0, layers: (0..num_layers).map(|_| LayerKv { k: Vec::new(), v: Vec::new() }).collect() }
    }

    /// A cache holding `len` positions: per layer, keys and values
    /// `[len, kv_dim]` (a restored session state).
    pub fn from_layers(kv_dim: usize, len: usize, layers: Vec<(Vec<f32>, Vec<f32>)>) -> KvCache {
        assert!(
            layers.iter().all(|(k, v)| k.len() == len * kv_dim && v.len() == len * kv_dim),
            "KvCache::from_layers: layer shapes"
        );
        KvCache { kv_dim, len, layers: layers.into_iter().map(|(k, v)| LayerKv { k, v }).collect() }
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Appends the keys and values `[T, kv_dim]` of the rows being run to `layer`.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert!(k.len() == v.len() && k.len() % self.kv_dim == 0, "KvCache::append: k/v shapes");
        let l = &mut self.layers[layer];
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
    }

    /// Keys and values of `layer` for every position appended so far.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let l = &self.layers[layer];
        (&l.k, &l.v)
    }

    /// Marks `n` more positions as held by every layer (after a forward).
    pub fn commit(&mut self, n: usize) {
        let want = (self.len + n) * self.kv_dim;
        assert!(
            self.layers.iter().all(|l| l.k.len() == want && l.v.len() == want),
            "KvCache::commit: a layer did not append {n} rows"
        );
        self.len += n;
    }

    /// Keeps positions `0..n` (n <= len) and drops any uncommitted rows.
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
    #[should_panic(expected = "did not append")]
    fn commit_checks_every_layer() {
        let mut kv = KvCache::new(2, 1);
        kv.append(0, &[1.0], &[1.0]);
        kv.commit(1);
    }
}
