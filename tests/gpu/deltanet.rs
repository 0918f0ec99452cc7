//! GPU tests of kernels/deltanet.cu against the CPU reference
//! (`strata::backend::cpu::deltanet`): each stage alone (conv, the recurrent
//! and the chunked rule, the gated RMSNorm), then `deltanet_core` against the
//! CPU composition of `gated_deltanet_layer` between its matmuls, in both
//! forms, from a random non-zero state, with the state after the call
//! compared too; a sequence split over calls; the state helpers; argument
//! checks; timing lines for decode and a 4096-token prefill at 80B.
//!
//! Tolerances (`check_close`: max |got - want| / max |want|): everything is f32
//! on both sides; only the summation order differs (tree and per-warp sums,
//! fused multiply-adds, the chunked form's explicit (I + A)^-1 instead of the
//! CPU's substitution, and its o = O0 + Q' S with Q' = e^c q - attn Tm (beta e^c k)
//! precomputed per chunk instead of e^c q S + attn (U - W S)). The conv and the norm: 1e-5. The delta rule and the
//! whole core: 1e-4 (sums of 128-256 products carried over up to 300 tokens
//! of state).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use strata::backend::cpu::deltanet::{
    causal_conv1d, deltanet_gates, gated_delta_rule_chunked, gated_delta_rule_recurrent, gated_rmsnorm, split_ba,
    split_qkvz, DeltaNetShape, DeltaNetState, DELTA_RULE_CHUNK,
};
use strata::backend::cuda::deltanet::{
    chunked_form_fits, conv_silu, delta_rule_chunked, delta_rule_recurrent, deltanet_core, deltanet_core_with,
    gated_rmsnorm as gpu_norm, DeltaNetDeviceWeights, DeltaNetScratch, DeltaRuleChunkScratch, DeltaRuleForm,
    DeviceDeltaState,
};
use strata::backend::cuda::{CudaSlice, Gpu};
use strata::error::Error;
use strata::rng::Rng;

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("deltanet_conv_silu_matches_cpu", conv_silu_matches_cpu),
    ("deltanet_recurrent_rule_matches_cpu", recurrent_rule_matches_cpu),
    ("deltanet_chunked_rule_matches_cpu", chunked_rule_matches_cpu),
    ("deltanet_gated_rmsnorm_matches_cpu", gated_rmsnorm_matches_cpu),
    ("deltanet_core_matches_cpu_layer", core_matches_cpu_layer),
    ("deltanet_core_split_calls_equal_one_call", core_split_calls_equal_one_call),
    ("deltanet_state_upload_download_copy", state_upload_download_copy),
    ("deltanet_rejects_bad_arguments", rejects_bad_arguments),
    ("deltanet_timing_80b", timing_80b),
];

/// Hk 2, Hv 4 (two value heads per key head), dk = dv = 16, K 4.
const TINY: DeltaNetShape =
    DeltaNetShape { key_heads: 2, value_heads: 4, key_head_dim: 16, value_head_dim: 16, conv_kernel: 4 };
/// Qwen3-Next-80B-A3B: 16 key / 32 value heads of 128, conv kernel 4.
const NEXT_80B: DeltaNetShape =
    DeltaNetShape { key_heads: 16, value_heads: 32, key_head_dim: 128, value_head_dim: 128, conv_kernel: 4 };
/// Odd sizes: dk, dv not multiples of 32 or 8, Hv/Hk 3, K 3.
const ODD: DeltaNetShape =
    DeltaNetShape { key_heads: 1, value_heads: 3, key_head_dim: 20, value_head_dim: 40, conv_kernel: 3 };

const SHAPES: [(&str, DeltaNetShape); 3] = [("tiny", TINY), ("80B", NEXT_80B), ("odd", ODD)];
/// Around the chunk size (64) and the conv window (K-1 = 3).
const TOKENS: [usize; 7] = [1, 2, 63, 64, 65, 130, 300];
const EPS: f32 = 1e-6;
const TOL_RULE: f32 = 1e-4;
const TOL_ELEMENTWISE: f32 = 1e-5;

