//! A session: one conversation's tokens, KV cache and last logits, with
//! checkpoints to rewind to and a binary state to save and restore.
//!
//! Bad input is rejected before any state changes, and a failing forward
//! leaves the session as it was before the call (tokens, KV, logits) — a
//! NaN or infinity in a forward's hidden states or logits is such a failure
//! (`Error::NonFinite`, naming the layer and position).
//! Invariant: `logits` are those of the last held position, or `None`
//! (an empty session, or after `truncate` when they are not known).
//!
//! Threads: a `Session` is `Send`; sessions of one engine may run on
//! different threads at once (on a CUDA engine their GPU work takes turns
//! on the engine's stream, one forward at a time: docs/c-api.md,
//! "Ownership and threading"). Do not call a session from inside a rayon
//! task: a rayon worker that waits for the engine's parallel work may run
//! another queued task meanwhile, inside this call, on this thread; if that
//! task calls a session of the same engine with an expert cache, it waits
//! forever for the cache this call holds. Threads of your own, or
//! `std::thread::scope`, have no such limit.

pub(crate) mod kv;
pub mod state;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::DeltaNetState;
use crate::engine::{Engine, HostLogits, Logits, Piece};
use crate::error::{Error, Result};
use crate::sampling::{DrawAhead, Sampler, SamplingParams};
use kv::Cache;

/// Checkpoint ids: a session's are `base + 1`, `base + 2`, ... in the order
/// taken (automatic and explicit alike), with a `base` (a multiple of 2^32)
/// no other session of the process has, so an id is never reused and never
/// names a checkpoint of another session (whose rewind then fails with
/// `NotFound` and changes nothing).
static NEXT_ID_BASE: AtomicU64 = AtomicU64::new(0);
const IDS_PER_BASE: u64 = 1 << 32;

fn new_id_base() -> u64 {
    NEXT_ID_BASE.fetch_add(1, Ordering::Relaxed) * IDS_PER_BASE
}

#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// Most tokens the session holds; 0 = the model's max_position_embeddings.
    pub context_size: usize,
    /// Tokens per forward during prefill; 0 = the whole prompt in one forward.
    pub prefill_chunk: usize,
    /// Keep the logits of every position of the last prefill (`logits_at`).
    pub keep_all_logits: bool,
    /// On models with recurrent state (qwen3_next): besides the automatic
    /// checkpoint at the end of each prefill, take one whenever a prefill
    /// reaches a position that is a multiple of this many tokens (prefill
    /// pieces are split there). 0 = only at the end of each prefill.
    pub checkpoint_every: usize,
    /// Bytes that all checkpoints together may hold
    /// (`Checkpoint::size_bytes`); automatic checkpoints are evicted, oldest
    /// first, to stay under it (explicit ones never are, but count).
    /// 0 = `DEFAULT_CHECKPOINT_BUDGET`.
    pub checkpoint_budget: usize,
    /// Element type of the KV cache.
    pub kv_type: KvType,
}

/// Element type of a session's KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// The backend's choice: f32 on the CPU, int8 on CUDA.
    #[default]
    Auto,
    /// CPU only.
    F32,
    /// bf16 values. On the CPU, emulated: values rounded as the CUDA cache
    /// rounds them, kept in f32 (the reference for the GPU's bf16 cache).
    Bf16,
    /// int8 values with one f32 scale per position and kv head. On the
    /// CPU, emulated the same way (the reference for the GPU's int8 cache).
    Int8,
}

/// What a rewind restores: the number of tokens and the logits of the last
/// of them. qwen3_moe keeps only KV, which a rewind truncates; hybrid
/// models (Qwen3-Next) also keep every Gated DeltaNet layer's state, which
/// cannot be truncated.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Tokens the session held when the checkpoint was taken.
    pub position: usize,
    /// Logits of the last of those tokens (`None` at position 0).
    pub logits: Option<Vec<f32>>,
    /// The recurrent states at `position` (empty for qwen3_moe).
    pub(crate) deltas: Vec<DeltaNetState>,
    /// Taken by the session's policy on a hybrid model (evicted, oldest
    /// first, to keep all checkpoints under the session's budget).
    pub automatic: bool,
}

impl Checkpoint {
    /// Bytes this checkpoint holds: its logits and recurrent states.
    pub fn size_bytes(&self) -> usize {
        let floats = self.logits.as_ref().map_or(0, Vec::len)
            + self.deltas.iter().map(|d| d.conv.len() + d.recurrent.len()).sum::<usize>();
        floats * std::mem::size_of::<f32>()
    }
}

/// The checkpoint budget of a session that names none: 1 GiB (about a
/// dozen checkpoints of Qwen3-Next-80B-A3B, 79 MB of recurrent state each).
pub const DEFAULT_CHECKPOINT_BUDGET: usize = 1 << 30;

/// The logits of positions `start..start + rows.len() / vocab` (the last
/// prefill, with `keep_all_logits`), trimmed when the session is shortened.
struct KeptLogits {
    start: usize,
    rows: Vec<f32>,
}

pub struct Session {
    engine: Engine,
    kv: Cache,
    tokens: Vec<u32>,
    /// Logits of the last position, when they match `tokens`.
    logits: Option<HostLogits>,
    kept: Option<KeptLogits>,
    capacity: usize,
    prefill_chunk: usize,
    keep_all_logits: bool,
    checkpoint_every: usize,
    checkpoint_budget: usize,
    /// Every checkpoint here is valid: its position is at most `len()` and
    /// the tokens before it are unchanged, because shortening the session
    /// below a checkpoint's position drops the checkpoint.
    checkpoints: BTreeMap<u64, Checkpoint>,
    /// The id the next checkpoint takes (`new_id_base` + 1 at the start).
    next_checkpoint: u64,
    /// The sampler of `step_with`, kept while its parameters are unchanged.
    sampler: Option<Sampler>,
    /// Tokens run through the forward by this session, ever (successful
    /// forwards only): `prefill_conversation` reports its share.
    forwarded: u64,
    /// Steps whose token the device drew (`device_draws`).
    device_draws: u64,
}

/// With `STRATA_CHECK_DRAW=1` (builds with `test-hooks`): a draw made on
/// the device must be the token the host's sampler `before` picks from
/// `logits` (else `Error::Cuda`), so that the GPU suite's sampled sessions
/// check every device draw.
fn check_drawn(before: &Sampler, logits: &[f32], token: u32) -> Result<()> {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *ON.get_or_init(|| std::env::var("STRATA_CHECK_DRAW").is_ok_and(|v| v == "1")) {
            let host = before.clone().sample_checked(logits);
            if host != token {
                return Err(Error::Cuda(format!("the device drew token {token} where the host draws {host}")));
            }
        }
    }
    #[cfg(not(any(test, feature = "test-hooks")))]
    let _ = (before, logits, token);
    Ok(())
}

/// What `prefill_conversation` did. `reused + read` is the length of the
/// conversation it was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillReport {
    /// Tokens of the conversation not run through the forward in this call:
    /// their state was already in the session (the common prefix with the
    /// live tokens, or on a hybrid model the checkpoint the rewind
    /// restored).
    pub reused: usize,
    /// Tokens run through the forward in this call: the new tail, plus any
    /// tokens re-read after a checkpoint (hybrids) or to recompute the
    /// last position's logits.
    pub read: usize,
}

