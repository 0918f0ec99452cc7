//! GPU tests of kernels/attention.cu against the CPU reference.
//!
//! The attention kernels are compared with `cpu::ops::attention` run on the
//! cache's own dequantized contents (`kv_read_f32`), so the only differences
//! are f32 summation order and the online softmax's rescaling: the tolerance
//! is tight. The int8 quantization error itself is bounded separately.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use strata::backend::cpu::ops;
use strata::backend::cuda::attention::{
    attention, attention_at, attention_with, attention_with_scratch, kv_append, kv_append_at, kv_read_f32, qkv_prepare,
    qkv_prepare_at, step_chunk, step_plan, step_plan_with, AttnConfig, AttnKernel, AttnPrecision, AttnScratch,
    DeviceKv, KvDtype, QkvPrep, StepPlan, StepPos,
};
use strata::backend::cuda::dense::{self, RopeTable};
use strata::backend::cuda::{CudaSlice, Gpu, LaunchConfig};
use strata::backend::{AttentionShape, Rope};

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("attention_kv_append_int8_exact", kv_append_int8_exact),
    ("attention_kv_append_bf16_exact", kv_append_bf16_exact),
    ("attention_decode_int8", decode_int8),
    ("attention_decode_bf16", decode_bf16),
    ("attention_prefill_int8", prefill_int8),
    ("attention_prefill_bf16", prefill_bf16),
    ("attention_simt_int8", simt_int8),
    ("attention_simt_bf16", simt_bf16),
    ("attention_dec_kernel_int8", dec_kernel_int8),
    ("attention_dec_kernel_bf16", dec_kernel_bf16),
    ("attention_mma_decode_int8", mma_decode_int8),
    ("attention_mma_decode_bf16", mma_decode_bf16),
    ("attention_mma_bf16_operands", mma_bf16_operands),
    ("attention_int8_error_vs_f32", int8_error_vs_f32),
    ("attention_deterministic", deterministic),
    ("attention_rejects_bad_arguments", rejects_bad_arguments),
    ("attention_small_head_dims_int8", small_head_dims_int8),
    ("attention_small_head_dims_bf16", small_head_dims_bf16),
    ("attention_scratch_reuse", scratch_reuse),
    ("attention_step_pointer_int8", step_pointer_int8),
    ("attention_step_pointer_bf16", step_pointer_bf16),
    ("attention_step_graph_replay", step_graph_replay),
    ("attention_timing", timing),
    ("attention_row_int8", row_int8),
    ("attention_row_bf16", row_bf16),
    ("attention_row_auto_picks_row", row_auto_picks_row),
    ("attention_row_prewait_same_bits", row_prewait_same_bits),
    ("attention_row_scratch_counters_reset", row_counters_reset),
    ("attention_row_step_pointer_int8", row_step_pointer_int8),
    ("attention_row_step_pointer_bf16", row_step_pointer_bf16),
    ("attention_row_rejects_bad_arguments", row_rejects_bad_arguments),
    ("attention_row_clusters_int8", row_clusters_int8),
    ("attention_row_clusters_bf16", row_clusters_bf16),
    ("attention_row_clusters_step_pointer", row_clusters_step_pointer),
    ("attention_row_clusters_counters_reset", row_clusters_counters_reset),
    ("attention_qkv_prepare_int8_exact", qkv_prepare_int8_exact),
    ("attention_qkv_prepare_bf16_exact", qkv_prepare_bf16_exact),
    ("attention_qkv_prepare_rejects_bad_arguments", qkv_prepare_rejects_bad_arguments),
    ("attention_row_timing", row_timing),
];

/// Shapes (heads, kv_heads, head_dim): Qwen3-30B-A3B, Qwen3-Next, a small
/// MHA one, and an odd group count.
const SHAPES: [(usize, usize, usize); 4] = [(32, 4, 128), (16, 2, 256), (4, 4, 64), (12, 3, 64)];

/// The tiny fixture models' shapes: head_dim 32 and 16 (SIMT kernels only;
/// `Auto` picks SIMT for them).
const SMALL_SHAPES: [(usize, usize, usize); 3] = [(4, 2, 32), (6, 1, 16), (6, 2, 16)];

fn shape_of((heads, kv_heads, head_dim): (usize, usize, usize)) -> AttentionShape {
    AttentionShape { heads, kv_heads, head_dim }
}

/// A fresh cache of `capacity` positions whose positions `0..len` hold random
/// K/V (scale `kv_scale`), appended in two calls (a prefix, then the rest)
/// the way the engine appends. Returns the cache and the f32 rows appended.
fn filled_cache(
    gpu: &Arc<Gpu>,
    dtype: KvDtype,
    shape: AttentionShape,
    capacity: usize,
    len: usize,
    seed: u64,
) -> Result<(DeviceKv, Vec<f32>, Vec<f32>), String> {
    let kv_dim = shape.kv_dim();
    let mut kv = DeviceKv::new(gpu, dtype, capacity, shape.kv_heads, shape.head_dim).map_err(e)?;
    let k = rand_f32(seed, len * kv_dim, 1.0);
    let v = rand_f32(seed + 1, len * kv_dim, 1.0);
    // Split point of the two appends; min: len / 2 + len % 3 exceeds len for len = 2.
    let first = (len / 2 + len % 3).min(len);
    for (start, rows) in [(0, first), (first, len - first)] {
        if rows == 0 {
            continue;
        }
        let kd = gpu.upload(&k[start * kv_dim..(start + rows) * kv_dim]).map_err(e)?;
        let vd = gpu.upload(&v[start * kv_dim..(start + rows) * kv_dim]).map_err(e)?;
        kv_append(gpu, &mut kv, &kd, &vd, start, rows).map_err(e)?;
    }
    Ok((kv, k, v))
}

/// Host model of the int8 cache: each (position, kv head) block quantized by
/// `strata::quant::quantize_int8_block`, then dequantized (`value * scale`).
fn host_int8_roundtrip(x: &[f32], head_dim: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    out.chunks_exact_mut(head_dim).for_each(strata::quant::int8_block_round_trip);
    out
}

fn exact(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits()) {
        Some(i) => Err(format!("{what}: [{i}] = {} want {} (bit-exact)", got[i], want[i])),
        None => Ok(()),
    }
}

/// Append rows in two calls (and some rows with special content: all zero,
/// one outlier), read the cache back, compare bit for bit with the host model.
fn kv_append_roundtrip(gpu: &Arc<Gpu>, dtype: KvDtype) -> Result<(), String> {
    let cases =
        [(4usize, 128usize, 37usize), (2, 256, 9), (3, 64, 130), (1, 64, 1), (2, 32, 41), (1, 16, 23), (2, 16, 2)];
    for &(kv_heads, head_dim, len) in &cases {
        let shape = AttentionShape { heads: kv_heads, kv_heads, head_dim };
        let kv_dim = shape.kv_dim();
        let mut kv = DeviceKv::new(gpu, dtype, len + 5, kv_heads, head_dim).map_err(e)?;
        let mut k = rand_f32(11 + len as u64, len * kv_dim, 3.0);
        let v = rand_f32(12 + len as u64, len * kv_dim, 0.02);
        // An all-zero block (scale 0) and a block with one outlier.
        k[..head_dim].fill(0.0);
        if len > 1 {
            k[kv_dim + 5] = 1000.0;
        }
        let first = len / 3;
        for (start, rows) in [(0, first), (first, len - first)] {
            if rows == 0 {
                continue;
            }
            let kd = gpu.upload(&k[start * kv_dim..(start + rows) * kv_dim]).map_err(e)?;
            let vd = gpu.upload(&v[start * kv_dim..(start + rows) * kv_dim]).map_err(e)?;
            kv_append(gpu, &mut kv, &kd, &vd, start, rows).map_err(e)?;
        }
        let (kr, vr) = kv_read_f32(gpu, &kv, len).map_err(e)?;
        let (kw, vw) = match dtype {
            KvDtype::Int8 => (host_int8_roundtrip(&k, head_dim), host_int8_roundtrip(&v, head_dim)),
            KvDtype::Bf16 => {
                let r = |x: &[f32]| x.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
                (r(&k), r(&v))
            }
        };
        let what = format!("{dtype:?} kv_heads {kv_heads} head_dim {head_dim} len {len}");
        exact(&format!("{what}: K"), &kr, &kw)?;
        exact(&format!("{what}: V"), &vr, &vw)?;
        if kr[..head_dim].iter().any(|&x| x != 0.0) {
            return Err(format!("{what}: an all-zero block did not stay zero"));
        }
        // Positions past len were never written: still zero.
        let (kall, _) = kv_read_f32(gpu, &kv, len + 5).map_err(e)?;
        if kall[len * kv_dim..].iter().any(|&x| x != 0.0) {
            return Err(format!("{what}: kv_append wrote past its rows"));
        }
    }
    Ok(())
}

fn kv_append_int8_exact(gpu: &Arc<Gpu>) -> Result<(), String> {
    kv_append_roundtrip(gpu, KvDtype::Int8)
}

