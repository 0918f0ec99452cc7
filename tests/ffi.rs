//! The C API exercised across the boundary: these tests call the
//! `extern "C"` functions exactly as a C host would (raw pointers, sizes,
//! status codes), on tiny packs made in a temporary directory.

use std::ffi::{c_char, c_void, CStr, CString};
use std::mem::{offset_of, size_of, MaybeUninit};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Arc, Barrier, Mutex};

use strata::engine::{Engine, EngineOptions};
use strata::ffi::strata_status::*;
use strata::ffi::*;
use strata::model::{Arch, ModelConfig};
use strata::pack::synth::{self, SynthOptions};
use strata::sampling::{Sampler, SamplingParams};
use strata::session::SessionOptions;
use tempfile::TempDir;

const PROMPT: [i32; 10] = [3, 96, 14, 15, 92, 65, 35, 89, 79, 32];
const VOCAB: usize = 256;

fn tiny_config() -> ModelConfig {
    synth::preset(Arch::Qwen3Moe, "tiny").unwrap()
}

/// A synthetic pack of `config` in a new temporary directory.
fn make_pack(config: &ModelConfig) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pack");
    synth::synth(config, &path, &SynthOptions::default()).unwrap();
    (dir, path)
}

fn c_path(p: &Path) -> CString {
    CString::new(p.to_str().unwrap()).unwrap()
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(strata_last_error()) }.to_string_lossy().into_owned()
}

/// Asserts `status == want` and that the thread's last error contains `needle`.
#[track_caller]
fn expect_err(status: strata_status, want: strata_status, needle: &str) {
    assert_eq!(status, want, "last error: {}", last_error());
    let msg = last_error();
    assert!(msg.contains(needle), "{want:?}: message {msg:?} lacks {needle:?}");
}

#[track_caller]
fn ok(status: strata_status) {
    assert_eq!(status, STRATA_OK, "{}", last_error());
}

/// An engine handle freed on drop.
struct EngineHandle(*mut strata_engine);

// SAFETY: strata_engine is documented thread-safe.
unsafe impl Send for EngineHandle {}
unsafe impl Sync for EngineHandle {}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        unsafe { strata_engine_free(self.0) }
    }
}

fn load(path: &Path) -> EngineHandle {
    load_with(path, ptr::null())
}

fn load_with(path: &Path, params: *const strata_engine_params) -> EngineHandle {
    let mut e = ptr::null_mut();
    ok(unsafe { strata_engine_load(c_path(path).as_ptr(), params, &mut e) });
    assert!(!e.is_null());
    EngineHandle(e)
}

/// A session handle freed on drop.
struct SessionHandle(*mut strata_session);

unsafe impl Send for SessionHandle {}
unsafe impl Sync for SessionHandle {}

impl Drop for SessionHandle {
    fn drop(&mut self) {
        unsafe { strata_session_free(self.0) }
    }
}

fn open(e: &EngineHandle) -> SessionHandle {
    open_with(e, ptr::null())
}

fn open_with(e: &EngineHandle, params: *const strata_session_params) -> SessionHandle {
    let mut s = ptr::null_mut();
    ok(unsafe { strata_session_open(e.0, params, &mut s) });
    SessionHandle(s)
}

fn session_params() -> strata_session_params {
    let mut p = MaybeUninit::<strata_session_params>::uninit();
    ok(unsafe { strata_session_default_params(p.as_mut_ptr(), size_of::<strata_session_params>() as u32) });
    unsafe { p.assume_init() }
}

fn engine_params() -> strata_engine_params {
    let mut p = MaybeUninit::<strata_engine_params>::uninit();
    ok(unsafe { strata_engine_default_params(p.as_mut_ptr(), size_of::<strata_engine_params>() as u32) });
    unsafe { p.assume_init() }
}

fn sampling(temperature: f32, seed: u64) -> strata_sampling_params {
    let mut p = MaybeUninit::<strata_sampling_params>::uninit();
    ok(unsafe { strata_sampling_default_params(p.as_mut_ptr(), size_of::<strata_sampling_params>() as u32) });
    let mut p = unsafe { p.assume_init() };
    p.temperature = temperature;
    p.seed = seed;
    p
}

fn prefill(s: &SessionHandle, tokens: &[i32]) {
    ok(unsafe { strata_session_prefill(s.0, tokens.as_ptr(), tokens.len()) });
}

fn step(s: &SessionHandle, params: Option<&strata_sampling_params>) -> i32 {
    let mut t = -1;
    ok(unsafe { strata_session_step(s.0, params.map_or(ptr::null(), |p| p as *const _), &mut t) });
    t
}

fn logits(s: &SessionHandle, index: i64) -> Vec<f32> {
    let mut buf = vec![0.0f32; VOCAB];
    let mut n = 0;
    ok(unsafe { strata_session_logits(s.0, index, buf.as_mut_ptr(), buf.len(), &mut n) });
    assert_eq!(n, VOCAB);
    buf
}

fn position(s: &SessionHandle) -> usize {
    let mut n = usize::MAX;
    ok(unsafe { strata_session_position(s.0, &mut n) });
    n
}

fn checkpoint(s: &SessionHandle) -> u64 {
    let mut id = 0;
    ok(unsafe { strata_session_checkpoint(s.0, &mut id) });
    assert_ne!(id, 0);
    id
}

fn save_state(s: &SessionHandle) -> Vec<u8> {
    let mut size = 0;
    ok(unsafe { strata_session_state_size(s.0, &mut size) });
    let mut buf = vec![0u8; size];
    let mut n = 0;
    ok(unsafe { strata_session_state_save(s.0, buf.as_mut_ptr(), buf.len(), &mut n) });
    assert_eq!(n, size);
    buf
}

/// Greedy (or seeded) generation of `n` tokens after `prompt`.
fn generate(e: &EngineHandle, prompt: &[i32], n: usize, params: Option<&strata_sampling_params>) -> Vec<i32> {
    let s = open(e);
    prefill(&s, prompt);
    (0..n).map(|_| step(&s, params)).collect()
}

/// One C call of a table-driven test.
type Call<'a> = Box<dyn Fn() -> strata_status + 'a>;