impl Session {
    pub(crate) fn new(engine: Engine, opts: &SessionOptions) -> Result<Session> {
        let c = engine.config();
        let max = c.max_position_embeddings;
        if opts.context_size > max {
            return Err(Error::InvalidArgument(format!(
                "context_size {} exceeds the model's max_position_embeddings {max}",
                opts.context_size
            )));
        }
        let capacity = if opts.context_size == 0 { max } else { opts.context_size };
        Ok(Session {
            kv: engine.new_cache(opts.kv_type)?,
            engine,
            tokens: Vec::new(),
            logits: None,
            kept: None,
            capacity,
            prefill_chunk: opts.prefill_chunk,
            keep_all_logits: opts.keep_all_logits,
            checkpoint_every: opts.checkpoint_every,
            checkpoint_budget: if opts.checkpoint_budget == 0 {
                DEFAULT_CHECKPOINT_BUDGET
            } else {
                opts.checkpoint_budget
            },
            checkpoints: BTreeMap::new(),
            next_checkpoint: new_id_base() + 1,
            sampler: None,
            forwarded: 0,
            device_draws: 0,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Appends `tokens` and returns the logits of the last position.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.run_prompt(tokens, false)?;
        Ok(self.logits.as_deref().expect("set by run_prompt"))
    }

    /// Makes the session hold `tokens`, the WHOLE conversation so far,
    /// reusing what it already holds: the longest common prefix `p` of
    /// `tokens` and the live tokens is kept; when the live tokens go on
    /// past `p` (the conversation diverges or is shorter), the session is
    /// rewound to `p` with `rewind_to` (on a hybrid model: the nearest
    /// checkpoint at or before `p`, then the tokens after it re-read); then
    /// `tokens[p..]` are prefilled. When `tokens` equals the live tokens and
    /// their logits are known, nothing runs and the logits stay.
    ///
    /// Logits then equal those of a fresh session fed `tokens` in the same
    /// calls (bit for bit when the split points match, e.g. a divergence at
    /// a checkpoint's position on a hybrid model).
    ///
    /// Bad input (empty, a token outside the vocabulary, more than the
    /// capacity) changes nothing. If a forward fails (a non-finite value,
    /// say), the session holds a prefix of `tokens` with consistent state:
    /// the common prefix (on a hybrid model the restored checkpoint's
    /// tokens) plus the prefill pieces read before the failing one, with
    /// the checkpoints taken on the way; calling again with the same
    /// conversation resumes from there instead of from the start. Until
    /// then the session may hold no logits (`rewind_to(len)` computes
    /// them).
    pub fn prefill_conversation(&mut self, tokens: &[u32]) -> Result<PrefillReport> {
        Self::check_tokens(&self.engine, tokens)?;
        if tokens.len() > self.capacity {
            return Err(Error::ContextOverflow { needed: tokens.len(), capacity: self.capacity });
        }
        let before = self.forwarded;
        let p = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        if p == tokens.len() {
            // Equal, or a prefix of the live tokens: exact logits at p.
            self.rewind_to(p)?;
        } else {
            if p < self.tokens.len() {
                if self.kv.is_hybrid() {
                    self.rewind_to(p)?;
                } else {
                    // KV truncates; the prefill below makes the logits.
                    self.truncate(p)?;
                }
            }
            // Keep what was read if a piece fails: calling again resumes.
            self.read_tokens(&tokens[p..], Read { all: false, keep_progress: true, end_checkpoint: true })?;
        }
        let read = (self.forwarded - before) as usize;
        Ok(PrefillReport { reused: tokens.len() - read, read })
    }

    /// Runs `tokens` through the engine on this session's cache, counting them.
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<HostLogits> {
        self.forward_drawing(tokens, want, None)
    }

    /// `forward`, with the next token drawn on the device as `draw` asks
    /// (`Engine::forward_drawing`).
    fn forward_drawing(&mut self, tokens: &[u32], want: Logits, draw: Option<&DrawAhead>) -> Result<HostLogits> {
        let logits = self.engine.forward_drawing(&mut self.kv, tokens, want, draw)?;
        self.forwarded += tokens.len() as u64;
        Ok(logits)
    }

    /// Appends `tokens` and returns the logits of every new position,
    /// row-major `[tokens.len(), vocab]`.
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.run_prompt(tokens, true)
    }

    /// Samples the next token from the current logits, appends it and runs
    /// it, so that `logits()` is fresh. Returns the token. On error nothing
    /// changes, the sampler's random stream included.
    pub fn step(&mut self, sampler: &mut Sampler) -> Result<u32> {
        let Some(logits) = &self.logits else {
            return Err(Error::InvalidArgument(format!(
                "step: the session has no logits (holds {} tokens): prefill a prompt first",
                self.tokens.len()
            )));
        };
        self.check_room(1)?;
        if logits.is_empty() {
            return Err(Error::InvalidArgument("step: the session's logits are empty".into()));
        }
        // Held logits are finite: the engine fails a forward whose logits
        // are not (Error::NonFinite), and load_state refuses them; so no
        // scan here (a decode step would read the vocabulary once more).
        debug_assert!(crate::sampling::first_nonfinite(logits).is_none(), "a session holds non-finite logits");
        let before = sampler.clone();
        // The draw the device made with the last forward, when it was made
        // for this sampler as it is (a CUDA engine, a loop of steps with one
        // sampler); else the host's. The same token either way.
        let drawn = logits.drawn().and_then(|d| sampler.take_drawn(d));
        let token = match drawn {
            Some(token) => {
                if let Err(e) = check_drawn(&before, logits, token) {
                    *sampler = before;
                    return Err(e);
                }
                token
            }
            None => sampler.sample_checked(logits),
        };
        // Asks the device to draw the next token right after this step's
        // logits, for this sampler's next state.
        match self.forward_drawing(&[token], Logits::Last, Some(&sampler.ahead())) {
            Ok(logits) => {
                self.tokens.push(token);
                self.logits = Some(logits);
                self.device_draws += drawn.is_some() as u64;
                Ok(token)
            }
            Err(e) => {
                *sampler = before;
                Err(e)
            }
        }
    }

    /// How many of this session's steps took the token the device drew
    /// ahead (a CUDA engine: every step of a loop with one sampler but the
    /// first after a prefill or a rewind); the others drew on the host.
    /// The tokens are the same either way.
    pub fn device_draws(&self) -> u64 {
        self.device_draws
    }

    /// `step` with the session's own sampler, made from `params` and kept
    /// across calls while `params` stay equal: a run of `step_with` with
    /// one seed gives the tokens of a `Sampler` loop with that seed.
    pub fn step_with(&mut self, params: &SamplingParams) -> Result<u32> {
        let previous = self.sampler.take();
        let mut sampler = match &previous {
            Some(s) if s.params() == params => s.clone(),
            _ => match Sampler::new(params.clone()) {
                Ok(s) => s,
                Err(e) => {
                    self.sampler = previous;
                    return Err(e);
                }
            },
        };
        let r = self.step(&mut sampler);
        self.sampler = if r.is_ok() { Some(sampler) } else { previous };
        r
    }

    /// The sampler `step_with` uses, if it has run.
    pub fn sampler(&self) -> Option<&Sampler> {
        self.sampler.as_ref()
    }

    /// Logits of the last position, if the last call produced them.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// Logits of one position: `index >= 0` is a position, `-1` the last,
    /// `-2` the one before... The last position's are always there (after
    /// a prefill or step); others only with `keep_all_logits`, for the
    /// positions of the last prefill.
    pub fn logits_at(&self, index: i64) -> Result<&[f32]> {
        let len = self.tokens.len();
        let pos = if index < 0 { len as i64 + index } else { index };
        if pos < 0 || pos >= len as i64 {
            return Err(Error::InvalidArgument(format!("logits index {index}: the session holds {len} positions")));
        }
        let pos = pos as usize;
        if pos + 1 == len {
            if let Some(l) = &self.logits {
                return Ok(l);
            }
        }
        self.kept_row(pos).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "logits of position {pos} are not kept (only the last position's, and with keep_all_logits \
                 those of the last prefill)"
            ))
        })
    }

    fn kept_row(&self, pos: usize) -> Option<&[f32]> {
        let vocab = self.engine.config().vocab_size;
        let k = self.kept.as_ref()?;
        let i = pos.checked_sub(k.start)?;
        k.rows.get(i * vocab..(i + 1) * vocab)
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Most tokens this session can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `n` tokens and their KV, dropping the rest. The
    /// logits are those of position `n - 1` when the session knows them (a
    /// checkpoint at `n`, kept logits), else `None`; `rewind_to` recomputes
    /// them instead.
    ///
    /// A hybrid model's recurrent state cannot be cut: there `truncate` is
    /// `rewind_to` (restore the nearest checkpoint, re-read the rest).
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        self.check_shorten(n, "truncate")?;
        if self.kv.is_hybrid() {
            return self.rewind_to(n);
        }
        if n < self.tokens.len() {
            let known = self.known_logits(n);
            self.shorten(n);
            self.logits = known.map(HostLogits::from);
        }
        Ok(())
    }

    /// Keeps the first `position` tokens, with exact logits: from a
    /// checkpoint at `position` or the kept logits when there is one, else
    /// by running token `position - 1` again. Logits then equal bit for bit
    /// those of a fresh session fed the same tokens. If that forward fails,
    /// the session holds `position - 1` tokens.
    ///
    /// On a hybrid model (Qwen3-Next) the recurrent state comes from the
    /// nearest checkpoint at or before `position` (one at `position` counts
    /// only with its logits; the session start counts as an empty one) and
    /// the tokens after it are read again, in the session's prefill chunks,
    /// so the state and logits equal those of a fresh session fed the same
    /// tokens in the same calls, split at the checkpoints. If that forward
    /// fails, the session holds the checkpoint's tokens.
    pub fn rewind_to(&mut self, position: usize) -> Result<()> {
        self.check_shorten(position, "rewind_to")?;
        if position == self.tokens.len() && (self.logits.is_some() || position == 0) {
            return Ok(());
        }
        if self.kv.is_hybrid() {
            return self.rewind_hybrid(position);
        }
        let known = self.known_logits(position);
        if known.is_some() || position == 0 {
            self.shorten(position);
            self.logits = known.map(HostLogits::from);
            return Ok(());
        }
        // Token `position - 1` runs again for its logits. Checkpoints at
        // `position` stay: the session returns there (unless that fails).
        let last = self.tokens[position - 1];
        self.shorten(position);
        self.kv.truncate(position - 1);
        self.tokens.truncate(position - 1);
        self.logits = None;
        match self.forward(&[last], Logits::Last) {
            Ok(logits) => {
                self.tokens.push(last);
                self.logits = Some(logits);
                Ok(())
            }
            Err(e) => {
                self.checkpoints.retain(|_, cp| cp.position < position);
                Err(e)
            }
        }
    }

    /// Records the current position and logits; `rewind(id)` returns here.
    /// The id stays valid until the session is shortened below this
    /// position (by a rewind, `rewind_to`, `truncate` or a state load) or
    /// the checkpoint is released.
    pub fn checkpoint(&mut self) -> u64 {
        self.take_checkpoint(false)
    }

    fn take_checkpoint(&mut self, automatic: bool) -> u64 {
        let id = self.next_checkpoint;
        self.next_checkpoint = if (id + 1) % IDS_PER_BASE == 0 { new_id_base() + 1 } else { id + 1 };
        let deltas = if self.kv.is_hybrid() { self.kv.deltas() } else { Vec::new() };
        let logits = self.logits.as_deref().map(<[f32]>::to_vec);
        let cp = Checkpoint { position: self.tokens.len(), logits, deltas, automatic };
        self.checkpoints.insert(id, cp);
        self.enforce_checkpoint_budget();
        id
    }

    /// Evicts automatic checkpoints, oldest first, until all checkpoints
    /// together fit the budget (or only explicit ones are left).
    fn enforce_checkpoint_budget(&mut self) {
        let mut total: usize = self.checkpoints.values().map(Checkpoint::size_bytes).sum();
        while total > self.checkpoint_budget {
            let Some((&oldest, cp)) = self.checkpoints.iter().find(|(_, c)| c.automatic) else {
                break;
            };
            total -= cp.size_bytes();
            self.checkpoints.remove(&oldest);
        }
    }

    /// Bytes all valid checkpoints hold together.
    pub fn checkpoints_size(&self) -> usize {
        self.checkpoints.values().map(Checkpoint::size_bytes).sum()
    }

    /// Ids of the valid checkpoints, oldest first (automatic ones included).
    pub fn checkpoint_ids(&self) -> Vec<u64> {
        self.checkpoints.keys().copied().collect()
    }

    /// Bytes checkpoint `id` holds (logits and recurrent states).
    pub fn checkpoint_size(&self, id: u64) -> Result<usize> {
        self.checkpoints.get(&id).map(Checkpoint::size_bytes).ok_or_else(|| Self::no_checkpoint(id))
    }

    /// `rewind_to` on a hybrid model: restore the nearest checkpoint at or
    /// before `position`, then re-read the tokens after it.
    fn rewind_hybrid(&mut self, position: usize) -> Result<()> {
        // A checkpoint at `position` itself serves only with its logits (one
        // taken when the session had none would leave none).
        let base = self
            .checkpoints
            .values()
            .filter(|c| c.position < position || (c.position == position && c.logits.is_some()))
            .max_by_key(|c| c.position);
        let (base_pos, logits, deltas) = match base {
            Some(c) => (c.position, c.logits.clone(), Some(c.deltas.clone())),
            None => (0, None, None),
        };
        let replay = self.tokens[base_pos..position].to_vec();
        // Checkpoints at `position` above the base (without logits) stay
        // valid: the replay returns there (unless it fails).
        let at: Vec<u64> = self
            .checkpoints
            .iter()
            .filter(|(_, c)| c.position == position && position > base_pos)
            .map(|(&id, _)| id)
            .collect();
        let kept: Vec<(u64, Checkpoint)> =
            at.iter().filter_map(|id| self.checkpoints.remove(id).map(|c| (*id, c))).collect();
        self.shorten(base_pos);
        match deltas {
            Some(d) => self.kv.restore_deltas(&d),
            None => self.kv.reset_deltas(),
        }
        self.logits = logits.map(HostLogits::from);
        if !replay.is_empty() {
            // On failure the session is back at the checkpoint.
            self.read_tokens(&replay, Read { all: false, keep_progress: false, end_checkpoint: false })?;
        }
        self.checkpoints.extend(kept);
        // They were out of the count while the replay's own checkpoints
        // were taken.
        self.enforce_checkpoint_budget();
        Ok(())
    }

    /// Returns to checkpoint `id`: its position and logits, exactly.
    /// Checkpoints at later positions become invalid; this one stays.
    pub fn rewind(&mut self, id: u64) -> Result<()> {
        let cp = self.checkpoints.get(&id).ok_or_else(|| Self::no_checkpoint(id))?;
        let (position, logits) = (cp.position, cp.logits.clone());
        let deltas = self.kv.is_hybrid().then(|| cp.deltas.clone());
        self.shorten(position);
        if let Some(d) = deltas {
            self.kv.restore_deltas(&d);
        }
        self.logits = logits.map(HostLogits::from);
        Ok(())
    }

    /// Forgets checkpoint `id` (its logits are freed).
    pub fn release_checkpoint(&mut self, id: u64) -> Result<()> {
        self.checkpoints.remove(&id).map(|_| ()).ok_or_else(|| Self::no_checkpoint(id))
    }

    /// The checkpoint `id`, if it is valid.
    pub fn checkpoint_info(&self, id: u64) -> Option<&Checkpoint> {
        self.checkpoints.get(&id)
    }

    fn no_checkpoint(id: u64) -> Error {
        Error::NotFound(format!(
            "checkpoint {id} is unknown, released, or was invalidated when the session was shortened below its position"
        ))
    }

    fn check_shorten(&self, n: usize, what: &str) -> Result<()> {
        if n > self.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "{what} to {n} tokens: the session holds only {}",
                self.tokens.len()
            )));
        }
        Ok(())
    }

    /// The logits of position `n - 1` if the session has them without a
    /// forward.
    fn known_logits(&self, n: usize) -> Option<Vec<f32>> {
        if n == 0 {
            return None;
        }
        if n == self.tokens.len() {
            if let Some(l) = &self.logits {
                return Some(l.to_vec());
            }
        }
        if let Some(cp) = self.checkpoints.values().find(|cp| cp.position == n && cp.logits.is_some()) {
            return cp.logits.clone();
        }
        self.kept_row(n - 1).map(|r| r.to_vec())
    }

    /// Drops tokens, KV and kept logits past `n`, and the checkpoints that
    /// they invalidate. Leaves `logits` to the caller.
    fn shorten(&mut self, n: usize) {
        self.kv.truncate(n);
        self.tokens.truncate(n);
        self.checkpoints.retain(|_, cp| cp.position <= n);
        let vocab = self.engine.config().vocab_size;
        if let Some(k) = &mut self.kept {
            if k.start >= n {
                self.kept = None;
            } else {
                k.rows.truncate((n - k.start) * vocab);
            }
        }
    }

    fn check_room(&self, more: usize) -> Result<()> {
        let needed = self.tokens.len() + more;
        if needed > self.capacity {
            return Err(Error::ContextOverflow { needed, capacity: self.capacity });
        }
        Ok(())
    }

    /// Checks a prompt against the vocabulary of `engine`: every failure of
    /// `prefill` that does not depend on the session's state.
    pub fn check_tokens(engine: &Engine, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("empty prompt: prefill needs at least one token".into()));
        }
        let vocab = engine.config().vocab_size;
        if let Some((index, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange { token: t.into(), index, vocab });
        }
        Ok(())
    }

    /// Runs a prompt (see `read_tokens`) after checking it: every failure
    /// that does not depend on the forward happens before anything changes.
    fn run_prompt(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        Self::check_tokens(&self.engine, tokens)?;
        self.check_room(tokens.len())?;
        self.read_tokens(tokens, Read { all, keep_progress: false, end_checkpoint: true })
    }

    /// The pieces in which `n` tokens appended at position `start` run
    /// through the forward: `(offset, len, checkpoint)`, at most
    /// `prefill_chunk` tokens each, also split where a piece reaches a
    /// multiple of `checkpoint_every` on a hybrid model (`checkpoint`: the
    /// policy takes one after that piece).
    fn pieces(&self, start: usize, n: usize) -> Vec<(usize, usize, bool)> {
        let chunk = if self.prefill_chunk == 0 { n } else { self.prefill_chunk };
        let every = if self.kv.is_hybrid() { self.checkpoint_every } else { 0 };
        let mut out = Vec::new();
        let mut off = 0;
        while off < n {
            let mut end = (off + chunk).min(n);
            let mut at_mark = false;
            if let Some(q) = (start + off).checked_div(every) {
                let mark = (q + 1) * every - start;
                if mark <= end {
                    end = mark;
                    at_mark = true;
                }
            }
            out.push((off, end - off, at_mark));
            off = end;
        }
        out
    }

    /// Reads `tokens` at the end of the session, piece by piece (`pieces`),
    /// appending each piece's tokens once its forward succeeded and taking
    /// the policy's checkpoints. Returns every row's logits when
    /// `read.all` (or `keep_all_logits`), else the last row's.
    ///
    /// If a forward fails, the engine has already put the cache back as it
    /// was before that piece. With `keep_progress` the session then keeps
    /// the pieces read so far (with the logits of the last of them when
    /// they were computed, else none) and the checkpoints taken on the way;
    /// without it, everything this call did is undone: tokens, cache,
    /// recurrent states, logits and its checkpoints.
    fn read_tokens(&mut self, tokens: &[u32], read: Read) -> Result<Vec<f32>> {
        let all = read.all || self.keep_all_logits;
        let start = self.kv.len();
        debug_assert_eq!(start, self.tokens.len());
        self.kv.reserve(tokens.len())?;
        let vocab = self.engine.config().vocab_size;
        let pieces = self.pieces(start, tokens.len());
        let n_pieces = pieces.len();
        // Undoing a whole call needs the state from before it only when a
        // later piece can fail after an earlier one succeeded: a single
        // piece is undone by the engine itself (and changes nothing here
        // before it succeeds).
        let before = (!read.keep_progress && n_pieces > 1).then(|| {
            let deltas = if self.kv.is_hybrid() { Some(self.kv.deltas()) } else { None };
            (deltas, self.logits.clone())
        });
        let mut out = Vec::new();
        let want = |i: usize, checkpoint: bool| match (all, i + 1 == n_pieces || checkpoint) {
            (true, _) => Logits::All,
            (false, true) => Logits::Last,
            (false, false) => Logits::Skip,
        };
        // Runs of pieces that end at a checkpoint piece (its state is taken
        // after it) or at the last: the engine may pipeline a run.
        let mut first = 0;
        while first < n_pieces {
            let end = (first..n_pieces).find(|&i| pieces[i].2).map_or(n_pieces, |i| i + 1);
            let run: Vec<Piece<'_>> = (first..end)
                .map(|i| {
                    let (off, len, checkpoint) = pieces[i];
                    Piece { tokens: &tokens[off..off + len], want: want(i, checkpoint) }
                })
                .collect();
            // Undoing the whole call on failure (`before`): the engine
            // need not keep the completed pieces of a failed run.
            let (done, failed) = self.engine.forward_pieces(&mut self.kv, &run, before.is_none());
            for (k, l) in done.into_iter().enumerate() {
                let i = first + k;
                let (off, len, checkpoint) = pieces[i];
                let (last, part) = (i + 1 == n_pieces, &tokens[off..off + len]);
                self.forwarded += len as u64;
                self.tokens.extend_from_slice(part);
                if all || last {
                    out.extend_from_slice(&l);
                }
                // One row (a decode-size piece) is kept as it came.
                self.logits = match run[k].want {
                    Logits::Skip => None,
                    _ if l.len() == vocab => Some(l),
                    _ => Some(l[l.len() - vocab..].to_vec().into()),
                };
                if checkpoint && !(last && read.end_checkpoint) {
                    self.take_checkpoint(true);
                }
            }
            if let Some(e) = failed {
                if let Some((deltas, logits)) = before {
                    self.tokens.truncate(start);
                    self.kv.truncate(start);
                    if let Some(d) = &deltas {
                        self.kv.restore_deltas(d);
                    }
                    self.logits = logits;
                    self.checkpoints.retain(|_, cp| cp.position <= start);
                }
                return Err(e);
            }
            first = end;
        }
        if self.keep_all_logits {
            self.kept = Some(KeptLogits { start, rows: out.clone() });
        }
        if read.end_checkpoint && self.kv.is_hybrid() {
            self.take_checkpoint(true);
        }
        Ok(out)
    }
}