/// A layer's small weights with realistic gates: A = exp(a_log) in [1, 16],
/// softplus(dt_bias) = dt in [0.001, 0.1] log-uniform (Mamba's init), so g is
/// neither ~0 nor saturated.
struct Layer {
    conv1d: Vec<f32>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    norm: Vec<f32>,
}

fn layer(seed: u64, s: DeltaNetShape) -> Layer {
    let mut r = Rng::new(seed);
    let a_log = (0..s.value_heads).map(|_| (1.0 + 15.0 * r.next_f32()).ln()).collect();
    let dt_bias = (0..s.value_heads)
        .map(|_| {
            let dt = (0.001f32.ln() + (0.1f32.ln() - 0.001f32.ln()) * r.next_f32()).exp();
            dt.exp_m1().ln()
        })
        .collect();
    let norm = rand_f32(seed + 1, s.value_head_dim, 0.2).iter().map(|x| 1.0 + x).collect();
    Layer { conv1d: rand_f32(seed + 2, s.conv_dim() * s.conv_kernel, 0.5), dt_bias, a_log, norm }
}

fn device_weights(gpu: &Gpu, l: &Layer, s: DeltaNetShape) -> Result<DeltaNetDeviceWeights, String> {
    DeltaNetDeviceWeights::new(gpu, &l.conv1d, &l.dt_bias, &l.a_log, &l.norm, s).map_err(e)
}

/// in_proj outputs: mixed_qkvz [T, qkvz_dim] ~ N(0, 1), mixed_ba [T, 2Hv]
/// with b ~ N(0, 1) and a ~ N(0, 0.25).
fn inputs(seed: u64, s: DeltaNetShape, t: usize) -> (Vec<f32>, Vec<f32>) {
    let qkvz = rand_f32(seed, t * s.qkvz_dim(), 1.0);
    let mut ba = rand_f32(seed + 1, t * s.ba_dim(), 1.0);
    let r = s.group();
    for (i, x) in ba.iter_mut().enumerate() {
        if i % (2 * r) >= r {
            *x *= 0.5; // the a half of each group
        }
    }
    (qkvz, ba)
}

/// A random non-zero state (a sequence already under way).
fn start_state(seed: u64, s: DeltaNetShape) -> DeltaNetState {
    DeltaNetState {
        conv: rand_f32(seed, s.conv_state_len(), 1.0),
        recurrent: rand_f32(seed + 1, s.recurrent_state_len(), 0.5),
    }
}

/// The conv channels cat(q, k, v) of each row.
fn cat_qkv(s: DeltaNetShape, t: usize, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    let (kd, vd, cd) = (s.key_dim(), s.value_dim(), s.conv_dim());
    let mut qkv = vec![0.0; t * cd];
    for (i, r) in qkv.chunks_mut(cd).enumerate() {
        r[..kd].copy_from_slice(&q[i * kd..][..kd]);
        r[kd..2 * kd].copy_from_slice(&k[i * kd..][..kd]);
        r[2 * kd..].copy_from_slice(&v[i * vd..][..vd]);
    }
    qkv
}

/// qkv [T, conv_dim] back into q, k [T, Hk*dk] and v [T, Hv*dv].
fn split_qkv(s: DeltaNetShape, qkv: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (kd, cd) = (s.key_dim(), s.conv_dim());
    let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
    for r in qkv.chunks(cd) {
        q.extend_from_slice(&r[..kd]);
        k.extend_from_slice(&r[kd..2 * kd]);
        v.extend_from_slice(&r[2 * kd..]);
    }
    (q, k, v)
}

/// The CPU split + conv: (qkv [T, conv_dim] after SiLU, z [T, Hv*dv]).
fn cpu_conv(s: DeltaNetShape, l: &Layer, qkvz: &[f32], t: usize, conv_state: &mut [f32]) -> (Vec<f32>, Vec<f32>) {
    let (kd, vd) = (s.key_dim(), s.value_dim());
    let (mut q, mut k) = (vec![0.0; t * kd], vec![0.0; t * kd]);
    let (mut v, mut z) = (vec![0.0; t * vd], vec![0.0; t * vd]);
    split_qkvz(qkvz, s, &mut q, &mut k, &mut v, &mut z);
    let qkv = cat_qkv(s, t, &q, &k, &v);
    let mut conv = vec![0.0; qkv.len()];
    causal_conv1d(&qkv, &l.conv1d, conv_state, &mut conv);
    (conv, z)
}