#[test]
fn null_pointers_are_rejected_and_named() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    prefill(&s, &PROMPT);
    let before = (position(&s), logits(&s, -1));
    let cpath = c_path(&path);
    // Raw pointers to outputs, so the table's closures are plain `Fn`s.
    let (mut u, mut f, mut id, mut t) = (0usize, [0.0f32; 4], 0u64, 0i32);
    let (mut bytes, mut text, mut toks) = ([0u8; 4], [0 as c_char; 4], [0i32; 4]);
    let mut info = MaybeUninit::<strata_model_info>::zeroed();
    let (mut engine_out, mut session_out): (*mut strata_engine, *mut strata_session) =
        (ptr::null_mut(), ptr::null_mut());
    let (u, f, id, t) = (&mut u as *mut usize, f.as_mut_ptr(), &mut id as *mut u64, &mut t as *mut i32);
    let (bytes, text, toks, info) = (bytes.as_mut_ptr(), text.as_mut_ptr(), toks.as_mut_ptr(), info.as_mut_ptr());
    let (eo, so) = (&mut engine_out as *mut *mut strata_engine, &mut session_out as *mut *mut strata_session);
    let (sp, smp) = (session_params(), sampling(0.0, 0));
    let tok = [1i32];
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, Call)> = unsafe { vec![
        ("engine_default_params out", "out", Box::new(|| strata_engine_default_params(ptr::null_mut(), 64))),
        ("engine_load pack_path", "pack_path", Box::new(|| strata_engine_load(ptr::null(), ptr::null(), eo))),
        ("engine_load out", "out", Box::new(|| strata_engine_load(cpath.as_ptr(), ptr::null(), ptr::null_mut()))),
        ("engine_info engine", "engine", Box::new(|| strata_engine_info(ptr::null(), info))),
        ("engine_info out", "out", Box::new(|| strata_engine_info(e.0, ptr::null_mut()))),
        ("session_default_params out", "out", Box::new(|| strata_session_default_params(ptr::null_mut(), 16))),
        ("sampling_default_params out", "out", Box::new(|| strata_sampling_default_params(ptr::null_mut(), 16))),
        ("session_open engine", "engine", Box::new(|| strata_session_open(ptr::null_mut(), &sp, so))),
        ("session_open out", "out", Box::new(|| strata_session_open(e.0, ptr::null(), ptr::null_mut()))),
        ("prefill session", "session", Box::new(|| strata_session_prefill(ptr::null_mut(), tok.as_ptr(), 1))),
        ("prefill tokens", "tokens", Box::new(|| strata_session_prefill(s.0, ptr::null(), 1))),
        ("step session", "session", Box::new(|| strata_session_step(ptr::null_mut(), &smp, t))),
        ("step out_token", "out_token", Box::new(|| strata_session_step(s.0, ptr::null(), ptr::null_mut()))),
        ("logits session", "session", Box::new(|| strata_session_logits(ptr::null_mut(), -1, f, 4, u))),
        ("logits buf", "buf", Box::new(|| strata_session_logits(s.0, -1, ptr::null_mut(), 4, u))),
        ("logits n_out", "n_out", Box::new(|| strata_session_logits(s.0, -1, f, 4, ptr::null_mut()))),
        ("position session", "session", Box::new(|| strata_session_position(ptr::null_mut(), u))),
        ("position out", "out", Box::new(|| strata_session_position(s.0, ptr::null_mut()))),
        ("checkpoint session", "session", Box::new(|| strata_session_checkpoint(ptr::null_mut(), id))),
        ("checkpoint out_id", "out_id", Box::new(|| strata_session_checkpoint(s.0, ptr::null_mut()))),
        ("rewind session", "session", Box::new(|| strata_session_rewind(ptr::null_mut(), 1))),
        ("rewind_to session", "session", Box::new(|| strata_session_rewind_to(ptr::null_mut(), 0))),
        ("checkpoint_release session", "session", Box::new(|| strata_session_checkpoint_release(ptr::null_mut(), 1))),
        ("state_size session", "session", Box::new(|| strata_session_state_size(ptr::null_mut(), u))),
        ("state_size out", "out", Box::new(|| strata_session_state_size(s.0, ptr::null_mut()))),
        ("state_save session", "session", Box::new(|| strata_session_state_save(ptr::null_mut(), bytes, 4, u))),
        ("state_save buf", "buf", Box::new(|| strata_session_state_save(s.0, ptr::null_mut(), 4, u))),
        ("state_save n_out", "n_out", Box::new(|| strata_session_state_save(s.0, bytes, 4, ptr::null_mut()))),
        ("state_load session", "session", Box::new(|| strata_session_state_load(ptr::null_mut(), bytes, 4))),
        ("state_load buf", "buf", Box::new(|| strata_session_state_load(s.0, ptr::null(), 4))),
        ("tokenize engine", "engine", Box::new(|| strata_tokenize(ptr::null(), c"a".as_ptr(), 1, toks, 4, u))),
        ("tokenize text", "text", Box::new(|| strata_tokenize(e.0, ptr::null(), 1, toks, 4, u))),
        ("tokenize tokens", "tokens", Box::new(|| strata_tokenize(e.0, c"a".as_ptr(), 1, ptr::null_mut(), 4, u))),
        ("tokenize n_out", "n_out", Box::new(|| strata_tokenize(e.0, c"a".as_ptr(), 1, toks, 4, ptr::null_mut()))),
        ("detokenize engine", "engine", Box::new(|| strata_detokenize(ptr::null(), tok.as_ptr(), 1, text, 4, u))),
        ("detokenize tokens", "tokens", Box::new(|| strata_detokenize(e.0, ptr::null(), 1, text, 4, u))),
        ("detokenize buf", "buf", Box::new(|| strata_detokenize(e.0, tok.as_ptr(), 1, ptr::null_mut(), 4, u))),
        ("detokenize n_out", "n_out", Box::new(|| strata_detokenize(e.0, tok.as_ptr(), 1, text, 4, ptr::null_mut()))),
        ("eos_tokens engine", "engine", Box::new(|| strata_engine_eos_tokens(ptr::null(), toks, 4, u))),
        ("eos_tokens tokens", "tokens", Box::new(|| strata_engine_eos_tokens(e.0, ptr::null_mut(), 4, u))),
        ("eos_tokens n_out", "n_out", Box::new(|| strata_engine_eos_tokens(e.0, toks, 4, ptr::null_mut()))),
        ("get_api out", "out", Box::new(|| strata_get_api(1, ptr::null_mut()))),
    ] };
    for (what, arg, call) in &cases {
        let status = call();
        assert_eq!(status, STRATA_ERR_NULL_POINTER, "{what}: {}", last_error());
        let msg = last_error();
        assert!(msg.contains(&format!("{arg} is NULL")), "{what}: {msg:?}");
    }
    // Outputs of failed constructors are NULL; nothing changed in the session.
    assert!(engine_out.is_null() && session_out.is_null());
    assert_eq!((position(&s), logits(&s, -1)), before);
    // Free functions accept NULL.
    unsafe {
        strata_engine_free(ptr::null_mut());
        strata_session_free(ptr::null_mut());
    }
}

#[test]
fn older_callers_smaller_structs_get_defaults_for_missing_fields() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);

    // An "older" session params struct that ends before kv_type: the
    // fields it has are read, keep_all_logits (not covered) stays false.
    let mut p = session_params();
    p.context_size = 12;
    p.keep_all_logits = true;
    p.struct_size = offset_of!(strata_session_params, kv_type) as u32;
    let s = open_with(&e, &p);
    expect_err(unsafe { strata_session_prefill(s.0, [1; 13].as_ptr(), 13) }, STRATA_ERR_CONTEXT_OVERFLOW, "12");
    prefill(&s, &PROMPT[..3]);
    let mut buf = [0f32; VOCAB];
    let mut n = 0;
    let st = unsafe { strata_session_logits(s.0, 0, buf.as_mut_ptr(), VOCAB, &mut n) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "not kept");

    // default_params for an older struct writes only what it covers.
    let mut raw = [0xEEu8; size_of::<strata_session_params>()];
    let small = offset_of!(strata_session_params, prefill_chunk) as u32;
    ok(unsafe { strata_session_default_params(raw.as_mut_ptr() as *mut _, small) });
    assert_eq!(u32::from_ne_bytes(raw[..4].try_into().unwrap()), small);
    assert_eq!(&raw[4..8], &0u32.to_ne_bytes());
    assert!(raw[small as usize..].iter().all(|&b| b == 0xEE), "wrote past struct_size");

    // An older sampling struct without `seed`: the seed is the default 0.
    let mut old = sampling(0.9, 99);
    old.struct_size = offset_of!(strata_sampling_params, seed) as u32;
    let with_old = generate(&e, &PROMPT, 8, Some(&old));
    assert_eq!(with_old, generate(&e, &PROMPT, 8, Some(&sampling(0.9, 0))));
    assert_ne!(with_old, generate(&e, &PROMPT, 8, Some(&sampling(0.9, 99))), "the seed matters");

    // An older engine params struct that ends before `progress`: the
    // callback it cannot describe is never called.
    unsafe extern "C" fn never(_: *mut c_void, _: f32) -> bool {
        panic!("progress must not be called")
    }
    let mut ep = engine_params();
    ep.progress = Some(never);
    ep.struct_size = offset_of!(strata_engine_params, progress) as u32;
    drop(load_with(&path, &ep));

    // engine_info fills only the fields of the caller's struct_size.
    let mut info = [0xEEu8; size_of::<strata_model_info>()];
    let small = offset_of!(strata_model_info, num_layers) as u32;
    info[..4].copy_from_slice(&small.to_ne_bytes());
    ok(unsafe { strata_engine_info(e.0, info.as_mut_ptr() as *mut _) });
    let word = |i: usize| u32::from_ne_bytes(info[i..i + 4].try_into().unwrap());
    assert_eq!((word(0), word(4), word(8)), (small, VOCAB as u32, 64));
    assert!(info[small as usize..].iter().all(|&b| b == 0xEE));
}

