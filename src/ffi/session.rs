//! `strata_session`: one conversation on an engine.

use std::sync::{Mutex, MutexGuard, TryLockError};

use super::args;
use super::engine::strata_engine;
use super::params::{self, field, Field, Kind, Versioned};
use super::status::{run, strata_status, FfiError};
use crate::sampling::SamplingParams;
use crate::session::{KvType, Session, SessionOptions};

/// One conversation: tokens, KV cache, logits, checkpoints, sampler.
/// Opaque; created by `strata_session_open`, freed by `strata_session_free`.
///
/// Thread-safety: a session may be passed between threads, but is used by
/// one call at a time. A call made while another thread's call on the same
/// session is running returns `STRATA_ERR_BUSY` at once and changes
/// nothing; it never blocks and never corrupts the session.
#[allow(non_camel_case_types)]
pub struct strata_session {
    pub(crate) inner: Mutex<Session>,
    vocab: usize,
}

/// KV cache element type.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum strata_kv_type {
    /// The backend's choice (f32 on cpu, int8 on cuda).
    STRATA_KV_AUTO = 0,
    /// cpu only (`STRATA_ERR_UNSUPPORTED` on cuda).
    STRATA_KV_F32 = 1,
    /// bf16 values (on cpu: emulated, rounded as the cuda cache rounds).
    STRATA_KV_BF16 = 2,
    /// int8 with one scale per position and kv head (on cpu: emulated).
    STRATA_KV_INT8 = 3,
}

/// Options of `strata_session_open`. Get defaults from
/// `strata_session_default_params`, then change fields.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct strata_session_params {
    /// `sizeof(strata_session_params)` as the caller knows it (versioning).
    pub struct_size: u32,
    /// Most tokens the session holds; 0 (default) = the model's maximum.
    pub context_size: u32,
    /// Tokens per forward pass during prefill; 0 (default) = the whole
    /// prompt at once. Results do not depend on it.
    pub prefill_chunk: u32,
    /// KV cache type; default `STRATA_KV_AUTO`.
    pub kv_type: strata_kv_type,
    /// Keep the logits of every position of the last prefill, for
    /// `strata_session_logits` with earlier positions. Default false.
    pub keep_all_logits: bool,
    /// On models with recurrent state (Qwen3-Next): also take an automatic
    /// checkpoint whenever a prefill reaches a multiple of this many
    /// tokens; 0 (default) = only at the end of each prefill.
    pub checkpoint_every: u32,
    /// Bytes all checkpoints of the session may hold together; automatic
    /// checkpoints are evicted, oldest first, to stay under it (explicit
    /// ones never are; a call that fails may have evicted some). 0
    /// (default) = 1 GiB.
    pub checkpoint_budget: u64,
}

// SAFETY: the table lists every field after struct_size with its kind.
unsafe impl Versioned for strata_session_params {
    const NAME: &'static str = "strata_session_params";
    fn defaults() -> Self {
        strata_session_params {
            struct_size: std::mem::size_of::<Self>() as u32,
            context_size: 0,
            prefill_chunk: 0,
            kv_type: strata_kv_type::STRATA_KV_AUTO,
            keep_all_logits: false,
            checkpoint_every: 0,
            checkpoint_budget: 0,
        }
    }
    fn fields() -> Vec<Field> {
        type T = strata_session_params;
        vec![
            field!(T, context_size, Kind::Plain),
            field!(T, prefill_chunk, Kind::Plain),
            field!(T, kv_type, Kind::Enum { max: strata_kv_type::STRATA_KV_INT8 as u32 }),
            field!(T, keep_all_logits, Kind::Bool),
            field!(T, checkpoint_every, Kind::Plain),
            field!(T, checkpoint_budget, Kind::Plain),
        ]
    }
}

