//! `strata_engine`: a loaded pack, shared by any number of sessions; and
//! the tokenizer that ships in the pack.

use std::ffi::{c_char, c_void};
use std::path::Path;
use std::time::Instant;

use super::args;
use super::log::{log, strata_log_level};
use super::params::{self, field, Field, Kind, Versioned};
use super::status::{run, strata_status, FfiError};
use crate::engine::{Engine, EngineOptions, GpuPrecision, Help};
use crate::experts::ExpertCacheOptions;
use crate::tokenizer::Tokenizer;
use crate::Error;

/// A loaded model. Opaque; created by `strata_engine_load`, freed by
/// `strata_engine_free`.
///
/// Thread-safety: thread-safe. Any number of threads may use one engine at
/// once (open sessions, tokenize, read its info).
#[allow(non_camel_case_types)]
pub struct strata_engine {
    pub(crate) engine: Engine,
    /// The pack's tokenizer, or why there is none.
    tokenizer: Result<Tokenizer, String>,
}

// The thread-safety promised above: an engine is shared by reference
// across threads, a session is moved between them.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<strata_engine>();
    shareable::<super::session::strata_session>();
};

/// Load progress: `fraction` goes from 0 to 1 and never decreases; return
/// false to cancel the load (it then fails with `STRATA_ERR_CANCELLED`).
/// Called on the thread that called `strata_engine_load`, never after it
/// returns.
#[allow(non_camel_case_types)]
pub type strata_progress_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, fraction: f32) -> bool>;

/// Options of `strata_engine_load`. Get defaults from
/// `strata_engine_default_params`, then change fields.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct strata_engine_params {
    /// `sizeof(strata_engine_params)` as the caller knows it (versioning).
    pub struct_size: u32,
    /// NULL-terminated list of device names: `"cpu"`, `"cuda"`, `"cuda:N"`
    /// (at most 64). NULL or an empty list means `{"cpu"}`. Several devices
    /// split the layers into stages, all CPU or all CUDA (a repeated CUDA
    /// ordinal: two logical devices on one GPU). A build without CUDA fails
    /// with `STRATA_ERR_NO_CUDA` for CUDA devices. Read during the call
    /// only. Default NULL.
    pub devices: *const *const c_char,
    /// CPU threads for this engine (a pool of its own); 0 (default) = all
    /// cores, shared with other engines.
    pub n_threads: u32,
    /// GPU memory for the expert cache (slots and the prefill ring);
    /// 0 (default) = no cache, every expert resident in GPU memory. A budget
    /// below one token's experts plus the ring fails with
    /// `STRATA_ERR_INVALID_ARGUMENT` naming the budget and the need.
    /// Per CUDA device: each stage of a split has its own cache. Ignored on
    /// cpu (experts stay mapped).
    pub vram_budget_bytes: u64,
    /// Page-locked host memory for experts outside the GPU cache; 0
    /// (default) = none (misses read the mapped pack). Needs
    /// `vram_budget_bytes`. On a split, divided among the stages: each its
    /// staging blobs, the rest in proportion to its layers. Ignored on cpu.
    pub host_budget_bytes: u64,
    /// Recompute every checksum of the pack while loading (reads the whole
    /// pack). Default false.
    pub verify_checksums: bool,
    /// Progress callback; NULL (default) = none.
    pub progress: strata_progress_fn,
    /// Passed to `progress` unchanged. Default NULL.
    pub progress_user_data: *mut c_void,
    /// How a CUDA device rounds activations in its tensor-core products
    /// (prefill); default `STRATA_GPU_PRECISION_ACCURATE`. Ignored on cpu.
    pub gpu_precision: strata_gpu_precision,
    /// With several devices: the first layer of each stage after the first, ascending, one entry fewer than the
    /// devices listed (`n_layer_split` of them); NULL (default) = layers split evenly.
    /// Read during the call only.
    pub layer_split: *const u32,
    /// Entries of `layer_split`. Default 0.
    pub n_layer_split: u32,
    /// Prefill help on a split (an idle stage takes a share of the active
    /// stage's expert rows); default `STRATA_PREFILL_HELP_AUTO`.
    pub prefill_help: strata_prefill_help,
    /// With several devices, instead of `layer_split`: each device's memory
    /// budget in bytes, one per device (`n_stage_memory` of them); the split
    /// is the one that fits every stage in its budget, as evenly filled as
    /// it can be. NULL (default) = none. Read during the call only.
    pub stage_memory_bytes: *const u64,
    /// Entries of `stage_memory_bytes`. Default 0.
    pub n_stage_memory: u32,
    /// With `stage_memory_bytes`: each stage's budget also holds one
    /// session's KV cache for this many tokens (int8 on CUDA, f32 on the
    /// CPU) and its recurrent states; 0 (default) = the weights alone.
    pub stage_memory_context: u32,
}