#[test]
fn newer_callers_larger_structs_have_their_tail_ignored() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    const EXTRA: usize = 32;
    let size = size_of::<strata_session_params>() + EXTRA;
    // u64 storage keeps the struct aligned.
    let mut buf = vec![0u64; size.div_ceil(8)];
    let bytes = buf.as_mut_ptr() as *mut u8;
    unsafe { ptr::write_bytes(bytes, 0xAB, size) };
    ok(unsafe { strata_session_default_params(bytes as *mut _, size as u32) });
    let tail = unsafe { std::slice::from_raw_parts(bytes.add(size - EXTRA), EXTRA) };
    assert!(tail.iter().all(|&b| b == 0), "unknown fields are zeroed");
    let p = unsafe { &mut *(bytes as *mut strata_session_params) };
    assert_eq!(p.struct_size as usize, size);
    assert_eq!((p.context_size, p.kv_type, p.keep_all_logits), (0, strata_kv_type::STRATA_KV_AUTO, false));
    p.keep_all_logits = true;
    unsafe { ptr::write_bytes(bytes.add(size - EXTRA), 0xCD, EXTRA) }; // garbage in "future" fields
    let s = open_with(&e, p);
    prefill(&s, &PROMPT);
    let _ = logits(&s, 0); // keep_all_logits was read

    // The same for engine params and sampling params.
    let size = size_of::<strata_engine_params>() + EXTRA;
    let mut ebuf = vec![0u64; size.div_ceil(8)];
    let eb = ebuf.as_mut_ptr() as *mut u8;
    ok(unsafe { strata_engine_default_params(eb as *mut _, size as u32) });
    unsafe { ptr::write_bytes(eb.add(size - EXTRA), 0xCD, EXTRA) };
    drop(load_with(&path, eb as *const _));

    let size = size_of::<strata_sampling_params>() + EXTRA;
    let mut sbuf = vec![0u64; size.div_ceil(8)];
    let sb = sbuf.as_mut_ptr() as *mut u8;
    let want = sampling(0.7, 5);
    unsafe {
        ptr::write_bytes(sb, 0xCD, size);
        ptr::copy_nonoverlapping(&want as *const _ as *const u8, sb, size_of::<strata_sampling_params>());
        (*(sb as *mut strata_sampling_params)).struct_size = size as u32;
    }
    let got = generate(&e, &PROMPT, 6, Some(unsafe { &*(sb as *const strata_sampling_params) }));
    assert_eq!(got, generate(&e, &PROMPT, 6, Some(&want)));
}

#[test]
fn bad_struct_sizes_and_field_values_are_invalid_arguments() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let mut p = session_params();
    let mut out = ptr::null_mut();
    for bad in [0u32, 3, 64 * 1024 + 1, u32::MAX] {
        p.struct_size = bad;
        let st = unsafe { strata_session_open(e.0, &p, &mut out) };
        expect_err(st, STRATA_ERR_INVALID_ARGUMENT, &format!("struct_size is {bad}"));
        assert!(out.is_null());
        let st = unsafe { strata_session_default_params(&mut p, bad) };
        expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "struct_size");
    }
    // A C bool that is neither 0 nor 1, an enum value out of range.
    let mut p = session_params();
    unsafe { *(ptr::addr_of_mut!(p.keep_all_logits) as *mut u8) = 2 };
    let st = unsafe { strata_session_open(e.0, &p, &mut out) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "keep_all_logits is 2");
    let mut p = session_params();
    unsafe { *(ptr::addr_of_mut!(p.kv_type) as *mut u32) = 7 };
    let st = unsafe { strata_session_open(e.0, &p, &mut out) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "kv_type is 7");
    let mut p = session_params();
    // Every KV type opens on the cpu (bf16 and int8 are emulated there).
    for kv in [strata_kv_type::STRATA_KV_F32, strata_kv_type::STRATA_KV_BF16, strata_kv_type::STRATA_KV_INT8] {
        p.kv_type = kv;
        ok(unsafe { strata_session_open(e.0, &p, &mut out) });
        unsafe { strata_session_free(out) };
    }
    // Sampling values are checked before anything changes.
    let s = open(&e);
    prefill(&s, &PROMPT);
    let mut t = 0;
    let mut bad = sampling(0.5, 1);
    bad.top_k = -3;
    expect_err(unsafe { strata_session_step(s.0, &bad, &mut t) }, STRATA_ERR_INVALID_ARGUMENT, "top_k -3");
    bad = sampling(-1.0, 1);
    expect_err(unsafe { strata_session_step(s.0, &bad, &mut t) }, STRATA_ERR_INVALID_ARGUMENT, "temperature -1");
    assert_eq!(position(&s), PROMPT.len());
    // Log levels are checked too.
    let st = unsafe { strata_set_log_callback(None, ptr::null_mut(), LogLevelCode(4)) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "max_level 4");
}

#[test]
fn paths_and_devices_are_checked() {
    let (_d, path) = make_pack(&tiny_config());
    let mut out = ptr::null_mut();
    let bad = b"/tmp/strata-\xff\xfe-pack\0";
    let st = unsafe { strata_engine_load(bad.as_ptr() as *const c_char, ptr::null(), &mut out) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "pack_path is not valid UTF-8 (invalid byte at offset 12)");
    assert!(out.is_null());

    let missing = c_path(&path.join("nope"));
    expect_err(unsafe { strata_engine_load(missing.as_ptr(), ptr::null(), &mut out) }, STRATA_ERR_IO, "nope");
    let not_a_pack = c_path(path.parent().unwrap());
    let st = unsafe { strata_engine_load(not_a_pack.as_ptr(), ptr::null(), &mut out) };
    expect_err(st, STRATA_ERR_BAD_PACK, "manifest.json");

    let cpath = c_path(&path);
    let with_devices = |names: &[*const c_char]| {
        let mut p = engine_params();
        p.devices = names.as_ptr();
        let mut out = ptr::null_mut();
        let st = unsafe { strata_engine_load(cpath.as_ptr(), &p, &mut out) };
        unsafe { strata_engine_free(out) };
        st
    };
    ok(with_devices(&[c"cpu".as_ptr(), ptr::null()]));
    ok(with_devices(&[ptr::null()]));
    // Without the feature: no CUDA support; with it and no device: the cause
    // (tests/no_device.rs). A machine with a device loads (tests/gpu.rs).
    #[cfg(feature = "cuda")]
    let device_here = strata::backend::cuda::device_count().is_ok();
    #[cfg(not(feature = "cuda"))]
    let device_here = false;
    if !device_here {
        let no_cuda_why = if cfg!(feature = "cuda") { "no CUDA device: " } else { "feature cuda" };
        expect_err(with_devices(&[c"cuda:0".as_ptr(), ptr::null()]), STRATA_ERR_NO_CUDA, no_cuda_why);
        expect_err(with_devices(&[c"cuda".as_ptr(), ptr::null()]), STRATA_ERR_NO_CUDA, "CUDA");
    }
    expect_err(with_devices(&[c"tpu".as_ptr(), ptr::null()]), STRATA_ERR_INVALID_ARGUMENT, "\"tpu\"");
    expect_err(with_devices(&[c"cuda:x".as_ptr(), ptr::null()]), STRATA_ERR_INVALID_ARGUMENT, "cuda:x");
    let bad_name = b"cp\xffu\0";
    expect_err(
        with_devices(&[bad_name.as_ptr() as *const c_char, ptr::null()]),
        STRATA_ERR_INVALID_ARGUMENT,
        "devices[0] is not valid UTF-8",
    );
    let unterminated = vec![c"cpu".as_ptr(); 65];
    expect_err(with_devices(&unterminated), STRATA_ERR_INVALID_ARGUMENT, "NULL terminator");
    let mut p = engine_params();
    p.n_threads = 1_000_000;
    expect_err(unsafe { strata_engine_load(cpath.as_ptr(), &p, &mut out) }, STRATA_ERR_INVALID_ARGUMENT, "n_threads");
}