/// How `strata_session_step` picks a token. The defaults are greedy.
/// The filters apply in order (top_k, then top_p over what top_k kept,
/// then min_p), and the draw is from what they keep, renormalized. The
/// same parameters, seed and logits give the same tokens on every
/// platform: the arithmetic is f32 and integer operations with no library
/// math; a token less probable than 2^-40 times the most probable counts
/// as probability 0.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct strata_sampling_params {
    /// `sizeof(strata_sampling_params)` as the caller knows it (versioning).
    pub struct_size: u32,
    /// 0 (default) = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the k most probable tokens; 0 (default) = off. Not negative.
    pub top_k: i32,
    /// Keep the smallest set of tokens whose probability reaches top_p,
    /// in (0, 1]; 1 (default) = off.
    pub top_p: f32,
    /// Drop tokens less probable than min_p times the most probable, in
    /// [0, 1]; 0 (default) = off.
    pub min_p: f32,
    /// Seed of the random draws. Default 0.
    pub seed: u64,
}

// SAFETY: the table lists every field after struct_size with its kind.
unsafe impl Versioned for strata_sampling_params {
    const NAME: &'static str = "strata_sampling_params";
    fn defaults() -> Self {
        strata_sampling_params {
            struct_size: std::mem::size_of::<Self>() as u32,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
    fn fields() -> Vec<Field> {
        type T = strata_sampling_params;
        vec![
            field!(T, temperature, Kind::Plain),
            field!(T, top_k, Kind::Plain),
            field!(T, top_p, Kind::Plain),
            field!(T, min_p, Kind::Plain),
            field!(T, seed, Kind::Plain),
        ]
    }
}

impl strata_session {
    /// Locks the session for this call, or `STRATA_ERR_BUSY` if another
    /// call holds it.
    fn lock(&self) -> Result<MutexGuard<'_, Session>, FfiError> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::WouldBlock) => Err(FfiError::new(
                strata_status::STRATA_ERR_BUSY,
                "the session is in use by another call (a session is used by one thread at a time)",
            )),
            Err(TryLockError::Poisoned(_)) => Err(FfiError::new(
                strata_status::STRATA_ERR_INTERNAL,
                "the session is unusable after an internal error in an earlier call; free it",
            )),
        }
    }
}

/// # Safety
/// `s` is NULL or a live session.
pub(crate) unsafe fn lock<'a>(s: *mut strata_session) -> Result<MutexGuard<'a, Session>, FfiError> {
    args::get(s, "session")?.lock()
}

/// Writes the default session params into the first `struct_size` bytes
/// of `out` (see `strata_engine_default_params`).
///
/// Thread-safety: any thread.
///
/// # Safety
/// `out` must be NULL (an error) or point to `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_session_default_params(
    out: *mut strata_session_params,
    struct_size: u32,
) -> strata_status {
    run("strata_session_default_params", || {
        let out = args::out(out, "out")?;
        params::write(&strata_session_params::defaults(), out, struct_size)
    })
}

/// Writes the default (greedy) sampling params into the first
/// `struct_size` bytes of `out` (see `strata_engine_default_params`).
///
/// Thread-safety: any thread.
///
/// # Safety
/// `out` must be NULL (an error) or point to `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_sampling_default_params(
    out: *mut strata_sampling_params,
    struct_size: u32,
) -> strata_status {
    run("strata_sampling_default_params", || {
        let out = args::out(out, "out")?;
        params::write(&strata_sampling_params::defaults(), out, struct_size)
    })
}

/// Opens a session on `engine`. On success `*out` is a new session that the
/// caller owns and frees with `strata_session_free`; on failure NULL.
/// `params` NULL means defaults; it is read during the call only. The
/// session keeps the model alive: the engine may be freed before it.
///
/// Thread-safety: any thread; many sessions may be opened on one engine.
///
/// # Safety
/// `engine` from `strata_engine_load`; `params` NULL or a valid params
/// struct; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_open(
    engine: *mut strata_engine,
    params: *const strata_session_params,
    out: *mut *mut strata_session,
) -> strata_status {
    run("strata_session_open", || {
        let e = args::get(engine, "engine")?;
        let out = args::out(out, "out")?;
        *out = std::ptr::null_mut();
        let p = params::read(params)?;
        let opts = SessionOptions {
            context_size: p.context_size as usize,
            prefill_chunk: p.prefill_chunk as usize,
            keep_all_logits: p.keep_all_logits,
            checkpoint_every: p.checkpoint_every as usize,
            checkpoint_budget: usize::try_from(p.checkpoint_budget).unwrap_or(usize::MAX),
            kv_type: match p.kv_type {
                strata_kv_type::STRATA_KV_AUTO => KvType::Auto,
                strata_kv_type::STRATA_KV_F32 => KvType::F32,
                strata_kv_type::STRATA_KV_BF16 => KvType::Bf16,
                strata_kv_type::STRATA_KV_INT8 => KvType::Int8,
            },
        };
        let session = e.engine.new_session(&opts)?;
        let vocab = e.engine.config().vocab_size;
        *out = Box::into_raw(Box::new(strata_session { inner: Mutex::new(session), vocab }));
        Ok(())
    })
}