fn kv_append_bf16_exact(gpu: &Arc<Gpu>) -> Result<(), String> {
    kv_append_roundtrip(gpu, KvDtype::Bf16)
}

/// Runs the device attention for `rows` rows at `start_pos` on a random
/// cache; returns (device output, CPU output on the dequantized cache, q, k, v f32).
#[allow(clippy::type_complexity)]
fn run_case(
    gpu: &Arc<Gpu>,
    dtype: KvDtype,
    shape: AttentionShape,
    start_pos: usize,
    rows: usize,
    seed: u64,
    config: AttnConfig,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>), String> {
    let len = start_pos + rows;
    let (kv, k, v) = filled_cache(gpu, dtype, shape, len + 3, len, seed)?;
    // q scale 2: scores of std ~2, so the max subtraction matters.
    let q = rand_f32(seed + 7, rows * shape.q_dim(), 2.0);
    let qd = gpu.upload(&q).map_err(e)?;
    let mut out = poisoned(gpu, rows * shape.q_dim())?;
    attention_with(gpu, &qd, &kv, shape, start_pos, rows, &mut out, config).map_err(e)?;
    let got = gpu.download(&out).map_err(e)?;
    let (kd, vd) = kv_read_f32(gpu, &kv, len).map_err(e)?;
    let mut want = vec![0.0f32; q.len()];
    ops::attention(&q, &kd, &vd, shape, start_pos, &mut want);
    Ok((got, want, q, k, v))
}

/// Tolerance of the SIMT kernel against the CPU on the same (dequantized)
/// cache: both sum in f32, in different orders (the CPU sequentially over up
/// to 40K keys, the GPU in tiles and splits, with online-softmax rescaling);
/// the error of a sequential f32 sum grows like sqrt(n) * 2^-24, ~1e-5 at 40K terms.
fn tight_tol(keys: usize) -> f32 {
    if keys > 4096 {
        5e-5
    } else {
        2e-5
    }
}

/// Tolerance of the tensor-core kernels (decode and prefill, F32 precision):
/// Q and P (times the V scale) enter as bf16 hi + lo pairs, 16 significant
/// bits, so each operand is off by up to 2^-17 ~ 7.6e-6 relative (a host
/// emulation of the kernels measured up to ~9e-6 of max |out|); K and V
/// are exact in bf16 (int8 integers, or bf16 already). 5e-5 leaves room for
/// the tensor cores' own f32 accumulation and still fails on a dropped key
/// (~1e-3 at 1000 keys) or a wrong scale.
fn mma_tol(keys: usize) -> f32 {
    if keys > 4096 {
        1e-4
    } else {
        5e-5
    }
}

fn check_cases(
    gpu: &Arc<Gpu>,
    dtype: KvDtype,
    cases: &[(usize, usize)],
    config: AttnConfig,
    tol: fn(usize) -> f32,
) -> Result<(), String> {
    check_shapes(gpu, dtype, &SHAPES, cases, config, tol)
}

fn check_shapes(
    gpu: &Arc<Gpu>,
    dtype: KvDtype,
    shapes: &[(usize, usize, usize)],
    cases: &[(usize, usize)],
    config: AttnConfig,
    tol: fn(usize) -> f32,
) -> Result<(), String> {
    for (si, &sh) in shapes.iter().enumerate() {
        let shape = shape_of(sh);
        for (ci, &(start_pos, rows)) in cases.iter().enumerate() {
            let seed = 1000 + (si * 100 + ci) as u64;
            let (got, want, ..) = run_case(gpu, dtype, shape, start_pos, rows, seed, config)?;
            check_close(
                &format!("{dtype:?} {config:?} {sh:?} start_pos {start_pos} rows {rows}"),
                &got,
                &want,
                tol(start_pos + rows),
            )?;
        }
    }
    Ok(())
}

/// Decode: T = 1 at several context lengths (split key ranges up to 40K), T = 3.
const DECODE_CASES: [(usize, usize); 7] = [(0, 1), (1, 1), (1000, 1), (40000, 1), (0, 3), (37, 3), (1000, 3)];
/// Prefill from an empty cache and after a 500-position prefix.
const PREFILL_CASES: [(usize, usize); 8] =
    [(0, 17), (0, 64), (0, 200), (0, 1000), (500, 17), (500, 64), (500, 200), (500, 1000)];

const AUTO: AttnConfig = AttnConfig { kernel: AttnKernel::Auto, precision: AttnPrecision::F32, row_cluster: 0 };
const SIMT: AttnConfig = AttnConfig { kernel: AttnKernel::Simt, precision: AttnPrecision::F32, row_cluster: 0 };
const MMA: AttnConfig = AttnConfig { kernel: AttnKernel::Mma, precision: AttnPrecision::F32, row_cluster: 0 };

/// The default path (on sm_80+: the tensor-core decode kernel up to 16 query
/// vectors per kv head, the prefill kernel for T = 3 with groups of 8).
fn decode_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Int8, &DECODE_CASES, AUTO, mma_tol)
}

fn decode_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Bf16, &DECODE_CASES, AUTO, mma_tol)
}

/// The default path (the tensor-core kernel with hi/lo bf16 operands on sm_80+).
fn prefill_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Int8, &PREFILL_CASES, AUTO, mma_tol)
}

fn prefill_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Bf16, &PREFILL_CASES, AUTO, mma_tol)
}

/// The SIMT kernel (the path of devices before sm_80) on decode and prefill sizes.
fn simt_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Int8, &DECODE_CASES, SIMT, tight_tol)?;
    check_cases(gpu, KvDtype::Int8, &PREFILL_CASES, SIMT, tight_tol)
}

fn simt_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Bf16, &DECODE_CASES, SIMT, tight_tol)?;
    check_cases(gpu, KvDtype::Bf16, &PREFILL_CASES, SIMT, tight_tol)
}

/// The tensor-core decode kernel forced, with one row and with as many rows
/// as fit its 16 query vectors per kv head (two n-blocks), at context
/// lengths from 1 to 40K (one split, many splits, partly filled warp tiles).
fn dec_kernel(gpu: &Arc<Gpu>, dtype: KvDtype) -> Result<(), String> {
    let dec = AttnConfig { kernel: AttnKernel::Decode, precision: AttnPrecision::F32, row_cluster: 0 };
    for (si, &sh) in SHAPES.iter().enumerate() {
        let shape = shape_of(sh);
        let most_rows = (16 / (sh.0 / sh.1)).max(1);
        let mut cases = vec![(0usize, 1usize), (1, 1), (45, 1), (1000, 1), (40000, 1), (0, most_rows)];
        cases.extend([(7, most_rows), (1000, most_rows), (40000, most_rows)]);
        if most_rows > 2 {
            cases.push((300, most_rows - 1));
        }
        for (ci, &(start_pos, rows)) in cases.iter().enumerate() {
            let seed = 3000 + (si * 100 + ci) as u64;
            let (got, want, ..) = run_case(gpu, dtype, shape, start_pos, rows, seed, dec)?;
            check_close(
                &format!("{dtype:?} decode kernel {sh:?} start_pos {start_pos} rows {rows}"),
                &got,
                &want,
                mma_tol(start_pos + rows),
            )?;
        }
    }
    Ok(())
}

fn dec_kernel_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    dec_kernel(gpu, KvDtype::Int8)
}

fn dec_kernel_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    dec_kernel(gpu, KvDtype::Bf16)
}

/// The tensor-core kernel on decode sizes (mostly-empty query tiles, split key ranges).
fn mma_decode_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Int8, &DECODE_CASES, MMA, mma_tol)
}

fn mma_decode_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_cases(gpu, KvDtype::Bf16, &DECODE_CASES, MMA, mma_tol)
}

/// The tensor-core kernel with single bf16 Q and P: Q rounds by up to 2^-9
/// relative, which moves scores of std ~2 by ~2e-3 (weights by ~0.2%), and
/// P (in [0, 1]) rounds by up to 2^-9: the output moves by well under 1% of
/// its largest entry; 1e-2 bounds that (a dropped key or a wrong scale
/// still fails: see int8_error_vs_f32 for why errors stay this size).
fn mma_bf16_operands(gpu: &Arc<Gpu>) -> Result<(), String> {
    let fast = AttnConfig { kernel: AttnKernel::Mma, precision: AttnPrecision::Bf16, row_cluster: 0 };
    for dtype in [KvDtype::Int8, KvDtype::Bf16] {
        check_cases(gpu, dtype, &[(0, 64), (500, 200), (0, 1000), (1000, 1)], fast, |_| 1e-2)?;
    }
    Ok(())
}

