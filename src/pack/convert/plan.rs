//! The conversion plan: for every tensor the pack needs, where its bytes come
//! from and how they are stored. Building the plan reads only safetensors
//! headers and scalar global scales, and checks every shape, dtype and global
//! scale, so a bad checkpoint fails before a byte of the pack is written.

use std::borrow::Cow;
use std::collections::HashSet;

use safetensors::Dtype;

use super::checkpoint::{Checkpoint, Scheme, Tensor};
use super::DenseFormat;
use crate::error::{Error, Result};
use crate::model::weights::{layer_prefix, model_tensor_name, required_dense_tensors, Role};
use crate::model::ModelConfig;
use crate::pack::format::DType;
use crate::quant::nvfp4::BLOCK;
use crate::quant::{bf16_bytes_to_f32, f16_bytes_to_f32, f32_bytes_to_f32, Nvfp4Matrix};

/// Elements decoded at a time when a tensor is converted piecewise.
pub const CHUNK_ELEMS: usize = 1 << 22;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDtype {
    Bf16,
    F16,
    F32,
}

impl FloatDtype {
    fn of(d: Dtype) -> Option<FloatDtype> {
        match d {
            Dtype::BF16 => Some(FloatDtype::Bf16),
            Dtype::F16 => Some(FloatDtype::F16),
            Dtype::F32 => Some(FloatDtype::F32),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            FloatDtype::Bf16 | FloatDtype::F16 => 2,
            FloatDtype::F32 => 4,
        }
    }
}

/// Row-major floating-point weights borrowed from a checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct FloatData<'a> {
    pub dtype: FloatDtype,
    pub bytes: &'a [u8],
}

impl<'a> FloatData<'a> {
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Decodes elements `first .. first + out.len()` (exact for every dtype).
    pub fn decode(&self, first: usize, out: &mut [f32]) {
        let s = self.dtype.size();
        let b = &self.bytes[first * s..(first + out.len()) * s];
        match self.dtype {
            FloatDtype::Bf16 => bf16_bytes_to_f32(b, out),
            FloatDtype::F16 => f16_bytes_to_f32(b, out),
            FloatDtype::F32 => f32_bytes_to_f32(b, out),
        }
    }

    /// The elements as little-endian BF16: borrowed when already BF16, else
    /// rounded to nearest even (F32 and F16 lose mantissa bits here).
    pub fn to_bf16(self) -> Cow<'a, [u8]> {
        if self.dtype == FloatDtype::Bf16 {
            return Cow::Borrowed(self.bytes);
        }
        let n = self.len();
        let mut out = Vec::with_capacity(n * 2);
        let mut buf = vec![0.0f32; n.min(CHUNK_ELEMS)];
        let mut first = 0;
        while first < n {
            let len = (n - first).min(CHUNK_ELEMS);
            self.decode(first, &mut buf[..len]);
            out.extend_from_slice(&crate::quant::f32_to_bf16_bytes(&buf[..len]));
            first += len;
        }
        Cow::Owned(out)
    }

    /// The elements as little-endian F32 (exact for every dtype): borrowed
    /// when already F32. For small tensors (decoded whole).
    pub fn to_f32(self) -> Cow<'a, [u8]> {
        if self.dtype == FloatDtype::F32 {
            return Cow::Borrowed(self.bytes);
        }
        let mut v = vec![0.0f32; self.len()];
        self.decode(0, &mut v);
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Where one weight's bytes come from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// BF16/F16/F32 weights, row-major in the logical shape.
    Float(FloatData<'a>),
    /// NVFP4 codes and block scales carried over unchanged, with the global
    /// scale already converted to a multiplier.
    Nvfp4(Nvfp4Matrix<'a>),
}

/// One 2-D matrix: `name` is what errors call it.
#[derive(Clone, Debug)]
pub struct MatrixPlan<'a> {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub src: Source<'a>,
}

/// One dense tensor of the pack.
#[derive(Clone, Debug)]
pub struct DensePlan<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub src: Source<'a>,
    /// How the pack stores it; `Nvfp4` with a float source means we quantize it.
    pub store: DType,
}