/// Frees a session and everything it holds (checkpoints included). NULL is
/// allowed (nothing happens).
///
/// Thread-safety: not while another call on this session is running.
///
/// # Safety
/// `session` must be NULL or a pointer from `strata_session_open` not yet
/// freed.
#[no_mangle]
pub unsafe extern "C" fn strata_session_free(session: *mut strata_session) {
    run("strata_session_free", || {
        if !session.is_null() {
            drop(Box::from_raw(session));
        }
        Ok(())
    });
}

/// Appends `n_tokens` tokens (at least one) and runs them, so that the
/// logits of the last one are ready for `strata_session_step` and
/// `strata_session_logits`. Every id is checked against the vocabulary
/// (`STRATA_ERR_TOKEN_OUT_OF_RANGE`) and the context is checked for room
/// (`STRATA_ERR_CONTEXT_OVERFLOW`) before anything changes; on any failure
/// the session is as it was (on a hybrid model, automatic checkpoints the
/// call took may have evicted older ones). `tokens` is read during the call
/// only.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `tokens` readable for `n_tokens` ids.
#[no_mangle]
pub unsafe extern "C" fn strata_session_prefill(
    s: *mut strata_session,
    tokens: *const i32,
    n_tokens: usize,
) -> strata_status {
    run("strata_session_prefill", || {
        let sess = args::get(s, "session")?;
        if n_tokens == 0 {
            return Err(FfiError::invalid("empty prompt: prefill needs at least one token"));
        }
        let tokens = args::slice(tokens, n_tokens, "tokens")?;
        let ids =
            tokens.iter().enumerate().map(|(i, &t)| args::token(t, i, sess.vocab)).collect::<Result<Vec<_>, _>>()?;
        sess.lock()?.prefill(&ids)?;
        Ok(())
    })
}

/// Makes the session hold exactly `tokens`, the WHOLE conversation so far
/// (`n_tokens` >= 1), reusing what it already holds: the longest common
/// prefix with the session's tokens is kept (on a model with recurrent
/// state, from the nearest checkpoint at or before it) and only the rest
/// is read. Afterwards the logits of the last token are ready, as after
/// `strata_session_prefill`. `*out_reused` (tokens not run in this call)
/// and `*out_read` (tokens run) are written when not NULL; they add up to
/// `n_tokens`.
///
/// Bad input (ids, room) changes nothing. If a forward fails (e.g.
/// `STRATA_ERR_NONFINITE`), the session keeps a consistent prefix of the
/// conversation (what was reused plus the prefill pieces read before the
/// failure, with their checkpoints): calling again with the same
/// conversation resumes from there. Until then its last token may have no
/// logits (`strata_session_step` fails; `strata_session_rewind_to` at the
/// session's position computes them).
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `tokens` readable for `n_tokens` ids; `out_reused`
/// and `out_read` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_prefill_conversation(
    s: *mut strata_session,
    tokens: *const i32,
    n_tokens: usize,
    out_reused: *mut usize,
    out_read: *mut usize,
) -> strata_status {
    run("strata_session_prefill_conversation", || {
        let sess = args::get(s, "session")?;
        if n_tokens == 0 {
            return Err(FfiError::invalid("empty conversation: prefill_conversation needs at least one token"));
        }
        let tokens = args::slice(tokens, n_tokens, "tokens")?;
        let ids =
            tokens.iter().enumerate().map(|(i, &t)| args::token(t, i, sess.vocab)).collect::<Result<Vec<_>, _>>()?;
        let report = sess.lock()?.prefill_conversation(&ids)?;
        if !out_reused.is_null() {
            *out_reused = report.reused;
        }
        if !out_read.is_null() {
            *out_read = report.read;
        }
        Ok(())
    })
}