/// The int8 cache against exact f32 K/V. Each value is off by at most
/// scale / 2 = amax / 254 of its (position, head) block, i.e. <= 0.4% of the
/// block's largest magnitude; a score moves by about |q| * that (~1% of a
/// score of std 2 here), which perturbs the softmax weights by ~1% relative,
/// and the output (a convex combination of V) moves by at most
/// max|dV| + |dP| * max|V|: ~1% of max|output|, so 2e-2 bounds it with
/// margin while a lost scale (x127 or x1/127) or a wrong block fails it.
fn int8_error_vs_f32(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (si, &sh) in SHAPES.iter().enumerate() {
        let shape = shape_of(sh);
        for &(start_pos, rows) in &[(0usize, 1usize), (1000, 1), (500, 64)] {
            let seed = 5000 + si as u64 * 10 + rows as u64;
            let (got, _, q, k, v) = run_case(gpu, KvDtype::Int8, shape, start_pos, rows, seed, AUTO)?;
            let mut want = vec![0.0f32; q.len()];
            ops::attention(&q, &k, &v, shape, start_pos, &mut want);
            check_close(&format!("int8 vs f32 KV {sh:?} start_pos {start_pos} rows {rows}"), &got, &want, 2e-2)?;
        }
    }
    Ok(())
}

/// head_dim 32 and 16 (the fixture models): decode (T = 1, 3) and prefill
/// (T = 17, 150) from an empty cache and after 40 positions, plus a long
/// context (split key ranges), through `Auto` (which runs SIMT for these head
/// dims: tolerance mma_tol, in case a tensor-core path ever takes them) and
/// the SIMT kernel forced (tight_tol: f32 throughout).
fn small_head_dims(gpu: &Arc<Gpu>, dtype: KvDtype) -> Result<(), String> {
    let mut cases = Vec::new();
    for start_pos in [0usize, 40] {
        for rows in [1usize, 3, 17, 150] {
            cases.push((start_pos, rows));
        }
    }
    cases.extend([(1000, 1), (5000, 3)]);
    check_shapes(gpu, dtype, &SMALL_SHAPES, &cases, AUTO, mma_tol)?;
    check_shapes(gpu, dtype, &SMALL_SHAPES, &cases, SIMT, tight_tol)
}

fn small_head_dims_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    small_head_dims(gpu, KvDtype::Int8)
}

fn small_head_dims_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    small_head_dims(gpu, KvDtype::Bf16)
}

/// One AttnScratch reused across launches of different sizes (decode at
/// growing contexts, a prefill that makes it grow, decode again) gives the
/// same bits as `attention` with its own buffers, and a decode-sized scratch
/// does not grow at 40K context (the split count bound of AttnScratch::new).
fn scratch_reuse(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (si, &sh) in [(32usize, 4usize, 128usize), (4, 2, 32), (6, 1, 16)].iter().enumerate() {
        let shape = shape_of(sh);
        let mut scratch = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let decode_bytes = scratch.bytes();
        let steps = [(40000usize, 1usize), (1, 1), (1000, 1), (300, 17), (500, 200), (40000, 1)];
        let len = 40001;
        let (kv, ..) = filled_cache(gpu, KvDtype::Int8, shape, len, len, 700 + si as u64)?;
        for (ci, &(start_pos, rows)) in steps.iter().enumerate() {
            let qd = gpu.upload(&rand_f32(800 + ci as u64, rows * shape.q_dim(), 2.0)).map_err(e)?;
            let mut want = poisoned(gpu, rows * shape.q_dim())?;
            attention(gpu, &qd, &kv, shape, start_pos, rows, &mut want).map_err(e)?;
            let mut got = poisoned(gpu, rows * shape.q_dim())?;
            attention_with_scratch(gpu, &qd, &kv, shape, start_pos, rows, &mut got, AUTO, &mut scratch).map_err(e)?;
            let what = format!("{sh:?} start_pos {start_pos} rows {rows} with a reused scratch");
            exact(&what, &gpu.download(&got).map_err(e)?, &gpu.download(&want).map_err(e)?)?;
            if rows == 1 && ci < 3 && scratch.bytes() != decode_bytes {
                return Err(format!(
                    "{what}: a decode-sized scratch grew from {decode_bytes} to {} bytes",
                    scratch.bytes()
                ));
            }
        }
    }
    Ok(())
}

/// The same launch twice gives the same bits (split partials merge in a fixed order).
fn deterministic(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(start_pos, rows) in &[(40000usize, 1usize), (500, 200), (40000, 17)] {
        let shape = shape_of((32, 4, 128));
        let len = start_pos + rows;
        let (kv, ..) = filled_cache(gpu, KvDtype::Int8, shape, len, len, 77)?;
        let qd = gpu.upload(&rand_f32(78, rows * shape.q_dim(), 2.0)).map_err(e)?;
        let mut outs = Vec::new();
        for _ in 0..2 {
            let mut out = poisoned(gpu, rows * shape.q_dim())?;
            attention(gpu, &qd, &kv, shape, start_pos, rows, &mut out).map_err(e)?;
            outs.push(gpu.download(&out).map_err(e)?);
        }
        exact(&format!("second run, start_pos {start_pos} rows {rows}"), &outs[1], &outs[0])?;
    }
    Ok(())
}

fn rejects_bad_arguments(gpu: &Arc<Gpu>) -> Result<(), String> {
    let shape = shape_of((8, 2, 64));
    let mut kv = DeviceKv::new(gpu, KvDtype::Int8, 16, 2, 64).map_err(e)?;
    let rows = gpu.upload(&rand_f32(1, 4 * shape.kv_dim(), 1.0)).map_err(e)?;
    let q = gpu.upload(&rand_f32(2, 4 * shape.q_dim(), 1.0)).map_err(e)?;
    let mut out = poisoned(gpu, 4 * shape.q_dim())?;
    let mut failures = Vec::new();
    if kv_append(gpu, &mut kv, &rows, &rows, 13, 4).is_ok() {
        failures.push("kv_append past the capacity");
    }
    if kv_append(gpu, &mut kv, &rows, &rows, 0, 5).is_ok() {
        failures.push("kv_append of more rows than k holds");
    }
    if attention(gpu, &q, &kv, shape, 13, 4, &mut out).is_ok() {
        failures.push("attention past the capacity");
    }
    if attention(gpu, &q, &kv, shape_of((8, 4, 64)), 0, 4, &mut out).is_ok() {
        failures.push("attention with the wrong kv_heads");
    }
    if attention(gpu, &q, &kv, shape_of((6, 2, 128)), 0, 1, &mut out).is_ok() {
        failures.push("attention with the wrong head_dim");
    }
    if attention(gpu, &q, &kv, shape, 0, 5, &mut out).is_ok() {
        failures.push("attention of more rows than q holds");
    }
    let dec = AttnConfig { kernel: AttnKernel::Decode, precision: AttnPrecision::F32, row_cluster: 0 };
    if attention_with(gpu, &q, &kv, shape, 0, 5, &mut out, dec).is_ok() {
        failures.push("the decode kernel with 20 query vectors per kv head");
    }
    if DeviceKv::new(gpu, KvDtype::Bf16, 16, 2, 96).is_ok() {
        failures.push("a cache of head_dim 96");
    }
    // The tensor-core kernels are not built for head_dim 32: forcing them is refused.
    let small = shape_of((4, 2, 32));
    let kv32 = DeviceKv::new(gpu, KvDtype::Int8, 16, 2, 32).map_err(e)?;
    let mma = AttnConfig { kernel: AttnKernel::Mma, precision: AttnPrecision::F32, row_cluster: 0 };
    let has_tc = gpu.compute_capability().0 >= 8;
    if has_tc && attention_with(gpu, &q, &kv32, small, 0, 1, &mut out, mma).is_ok() {
        failures.push("the tensor-core prefill kernel at head_dim 32");
    }
    if has_tc && attention_with(gpu, &q, &kv32, small, 0, 1, &mut out, dec).is_ok() {
        failures.push("the tensor-core decode kernel at head_dim 32");
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("accepted: {}", failures.join(", ")))
    }
}

