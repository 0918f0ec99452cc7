//! GPU tests of kernels/moe.cu against the CPU reference (`strata::moe`,
//! `strata::backend::cpu::ops::expert_ffn_row`, `strata::quant::nvfp4`).
//!
//! Expert weights are NVFP4 made by `quantize_with_global` with global scales
//! far from 1 and different for gate, up and down (and per expert), so a
//! kernel that drops or mixes up a global scale cannot pass; one test also
//! asserts the result is far from what a dropped down scale would give.
//!
//! Tolerances (`check_close`: max |got - want| / max |want|):
//! - f32 paths (route, GEMVs, SIMT grouped path, combine): 1e-5. The kernels
//!   decode NVFP4 exactly and accumulate in f32 like the CPU; only the order
//!   of the sums differs (a few ulps of the largest terms).
//! - tensor-core grouped path: 1e-2. x and the activations are rounded to
//!   bf16 (relative error 2^-9 per element) before the MMA; the weights are
//!   exact in bf16 (e2m1 * e4m3) and accumulation is f32, so each dot product
//!   carries about 2^-9 of its magnitude per stage, two stages (gate/up, down)
//!   compound to a few 1e-3 of max |out|.
//! - tensor-core grouped path with `GroupedPrecision::Split`: 1e-4. x and the
//!   activations go in as bf16 hi + lo, lo = bf16(a - hi), so each operand
//!   carries ~2^-17 of its magnitude (at most 2^-16); the weights are exact
//!   and accumulation is f32, so the two stages stay at ~1e-5 of max |out|
//!   (the bf16 path's error times ~2^-8, plus the f32 summation order).

use std::sync::Arc;

use strata::backend::cpu::ops::{expert_ffn, expert_ffn_row, silu};
use strata::backend::cuda::moe::{self as gm, BlobLayout, GroupedPrecision};
use strata::backend::cuda::{CudaSlice, DevicePtr, Gpu, PREWAIT_DOWN};
use strata::backend::{Backend, CpuBackend, ExpertRows, Matrix};
use strata::moe::{self, ExpertSource, MoeLayer, Routing};
use strata::pack::format::ExpertLayout;
use strata::pack::ExpertView;
use strata::quant::nvfp4::{quantize_with_global, Nvfp4Owned};
use strata::rng::Rng;

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("moe_route_topk_matches_moe_route", route_topk_matches_moe_route),
    ("moe_gemv_matches_expert_ffn_row", gemv_matches_expert_ffn_row),
    ("moe_gemv_shared_expert_accumulates", gemv_shared_expert_accumulates),
    ("moe_gemv_bad_expert_id_gives_nan_rows", gemv_bad_expert_id_gives_nan_rows),
    ("moe_routed_gemvs_bad_expert_id_give_nan_rows", routed_gemvs_bad_expert_id_give_nan_rows),
    ("moe_gemv_wide_range_and_slices", gemv_wide_range_and_slices),
    ("moe_decode_pipeline_matches_moe_forward", decode_pipeline_matches_moe_forward),
    ("moe_fused_decode_matches_two_launches", fused_decode_matches_two_launches),
    ("moe_group_by_expert_matches_cpu", group_by_expert_matches_cpu),
    ("moe_grouped_matches_cpu_forward", grouped_matches_cpu_forward),
    ("moe_grouped_split_precision", grouped_split_precision),
    ("moe_gemv_any_multiple_of_16", gemv_any_multiple_of_16),
    ("moe_grouped_any_multiple_of_16", grouped_any_multiple_of_16),
    ("moe_shared_expert_every_token_count", shared_expert_every_token_count),
    ("moe_results_are_deterministic", results_are_deterministic),
    ("moe_decode_gemv_timing", decode_gemv_timing),
    ("moe_prefill_grouped_timing", prefill_grouped_timing),
];

/// Global scales of expert 0 (gate, up, down); expert e multiplies them by
/// (1 + 0.03 e), (1 + 0.05 e), (1 + 0.07 e).
const G_GATE: f32 = 1e-3;
const G_UP: f32 = 37.0;
const G_DOWN: f32 = 2.5e-4;

/// Floors the timing lines compare against (H200: measured HBM, dense BF16 tensor rate).
const HBM_BYTES_PER_S: f64 = 4.3e12;
const BF16_FLOPS: f64 = 790e12;

const F32_TOL: f32 = 1e-5;
const BF16_TOL: f32 = 1e-2;
const SPLIT_TOL: f32 = 1e-4;

/// Random NVFP4 experts on the host, in `ExpertLayout` blob form too.
struct HostExperts {
    layout: ExpertLayout,
    mats: Vec<[Nvfp4Owned; 3]>,
}

impl HostExperts {
    fn random(seed: u64, hidden: usize, inter: usize, n: usize) -> HostExperts {
        let mats = (0..n)
            .map(|ex| {
                let f = ex as f32;
                let g = [G_GATE * (1.0 + 0.03 * f), G_UP * (1.0 + 0.05 * f), G_DOWN * (1.0 + 0.07 * f)];
                let s = seed * 1000 + ex as u64 * 3;
                // Weights of about 20 g: block scales near 8, well inside E4M3's range.
                [
                    quantize_with_global(&rand_f32(s, inter * hidden, 20.0 * g[0]), inter, hidden, g[0]),
                    quantize_with_global(&rand_f32(s + 1, inter * hidden, 20.0 * g[1]), inter, hidden, g[1]),
                    quantize_with_global(&rand_f32(s + 2, hidden * inter, 20.0 * g[2]), hidden, inter, g[2]),
                ]
            })
            .collect();
        HostExperts { layout: ExpertLayout::new(hidden as u64, inter as u64), mats }
    }

    fn view(&self, ex: usize) -> ExpertView<'_> {
        let m = &self.mats[ex];
        ExpertView { gate: m[0].view(), up: m[1].view(), down: m[2].view(), blob: &[] }
    }

    /// All blobs, `stride` bytes each, as docs/pack-format.md lays them out.
    fn blob_bytes(&self) -> Vec<u8> {
        let l = &self.layout;
        let stride = l.stride as usize;
        let mut out = vec![0u8; stride * self.mats.len()];
        for (ex, m) in self.mats.iter().enumerate() {
            let b = &mut out[ex * stride..(ex + 1) * stride];
            let put = |b: &mut [u8], at: u64, src: &[u8]| b[at as usize..at as usize + src.len()].copy_from_slice(src);
            put(b, l.gate_codes, &m[0].codes);
            put(b, l.gate_scales, &m[0].scales);
            put(b, l.up_codes, &m[1].codes);
            put(b, l.up_scales, &m[1].scales);
            put(b, l.down_codes, &m[2].codes);
            put(b, l.down_scales, &m[2].scales);
            let mut tail = Vec::with_capacity(16);
            for g in [m[0].global_scale, m[1].global_scale, m[2].global_scale] {
                tail.extend_from_slice(&g.to_le_bytes());
            }
            tail.extend_from_slice(&0u32.to_le_bytes());
            put(b, l.tail, &tail);
        }
        out
    }
}

impl ExpertSource for HostExperts {
    fn expert(&self, _layer: usize, expert: usize) -> strata::Result<ExpertView<'_>> {
        Ok(self.view(expert))
    }
}

/// Blobs on the device and their table of addresses.
struct DeviceExperts {
    _blobs: CudaSlice<u8>,
    table: CudaSlice<u64>,
    layout: BlobLayout,
}

fn table_of(gpu: &Gpu, blobs: &CudaSlice<u8>, stride: u64, n: usize) -> Result<CudaSlice<u64>, String> {
    let base = {
        let (ptr, _sync) = blobs.device_ptr(gpu.stream());
        ptr
    };
    let table: Vec<u64> = (0..n as u64).map(|ex| base + ex * stride).collect();
    gpu.upload(&table).map_err(e)
}

fn upload_experts(gpu: &Gpu, host: &HostExperts) -> Result<DeviceExperts, String> {
    let blobs = gpu.upload(&host.blob_bytes()).map_err(e)?;
    let table = table_of(gpu, &blobs, host.layout.stride, host.mats.len())?;
    Ok(DeviceExperts { _blobs: blobs, table, layout: BlobLayout::from(&host.layout) })
}

/// The CPU act of one expert: `silu(gate . x) * (up . x)`.
fn cpu_act(ev: &ExpertView<'_>, x: &[f32]) -> Vec<f32> {
    (0..ev.gate.rows).map(|i| silu(ev.gate.row_dot(i, x)) * ev.up.row_dot(i, x)).collect()
}

/// For each token, `k` distinct experts of `n` (a random prefix of a shuffle).
fn random_ids(seed: u64, tokens: usize, k: usize, n: usize) -> Vec<u32> {
    let mut r = Rng::new(seed);
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut all: Vec<u32> = (0..n as u32).collect();
        for i in 0..k {
            let j = i + r.below((n - i) as u64) as usize;
            all.swap(i, j);
        }
        ids.extend_from_slice(&all[..k]);
    }
    ids
}

fn download(gpu: &Gpu, d: &CudaSlice<f32>) -> Result<Vec<f32>, String> {
    gpu.download(d).map_err(e)
}

fn download_u32(gpu: &Gpu, d: &CudaSlice<u32>) -> Result<Vec<u32>, String> {
    gpu.download(d).map_err(e)
}

// ---------------------------------------------------------------------------