/// Samples the next token from the current logits with `params` (NULL =
/// greedy), appends it and runs it, so its logits are ready; `*out_token`
/// is the token. The session keeps its sampler (and its random stream)
/// across steps while `params` are equal, seed included: steps with one
/// seed give the same tokens as `strata generate --seed`. Changing params
/// starts a new stream from their seed. Needs logits (prefill first). On
/// failure nothing changes, the random stream included.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `params` NULL or a valid params struct;
/// `out_token` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_step(
    s: *mut strata_session,
    params: *const strata_sampling_params,
    out_token: *mut i32,
) -> strata_status {
    run("strata_session_step", || {
        let sess = args::get(s, "session")?;
        let out_token = args::out(out_token, "out_token")?;
        let p = params::read(params)?;
        let top_k = usize::try_from(p.top_k)
            .map_err(|_| FfiError::invalid(format!("top_k {} must be >= 0 (0 = off)", p.top_k)))?;
        let sp = SamplingParams { temperature: p.temperature, top_k, top_p: p.top_p, min_p: p.min_p, seed: p.seed };
        let token = sess.lock()?.step_with(&sp)?;
        *out_token = token as i32;
        Ok(())
    })
}

/// Copies the logits (`vocab_size` floats) of one position into `buf`:
/// `index` -1 is the last position, -2 the one before, ...; `index >= 0`
/// is an absolute position. The last position's logits are there after
/// every prefill and step; earlier positions only with `keep_all_logits`,
/// for the positions of the last prefill (else `STRATA_ERR_INVALID_ARGUMENT`).
/// `*n_out` is set to `vocab_size`; if `buf_len` is smaller, nothing is
/// copied and the call returns `STRATA_ERR_BUFFER_TOO_SMALL`. `buf` may be
/// NULL when `buf_len` is 0.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `buf` writable for `buf_len` floats; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_logits(
    s: *mut strata_session,
    index: i64,
    buf: *mut f32,
    buf_len: usize,
    n_out: *mut usize,
) -> strata_status {
    run("strata_session_logits", || {
        let sess = args::get(s, "session")?;
        let n_out = args::out(n_out, "n_out")?;
        let buf = args::slice_mut(buf, buf_len, "buf")?;
        let guard = sess.lock()?;
        let logits = guard.logits_at(index)?;
        *n_out = logits.len();
        if buf_len < logits.len() {
            return Err(FfiError::new(
                strata_status::STRATA_ERR_BUFFER_TOO_SMALL,
                format!("buf holds {buf_len} floats, the logits are {}", logits.len()),
            ));
        }
        buf[..logits.len()].copy_from_slice(logits);
        Ok(())
    })
}

/// `*out` = the number of tokens in the session's context.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_position(s: *mut strata_session, out: *mut usize) -> strata_status {
    run("strata_session_position", || {
        let out = args::out(out, "out")?;
        let n = lock(s)?.len();
        *out = n;
        Ok(())
    })
}

/// Records the current position and logits; `*out_id` is an id for
/// `strata_session_rewind` (never 0, never reused: ids are unique in the
/// process, so another session's id is `STRATA_ERR_NOT_FOUND` here). The
/// checkpoint stays valid until the session is rewound below its position
/// (by a rewind to an earlier checkpoint, `strata_session_rewind_to` or
/// `strata_session_state_load`) or it is released. It costs `vocab_size`
/// floats until then.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `out_id` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_checkpoint(s: *mut strata_session, out_id: *mut u64) -> strata_status {
    run("strata_session_checkpoint", || {
        let out_id = args::out(out_id, "out_id")?;
        let id = lock(s)?.checkpoint();
        *out_id = id;
        Ok(())
    })
}