/// One expert: gate and up `[moe_intermediate, hidden]`, down `[hidden, moe_intermediate]`.
#[derive(Clone, Debug)]
pub struct ExpertPlan<'a> {
    pub gate: MatrixPlan<'a>,
    pub up: MatrixPlan<'a>,
    pub down: MatrixPlan<'a>,
}

pub struct Plan<'a> {
    /// In `required_dense_tensors` order.
    pub dense: Vec<DensePlan<'a>>,
    /// `[layer][expert]`, main layers then MTP layers.
    pub experts: Vec<Vec<ExpertPlan<'a>>>,
    /// Checkpoint tensors the model does not use, sorted.
    pub skipped: Vec<String>,
}

/// Builds and validates the plan for `cfg` from the checkpoint.
pub fn plan<'a>(ck: &Checkpoint<'a>, cfg: &ModelConfig, scheme: Scheme, dense: DenseFormat) -> Result<Plan<'a>> {
    let mut p = Planner { ck, scheme, used: HashSet::new() };
    let mut dense_plans = Vec::new();
    for (name, shape, role) in required_dense_tensors(cfg) {
        let src = match name.strip_suffix(".weight") {
            Some(prefix) => p.weight(prefix, &shape, "").map_err(|e| match e {
                Error::Tensor { name, msg } if name == model_tensor_name(Role::LmHead) && !ck.contains(&name) => {
                    Error::Tensor {
                        name,
                        msg: format!("{msg}; config.json has tie_word_embeddings = false, so the model needs it"),
                    }
                }
                e => e,
            })?,
            // A_log and dt_bias are parameters without a `.weight` suffix.
            None => Source::Float(float_data(&p.require(&name)?, &shape, "")?),
        };
        let store = match src {
            Source::Nvfp4(_) if !role.is_linear() => {
                return Err(Error::tensor(&name, "is NVFP4 in the checkpoint, but only linear weights may be"));
            }
            Source::Nvfp4(_) => DType::Nvfp4,
            // qwen3_next's shared expert is NVFP4 in every pack, like the routed experts.
            Source::Float(_) if role.is_shared_expert() || (dense == DenseFormat::Nvfp4 && role.may_quantize()) => {
                if shape.len() != 2 || shape[1] % BLOCK != 0 {
                    return Err(Error::tensor(
                        &name,
                        format!(
                            "shape {shape:?} cannot be stored as NVFP4: the input dimension must be \
                             a multiple of {BLOCK} (convert with BF16 dense tensors instead)"
                        ),
                    ));
                }
                DType::Nvfp4
            }
            Source::Float(f) if role.keeps_f32() && f.dtype != FloatDtype::Bf16 => DType::F32,
            Source::Float(_) => DType::Bf16,
        };
        dense_plans.push(DensePlan { name, shape, src, store });
    }
    let experts = (0..cfg.num_expert_layers()).map(|l| p.layer_experts(l, cfg)).collect::<Result<Vec<_>>>()?;
    let mut skipped: Vec<String> = ck.names().filter(|n| !p.used.contains(*n)).map(str::to_string).collect();
    skipped.sort_unstable();
    Ok(Plan { dense: dense_plans, experts, skipped })
}

struct Planner<'a, 'c> {
    ck: &'c Checkpoint<'a>,
    scheme: Scheme,
    /// Every checkpoint tensor the plan reads (the rest is reported as skipped).
    used: HashSet<String>,
}