/// When an idle stage of a layer split helps the active one with its
/// expert rows (docs/layer-split.md).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum strata_prefill_help {
    /// On forwards of a prefill chunk's size (not decode steps).
    STRATA_PREFILL_HELP_AUTO = 0,
    /// On every forward of a split engine.
    STRATA_PREFILL_HELP_ON = 1,
    /// Never.
    STRATA_PREFILL_HELP_OFF = 2,
}

/// Activation precision of the GPU's tensor-core products (the
/// projections, experts and attention of prefill; decode uses f32 GEMVs).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum strata_gpu_precision {
    /// Each activation as two bf16 (about 16 significant bits).
    STRATA_GPU_PRECISION_ACCURATE = 0,
    /// Each activation as one bf16: faster, coarser.
    STRATA_GPU_PRECISION_FAST = 1,
}

/// A per-device array of the params (`ptr`, `n` entries): `None` when `n`
/// is 0; a NULL `ptr` with entries, or more entries than devices, refused.
///
/// # Safety
/// A non-NULL `ptr` must point to `n` readable entries (when `n <= MAX_DEVICES`).
unsafe fn per_device<'a, T>(ptr: *const T, n: u32, name: &str, count: &str) -> Result<Option<&'a [T]>, FfiError> {
    match (ptr.is_null(), n) {
        (_, 0) => Ok(None),
        (true, n) => Err(FfiError::invalid(format!("{name} is NULL with {count} {n}"))),
        (false, n) if n as usize > MAX_DEVICES => {
            Err(FfiError::invalid(format!("{count} {n} is more than {MAX_DEVICES}")))
        }
        // SAFETY: the caller's promise, n bounded above.
        (false, n) => Ok(Some(unsafe { std::slice::from_raw_parts(ptr, n as usize) })),
    }
}

// SAFETY: the table lists every field after struct_size with its kind.
unsafe impl Versioned for strata_engine_params {
    const NAME: &'static str = "strata_engine_params";
    fn defaults() -> Self {
        strata_engine_params {
            struct_size: std::mem::size_of::<Self>() as u32,
            devices: std::ptr::null(),
            n_threads: 0,
            vram_budget_bytes: 0,
            host_budget_bytes: 0,
            verify_checksums: false,
            progress: None,
            progress_user_data: std::ptr::null_mut(),
            gpu_precision: strata_gpu_precision::STRATA_GPU_PRECISION_ACCURATE,
            layer_split: std::ptr::null(),
            n_layer_split: 0,
            prefill_help: strata_prefill_help::STRATA_PREFILL_HELP_AUTO,
            stage_memory_bytes: std::ptr::null(),
            n_stage_memory: 0,
            stage_memory_context: 0,
        }
    }
    fn fields() -> Vec<Field> {
        type T = strata_engine_params;
        vec![
            field!(T, devices, Kind::Plain),
            field!(T, n_threads, Kind::Plain),
            field!(T, vram_budget_bytes, Kind::Plain),
            field!(T, host_budget_bytes, Kind::Plain),
            field!(T, verify_checksums, Kind::Bool),
            field!(T, progress, Kind::Plain),
            field!(T, progress_user_data, Kind::Plain),
            field!(T, gpu_precision, Kind::Enum { max: strata_gpu_precision::STRATA_GPU_PRECISION_FAST as u32 }),
            field!(T, layer_split, Kind::Plain),
            field!(T, n_layer_split, Kind::Plain),
            field!(T, prefill_help, Kind::Enum { max: strata_prefill_help::STRATA_PREFILL_HELP_OFF as u32 }),
            field!(T, stage_memory_bytes, Kind::Plain),
            field!(T, n_stage_memory, Kind::Plain),
            field!(T, stage_memory_context, Kind::Plain),
        ]
    }
}

/// What `strata_engine_info` reports. The caller sets `struct_size`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct strata_model_info {
    /// `sizeof(strata_model_info)` as the caller knows it; set by the caller.
    pub struct_size: u32,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_experts: u32,
    pub num_experts_per_tok: u32,
    /// The model's maximum context (max_position_embeddings).
    pub max_context: u32,
    /// Whether `strata_tokenize` / `strata_detokenize` work with this pack.
    pub has_tokenizer: bool,
}