/// Median seconds of `reps` launches of `work`, timed with CUDA events.
fn median_seconds(gpu: &Arc<Gpu>, reps: usize, mut work: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let ctx = gpu.context();
    // Timing events: new_event(None) means CU_EVENT_DISABLE_TIMING, whose
    // elapsed_ms fails with CUDA_ERROR_INVALID_HANDLE.
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    work()?;
    gpu.sync().map_err(e)?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        start.record(gpu.stream()).map_err(e)?;
        work()?;
        end.record(gpu.stream()).map_err(e)?;
        times.push(start.elapsed_ms(&end).map_err(e)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// Decode T=1 at 32K context (GB/s of KV bytes read vs the 4.3 TB/s HBM
/// floor) and prefill T=4096 (TFLOP/s of the causal 4 * T^2 / 2 * hd * heads).
fn timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    let decode_runs = [
        ((32usize, 4usize, 128usize), KvDtype::Int8, AUTO),
        ((32, 4, 128), KvDtype::Int8, SIMT),
        ((32, 4, 128), KvDtype::Bf16, AUTO),
        ((16, 2, 256), KvDtype::Int8, AUTO),
    ];
    for (sh, dtype, config) in decode_runs {
        let shape = shape_of(sh);
        let ctx_len = 32768;
        let (kv, ..) = filled_cache(gpu, dtype, shape, ctx_len, ctx_len, 91)?;
        let qd = gpu.upload(&rand_f32(92, shape.q_dim(), 2.0)).map_err(e)?;
        let mut out = poisoned(gpu, shape.q_dim())?;
        let secs = median_seconds(gpu, 21, || {
            attention_with(gpu, &qd, &kv, shape, ctx_len - 1, 1, &mut out, config).map_err(e)
        })?;
        let gbs = (ctx_len * kv.bytes_per_position()) as f64 / secs / 1e9;
        println!(
            "     timing: attention decode {dtype:?} {sh:?} {:?} ctx {ctx_len}: {:.1} us, {gbs:.0} GB/s of KV = {:.1}% \
             of 4300 GB/s",
            config.kernel,
            secs * 1e6,
            gbs / 43.0
        );
    }
    let fast = AttnConfig { kernel: AttnKernel::Mma, precision: AttnPrecision::Bf16, row_cluster: 0 };
    let runs = [
        ((32usize, 4usize, 128usize), AUTO),
        ((32, 4, 128), fast),
        ((32, 4, 128), SIMT),
        ((16, 2, 256), AUTO),
        ((16, 2, 256), fast),
    ];
    for (sh, config) in runs {
        let shape = shape_of(sh);
        let t = 4096;
        let (kv, ..) = filled_cache(gpu, KvDtype::Int8, shape, t, t, 93)?;
        let qd = gpu.upload(&rand_f32(94, t * shape.q_dim(), 2.0)).map_err(e)?;
        let mut out: CudaSlice<f32> = poisoned(gpu, t * shape.q_dim())?;
        let secs = median_seconds(gpu, 5, || attention_with(gpu, &qd, &kv, shape, 0, t, &mut out, config).map_err(e))?;
        let flops = 4.0 * (t * t) as f64 / 2.0 * (sh.2 * sh.0) as f64;
        let tfs = flops / secs / 1e12;
        println!(
            "     timing: attention prefill Int8 {sh:?} T {t} {:?}/{:?}: {:.2} ms, {tfs:.1} TFLOP/s = {:.1}% of 790",
            config.kernel,
            config.precision,
            secs * 1e3,
            tfs / 7.9
        );
    }
    Ok(())
}

/// Decode positions of the step-pointer tests: split ranges from one split (0, 1, 2) through tile edges (63..65)
/// to many splits (4095, 40000).
const STEP_POSITIONS: [usize; 9] = [0, 1, 2, 63, 64, 65, 500, 4095, 40000];
const STEP_SHAPES: [(usize, usize, usize); 4] = [(32, 4, 128), (16, 2, 256), (4, 2, 32), (6, 1, 16)];
const STEP_CAPACITY: usize = 40001;

/// The raw cache contents (K, V bytes and, for Int8, the K/V scales) of `pos`.
fn cache_row(gpu: &Arc<Gpu>, kv: &DeviceKv, pos: usize) -> Result<Vec<u8>, String> {
    let kv_dim = kv.kv_heads * kv.head_dim;
    let vb = kv.dtype.value_bytes();
    let stream = gpu.stream();
    let range = pos * kv_dim * vb..(pos + 1) * kv_dim * vb;
    let mut out = stream.clone_dtoh(&kv.k.slice(range.clone())).map_err(e)?;
    out.extend(stream.clone_dtoh(&kv.v.slice(range)).map_err(e)?);
    if kv.dtype == KvDtype::Int8 {
        let sr = pos * kv.kv_heads..(pos + 1) * kv.kv_heads;
        for sc in [&kv.k_scale, &kv.v_scale] {
            let x = stream.clone_dtoh(&sc.slice(sr.clone())).map_err(e)?;
            out.extend(x.iter().flat_map(|f| f.to_le_bytes()));
        }
    }
    gpu.sync().map_err(e)?;
    Ok(out)
}

fn all_finite(what: &str, x: &[f32]) -> Result<(), String> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(format!("{what}: [{i}] = {} (not finite)", x[i])),
        None => Ok(()),
    }
}

/// A captured decode step's attention (`kv_append_at` + `attention_at` with ONE StepPos set per step and ONE
/// StepPlan, fixed grid) against the plain `kv_append` + `attention` at the same start_pos, on two caches filled
/// alike: the appended row and the output must be the same bits. (step_chunk gives plan_splits's chunk, so the
/// non-empty splits cover the same ranges; the extra splits are empty and their neutral partials change nothing
/// in the combine; a range within split 0 is written by split 0 as the one-split launch does.)
fn step_pointer(gpu: &Arc<Gpu>, dtype: KvDtype) -> Result<(), String> {
    step_pointer_at(gpu, dtype, &STEP_SHAPES, &STEP_POSITIONS, STEP_CAPACITY, AUTO)
}

/// `step_pointer` over `shapes` at `positions` (each < capacity) on caches of `capacity` positions, both paths
/// with the kernel `config` gives.
fn step_pointer_at(
    gpu: &Arc<Gpu>,
    dtype: KvDtype,
    shapes: &[(usize, usize, usize)],
    positions: &[usize],
    capacity: usize,
    config: AttnConfig,
) -> Result<(), String> {
    for (si, &sh) in shapes.iter().enumerate() {
        let shape = shape_of(sh);
        let seed = 900 + si as u64 * 10;
        let (mut kv_plain, ..) = filled_cache(gpu, dtype, shape, capacity, capacity, seed)?;
        let (mut kv_step, ..) = filled_cache(gpu, dtype, shape, capacity, capacity, seed)?;
        let plan: StepPlan = step_plan_with(gpu, shape, 1, dtype, config).map_err(e)?;
        if plan.splits < 2 || plan.tile == 0 {
            return Err(format!("{sh:?}: step plan {plan:?} (want a split launch)"));
        }
        let mut pos = StepPos::new(gpu).map_err(e)?;
        let mut scratch_plain = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let mut scratch_step = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let qn = shape.q_dim();
        let mut out_step = poisoned(gpu, qn)?;
        for (pi, &sp) in positions.iter().enumerate() {
            let what = format!("{dtype:?} {sh:?} start_pos {sp} plan {plan:?}");
            let chunk = step_chunk(&plan, sp + 1);
            if chunk % plan.tile != 0 || chunk * plan.splits < sp + 1 {
                return Err(format!("{what}: chunk {chunk} does not cover the keys"));
            }
            let sd = seed + 100 + pi as u64;
            let kd = gpu.upload(&rand_f32(sd, shape.kv_dim(), 1.0)).map_err(e)?;
            let vd = gpu.upload(&rand_f32(sd + 1, shape.kv_dim(), 1.0)).map_err(e)?;
            let qd = gpu.upload(&rand_f32(sd + 2, qn, 2.0)).map_err(e)?;
            kv_append(gpu, &mut kv_plain, &kd, &vd, sp, 1).map_err(e)?;
            let mut want = poisoned(gpu, qn)?;
            attention_with_scratch(gpu, &qd, &kv_plain, shape, sp, 1, &mut want, config, &mut scratch_plain)
                .map_err(e)?;

            pos.set(gpu, sp, chunk).map_err(e)?;
            kv_append_at(gpu, &mut kv_step, &kd, &vd, &pos, 1).map_err(e)?;
            gpu.fill_f32(&mut out_step, f32::NAN).map_err(e)?;
            attention_at(gpu, &qd, &kv_step, shape, 1, &mut out_step, &plan, &pos, &mut scratch_step).map_err(e)?;

            let (got_row, want_row) = (cache_row(gpu, &kv_step, sp)?, cache_row(gpu, &kv_plain, sp)?);
            if got_row != want_row {
                return Err(format!("{what}: kv_append_at row differs from kv_append"));
            }
            let (got, want) = (gpu.download(&out_step).map_err(e)?, gpu.download(&want).map_err(e)?);
            all_finite(&what, &want)?;
            exact(&what, &got, &want)?;
        }
        // The whole caches agree (nothing written elsewhere).
        let (ka, va) = kv_read_f32(gpu, &kv_step, capacity).map_err(e)?;
        let (kb, vb) = kv_read_f32(gpu, &kv_plain, capacity).map_err(e)?;
        exact(&format!("{dtype:?} {sh:?} whole K cache"), &ka, &kb)?;
        exact(&format!("{dtype:?} {sh:?} whole V cache"), &va, &vb)?;
    }
    Ok(())
}

fn step_pointer_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    step_pointer(gpu, KvDtype::Int8)
}

fn step_pointer_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    step_pointer(gpu, KvDtype::Bf16)
}