impl<'a> Planner<'a, '_> {
    fn get(&mut self, name: &str) -> Option<Tensor<'a>> {
        let t = self.ck.get(name)?;
        self.used.insert(name.to_string());
        Some(t)
    }

    fn require(&mut self, name: &str) -> Result<Tensor<'a>> {
        self.get(name).ok_or_else(|| self.ck.missing(name))
    }

    /// The weight stored under `prefix` (`X` of `X.weight`) with logical
    /// shape `shape`: NVFP4 when the scheme's quantized tensors are present
    /// for it, else float. `what` describes the shape's axes in messages.
    fn weight(&mut self, prefix: &str, shape: &[usize], what: &str) -> Result<Source<'a>> {
        match self.scheme {
            Scheme::Modelopt if self.ck.contains(&format!("{prefix}.weight_scale")) => {
                self.nvfp4(prefix, shape, "weight", "weight_scale_2", false)
            }
            Scheme::CompressedTensors if self.ck.contains(&format!("{prefix}.weight_packed")) => {
                self.nvfp4(prefix, shape, "weight_packed", "weight_global_scale", true)
            }
            _ => {
                let t = self.require(&format!("{prefix}.weight"))?;
                float_data(&t, shape, what).map(Source::Float)
            }
        }
    }

    /// An NVFP4 weight: codes `{prefix}.{codes}` U8 `[N, K/2]`, block scales
    /// `{prefix}.weight_scale` E4M3 (or U8) `[N, K/16]`, and the global scale
    /// `{prefix}.{global}`, a divisor when `divisor`.
    fn nvfp4(&mut self, prefix: &str, shape: &[usize], codes: &str, global: &str, divisor: bool) -> Result<Source<'a>> {
        let codes_t = self.require(&format!("{prefix}.{codes}"))?;
        let &[n, k] = shape else {
            return Err(codes_t
                .err(format!("is NVFP4, but the model needs a {}-D tensor of shape {shape:?} here", shape.len())));
        };
        if k % BLOCK != 0 {
            return Err(codes_t.err(format!("is NVFP4, but its input dimension {k} is not a multiple of {BLOCK}")));
        }
        expect(&codes_t, &[Dtype::U8], &[n, k / 2], "NVFP4 codes")?;
        let scales_t = self.require(&format!("{prefix}.weight_scale"))?;
        expect(&scales_t, &[Dtype::F8_E4M3, Dtype::U8], &[n, k / BLOCK], "NVFP4 block scales")?;
        let g_t = self.require(&format!("{prefix}.{global}"))?;
        let global_scale = global_scale(&g_t, divisor)?;
        // Activation scales and CT's shape record are not weights; the
        // shape record, when present, must agree.
        for extra in ["input_scale", "input_global_scale"] {
            self.get(&format!("{prefix}.{extra}"));
        }
        if let Some(s) = self.get(&format!("{prefix}.weight_shape")) {
            check_shape_record(&s, n, k)?;
        }
        let m = Nvfp4Matrix::new(n, k, codes_t.data, scales_t.data, global_scale, &codes_t.name)?;
        Ok(Source::Nvfp4(m))
    }

    /// The experts of layer `l` (main layers, then MTP layers): per-expert
    /// keys, or the fused 3-D pair.
    fn layer_experts(&mut self, l: usize, cfg: &ModelConfig) -> Result<Vec<ExpertPlan<'a>>> {
        let (h, i, ne) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
        let base = format!("{}mlp.experts", layer_prefix(cfg, l));
        let fused_gu = format!("{base}.gate_up_proj");
        if !self.ck.contains(&fused_gu) {
            return (0..ne)
                .map(|e| {
                    let m = |p: &mut Self, proj: &str, rows, cols, what| -> Result<MatrixPlan<'a>> {
                        let prefix = format!("{base}.{e}.{proj}");
                        let src = p.weight(&prefix, &[rows, cols], what)?;
                        Ok(MatrixPlan { name: format!("{prefix}.weight"), rows, cols, src })
                    };
                    Ok(ExpertPlan {
                        gate: m(self, "gate_proj", i, h, "[moe_intermediate, hidden]")?,
                        up: m(self, "up_proj", i, h, "[moe_intermediate, hidden]")?,
                        down: m(self, "down_proj", h, i, "[hidden, moe_intermediate]")?,
                    })
                })
                .collect();
        }
        // transformers 5.x in-memory layout: gate_up [E, 2I, H] with the gate's
        // rows first, down [E, H, I].
        for per in ["weight", "weight_packed"] {
            let key = format!("{base}.0.gate_proj.{per}");
            if self.ck.contains(&key) {
                return Err(Error::tensor(
                    &fused_gu,
                    format!("layer {l} has both this fused tensor and per-expert {key}"),
                ));
            }
        }
        let gu_t = self.require(&fused_gu)?;
        let gu = float_data(&gu_t, &[ne, 2 * i, h], "fused [experts, 2 * moe_intermediate, hidden]")?;
        let dn_t = self.require(&format!("{base}.down_proj"))?;
        let dn = float_data(&dn_t, &[ne, h, i], "fused [experts, hidden, moe_intermediate]")?;
        let slice = |f: FloatData<'a>, first: usize, n: usize| FloatData {
            dtype: f.dtype,
            bytes: &f.bytes[first * f.dtype.size()..(first + n) * f.dtype.size()],
        };
        let m = i * h;
        Ok((0..ne)
            .map(|e| ExpertPlan {
                gate: MatrixPlan {
                    name: format!("{fused_gu}[{e}] (gate rows)"),
                    rows: i,
                    cols: h,
                    src: Source::Float(slice(gu, 2 * e * m, m)),
                },
                up: MatrixPlan {
                    name: format!("{fused_gu}[{e}] (up rows)"),
                    rows: i,
                    cols: h,
                    src: Source::Float(slice(gu, 2 * e * m + m, m)),
                },
                down: MatrixPlan {
                    name: format!("{}[{e}]", dn_t.name),
                    rows: h,
                    cols: i,
                    src: Source::Float(slice(dn, e * m, m)),
                },
            })
            .collect())
    }
}