// SAFETY: the table lists every field after struct_size with its kind.
unsafe impl Versioned for strata_model_info {
    const NAME: &'static str = "strata_model_info";
    fn defaults() -> Self {
        strata_model_info {
            struct_size: std::mem::size_of::<Self>() as u32,
            vocab_size: 0,
            hidden_size: 0,
            num_layers: 0,
            num_experts: 0,
            num_experts_per_tok: 0,
            max_context: 0,
            has_tokenizer: false,
        }
    }
    fn fields() -> Vec<Field> {
        type T = strata_model_info;
        vec![
            field!(T, vocab_size, Kind::Plain),
            field!(T, hidden_size, Kind::Plain),
            field!(T, num_layers, Kind::Plain),
            field!(T, num_experts, Kind::Plain),
            field!(T, num_experts_per_tok, Kind::Plain),
            field!(T, max_context, Kind::Plain),
            field!(T, has_tokenizer, Kind::Bool),
        ]
    }
}

/// Most entries read from `strata_engine_params.devices` before giving up
/// on finding its NULL terminator.
const MAX_DEVICES: usize = 64;
/// Most threads `n_threads` may ask for.
const MAX_THREADS: u32 = 4096;

/// # Safety
/// `list` is NULL or a NULL-terminated array of C strings.
unsafe fn read_devices(list: *const *const c_char) -> Result<Vec<String>, FfiError> {
    let mut out = Vec::new();
    if list.is_null() {
        return Ok(out);
    }
    for i in 0..=MAX_DEVICES {
        let p = *list.add(i);
        if p.is_null() {
            return Ok(out);
        }
        if i == MAX_DEVICES {
            break;
        }
        out.push(args::c_str(p, &format!("devices[{i}]"))?.to_string());
    }
    Err(FfiError::invalid(format!("devices has no NULL terminator within {MAX_DEVICES} entries")))
}

fn u32_of(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Writes the default engine params into the first `struct_size` bytes of
/// `out` (fields beyond this library's version are zeroed) and sets
/// `out->struct_size = struct_size`. Pass `sizeof(strata_engine_params)`.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `out` must be NULL (an error) or point to `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_engine_default_params(
    out: *mut strata_engine_params,
    struct_size: u32,
) -> strata_status {
    run("strata_engine_default_params", || {
        let out = args::out(out, "out")?;
        params::write(&strata_engine_params::defaults(), out, struct_size)
    })
}

