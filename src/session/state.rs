//! A session's state as bytes (docs/c-api.md, "Session state format"):
//! tokens, KV of every layer, the last logits and the `step_with` sampler,
//! tied to the model by a fingerprint of its config. All integers and
//! floats are little-endian.
//!
//! ```text
//! offset  size             field
//! 0       8                magic "STRATAST"
//! 8       4                version (1 for qwen3_moe, 2 for hybrid models)
//! 12      4                flags: bit 0 = logits present, bit 1 = sampler present
//! 16      8                model fingerprint (FNV-1a 64 of the config as JSON)
//! 24      4                num_layers
//! 28      4                kv_dim
//! 32      4                vocab_size
//! 36      8                n = tokens held
//! 44      4 n              tokens (u32)
//!         8 n kv_dim       per full-attention layer: keys then values, f32 [n, kv_dim] each
//!         4 R              version 2: per Gated DeltaNet layer, in layer order, its conv
//!                          state f32 [conv_dim, K-1] then its recurrent state f32 [Hv, dk, dv]
//!         4 vocab          logits of position n - 1 (if flag bit 0)
//!         60               sampler (if flag bit 1): temperature f32, top_k u64,
//!                          top_p f32, min_p f32, seed u64, rng state 4 x u64
//!         4                CRC-32 of every byte before it
//! ```
//!
//! Loading validates everything (size, checksum, model, vocabulary,
//! capacity, sampler) before it changes the session. Checkpoints and kept
//! logits are not part of the state; loading drops the session's own (a
//! hybrid session then takes an automatic checkpoint at the loaded position).

use super::Session;
use crate::backend::DeltaNetState;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::rng::Rng;
use crate::sampling::{Sampler, SamplingParams};

pub const STATE_MAGIC: [u8; 8] = *b"STRATAST";
/// The version of hybrid (qwen3_next) states: KV of the full-attention
/// layers only, then every Gated DeltaNet layer's recurrent state. A model
/// without linear layers writes (and reads only) version 1, whose layout
/// is version 2's with no recurrent state.
pub const STATE_VERSION: u32 = 2;
const STATE_VERSION_PLAIN: u32 = 1;
const HEADER_LEN: usize = 44;
const SAMPLER_LEN: usize = 60;
const CRC_LEN: usize = 4;
const FLAG_LOGITS: u32 = 1;
const FLAG_SAMPLER: u32 = 2;

/// FNV-1a 64 of the config's JSON (field order is the struct's, so the
/// bytes are stable): two models with equal configs share KV layouts.
pub fn model_fingerprint(c: &ModelConfig) -> u64 {
    let json = serde_json::to_vec(c).expect("a model config serializes");
    json.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn invalid(msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("session state: {msg}"))
}

/// The state's layout for a model: how many layers hold KV, and the f32s
/// of all recurrent states; and the version it is written as.
fn layout(c: &ModelConfig) -> (usize, usize, u32) {
    let linear = crate::engine::linear_layers(c);
    let kv_layers = linear.iter().filter(|s| s.is_none()).count();
    let delta: usize = linear.iter().flatten().map(|s| s.conv_state_len() + s.recurrent_state_len()).sum();
    let version = if kv_layers == linear.len() { STATE_VERSION_PLAIN } else { STATE_VERSION };
    (kv_layers, delta, version)
}

/// Bytes of a state with these dimensions, or `None` on overflow.
fn state_len(n: u64, c: &ModelConfig, flags: u32) -> Option<usize> {
    let (layers, delta, _) = layout(c);
    let (kv_dim, vocab) = (c.kv_dim(), c.vocab_size);
    let n = usize::try_from(n).ok()?;
    let kv = n.checked_mul(kv_dim)?.checked_mul(8)?.checked_mul(layers)?.checked_add(delta * 4)?;
    let logits = if flags & FLAG_LOGITS != 0 { vocab * 4 } else { 0 };
    let sampler = if flags & FLAG_SAMPLER != 0 { SAMPLER_LEN } else { 0 };
    HEADER_LEN.checked_add(n.checked_mul(4)?)?.checked_add(kv)?.checked_add(logits + sampler + CRC_LEN)
}

struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes())
    }
    fn f32s(&mut self, v: &[f32]) {
        for x in v {
            self.put(&x.to_le_bytes());
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Callers checked the total length first, so reads stay in bounds.
    fn take(&mut self, n: usize) -> &'a [u8] {
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }
    fn f32(&mut self) -> f32 {
        f32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(n * 4).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect()
    }
}

impl Session {
    fn state_flags(&self) -> u32 {
        (if self.logits.is_some() { FLAG_LOGITS } else { 0 }) | (if self.sampler.is_some() { FLAG_SAMPLER } else { 0 })
    }

    /// Bytes `write_state` needs.
    pub fn state_size(&self) -> usize {
        let c = self.engine.config();
        state_len(self.tokens.len() as u64, c, self.state_flags()).expect("a state the session holds has a size")
    }

    /// Writes the state into the first `state_size()` bytes of `out` and
    /// returns that size; a smaller `out` is an error and is not written.
    pub fn write_state(&self, out: &mut [u8]) -> Result<usize> {
        let size = self.state_size();
        if out.len() < size {
            return Err(invalid(format!("{} bytes of room, the state needs {size}", out.len())));
        }
        let c = self.engine.config();
        let n = self.tokens.len();
        let mut w = Writer { buf: &mut out[..size], pos: 0 };
        w.put(&STATE_MAGIC);
        w.u32(layout(c).2);
        w.u32(self.state_flags());
        w.u64(model_fingerprint(c));
        w.u32(c.num_hidden_layers as u32);
        w.u32(c.kv_dim() as u32);
        w.u32(c.vocab_size as u32);
        w.u64(n as u64);
        for &t in &self.tokens {
            w.u32(t);
        }
        for l in (0..self.kv.num_layers()).filter(|&l| self.kv.has_kv(l)) {
            let (k, v) = self.kv.layer_f32(l)?;
            w.f32s(&k[..n * c.kv_dim()]);
            w.f32s(&v[..n * c.kv_dim()]);
        }
        for d in self.kv.deltas() {
            w.f32s(&d.conv);
            w.f32s(&d.recurrent);
        }
        if let Some(l) = &self.logits {
            w.f32s(l);
        }
        if let Some(s) = &self.sampler {
            let p = s.params();
            w.u32(p.temperature.to_bits());
            w.u64(p.top_k as u64);
            w.u32(p.top_p.to_bits());
            w.u32(p.min_p.to_bits());
            w.u64(p.seed);
            for x in s.rng().state() {
                w.u64(x);
            }
        }
        let crc = crc32fast::hash(&w.buf[..w.pos]);
        w.u32(crc);
        debug_assert_eq!(w.pos, size);
        Ok(size)
    }

    /// The state as a new buffer.
    pub fn save_state(&self) -> Vec<u8> {
        let mut out = vec![0; self.state_size()];
        self.write_state(&mut out).expect("sized by state_size");
        out
    }