/// The CPU gates + delta rule over conv output `qkv`: core [T, Hv*dv].
fn cpu_rule(s: DeltaNetShape, l: &Layer, qkv: &[f32], ba: &[f32], recurrent: &mut [f32], chunked: bool) -> Vec<f32> {
    let t = qkv.len() / s.conv_dim();
    let (q, k, v) = split_qkv(s, qkv);
    let (mut b, mut a) = (vec![0.0; t * s.value_heads], vec![0.0; t * s.value_heads]);
    split_ba(ba, s, &mut b, &mut a);
    let (mut beta, mut g) = (vec![0.0; b.len()], vec![0.0; b.len()]);
    deltanet_gates(&b, &a, &l.a_log, &l.dt_bias, &mut beta, &mut g);
    let mut core = vec![0.0; t * s.value_dim()];
    if chunked {
        gated_delta_rule_chunked(&q, &k, &v, &g, &beta, s, DELTA_RULE_CHUNK, recurrent, &mut core);
    } else {
        gated_delta_rule_recurrent(&q, &k, &v, &g, &beta, s, recurrent, &mut core);
    }
    core
}

/// What `gated_deltanet_layer` does between in_proj and out_proj: split, conv,
/// gates, the rule (recurrent for one token, chunked for more), gated RMSNorm.
fn cpu_core(s: DeltaNetShape, l: &Layer, qkvz: &[f32], ba: &[f32], t: usize, state: &mut DeltaNetState) -> Vec<f32> {
    let (qkv, z) = cpu_conv(s, l, qkvz, t, &mut state.conv);
    let core = cpu_rule(s, l, &qkv, ba, &mut state.recurrent, t > 1);
    let mut out = vec![0.0; core.len()];
    gated_rmsnorm(&core, &z, &l.norm, EPS, &mut out);
    out
}

/// Downloads `d` and checks its first `n` values against `want` and that the
/// rest (poisoned before the launch) is still NaN: nothing written past the end.
fn check_rows(gpu: &Gpu, what: &str, d: &CudaSlice<f32>, want: &[f32], tol: f32) -> Result<(), String> {
    let got = gpu.download(d).map_err(e)?;
    check_close(what, &got[..want.len()], want, tol)?;
    if let Some(i) = got[want.len()..].iter().position(|x| !x.is_nan()) {
        return Err(format!("{what}: wrote past its {} values (at {})", want.len(), want.len() + i));
    }
    Ok(())
}

fn conv_silu_matches_cpu(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let l = layer(10, s);
        let w = device_weights(gpu, &l, s)?;
        for t in TOKENS {
            let what = format!("conv {name} T {t}");
            let (qkvz, _) = inputs(20 + t as u64, s, t);
            let mut state = start_state(30 + t as u64, s).conv;
            let mut d_state = gpu.upload(&state).map_err(e)?;
            let (want, _) = cpu_conv(s, &l, &qkvz, t, &mut state);
            let d_qkvz = gpu.upload(&qkvz).map_err(e)?;
            let mut out = poisoned(gpu, (t + 1) * s.conv_dim())?;
            conv_silu(gpu, &d_qkvz, &w.conv1d, s, t, &mut d_state, &mut out).map_err(e)?;
            check_rows(gpu, &what, &out, &want, TOL_ELEMENTWISE)?;
            check_close(&format!("{what} state"), &gpu.download(&d_state).map_err(e)?, &state, 0.0)?;
        }
    }
    Ok(())
}

/// The rule stages on random conv outputs: (qkv, mixed_ba, start state).
fn rule_case(s: DeltaNetShape, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (_, ba) = inputs(40 + t as u64, s, t);
    (rand_f32(50 + t as u64, t * s.conv_dim(), 1.0), ba, start_state(60 + t as u64, s).recurrent)
}