/// Loads the pack in directory `pack_path` (UTF-8). On success `*out` is a
/// new engine that the caller owns and frees with `strata_engine_free`; on
/// failure `*out` is NULL. `params` NULL means defaults; it is read during
/// the call only. Logs the load at INFO level.
///
/// Thread-safety: any thread; loads may run concurrently.
///
/// # Safety
/// `pack_path` must be a NUL-terminated string; `params` NULL or a valid
/// params struct of at least `params->struct_size` bytes; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn strata_engine_load(
    pack_path: *const c_char,
    params: *const strata_engine_params,
    out: *mut *mut strata_engine,
) -> strata_status {
    run("strata_engine_load", || {
        let out = args::out(out, "out")?;
        *out = std::ptr::null_mut();
        let path = args::c_str(pack_path, "pack_path")?;
        let p = params::read(params)?;
        let devices = read_devices(p.devices)?;
        // SAFETY (both): the caller vouches for that many readable entries (bounded by MAX_DEVICES).
        let layer_split = unsafe { per_device(p.layer_split, p.n_layer_split, "layer_split", "n_layer_split") }?;
        let stage_memory =
            unsafe { per_device(p.stage_memory_bytes, p.n_stage_memory, "stage_memory_bytes", "n_stage_memory") }?;
        if p.n_threads > MAX_THREADS {
            return Err(FfiError::invalid(format!("n_threads {} is more than {MAX_THREADS}", p.n_threads)));
        }
        let on_gpu = devices.first().is_some_and(|d| d.starts_with("cuda"));
        let opts = EngineOptions {
            threads: (p.n_threads > 0).then_some(p.n_threads as usize),
            devices,
            verify_checksums: p.verify_checksums,
            gpu_precision: match p.gpu_precision {
                strata_gpu_precision::STRATA_GPU_PRECISION_ACCURATE => GpuPrecision::Accurate,
                strata_gpu_precision::STRATA_GPU_PRECISION_FAST => GpuPrecision::Fast,
            },
            expert_cache: {
                let budget = |b: u64| (on_gpu && b > 0).then_some(b);
                ExpertCacheOptions {
                    vram_budget: budget(p.vram_budget_bytes),
                    host_budget: budget(p.host_budget_bytes),
                    ..Default::default()
                }
            },
            layer_split: layer_split.map(|s| s.iter().map(|&l| l as usize).collect()),
            stage_memory: stage_memory.map(<[u64]>::to_vec),
            stage_memory_context: p.stage_memory_context as usize,
            prefill_help: match p.prefill_help {
                strata_prefill_help::STRATA_PREFILL_HELP_AUTO => Help::Auto,
                strata_prefill_help::STRATA_PREFILL_HELP_ON => Help::On,
                strata_prefill_help::STRATA_PREFILL_HELP_OFF => Help::Off,
            },
        };
        log(strata_log_level::STRATA_LOG_INFO, &format!("loading pack {path} ({opts:?})"));
        let start = Instant::now();
        let (callback, user_data) = (p.progress, p.progress_user_data);
        let mut progress = |fraction: f32| match callback {
            // SAFETY: the caller vouches for the callback and its user data.
            Some(f) => unsafe { f(user_data, fraction) },
            None => true,
        };
        let engine = Engine::load_with_progress(Path::new(path), &opts, &mut progress)?;
        let tokenizer = match engine.pack().tokenizer_path() {
            Some(t) => Tokenizer::from_file(&t).map_err(|e| e.to_string()),
            None => Err(format!("pack {path} has no tokenizer.json")),
        };
        if let (Some(_), Err(e)) = (engine.pack().tokenizer_path(), &tokenizer) {
            log(strata_log_level::STRATA_LOG_WARN, &format!("pack {path}: the tokenizer did not load: {e}"));
        }
        let c = engine.config();
        log(
            strata_log_level::STRATA_LOG_INFO,
            &format!(
                "loaded pack {path}: {} with {} layers, {} experts (top {}), vocab {}, on {}, in {:.2} s",
                c.arch.name(),
                c.num_hidden_layers,
                c.num_experts,
                c.num_experts_per_tok,
                c.vocab_size,
                engine.backend_name(),
                start.elapsed().as_secs_f64()
            ),
        );
        *out = Box::into_raw(Box::new(strata_engine { engine, tokenizer }));
        Ok(())
    })
}

/// Frees an engine. NULL is allowed (nothing happens). Sessions opened on
/// it stay usable: they keep the model alive until they are freed.
///
/// Thread-safety: do not free an engine while another thread is using this
/// handle (its sessions are fine).
///
/// # Safety
/// `engine` must be NULL or a pointer from `strata_engine_load` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn strata_engine_free(engine: *mut strata_engine) {
    run("strata_engine_free", || {
        if !engine.is_null() {
            drop(Box::from_raw(engine));
        }
        Ok(())
    });
}

/// Describes the loaded model. The caller sets `out->struct_size`; the
/// fields it covers are written.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `engine` from `strata_engine_load`; `out` points to `out->struct_size`
/// writable bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_engine_info(
    engine: *const strata_engine,
    out: *mut strata_model_info,
) -> strata_status {
    run("strata_engine_info", || {
        let e = args::get(engine, "engine")?;
        let out = args::out(out, "out")?;
        let c = e.engine.config();
        let info = strata_model_info {
            struct_size: std::mem::size_of::<strata_model_info>() as u32,
            vocab_size: u32_of(c.vocab_size),
            hidden_size: u32_of(c.hidden_size),
            num_layers: u32_of(c.num_hidden_layers),
            num_experts: u32_of(c.num_experts),
            num_experts_per_tok: u32_of(c.num_experts_per_tok),
            max_context: u32_of(c.max_position_embeddings),
            has_tokenizer: e.tokenizer.is_ok(),
        };
        params::write_sized(&info, out)
    })
}

impl strata_engine {
    fn tokenizer(&self) -> Result<&Tokenizer, FfiError> {
        self.tokenizer.as_ref().map_err(|e| Error::Tokenizer(e.clone()).into())
    }
}