/// Two CPU devices through the C API: an explicit split point and help
/// forced on give the one-device logits bit for bit; a NULL split with a
/// count, a split point out of range and an unknown help value are refused.
#[test]
fn layer_split_through_the_c_api() {
    let c = tiny_config();
    let (_d, path) = make_pack(&c);
    let one = load(&path);
    let devices = [c"cpu".as_ptr(), c"cpu".as_ptr(), ptr::null()];
    let split = [1u32];
    let mut p = engine_params();
    p.devices = devices.as_ptr();
    p.layer_split = split.as_ptr();
    p.n_layer_split = 1;
    p.prefill_help = strata_prefill_help::STRATA_PREFILL_HELP_ON;
    let two = load_with(&path, &p);
    let (s1, s2) = (open(&one), open(&two));
    let prompt = [5, 17, 90, 3, 44, 8];
    prefill(&s1, &prompt);
    prefill(&s2, &prompt);
    let (a, b) = (logits(&s1, -1), logits(&s2, -1));
    assert!(a.iter().all(|v| v.is_finite()));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "split logits differ");
    let cpath = c_path(&path);
    let try_load = |p: &strata_engine_params| {
        let mut out = ptr::null_mut();
        let st = unsafe { strata_engine_load(cpath.as_ptr(), p, &mut out) };
        unsafe { strata_engine_free(out) };
        st
    };
    let mut bad = p;
    bad.layer_split = ptr::null();
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "layer_split is NULL");
    let past = [c.num_hidden_layers as u32];
    let mut bad = p;
    bad.layer_split = past.as_ptr();
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "split");
    let mut bad = p;
    // SAFETY: an out-of-range enum value is what the check must catch; it is only read as an int.
    unsafe { *(std::ptr::addr_of_mut!(bad.prefill_help) as *mut u32) = 3 };
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "prefill_help");
    // The split from memory budgets instead: the same logits; budgets too
    // small, a NULL list with a count, or both ways at once are refused.
    let budgets = [1u64 << 30, 1 << 30];
    let mut by_budget = p;
    by_budget.layer_split = ptr::null();
    by_budget.n_layer_split = 0;
    by_budget.stage_memory_bytes = budgets.as_ptr();
    by_budget.n_stage_memory = 2;
    let three = load_with(&path, &by_budget);
    let s3 = open(&three);
    prefill(&s3, &prompt);
    assert!(logits(&s3, -1).iter().zip(&a).all(|(x, y)| x.to_bits() == y.to_bits()), "budget split logits differ");
    let tiny = [1u64, 1];
    let mut bad = by_budget;
    bad.stage_memory_bytes = tiny.as_ptr();
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "memory budgets");
    let mut bad = by_budget;
    bad.stage_memory_bytes = ptr::null();
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "stage_memory_bytes is NULL");
    let mut bad = by_budget;
    bad.layer_split = split.as_ptr();
    bad.n_layer_split = 1;
    expect_err(try_load(&bad), STRATA_ERR_INVALID_ARGUMENT, "not both");
}

#[test]
fn bad_tokens_change_nothing() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let mut p = session_params();
    p.context_size = 16;
    let s = open_with(&e, &p);
    let mut t = 0;
    expect_err(unsafe { strata_session_step(s.0, ptr::null(), &mut t) }, STRATA_ERR_INVALID_ARGUMENT, "prefill");
    prefill(&s, &[1, 2, 3]);
    let before = (position(&s), logits(&s, -1), save_state(&s));
    let same = |s: &SessionHandle| (position(s), logits(s, -1), save_state(s));

    let st = unsafe { strata_session_prefill(s.0, [4, 256, 5].as_ptr(), 3) };
    expect_err(st, STRATA_ERR_TOKEN_OUT_OF_RANGE, "token 256 at index 1");
    assert_eq!(same(&s), before);
    let st = unsafe { strata_session_prefill(s.0, [4, 5, -7].as_ptr(), 3) };
    expect_err(st, STRATA_ERR_TOKEN_OUT_OF_RANGE, "token -7 at index 2");
    assert_eq!(same(&s), before);
    let st = unsafe { strata_session_prefill(s.0, [0; 14].as_ptr(), 14) };
    expect_err(st, STRATA_ERR_CONTEXT_OVERFLOW, "17 tokens needed");
    assert_eq!(same(&s), before);
    let st = unsafe { strata_session_prefill(s.0, [1].as_ptr(), 0) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "empty prompt");
    let st = unsafe { strata_session_rewind_to(s.0, 4) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "holds only 3");
    expect_err(unsafe { strata_session_rewind(s.0, 77) }, STRATA_ERR_NOT_FOUND, "checkpoint 77");
    assert_eq!(same(&s), before);
    let mut n = 0;
    let mut text = [0 as c_char; 8];
    let st = unsafe { strata_detokenize(e.0, [-5].as_ptr(), 1, text.as_mut_ptr(), 8, &mut n) };
    expect_err(st, STRATA_ERR_TOKEN_OUT_OF_RANGE, "-5");
    // The session still works.
    prefill(&s, &[7]);
    assert_eq!(position(&s), 4);
}

#[cfg(feature = "test-hooks")]
#[test]
fn a_panic_becomes_internal_with_its_message() {
    assert_eq!(strata_test_force_panic(), STRATA_ERR_INTERNAL);
    let msg = last_error();
    assert!(
        msg.contains("strata_test_force_panic") && msg.contains("forced panic from strata_test_force_panic"),
        "{msg}"
    );
    // A panic while a session is locked leaves it unusable, and says so.
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    assert_eq!(unsafe { strata_test_panic_in_session(s.0) }, STRATA_ERR_INTERNAL);
    assert!(last_error().contains("forced panic while holding the session"));
    let mut n = 0;
    expect_err(unsafe { strata_session_position(s.0, &mut n) }, STRATA_ERR_INTERNAL, "free it");
}

#[cfg(feature = "test-hooks")]
#[test]
fn a_second_thread_on_a_busy_session_gets_busy() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = Arc::new(open(&e));
    prefill(&s, &PROMPT);
    let before = (position(&s), logits(&s, -1));
    let holder = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || unsafe { strata_test_hold_session(s.0, 400) })
    };
    // Poll (without changing anything) until the holder has the lock.
    let start = std::time::Instant::now();
    let mut n = 0;
    loop {
        let st = unsafe { strata_session_position(s.0, &mut n) };
        if st == STRATA_ERR_BUSY {
            break;
        }
        ok(st);
        assert!(start.elapsed().as_secs() < 5, "the holder never took the lock");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(last_error().contains("in use by another"), "{}", last_error());
    let st = unsafe { strata_session_prefill(s.0, [1, 2].as_ptr(), 2) };
    expect_err(st, STRATA_ERR_BUSY, "in use");
    let mut t = 0;
    expect_err(unsafe { strata_session_step(s.0, ptr::null(), &mut t) }, STRATA_ERR_BUSY, "in use");
    ok(holder.join().unwrap());
    assert_eq!((position(&s), logits(&s, -1)), before);
}