fn recurrent_rule_matches_cpu(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let l = layer(11, s);
        let w = device_weights(gpu, &l, s)?;
        for t in TOKENS {
            let what = format!("recurrent rule {name} T {t}");
            let (qkv, ba, mut state) = rule_case(s, t);
            let mut d_state = gpu.upload(&state).map_err(e)?;
            // The recurrent form on the CPU too: the same function, token by token.
            let want = cpu_rule(s, &l, &qkv, &ba, &mut state, false);
            let (d_qkv, d_ba) = (gpu.upload(&qkv).map_err(e)?, gpu.upload(&ba).map_err(e)?);
            let mut core = poisoned(gpu, (t + 1) * s.value_dim())?;
            delta_rule_recurrent(gpu, &d_qkv, &d_ba, &w, s, t, &mut d_state, &mut core).map_err(e)?;
            check_rows(gpu, &what, &core, &want, TOL_RULE)?;
            check_close(&format!("{what} state"), &gpu.download(&d_state).map_err(e)?, &state, TOL_RULE)?;
        }
    }
    Ok(())
}

fn chunked_rule_matches_cpu(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let l = layer(12, s);
        let w = device_weights(gpu, &l, s)?;
        for t in TOKENS {
            let what = format!("chunked rule {name} T {t}");
            let (qkv, ba, mut state) = rule_case(s, t);
            let mut d_state = gpu.upload(&state).map_err(e)?;
            let want = cpu_rule(s, &l, &qkv, &ba, &mut state, true);
            let (mut d_qkv, d_ba) = (gpu.upload(&qkv).map_err(e)?, gpu.upload(&ba).map_err(e)?);
            let mut scratch = DeltaRuleChunkScratch::new(gpu, s, t).map_err(e)?;
            let mut core = poisoned(gpu, (t + 1) * s.value_dim())?;
            delta_rule_chunked(gpu, &mut d_qkv, &d_ba, &w, s, t, &mut scratch, &mut d_state, &mut core).map_err(e)?;
            check_rows(gpu, &what, &core, &want, TOL_RULE)?;
            check_close(&format!("{what} state"), &gpu.download(&d_state).map_err(e)?, &state, TOL_RULE)?;
        }
    }
    Ok(())
}

fn gated_rmsnorm_matches_cpu(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let l = layer(13, s);
        let w = device_weights(gpu, &l, s)?;
        for t in [1, 3, 64, 300] {
            let what = format!("gated rmsnorm {name} T {t}");
            let (qkvz, _) = inputs(70 + t as u64, s, t);
            let core = rand_f32(80 + t as u64, t * s.value_dim(), 0.7);
            let (kd, vd) = (s.key_dim(), s.value_dim());
            let (mut q, mut k) = (vec![0.0; t * kd], vec![0.0; t * kd]);
            let (mut v, mut z) = (vec![0.0; t * vd], vec![0.0; t * vd]);
            split_qkvz(&qkvz, s, &mut q, &mut k, &mut v, &mut z);
            let mut want = vec![0.0; core.len()];
            gated_rmsnorm(&core, &z, &l.norm, EPS, &mut want);
            let (d_core, d_qkvz) = (gpu.upload(&core).map_err(e)?, gpu.upload(&qkvz).map_err(e)?);
            let mut out = poisoned(gpu, (t + 1) * vd)?;
            gpu_norm(gpu, &d_core, &d_qkvz, &w.norm, s, EPS, t, &mut out).map_err(e)?;
            check_rows(gpu, &what, &out, &want, TOL_ELEMENTWISE)?;
        }
    }
    Ok(())
}

/// One `deltanet_core_with` call; returns the output rows.
#[allow(clippy::too_many_arguments)]
fn gpu_core(
    gpu: &Gpu,
    s: DeltaNetShape,
    w: &DeltaNetDeviceWeights,
    qkvz: &[f32],
    ba: &[f32],
    t: usize,
    state: &mut DeviceDeltaState,
    form: DeltaRuleForm,
) -> Result<Vec<f32>, String> {
    let (d_qkvz, d_ba) = (gpu.upload(qkvz).map_err(e)?, gpu.upload(ba).map_err(e)?);
    let mut out = poisoned(gpu, (t + 1) * s.value_dim())?;
    let mut scratch = DeltaNetScratch::new(gpu, s, t).map_err(e)?;
    deltanet_core_with(gpu, &d_qkvz, &d_ba, w, s, EPS, t, state, &mut out, &mut scratch, form).map_err(e)?;
    let got = gpu.download(&out).map_err(e)?;
    let n = t * s.value_dim();
    if let Some(i) = got[n..].iter().position(|x| !x.is_nan()) {
        return Err(format!("deltanet_core wrote past its {n} values (at {})", n + i));
    }
    Ok(got[..n].to_vec())
}