fn route_topk_matches_moe_route(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &num_experts in &[8usize, 128, 512] {
        for &k in &[1usize, 8, 10] {
            if k > num_experts {
                continue;
            }
            for norm in [false, true] {
                let tokens = 37;
                let mut logits = rand_f32(num_experts as u64 * 31 + k as u64, tokens * num_experts, 2.0);
                // Token 0: all tied (experts 0..k win); token 1: few distinct values (many ties);
                // token 2: the top value tied across scattered experts.
                logits[..num_experts].fill(0.25);
                for v in &mut logits[num_experts..2 * num_experts] {
                    *v = (*v * 0.5).round();
                }
                for ex in (0..num_experts).step_by(3) {
                    logits[2 * num_experts + ex] = 9.0;
                }
                let want: Routing = moe::route(&logits, num_experts, k, norm);
                let d_logits = gpu.upload(&logits).map_err(e)?;
                let mut ids = gpu.alloc_zeros::<u32>(tokens * k).map_err(e)?;
                gpu.fill_random_u32(&mut ids, 7).map_err(e)?;
                let mut weights = poisoned(gpu, tokens * k)?;
                gm::route_topk(gpu, &d_logits, tokens, num_experts, k, norm, &mut ids, &mut weights).map_err(e)?;
                let got_ids = download_u32(gpu, &ids)?;
                let want_ids: Vec<u32> = want.experts.iter().map(|&x| x as u32).collect();
                if got_ids != want_ids {
                    let t = (0..tokens).find(|&t| got_ids[t * k..(t + 1) * k] != want_ids[t * k..(t + 1) * k]).unwrap();
                    return Err(format!(
                        "E={num_experts} k={k} norm={norm}: token {t} experts {:?}, want {:?}",
                        &got_ids[t * k..(t + 1) * k],
                        &want_ids[t * k..(t + 1) * k]
                    ));
                }
                let got_w = download(gpu, &weights)?;
                check_close(
                    &format!("route weights E={num_experts} k={k} norm={norm}"),
                    &got_w,
                    &want.weights,
                    F32_TOL,
                )?;
            }
        }
    }
    Ok(())
}

/// Runs `check` with the expert GEMVs on tensor cores (for a `routed` check, which launches the routed decode
/// pair, also with their weights staged in shared memory: `Gpu::set_staged_moe`) and, where the device has them,
/// again on CUDA cores (`Gpu::set_tc_gemv`, test-hooks builds; others run the device's default once), then
/// restores the settings. A failure names the kernels.
fn each_gemv_kernel(gpu: &Gpu, routed: bool, check: impl Fn() -> Result<(), String>) -> Result<(), String> {
    #[cfg(feature = "test-hooks")]
    {
        let prev = gpu.set_tc_gemv(true);
        let prev_staged = gpu.set_staged_moe(routed);
        let tc = gpu.tc_gemv();
        let name = if !tc {
            "CUDA cores"
        } else if gpu.staged_moe() {
            "tensor cores, staged"
        } else {
            "tensor cores"
        };
        let mut r = check().map_err(|m| format!("{name}: {m}"));
        if r.is_ok() && gpu.staged_moe() {
            gpu.set_staged_moe(false);
            r = check().map_err(|m| format!("tensor cores: {m}"));
        }
        if r.is_ok() && tc {
            gpu.set_tc_gemv(false);
            r = check().map_err(|m| format!("CUDA cores: {m}"));
        }
        gpu.set_tc_gemv(prev);
        gpu.set_staged_moe(prev_staged);
        MEMO.with(|m| m.borrow_mut().clear());
        r
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = (gpu, routed);
        let r = check();
        MEMO.with(|m| m.borrow_mut().clear());
        r
    }
}

/// The decode GEMVs against expert_ffn_row for T in {1, 3} and three shapes,
/// with overwrite and accumulate, and a check that the down scale matters,
/// on tensor cores and on CUDA cores (each_gemv_kernel). The model sizes
/// (k = 8 of I = 768, k = 10 of I = 512) at T = 1 and 3, and the largest k
/// (16: 48 parts of the tensor-core down GEMV, more than its 24 warps; the
/// CUDA-core one's second expert slot in every warp, 48 KB of staged act
/// rows) at T = 1 and 8.
fn gemv_matches_expert_ffn_row(gpu: &Arc<Gpu>) -> Result<(), String> {
    each_gemv_kernel(gpu, false, || {
        for &(h, i, n_exp, k) in &[(64usize, 32usize, 12usize, 10usize), (2048, 768, 10, 8), (2048, 512, 12, 10)] {
            check_gemv(gpu, h, i, n_exp, k, &[1, 3])?;
        }
        check_gemv(gpu, 2048, 768, 20, 16, &[1, 8])?;
        check_gemv(gpu, 256, 64, 17, 16, &[2, 5])
    })
}

/// The tensor-core GEMVs' edges. H = 2304 is 9 slices of 256, so a gate/up
/// warp takes two (I = 256: the down GEMV's one slice per expert). x far
/// from f16's normal range (3e5: f16 overflows at 65504; 1e-7: f16
/// subnormals, a bit or two of precision) must come out as accurate as at
/// 1, which the power-of-two prescale gives (the down GEMV's act rows
/// follow x's magnitude); slices of 3e5 or 3e-7 beside all-zero slices
/// (a zero slice's prescale), one magnitude a row.
fn gemv_wide_range_and_slices(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_gemv(gpu, 2304, 256, 9, 4, &[1, 2])?;
    check_gemv_x(gpu, 2048, 768, 10, 8, &[1], " x*3e5", &|_, v| v * 3.0e5)?;
    check_gemv_x(gpu, 2048, 768, 10, 8, &[1], " x*1e-7", &|_, v| v * 1.0e-7)?;
    // Slice s of 256: huge (s % 3 == 0), tiny (1) or zero (2).
    let mag = |c: usize| [3.0e5f32, 3.0e-7, 0.0][(c / 256) % 3];
    check_gemv_x(gpu, 2304, 256, 9, 4, &[1], " huge slices", &|c, v| if mag(c) > 1.0 { v * mag(c) } else { 0.0 })?;
    check_gemv_x(gpu, 2304, 256, 9, 4, &[1], " tiny slices", &|c, v| if mag(c) < 1.0 { v * mag(c) } else { 0.0 })?;
    Ok(())
}

/// An expert id at or past the table's length (a corrupt routing) makes the
/// act rows of that assignment and the out row of its token NaN, and leaves
/// the other tokens right: never a wild read, never a silent zero. T = 3,
/// k = 10 (the bad ids at j = 2 of token 0 and j = 9 of token 2: both expert
/// slots of the fast CUDA-core down GEMV's warps), the tensor-core, fast and
/// generic kernels (each_gemv_kernel).
fn gemv_bad_expert_id_gives_nan_rows(gpu: &Arc<Gpu>) -> Result<(), String> {
    each_gemv_kernel(gpu, false, || {
        for &(h, i) in &[(2048usize, 512usize), (64, 32), (48, 16)] {
            let (n_exp, k, tokens) = (12usize, 10usize, 3usize);
            let host = HostExperts::random(70 + i as u64, h, i, n_exp);
            let dev = upload_experts(gpu, &host)?;
            let x = rand_f32(71, tokens * h, 1.0);
            let mut ids = random_ids(72, tokens, k, n_exp);
            ids[2] = n_exp as u32 + 5;
            ids[2 * k + 9] = u32::MAX;
            let weights: Vec<f32> = rand_f32(73, tokens * k, 1.0).iter().map(|v| 0.05 + v.abs()).collect();
            let d_x = gpu.upload(&x).map_err(e)?;
            let d_ids = gpu.upload(&ids).map_err(e)?;
            let d_w = gpu.upload(&weights).map_err(e)?;
            let mut act = poisoned(gpu, tokens * k * i)?;
            gm::expert_gate_up_gemv(gpu, &d_x, &d_ids, &dev.table, &dev.layout, tokens, k, &mut act).map_err(e)?;
            let mut out = gpu.upload(&rand_f32(74, tokens * h, 1.0)).map_err(e)?;
            gm::expert_down_gemv(gpu, &act, &d_ids, &d_w, &dev.table, &dev.layout, tokens, k, &mut out, false)
                .map_err(e)?;
            let got_act = download(gpu, &act)?;
            let got = download(gpu, &out)?;
            let what = format!("H={h} I={i} bad ids");
            for a in [2usize, 2 * k + 9] {
                if let Some(p) = got_act[a * i..(a + 1) * i].iter().position(|v| !v.is_nan()) {
                    return Err(format!("{what}: act[{a}][{p}] = {} is not NaN", got_act[a * i + p]));
                }
            }
            for t in [0usize, 2] {
                if let Some(p) = got[t * h..(t + 1) * h].iter().position(|v| !v.is_nan()) {
                    return Err(format!("{what}: out[{t}][{p}] = {} is not NaN", got[t * h + p]));
                }
            }
            // Token 1 is untouched by the bad ids.
            let mut want = vec![0.0f32; h];
            let mut y = vec![0.0f32; h];
            for j in 0..k {
                expert_ffn_row(&host.view(ids[k + j] as usize), &x[h..2 * h], &mut y);
                for (o, v) in want.iter_mut().zip(&y) {
                    *o += weights[k + j] * v;
                }
            }
            check_close(&format!("{what}: out[1]"), &got[h..2 * h], &want, F32_TOL)?;
        }
        Ok(())
    })
}

/// The (hidden, intermediate) sizes of the fixture models' routed and shared
/// experts, (48, 16), and the other mixes of "multiple of 32" and "multiple
/// of 16 only" (the kernels reduce over H for gate/up and I for down: each
/// matrix takes the fast 32-element kernel or the generic 16-element one).
const SMALL_SHAPES: &[(usize, usize)] = &[(64, 32), (96, 48), (64, 48), (96, 32), (48, 16), (48, 32), (16, 16)];

/// The decode GEMVs at every SMALL_SHAPES size (hidden and intermediate any
/// multiples of 16), with the fixtures' k = 2 of 8 experts and k = 10 of 12,
/// T in {1, 3, 8}: act, out (overwrite and accumulate) against expert_ffn_row.
fn gemv_any_multiple_of_16(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(h, i) in SMALL_SHAPES {
        check_gemv(gpu, h, i, 8, 2, &[1, 3, 8])?;
        check_gemv(gpu, h, i, 12, 10, &[1, 3])?;
    }
    Ok(())
}