#[test]
fn threads_with_their_own_sessions_match_one_thread() {
    let (_d, path) = make_pack(&tiny_config());
    let e = Arc::new(load(&path));
    let prompts: Vec<Vec<i32>> = vec![PROMPT.to_vec(), vec![5, 6, 7, 200, 11]];
    let params = sampling(0.8, 21);
    let serial: Vec<Vec<i32>> = prompts.iter().map(|p| generate(&e, p, 10, Some(&params))).collect();
    let barrier = Arc::new(Barrier::new(prompts.len()));
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let (e, barrier) = (Arc::clone(&e), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                generate(&e, &p, 10, Some(&sampling(0.8, 21)))
            })
        })
        .collect();
    let parallel: Vec<Vec<i32>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(parallel, serial);
    assert_ne!(serial[0], serial[1]);
}

#[test]
fn checkpoint_and_rewind_equal_fresh_sessions_bit_for_bit() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    prefill(&s, &PROMPT);
    let after_prompt = logits(&s, -1);
    let cp = checkpoint(&s);
    let run =
        |s: &SessionHandle| -> (Vec<i32>, Vec<Vec<f32>>) { (0..5).map(|_| (step(s, None), logits(s, -1))).unzip() };
    let (toks, steps) = run(&s);
    let cp_end = checkpoint(&s);
    ok(unsafe { strata_session_rewind(s.0, cp) });
    assert_eq!((position(&s), logits(&s, -1)), (PROMPT.len(), after_prompt.clone()));
    assert_eq!(run(&s), (toks.clone(), steps.clone()), "continuing after a rewind");
    // A fresh session fed the same tokens gives the same logits.
    let fresh = open(&e);
    prefill(&fresh, &PROMPT);
    assert_eq!(run(&fresh), (toks.clone(), steps.clone()));

    // The rewind dropped positions past `cp`, so `cp_end` is gone; `cp` stays.
    expect_err(unsafe { strata_session_rewind(s.0, cp_end) }, STRATA_ERR_NOT_FOUND, "invalidated");
    let cp15 = checkpoint(&s);
    // rewind_to a position no checkpoint holds: the logits are recomputed,
    // and equal those of a fresh session that prefilled those tokens.
    ok(unsafe { strata_session_rewind_to(s.0, 12) });
    assert_eq!(position(&s), 12);
    let mut first12 = PROMPT.to_vec();
    first12.extend(&toks[..2]);
    let f12 = open(&e);
    prefill(&f12, &first12);
    assert_eq!(logits(&s, -1), logits(&f12, -1));
    assert_eq!(logits(&s, -1), steps[1]);
    expect_err(unsafe { strata_session_rewind(s.0, cp15) }, STRATA_ERR_NOT_FOUND, "checkpoint");
    // A different continuation, then back to `cp` again.
    let other = step(&s, Some(&sampling(1.5, 3)));
    assert_eq!(position(&s), 13);
    assert_eq!(logits(&s, -1), {
        prefill(&f12, &[other]);
        logits(&f12, -1)
    });
    ok(unsafe { strata_session_rewind(s.0, cp) });
    assert_eq!(logits(&s, -1), after_prompt);
    // rewind_to the checkpoint's position takes its logits.
    ok(unsafe { strata_session_rewind_to(s.0, PROMPT.len()) });
    assert_eq!(logits(&s, -1), after_prompt);
    // Release frees it; the id is never valid again.
    ok(unsafe { strata_session_checkpoint_release(s.0, cp) });
    expect_err(unsafe { strata_session_rewind(s.0, cp) }, STRATA_ERR_NOT_FOUND, "released");
    expect_err(unsafe { strata_session_checkpoint_release(s.0, cp) }, STRATA_ERR_NOT_FOUND, "checkpoint");
    // rewind_to 0 empties the session.
    ok(unsafe { strata_session_rewind_to(s.0, 0) });
    assert_eq!(position(&s), 0);
    let mut t = 0;
    expect_err(unsafe { strata_session_step(s.0, ptr::null(), &mut t) }, STRATA_ERR_INVALID_ARGUMENT, "prefill");
}

#[test]
fn keep_all_logits_and_negative_indexing() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let mut p = session_params();
    p.keep_all_logits = true;
    let s = open_with(&e, &p);
    prefill(&s, &PROMPT[..4]);
    prefill(&s, &PROMPT[4..]);
    let n = PROMPT.len() as i64;
    // Rows of the last prefill are position 4.. and equal fresh prefixes.
    for pos in 4..n {
        let f = open(&e);
        prefill(&f, &PROMPT[..pos as usize + 1]);
        assert_eq!(logits(&s, pos), logits(&f, -1), "position {pos}");
        assert_eq!(logits(&s, pos), logits(&s, pos - n));
    }
    let mut buf = [0f32; VOCAB];
    let mut got = 0;
    for bad in [3, -7, n, -n - 1, i64::MIN, i64::MAX] {
        let st = unsafe { strata_session_logits(s.0, bad, buf.as_mut_ptr(), VOCAB, &mut got) };
        assert_eq!(st, STRATA_ERR_INVALID_ARGUMENT, "index {bad}");
    }
    // rewind_to inside the kept rows uses them: equal to the fresh prefix.
    ok(unsafe { strata_session_rewind_to(s.0, 6) });
    let f = open(&e);
    prefill(&f, &PROMPT[..6]);
    assert_eq!(logits(&s, -1), logits(&f, -1));
    assert_eq!(step(&s, None), step(&f, None));
    assert_eq!(logits(&s, -1), logits(&f, -1));
}