/// kv_append_at + attention_at captured once into a CUDA graph and replayed for 5 steps (StepPos::set between
/// replays) give the same cache rows and outputs as the plain path at each start_pos.
fn step_graph_replay(gpu: &Arc<Gpu>) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    for (si, &(sh, dtype)) in
        [((32usize, 4usize, 128usize), KvDtype::Int8), ((16, 2, 256), KvDtype::Bf16), ((4, 2, 32), KvDtype::Int8)]
            .iter()
            .enumerate()
    {
        let shape = shape_of(sh);
        let capacity = 5000;
        let seed = 950 + si as u64 * 10;
        let (mut kv_plain, ..) = filled_cache(gpu, dtype, shape, capacity, capacity, seed)?;
        let (mut kv_step, ..) = filled_cache(gpu, dtype, shape, capacity, capacity, seed)?;
        let plan = step_plan(gpu, shape, 1, dtype).map_err(e)?;
        let mut pos = StepPos::new(gpu).map_err(e)?;
        let mut scratch_plain = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let mut scratch_step = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let qn = shape.q_dim();
        // Inputs the graph reads (rewritten in place before each replay) and its output.
        let mut kd = gpu.upload(&rand_f32(seed, shape.kv_dim(), 1.0)).map_err(e)?;
        let mut vd = gpu.upload(&rand_f32(seed + 1, shape.kv_dim(), 1.0)).map_err(e)?;
        let mut qd = gpu.upload(&rand_f32(seed + 2, qn, 2.0)).map_err(e)?;
        let mut out_step = poisoned(gpu, qn)?;
        // Capture (the first position's values are set so a warm-up run would be valid; capture runs nothing).
        pos.set(gpu, 0, step_chunk(&plan, 1)).map_err(e)?;
        gpu.sync().map_err(e)?;
        let stream = gpu.stream().clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(e)?;
        let captured = kv_append_at(gpu, &mut kv_step, &kd, &vd, &pos, 1)
            .and_then(|_| attention_at(gpu, &qd, &kv_step, shape, 1, &mut out_step, &plan, &pos, &mut scratch_step));
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
        captured.map_err(e)?;
        let graph = graph.ok_or_else(|| format!("{sh:?}: the capture gave no graph"))?;
        for (step, &sp) in [3usize, 64, 65, 1999, 4990].iter().enumerate() {
            let what = format!("graph replay {dtype:?} {sh:?} step {step} start_pos {sp}");
            let sd = seed + 100 + step as u64;
            let (k, v, q) =
                (rand_f32(sd, shape.kv_dim(), 1.0), rand_f32(sd + 1, shape.kv_dim(), 1.0), rand_f32(sd + 2, qn, 2.0));
            stream.memcpy_htod(&k, &mut kd).map_err(e)?;
            stream.memcpy_htod(&v, &mut vd).map_err(e)?;
            stream.memcpy_htod(&q, &mut qd).map_err(e)?;
            gpu.fill_f32(&mut out_step, f32::NAN).map_err(e)?;
            pos.set(gpu, sp, step_chunk(&plan, sp + 1)).map_err(e)?;
            graph.launch().map_err(e)?;
            let got = gpu.download(&out_step).map_err(e)?;

            kv_append(gpu, &mut kv_plain, &kd, &vd, sp, 1).map_err(e)?;
            let mut want = poisoned(gpu, qn)?;
            attention_with_scratch(gpu, &qd, &kv_plain, shape, sp, 1, &mut want, AUTO, &mut scratch_plain)
                .map_err(e)?;
            let want = gpu.download(&want).map_err(e)?;
            if cache_row(gpu, &kv_step, sp)? != cache_row(gpu, &kv_plain, sp)? {
                return Err(format!("{what}: appended row differs from kv_append"));
            }
            all_finite(&what, &want)?;
            exact(&what, &got, &want)?;
        }
        drop(graph);
    }
    Ok(())
}

// ------------------------------------------------------------------------
// The one-row decode kernel (attn_row_*).

const ROW: AttnConfig = AttnConfig { kernel: AttnKernel::Row, precision: AttnPrecision::F32, row_cluster: 0 };
/// The one-row kernel without clusters (attn_row_*), and in clusters of 16, 8 and 5 blocks (attn_rowc_*, sm_90+).
const ROW_PLAIN: AttnConfig = AttnConfig { row_cluster: 1, ..ROW };
const ROW_C16: AttnConfig = AttnConfig { row_cluster: 16, ..ROW };
const ROW_C8: AttnConfig = AttnConfig { row_cluster: 8, ..ROW };
const ROW_C5: AttnConfig = AttnConfig { row_cluster: 5, ..ROW };

/// Shapes (heads, kv_heads, head_dim) of the one-row kernel (a block takes at most 4 query heads of a kv head,
/// a larger group is cut into parts, grid z): Qwen3-30B-A3B (group 8: 2 parts of 4, hd 128), Qwen3-Next (group
/// 8, hd 256), MHA (group 1), group 16 on one kv head (4 parts, 66 splits at long contexts: a level-2 merge of 9
/// groups), the fixture head dims 16 and 32, a group of 3 (one part, padded to 4), of 10 (parts of 4, 4 and 2),
/// of 6 (2 parts of 3, padded to 4) and of 7 (parts of 4 and 3), and group 2 on one kv head (one part: up to 264
/// splits, a level-2 merge of up to 33 groups).
const ROW_SHAPES: [(usize, usize, usize); 11] = [
    (32, 4, 128),
    (16, 2, 256),
    (8, 8, 64),
    (16, 1, 128),
    (4, 4, 16),
    (8, 2, 32),
    (12, 4, 64),
    (10, 1, 32),
    (6, 1, 64),
    (14, 2, 128),
    (2, 1, 64),
];

/// Keys of the one-row cases (the row sits at position kend - 1): one and two keys, 17, the 64-key minimum split
/// and its edges (63, 64, 65: one split, then two), 1000, 1024 and 1025 (for 4 kv heads x 2 parts: 16 splits of
/// 64, the most one merge level takes, then 17: two levels, the last group of one split), the profiled 4128 (33
/// splits, 5 groups), 8192 + 3 (a last split of 3 keys) and 20001 (many splits: 209 of 96 for one kv head of
/// one part).
const ROW_CONTEXTS: [usize; 12] = [1, 2, 17, 63, 64, 65, 1000, 1024, 1025, 4128, 8195, 20001];

/// The one-row kernel forced, against `cpu::ops::attention` on the cache's dequantized contents, with
/// `tight_tol`: both sides are f32 throughout (cache values enter exactly; the kernel applies the int8 K scale
/// to the dot product and the V scale to the probability instead of to each value, which moves each product by
/// at most one f32 rounding, 6e-8 relative); what differs is the summation order (dims in segments, keys in
/// tiles, subsets and splits, the merge's rescaling) against the CPU's sequential sums: the same error sources
/// as the SIMT kernel's, bounded by the same 2e-5 (5e-5 past 4096 keys) of max |out|, while a dropped key or
/// split (~1e-3 at 1000 keys, more at fewer), a lost scale or a wrong head fails by orders of magnitude.
fn row_cases(gpu: &Arc<Gpu>, dtype: KvDtype, config: AttnConfig) -> Result<(), String> {
    for (si, &sh) in ROW_SHAPES.iter().enumerate() {
        let shape = shape_of(sh);
        for (ci, &kend) in ROW_CONTEXTS.iter().enumerate() {
            let seed = 7000 + (si * 100 + ci) as u64;
            let (got, want, ..) = run_case(gpu, dtype, shape, kend - 1, 1, seed, config)?;
            let what = format!("{dtype:?} row kernel {sh:?} keys {kend}, clusters {}", config.row_cluster);
            check_close(&what, &got, &want, tight_tol(kend))?;
        }
    }
    Ok(())
}

fn row_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    row_cases(gpu, KvDtype::Int8, ROW)
}

fn row_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    row_cases(gpu, KvDtype::Bf16, ROW)
}

/// The one-row kernel in thread-block clusters of 16, 8 and 5 blocks (attn_rowc_*: a cluster's splits merged in
/// distributed shared memory, then the clusters through global memory), on sm_90 and later; before sm_90 the
/// plain kernel runs (the same cases as row_int8). Checked as row_int8 (against the CPU, `tight_tol`), and the
/// plan must really take clusters where the device has them: one cluster of 8 or 5 blocks a (kv head, part)
/// always runs at once (8 is the portable size); 16 may not fit (printed at the 30B shape, with the splits).
fn row_cluster_cases(gpu: &Arc<Gpu>, dtype: KvDtype, configs: &[AttnConfig]) -> Result<(), String> {
    for &config in configs {
        for (si, &sh) in ROW_SHAPES.iter().enumerate() {
            let shape = shape_of(sh);
            let plan = step_plan_with(gpu, shape, 1, dtype, config).map_err(e)?;
            let got = plan.row_cluster();
            if si == 0 {
                println!(
                    "     clusters of {} asked at {sh:?} {dtype:?}: {got}, {} splits",
                    config.row_cluster, plan.splits
                );
            }
            if config.row_cluster != 16 && gpu.compute_capability().0 >= 9 && got != config.row_cluster {
                return Err(format!("{dtype:?} {sh:?}: clusters of {got}, want {} ({plan:?})", config.row_cluster));
            }
        }
        row_cases(gpu, dtype, config)?;
    }
    Ok(())
}