/// gate/up GEMV then down GEMV against the CPU for each token count: act with
/// F32_TOL (and not what g_gate = 1 gives), out overwritten (poisoned first;
/// not what g_down = 1 gives) and accumulated onto a prior.
/// One `check_gemv_x` case's inputs and CPU results (`gemv_reference`).
struct GemvReference {
    x: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    prior: Vec<f32>,
    want_act: Vec<f32>,
    want_out: Vec<f32>,
    /// With the down (gate) global scale taken as 1: a result that matches
    /// these dropped the scale.
    want_no_gdown: Vec<f32>,
    want_act_no_ggate: Vec<f32>,
}

/// The CPU side of a `check_gemv_x` case: act per assignment, out per token
/// summed in j order.
fn gemv_reference(
    host: &HostExperts,
    h: usize,
    i: usize,
    n_exp: usize,
    k: usize,
    tokens: usize,
    x_of: &dyn Fn(usize, f32) -> f32,
) -> GemvReference {
    let seed = (h * 7 + i * 3 + tokens) as u64;
    let x: Vec<f32> = rand_f32(seed, tokens * h, 1.0).iter().enumerate().map(|(n, &v)| x_of(n % h, v)).collect();
    let ids = random_ids(seed + 1, tokens, k, n_exp);
    let weights: Vec<f32> = rand_f32(seed + 2, tokens * k, 1.0).iter().map(|v| 0.05 + v.abs()).collect();
    let prior = rand_f32(seed + 3, tokens * h, 1.0);
    let mut want_act = Vec::with_capacity(tokens * k * i);
    let mut want_out = vec![0.0f32; tokens * h];
    let mut want_no_gdown = vec![0.0f32; tokens * h];
    let mut want_act_no_ggate = Vec::with_capacity(tokens * k * i);
    let mut y = vec![0.0f32; h];
    for t in 0..tokens {
        let xt = &x[t * h..(t + 1) * h];
        for j in 0..k {
            let ev = host.view(ids[t * k + j] as usize);
            want_act.extend(cpu_act(&ev, xt));
            let mut no_gate = ev;
            no_gate.gate.global_scale = 1.0;
            want_act_no_ggate.extend(cpu_act(&no_gate, xt));
            let w = weights[t * k + j];
            expert_ffn_row(&ev, xt, &mut y);
            for (o, v) in want_out[t * h..(t + 1) * h].iter_mut().zip(&y) {
                *o += w * v;
            }
            let mut no_down = ev;
            no_down.down.global_scale = 1.0;
            expert_ffn_row(&no_down, xt, &mut y);
            for (o, v) in want_no_gdown[t * h..(t + 1) * h].iter_mut().zip(&y) {
                *o += w * v;
            }
        }
    }
    GemvReference { x, ids, weights, prior, want_act, want_out, want_no_gdown, want_act_no_ggate }
}

thread_local! {
    /// `memo`'s values by name, dropped at the end of each `each_gemv_kernel`.
    static MEMO: std::cell::RefCell<std::collections::HashMap<String, std::rc::Rc<dyn std::any::Any>>> =
        Default::default();
}

/// `make()`'s value, made once per `each_gemv_kernel` call under `name`: the
/// kernel families it runs a check on share the check's CPU reference.
fn memo<T: 'static>(name: String, make: impl FnOnce() -> T) -> std::rc::Rc<T> {
    if let Some(v) = MEMO.with(|m| m.borrow().get(&name).cloned()) {
        if let Ok(v) = v.downcast::<T>() {
            return v;
        }
    }
    let v = std::rc::Rc::new(make());
    MEMO.with(|m| m.borrow_mut().insert(name, v.clone()));
    v
}

fn check_gemv(gpu: &Gpu, h: usize, i: usize, n_exp: usize, k: usize, token_counts: &[usize]) -> Result<(), String> {
    check_gemv_x(gpu, h, i, n_exp, k, token_counts, "", &|_, v| v)
}

/// check_gemv with x[t][c] replaced by `x_of(c, x[t][c])` (`label` names it).
#[allow(clippy::too_many_arguments)]
fn check_gemv_x(
    gpu: &Gpu,
    h: usize,
    i: usize,
    n_exp: usize,
    k: usize,
    token_counts: &[usize],
    label: &str,
    x_of: &dyn Fn(usize, f32) -> f32,
) -> Result<(), String> {
    let host = memo(format!("experts H={h} I={i} E={n_exp}"), || HostExperts::random(h as u64 + i as u64, h, i, n_exp));
    let dev = upload_experts(gpu, &host)?;
    for &tokens in token_counts {
        let what = format!("H={h} I={i} E={n_exp} k={k} T={tokens}{label}");
        let r = memo(what.clone(), || gemv_reference(&host, h, i, n_exp, k, tokens, x_of));
        let GemvReference { x, ids, weights, prior, want_act, want_out, want_no_gdown, want_act_no_ggate } = &*r;

        let d_x = gpu.upload(x).map_err(e)?;
        let d_ids = gpu.upload(ids).map_err(e)?;
        let d_w = gpu.upload(weights).map_err(e)?;
        let mut act = poisoned(gpu, tokens * k * i)?;
        gm::expert_gate_up_gemv(gpu, &d_x, &d_ids, &dev.table, &dev.layout, tokens, k, &mut act).map_err(e)?;
        let got_act = download(gpu, &act)?;
        check_close(&format!("{what}: act"), &got_act, want_act, F32_TOL)?;
        if check_close("", &got_act, want_act_no_ggate, 0.5).is_ok() {
            return Err(format!("{what}: act matches the result with g_gate = 1: the gate scale is ignored"));
        }

        let mut out = poisoned(gpu, tokens * h)?;
        gm::expert_down_gemv(gpu, &act, &d_ids, &d_w, &dev.table, &dev.layout, tokens, k, &mut out, false)
            .map_err(e)?;
        let got = download(gpu, &out)?;
        check_close(&format!("{what}: out"), &got, want_out, F32_TOL)?;
        // The field report's bug: a path that ignores the down global scale.
        if check_close("", &got, want_no_gdown, 0.5).is_ok() {
            return Err(format!("{what}: out matches the result with g_down = 1: the down scale is ignored"));
        }

        let mut acc = gpu.upload(prior).map_err(e)?;
        gm::expert_down_gemv(gpu, &act, &d_ids, &d_w, &dev.table, &dev.layout, tokens, k, &mut acc, true).map_err(e)?;
        let got = download(gpu, &acc)?;
        let want: Vec<f32> = prior.iter().zip(want_out).map(|(p, w)| p + w).collect();
        check_close(&format!("{what}: out (accumulate)"), &got, &want, F32_TOL)?;
    }
    Ok(())
}

/// The shared expert through the same kernels: a table of one entry, ids 0,
/// k = 1, weights = its sigmoid gate, accumulated onto the routed output; its
/// intermediate size (512) differs from the routed experts' (768).
fn gemv_shared_expert_accumulates(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (h, i_routed, i_shared, k, tokens) = (2048usize, 768usize, 512usize, 8usize, 3usize);
    let routed = HostExperts::random(41, h, i_routed, 9);
    let shared = HostExperts::random(42, h, i_shared, 1);
    let (d_routed, d_shared) = (upload_experts(gpu, &routed)?, upload_experts(gpu, &shared)?);
    let x = rand_f32(43, tokens * h, 1.0);
    let ids = random_ids(44, tokens, k, 9);
    let weights: Vec<f32> = rand_f32(45, tokens * k, 0.3).iter().map(|v| v.abs()).collect();
    let gates: Vec<f32> = rand_f32(46, tokens, 2.0).iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();

    let mut want = vec![0.0f32; tokens * h];
    let mut y = vec![0.0f32; h];
    for t in 0..tokens {
        let xt = &x[t * h..(t + 1) * h];
        for j in 0..k {
            expert_ffn_row(&routed.view(ids[t * k + j] as usize), xt, &mut y);
            for (o, v) in want[t * h..(t + 1) * h].iter_mut().zip(&y) {
                *o += weights[t * k + j] * v;
            }
        }
        expert_ffn_row(&shared.view(0), xt, &mut y);
        for (o, v) in want[t * h..(t + 1) * h].iter_mut().zip(&y) {
            *o += gates[t] * v;
        }
    }

    let d_x = gpu.upload(&x).map_err(e)?;
    let (d_ids, d_w) = (gpu.upload(&ids).map_err(e)?, gpu.upload(&weights).map_err(e)?);
    let (d_zero, d_gates) = (gpu.upload(&vec![0u32; tokens]).map_err(e)?, gpu.upload(&gates).map_err(e)?);
    let mut act = poisoned(gpu, tokens * k * i_routed)?;
    let mut act_sh = poisoned(gpu, tokens * i_shared)?;
    let mut out = poisoned(gpu, tokens * h)?;
    gm::expert_gate_up_gemv(gpu, &d_x, &d_ids, &d_routed.table, &d_routed.layout, tokens, k, &mut act).map_err(e)?;
    gm::expert_down_gemv(gpu, &act, &d_ids, &d_w, &d_routed.table, &d_routed.layout, tokens, k, &mut out, false)
        .map_err(e)?;
    gm::expert_gate_up_gemv(gpu, &d_x, &d_zero, &d_shared.table, &d_shared.layout, tokens, 1, &mut act_sh)
        .map_err(e)?;
    gm::expert_down_gemv(gpu, &act_sh, &d_zero, &d_gates, &d_shared.table, &d_shared.layout, tokens, 1, &mut out, true)
        .map_err(e)?;
    check_close("routed + shared expert", &download(gpu, &out)?, &want, F32_TOL)
}