fn check_state(gpu: &Gpu, what: &str, got: &DeviceDeltaState, want: &DeltaNetState) -> Result<(), String> {
    let got = got.download(gpu).map_err(e)?;
    check_close(&format!("{what} conv state"), &got.conv, &want.conv, 0.0)?;
    check_close(&format!("{what} recurrent state"), &got.recurrent, &want.recurrent, TOL_RULE)
}

fn core_matches_cpu_layer(gpu: &Arc<Gpu>) -> Result<(), String> {
    // Auto must take the chunked form for T > 1 on every CC >= 8.0 device.
    if gpu.compute_capability() >= (8, 0) && !chunked_form_fits(gpu, NEXT_80B).map_err(e)? {
        return Err("the chunked form's shared memory does not fit a CC >= 8.0 device".into());
    }
    for (name, s) in SHAPES {
        let l = layer(14, s);
        let w = device_weights(gpu, &l, s)?;
        for t in TOKENS {
            let (qkvz, ba) = inputs(90 + t as u64, s, t);
            let start = start_state(100 + t as u64, s);
            let mut want_state = start.clone();
            let want = cpu_core(s, &l, &qkvz, &ba, t, &mut want_state);
            for form in [DeltaRuleForm::Auto, DeltaRuleForm::Recurrent, DeltaRuleForm::Chunked] {
                let what = format!("core {name} T {t} {form:?}");
                let mut state = DeviceDeltaState::upload(gpu, &start).map_err(e)?;
                let got = gpu_core(gpu, s, &w, &qkvz, &ba, t, &mut state, form)?;
                check_close(&what, &got, &want, TOL_RULE)?;
                check_state(gpu, &what, &state, &want_state)?;
            }
        }
        // The plain entry point (its own scratch), from a zero state.
        let t = 65;
        let (qkvz, ba) = inputs(110, s, t);
        let mut want_state = DeltaNetState::new(s);
        let want = cpu_core(s, &l, &qkvz, &ba, t, &mut want_state);
        let mut state = DeviceDeltaState::new(gpu, s).map_err(e)?;
        let (d_qkvz, d_ba) = (gpu.upload(&qkvz).map_err(e)?, gpu.upload(&ba).map_err(e)?);
        let mut out = poisoned(gpu, t * s.value_dim())?;
        deltanet_core(gpu, &d_qkvz, &d_ba, &w, s, EPS, t, &mut state, &mut out).map_err(e)?;
        let what = format!("deltanet_core {name} T {t} from zeros");
        check_close(&what, &gpu.download(&out).map_err(e)?, &want, TOL_RULE)?;
        check_state(gpu, &what, &state, &want_state)?;
    }
    Ok(())
}

/// T tokens in one call == the same tokens in calls of 1, 7 and the rest
/// (each call from the state the previous one left), against the CPU too.
fn core_split_calls_equal_one_call(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let l = layer(15, s);
        let w = device_weights(gpu, &l, s)?;
        let t = 300;
        let (qkvz, ba) = inputs(120, s, t);
        let start = start_state(130, s);
        let mut want_state = start.clone();
        let want = cpu_core(s, &l, &qkvz, &ba, t, &mut want_state);
        for form in [DeltaRuleForm::Auto, DeltaRuleForm::Recurrent, DeltaRuleForm::Chunked] {
            let mut one_state = DeviceDeltaState::upload(gpu, &start).map_err(e)?;
            let one = gpu_core(gpu, s, &w, &qkvz, &ba, t, &mut one_state, form)?;
            let mut state = DeviceDeltaState::upload(gpu, &start).map_err(e)?;
            let mut split = Vec::new();
            for (lo, hi) in [(0, 1), (1, 8), (8, t)] {
                let part = gpu_core(
                    gpu,
                    s,
                    &w,
                    &qkvz[lo * s.qkvz_dim()..hi * s.qkvz_dim()],
                    &ba[lo * s.ba_dim()..hi * s.ba_dim()],
                    hi - lo,
                    &mut state,
                    form,
                )?;
                split.extend(part);
            }
            let what = format!("{name} {form:?} T {t} in calls of 1, 7, 292");
            check_close(&format!("{what} vs one call"), &split, &one, TOL_RULE)?;
            check_close(&format!("{what} vs CPU"), &split, &want, TOL_RULE)?;
            let one_host = one_state.download(gpu).map_err(e)?;
            check_state(gpu, &format!("{what} vs one call"), &state, &one_host)?;
            check_state(gpu, &format!("{what} vs CPU"), &state, &want_state)?;
        }
    }
    Ok(())
}