fn row_clusters_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    // What the occupancy API answers at the 30B shape (int8 KV, 4 query heads a block: 42416 bytes of shared
    // memory), for the record.
    if gpu.compute_capability().0 >= 9 {
        for cluster in [4u32, 5, 8, 11, 16] {
            let cfg = LaunchConfig { grid_dim: (cluster, 4, 2), block_dim: (256, 1, 1), shared_mem_bytes: 42416 };
            let n = gpu.active_clusters("attn_rowc_hd128_i8_g4", cfg, cluster);
            println!("     attn_rowc_hd128_i8_g4 in clusters of {cluster}: {n} run at once");
        }
    }
    row_cluster_cases(gpu, KvDtype::Int8, &[ROW_C16, ROW_C8, ROW_C5])
}

fn row_clusters_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    row_cluster_cases(gpu, KvDtype::Bf16, &[ROW_C16])
}

/// The captured step in clusters against the plain path in the same clusters, bit for bit (as
/// row_step_pointer_int8).
fn row_clusters_step_pointer(gpu: &Arc<Gpu>) -> Result<(), String> {
    for config in [ROW_C16, ROW_C5] {
        step_pointer_at(gpu, KvDtype::Int8, &ROW_STEP_SHAPES, &ROW_STEP_POSITIONS, 8195, config)?;
    }
    Ok(())
}

/// One scratch reused across split counts in clusters (as row_counters_reset).
fn row_clusters_counters_reset(gpu: &Arc<Gpu>) -> Result<(), String> {
    for config in [ROW_C16, ROW_C5] {
        row_counters_reset_with(gpu, config)?;
    }
    Ok(())
}

/// `Auto` runs the one-row kernel for one row (the same bits as `Row` forced; the tensor-core decode kernel's
/// bf16 hi/lo operands would differ in the low bits), on the model shapes at short and long contexts.
fn row_auto_picks_row(gpu: &Arc<Gpu>) -> Result<(), String> {
    for dtype in [KvDtype::Int8, KvDtype::Bf16] {
        for (si, &sh) in [(32usize, 4usize, 128usize), (16, 2, 256), (4, 2, 32)].iter().enumerate() {
            let shape = shape_of(sh);
            for kend in [16usize, 4128] {
                let (kv, ..) = filled_cache(gpu, dtype, shape, kend, kend, 7500 + si as u64)?;
                let qd = gpu.upload(&rand_f32(7600 + kend as u64, shape.q_dim(), 2.0)).map_err(e)?;
                let mut outs = Vec::new();
                for config in [AUTO, ROW] {
                    let mut out = poisoned(gpu, shape.q_dim())?;
                    attention_with(gpu, &qd, &kv, shape, kend - 1, 1, &mut out, config).map_err(e)?;
                    outs.push(gpu.download(&out).map_err(e)?);
                }
                let what = format!("{dtype:?} {sh:?} keys {kend}: Auto vs Row");
                all_finite(&what, &outs[1])?;
                exact(&what, &outs[0], &outs[1])?;
            }
        }
    }
    Ok(())
}

/// The one-row kernel reading its first key tile before its programmatic wait (`Gpu::prewait`, the default: the
/// keys before the row's position there, the row's own key after) gives the same bits as reading it all after
/// (a `test-hooks` build switches it; without, the default path against itself). For 4 kv heads x 2 parts the
/// contexts put the row's key alone in a split (1, 65, 1025: chunk 64), inside a split's first tile (17, 4128)
/// and past it (8195: splits of 256 keys, two tiles of 128); row_int8 / row_bf16 check the default against the
/// CPU. The cache holds the row's key before the launch, so this catches a wrong key range, not a read too early.
fn row_prewait_same_bits(gpu: &Arc<Gpu>) -> Result<(), String> {
    for dtype in [KvDtype::Int8, KvDtype::Bf16] {
        for (si, &sh) in [(32usize, 4usize, 128usize), (16, 2, 256), (16, 1, 128)].iter().enumerate() {
            let shape = shape_of(sh);
            let len = 8195;
            let (kv, ..) = filled_cache(gpu, dtype, shape, len, len, 7900 + si as u64)?;
            for kend in [1usize, 17, 65, 1025, 4128, 8195] {
                let qd = gpu.upload(&rand_f32(7950 + kend as u64, shape.q_dim(), 2.0)).map_err(e)?;
                let mut outs = Vec::new();
                for on in [true, false] {
                    #[cfg(feature = "test-hooks")]
                    let prev = gpu.set_prewait(if on { strata::backend::cuda::PREWAIT_ATTN } else { 0 });
                    let mut out = poisoned(gpu, shape.q_dim())?;
                    let r = attention_with(gpu, &qd, &kv, shape, kend - 1, 1, &mut out, ROW).map_err(e);
                    #[cfg(feature = "test-hooks")]
                    gpu.set_prewait(prev);
                    #[cfg(not(feature = "test-hooks"))]
                    let _ = on;
                    r?;
                    outs.push(gpu.download(&out).map_err(e)?);
                }
                let what = format!("{dtype:?} {sh:?} keys {kend}: keys read before the wait vs after");
                all_finite(&what, &outs[0])?;
                exact(&what, &outs[0], &outs[1])?;
            }
        }
    }
    Ok(())
}

/// One scratch reused by a sequence of one-row launches whose split and group counts change (many splits, one
/// split, two, one merge level, two levels of many groups...) over one or several query parts: every launch must
/// find its arrival counters at zero (each launch's mergers reset them), so each output is the same bits as a
/// launch with a fresh scratch, and a decode-sized scratch never grows.
fn row_counters_reset(gpu: &Arc<Gpu>) -> Result<(), String> {
    row_counters_reset_with(gpu, ROW)
}

fn row_counters_reset_with(gpu: &Arc<Gpu>, config: AttnConfig) -> Result<(), String> {
    for (si, &sh) in [(32usize, 4usize, 128usize), (16, 1, 128), (10, 1, 32), (2, 1, 64)].iter().enumerate() {
        let shape = shape_of(sh);
        let len = 8195;
        let (kv, ..) = filled_cache(gpu, KvDtype::Int8, shape, len, len, 7700 + si as u64)?;
        let mut scratch = AttnScratch::new(gpu, shape, 1).map_err(e)?;
        let bytes = scratch.bytes();
        for (ci, &kend) in [4128usize, 8195, 65, 1000, 1, 1025, 4128, 1024, 8195, 513, 8195].iter().enumerate() {
            let qd = gpu.upload(&rand_f32(7800 + ci as u64, shape.q_dim(), 2.0)).map_err(e)?;
            let mut want = poisoned(gpu, shape.q_dim())?;
            attention_with(gpu, &qd, &kv, shape, kend - 1, 1, &mut want, config).map_err(e)?;
            let mut got = poisoned(gpu, shape.q_dim())?;
            attention_with_scratch(gpu, &qd, &kv, shape, kend - 1, 1, &mut got, config, &mut scratch).map_err(e)?;
            let what = format!("{sh:?} launch {ci} (keys {kend}) with a reused scratch");
            let want = gpu.download(&want).map_err(e)?;
            all_finite(&what, &want)?;
            exact(&what, &gpu.download(&got).map_err(e)?, &want)?;
            if scratch.bytes() != bytes {
                return Err(format!("{what}: the scratch grew from {bytes} to {} bytes", scratch.bytes()));
            }
        }
    }
    Ok(())
}

/// The captured step (kv_append_at + attention_at through the one-row kernel's StepPlan) against the plain path,
/// bit for bit, at positions where the split count changes (for 4 kv heads x 2 query parts, a grid of 33 splits:
/// 1 split up to 64 keys, 2 at 65, 8 at 512, 9 at 513, 16 at 1024 (the most one merge level takes), 17 at 1025
/// (two levels), 33 at 2112, 23 at 2113 (chunk 96), 33 at 4128 and 8195).
const ROW_STEP_POSITIONS: [usize; 11] = [0, 63, 64, 511, 512, 1023, 1024, 2111, 2112, 4127, 8194];
const ROW_STEP_SHAPES: [(usize, usize, usize); 6] =
    [(32, 4, 128), (16, 2, 256), (16, 1, 128), (10, 1, 32), (14, 2, 128), (2, 1, 64)];

fn row_step_pointer_int8(gpu: &Arc<Gpu>) -> Result<(), String> {
    step_pointer_at(gpu, KvDtype::Int8, &ROW_STEP_SHAPES, &ROW_STEP_POSITIONS, 8195, AUTO)
}

fn row_step_pointer_bf16(gpu: &Arc<Gpu>) -> Result<(), String> {
    step_pointer_at(gpu, KvDtype::Bf16, &ROW_STEP_SHAPES, &ROW_STEP_POSITIONS, 8195, AUTO)
}