    /// Replaces this session's tokens, KV, logits and sampler with a saved
    /// state. Everything is checked first; on error the session is
    /// unchanged. Checkpoints and kept logits are dropped.
    pub fn load_state(&mut self, bytes: &[u8]) -> Result<()> {
        let c = self.engine.config();
        let (layers, kv_dim, vocab) = (c.num_hidden_layers, c.kv_dim(), c.vocab_size);
        if bytes.len() < HEADER_LEN + CRC_LEN {
            return Err(invalid(format!(
                "{} bytes, shorter than the {}-byte minimum",
                bytes.len(),
                HEADER_LEN + CRC_LEN
            )));
        }
        let mut r = Reader { buf: bytes, pos: 0 };
        if r.take(8) != STATE_MAGIC {
            return Err(invalid("wrong magic (not a Strata session state)"));
        }
        let version = r.u32();
        let want = layout(c).2;
        if version != want {
            return Err(invalid(format!(
                "version {version} is not supported for this model (this build reads version {want} for {})",
                c.arch.name()
            )));
        }
        let flags = r.u32();
        let fingerprint = r.u64();
        let ours = model_fingerprint(c);
        if fingerprint != ours {
            return Err(invalid(format!(
                "saved from another model (config fingerprint {fingerprint:016x}, this engine's is {ours:016x})"
            )));
        }
        if flags & !(FLAG_LOGITS | FLAG_SAMPLER) != 0 {
            return Err(invalid(format!("unknown flags {flags:#x}")));
        }
        let dims = (r.u32() as usize, r.u32() as usize, r.u32() as usize);
        if dims != (layers, kv_dim, vocab) {
            return Err(invalid(format!(
                "(layers, kv_dim, vocab) {dims:?} differ from the model's {:?}",
                (layers, kv_dim, vocab)
            )));
        }
        let n = r.u64();
        match state_len(n, c, flags) {
            Some(len) if len == bytes.len() => {}
            _ => {
                return Err(invalid(format!(
                    "{} bytes do not hold the {n} tokens its header lists (truncated?)",
                    bytes.len()
                )))
            }
        }
        let body = bytes.len() - CRC_LEN;
        let stored = u32::from_le_bytes(bytes[body..].try_into().expect("4 bytes"));
        let actual = crc32fast::hash(&bytes[..body]);
        if stored != actual {
            return Err(invalid(format!("checksum mismatch: stored {stored:08x}, data gives {actual:08x} (corrupt)")));
        }
        let n = n as usize;
        if n > self.capacity {
            return Err(Error::ContextOverflow { needed: n, capacity: self.capacity });
        }
        let tokens: Vec<u32> = (0..n).map(|_| r.u32()).collect();
        if let Some((index, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange { token: t.into(), index, vocab });
        }
        // Tokens without logits are a session after a `truncate` that could
        // not know them (it round-trips); logits without tokens are not.
        if flags & FLAG_LOGITS != 0 && n == 0 {
            return Err(invalid("0 tokens with logits"));
        }
        let linear = crate::engine::linear_layers(c);
        let kv: Vec<(Vec<f32>, Vec<f32>)> = linear
            .iter()
            .map(|s| if s.is_some() { (Vec::new(), Vec::new()) } else { (r.f32s(n * kv_dim), r.f32s(n * kv_dim)) })
            .collect();
        let deltas: Vec<DeltaNetState> = linear
            .iter()
            .flatten()
            .map(|s| DeltaNetState { conv: r.f32s(s.conv_state_len()), recurrent: r.f32s(s.recurrent_state_len()) })
            .collect();
        // A session's caches, recurrent state and logits are finite (a
        // forward that made a NaN failed and changed nothing; Session::step
        // relies on finite logits): a state that holds one would fail every
        // later step.
        let finite = |what: String, values: &[f32]| match crate::sampling::first_nonfinite(values) {
            Some(i) => Err(invalid(format!("{what} {i} is {}: a state holds finite values", values[i]))),
            None => Ok(()),
        };
        for (layer, (k, v)) in kv.iter().enumerate() {
            finite(format!("layer {layer} key cache value"), k)?;
            finite(format!("layer {layer} value cache value"), v)?;
        }
        for (j, d) in deltas.iter().enumerate() {
            finite(format!("linear-attention layer {j} conv state value"), &d.conv)?;
            finite(format!("linear-attention layer {j} recurrent state value"), &d.recurrent)?;
        }
        let logits = (flags & FLAG_LOGITS != 0).then(|| r.f32s(vocab));
        if let Some(l) = &logits {
            finite("logit".into(), l)?;
        }
        let sampler = if flags & FLAG_SAMPLER != 0 {
            let temperature = r.f32();
            let top_k = usize::try_from(r.u64()).map_err(|_| invalid("sampler top_k does not fit"))?;
            let (top_p, min_p, seed) = (r.f32(), r.f32(), r.u64());
            let rng = Rng::from_state([r.u64(), r.u64(), r.u64(), r.u64()])
                .ok_or_else(|| invalid("sampler random state is all zero"))?;
            let params = SamplingParams { temperature, top_k, top_p, min_p, seed };
            Some(Sampler::with_rng(params, rng).map_err(|e| invalid(format!("sampler: {e}")))?)
        } else {
            None
        };
        debug_assert_eq!(r.pos, body);

        self.kv = self.kv.restored(kv_dim, n, &linear, kv, &deltas)?;
        self.tokens = tokens;
        self.logits = logits.map(crate::engine::HostLogits::from);
        self.sampler = sampler;
        self.kept = None;
        self.checkpoints.clear();
        if self.kv.is_hybrid() {
            // rewind_to back to the loaded position needs no replay (unless
            // the state held no logits: then it replays from the start).
            self.take_checkpoint(true);
        }
        Ok(())
    }
}