fn state_upload_download_copy(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (name, s) in SHAPES {
        let zero = DeviceDeltaState::new(gpu, s).map_err(e)?.download(gpu).map_err(e)?;
        if zero != DeltaNetState::new(s) {
            return Err(format!("{name}: DeviceDeltaState::new is not the zero state of the shape"));
        }
        let host = start_state(140, s);
        let a = DeviceDeltaState::upload(gpu, &host).map_err(e)?;
        if a.download(gpu).map_err(e)? != host {
            return Err(format!("{name}: upload/download changed the state"));
        }
        let mut b = DeviceDeltaState::upload(gpu, &start_state(150, s)).map_err(e)?;
        b.copy_from(gpu, &a).map_err(e)?;
        if b.download(gpu).map_err(e)? != host {
            return Err(format!("{name}: copy_from did not copy the state"));
        }
    }
    let mut small = DeviceDeltaState::new(gpu, TINY).map_err(e)?;
    let big = DeviceDeltaState::new(gpu, NEXT_80B).map_err(e)?;
    match small.copy_from(gpu, &big) {
        Err(Error::InvalidArgument(_)) => Ok(()),
        other => Err(format!("copy_from a state of another shape: {:?}", other.map_err(|x| x.to_string()))),
    }
}

fn rejects_bad_arguments(gpu: &Arc<Gpu>) -> Result<(), String> {
    let s = TINY;
    let l = layer(16, s);
    let w = device_weights(gpu, &l, s)?;
    let t = 5;
    let (qkvz, ba) = inputs(160, s, t);
    let start = start_state(170, s);
    let d_qkvz = gpu.upload(&qkvz).map_err(e)?;
    let d_ba = gpu.upload(&ba).map_err(e)?;
    let short_ba = gpu.upload(&ba[..ba.len() - 1]).map_err(e)?;
    let mut out = poisoned(gpu, t * s.value_dim())?;
    let mut short_out = poisoned(gpu, t * s.value_dim() - 1)?;
    let mut state = DeviceDeltaState::upload(gpu, &start).map_err(e)?;
    let mut small = DeltaNetScratch::new(gpu, s, t - 1).map_err(e)?;
    let odd = DeltaNetShape { value_heads: 3, ..s };
    let cases: [(&str, Result<(), Error>); 5] = [
        ("short mixed_ba", deltanet_core(gpu, &d_qkvz, &short_ba, &w, s, EPS, t, &mut state, &mut out)),
        ("short out", deltanet_core(gpu, &d_qkvz, &d_ba, &w, s, EPS, t, &mut state, &mut short_out)),
        ("weights of another shape", deltanet_core(gpu, &d_qkvz, &d_ba, &w, NEXT_80B, EPS, 1, &mut state, &mut out)),
        (
            "scratch too small",
            deltanet_core_with(
                gpu,
                &d_qkvz,
                &d_ba,
                &w,
                s,
                EPS,
                t,
                &mut state,
                &mut out,
                &mut small,
                DeltaRuleForm::Auto,
            ),
        ),
        ("Hv not a multiple of Hk", deltanet_core(gpu, &d_qkvz, &d_ba, &w, odd, EPS, 1, &mut state, &mut out)),
    ];
    for (what, r) in cases {
        match r {
            Err(Error::InvalidArgument(_)) => {}
            other => return Err(format!("{what}: want InvalidArgument, got {:?}", other.map_err(|x| x.to_string()))),
        }
    }
    if state.download(gpu).map_err(e)? != start {
        return Err("a rejected call changed the state".into());
    }
    Ok(())
}