/// How `read_tokens` runs.
#[derive(Clone, Copy)]
struct Read {
    /// Return every row's logits.
    all: bool,
    /// On failure keep the pieces read so far (else undo the whole call).
    keep_progress: bool,
    /// Take an automatic checkpoint at the end (hybrid models).
    end_checkpoint: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_pack::{tiny_config, write_tiny_pack, TinyPack};
    use crate::engine::EngineOptions;
    use crate::sampling::SamplingParams;
    use tempfile::TempDir;

    fn tiny_engine(opts: &TinyPack) -> (TempDir, Engine) {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), opts).unwrap();
        let e = Engine::load(dir.path(), &EngineOptions::default()).unwrap();
        (dir, e)
    }

    fn session(e: &Engine, prefill_chunk: usize) -> Session {
        e.new_session(&SessionOptions { prefill_chunk, ..Default::default() }).unwrap()
    }

    const PROMPT: [u32; 11] = [3, 96, 14, 15, 92, 65, 35, 89, 79, 32, 38];

    /// max |a - b| <= 1e-5 * max |b|.
    fn assert_close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0 && b.iter().all(|v| v.is_finite()), "{what}: degenerate logits");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * scale, "{what}: index {i}: {x} vs {y}");
        }
    }

    #[test]
    fn whole_chunked_and_token_by_token_prefill_agree() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let vocab = e.config().vocab_size;
        let whole = session(&e, 0).prefill_all(&PROMPT).unwrap();
        assert_eq!(whole.len(), PROMPT.len() * vocab);
        let chunked = session(&e, 3).prefill_all(&PROMPT).unwrap();
        assert_close(&chunked, &whole, "chunk 3");
        let mut one = session(&e, 0);
        for (i, &t) in PROMPT.iter().enumerate() {
            let l = one.prefill(&[t]).unwrap().to_vec();
            assert_close(&l, &whole[i * vocab..(i + 1) * vocab], &format!("position {i}"));
        }
        // prefill returns the last row of prefill_all, and logits() keeps it.
        let mut s = session(&e, 4);
        let last = s.prefill(&PROMPT).unwrap().to_vec();
        assert_close(&last, &whole[(PROMPT.len() - 1) * vocab..], "prefill last");
        assert_eq!(s.logits().unwrap(), &last[..]);
        assert_eq!((s.len(), s.tokens()), (PROMPT.len(), &PROMPT[..]));
        // Rows differ by position: the comparison above is not vacuous.
        assert_ne!(&whole[..vocab], &whole[vocab..2 * vocab]);
    }

    #[test]
    fn greedy_generation_is_identical_across_chunk_sizes() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let generate = |chunk| {
            let mut s = session(&e, chunk);
            s.prefill(&PROMPT).unwrap();
            let mut g = Sampler::greedy();
            let out: Vec<u32> = (0..12).map(|_| s.step(&mut g).unwrap()).collect();
            assert_eq!(s.len(), PROMPT.len() + 12);
            assert_eq!(&s.tokens()[PROMPT.len()..], &out[..]);
            out
        };
        let reference = generate(0);
        for chunk in [1, 2, 3, 5, 64] {
            assert_eq!(generate(chunk), reference, "chunk {chunk}");
        }
        // Not a fixed point: the generated tokens vary.
        let mut distinct = reference.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 1, "{reference:?}");
    }

    #[test]
    fn step_logits_equal_prefill_of_the_same_tokens() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut a = session(&e, 0);
        a.prefill(&PROMPT[..4]).unwrap();
        let mut sampler =
            Sampler::new(SamplingParams { temperature: 0.8, seed: 11, ..SamplingParams::default() }).unwrap();
        for _ in 0..5 {
            a.step(&mut sampler).unwrap();
        }
        let mut b = session(&e, 0);
        let lb = b.prefill(a.tokens()).unwrap().to_vec();
        assert_close(a.logits().unwrap(), &lb, "step vs prefill");
    }

    #[test]
    fn truncate_then_prefill_reproduces_logits() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let vocab = e.config().vocab_size;
        let mut s = session(&e, 2);
        let all = s.prefill_all(&PROMPT).unwrap();
        // Same length: nothing changes, logits stay.
        s.truncate(PROMPT.len()).unwrap();
        assert!(s.logits().is_some());
        s.truncate(5).unwrap();
        assert_eq!((s.len(), s.tokens()), (5, &PROMPT[..5]));
        assert!(s.logits().is_none());
        let again = s.prefill_all(&PROMPT[5..]).unwrap();
        assert_close(&again, &all[5 * vocab..], "after truncate");
        // A different continuation after truncation does not see the old tail.
        s.truncate(5).unwrap();
        let other = s.prefill(&[1, 2]).unwrap().to_vec();
        let mut fresh = session(&e, 0);
        let mut p = PROMPT[..5].to_vec();
        p.extend([1, 2]);
        assert_close(&other, fresh.prefill(&p).unwrap(), "new tail");
        s.truncate(0).unwrap();
        assert!(s.is_empty());
        let e2 = s.truncate(1).unwrap_err().to_string();
        assert!(e2.contains("truncate to 1"), "{e2}");
    }

    /// The observable state of a session.
    fn state(s: &Session) -> (Vec<u32>, usize, Option<Vec<f32>>, usize) {
        (s.tokens().to_vec(), s.len(), s.logits().map(|l| l.to_vec()), s.kv.len())
    }

    #[test]
    fn bad_input_is_rejected_and_changes_nothing() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let cap = e.config().max_position_embeddings;
        let mut s = session(&e, 3);
        // No logits yet: step fails.
        let err = s.step(&mut Sampler::greedy()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("no logits")), "{err}");
        s.prefill(&PROMPT).unwrap();
        let before = state(&s);

        let err = s.prefill(&[]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.starts_with("empty prompt")), "{err}");
        assert_eq!(state(&s), before);

        let err = s.prefill_all(&[1, 2, 97, 5]).unwrap_err();
        assert!(matches!(err, Error::TokenOutOfRange { token: 97, index: 2, vocab: 97 }), "{err}");
        assert!(err.to_string().contains("token 97 at index 2"), "{err}");
        assert_eq!(state(&s), before);
        let err = s.prefill(&[u32::MAX]).unwrap_err().to_string();
        assert!(err.contains(&u32::MAX.to_string()), "{err}");
        assert_eq!(state(&s), before);

        let room = cap - PROMPT.len();
        let err = s.prefill(&vec![1; room + 1]).unwrap_err();
        assert!(
            matches!(err, Error::ContextOverflow { needed, capacity } if needed == cap + 1 && capacity == cap),
            "{err}"
        );
        assert_eq!(state(&s), before);

        let err = s.truncate(PROMPT.len() + 1).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert_eq!(state(&s), before);

        // The session still works, and fills exactly to capacity.
        s.prefill(&vec![1; room]).unwrap();
        assert_eq!(s.len(), cap);
        let full = state(&s);
        let err = s.step(&mut Sampler::greedy()).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { needed, .. } if needed == cap + 1), "{err}");
        assert_eq!(state(&s), full);
    }

    #[test]
    fn context_size_is_checked_and_limits_the_session() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let max = e.config().max_position_embeddings;
        let err =
            e.new_session(&SessionOptions { context_size: max + 1, ..Default::default() }).err().unwrap().to_string();
        assert!(err.contains(&format!("context_size {}", max + 1)), "{err}");
        let mut s = e.new_session(&SessionOptions { context_size: 8, ..Default::default() }).unwrap();
        assert_eq!(s.capacity(), 8);
        assert_eq!(session(&e, 0).capacity(), max);
        let err = s.prefill(&PROMPT).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { needed: 11, capacity: 8 }), "{err}");
        assert!(s.is_empty() && s.logits().is_none());
    }

    #[test]
    fn expert_global_scales_are_applied() {
        let (_a, good) = tiny_engine(&TinyPack::default());
        let (_b, unscaled) = tiny_engine(&TinyPack { expert_global_scale: Some(1.0), ..TinyPack::default() });
        // The fixture's scales are far from 1, so dropping them cannot hide.
        let g = good.pack().expert(0, 0).unwrap();
        assert!(g.gate.global_scale < 1e-2 && g.gate.global_scale != g.up.global_scale);
        assert_eq!(unscaled.pack().expert(1, 7).unwrap().down.global_scale, 1.0);
        let a = session(&good, 0).prefill_all(&PROMPT).unwrap();
        let b = session(&unscaled, 0).prefill_all(&PROMPT).unwrap();
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(&b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff > 0.1 * scale, "max diff {diff} vs max logit {scale}");
    }

    fn keep_all(e: &Engine) -> Session {
        e.new_session(&SessionOptions { keep_all_logits: true, ..Default::default() }).unwrap()
    }

    #[test]
    fn rewind_to_a_checkpoint_restores_position_and_logits_exactly() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut s = session(&e, 3);
        s.prefill(&PROMPT).unwrap();
        let at_prompt = s.logits().unwrap().to_vec();
        let cp = s.checkpoint();
        let mut g = Sampler::greedy();
        let first: Vec<(u32, Vec<f32>)> =
            (0..4).map(|_| (s.step(&mut g).unwrap(), s.logits().unwrap().to_vec())).collect();
        let late = s.checkpoint();
        s.rewind(cp).unwrap();
        assert_eq!((s.len(), s.tokens(), s.logits().unwrap()), (PROMPT.len(), &PROMPT[..], &at_prompt[..]));
        let again: Vec<(u32, Vec<f32>)> =
            (0..4).map(|_| (s.step(&mut g).unwrap(), s.logits().unwrap().to_vec())).collect();
        assert_eq!(again, first, "bit for bit");
        // A fresh session fed the same tokens agrees bit for bit too.
        let mut fresh = session(&e, 0);
        let mut all = PROMPT.to_vec();
        all.extend(first.iter().map(|f| f.0));
        assert_eq!(fresh.prefill(&all).unwrap(), &first[3].1[..]);
        // `late` sits past the rewind point: invalid; `cp` stays valid.
        assert!(matches!(s.rewind(late), Err(Error::NotFound(_))));
        assert_eq!(s.checkpoint_info(cp).unwrap().position, PROMPT.len());
        s.release_checkpoint(cp).unwrap();
        assert!(matches!(s.rewind(cp), Err(Error::NotFound(_))));
    }

    #[test]
    fn another_sessions_checkpoint_id_is_not_found_and_changes_nothing() {
        // Ids counted per session would make A's first id B's first id too:
        // B's rewind to it would succeed and cut B back.
        let (_d, e) = tiny_engine(&TinyPack::default());
        let (mut a, mut b) = (session(&e, 0), session(&e, 0));
        a.prefill(&PROMPT[..2]).unwrap();
        let from_a = a.checkpoint();
        b.prefill(&PROMPT).unwrap();
        let own = b.checkpoint();
        assert_ne!(own, from_a);
        b.prefill(&PROMPT[..2]).unwrap();
        let (tokens, logits) = (b.tokens().to_vec(), b.logits().unwrap().to_vec());
        assert!(matches!(b.rewind(from_a), Err(Error::NotFound(_))));
        assert_eq!((b.tokens(), b.logits().unwrap()), (&tokens[..], &logits[..]));
        b.rewind(own).unwrap();
        assert_eq!(b.len(), PROMPT.len());
        a.rewind(from_a).unwrap();
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn rewind_to_recomputes_logits_that_nobody_kept() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut s = session(&e, 0);
        s.prefill(&PROMPT).unwrap();
        let cp3 = s.checkpoint();
        s.rewind_to(7).unwrap();
        let mut fresh = session(&e, 0);
        assert_eq!(s.logits().unwrap(), fresh.prefill(&PROMPT[..7]).unwrap());
        assert_eq!(s.tokens(), &PROMPT[..7]);
        // The checkpoint past 7 is gone, even though nothing was appended.
        assert!(s.checkpoint_info(cp3).is_none());
        // A checkpoint at or before the rewind point survives appends.
        let cp7 = s.checkpoint();
        s.prefill(&[1, 2]).unwrap();
        s.rewind(cp7).unwrap();
        assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());
        // truncate keeps known logits (a checkpoint here) and drops unknown ones.
        s.prefill(&[5, 6]).unwrap();
        s.truncate(7).unwrap();
        assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());
        s.truncate(4).unwrap();
        assert!(s.logits().is_none());
        s.rewind_to(4).unwrap();
        assert_eq!(s.logits().unwrap(), session(&e, 0).prefill(&PROMPT[..4]).unwrap());
        s.rewind_to(0).unwrap();
        assert!(s.is_empty() && s.logits().is_none());
        assert!(matches!(s.rewind_to(1), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn kept_logits_cover_the_last_prefill_and_follow_truncation() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let vocab = e.config().vocab_size;
        let whole = session(&e, 0).prefill_all(&PROMPT).unwrap();
        let mut s = keep_all(&e);
        s.prefill(&PROMPT[..2]).unwrap();
        s.prefill(&PROMPT[2..]).unwrap();
        for pos in 2..PROMPT.len() {
            assert_eq!(s.logits_at(pos as i64).unwrap(), &whole[pos * vocab..(pos + 1) * vocab]);
        }
        assert_eq!(s.logits_at(-1).unwrap(), s.logits_at(PROMPT.len() as i64 - 1).unwrap());
        assert_eq!(s.logits_at(-9).unwrap(), s.logits_at(2).unwrap());
        for bad in [1, -10, 11, -12] {
            assert!(matches!(s.logits_at(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
        // After a step the last position is the step's; kept rows remain.
        s.step(&mut Sampler::greedy()).unwrap();
        assert_eq!(s.logits_at(-1).unwrap(), s.logits().unwrap());
        assert_eq!(s.logits_at(5).unwrap(), &whole[5 * vocab..6 * vocab]);
        // Truncation trims them; rewind_to inside them needs no forward.
        s.rewind_to(6).unwrap();
        assert_eq!(s.logits().unwrap(), &whole[5 * vocab..6 * vocab]);
        assert!(s.logits_at(6).is_err());
        // Without keep_all_logits, only the last position's.
        let mut plain = session(&e, 0);
        plain.prefill(&PROMPT).unwrap();
        let err = plain.logits_at(0).unwrap_err().to_string();
        assert!(err.contains("not kept"), "{err}");
    }

    #[test]
    fn step_with_keeps_its_sampler_while_params_are_equal() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let params = SamplingParams { temperature: 0.9, top_k: 30, seed: 5, ..SamplingParams::default() };
        let mut a = session(&e, 0);
        a.prefill(&PROMPT).unwrap();
        let via_session: Vec<u32> = (0..10).map(|_| a.step_with(&params).unwrap()).collect();
        let mut b = session(&e, 0);
        b.prefill(&PROMPT).unwrap();
        let mut sampler = Sampler::new(params.clone()).unwrap();
        let via_loop: Vec<u32> = (0..10).map(|_| b.step(&mut sampler).unwrap()).collect();
        assert_eq!(via_session, via_loop);
        // New params start a new stream; invalid params change nothing.
        let before = a.save_state();
        let bad = SamplingParams { top_p: 0.0, ..params.clone() };
        assert!(a.step_with(&bad).is_err());
        assert_eq!(a.save_state(), before);
        assert_eq!(a.sampler().unwrap().params(), &params);
        // A failed step (context full) leaves the sampler's stream where it was.
        let mut full = e.new_session(&SessionOptions { context_size: PROMPT.len() + 1, ..Default::default() }).unwrap();
        full.prefill(&PROMPT).unwrap();
        full.step_with(&params).unwrap();
        let state = full.save_state();
        assert!(matches!(full.step_with(&params), Err(Error::ContextOverflow { .. })));
        assert_eq!(full.save_state(), state);
    }

    #[test]
    fn a_state_with_non_finite_logits_is_refused() {
        // A session holds only finite logits (step relies on it): a state
        // whose logits are not, its checksum made right, is refused and
        // changes nothing.
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut s = session(&e, 0);
        s.prefill(&PROMPT).unwrap();
        let mut state = s.save_state();
        let mut other = session(&e, 0);
        other.prefill(&[4, 5]).unwrap();
        let keep = other.save_state();
        // No sampler: the logits are the last section before the checksum.
        let vocab = e.config().vocab_size;
        let body = state.len() - 4;
        let at = body - 4 * vocab + 4 * 3;
        state[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = crc32fast::hash(&state[..body]);
        state[body..].copy_from_slice(&crc.to_le_bytes());
        let err = other.load_state(&state).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("logit 3 is NaN")), "{err}");
        assert_eq!(other.save_state(), keep);
    }

    #[test]
    fn state_round_trips_and_is_validated_before_use() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let params = SamplingParams { temperature: 1.1, seed: 9, ..SamplingParams::default() };
        let mut a = session(&e, 0);
        a.prefill(&PROMPT).unwrap();
        a.step_with(&params).unwrap();
        let bytes = a.save_state();
        assert_eq!(bytes.len(), a.state_size());
        assert_eq!(&bytes[..8], b"STRATAST");
        let mut b = session(&e, 0);
        b.load_state(&bytes).unwrap();
        assert_eq!((b.tokens(), b.logits()), (a.tokens(), a.logits()));
        assert_eq!(b.save_state(), bytes, "save(load(x)) == x");
        let next: Vec<u32> = (0..5).map(|_| a.step_with(&params).unwrap()).collect();
        assert_eq!((0..5).map(|_| b.step_with(&params).unwrap()).collect::<Vec<_>>(), next);

        // Every corruption is refused and leaves the session as it was.
        let mut c = session(&e, 0);
        c.prefill(&[4, 5]).unwrap();
        let keep = c.save_state();
        let mut flags = bytes.clone();
        flags[12] |= 8;
        let mut token = bytes.clone();
        token[44..48].copy_from_slice(&1000u32.to_le_bytes());
        let body = token.len() - 4;
        let crc = crc32fast::hash(&token[..body]);
        token[body..].copy_from_slice(&crc.to_le_bytes());
        let mut huge = bytes.clone();
        huge[36..44].copy_from_slice(&u64::MAX.to_le_bytes());
        for (bad, want) in [
            (&flags[..], "unknown flags"),
            (&huge[..], "truncated"),
            (&bytes[..bytes.len() - 4], "truncated"),
            (&bytes[..0], "shorter"),
        ] {
            let err = c.load_state(bad).unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
            assert_eq!(c.save_state(), keep);
        }
        assert!(matches!(c.load_state(&token), Err(Error::TokenOutOfRange { token: 1000, index: 0, .. })));
        assert_eq!(c.save_state(), keep);
        // A NaN in the key cache (layer 0's first value, after the header
        // and the tokens), the checksum made right: refused.
        let mut nan = bytes.clone();
        let at = 44 + 4 * (PROMPT.len() + 1);
        nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = crc32fast::hash(&nan[..body]);
        nan[body..].copy_from_slice(&crc.to_le_bytes());
        let err = c.load_state(&nan).unwrap_err().to_string();
        assert!(err.contains("layer 0 key cache value 0 is NaN"), "{err}");
        assert_eq!(c.save_state(), keep);

        // A session cut by truncate without logits round-trips as it is (a
        // load refused such states until a random sequence of operations
        // found it); an empty session's state with logits is refused.
        let mut cut = session(&e, 0);
        cut.prefill(&PROMPT).unwrap();
        cut.truncate(2).unwrap();
        assert!(cut.logits().is_none());
        let state = cut.save_state();
        let mut d = session(&e, 0);
        d.load_state(&state).unwrap();
        assert_eq!((d.tokens(), d.logits()), (&PROMPT[..2], None));
        let mut empty = session(&e, 0).save_state();
        empty[12] |= 1;
        empty.splice(empty.len() - 4.., vec![0; 4 * e.config().vocab_size + 4]);
        let body = empty.len() - 4;
        let crc = crc32fast::hash(&empty[..body]);
        empty[body..].copy_from_slice(&crc.to_le_bytes());
        let err = c.load_state(&empty).unwrap_err().to_string();
        assert!(err.contains("0 tokens with logits"), "{err}");
        assert_eq!(c.save_state(), keep);
    }

    #[test]
    fn rewind_to_a_checkpoint_without_logits_keeps_it() {
        // A checkpoint taken after a truncate that could not know the
        // logits: rewind_to its position runs the last token again and
        // must not drop it (it did, until a random sequence of operations
        // found it: the rerun went one token below it).
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut s = session(&e, 0);
        s.prefill(&PROMPT).unwrap();
        s.truncate(3).unwrap();
        assert!(s.logits().is_none());
        let id = s.checkpoint();
        s.prefill(&[7, 8]).unwrap();
        s.rewind_to(3).unwrap();
        assert_eq!(s.tokens(), &PROMPT[..3]);
        assert!(s.checkpoint_ids().contains(&id), "checkpoint {id} at the rewind's position was dropped");
        let mut fresh = session(&e, 0);
        assert_eq!(s.logits().unwrap(), fresh.prefill(&PROMPT[..3]).unwrap());
        s.rewind(id).unwrap();
        assert_eq!((s.tokens(), s.logits()), (&PROMPT[..3], None));
    }

    #[test]
    fn rewind_to_on_a_hybrid_recomputes_logits_a_checkpoint_lacks_and_keeps_it() {
        // A failed prefill_conversation keeps the pieces it read, without
        // logits (pieces before the last skip them). A checkpoint there has
        // none; rewind_to its position must still give logits (it gave none:
        // it restored that checkpoint and had nothing to replay) and keep it.
        let (_d, e) = tiny_next();
        let layers = e.config().num_hidden_layers;
        let mut s = e.new_session(&SessionOptions { prefill_chunk: 3, ..Default::default() }).unwrap();
        s.prefill(&PROMPT[..4]).unwrap();
        let conv: Vec<u32> = PROMPT[..4].iter().chain(&[9, 8, 7, 6, 5, 4, 3]).copied().collect();
        e.fail_next_forward_after(2 * layers + 1); // in the third piece
        assert!(matches!(s.prefill_conversation(&conv), Err(Error::Cancelled)));
        assert_eq!((s.tokens(), s.logits()), (&conv[..10], None));
        let id = s.checkpoint();
        s.rewind_to(10).unwrap();
        assert!(s.checkpoint_ids().contains(&id), "the checkpoint at the rewind's position was dropped");
        let mut fresh = e.new_session(&SessionOptions::default()).unwrap();
        assert_close(s.logits().expect("rewind_to gives logits"), fresh.prefill(&conv[..10]).unwrap(), "rewind_to 10");
    }

    #[test]
    fn rewind_to_on_a_hybrid_keeps_the_checkpoint_budget() {
        // The checkpoint at the rewind's position (without logits) is out of
        // the map while the replay takes its own; putting it back must
        // evict automatic ones again to stay under the budget.
        let (_d, e) = tiny_next();
        let layers = e.config().num_hidden_layers;
        let mut probe = e.new_session(&SessionOptions::default()).unwrap();
        probe.prefill(&PROMPT[..2]).unwrap();
        let taken = probe.checkpoint();
        let with_logits = probe.checkpoint_size(taken).unwrap();
        let budget = 2 * with_logits;
        let opts =
            SessionOptions { prefill_chunk: 2, checkpoint_every: 5, checkpoint_budget: budget, ..Default::default() };
        let mut s = e.new_session(&opts).unwrap();
        s.prefill(&PROMPT[..4]).unwrap();
        let conv: Vec<u32> = PROMPT[..4].iter().chain(&[9, 8, 7, 6, 5, 4, 3]).copied().collect();
        e.fail_next_forward_after(2 * layers + 1);
        assert!(s.prefill_conversation(&conv).is_err());
        assert_eq!((s.len(), s.logits()), (7, None));
        let at5 = s.checkpoint_ids().into_iter().find(|&id| s.checkpoint_info(id).unwrap().position == 5).unwrap();
        s.release_checkpoint(at5).unwrap();
        let id = s.checkpoint();
        s.rewind_to(7).unwrap();
        assert!(s.checkpoint_ids().contains(&id) && s.logits().is_some());
        assert!(s.checkpoints_size() <= budget, "{} bytes of checkpoints over {budget}", s.checkpoints_size());
    }

    #[test]
    fn a_failing_forward_on_a_hybrid_leaves_the_session_as_it_was() {
        let (dir, cfg) = synth_tiny(crate::model::Arch::Qwen3Next);
        let e = Engine::load(dir.path(), &Default::default()).unwrap();
        assert!(e.config().num_hidden_layers >= 2 && !e.config().is_full_attention(0));
        let prompt: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % cfg.vocab_size as u32).collect();
        for chunk in [0, 5] {
            let mut s = e.new_session(&SessionOptions { prefill_chunk: chunk, ..Default::default() }).unwrap();
            s.prefill(&prompt[..6]).unwrap();
            let before = s.save_state();
            let ids = s.checkpoint_ids();
            // Fails in the second chunk (chunk 5) or the only one, after a linear layer ran.
            e.fail_next_forward_after(if chunk == 0 { 1 } else { cfg.num_hidden_layers + 1 });
            assert!(matches!(s.prefill(&prompt[6..]), Err(Error::Cancelled)));
            assert_eq!(s.save_state(), before, "chunk {chunk}: prefill");
            assert_eq!(s.checkpoint_ids(), ids);
            e.fail_next_forward_after(1);
            assert!(s.step(&mut Sampler::greedy()).is_err());
            assert_eq!(s.save_state(), before, "chunk {chunk}: step");
            let got = s.prefill(&prompt[6..]).unwrap().to_vec();
            let mut fresh = e.new_session(&SessionOptions { prefill_chunk: chunk, ..Default::default() }).unwrap();
            fresh.prefill(&prompt[..6]).unwrap();
            assert_eq!(got, fresh.prefill(&prompt[6..]).unwrap());
            // A replay that fails leaves the session at the checkpoint it restored.
            e.fail_next_forward_after(1);
            assert!(matches!(s.rewind_to(9), Err(Error::Cancelled)));
            assert_eq!(s.save_state(), before, "chunk {chunk}: rewind_to");
        }
    }

    fn tiny_next() -> (TempDir, Engine) {
        let (dir, _) = synth_tiny(crate::model::Arch::Qwen3Next);
        let e = Engine::load(dir.path(), &Default::default()).unwrap();
        (dir, e)
    }

    /// A tiny synthetic pack of `arch` and its config.
    fn synth_tiny(arch: crate::model::Arch) -> (TempDir, crate::model::ModelConfig) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::pack::synth::preset(arch, "tiny").unwrap();
        crate::pack::synth::synth(&cfg, dir.path(), &Default::default()).unwrap();
        (dir, cfg)
    }

    /// The pack in `dir` on one CPU device and on two CPU stages (one
    /// thread each, prefill help as given).
    fn one_and_split(dir: &std::path::Path, help: crate::engine::Help) -> (Engine, Engine) {
        let one = Engine::load(dir, &EngineOptions::default()).unwrap();
        let two = EngineOptions {
            devices: vec!["cpu".into(), "cpu".into()],
            threads: Some(2),
            prefill_help: help,
            ..Default::default()
        };
        (one, Engine::load(dir, &two).unwrap())
    }

    /// A split of two CPU stages pipelines a prefill's pieces; a NaN in a
    /// later piece (on either stage) fails the call with the place, the
    /// session keeps exactly the pieces before it (KV and recurrent
    /// states), and reading on gives the one-device logits bit for bit.
    #[test]
    fn a_failure_in_pipelined_pieces_keeps_the_pieces_before_it() {
        for arch in [crate::model::Arch::Qwen3Moe, crate::model::Arch::Qwen3Next] {
            let (dir, cfg) = synth_tiny(arch);
            let (one, split) = one_and_split(dir.path(), crate::engine::Help::Off);
            let tokens = next_prompt(&one, 40);
            let mut want = session(&one, 8);
            want.prefill_conversation(&tokens).unwrap();
            for layer in [0, cfg.num_hidden_layers - 1] {
                let mut s = session(&split, 8);
                split.inject_nan_at(layer, 27);
                let err = s.prefill_conversation(&tokens).unwrap_err();
                let place = format!("at layer {layer}, position 27");
                assert!(matches!(err, Error::NonFinite(ref m) if m.contains(&place)), "{arch:?}: {err}");
                assert_eq!(s.len(), 24, "{arch:?} layer {layer}: the pieces before the failing one");
                let report = s.prefill_conversation(&tokens).unwrap();
                assert_eq!((report.reused, report.read), (24, 16));
                let (a, b) = (s.logits().unwrap(), want.logits().unwrap());
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{arch:?} layer {layer}");
            }
            // `prefill` undoes the whole call: the session is as before it.
            let mut s = session(&split, 8);
            s.prefill(&tokens[..8]).unwrap();
            let before = s.save_state();
            split.inject_nan_at(cfg.num_hidden_layers - 1, 27);
            assert!(matches!(s.prefill(&tokens[8..]), Err(Error::NonFinite(_))), "{arch:?}");
            assert_eq!(s.save_state(), before, "{arch:?}: the failed prefill changed the session");
            s.prefill(&tokens[8..]).unwrap();
            let (a, b) = (s.logits().unwrap(), want.logits().unwrap());
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{arch:?} after an undone prefill");
            assert!(split.split_stats().unwrap().pipelined_windows > 0);
        }
    }

    /// On a hybrid split, pipelined runs end at the checkpoint pieces:
    /// the checkpoints hold the states a one-device session takes, so
    /// rewinding between them gives the same bits.
    #[test]
    fn pipelined_runs_end_at_checkpoints_and_rewinds_match_one_device() {
        let (dir, _) = synth_tiny(crate::model::Arch::Qwen3Next);
        let (one, split) = one_and_split(dir.path(), crate::engine::Help::Auto);
        let opts = SessionOptions { prefill_chunk: 6, checkpoint_every: 16, ..Default::default() };
        let tokens = next_prompt(&one, 50);
        let (mut a, mut b) = (one.new_session(&opts).unwrap(), split.new_session(&opts).unwrap());
        let same = |a: &Session, b: &Session, what: &str| {
            let (x, y) = (a.logits().unwrap(), b.logits().unwrap());
            assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "{what}");
        };
        a.prefill(&tokens).unwrap();
        b.prefill(&tokens).unwrap();
        same(&a, &b, "prefill");
        assert_eq!(a.checkpoint_ids().len(), b.checkpoint_ids().len());
        for pos in [40, 20, 7] {
            a.rewind_to(pos).unwrap();
            b.rewind_to(pos).unwrap();
            same(&a, &b, &format!("rewind_to({pos})"));
        }
        assert!(split.split_stats().unwrap().pipelined_windows > 0);
    }

    fn next_prompt(e: &Engine, n: u32) -> Vec<u32> {
        (0..n).map(|i| (i * 7 + 3) % e.config().vocab_size as u32).collect()
    }

    /// A NaN injected at `layer` in the second chunk of a prefill (chunks
    /// of 3) fails it with `NonFinite` naming the layer and position, and
    /// leaves the session as it was; checkpoints stay usable.
    fn nan_guard_round_trip(e: &Engine, prompt: &[u32], layer: usize) {
        let mut s = session(e, 3);
        s.prefill(&prompt[..4]).unwrap();
        let cp = s.checkpoint();
        s.prefill(&prompt[4..6]).unwrap();
        let (before, logits, ids) = (s.save_state(), s.logits().unwrap().to_vec(), s.checkpoint_ids());
        // prompt[6..11] runs as positions 6..9 then 9..11.
        e.inject_nan_at(layer, 10);
        let err = s.prefill(&prompt[6..11]).unwrap_err();
        let want = format!("NaN at layer {layer}, position 10");
        assert!(matches!(err, Error::NonFinite(ref m) if *m == want), "{err}");
        assert!(err.to_string().contains(&format!("layer {layer}, position 10")), "{err}");
        assert_eq!(s.save_state(), before);
        assert_eq!((s.len(), s.logits().unwrap(), s.checkpoint_ids()), (6, &logits[..], ids.clone()));
        // A step is guarded too, and its failure changes nothing either.
        e.inject_nan_at(layer, 6);
        let err = s.step(&mut Sampler::greedy()).unwrap_err();
        assert!(matches!(err, Error::NonFinite(ref m) if m.ends_with("position 6")), "{err}");
        assert_eq!(s.save_state(), before);
        assert_eq!(s.checkpoint_ids(), ids);
        // Without the injection the same call succeeds, as in a fresh session.
        let got = s.prefill(&prompt[6..11]).unwrap().to_vec();
        let mut fresh = session(e, 3);
        fresh.prefill(&prompt[..4]).unwrap();
        fresh.prefill(&prompt[4..6]).unwrap();
        assert_eq!(got, fresh.prefill(&prompt[6..11]).unwrap(), "retry");
        // The checkpoint taken before the failure rewinds, and continuing
        // from it equals a fresh session bit for bit.
        s.rewind(cp).unwrap();
        let cont = s.prefill(&prompt[4..11]).unwrap().to_vec();
        let mut fresh = session(e, 3);
        fresh.prefill(&prompt[..4]).unwrap();
        assert_eq!(cont, fresh.prefill(&prompt[4..11]).unwrap(), "after rewind");
    }

    #[test]
    fn a_nan_in_the_hidden_state_fails_the_call_and_changes_nothing() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        for layer in 0..e.config().num_hidden_layers {
            nan_guard_round_trip(&e, &PROMPT, layer);
        }
    }

    #[test]
    fn a_nan_in_the_hidden_state_of_a_hybrid_fails_the_call_and_changes_nothing() {
        let (_d, e) = tiny_next();
        let c = e.config();
        let linear = (0..c.num_hidden_layers).find(|&l| !c.is_full_attention(l)).unwrap();
        let full = (0..c.num_hidden_layers).find(|&l| c.is_full_attention(l)).unwrap();
        let prompt = next_prompt(&e, 11);
        nan_guard_round_trip(&e, &prompt, linear);
        nan_guard_round_trip(&e, &prompt, full);
    }

    #[test]
    fn a_nan_reaches_the_c_api_as_nonfinite() {
        use crate::ffi::*;
        use std::ffi::{CStr, CString};
        let (d, _e) = tiny_engine(&TinyPack::default());
        let path = CString::new(d.path().to_str().unwrap()).unwrap();
        unsafe {
            let mut engine = std::ptr::null_mut();
            assert_eq!(strata_engine_load(path.as_ptr(), std::ptr::null(), &mut engine), strata_status::STRATA_OK);
            let mut s = std::ptr::null_mut();
            assert_eq!(strata_session_open(engine, std::ptr::null(), &mut s), strata_status::STRATA_OK);
            (*engine).engine.inject_nan_at(1, 2);
            let tokens: Vec<i32> = PROMPT.iter().map(|&t| t as i32).collect();
            let status = strata_session_prefill(s, tokens.as_ptr(), tokens.len());
            assert_eq!(status, strata_status::STRATA_ERR_NONFINITE);
            let msg = CStr::from_ptr(strata_last_error()).to_str().unwrap().to_owned();
            assert!(msg.contains("strata_session_prefill") && msg.contains("NaN at layer 1, position 2"), "{msg}");
            let mut pos = 99;
            assert_eq!(strata_session_position(s, &mut pos), strata_status::STRATA_OK);
            assert_eq!(pos, 0);
            assert_eq!(strata_session_prefill(s, tokens.as_ptr(), tokens.len()), strata_status::STRATA_OK);
            strata_session_free(s);
            strata_engine_free(engine);
        }
    }

    fn report(reused: usize, read: usize) -> PrefillReport {
        PrefillReport { reused, read }
    }

    #[test]
    fn prefill_conversation_reuses_the_common_prefix() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let fresh = |conv: &[u32]| session(&e, 0).prefill(conv).unwrap().to_vec();
        let mut s = session(&e, 0);
        assert_eq!(s.prefill_conversation(&PROMPT[..6]).unwrap(), report(0, 6));
        assert_eq!(s.logits().unwrap(), &fresh(&PROMPT[..6])[..]);
        // An extension reads only the new tokens.
        assert_eq!(s.prefill_conversation(&PROMPT).unwrap(), report(6, 5));
        assert_eq!(s.logits().unwrap(), &fresh(&PROMPT)[..], "extension");
        // A divergence in the last turn rewinds to the common prefix.
        let mut diverged = PROMPT[..8].to_vec();
        diverged.extend([1, 2, 3]);
        assert_eq!(s.prefill_conversation(&diverged).unwrap(), report(8, 3));
        assert_eq!((s.tokens(), s.logits().unwrap()), (&diverged[..], &fresh(&diverged)[..]), "divergence");
        // The same conversation again reads nothing and keeps the logits.
        let logits = s.logits().unwrap().to_vec();
        assert_eq!(s.prefill_conversation(&diverged).unwrap(), report(11, 0));
        assert_eq!(s.logits().unwrap(), &logits[..]);
        // A shorter conversation recomputes only the last position's logits.
        assert_eq!(s.prefill_conversation(&PROMPT[..5]).unwrap(), report(4, 1));
        assert_eq!((s.tokens(), s.logits().unwrap()), (&PROMPT[..5], &fresh(&PROMPT[..5])[..]));
        // Bad input changes nothing.
        let state = s.save_state();
        assert!(matches!(s.prefill_conversation(&[]), Err(Error::InvalidArgument(_))));
        assert!(matches!(s.prefill_conversation(&[3, 97]), Err(Error::TokenOutOfRange { .. })));
        let cap = s.capacity();
        assert!(matches!(s.prefill_conversation(&vec![1; cap + 1]), Err(Error::ContextOverflow { .. })));
        assert_eq!(s.save_state(), state);
    }

    #[test]
    fn prefill_conversation_on_a_hybrid_restores_the_nearest_checkpoint() {
        let (_d, e) = tiny_next();
        let prompt = next_prompt(&e, 11);
        // A fresh session fed `conv` in calls split at `splits`.
        let fresh = |conv: &[u32], splits: &[usize]| {
            let mut f = session(&e, 0);
            let mut from = 0;
            for &to in splits.iter().chain([conv.len()].iter()) {
                f.prefill(&conv[from..to]).unwrap();
                from = to;
            }
            f.logits().unwrap().to_vec()
        };
        let mut s = session(&e, 0);
        assert_eq!(s.prefill_conversation(&prompt[..6]).unwrap(), report(0, 6));
        // An extension: bit for bit a fresh session split the same way.
        assert_eq!(s.prefill_conversation(&prompt).unwrap(), report(6, 5));
        assert_eq!(s.logits().unwrap(), &fresh(&prompt, &[6])[..], "extension");
        assert_close(s.logits().unwrap(), &fresh(&prompt, &[]), "extension vs one call");
        // A divergence at a checkpoint (6) restores it and reads the rest.
        let mut at_cp = prompt[..6].to_vec();
        at_cp.extend([4, 5]);
        assert_ne!(prompt[6], 4);
        assert_eq!(s.prefill_conversation(&at_cp).unwrap(), report(6, 2));
        assert_eq!(s.logits().unwrap(), &fresh(&at_cp, &[6])[..], "divergence at a checkpoint");
        // A divergence past it (at 8): the checkpoint at 6, then 2 + 3 tokens read.
        assert_eq!(s.prefill_conversation(&prompt).unwrap(), report(6, 5));
        let mut past = prompt[..8].to_vec();
        past.extend([1, 2, 3]);
        assert_eq!(s.prefill_conversation(&past).unwrap(), report(6, 5));
        assert_eq!(s.tokens(), &past[..]);
        assert_eq!(s.logits().unwrap(), &fresh(&past, &[6, 8])[..], "divergence past a checkpoint");
        assert_close(s.logits().unwrap(), &fresh(&past, &[]), "divergence vs one call");
        // The same conversation again: nothing read, logits kept.
        let logits = s.logits().unwrap().to_vec();
        assert_eq!(s.prefill_conversation(&past).unwrap(), report(11, 0));
        assert_eq!(s.logits().unwrap(), &logits[..]);
        // A failure while reading the new tail leaves the common prefix;
        // the same call again resumes from it.
        assert_eq!(s.prefill_conversation(&prompt).unwrap(), report(6, 5));
        e.inject_nan_at(0, 9);
        assert!(matches!(s.prefill_conversation(&past), Err(Error::NonFinite(_))));
        assert_eq!(s.tokens(), &past[..8]);
        assert_eq!(s.prefill_conversation(&past).unwrap(), report(8, 3));
        assert_eq!(s.logits().unwrap(), &fresh(&past, &[6, 8])[..], "after a failure");
    }

    #[test]
    fn pieces_split_at_the_chunk_size_and_the_checkpoint_marks() {
        let (_d, e) = tiny_next();
        let mut s =
            e.new_session(&SessionOptions { prefill_chunk: 5, checkpoint_every: 8, ..Default::default() }).unwrap();
        assert_eq!(s.pieces(3, 14), vec![(0, 5, true), (5, 5, false), (10, 3, true), (13, 1, false)]);
        assert_eq!(s.pieces(0, 8), vec![(0, 5, false), (5, 3, true)]);
        s.prefill_chunk = 0;
        assert_eq!(s.pieces(7, 20), vec![(0, 1, true), (1, 8, true), (9, 8, true), (17, 3, false)]);
        s.checkpoint_every = 0;
        assert_eq!(s.pieces(7, 20), vec![(0, 20, false)]);
        // qwen3_moe keeps no recurrent state: no marks.
        let (_d2, m) = tiny_engine(&TinyPack::default());
        let s = m.new_session(&SessionOptions { prefill_chunk: 5, checkpoint_every: 8, ..Default::default() }).unwrap();
        assert_eq!(s.pieces(3, 7), vec![(0, 5, false), (5, 2, false)]);
    }

    fn positions(s: &Session) -> Vec<usize> {
        s.checkpoint_ids().iter().map(|&i| s.checkpoint_info(i).unwrap().position).collect()
    }

    #[test]
    fn checkpoints_every_n_tokens_hold_exact_logits_and_rewind_exactly() {
        let (_d, e) = tiny_next();
        let prompt = next_prompt(&e, 50);
        let opts = SessionOptions { prefill_chunk: 5, checkpoint_every: 8, ..Default::default() };
        let fresh = |n: usize| {
            let mut f = e.new_session(&opts).unwrap();
            f.prefill(&prompt[..3]).unwrap();
            if n > 3 {
                f.prefill(&prompt[3..n]).unwrap();
            }
            f.logits().unwrap().to_vec()
        };
        let mut s = e.new_session(&opts).unwrap();
        s.prefill(&prompt[..3]).unwrap();
        s.prefill(&prompt[3..]).unwrap();
        assert_eq!(positions(&s), vec![3, 8, 16, 24, 32, 40, 48, 50]);
        for id in s.checkpoint_ids() {
            let cp = s.checkpoint_info(id).unwrap();
            assert!(cp.automatic);
            // A fresh session that stops there reads the same pieces.
            assert_eq!(cp.logits.as_deref().unwrap(), &fresh(cp.position)[..], "checkpoint at {}", cp.position);
        }
        // Between marks: the checkpoint at 24, then 6 tokens re-read.
        s.rewind_to(30).unwrap();
        assert_eq!(positions(&s), vec![3, 8, 16, 24]);
        assert_eq!(s.logits().unwrap(), &fresh(30)[..]);
        // On a mark: the checkpoint itself; the replay of 24..40 retakes 32 and 40.
        s.rewind_to(24).unwrap();
        assert_eq!(s.logits().unwrap(), &fresh(24)[..]);
        s.prefill(&prompt[24..41]).unwrap();
        assert_eq!(positions(&s), vec![3, 8, 16, 24, 32, 40, 41]);
        assert_eq!(s.logits().unwrap(), &fresh(41)[..]);
    }

    #[test]
    fn the_checkpoint_budget_evicts_the_oldest_automatic_checkpoints() {
        let (_d, e) = tiny_next();
        let prompt = next_prompt(&e, 40);
        let mut probe = e.new_session(&SessionOptions::default()).unwrap();
        let at0 = probe.checkpoint();
        probe.prefill(&prompt[..2]).unwrap();
        let (explicit, auto) = (probe.checkpoint_size(at0).unwrap(), probe.checkpoint_size(at0 + 1).unwrap());
        assert_eq!(auto - explicit, e.config().vocab_size * 4, "an automatic checkpoint adds its logits");
        for (budget, want) in [
            (explicit + 3 * auto, vec![0, 32, 36, 40]),
            (explicit + 3 * auto - 1, vec![0, 36, 40]),
            (explicit, vec![0]),
            (1, vec![0]),
        ] {
            let opts = SessionOptions { checkpoint_every: 4, checkpoint_budget: budget, ..Default::default() };
            let mut s = e.new_session(&opts).unwrap();
            let id = s.checkpoint();
            s.prefill(&prompt).unwrap();
            assert_eq!(positions(&s), want, "budget {budget}");
            assert_eq!(s.checkpoint_ids()[0], id, "explicit checkpoints are never evicted");
            assert!(s.checkpoints_size() <= budget.max(explicit), "budget {budget}");
        }
        assert_eq!(e.new_session(&SessionOptions::default()).unwrap().checkpoint_budget, DEFAULT_CHECKPOINT_BUDGET);
    }

    /// The field report's failure mode: one bad window late in a long
    /// prompt must not throw away the work before it.
    #[test]
    fn prefill_conversation_keeps_the_pieces_read_before_a_failure() {
        let (_d, e) = tiny_next();
        let prompt = next_prompt(&e, 40);
        let opts = SessionOptions { checkpoint_every: 8, ..Default::default() };
        let mut s = e.new_session(&opts).unwrap();
        // Pieces 0..8, 8..16, 16..24, 24..32, 32..40: the fourth fails.
        e.inject_nan_at(1, 29);
        let err = s.prefill_conversation(&prompt).unwrap_err();
        assert!(matches!(err, Error::NonFinite(ref m) if m == "NaN at layer 1, position 29"), "{err}");
        assert_eq!(s.tokens(), &prompt[..24]);
        assert_eq!(positions(&s), vec![8, 16, 24]);
        assert_eq!(s.prefill_conversation(&prompt).unwrap(), report(24, 16));
        let mut fresh = e.new_session(&opts).unwrap();
        assert_eq!(s.logits().unwrap(), fresh.prefill(&prompt).unwrap(), "resumed vs fresh");
        // prefill() stays all or nothing, its checkpoints included.
        let mut a = e.new_session(&opts).unwrap();
        e.inject_nan_at(1, 29);
        assert!(matches!(a.prefill(&prompt), Err(Error::NonFinite(_))));
        assert_eq!((a.len(), a.checkpoint_ids()), (0, vec![]));
        // qwen3_moe keeps the prefill chunks read before the failure.
        let (_d2, m) = tiny_engine(&TinyPack::default());
        let mut q = session(&m, 4);
        m.inject_nan_at(0, 9);
        assert!(matches!(q.prefill_conversation(&PROMPT), Err(Error::NonFinite(_))));
        assert_eq!((q.tokens(), q.logits()), (&PROMPT[..8], None));
        assert_eq!(q.prefill_conversation(&PROMPT).unwrap(), report(8, 3));
        assert_eq!(q.logits().unwrap(), session(&m, 4).prefill(&PROMPT).unwrap());
    }

    /// The CPU's int8 and bf16 KV hold exactly what the CUDA cache would:
    /// layer 0's rows (whose inputs do not depend on the cache) are the f32
    /// rows rounded by the int8 block rule / to bf16.
    #[test]
    fn emulated_int8_and_bf16_kv_round_as_the_cuda_cache() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let open = |kv_type| e.new_session(&SessionOptions { kv_type, ..Default::default() }).unwrap();
        let mut f = open(KvType::F32);
        let want = f.prefill(&PROMPT).unwrap().to_vec();
        let fk = f.kv.host().expect("a host cache");
        let (k0, v0) = fk.layer(0);
        let hd = e.config().head_dim;
        for (kv_type, round) in [
            (
                KvType::Int8,
                Box::new(move |x: &mut [f32]| x.chunks_exact_mut(hd).for_each(crate::quant::int8_block_round_trip))
                    as Box<dyn Fn(&mut [f32])>,
            ),
            (KvType::Bf16, Box::new(crate::quant::bf16_round_trip)),
        ] {
            let mut s = open(kv_type);
            let got = s.prefill(&PROMPT).unwrap().to_vec();
            let sk = s.kv.host().expect("a host cache");
            let (mut k, mut v) = (k0.to_vec(), v0.to_vec());
            round(&mut k);
            round(&mut v);
            assert_eq!(sk.layer(0), (&k[..], &v[..]), "{kv_type:?}: layer 0 rows");
            assert_ne!(k, k0, "{kv_type:?} must round something");
            // Tiny random models amplify the rounding (here by ~10%), so
            // only that it changed the logits, and nothing non-finite.
            assert!(got.iter().all(|x| x.is_finite()) && got != want, "{kv_type:?}");
        }
    }

    /// A state saved by an f32 session and loaded into an int8 or bf16 one
    /// holds what that cache stores: every row rounded as an append rounds
    /// it (the CUDA cache's restore appends through its kernel).
    #[test]
    fn a_state_loaded_into_a_rounding_cache_is_rounded_as_appends_are() {
        use super::kv::KvRounding;
        let (_d, e) = tiny_engine(&TinyPack::default());
        let open = |kv_type| e.new_session(&SessionOptions { kv_type, ..Default::default() }).unwrap();
        let mut f = open(KvType::F32);
        f.prefill(&PROMPT).unwrap();
        let state = f.save_state();
        let fk = f.kv.host().expect("a host cache");
        let hd = e.config().head_dim;
        for (kv_type, rounding) in [(KvType::Int8, KvRounding::Int8 { head_dim: hd }), (KvType::Bf16, KvRounding::Bf16)]
        {
            let mut s = open(kv_type);
            s.load_state(&state).unwrap();
            let sk = s.kv.host().expect("a host cache");
            for layer in 0..fk.num_layers() {
                let (mut k, mut v) = (fk.layer(layer).0.to_vec(), fk.layer(layer).1.to_vec());
                rounding.apply(&mut k);
                rounding.apply(&mut v);
                assert_ne!(k, fk.layer(layer).0, "{kv_type:?} must round something");
                assert_eq!(sk.layer(layer), (&k[..], &v[..]), "{kv_type:?}: layer {layer}");
            }
        }
    }
}