/// The one-row kernel forced on more than one row or more than 16 query heads per kv head is refused (and takes
/// 16); a step plan for one row uses it (a chunk step_chunk gives is a multiple of its tile and covers the keys).
fn row_rejects_bad_arguments(gpu: &Arc<Gpu>) -> Result<(), String> {
    let mut failures = Vec::new();
    let shape = shape_of((8, 2, 64));
    let kv = DeviceKv::new(gpu, KvDtype::Int8, 16, 2, 64).map_err(e)?;
    let q = gpu.upload(&rand_f32(1, 2 * shape.q_dim(), 1.0)).map_err(e)?;
    let mut out = poisoned(gpu, 2 * shape.q_dim())?;
    if attention_with(gpu, &q, &kv, shape, 0, 2, &mut out, ROW).is_ok() {
        failures.push("the one-row kernel with 2 rows".to_string());
    }
    let kv1 = DeviceKv::new(gpu, KvDtype::Bf16, 16, 1, 64).map_err(e)?;
    let q32 = gpu.upload(&rand_f32(2, 32 * 64, 1.0)).map_err(e)?;
    let mut out32 = poisoned(gpu, 32 * 64)?;
    if attention_with(gpu, &q32, &kv1, shape_of((32, 1, 64)), 0, 1, &mut out32, ROW).is_ok() {
        failures.push("the one-row kernel with 32 query heads per kv head".to_string());
    }
    if let Err(err) = attention_with(gpu, &q32, &kv1, shape_of((16, 1, 64)), 3, 1, &mut out32, ROW) {
        failures.push(format!("the one-row kernel with 16 query heads per kv head refused: {err}"));
    }
    let plan = step_plan(gpu, shape, 1, KvDtype::Int8).map_err(e)?;
    for kend in [1usize, 63, 64, 65, 4128, 40000] {
        let chunk = step_chunk(&plan, kend);
        if chunk == 0 || chunk % plan.tile != 0 || chunk * plan.splits < kend {
            failures.push(format!("step_chunk {chunk} for {kend} keys with {plan:?}"));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("failures: {}", failures.join(", ")))
    }
}