#[test]
fn saved_state_continues_identically_in_a_new_session() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    prefill(&s, &PROMPT);
    let params = sampling(0.9, 7);
    for _ in 0..3 {
        step(&s, Some(&params));
    }
    // Size query: a NULL buffer of length 0 reports the size needed.
    let mut needed = 0;
    let st = unsafe { strata_session_state_save(s.0, ptr::null_mut(), 0, &mut needed) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, &needed.to_string());
    let state = save_state(&s);
    assert_eq!(state.len(), needed);
    let cont: Vec<i32> = (0..6).map(|_| step(&s, Some(&params))).collect();

    let s2 = open(&e);
    prefill(&s2, &[9, 9]);
    let cp = checkpoint(&s2);
    ok(unsafe { strata_session_state_load(s2.0, state.as_ptr(), state.len()) });
    assert_eq!(position(&s2), PROMPT.len() + 3);
    let cont2: Vec<i32> = (0..6).map(|_| step(&s2, Some(&params))).collect();
    assert_eq!(cont2, cont, "the seeded stream continues where it was saved");
    assert_eq!(logits(&s2, -1), logits(&s, -1));
    expect_err(unsafe { strata_session_rewind(s2.0, cp) }, STRATA_ERR_NOT_FOUND, "checkpoint");

    // Bad states are refused and change nothing.
    let s3 = open(&e);
    prefill(&s3, &[1, 2, 3]);
    let before = save_state(&s3);
    let load_err = |bytes: &[u8], want: strata_status, needle: &str| {
        let st = unsafe { strata_session_state_load(s3.0, bytes.as_ptr(), bytes.len()) };
        expect_err(st, want, needle);
        assert_eq!(save_state(&s3), before);
    };
    let mut corrupt = state.clone();
    corrupt[100] ^= 1;
    load_err(&corrupt, STRATA_ERR_INVALID_ARGUMENT, "checksum");
    load_err(&state[..state.len() - 1], STRATA_ERR_INVALID_ARGUMENT, "truncated");
    load_err(&state[..10], STRATA_ERR_INVALID_ARGUMENT, "shorter");
    load_err(b"not a state at all, just some bytes of text here.", STRATA_ERR_INVALID_ARGUMENT, "magic");
    let mut v2 = state.clone();
    v2[8] = 2;
    load_err(&v2, STRATA_ERR_INVALID_ARGUMENT, "version 2");
    // From another model (vocab 128): refused by its fingerprint.
    let (_d2, other_path) = make_pack(&ModelConfig { vocab_size: 128, ..tiny_config() });
    let other = load(&other_path);
    let so = open(&other);
    prefill(&so, &[1, 2, 3]);
    load_err(&save_state(&so), STRATA_ERR_INVALID_ARGUMENT, "another model");
    // Too many tokens for a session with a smaller context.
    let mut p = session_params();
    p.context_size = 8;
    let small = open_with(&e, &p);
    let st = unsafe { strata_session_state_load(small.0, state.as_ptr(), state.len()) };
    expect_err(st, STRATA_ERR_CONTEXT_OVERFLOW, "13 tokens needed");
    assert_eq!(position(&small), 0);
    // An empty session's state round-trips.
    let empty = open(&e);
    let bytes = save_state(&empty);
    ok(unsafe { strata_session_state_load(s3.0, bytes.as_ptr(), bytes.len()) });
    assert_eq!(position(&s3), 0);
}