/// Encodes `text_len` bytes of UTF-8 `text` (no NUL needed; no special
/// tokens are added) into token ids. `*n_out` is the number of tokens; if
/// it exceeds `cap`, nothing is written to `tokens` and the call returns
/// `STRATA_ERR_BUFFER_TOO_SMALL` (call again with `cap >= *n_out`).
/// `tokens` may be NULL when `cap` is 0, `text` when `text_len` is 0.
/// Fails with `STRATA_ERR_TOKENIZER` if the pack has no tokenizer.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `text` readable for `text_len` bytes; `tokens` writable for `cap` ids.
#[no_mangle]
pub unsafe extern "C" fn strata_tokenize(
    engine: *const strata_engine,
    text: *const c_char,
    text_len: usize,
    tokens: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> strata_status {
    run("strata_tokenize", || {
        let e = args::get(engine, "engine")?;
        let n_out = &mut *args::out(n_out, "n_out")?;
        let text = args::utf8(args::slice(text as *const u8, text_len, "text")?, "text")?;
        let tokens = args::slice_mut(tokens, cap, "tokens")?;
        let ids = e.tokenizer()?.encode(text)?;
        write_ids(&ids, tokens, n_out, "tokens in the text")
    })
}

/// The tokens that end generation: the pack's `eos_token_ids` (from the
/// checkpoint's generation_config.json or config.json; none when it named
/// none). `strata_session_step` does not stop by itself: a host stops
/// when a sampled token is one of these. `*n_out` is their number; if it
/// exceeds `cap`, nothing is written and the call returns
/// `STRATA_ERR_BUFFER_TOO_SMALL`. `tokens` may be NULL when `cap` is 0.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `engine` from `strata_engine_load`; `tokens` writable for `cap` ids.
#[no_mangle]
pub unsafe extern "C" fn strata_engine_eos_tokens(
    engine: *const strata_engine,
    tokens: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> strata_status {
    run("strata_engine_eos_tokens", || {
        let e = args::get(engine, "engine")?;
        let n_out = &mut *args::out(n_out, "n_out")?;
        let tokens = args::slice_mut(tokens, cap, "tokens")?;
        write_ids(e.engine.eos_token_ids(), tokens, n_out, "end-of-generation tokens")
    })
}

/// Writes `ids` into `tokens` and their count into `n_out`, or fails with
/// `STRATA_ERR_BUFFER_TOO_SMALL` (writing only the count) when they do
/// not fit.
fn write_ids(ids: &[u32], tokens: &mut [i32], n_out: &mut usize, what: &str) -> Result<(), FfiError> {
    *n_out = ids.len();
    if ids.len() > tokens.len() {
        return Err(FfiError::new(
            strata_status::STRATA_ERR_BUFFER_TOO_SMALL,
            format!("{} {what}, tokens holds {}", ids.len(), tokens.len()),
        ));
    }
    for (o, &id) in tokens.iter_mut().zip(ids) {
        *o = id as i32;
    }
    Ok(())
}

/// Decodes `n` token ids into UTF-8 text in `buf`, NUL-terminated. On
/// success `*n_out` is the text's length in bytes, without the NUL. If
/// `cap` is less than that length + 1, nothing is written, `*n_out` is the
/// size needed including the NUL, and the call returns
/// `STRATA_ERR_BUFFER_TOO_SMALL`. `buf` may be NULL when `cap` is 0,
/// `tokens` when `n` is 0. Ids are checked against the vocabulary first
/// (`STRATA_ERR_TOKEN_OUT_OF_RANGE`).
///
/// Thread-safety: any thread.
///
/// # Safety
/// `tokens` readable for `n` ids; `buf` writable for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_detokenize(
    engine: *const strata_engine,
    tokens: *const i32,
    n: usize,
    buf: *mut c_char,
    cap: usize,
    n_out: *mut usize,
) -> strata_status {
    run("strata_detokenize", || {
        let e = args::get(engine, "engine")?;
        let n_out = args::out(n_out, "n_out")?;
        let tokens = args::slice(tokens, n, "tokens")?;
        let buf = args::slice_mut(buf as *mut u8, cap, "buf")?;
        let vocab = e.engine.config().vocab_size;
        let ids = tokens.iter().enumerate().map(|(i, &t)| args::token(t, i, vocab)).collect::<Result<Vec<_>, _>>()?;
        let text = e.tokenizer()?.decode(&ids)?;
        let needed = text.len() + 1;
        if cap < needed {
            *n_out = needed;
            return Err(FfiError::new(
                strata_status::STRATA_ERR_BUFFER_TOO_SMALL,
                format!("the text needs {needed} bytes with its NUL, buf holds {cap}"),
            ));
        }
        buf[..text.len()].copy_from_slice(text.as_bytes());
        buf[text.len()] = 0;
        *n_out = text.len();
        Ok(())
    })
}