/// Checks a float tensor's dtype and exact shape (`what` names the axes).
fn float_data<'a>(t: &Tensor<'a>, shape: &[usize], what: &str) -> Result<FloatData<'a>> {
    let Some(dtype) = FloatDtype::of(t.dtype) else {
        return Err(t.err(format!(
            "dtype {:?}, expected BF16, F16 or F32 (quantized weights need their scale tensors \
             and a quantization_config in config.json)",
            t.dtype
        )));
    };
    check_shape(t, shape, what)?;
    Ok(FloatData { dtype, bytes: t.data })
}

fn check_shape(t: &Tensor<'_>, shape: &[usize], what: &str) -> Result<()> {
    if t.shape != shape {
        let what = if what.is_empty() { String::new() } else { format!(" = {what}") };
        return Err(t.err(format!("shape {:?}, expected {shape:?}{what} (from config.json)", t.shape)));
    }
    Ok(())
}

fn expect(t: &Tensor<'_>, dtypes: &[Dtype], shape: &[usize], what: &str) -> Result<()> {
    if !dtypes.contains(&t.dtype) {
        return Err(t.err(format!("{what} have dtype {:?}, expected one of {dtypes:?}", t.dtype)));
    }
    check_shape(t, shape, what)
}

/// Reads a scalar global scale and returns the multiplier: the value itself,
/// or `1 / value` (in f32) for a divisor. Both must be positive and finite.
fn global_scale(t: &Tensor<'_>, divisor: bool) -> Result<f32> {
    let Some(dtype) = FloatDtype::of(t.dtype) else {
        return Err(t.err(format!("global scale has dtype {:?}, expected F32", t.dtype)));
    };
    if t.shape.len() > 1 || t.shape.iter().product::<usize>() != 1 {
        return Err(t.err(format!("global scale has shape {:?}, expected [] or [1]", t.shape)));
    }
    let mut v = [0.0f32];
    FloatData { dtype, bytes: t.data }.decode(0, &mut v);
    let v = v[0];
    if !(v.is_finite() && v > 0.0) {
        return Err(t.err(format!("global scale {v} is not a positive finite number")));
    }
    let g = if divisor { 1.0 / v } else { v };
    if !(g.is_finite() && g > 0.0) {
        return Err(t.err(format!("global scale divisor {v} gives 1 / {v} = {g}, not a positive finite number")));
    }
    Ok(g)
}

/// compressed-tensors may record the unpacked shape `[N, K]` as integers.
fn check_shape_record(t: &Tensor<'_>, n: usize, k: usize) -> Result<()> {
    let vals: Vec<i64> = match t.dtype {
        Dtype::I64 => t.data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect(),
        Dtype::I32 => {
            t.data.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64).collect()
        }
        _ => return Ok(()),
    };
    if vals != [n as i64, k as i64] {
        return Err(t.err(format!("records the weight shape {vals:?}, the config needs [{n}, {k}]")));
    }
    Ok(())
}