#[test]
fn buffer_too_small_reports_the_size_needed() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    prefill(&s, &PROMPT);
    let mut buf = [0f32; 10];
    let mut n = 0;
    let st = unsafe { strata_session_logits(s.0, -1, buf.as_mut_ptr(), buf.len(), &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, "256");
    assert_eq!(n, VOCAB);
    assert!(buf.iter().all(|&x| x == 0.0), "nothing written");
    let st = unsafe { strata_session_logits(s.0, -1, ptr::null_mut(), 0, &mut n) };
    assert_eq!((st, n), (STRATA_ERR_BUFFER_TOO_SMALL, VOCAB));
    let mut size = 0;
    ok(unsafe { strata_session_state_size(s.0, &mut size) });
    let mut small = vec![0u8; size - 1];
    let st = unsafe { strata_session_state_save(s.0, small.as_mut_ptr(), small.len(), &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, &size.to_string());
    assert_eq!(n, size);
    assert!(small.iter().all(|&b| b == 0));
}

#[test]
fn tokenizer_round_trip_and_buffer_sizes() {
    let d = tempfile::tempdir().unwrap();
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures/a/bf16");
    let path = d.path().join("pack");
    strata::pack::convert::convert(&from, &path, &Default::default()).unwrap();
    let e = load(&path);
    let mut info = MaybeUninit::<strata_model_info>::zeroed();
    unsafe { (*info.as_mut_ptr()).struct_size = size_of::<strata_model_info>() as u32 };
    ok(unsafe { strata_engine_info(e.0, info.as_mut_ptr()) });
    let info = unsafe { info.assume_init() };
    assert!(info.has_tokenizer);

    let text = "The river carried";
    let mut n = 0;
    let st = unsafe { strata_tokenize(e.0, text.as_ptr() as *const c_char, text.len(), ptr::null_mut(), 0, &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, "tokens");
    let mut ids = vec![0i32; n];
    ok(unsafe { strata_tokenize(e.0, text.as_ptr() as *const c_char, text.len(), ids.as_mut_ptr(), n, &mut n) });
    let tok = strata::tokenizer::Tokenizer::from_file(&path.join("tokenizer.json")).unwrap();
    let want: Vec<i32> = tok.encode(text).unwrap().iter().map(|&t| t as i32).collect();
    assert_eq!(ids, want);

    let decoded = tok.decode(&want.iter().map(|&t| t as u32).collect::<Vec<_>>()).unwrap();
    let st = unsafe { strata_detokenize(e.0, ids.as_ptr(), ids.len(), ptr::null_mut(), 0, &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, "NUL");
    assert_eq!(n, decoded.len() + 1, "the size needed includes the NUL");
    let mut buf = vec![0x55 as c_char; n];
    let mut len = 0;
    ok(unsafe { strata_detokenize(e.0, ids.as_ptr(), ids.len(), buf.as_mut_ptr(), n, &mut len) });
    assert_eq!(len, decoded.len());
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), decoded);

    // Text must be UTF-8; empty text is zero tokens.
    let bad = b"ab\xffc";
    let st = unsafe { strata_tokenize(e.0, bad.as_ptr() as *const c_char, 4, ids.as_mut_ptr(), ids.len(), &mut n) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "text is not valid UTF-8 (invalid byte at offset 2)");
    ok(unsafe { strata_tokenize(e.0, ptr::null(), 0, ptr::null_mut(), 0, &mut n) });
    assert_eq!(n, 0);

    // A pack without a tokenizer says so.
    let (_d2, synth_path) = make_pack(&tiny_config());
    let plain = load(&synth_path);
    let st = unsafe { strata_tokenize(plain.0, c"hi".as_ptr(), 2, ids.as_mut_ptr(), ids.len(), &mut n) };
    expect_err(st, STRATA_ERR_TOKENIZER, "no tokenizer.json");
}

#[test]
fn every_status_has_a_message() {
    let mut seen = std::collections::HashSet::new();
    for code in 0..16 {
        let m = unsafe { CStr::from_ptr(strata_status_message(StatusCode(code))) }.to_str().unwrap();
        assert!(!m.is_empty() && m != "unknown status", "status {code}");
        assert!(seen.insert(m), "status {code} repeats {m:?}");
    }
    assert_eq!(unsafe { CStr::from_ptr(strata_status_message(StatusCode(0))) }.to_str().unwrap(), "ok");
    for code in [16, 999, u32::MAX] {
        let m = unsafe { CStr::from_ptr(strata_status_message(StatusCode(code))) };
        assert_eq!(m.to_str().unwrap(), "unknown status");
    }
    assert_eq!(strata_abi_version(), 1);
    let v = unsafe { CStr::from_ptr(strata_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
}

#[test]
fn the_api_table_works_and_refuses_newer_abi_versions() {
    let mut api: *const strata_api = ptr::null();
    ok(unsafe { strata_get_api(STRATA_ABI_VERSION, &mut api) });
    let api = unsafe { &*api };
    assert_eq!((api.struct_size as usize, api.abi_version), (size_of::<strata_api>(), 1));
    unsafe {
        assert_eq!((api.abi_version_fn)(), 1);
        assert_eq!((api.version)(), strata_version());
        let (_d, path) = make_pack(&tiny_config());
        let cpath = c_path(&path);
        let mut e = ptr::null_mut();
        assert_eq!((api.engine_load)(cpath.as_ptr(), ptr::null(), &mut e), STRATA_OK);
        let mut s = ptr::null_mut();
        assert_eq!((api.session_open)(e, ptr::null(), &mut s), STRATA_OK);
        assert_eq!((api.session_prefill)(s, PROMPT.as_ptr(), PROMPT.len()), STRATA_OK);
        let mut t = -1;
        assert_eq!((api.session_step)(s, ptr::null(), &mut t), STRATA_OK);
        let direct = {
            let e2 = load(&path);
            generate(&e2, &PROMPT, 1, None)
        };
        assert_eq!(vec![t], direct);
        let mut n = 1;
        assert_eq!((api.engine_eos_tokens)(e, ptr::null_mut(), 0, &mut n), STRATA_OK);
        assert_eq!(n, 0, "a synthetic pack names no end-of-generation token");
        assert_eq!((api.session_rewind)(s, 12345), STRATA_ERR_NOT_FOUND);
        assert!(CStr::from_ptr((api.last_error)()).to_str().unwrap().contains("12345"));
        (api.session_free)(s);
        (api.engine_free)(e);
    }
    // Not NULL before the call, so that the test sees it set to NULL.
    let mut out: *const strata_api = ptr::NonNull::dangling().as_ptr();
    expect_err(unsafe { strata_get_api(2, &mut out) }, STRATA_ERR_UNSUPPORTED, "abi_version 2");
    assert!(out.is_null());
    expect_err(unsafe { strata_get_api(0, &mut out) }, STRATA_ERR_INVALID_ARGUMENT, "abi_version 0");
}

#[test]
fn c_steps_with_a_seed_equal_the_rust_sampler_loop() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let mut p = sampling(0.8, 1234);
    p.top_k = 40;
    p.top_p = 0.95;
    p.min_p = 0.02;
    let c_tokens = generate(&e, &PROMPT, 16, Some(&p));

    // What `strata generate --temperature 0.8 --top-k 40 ... --seed 1234` runs.
    let engine = Engine::load(&path, &EngineOptions::default()).unwrap();
    let mut session = engine.new_session(&SessionOptions::default()).unwrap();
    let prompt: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();
    session.prefill(&prompt).unwrap();
    let mut sampler =
        Sampler::new(SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.02, seed: 1234 }).unwrap();
    let rust_tokens: Vec<i32> = (0..16).map(|_| session.step(&mut sampler).unwrap() as i32).collect();
    assert_eq!(c_tokens, rust_tokens);
    // Not vacuous: another seed, or greedy, differ.
    p.seed = 1235;
    assert_ne!(generate(&e, &PROMPT, 16, Some(&p)), c_tokens);
    assert_ne!(generate(&e, &PROMPT, 16, None), c_tokens);
}

#[test]
fn load_progress_is_reported_and_can_cancel() {
    let (_d, path) = make_pack(&tiny_config());
    struct Record {
        seen: Mutex<Vec<f32>>,
        cancel_above: f32,
        thread: std::thread::ThreadId,
    }
    unsafe extern "C" fn record(user_data: *mut c_void, fraction: f32) -> bool {
        let r = &*(user_data as *const Record);
        assert_eq!(std::thread::current().id(), r.thread, "progress runs on the loading thread");
        r.seen.lock().unwrap().push(fraction);
        fraction <= r.cancel_above
    }
    let run = |verify: bool, cancel_above: f32| {
        let r = Record { seen: Mutex::new(Vec::new()), cancel_above, thread: std::thread::current().id() };
        let mut p = engine_params();
        p.verify_checksums = verify;
        p.progress = Some(record);
        p.progress_user_data = &r as *const Record as *mut c_void;
        let mut out = ptr::null_mut();
        let st = unsafe { strata_engine_load(c_path(&path).as_ptr(), &p, &mut out) };
        unsafe { strata_engine_free(out) };
        (st, out.is_null(), r.seen.into_inner().unwrap())
    };
    let (st, _, seen) = run(true, 2.0);
    ok(st);
    assert_eq!((seen.first(), seen.last()), (Some(&0.0), Some(&1.0)));
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert!(seen.iter().any(|&f| f > 0.05 && f < 0.5), "verify reports progress: {seen:?}");
    assert!(seen.iter().any(|&f| f > 0.5 && f < 1.0), "decoding reports progress: {seen:?}");
    let (st, _, plain) = run(false, 2.0);
    ok(st);
    assert!(plain.iter().all(|&f| f == 0.0 || f >= 0.05), "{plain:?}");

    for cancel_above in [0.0, 0.3, 0.6, 0.99] {
        let (st, null, seen) = run(true, cancel_above);
        expect_err(st, STRATA_ERR_CANCELLED, "cancelled");
        assert!(null, "a cancelled load returns no engine");
        assert!(*seen.last().unwrap() > cancel_above && seen[..seen.len() - 1].iter().all(|&f| f <= cancel_above));
    }
}

#[test]
fn the_log_callback_hears_loads_and_failures() {
    // (level, message, strata_last_error() when the message came)
    type Log = Mutex<Vec<(strata_log_level, String, String)>>;
    unsafe extern "C" fn sink(user_data: *mut c_void, level: strata_log_level, message: *const c_char) {
        let log = &*(user_data as *const Log);
        let message = CStr::from_ptr(message).to_string_lossy().into_owned();
        log.lock().unwrap().push((level, message, last_error()));
        // A failing call from inside the callback does not recurse.
        let mut n = 0;
        strata_session_position(ptr::null_mut(), &mut n);
        // Nor can the callback replace itself.
        assert_eq!(strata_set_log_callback(None, ptr::null_mut(), LogLevelCode(0)), STRATA_ERR_BUSY);
    }
    let log: Log = Mutex::new(Vec::new());
    let user_data = &log as *const Log as *mut c_void;
    ok(unsafe { strata_set_log_callback(Some(sink), user_data, LogLevelCode(2)) });
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    let my_rewind = 987_654_321;
    let _ = unsafe { strata_session_rewind(s.0, my_rewind) };
    // The callback's own failing call does not replace this call's error.
    assert!(last_error().contains(&my_rewind.to_string()), "{}", last_error());
    let mut buf = [0f32; 1];
    let mut n = 0;
    prefill(&s, &PROMPT);
    let _ = unsafe { strata_session_logits(s.0, -1, buf.as_mut_ptr(), 1, &mut n) }; // DEBUG: not sent at INFO
    ok(unsafe { strata_set_log_callback(None, ptr::null_mut(), LogLevelCode(0)) });
    let log = log.into_inner().unwrap();
    let pack = path.display().to_string();
    assert!(
        log.iter()
            .any(|(l, m, _)| *l == strata_log_level::STRATA_LOG_INFO && m.contains("loaded pack") && m.contains(&pack)),
        "{log:?}"
    );
    // The callback heard the failure, and strata_last_error() was already
    // that failure's message when it did.
    assert!(log.iter().any(|(l, m, last)| *l == strata_log_level::STRATA_LOG_WARN
        && m.contains("strata_session_rewind")
        && m.contains(&my_rewind.to_string())
        && last == m));
    assert!(!log.iter().any(|(_, m, _)| m.contains("buf holds 1 floats")), "DEBUG messages were filtered");
    assert!(!log.iter().any(|(_, m, _)| m.contains("session is NULL")), "no recursion from inside the callback");
}

/// A failing call from a pthread key's destructor, which runs after the
/// thread's Rust thread-locals are gone (the last error among them),
/// returns its status: recording the error must not panic (a panic there
/// is outside the panic boundary, and would abort the host).
#[test]
fn a_failing_call_while_the_thread_exits_returns_its_status() {
    use std::sync::atomic::{AtomicI64, Ordering};
    static STATUS: AtomicI64 = AtomicI64::new(i64::MIN);
    static LAST: Mutex<Option<String>> = Mutex::new(None);
    // (A NULL engine: the log test, which may run meanwhile, expects no
    // "session is NULL" in its log.)
    unsafe extern "C" fn at_exit(_: *mut c_void) {
        let mut info = MaybeUninit::<strata_model_info>::uninit();
        STATUS.store(strata_engine_info(ptr::null(), info.as_mut_ptr()) as i64, Ordering::SeqCst);
        *LAST.lock().unwrap() = Some(last_error());
    }
    std::thread::spawn(|| unsafe {
        // A failure first, so that the thread's last error exists.
        let mut info = MaybeUninit::<strata_model_info>::uninit();
        expect_err(strata_engine_info(ptr::null(), info.as_mut_ptr()), STRATA_ERR_NULL_POINTER, "engine");
        let mut key: libc::pthread_key_t = 0;
        assert_eq!(libc::pthread_key_create(&mut key, Some(at_exit)), 0);
        assert_eq!(libc::pthread_setspecific(key, ptr::dangling::<c_void>()), 0);
    })
    .join()
    .unwrap();
    assert_eq!(STATUS.load(Ordering::SeqCst), STRATA_ERR_NULL_POINTER as i64);
    assert!(LAST.lock().unwrap().is_some(), "strata_last_error answered");
}

#[test]
fn sessions_keep_the_model_alive_after_the_engine_is_freed() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let want = generate(&e, &PROMPT, 4, None);
    let s = open(&e);
    drop(e);
    prefill(&s, &PROMPT);
    let got: Vec<i32> = (0..4).map(|_| step(&s, None)).collect();
    assert_eq!(got, want);
}