/// Returns the session to checkpoint `checkpoint_id`: its position and
/// logits exactly, so continuing gives the same logits as a session fed the
/// same tokens. Checkpoints at later positions become invalid; this one
/// stays valid. The sampler's random stream is not rewound. Unknown or
/// invalidated ids fail with `STRATA_ERR_NOT_FOUND` and change nothing.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session.
#[no_mangle]
pub unsafe extern "C" fn strata_session_rewind(s: *mut strata_session, checkpoint_id: u64) -> strata_status {
    run("strata_session_rewind", || Ok(lock(s)?.rewind(checkpoint_id)?))
}

/// Keeps the first `position` tokens (at most the current position) and
/// drops the rest, with exact logits for the new last position (from a
/// checkpoint or kept logits, else by running that token again; on a model
/// with recurrent state, by restoring the nearest checkpoint at or before
/// `position` that can serve and running the tokens after it again).
/// Checkpoints past `position` become invalid. If that forward fails, the
/// session holds `position - 1` tokens without logits (with recurrent
/// state: the restored checkpoint's tokens and logits), and checkpoints
/// past that are invalid.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session.
#[no_mangle]
pub unsafe extern "C" fn strata_session_rewind_to(s: *mut strata_session, position: usize) -> strata_status {
    run("strata_session_rewind_to", || Ok(lock(s)?.rewind_to(position)?))
}

/// Forgets checkpoint `checkpoint_id` and frees its logits
/// (`STRATA_ERR_NOT_FOUND` if it is unknown or already invalid).
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session.
#[no_mangle]
pub unsafe extern "C" fn strata_session_checkpoint_release(
    s: *mut strata_session,
    checkpoint_id: u64,
) -> strata_status {
    run("strata_session_checkpoint_release", || Ok(lock(s)?.release_checkpoint(checkpoint_id)?))
}

/// `*out` = the bytes `strata_session_state_save` needs now.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_state_size(s: *mut strata_session, out: *mut usize) -> strata_status {
    run("strata_session_state_size", || {
        let out = args::out(out, "out")?;
        let n = lock(s)?.state_size();
        *out = n;
        Ok(())
    })
}

/// Saves the session's state (tokens, KV cache, last logits, sampler; not
/// checkpoints) into `buf` in the format of docs/c-api.md. `*n_out` is the
/// state's size; if `buf_len` is smaller, nothing is written and the call
/// returns `STRATA_ERR_BUFFER_TOO_SMALL`. `buf` may be NULL when `buf_len`
/// is 0.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `buf` writable for `buf_len` bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_session_state_save(
    s: *mut strata_session,
    buf: *mut u8,
    buf_len: usize,
    n_out: *mut usize,
) -> strata_status {
    run("strata_session_state_save", || {
        let n_out = args::out(n_out, "n_out")?;
        let buf = args::slice_mut(buf, buf_len, "buf")?;
        let guard = lock(s)?;
        let size = guard.state_size();
        *n_out = size;
        if buf_len < size {
            return Err(FfiError::new(
                strata_status::STRATA_ERR_BUFFER_TOO_SMALL,
                format!("buf holds {buf_len} bytes, the state is {size}"),
            ));
        }
        guard.write_state(buf)?;
        Ok(())
    })
}

/// Replaces the session's state with one saved by
/// `strata_session_state_save` from a session of the same model (another
/// model's state: `STRATA_ERR_INVALID_ARGUMENT`). The bytes are checked
/// completely (format, version, model, checksum, vocabulary, this
/// session's context size, finite logits, caches and recurrent state)
/// before anything changes. The session's
/// checkpoints are dropped. `buf` is read during the call only.
///
/// Thread-safety: one call per session at a time (else `STRATA_ERR_BUSY`).
///
/// # Safety
/// `s` a live session; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_session_state_load(
    s: *mut strata_session,
    buf: *const u8,
    len: usize,
) -> strata_status {
    run("strata_session_state_load", || {
        let sess = args::get(s, "session")?;
        let bytes = args::slice(buf, len, "buf")?;
        sess.lock()?.load_state(bytes)?;
        Ok(())
    })
}