/// The median time (seconds) of `work` over `repeats` runs after one warm-up.
fn median_seconds(gpu: &Gpu, repeats: usize, mut work: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let ctx = gpu.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    work()?;
    gpu.sync().map_err(e)?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        start.record(gpu.stream()).map_err(e)?;
        work()?;
        end.record(gpu.stream()).map_err(e)?;
        times.push(start.elapsed_ms(&end).map_err(e)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[repeats / 2])
}

/// Decode (T 1) at 80B: the recurrent rule reads and writes the 2 MiB state
/// (32 heads x 128 x 128 x 4 B); its floor is those 4 MiB at ~4.3 TB/s (~1 us).
/// Prefill: 4096 tokens, chunked vs token by token, and the chunked time against the
/// 5.38 ms of the form before the WY rewrite.
fn timing_80b(gpu: &Arc<Gpu>) -> Result<(), String> {
    let s = NEXT_80B;
    let l = layer(17, s);
    let w = device_weights(gpu, &l, s)?;
    let (qkvz, ba) = inputs(180, s, 1);
    let (d_qkvz, d_ba) = (gpu.upload(&qkvz).map_err(e)?, gpu.upload(&ba).map_err(e)?);
    let mut state = DeviceDeltaState::upload(gpu, &start_state(190, s)).map_err(e)?;
    let mut out = poisoned(gpu, s.value_dim())?;
    let mut scratch = DeltaNetScratch::new(gpu, s, 4096).map_err(e)?;
    let qkv = gpu.upload(&rand_f32(200, s.conv_dim(), 1.0)).map_err(e)?;
    let mut core = poisoned(gpu, s.value_dim())?;
    let rule = median_seconds(gpu, 51, || {
        delta_rule_recurrent(gpu, &qkv, &d_ba, &w, s, 1, &mut state.recurrent, &mut core).map_err(e)
    })?;
    let whole = median_seconds(gpu, 51, || {
        deltanet_core_with(gpu, &d_qkvz, &d_ba, &w, s, EPS, 1, &mut state, &mut out, &mut scratch, DeltaRuleForm::Auto)
            .map_err(e)
    })?;
    let bytes = 2.0 * (s.recurrent_state_len() * 4) as f64;
    println!(
        "     deltanet decode 80B T 1: rule {:.1} us ({:.0} GB/s of state read+write, {:.0}% of 4300 GB/s), whole \
         core (conv + rule + norm) {:.1} us",
        rule * 1e6,
        bytes / rule / 1e9,
        bytes / rule / 4.3e12 * 100.0,
        whole * 1e6
    );

    let t = 4096;
    let (qkvz, ba) = inputs(210, s, t);
    let (d_qkvz, d_ba) = (gpu.upload(&qkvz).map_err(e)?, gpu.upload(&ba).map_err(e)?);
    let mut out = poisoned(gpu, t * s.value_dim())?;
    let mut line = format!("     deltanet prefill 80B T {t}:");
    let mut chunked = 0.0;
    for form in [DeltaRuleForm::Chunked, DeltaRuleForm::Recurrent] {
        let secs = median_seconds(gpu, 3, || {
            deltanet_core_with(gpu, &d_qkvz, &d_ba, &w, s, EPS, t, &mut state, &mut out, &mut scratch, form).map_err(e)
        })?;
        if form == DeltaRuleForm::Chunked {
            chunked = secs;
        }
        line += &format!(" {form:?} {:.2} ms ({:.1} us/token)", secs * 1e3, secs * 1e6 / t as f64);
    }
    println!("{line}");
    // The chunked form before the WY rewrite (dn_chunk_state over Tm and attn, 128 blocks)
    // took 5.38 ms on the H200; the goal is under 1.5 ms.
    println!(
        "     deltanet prefill 80B T {t}: chunked (WY form, state kernel over W, Q', U) {:.2} ms = {:.0}% of the \
         5.38 ms before (goal < 1.5 ms); ~{:.1} TFLOP/s of its ~13 GFLOP",
        chunked * 1e3,
        chunked / 5.38e-3 * 100.0,
        6.0 * (s.value_heads * s.key_head_dim * s.value_head_dim * t) as f64 / chunked / 1e12
    );
    match gpu.download(&out).map_err(e)?.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(format!("prefill output [{i}] is not finite")),
        None => Ok(()),
    }
}