/// `strata_session_prefill_conversation` reuses the common prefix and
/// reports the counts; the checkpoint policy fields reach the session.
#[test]
fn prefill_conversation_reuses_the_prefix_and_reports_counts() {
    let (_d, path) = make_pack(&tiny_config());
    let e = load(&path);
    let s = open(&e);
    let conv = |s: &SessionHandle, tokens: &[i32]| {
        let (mut reused, mut read) = (usize::MAX, usize::MAX);
        ok(unsafe { strata_session_prefill_conversation(s.0, tokens.as_ptr(), tokens.len(), &mut reused, &mut read) });
        (reused, read)
    };
    assert_eq!(conv(&s, &PROMPT[..6]), (0, 6));
    assert_eq!(conv(&s, &PROMPT), (6, 4));
    let fresh = open(&e);
    prefill(&fresh, &PROMPT);
    assert_eq!(logits(&s, -1), logits(&fresh, -1));
    // A divergence at 8: KV truncates to 8 (qwen3_moe), 2 tokens read.
    let mut other = PROMPT;
    other[8] = 7;
    assert_eq!(conv(&s, &other), (8, 2));
    assert_eq!(position(&s), 10);
    // NULL counts are allowed; bad input changes nothing.
    ok(unsafe { strata_session_prefill_conversation(s.0, PROMPT.as_ptr(), 3, ptr::null_mut(), ptr::null_mut()) });
    assert_eq!(position(&s), 3);
    let before = save_state(&s);
    let bad = [1, 2, VOCAB as i32];
    let st = unsafe { strata_session_prefill_conversation(s.0, bad.as_ptr(), 3, ptr::null_mut(), ptr::null_mut()) };
    expect_err(st, STRATA_ERR_TOKEN_OUT_OF_RANGE, "index 2");
    let st = unsafe { strata_session_prefill_conversation(s.0, bad.as_ptr(), 0, ptr::null_mut(), ptr::null_mut()) };
    expect_err(st, STRATA_ERR_INVALID_ARGUMENT, "empty");
    let st = unsafe { strata_session_prefill_conversation(s.0, ptr::null(), 2, ptr::null_mut(), ptr::null_mut()) };
    expect_err(st, STRATA_ERR_NULL_POINTER, "tokens");
    assert_eq!(save_state(&s), before);
    // Through the plugin table too.
    let mut api: *const strata_api = ptr::null();
    ok(unsafe { strata_get_api(STRATA_ABI_VERSION, &mut api) });
    let (mut reused, mut read) = (0, 0);
    ok(unsafe { ((*api).session_prefill_conversation)(s.0, PROMPT.as_ptr(), PROMPT.len(), &mut reused, &mut read) });
    assert_eq!((reused, read), (3, 7));
}

/// checkpoint_every and checkpoint_budget reach a hybrid session: with a
/// mark every 4 tokens a 10-token prefill takes checkpoints at 4, 8 and 10
/// (the end), and rewinding to and between them is exact.
#[test]
fn checkpoint_policy_params_reach_the_session() {
    let cfg = synth::preset(Arch::Qwen3Next, "tiny").unwrap();
    let (_d, path) = make_pack(&cfg);
    let e = load(&path);
    let logits = |s: &SessionHandle, index: i64| {
        let mut buf = vec![0.0f32; cfg.vocab_size];
        let mut n = 0;
        ok(unsafe { strata_session_logits(s.0, index, buf.as_mut_ptr(), buf.len(), &mut n) });
        buf
    };
    let mut p = session_params();
    assert_eq!((p.checkpoint_every, p.checkpoint_budget), (0, 0));
    p.checkpoint_every = 4;
    let s = open_with(&e, &p);
    prefill(&s, &PROMPT);
    // Automatic checkpoints take the ids before the next explicit one's
    // (positions 4, 8, 10: ids mine - 3, mine - 2, mine - 1).
    let mut mine = 0;
    ok(unsafe { strata_session_checkpoint(s.0, &mut mine) });
    ok(unsafe { strata_session_checkpoint_release(s.0, mine) });
    ok(unsafe { strata_session_rewind_to(s.0, 9) });
    let fresh = open_with(&e, &p);
    prefill(&fresh, &PROMPT[..9]);
    assert_eq!(logits(&s, -1), logits(&fresh, -1));
    ok(unsafe { strata_session_rewind(s.0, mine - 3) });
    assert_eq!(position(&s), 4);
    let fresh = open_with(&e, &p);
    prefill(&fresh, &PROMPT[..4]);
    assert_eq!(logits(&s, -1), logits(&fresh, -1));
    // A budget of one byte keeps no automatic checkpoint.
    p.checkpoint_budget = 1;
    let tight = open_with(&e, &p);
    prefill(&tight, &PROMPT);
    ok(unsafe { strata_session_checkpoint(tight.0, &mut mine) });
    expect_err(unsafe { strata_session_rewind(tight.0, mine - 3) }, STRATA_ERR_NOT_FOUND, "is unknown");
}

#[test]
fn end_of_generation_tokens_and_buffer_sizes() {
    let (_d, path) = make_pack(&tiny_config());
    let manifest = path.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    v["eos_token_ids"] = serde_json::json!([9, 5]);
    std::fs::write(&manifest, v.to_string()).unwrap();
    let e = load(&path);
    let mut n = 0;
    let st = unsafe { strata_engine_eos_tokens(e.0, ptr::null_mut(), 0, &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, "2 end-of-generation tokens, tokens holds 0");
    assert_eq!(n, 2);
    // Too small a buffer is left as it was.
    let mut ids = [-1i32; 3];
    let st = unsafe { strata_engine_eos_tokens(e.0, ids.as_mut_ptr(), 1, &mut n) };
    expect_err(st, STRATA_ERR_BUFFER_TOO_SMALL, "tokens holds 1");
    assert_eq!((n, ids), (2, [-1, -1, -1]));
    ok(unsafe { strata_engine_eos_tokens(e.0, ids.as_mut_ptr(), 3, &mut n) });
    assert_eq!((n, ids), (2, [9, 5, -1]));

    // An id outside the vocabulary fails the load, naming it.
    v["eos_token_ids"] = serde_json::json!([5, VOCAB]);
    std::fs::write(&manifest, v.to_string()).unwrap();
    let cpath = c_path(&path);
    let mut out = ptr::null_mut();
    let st = unsafe { strata_engine_load(cpath.as_ptr(), ptr::null(), &mut out) };
    expect_err(st, STRATA_ERR_BAD_PACK, &format!("end-of-generation token {VOCAB} is outside the vocabulary"));
    assert!(out.is_null());
}