/// The shared expert as the engine runs it (src/engine/gpu.rs, run_experts):
/// its blob alone in an allocation of `used_len` bytes, a table of one entry,
/// ids all 0, k = 1, weights = per-row sigmoid gates, accumulate = true onto
/// the routed output, for every T in 1..=300 at every SMALL_SHAPES size, by
/// three paths: the GEMVs (the engine's path for T <= 8), the grouped SIMT
/// and the default grouped entry points (its path above), each against
/// prior + gate * expert_ffn_row (F32_TOL; BF16_TOL where the default path
/// runs a matrix on tensor cores). act and y are poisoned before every run.
/// The prior is about as large as the expert's term, and at T = 300 the
/// result must be far from the prior alone and from the term alone.
fn shared_expert_every_token_count(gpu: &Arc<Gpu>) -> Result<(), String> {
    const T_MAX: usize = 300;
    for &(h, i) in SMALL_SHAPES {
        let host = HostExperts::random(7 * h as u64 + i as u64 + 1, h, i, 1);
        let blob = host.blob_bytes();
        let d_blob = gpu.upload(&blob[..host.layout.used_len() as usize]).map_err(e)?;
        let table = table_of(gpu, &d_blob, host.layout.stride, 1)?;
        let layout = BlobLayout::from(&host.layout);
        let seed = (h * 31 + i) as u64;
        let x = rand_f32(seed, T_MAX * h, 1.0);
        let gates: Vec<f32> = rand_f32(seed + 1, T_MAX, 2.0).iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        let ev = host.view(0);
        let mut term = vec![0.0f32; T_MAX * h];
        for (t, row) in term.chunks_exact_mut(h).enumerate() {
            expert_ffn_row(&ev, &x[t * h..(t + 1) * h], row);
            row.iter_mut().for_each(|v| *v *= gates[t]);
        }
        let term_max = term.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let prior = rand_f32(seed + 2, T_MAX * h, 0.5 * term_max);
        let want: Vec<f32> = prior.iter().zip(&term).map(|(p, v)| p + v).collect();

        let d_x = gpu.upload(&x).map_err(e)?;
        let d_zero = gpu.upload(&vec![0u32; T_MAX]).map_err(e)?;
        let d_gates = gpu.upload(&gates).map_err(e)?;
        let mut g = gm::ExpertGrouping::new(gpu, T_MAX, 1).map_err(e)?;
        let mut act = gpu.alloc_zeros::<f32>(T_MAX * i).map_err(e)?;
        let mut y = gpu.alloc_zeros::<f32>(T_MAX * h).map_err(e)?;
        let (tc_gu, tc_down) = gm::grouped_tensor_core_paths(gpu, &layout);
        for tokens in 1..=T_MAX {
            let n = tokens * h;
            for path in ["GEMV", "grouped SIMT", "grouped default"] {
                gpu.fill_f32(&mut act, f32::NAN).map_err(e)?;
                gpu.fill_f32(&mut y, f32::NAN).map_err(e)?;
                let mut out = gpu.upload(&prior[..n]).map_err(e)?;
                if path == "GEMV" {
                    gm::expert_gate_up_gemv(gpu, &d_x, &d_zero, &table, &layout, tokens, 1, &mut act).map_err(e)?;
                    gm::expert_down_gemv(gpu, &act, &d_zero, &d_gates, &table, &layout, tokens, 1, &mut out, true)
                        .map_err(e)?;
                } else {
                    gm::group_by_expert_into(gpu, &d_zero, tokens, 1, &mut g).map_err(e)?;
                    if path == "grouped SIMT" {
                        gm::expert_gate_up_grouped_simple(gpu, &d_x, &g, &table, &layout, &mut act).map_err(e)?;
                        gm::expert_down_grouped_simple(gpu, &act, &g, &table, &layout, &mut y).map_err(e)?;
                    } else {
                        gm::expert_gate_up_grouped(gpu, &d_x, &g, &table, &layout, &mut act).map_err(e)?;
                        gm::expert_down_grouped(gpu, &act, &g, &table, &layout, &mut y).map_err(e)?;
                    }
                    gm::moe_combine(gpu, &y, &g, &d_gates, h, &mut out, true).map_err(e)?;
                }
                let got = download(gpu, &out)?;
                let tol = if path == "grouped default" && (tc_gu || tc_down) { BF16_TOL } else { F32_TOL };
                let what = format!("shared expert H={h} I={i} T={tokens} {path}");
                check_close(&what, &got, &want[..n], tol)?;
                if tokens == T_MAX {
                    if check_close("", &got, &prior[..n], 0.2).is_ok() {
                        return Err(format!("{what}: the result is the prior: the expert's term is missing"));
                    }
                    if check_close("", &got, &term[..n], 0.2).is_ok() {
                        return Err(format!("{what}: the result is the expert's term: the prior was overwritten"));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Decode end to end against `moe::forward` (the CPU pipeline): router
/// logits (computed on the host) -> route_topk -> gate/up GEMV -> down GEMV
/// with the combine, for T = 1 and 5 tokens at Qwen3-Next's routing (E = 32
/// here to keep the host quantization short, k = 10, I = 512).
fn decode_pipeline_matches_moe_forward(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (h, i, n_exp, k) = (2048usize, 512usize, 32usize, 10usize);
    let host = HostExperts::random(51, h, i, n_exp);
    let dev = upload_experts(gpu, &host)?;
    let router = Matrix::new(n_exp, h, rand_f32(52, n_exp * h, 0.05));
    let cpu = CpuBackend::new(None).map_err(e)?;
    for &tokens in &[1usize, 5] {
        let x = rand_f32(53 + tokens as u64, tokens * h, 1.0);
        let layer = MoeLayer { layer: 0, router: &router, top_k: k, norm_topk_prob: true };
        let mut want = vec![0.0f32; tokens * h];
        let routing = moe::forward(&cpu, &host, &layer, &x, &mut want).map_err(e)?;
        let mut logits = vec![0.0f32; tokens * n_exp];
        cpu.matmul(&x, &router, &mut logits);

        let d_logits = gpu.upload(&logits).map_err(e)?;
        let d_x = gpu.upload(&x).map_err(e)?;
        let mut ids = gpu.alloc_zeros::<u32>(tokens * k).map_err(e)?;
        let mut weights = poisoned(gpu, tokens * k)?;
        gm::route_topk(gpu, &d_logits, tokens, n_exp, k, true, &mut ids, &mut weights).map_err(e)?;
        if download_u32(gpu, &ids)? != ids_u32(&routing) {
            return Err(format!("T={tokens}: route_topk chose other experts than moe::route"));
        }
        let mut act = poisoned(gpu, tokens * k * i)?;
        let mut out = poisoned(gpu, tokens * h)?;
        gm::expert_gate_up_gemv(gpu, &d_x, &ids, &dev.table, &dev.layout, tokens, k, &mut act).map_err(e)?;
        gm::expert_down_gemv(gpu, &act, &ids, &weights, &dev.table, &dev.layout, tokens, k, &mut out, false)
            .map_err(e)?;
        check_close(&format!("decode pipeline T={tokens}"), &download(gpu, &out)?, &want, F32_TOL)?;

        // The routing fused into the gate/up GEMV: the same ids, weights and
        // activations, bit for bit, as route_topk + expert_gate_up_gemv.
        let mut r_ids = gpu.alloc_zeros::<u32>(tokens * k).map_err(e)?;
        let mut r_weights = poisoned(gpu, tokens * k)?;
        let mut r_act = poisoned(gpu, tokens * k * i)?;
        let route = gm::Route {
            logits: &d_logits,
            num_experts: n_exp,
            norm_topk_prob: true,
            ids: &mut r_ids,
            weights: &mut r_weights,
            host_blobs: false,
        };
        gm::expert_gate_up_gemv_routed(gpu, &d_x, route, &dev.table, &dev.layout, tokens, k, &mut r_act).map_err(e)?;
        if download_u32(gpu, &r_ids)? != download_u32(gpu, &ids)? {
            return Err(format!("T={tokens}: the routed gate/up GEMV chose other experts than route_topk"));
        }
        check_close(
            &format!("routed weights T={tokens}"),
            &download(gpu, &r_weights)?,
            &download(gpu, &weights)?,
            0.0,
        )?;
        check_close(&format!("routed act T={tokens}"), &download(gpu, &r_act)?, &download(gpu, &act)?, 0.0)?;

        // The down GEMV routing itself before its wait (after the routed gate/up GEMV, as in a decode step):
        // the same bits as from route_topk's ids and weights, on both kernel families (routed_gemvs gives it
        // wrong ids and weights, so a kernel that read them fails).
        let want_out = download(gpu, &out)?;
        let logits = gm::Logits { logits: &d_logits, num_experts: n_exp, norm_topk_prob: true };
        each_gemv_kernel(gpu, true, || {
            let r = routed_gemvs(gpu, &dev, &d_x, logits, (h, i), tokens, k, false)?;
            let got = download(gpu, &r.out)?;
            if r.routed_itself {
                // The default kernels (tensor cores or CUDA cores) routed from the logits.
                let mut plain = poisoned(gpu, tokens * h)?;
                let (table, layout) = (&dev.table, &dev.layout);
                gm::expert_down_gemv(gpu, &r.act, &r.ids, &r.weights, table, layout, tokens, k, &mut plain, false)
                    .map_err(e)?;
                check_close(&format!("down routed itself T={tokens}"), &got, &download(gpu, &plain)?, 0.0)?;
            }
            check_close(&format!("down routed itself vs the CPU T={tokens}"), &got, &want_out, F32_TOL)
        })?;

        // A mapped decode step's GEMVs (host_blobs: the table may point into host memory) take the CUDA-core
        // kernels even where the tensor-core ones apply: the same bits as with the tensor cores off, and not
        // those of the tensor cores (which differ in the last bits, so this check can tell).
        #[cfg(feature = "test-hooks")]
        if gpu.compute_capability().0 >= 8 {
            let run = |tc: bool, host_blobs: bool| -> Result<Vec<f32>, String> {
                let prev = gpu.set_tc_gemv(tc);
                let r = routed_gemvs(gpu, &dev, &d_x, logits, (h, i), tokens, k, host_blobs);
                gpu.set_tc_gemv(prev);
                let r = r?;
                Ok([download(gpu, &r.act)?, download(gpu, &r.out)?].concat())
            };
            let mapped = run(true, true)?;
            let cuda_cores = run(false, false)?;
            let tensor_cores = run(true, false)?;
            check_close(&format!("mapped-step GEMVs T={tokens} vs CUDA cores"), &mapped, &cuda_cores, 0.0)?;
            if tensor_cores == cuda_cores {
                return Err(format!("T={tokens}: tensor and CUDA cores gave the same bits: the check cannot tell"));
            }
        }
    }
    // E = 128, k = 8 (qwen3_moe) with norm_topk_prob off, and E = 512, k = 10: routed ids and weights
    // against moe::route.
    for &(n_exp2, k2, norm) in &[(128usize, 8usize, false), (512, 10, true)] {
        let tokens = 2;
        let host2 = HostExperts::random(60 + n_exp2 as u64, h, i, n_exp2.min(64));
        let dev2 = upload_experts(gpu, &host2)?;
        // Ids are < 64 only when the logits favour them: shift the rest down.
        let mut logits = rand_f32(61 + n_exp2 as u64, tokens * n_exp2, 1.0);
        for row in logits.chunks_exact_mut(n_exp2) {
            row[64.min(n_exp2)..].iter_mut().for_each(|v| *v -= 50.0);
        }
        let routing = moe::route(&logits, n_exp2, k2, norm);
        let d_logits = gpu.upload(&logits).map_err(e)?;
        let d_x = gpu.upload(&rand_f32(62, tokens * h, 1.0)).map_err(e)?;
        let mut r_ids = gpu.alloc_zeros::<u32>(tokens * k2).map_err(e)?;
        let mut r_weights = poisoned(gpu, tokens * k2)?;
        let mut r_act = poisoned(gpu, tokens * k2 * i)?;
        let route = gm::Route {
            logits: &d_logits,
            num_experts: n_exp2,
            norm_topk_prob: norm,
            ids: &mut r_ids,
            weights: &mut r_weights,
            host_blobs: false,
        };
        gm::expert_gate_up_gemv_routed(gpu, &d_x, route, &dev2.table, &dev2.layout, tokens, k2, &mut r_act)
            .map_err(e)?;
        if download_u32(gpu, &r_ids)? != ids_u32(&routing) {
            return Err(format!("E={n_exp2}: routed ids differ from moe::route"));
        }
        check_close(&format!("routed weights E={n_exp2}"), &download(gpu, &r_weights)?, &routing.weights, 1e-6)?;
        let act = download(gpu, &r_act)?;
        if act.iter().any(|v| !v.is_finite()) {
            return Err(format!("E={n_exp2}: routed act has non-finite values"));
        }
        // The down GEMV routing itself at this E and norm (the 512-expert routing path at E = 512), given wrong
        // ids and NaN weights: the same bits as from the gate/up GEMV's ids and weights, on both kernel families.
        let logits = gm::Logits { logits: &d_logits, num_experts: n_exp2, norm_topk_prob: norm };
        each_gemv_kernel(gpu, true, || {
            let r = routed_gemvs(gpu, &dev2, &d_x, logits, (h, i), tokens, k2, false)?;
            let mut want = poisoned(gpu, tokens * h)?;
            let (table, layout) = (&dev2.table, &dev2.layout);
            gm::expert_down_gemv(gpu, &r.act, &r.ids, &r.weights, table, layout, tokens, k2, &mut want, false)
                .map_err(e)?;
            let (got, want) = (download(gpu, &r.out)?, download(gpu, &want)?);
            if want.iter().any(|v| !v.is_finite()) {
                return Err(format!("E={n_exp2}: the down GEMV gave non-finite values"));
            }
            check_close(&format!("down routed itself E={n_exp2} norm {norm}"), &got, &want, 0.0)
        })?;
    }
    Ok(())
}

/// The fused decode MoE (`fused_decode`, sm_90+: a thread-block cluster an expert) against the two GEMV launches
/// it replaces (`expert_gate_up_gemv_routed`, then `expert_down_gemv_routed` on the same logits): the same ids,
/// weights, act and output bits, onto a residual and not, launched twice in a row (the arrival counters must be
/// reset for the second), at 30b-a3b's shape (H 2048, I 768, k 8 of E 128) and Qwen3-Next's (I 512, k 10 of
/// 512), and within F32_TOL of the CPU's experts. With a table shorter than the ids routed to, the rows of both
/// are NaN alike. Before sm_90 (or, without `test-hooks`, unless `STRATA_FUSED_MOE=1`) `fused_decode_shape` must
/// give none.
fn fused_decode_matches_two_launches(gpu: &Arc<Gpu>) -> Result<(), String> {
    // Off by default (STRATA_FUSED_MOE=1 turns it on): on for this test where the device has clusters.
    #[cfg(feature = "test-hooks")]
    let prev = gpu.set_fused_moe(true);
    let r = fused_decode_check(gpu);
    #[cfg(feature = "test-hooks")]
    gpu.set_fused_moe(prev);
    r
}

fn fused_decode_check(gpu: &Arc<Gpu>) -> Result<(), String> {
    if !gpu.fused_moe() {
        if gm::fused_decode_shape(gpu, 2048, 768, 8, 128).is_some() {
            return Err("fused_decode_shape gives a shape with the fused kernel off".into());
        }
        eprintln!("    (the fused decode MoE is off on this device: nothing to compare)");
        return Ok(());
    }
    let Some(shape) = gm::fused_decode_shape(gpu, 2048, 768, 8, 128) else {
        let counts: Vec<String> = [(16, 2), (16, 4), (8, 2), (8, 6)]
            .iter()
            .map(|&(cluster, ring)| {
                format!("{cluster} x ring {ring}: {:?}", gm::fused_clusters(gpu, cluster, 8 * ring * 4608))
            })
            .collect();
        return Err(format!(
            "the fused decode MoE does not fit 30b-a3b's shape on an sm_90 device (clusters at once: {})",
            counts.join(", ")
        ));
    };
    eprintln!("    (30b-a3b's shape: {shape:?})");
    let h = 2048usize;
    for &(i, n_exp, k, norm, n_blobs, table_len) in &[
        (768usize, 128usize, 8usize, false, 16usize, 16usize),
        (512, 512, 10, true, 14, 14),
        (768, 128, 8, true, 16, 11),
    ] {
        let what = format!("I={i} k={k} of E={n_exp}, table {table_len}");
        if gm::fused_decode_shape(gpu, h, i, k, n_exp).is_none() {
            // (A shape named by STRATA_FUSED_SHAPE may not run k experts at once: the global exchange needs 16 k
            // blocks resident. 30b-a3b's shape was checked above.)
            eprintln!("    ({what}: no fused shape on this device, skipped)");
            continue;
        }
        let host = HostExperts::random(70 + i as u64 + k as u64, h, i, n_blobs);
        let dev = upload_experts(gpu, &host)?;
        let table = table_of(gpu, &dev._blobs, host.layout.stride, table_len)?;
        // Only the first n_blobs ids are likely: the rest are shifted far down.
        let mut logits = rand_f32(80 + i as u64, n_exp, 1.0);
        logits[n_blobs..].iter_mut().for_each(|v| *v -= 50.0);
        let d_logits = gpu.upload(&logits).map_err(e)?;
        let x = rand_f32(81 + i as u64, h, 1.0);
        let d_x = gpu.upload(&x).map_err(e)?;
        let residual = rand_f32(82 + i as u64, h, 0.5);
        for accumulate in [true, false] {
            // The two launches.
            let mut ids = gpu.alloc_zeros::<u32>(k).map_err(e)?;
            let mut weights = poisoned(gpu, k)?;
            let mut act = poisoned(gpu, k * i)?;
            let mut out = gpu.upload(&residual).map_err(e)?;
            let route = gm::Route {
                logits: &d_logits,
                num_experts: n_exp,
                norm_topk_prob: norm,
                ids: &mut ids,
                weights: &mut weights,
                host_blobs: false,
            };
            gm::expert_gate_up_gemv_routed(gpu, &d_x, route, &table, &dev.layout, 1, k, &mut act).map_err(e)?;
            let logit_of = gm::Logits { logits: &d_logits, num_experts: n_exp, norm_topk_prob: norm };
            gm::expert_down_gemv_routed(
                gpu,
                &act,
                &ids,
                &weights,
                Some(logit_of),
                false,
                &table,
                &dev.layout,
                1,
                k,
                &mut out,
                accumulate,
            )
            .map_err(e)?;
            let want = [download(gpu, &weights)?, download(gpu, &act)?, download(gpu, &out)?].concat();
            let want_ids = download_u32(gpu, &ids)?;
            // The fused launch, twice on the same scratch.
            let mut scratch = gm::FusedScratch::new(gpu, h, k).map_err(e)?;
            for run in 0..2 {
                let mut f_ids = gpu.alloc_zeros::<u32>(k).map_err(e)?;
                let mut f_weights = poisoned(gpu, k)?;
                let mut f_act = poisoned(gpu, k * i)?;
                let mut f_out = gpu.upload(&residual).map_err(e)?;
                let route = gm::Route {
                    logits: &d_logits,
                    num_experts: n_exp,
                    norm_topk_prob: norm,
                    ids: &mut f_ids,
                    weights: &mut f_weights,
                    host_blobs: false,
                };
                gm::fused_decode(
                    gpu,
                    &d_x,
                    route,
                    &table,
                    &dev.layout,
                    k,
                    &mut f_act,
                    &mut scratch,
                    &mut f_out,
                    accumulate,
                )
                .map_err(e)?;
                let got = [download(gpu, &f_weights)?, download(gpu, &f_act)?, download(gpu, &f_out)?].concat();
                let tag = format!("{what}, accumulate {accumulate}, run {run}");
                if download_u32(gpu, &f_ids)? != want_ids {
                    return Err(format!("{tag}: the fused kernel routed to other experts"));
                }
                if let Some(p) =
                    got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
                {
                    return Err(format!("{tag}: value {p} is {} where the two launches give {}", got[p], want[p]));
                }
            }
            let out = &want[k + k * i..];
            if table_len < n_blobs {
                // Some routed id is past the table (else this case tests nothing): NaN rows.
                if !want_ids.iter().any(|&id| id as usize >= table_len) || !out.iter().all(|v| v.is_nan()) {
                    return Err(format!("{what}: want every output NaN from an id past the table (ids {want_ids:?})"));
                }
                continue;
            }
            // The CPU's experts.
            let routing = moe::route(&logits, n_exp, k, norm);
            let mut cpu = if accumulate { residual.clone() } else { vec![0.0f32; h] };
            for (j, &id) in routing.experts.iter().enumerate() {
                let ev = host.view(id);
                let a = cpu_act(&ev, &x);
                for (row, o) in cpu.iter_mut().enumerate() {
                    *o += routing.weights[j] * ev.down.row_dot(row, &a);
                }
            }
            check_close(&format!("{what}, accumulate {accumulate}: fused vs the CPU"), out, &cpu, F32_TOL)?;
        }
    }
    Ok(())
}

/// The routed decode pair (`routed_gemvs`: the gate/up GEMV routes from the logits, the down GEMV routes itself)
/// with a table shorter than the ids the logits favour: the act rows of an assignment past the table are NaN,
/// the others finite, and the token's output rows NaN, on every kernel family (each_gemv_kernel, the staged pair
/// included). T = 1 at 30b-a3b's shape (H 2048, I 768, k 8).
fn routed_gemvs_bad_expert_id_give_nan_rows(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (h, i, n_exp, k, table_len) = (2048usize, 768usize, 16usize, 8usize, 11usize);
    let host = HostExperts::random(75, h, i, n_exp);
    let full = upload_experts(gpu, &host)?;
    let table = table_of(gpu, &full._blobs, host.layout.stride, table_len)?;
    let dev = DeviceExperts { _blobs: full._blobs, table, layout: full.layout };
    // Expert 15 (past the table) is the first choice; the others are random.
    let mut logits = rand_f32(76, n_exp, 1.0);
    logits[n_exp - 1] += 5.0;
    let d_logits = gpu.upload(&logits).map_err(e)?;
    let d_x = gpu.upload(&rand_f32(77, h, 1.0)).map_err(e)?;
    let logits = gm::Logits { logits: &d_logits, num_experts: n_exp, norm_topk_prob: true };
    each_gemv_kernel(gpu, true, || {
        let r = routed_gemvs(gpu, &dev, &d_x, logits, (h, i), 1, k, false)?;
        let (ids, act, out) = (download_u32(gpu, &r.ids)?, download(gpu, &r.act)?, download(gpu, &r.out)?);
        if !ids.iter().any(|&id| id as usize >= table_len) {
            return Err(format!("ids {ids:?}: none past the table of {table_len}, the check tests nothing"));
        }
        for (j, &id) in ids.iter().enumerate() {
            let rows = &act[j * i..(j + 1) * i];
            let bad = id as usize >= table_len;
            if let Some(p) = rows.iter().position(|v| v.is_nan() != bad || (!bad && !v.is_finite())) {
                return Err(format!("expert {id} (j {j}): act[{p}] = {}", rows[p]));
            }
        }
        if let Some(p) = out.iter().position(|v| !v.is_nan()) {
            return Err(format!("out[{p}] = {} is not NaN", out[p]));
        }
        Ok(())
    })
}

/// What `routed_gemvs` leaves: the gate/up GEMV's ids, weights and act, the down GEMV's out, and whether the down
/// GEMV routed itself.
struct RoutedGemvs {
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    act: CudaSlice<f32>,
    out: CudaSlice<f32>,
    routed_itself: bool,
}

/// A decode step's routed expert GEMVs as the engine launches them: `expert_gate_up_gemv_routed`, then at once
/// (every buffer allocated before, so nothing runs between the two) `expert_down_gemv_routed` on the same logits,
/// in a `test-hooks` build under `PREWAIT_DOWN` (restored after), so it routes itself; it is then given wrong ids
/// (all expert 0) and NaN weights, so a kernel that read them fails.
#[allow(clippy::too_many_arguments)]
fn routed_gemvs(
    gpu: &Gpu,
    dev: &DeviceExperts,
    x: &CudaSlice<f32>,
    logits: gm::Logits<'_>,
    (h, i): (usize, usize),
    tokens: usize,
    k: usize,
    host_blobs: bool,
) -> Result<RoutedGemvs, String> {
    let mut ids = gpu.alloc_zeros::<u32>(tokens * k).map_err(e)?;
    let mut weights = poisoned(gpu, tokens * k)?;
    let mut act = poisoned(gpu, tokens * k * i)?;
    let mut out = poisoned(gpu, tokens * h)?;
    let zeros = gpu.alloc_zeros::<u32>(tokens * k).map_err(e)?;
    let nan_w = poisoned(gpu, tokens * k)?;
    #[cfg(feature = "test-hooks")]
    let prev = gpu.set_prewait(PREWAIT_DOWN);
    let routed_itself = gpu.prewait(PREWAIT_DOWN);
    let r = (|| {
        let route = gm::Route {
            logits: logits.logits,
            num_experts: logits.num_experts,
            norm_topk_prob: logits.norm_topk_prob,
            ids: &mut ids,
            weights: &mut weights,
            host_blobs,
        };
        let (table, layout) = (&dev.table, &dev.layout);
        gm::expert_gate_up_gemv_routed(gpu, x, route, table, layout, tokens, k, &mut act)?;
        // (Without test-hooks and with STRATA_PREWAIT off it reads the ids and weights: give it the right ones.)
        let (gi, gw) = if routed_itself { (&zeros, &nan_w) } else { (&ids, &weights) };
        gm::expert_down_gemv_routed(
            gpu,
            &act,
            gi,
            gw,
            Some(logits),
            host_blobs,
            table,
            layout,
            tokens,
            k,
            &mut out,
            false,
        )
    })();
    #[cfg(feature = "test-hooks")]
    gpu.set_prewait(prev);
    r.map_err(e)?;
    Ok(RoutedGemvs { ids, weights, act, out, routed_itself })
}

/// Skewed router logits: expert e's logits are shifted by -skew * e, so low
/// ids get most tokens (several row tiles) and high ids few or none.
fn skewed_routing(seed: u64, tokens: usize, num_experts: usize, k: usize, skew: f32) -> Routing {
    let mut logits = rand_f32(seed, tokens * num_experts, 1.0);
    for row in logits.chunks_exact_mut(num_experts) {
        for (ex, v) in row.iter_mut().enumerate() {
            *v -= skew * ex as f32;
        }
    }
    moe::route(&logits, num_experts, k, true)
}

fn ids_u32(r: &Routing) -> Vec<u32> {
    r.experts.iter().map(|&x| x as u32).collect()
}

/// The grouping on the device against moe::group_by_expert: offsets, the
/// (token, j) order inside each expert, the inverse map and the tile offsets.
fn group_by_expert_matches_cpu(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(tokens, num_experts, k) in &[(1usize, 8usize, 1usize), (17, 128, 8), (300, 512, 10), (4096, 128, 8)] {
        let what = format!("T={tokens} E={num_experts} k={k}");
        let routing = skewed_routing(tokens as u64 + 5, tokens, num_experts, k, 0.02);
        let ids = ids_u32(&routing);
        let d_ids = gpu.upload(&ids).map_err(e)?;
        let g = gm::group_by_expert(gpu, &d_ids, tokens, k, num_experts).map_err(e)?;
        let (offsets, tiles) = (download_u32(gpu, &g.offsets)?, download_u32(gpu, &g.tile_offsets)?);
        let (rows, slot_of, slot_expert) =
            (download_u32(gpu, &g.rows)?, download_u32(gpu, &g.slot_of)?, download_u32(gpu, &g.slot_expert)?);
        let groups = moe::group_by_expert(&routing);
        let mut want_offsets = vec![0u32; num_experts + 1];
        let mut want_tiles = vec![0u32; num_experts + 1];
        let mut want_rows = Vec::new();
        let mut counts = vec![0usize; num_experts];
        for grp in &groups {
            counts[grp.expert] = grp.tokens.len();
            for &t in &grp.tokens {
                let j = routing.token(t).0.iter().position(|&x| x == grp.expert).unwrap();
                want_rows.push((t * k + j) as u32);
            }
        }
        for ex in 0..num_experts {
            want_offsets[ex + 1] = want_offsets[ex] + counts[ex] as u32;
            want_tiles[ex + 1] = want_tiles[ex] + counts[ex].div_ceil(gm::TILE_M) as u32;
        }
        if offsets != want_offsets {
            return Err(format!("{what}: offsets {offsets:?}, want {want_offsets:?}"));
        }
        if tiles != want_tiles {
            return Err(format!("{what}: tile offsets {tiles:?}, want {want_tiles:?}"));
        }
        if rows != want_rows {
            let s = rows.iter().zip(&want_rows).position(|(a, b)| a != b).unwrap();
            return Err(format!("{what}: rows[{s}] = {}, want {}", rows[s], want_rows[s]));
        }
        for (s, &a) in rows.iter().enumerate() {
            if slot_of[a as usize] != s as u32 || slot_expert[s] != ids[a as usize] {
                return Err(format!(
                    "{what}: slot {s} (assignment {a}): slot_of {} slot_expert {} (id {})",
                    slot_of[a as usize], slot_expert[s], ids[a as usize]
                ));
            }
        }
    }
    Ok(())
}

/// The whole prefill pipeline (group, gate/up, down, combine) against the
/// CPU's route -> group -> gather -> expert_ffn -> combine, for the SIMT and
/// the default (tensor-core on sm_80+) grouped kernels.
fn grouped_matches_cpu_forward(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(h, i, n_exp, k) in &[(2048usize, 768usize, 16usize, 8usize), (2048, 512, 24, 10)] {
        check_grouped(gpu, h, i, n_exp, k, &[1, 17, 300], DEFAULT_MODES)?;
    }
    Ok(())
}

/// The prefill pipeline by `expert_*_grouped_with(.., GroupedPrecision::Split)`
/// (tensor cores with activations as bf16 hi + lo) against the CPU forward at
/// SPLIT_TOL (1e-4, 100x tighter than the bf16 path's 1e-2, which it would
/// not pass): the model sizes (H 2048, I 768 / 512, k 8 / 10) and the
/// fixture shapes (64, 32) and (96, 32) (k = 2 of 8; both matrices on tensor
/// cores), T in {17, 300}.
fn grouped_split_precision(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(h, i, n_exp, k) in
        &[(2048usize, 768usize, 16usize, 8usize), (2048, 512, 24, 10), (64, 32, 8, 2), (96, 32, 8, 2)]
    {
        check_grouped(gpu, h, i, n_exp, k, &[17, 300], &[GroupedMode::Split])?;
    }
    Ok(())
}

/// The prefill pipeline at every SMALL_SHAPES size (hidden and intermediate
/// any multiples of 16) with the fixtures' k = 2 of 8 experts, T in {1, 9,
/// 17, 300}, SIMT and default entry points (the default runs a matrix on
/// tensor cores only when the dimension it reduces over is a multiple of 32).
fn grouped_any_multiple_of_16(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(h, i) in SMALL_SHAPES {
        check_grouped(gpu, h, i, 8, 2, &[1, 9, 17, 300], DEFAULT_MODES)?;
    }
    Ok(())
}

/// Which grouped entry points `check_grouped` runs.
#[derive(Clone, Copy, PartialEq)]
enum GroupedMode {
    /// `expert_*_grouped_simple` (SIMT, f32).
    Simple,
    /// `expert_*_grouped` (tensor cores with bf16 activations where they apply).
    Default,
    /// `expert_*_grouped_with(.., GroupedPrecision::Split)`.
    Split,
}
const DEFAULT_MODES: &[GroupedMode] = &[GroupedMode::Simple, GroupedMode::Default];

/// group -> gate/up -> down -> combine (overwrite into a poisoned out, and
/// accumulate onto a prior) against the CPU forward for each token count, by
/// each of `modes`; act and y are poisoned first.
fn check_grouped(
    gpu: &Gpu,
    h: usize,
    i: usize,
    n_exp: usize,
    k: usize,
    token_counts: &[usize],
    modes: &[GroupedMode],
) -> Result<(), String> {
    let host = HostExperts::random(h as u64 * 3 + i as u64, h, i, n_exp);
    let dev = upload_experts(gpu, &host)?;
    for &tokens in token_counts {
        let seed = (tokens * 13 + i) as u64;
        let routing = skewed_routing(seed, tokens, n_exp, k, 0.15);
        let x = rand_f32(seed + 1, tokens * h, 1.0);
        // CPU: moe::forward after the router matmul.
        let groups = moe::group_by_expert(&routing);
        let xg = moe::gather(&x, h, &groups);
        let work: Vec<ExpertRows<'_>> =
            groups.iter().map(|g| ExpertRows { weights: host.view(g.expert), rows: g.tokens.len() }).collect();
        let mut yg = vec![0.0f32; xg.len()];
        expert_ffn(&work, &xg, &mut yg);
        let mut want = vec![0.0f32; tokens * h];
        moe::combine(&groups, &yg, h, &mut want);
        let prior = rand_f32(seed + 2, tokens * h, 1.0);

        // What a path that ignored the down global scale would give (down is
        // linear: each expert's rows divided by its g_down).
        let no_gdown: Vec<f32> = {
            let mut yy = yg.clone();
            let mut rows = yy.chunks_exact_mut(h);
            for g in &groups {
                let g_down = host.mats[g.expert][2].global_scale;
                for row in rows.by_ref().take(g.tokens.len()) {
                    row.iter_mut().for_each(|v| *v /= g_down);
                }
            }
            let mut w = vec![0.0f32; tokens * h];
            moe::combine(&groups, &yy, h, &mut w);
            w
        };
        let d_x = gpu.upload(&x).map_err(e)?;
        let d_ids = gpu.upload(&ids_u32(&routing)).map_err(e)?;
        let d_w = gpu.upload(&routing.weights).map_err(e)?;
        let g = gm::group_by_expert(gpu, &d_ids, tokens, k, n_exp).map_err(e)?;
        let n = tokens * k;
        let (tc_gu, tc_down) = gm::grouped_tensor_core_paths(gpu, &dev.layout);
        let tc = tc_gu || tc_down;
        for &mode in modes {
            let path = |tc: bool| if tc { "tensor cores" } else { "SIMT" };
            let what = match mode {
                GroupedMode::Simple => format!("H={h} I={i} E={n_exp} k={k} T={tokens} SIMT"),
                GroupedMode::Default | GroupedMode::Split => format!(
                    "H={h} I={i} E={n_exp} k={k} T={tokens} {} (gate/up {}, down {})",
                    if mode == GroupedMode::Split { "split" } else { "default" },
                    path(tc_gu),
                    path(tc_down)
                ),
            };
            let mut act = poisoned(gpu, n * i)?;
            let mut y = poisoned(gpu, n * h)?;
            match mode {
                GroupedMode::Simple => {
                    gm::expert_gate_up_grouped_simple(gpu, &d_x, &g, &dev.table, &dev.layout, &mut act).map_err(e)?;
                    gm::expert_down_grouped_simple(gpu, &act, &g, &dev.table, &dev.layout, &mut y).map_err(e)?;
                }
                GroupedMode::Default => {
                    gm::expert_gate_up_grouped(gpu, &d_x, &g, &dev.table, &dev.layout, &mut act).map_err(e)?;
                    gm::expert_down_grouped(gpu, &act, &g, &dev.table, &dev.layout, &mut y).map_err(e)?;
                }
                GroupedMode::Split => {
                    let p = GroupedPrecision::Split;
                    gm::expert_gate_up_grouped_with(gpu, &d_x, &g, &dev.table, &dev.layout, &mut act, p).map_err(e)?;
                    gm::expert_down_grouped_with(gpu, &act, &g, &dev.table, &dev.layout, &mut y, p).map_err(e)?;
                }
            }
            let mut out = poisoned(gpu, tokens * h)?;
            gm::moe_combine(gpu, &y, &g, &d_w, h, &mut out, false).map_err(e)?;
            let tol = match mode {
                GroupedMode::Default if tc => BF16_TOL,
                GroupedMode::Split if tc => SPLIT_TOL,
                _ => F32_TOL,
            };
            let got = download(gpu, &out)?;
            check_close(&what, &got, &want, tol)?;
            // The down scale of each expert must reach the output.
            if check_close("", &got, &no_gdown, 0.5).is_ok() {
                return Err(format!("{what}: out matches the result with g_down = 1: the down scale is ignored"));
            }
            let mut acc = gpu.upload(&prior).map_err(e)?;
            gm::moe_combine(gpu, &y, &g, &d_w, h, &mut acc, true).map_err(e)?;
            let want_acc: Vec<f32> = prior.iter().zip(&want).map(|(p, w)| p + w).collect();
            check_close(&format!("{what} (accumulate)"), &download(gpu, &acc)?, &want_acc, tol)?;
        }
    }
    Ok(())
}

/// Two runs of the decode and the prefill pipelines on the same inputs give
/// the same bits (no float atomics; sums in a fixed order).
fn results_are_deterministic(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (h, i, n_exp, k, tokens) = (2048usize, 512usize, 8usize, 4usize, 150usize);
    let host = HostExperts::random(61, h, i, n_exp);
    let dev = upload_experts(gpu, &host)?;
    let routing = skewed_routing(62, tokens, n_exp, k, 0.2);
    let d_x = gpu.upload(&rand_f32(63, tokens * h, 1.0)).map_err(e)?;
    let d_ids = gpu.upload(&ids_u32(&routing)).map_err(e)?;
    let d_w = gpu.upload(&routing.weights).map_err(e)?;
    let n = tokens * k;
    let run = |prefill: bool| -> Result<Vec<u32>, String> {
        let mut act = poisoned(gpu, n * i)?;
        let mut out = poisoned(gpu, tokens * h)?;
        if prefill {
            let g = gm::group_by_expert(gpu, &d_ids, tokens, k, n_exp).map_err(e)?;
            let mut y = poisoned(gpu, n * h)?;
            gm::expert_gate_up_grouped(gpu, &d_x, &g, &dev.table, &dev.layout, &mut act).map_err(e)?;
            gm::expert_down_grouped(gpu, &act, &g, &dev.table, &dev.layout, &mut y).map_err(e)?;
            gm::moe_combine(gpu, &y, &g, &d_w, h, &mut out, false).map_err(e)?;
        } else {
            gm::expert_gate_up_gemv(gpu, &d_x, &d_ids, &dev.table, &dev.layout, tokens, k, &mut act).map_err(e)?;
            gm::expert_down_gemv(gpu, &act, &d_ids, &d_w, &dev.table, &dev.layout, tokens, k, &mut out, false)
                .map_err(e)?;
        }
        Ok(download(gpu, &out)?.iter().map(|v| v.to_bits()).collect())
    };
    for prefill in [false, true] {
        let (a, b) = (run(prefill)?, run(prefill)?);
        if let Some(at) = a.iter().zip(&b).position(|(x, y)| x != y) {
            return Err(format!(
                "{} differs between two runs at [{at}]: {} vs {}",
                if prefill { "prefill" } else { "decode" },
                f32::from_bits(a[at]),
                f32::from_bits(b[at])
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Timing (one line each; values are not checked).

/// Median seconds of `reps` runs of `work` (each run timed with CUDA events).
fn median_seconds(gpu: &Gpu, reps: usize, mut work: impl FnMut(usize) -> Result<(), String>) -> Result<f64, String> {
    use cudarc::driver::sys::CUevent_flags;
    let ctx = gpu.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    work(0)?;
    gpu.sync().map_err(e)?;
    let mut times = Vec::with_capacity(reps);
    for r in 0..reps {
        start.record(gpu.stream()).map_err(e)?;
        work(r + 1)?;
        end.record(gpu.stream()).map_err(e)?;
        times.push(start.elapsed_ms(&end).map_err(e)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// Random bytes for E blobs of `layout` (the kernels' speed does not depend on
/// the values), and the table.
fn random_blobs(gpu: &Gpu, layout: &ExpertLayout, n: usize) -> Result<(CudaSlice<u32>, CudaSlice<u64>), String> {
    let mut words = gpu.alloc_zeros::<u32>(layout.stride as usize / 4 * n).map_err(e)?;
    gpu.fill_random_u32(&mut words, 99).map_err(e)?;
    let base = {
        let (ptr, _sync) = words.device_ptr(gpu.stream());
        ptr
    };
    let table: Vec<u64> = (0..n as u64).map(|ex| base + ex * layout.stride).collect();
    Ok((words, gpu.upload(&table).map_err(e)?))
}

/// Batch-1 decode at the two models' routed-expert sizes: Qwen3-30B-A3B
/// (H=2048, I=768, k=8, E=128) and Qwen3-Next-80B-A3B (H=2048, I=512, k=10,
/// E=512). A timed run is 16 layers' launches, each with k other experts (all
/// E in turn: 340 / 900 MB of blobs against a 50 MB L2, so L2 does not serve
/// them). Bytes per layer: k x 3 matrices x (H I / 2 codes + H I / 16
/// scales) = 21.2 / 17.7 MB. One line per shape: gate_up alone, down alone
/// and both, each in us per layer and % of its floor (its bytes at 4.3 TB/s).
fn decode_gemv_timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    for &(h, i, k, n_exp) in &[(2048usize, 768usize, 8usize, 128usize), (2048, 512, 10, 512)] {
        decode_gemv_timing_shape(gpu, h, i, k, n_exp)?;
    }
    Ok(())
}

fn decode_gemv_timing_shape(gpu: &Gpu, h: usize, i: usize, k: usize, n_exp: usize) -> Result<(), String> {
    let layout = ExpertLayout::new(h as u64, i as u64);
    let (_blobs, table) = random_blobs(gpu, &layout, n_exp)?;
    let bl = BlobLayout::from(&layout);
    let x = gpu.upload(&rand_f32(1, h, 1.0)).map_err(e)?;
    let w = gpu.upload(&vec![0.125f32; k]).map_err(e)?;
    let id_sets: Vec<CudaSlice<u32>> = (0..n_exp / k)
        .map(|r| gpu.upload(&(0..k as u32).map(|j| (r * k) as u32 + j).collect::<Vec<_>>()).map_err(e))
        .collect::<Result<_, _>>()?;
    let mut act = gpu.upload(&rand_f32(3, k * i, 1.0)).map_err(e)?;
    let mut out = gpu.alloc_zeros::<f32>(h).map_err(e)?;
    let sets = id_sets.len();
    // 16 layers' worth of launches per timed run; per-layer time = run / 16.
    let t_gu = median_seconds(gpu, 9, |r| {
        for l in 0..16 {
            let ids = &id_sets[(r * 16 + l) % sets];
            gm::expert_gate_up_gemv(gpu, &x, ids, &table, &bl, 1, k, &mut act).map_err(e)?;
        }
        Ok(())
    })? / 16.0;
    let t_down = median_seconds(gpu, 9, |r| {
        for l in 0..16 {
            let ids = &id_sets[(r * 16 + l) % sets];
            gm::expert_down_gemv(gpu, &act, ids, &w, &table, &bl, 1, k, &mut out, false).map_err(e)?;
        }
        Ok(())
    })? / 16.0;
    let t_all = median_seconds(gpu, 9, |r| {
        for l in 0..16 {
            let ids = &id_sets[(r * 16 + l) % sets];
            gm::expert_gate_up_gemv(gpu, &x, ids, &table, &bl, 1, k, &mut act).map_err(e)?;
            gm::expert_down_gemv(gpu, &act, ids, &w, &table, &bl, 1, k, &mut out, false).map_err(e)?;
        }
        Ok(())
    })? / 16.0;
    let per_matrix = (h * i / 2 + h * i / 16) as f64;
    let bytes = k as f64 * 3.0 * per_matrix;
    let floor = bytes / HBM_BYTES_PER_S;
    // % of the floor of `matrices` of the k experts' matrices read in `secs`.
    let pct = |matrices: f64, secs: f64| 100.0 * k as f64 * matrices * per_matrix / HBM_BYTES_PER_S / secs;
    println!(
        "     moe decode T=1 H={h} I={i} k={k} E={n_exp}: gate_up {:.2} us ({:.0}% of floor), down {:.2} us ({:.0}%), \
         gate_up+down {:.2} us/layer = {:.0} GB/s = {:.0}% of the floor ({:.2} us at {:.1} TB/s, {:.2} MB/token/layer)",
        t_gu * 1e6,
        pct(2.0, t_gu),
        t_down * 1e6,
        pct(1.0, t_down),
        t_all * 1e6,
        bytes / t_all / 1e9,
        100.0 * floor / t_all,
        floor * 1e6,
        HBM_BYTES_PER_S / 1e12,
        bytes / 1e6
    );
    Ok(())
}

/// Prefill of 4096 tokens at Qwen3-30B-A3B sizes with skewed routing:
/// group + gate/up + down + combine, in TFLOP/s of 2 * 3 * H * I per (token, expert).
fn prefill_grouped_timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (h, i, k, n_exp, tokens) = (2048usize, 768usize, 8usize, 128usize, 4096usize);
    let layout = ExpertLayout::new(h as u64, i as u64);
    let (_blobs, table) = random_blobs(gpu, &layout, n_exp)?;
    let bl = BlobLayout::from(&layout);
    let routing = skewed_routing(77, tokens, n_exp, k, 0.03);
    let mut counts = vec![0usize; n_exp];
    for &x in &routing.experts {
        counts[x] += 1;
    }
    let (busiest, idle) = (counts.iter().max().copied().unwrap_or(0), counts.iter().filter(|&&c| c == 0).count());
    let x = gpu.upload(&rand_f32(2, tokens * h, 1.0)).map_err(e)?;
    let ids = gpu.upload(&ids_u32(&routing)).map_err(e)?;
    let w = gpu.upload(&routing.weights).map_err(e)?;
    let n = tokens * k;
    let mut g = gm::ExpertGrouping::new(gpu, n, n_exp).map_err(e)?;
    let mut act = gpu.alloc_zeros::<f32>(n * i).map_err(e)?;
    let mut y = gpu.alloc_zeros::<f32>(n * h).map_err(e)?;
    let mut out = gpu.alloc_zeros::<f32>(tokens * h).map_err(e)?;
    let flops = 2.0 * 3.0 * (h * i) as f64 * n as f64;
    let tc = gm::grouped_uses_tensor_cores(gpu);
    for mode in [GroupedMode::Simple, GroupedMode::Default, GroupedMode::Split] {
        if mode != GroupedMode::Simple && !tc {
            continue;
        }
        let secs = median_seconds(gpu, 5, |_| {
            gm::group_by_expert_into(gpu, &ids, tokens, k, &mut g).map_err(e)?;
            match mode {
                GroupedMode::Simple => {
                    gm::expert_gate_up_grouped_simple(gpu, &x, &g, &table, &bl, &mut act).map_err(e)?;
                    gm::expert_down_grouped_simple(gpu, &act, &g, &table, &bl, &mut y).map_err(e)?;
                }
                GroupedMode::Default => {
                    gm::expert_gate_up_grouped(gpu, &x, &g, &table, &bl, &mut act).map_err(e)?;
                    gm::expert_down_grouped(gpu, &act, &g, &table, &bl, &mut y).map_err(e)?;
                }
                GroupedMode::Split => {
                    let p = GroupedPrecision::Split;
                    gm::expert_gate_up_grouped_with(gpu, &x, &g, &table, &bl, &mut act, p).map_err(e)?;
                    gm::expert_down_grouped_with(gpu, &act, &g, &table, &bl, &mut y, p).map_err(e)?;
                }
            }
            gm::moe_combine(gpu, &y, &g, &w, h, &mut out, false).map_err(e)
        })?;
        println!(
            "     moe prefill T={tokens} H={h} I={i} k={k} E={n_exp} (skewed: busiest expert {busiest} rows, {idle} idle) \
             {}: {:.3} ms = {:.1} TFLOP/s = {:.1}% of {:.0} TFLOP/s (floor {:.3} ms)",
            match mode {
                GroupedMode::Simple => "SIMT",
                GroupedMode::Default => "tensor cores",
                GroupedMode::Split => "tensor cores (split hi/lo)",
            },
            secs * 1e3,
            flops / secs / 1e12,
            100.0 * flops / secs / BF16_FLOPS,
            BF16_FLOPS / 1e12,
            flops / BF16_FLOPS * 1e3
        );
    }
    Ok(())
}