/// Median per-launch time of the one-row kernel at the Qwen3-30B-A3B shape (and Qwen3-Next's) at contexts 16 and
/// 4128: 20 attention_at launches captured in one CUDA graph (as the engine's decode step runs them), the graph
/// timed with CUDA events 50 times; printed with the KV bytes read and their time at 4.25 TB/s. The output is
/// checked against the plain launch (same bits).
fn row_timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    const LAUNCHES: usize = 20;
    let runs =
        [((32usize, 4usize, 128usize), KvDtype::Int8), ((32, 4, 128), KvDtype::Bf16), ((16, 2, 256), KvDtype::Int8)];
    for (sh, dtype) in runs {
        for (ctx, config) in [16usize, 4128].into_iter().flat_map(|c| [ROW_PLAIN, ROW_C16, ROW_C8].map(|k| (c, k))) {
            let shape = shape_of(sh);
            let (kv, ..) = filled_cache(gpu, dtype, shape, ctx, ctx, 97)?;
            let qd = gpu.upload(&rand_f32(98, shape.q_dim(), 2.0)).map_err(e)?;
            let mut out = poisoned(gpu, shape.q_dim())?;
            let plan = step_plan_with(gpu, shape, 1, dtype, config).map_err(e)?;
            let mut pos = StepPos::new(gpu).map_err(e)?;
            pos.set(gpu, ctx - 1, step_chunk(&plan, ctx)).map_err(e)?;
            let mut scratch = AttnScratch::new(gpu, shape, 1).map_err(e)?;
            gpu.sync().map_err(e)?;
            let stream = gpu.stream().clone();
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(e)?;
            let captured = (0..LAUNCHES)
                .try_for_each(|_| attention_at(gpu, &qd, &kv, shape, 1, &mut out, &plan, &pos, &mut scratch));
            let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
            captured.map_err(e)?;
            let graph = graph.ok_or_else(|| format!("{sh:?}: the capture gave no graph"))?;
            let secs = median_seconds(gpu, 50, || graph.launch().map_err(e))? / LAUNCHES as f64;
            let bytes = ctx * kv.bytes_per_position();
            println!(
                "     timing: attention row {dtype:?} {sh:?} ctx {ctx} ({} splits of {}, clusters of {}): {:.2} us per \
                 launch, KV {} KB = {:.2} us at 4.25 TB/s",
                ctx.div_ceil(step_chunk(&plan, ctx)),
                step_chunk(&plan, ctx),
                plan.row_cluster(),
                secs * 1e6,
                bytes / 1000,
                bytes as f64 / 4.25e12 * 1e6
            );
            let got = gpu.download(&out).map_err(e)?;
            let mut want = poisoned(gpu, shape.q_dim())?;
            attention_with(gpu, &qd, &kv, shape, ctx - 1, 1, &mut want, config).map_err(e)?;
            exact(&format!("timing run {dtype:?} {sh:?} ctx {ctx}"), &got, &gpu.download(&want).map_err(e)?)?;
            drop(graph);
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------
// qkv_prepare (attn_qkv_prep_*).

/// A RoPE table of `rotary_dim` rotated dims (base 1e6) with attention factor 1.1 (a dropped factor fails).
fn test_rope(gpu: &Arc<Gpu>, rotary_dim: usize) -> Result<RopeTable, String> {
    let inv_freq =
        (0..rotary_dim / 2).map(|i| (1.0 / 1e6f64.powf(2.0 * i as f64 / rotary_dim as f64)) as f32).collect();
    RopeTable::new(gpu, &Rope { rotary_dim, inv_freq, attention_factor: 1.1 }).map_err(e)
}

/// (heads, kv_heads, head_dim, rotary_dim): Qwen3-30B-A3B (full rotary), Qwen3-Next (partial: 64 of 256), and
/// small ones (half rotary; head_dim 16).
const PREP_SHAPES: [(usize, usize, usize, usize); 8] = [
    (32, 4, 128, 128),
    (16, 2, 256, 64),
    (8, 2, 64, 32),
    (6, 1, 16, 16),
    // The kernel's register path takes each (head_dim / 32, rotary half / 32)
    // above and these: (2, 1), (4, 1), (8, 4), (8, 2); (64, 32) and head_dim
    // 16 take its generic path.
    (4, 2, 64, 64),
    (8, 2, 128, 64),
    (4, 1, 256, 256),
    (4, 2, 256, 128),
];

/// Every byte of a cache (K, V values and, for int8, the scales).
fn cache_bytes(gpu: &Arc<Gpu>, kv: &DeviceKv) -> Result<Vec<u8>, String> {
    let stream = gpu.stream();
    let mut out = stream.clone_dtoh(&kv.k).map_err(e)?;
    out.extend(stream.clone_dtoh(&kv.v).map_err(e)?);
    for sc in [&kv.k_scale, &kv.v_scale] {
        out.extend(stream.clone_dtoh(sc).map_err(e)?.iter().flat_map(|f| f.to_le_bytes()));
    }
    gpu.sync().map_err(e)?;
    Ok(out)
}

/// `qkv_prepare` and `qkv_prepare_at` against the unfused sequence (`dense::split_q_gate` when gated,
/// `dense::rmsnorm_rope` of q and of k, `kv_append`) on the same projection: qn, the gate and the cache must be
/// the same bits (exact compare), for plain and gated rows, 1, 3 and 17 rows, at positions 0, 1234 and 40000
/// (angles past the fast sincosf range), full and partial rotary. Row 0 has an all-zero K head and V head (an
/// int8 scale of 0 after the norm); the cache rows around the appended ones (and the whole cache when small)
/// must be untouched.
fn qkv_prepare_exact(gpu: &Arc<Gpu>, dtype: KvDtype) -> Result<(), String> {
    let eps = 1e-6f32;
    for (si, &(heads, kv_heads, hd, rot)) in PREP_SHAPES.iter().enumerate() {
        let table = test_rope(gpu, rot)?;
        let shape = AttentionShape { heads, kv_heads, head_dim: hd };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let norm = |seed| rand_f32(seed, hd, 0.3).iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let q_norm = gpu.upload(&norm(8000 + si as u64)).map_err(e)?;
        let k_norm = gpu.upload(&norm(8100 + si as u64)).map_err(e)?;
        for gated in [false, true] {
            let prep = QkvPrep { heads, gated, q_norm: &q_norm, k_norm: &k_norm, eps, rope: &table };
            let qw = if gated { 2 * qd } else { qd };
            let width = qw + 2 * kvd;
            for rows in [1usize, 3, 17] {
                for start in [0usize, 1234, 40000] {
                    let what =
                        format!("{dtype:?} {heads}/{kv_heads}x{hd} rot {rot} gated {gated} rows {rows} at {start}");
                    let seed = 8200 + (si * 1000 + rows * 10 + start % 7) as u64 + gated as u64 * 500;
                    let mut qkv = rand_f32(seed, rows * width, 1.0);
                    qkv[qw..qw + hd].fill(0.0);
                    qkv[qw + kvd..qw + kvd + hd].fill(0.0);
                    let capacity = start + rows + 2;
                    let mut kv_ref = DeviceKv::new(gpu, dtype, capacity, kv_heads, hd).map_err(e)?;
                    let mut kv_fused = DeviceKv::new(gpu, dtype, capacity, kv_heads, hd).map_err(e)?;
                    let mut kv_at = DeviceKv::new(gpu, dtype, capacity, kv_heads, hd).map_err(e)?;

                    // The unfused sequence on the host-split parts.
                    let part = |lo: usize, n: usize| -> Vec<f32> {
                        qkv.chunks_exact(width).flat_map(|r| r[lo..lo + n].iter().copied()).collect()
                    };
                    let qg_d = gpu.upload(&part(0, qw)).map_err(e)?;
                    let k_d = gpu.upload(&part(qw, kvd)).map_err(e)?;
                    let v_d = gpu.upload(&part(qw + kvd, kvd)).map_err(e)?;
                    let mut gate_ref = poisoned(gpu, rows * qd)?;
                    let q_d = if gated {
                        let mut q = poisoned(gpu, rows * qd)?;
                        dense::split_q_gate(gpu, &qg_d, heads, hd, &mut q, &mut gate_ref).map_err(e)?;
                        q
                    } else {
                        qg_d
                    };
                    let mut qn_ref = poisoned(gpu, rows * qd)?;
                    let mut kn_ref = poisoned(gpu, rows * kvd)?;
                    dense::rmsnorm_rope(gpu, &q_d, &q_norm, eps, heads, start, &table, &mut qn_ref).map_err(e)?;
                    dense::rmsnorm_rope(gpu, &k_d, &k_norm, eps, kv_heads, start, &table, &mut kn_ref).map_err(e)?;
                    kv_append(gpu, &mut kv_ref, &kn_ref, &v_d, start, rows).map_err(e)?;

                    // Fused, host position and device position.
                    let qkv_d = gpu.upload(&qkv).map_err(e)?;
                    let mut qn = poisoned(gpu, rows * qd)?;
                    let mut gate = if gated { Some(poisoned(gpu, rows * qd)?) } else { None };
                    qkv_prepare(gpu, &prep, &qkv_d, rows, &mut kv_fused, start, &mut qn, gate.as_mut()).map_err(e)?;
                    let mut pos = StepPos::new(gpu).map_err(e)?;
                    pos.set(gpu, start, 1).map_err(e)?;
                    let mut qn_at = poisoned(gpu, rows * qd)?;
                    let mut gate_at = if gated { Some(poisoned(gpu, rows * qd)?) } else { None };
                    qkv_prepare_at(gpu, &prep, &qkv_d, rows, &mut kv_at, &pos, &mut qn_at, gate_at.as_mut())
                        .map_err(e)?;

                    let qn_want = gpu.download(&qn_ref).map_err(e)?;
                    all_finite(&format!("{what}: reference qn"), &qn_want)?;
                    exact(&format!("{what}: qn"), &gpu.download(&qn).map_err(e)?, &qn_want)?;
                    exact(&format!("{what}: qn (at)"), &gpu.download(&qn_at).map_err(e)?, &qn_want)?;
                    if let (Some(g), Some(ga)) = (&gate, &gate_at) {
                        let gate_want = gpu.download(&gate_ref).map_err(e)?;
                        exact(&format!("{what}: gate"), &gpu.download(g).map_err(e)?, &gate_want)?;
                        exact(&format!("{what}: gate (at)"), &gpu.download(ga).map_err(e)?, &gate_want)?;
                    }
                    let first = start.saturating_sub(1);
                    for p in first..capacity {
                        let want = cache_row(gpu, &kv_ref, p)?;
                        if cache_row(gpu, &kv_fused, p)? != want {
                            return Err(format!("{what}: cache position {p} differs from kv_append's"));
                        }
                        if cache_row(gpu, &kv_at, p)? != want {
                            return Err(format!("{what}: cache position {p} (at) differs from kv_append's"));
                        }
                    }
                    if capacity < 2000 {
                        let want = cache_bytes(gpu, &kv_ref)?;
                        if cache_bytes(gpu, &kv_fused)? != want || cache_bytes(gpu, &kv_at)? != want {
                            return Err(format!("{what}: the whole cache differs from kv_append's"));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn qkv_prepare_int8_exact(gpu: &Arc<Gpu>) -> Result<(), String> {
    qkv_prepare_exact(gpu, KvDtype::Int8)
}

fn qkv_prepare_bf16_exact(gpu: &Arc<Gpu>) -> Result<(), String> {
    qkv_prepare_exact(gpu, KvDtype::Bf16)
}

/// Wrong lengths, a missing or extra gate, positions past the capacity and a rotary_dim past head_dim are refused
/// before any launch (and a correct call is accepted).
fn qkv_prepare_rejects_bad_arguments(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (heads, kv_heads, hd) = (8usize, 2usize, 64usize);
    let (qd, kvd) = (heads * hd, kv_heads * hd);
    let table = test_rope(gpu, 64)?;
    let wide = test_rope(gpu, 128)?;
    let q_norm = gpu.upload(&rand_f32(1, hd, 1.0)).map_err(e)?;
    let short_norm = gpu.upload(&rand_f32(2, hd - 1, 1.0)).map_err(e)?;
    let rows = 3;
    let width = qd + 2 * kvd;
    let gated_width = 2 * qd + 2 * kvd;
    let qkv = gpu.upload(&rand_f32(3, rows * gated_width, 1.0)).map_err(e)?;
    let qkv_short = gpu.upload(&rand_f32(4, rows * width - 1, 1.0)).map_err(e)?;
    let mut kv = DeviceKv::new(gpu, KvDtype::Int8, 8, kv_heads, hd).map_err(e)?;
    let mut qn = poisoned(gpu, rows * qd)?;
    let mut qn_short = poisoned(gpu, rows * qd - 1)?;
    let qkv9 = gpu.upload(&rand_f32(5, 9 * width, 1.0)).map_err(e)?;
    let mut qn9 = poisoned(gpu, 9 * qd)?;
    let mut gate = poisoned(gpu, rows * qd)?;
    let mut gate_short = poisoned(gpu, rows * qd - 1)?;
    let mut pos = StepPos::new(gpu).map_err(e)?;
    pos.set(gpu, 0, 1).map_err(e)?;
    let plain = QkvPrep { heads, gated: false, q_norm: &q_norm, k_norm: &q_norm, eps: 1e-6, rope: &table };
    let gated = QkvPrep { gated: true, ..plain };
    let mut failures = Vec::new();
    if let Err(err) = qkv_prepare(gpu, &plain, &qkv, rows, &mut kv, 5, &mut qn, None) {
        failures.push(format!("a correct call refused: {err}"));
    }
    if let Err(err) = qkv_prepare(gpu, &gated, &qkv, rows, &mut kv, 0, &mut qn, Some(&mut gate)) {
        failures.push(format!("a correct gated call refused: {err}"));
    }
    let bad_norm = QkvPrep { q_norm: &short_norm, ..plain };
    let bad_k_norm = QkvPrep { k_norm: &short_norm, ..plain };
    let bad_rope = QkvPrep { rope: &wide, ..plain };
    let no_heads = QkvPrep { heads: 0, ..plain };
    let cases: [(&str, bool); 12] = [
        ("q_norm of head_dim - 1", qkv_prepare(gpu, &bad_norm, &qkv, rows, &mut kv, 0, &mut qn, None).is_ok()),
        ("k_norm of head_dim - 1", qkv_prepare(gpu, &bad_k_norm, &qkv, rows, &mut kv, 0, &mut qn, None).is_ok()),
        ("rotary_dim 128 > head_dim 64", qkv_prepare(gpu, &bad_rope, &qkv, rows, &mut kv, 0, &mut qn, None).is_ok()),
        ("0 heads", qkv_prepare(gpu, &no_heads, &qkv, rows, &mut kv, 0, &mut qn, None).is_ok()),
        ("qkv one value short", qkv_prepare(gpu, &plain, &qkv_short, rows, &mut kv, 0, &mut qn, None).is_ok()),
        (
            "gated qkv of plain width",
            qkv_prepare(gpu, &gated, &qkv_short, rows, &mut kv, 0, &mut qn, Some(&mut gate)).is_ok(),
        ),
        ("qn one value short", qkv_prepare(gpu, &plain, &qkv, rows, &mut kv, 0, &mut qn_short, None).is_ok()),
        ("gated without a gate", qkv_prepare(gpu, &gated, &qkv, rows, &mut kv, 0, &mut qn, None).is_ok()),
        ("plain with a gate", qkv_prepare(gpu, &plain, &qkv, rows, &mut kv, 0, &mut qn, Some(&mut gate)).is_ok()),
        (
            "a gate one value short",
            qkv_prepare(gpu, &gated, &qkv, rows, &mut kv, 0, &mut qn, Some(&mut gate_short)).is_ok(),
        ),
        ("positions past the capacity", qkv_prepare(gpu, &plain, &qkv, rows, &mut kv, 6, &mut qn, None).is_ok()),
        ("(at) rows past the capacity", qkv_prepare_at(gpu, &plain, &qkv9, 9, &mut kv, &pos, &mut qn9, None).is_ok()),
    ];
    failures.extend(cases.iter().filter(|c| c.1).map(|c| format!("accepted: {}", c.0)));
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join(", "))
    }
}
