//! The normalized model config stored in a pack's manifest, and its parser
//! for Hugging Face `config.json` files (transformers 4.x and 5.x spellings).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::ops::RangeInclusive;
use std::path::Path;

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Qwen3Moe,
    Qwen3Next,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen3Next => "qwen3_next",
        }
    }

    /// Whether the model's RMSNorms (except DeltaNet's gated norm) scale by
    /// `1 + w` instead of `w`: qwen3_next's zero-centered norms.
    pub fn zero_centered_norms(self) -> bool {
        self == Arch::Qwen3Next
    }
}

/// YaRN rope scaling (formats-and-math.md section 4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    /// Multiplies cos and sin; `None` means `0.1 * ln(factor) + 1`.
    pub attention_factor: Option<f64>,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// qwen3_next's additions to the shape: the hybrid layer pattern, the Gated
/// DeltaNet (linear attention) geometry, the shared expert and the MTP head.
/// Field names are transformers'.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Qwen3NextConfig {
    /// Layer `i` (of the main stack) is full attention when
    /// `(i + 1) % full_attention_interval == 0`, else Gated DeltaNet.
    pub full_attention_interval: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub shared_expert_intermediate_size: usize,
    /// MTP layers after the main stack (0 = no MTP head).
    #[serde(default)]
    pub mtp_num_hidden_layers: usize,
}

/// The Gated DeltaNet shapes of a qwen3_next layer (formats-and-math.md
/// section 3): `Hk` key heads of `dk`, `Hv` value heads of `dv`, conv kernel `K`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttnShape {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl LinearAttnShape {
    /// `Hk * dk`: the width of q and of k.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// `Hv * dv`: the width of v, z and the mixer output.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Value heads per key head (`Hv / Hk`).
    pub fn value_heads_per_key_head(&self) -> usize {
        self.num_value_heads / self.num_key_heads
    }

    /// Conv channels `C = 2 * Hk * dk + Hv * dv` (q, k, v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Rows of `in_proj_qkvz`: `2 * Hk * dk + 2 * Hv * dv`.
    pub fn qkvz_dim(&self) -> usize {
        2 * self.key_dim() + 2 * self.value_dim()
    }

    /// Rows of `in_proj_ba`: `2 * Hv`.
    pub fn ba_dim(&self) -> usize {
        2 * self.num_value_heads
    }
}

impl Qwen3NextConfig {
    fn validate(&self) -> Result<()> {
        let n = self;
        check_dims(&[
            ("full_attention_interval", n.full_attention_interval, 1..=1 << 10),
            ("linear_num_key_heads", n.linear_num_key_heads, 1..=1 << 10),
            ("linear_num_value_heads", n.linear_num_value_heads, 1..=1 << 10),
            ("linear_key_head_dim", n.linear_key_head_dim, 1..=1 << 12),
            ("linear_value_head_dim", n.linear_value_head_dim, 1..=1 << 12),
            ("linear_conv_kernel_dim", n.linear_conv_kernel_dim, 1..=1 << 8),
            ("shared_expert_intermediate_size", n.shared_expert_intermediate_size, 1..=1 << 18),
            ("mtp_num_hidden_layers", n.mtp_num_hidden_layers, 0..=1 << 4),
        ])?;
        // Value head j reads key head j / (Hv / Hk).
        if n.linear_num_value_heads % n.linear_num_key_heads != 0 {
            return Err(Error::Config(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                n.linear_num_value_heads, n.linear_num_key_heads
            )));
        }
        // The shared expert is stored as NVFP4: 16-element blocks along its inputs.
        if n.shared_expert_intermediate_size % 16 != 0 {
            return Err(Error::Config(format!(
                "shared_expert_intermediate_size {} is not a multiple of 16 (the NVFP4 block size)",
                n.shared_expert_intermediate_size
            )));
        }
        Ok(())
    }
}

/// Fails on the first `(name, value, range)` whose value is outside its
/// range. The upper ends lie far above any published checkpoint, and low
/// enough that no product of them (a weight's elements or bytes, a layer
/// table) overflows usize or asks for an allocation that would abort the
/// host process before the tensors are checked against the files.
fn check_dims(dims: &[(&str, usize, RangeInclusive<usize>)]) -> Result<()> {
    for (name, v, range) in dims {
        if *v == 0 && !range.contains(v) {
            return Err(Error::Config(format!("{name} must be positive")));
        }
        if !range.contains(v) {
            return Err(Error::Config(format!("{name} {v} exceeds the supported maximum {}", range.end())));
        }
    }
    Ok(())
}

/// Everything the engine needs to know about a model's shape. Field names
/// follow transformers where a counterpart exists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Fraction of head_dim that is rotated (1.0 for qwen3_moe).
    pub partial_rotary_factor: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Present exactly for qwen3_next (absent from qwen3_moe manifests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qwen3_next: Option<Qwen3NextConfig>,
}

impl ModelConfig {
    /// Checks internal consistency; every later index computation relies on it.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        check_dims(&[
            ("vocab_size", c.vocab_size, 1..=1 << 22),
            ("hidden_size", c.hidden_size, 1..=1 << 16),
            ("num_hidden_layers", c.num_hidden_layers, 1..=1 << 10),
            ("num_attention_heads", c.num_attention_heads, 1..=1 << 10),
            ("num_key_value_heads", c.num_key_value_heads, 1..=1 << 10),
            ("head_dim", c.head_dim, 1..=1 << 12),
            ("num_experts", c.num_experts, 1..=1 << 14),
            ("num_experts_per_tok", c.num_experts_per_tok, 1..=1 << 14),
            ("moe_intermediate_size", c.moe_intermediate_size, 1..=1 << 18),
            ("max_position_embeddings", c.max_position_embeddings, 1..=1 << 24),
        ])?;
        if c.num_attention_heads % c.num_key_value_heads != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                c.num_attention_heads, c.num_key_value_heads
            )));
        }
        if c.num_experts_per_tok > c.num_experts {
            return Err(Error::Config(format!(
                "num_experts_per_tok {} exceeds num_experts {}",
                c.num_experts_per_tok, c.num_experts
            )));
        }
        // NVFP4 blocks are 16 elements along the input axis of every expert matrix.
        for (name, v) in [("hidden_size", c.hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)] {
            if v % 16 != 0 {
                return Err(Error::Config(format!("{name} {v} is not a multiple of 16 (the NVFP4 block size)")));
            }
        }
        if c.head_dim % 2 != 0 {
            return Err(Error::Config(format!("head_dim {} is odd", c.head_dim)));
        }
        if !(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0) {
            return Err(Error::Config(format!("partial_rotary_factor {} is not in (0, 1]", c.partial_rotary_factor)));
        }
        if self.rotary_dim() % 2 != 0 || self.rotary_dim() == 0 {
            return Err(Error::Config(format!("rotary dimension {} must be even and positive", self.rotary_dim())));
        }
        if !(c.rms_norm_eps > 0.0 && c.rms_norm_eps.is_finite()) {
            return Err(Error::Config(format!("rms_norm_eps {} is invalid", c.rms_norm_eps)));
        }
        if !(c.rope_theta > 1.0 && c.rope_theta.is_finite()) {
            return Err(Error::Config(format!("rope_theta {} is invalid", c.rope_theta)));
        }
        if let Some(y) = &c.rope_scaling {
            if !(y.factor >= 1.0 && y.factor.is_finite()) || y.original_max_position_embeddings == 0 {
                return Err(Error::Config(format!(
                    "yarn factor {} / original_max_position_embeddings {} are invalid",
                    y.factor, y.original_max_position_embeddings
                )));
            }
        }
        match (c.arch, &c.qwen3_next) {
            (Arch::Qwen3Moe, None) => Ok(()),
            (Arch::Qwen3Next, Some(n)) => n.validate(),
            (Arch::Qwen3Moe, Some(_)) => Err(Error::Config("a qwen3_moe config has qwen3_next fields".into())),
            (Arch::Qwen3Next, None) => Err(Error::Config(
                "a qwen3_next config needs its linear attention, shared expert and MTP fields".into(),
            )),
        }
    }

    /// MTP layers after the main stack (0 for qwen3_moe).
    pub fn mtp_layers(&self) -> usize {
        self.qwen3_next.as_ref().map_or(0, |n| n.mtp_num_hidden_layers)
    }

    /// Layers that have routed experts: the `num_hidden_layers` main layers,
    /// then the MTP layers (MTP layer `j` is layer `num_hidden_layers + j`).
    pub fn num_expert_layers(&self) -> usize {
        self.num_hidden_layers + self.mtp_layers()
    }

    /// Whether `layer` (in `0..num_expert_layers()`) is a full-attention
    /// layer: every layer of qwen3_moe; for qwen3_next main layer `i` when
    /// `(i + 1) % full_attention_interval == 0`, and every MTP layer.
    pub fn is_full_attention(&self, layer: usize) -> bool {
        match &self.qwen3_next {
            None => true,
            Some(_) if layer >= self.num_hidden_layers => true,
            Some(n) => (layer + 1) % n.full_attention_interval == 0,
        }
    }

    /// The Gated DeltaNet shapes (qwen3_next only).
    pub fn linear_attn(&self) -> Option<LinearAttnShape> {
        self.qwen3_next.as_ref().map(|n| LinearAttnShape {
            num_key_heads: n.linear_num_key_heads,
            num_value_heads: n.linear_num_value_heads,
            key_head_dim: n.linear_key_head_dim,
            value_head_dim: n.linear_value_head_dim,
            conv_kernel: n.linear_conv_kernel_dim,
        })
    }

    /// The shared expert's intermediate size (qwen3_next only).
    pub fn shared_expert_intermediate_size(&self) -> Option<usize> {
        self.qwen3_next.as_ref().map(|n| n.shared_expert_intermediate_size)
    }

    /// Whether full attention is gated (qwen3_next): `q_proj` emits
    /// `[q (head_dim) | gate (head_dim)]` per head and the output is
    /// `o_proj(attn * sigmoid(gate))`.
    pub fn has_attention_gate(&self) -> bool {
        self.arch == Arch::Qwen3Next
    }

    /// Rows of `q_proj`: `q_dim`, doubled when attention is gated.
    pub fn q_proj_dim(&self) -> usize {
        if self.has_attention_gate() {
            2 * self.q_dim()
        } else {
            self.q_dim()
        }
    }

    /// The same model cut to its first `layers` main layers (MTP layers
    /// kept), for smaller synthetic packs of a real per-layer geometry. A
    /// qwen3_next model must keep at least one full-attention layer.
    pub fn with_layers(&self, layers: usize) -> Result<ModelConfig> {
        if layers == 0 || layers > self.num_hidden_layers {
            return Err(Error::InvalidArgument(format!(
                "--layers {layers}: the model has {} layers (keep 1 to {0})",
                self.num_hidden_layers
            )));
        }
        let c = ModelConfig { num_hidden_layers: layers, ..self.clone() };
        if !(0..layers).any(|l| c.is_full_attention(l)) {
            let interval = self.qwen3_next.as_ref().map_or(1, |n| n.full_attention_interval);
            return Err(Error::InvalidArgument(format!(
                "--layers {layers} keeps no full-attention layer (every {interval}th layer is one; keep at least {interval})"
            )));
        }
        c.validate()?;
        Ok(c)
    }

    /// Number of leading head dims that RoPE rotates; truncated like
    /// transformers' `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> usize {
        ((self.head_dim as f64) * self.partial_rotary_factor) as usize
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parses a Hugging Face `config.json`. `path` is only used in messages.
    pub fn from_hf_json(text: &str, path: &Path) -> Result<ModelConfig> {
        let bad = |msg: String| Error::bad_checkpoint(path, msg);
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("config.json is not valid JSON: {e}")))?;
        // Multimodal wrappers keep the language model under text_config.
        let v = v.get("text_config").cloned().unwrap_or(v);
        let model_type =
            v.get("model_type").and_then(Value::as_str).ok_or_else(|| bad("config.json has no model_type".into()))?;
        let arch = match model_type {
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen3_next" => Arch::Qwen3Next,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: model_type {other:?} (supported: qwen3_moe, qwen3_next)",
                    path.display()
                )))
            }
        };
        let req_usize = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("config.json: {k} is missing or not a non-negative integer")))
        };
        let opt_usize = |k: &str| -> Result<Option<usize>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| bad(format!("config.json: {k} is not a non-negative integer"))),
            }
        };
        let opt_f64 = |obj: &Value, k: &str| -> Result<Option<f64>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_f64().map(Some).ok_or_else(|| bad(format!("config.json: {k} is not a number"))),
            }
        };
        let opt_bool = |k: &str| -> Result<Option<bool>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_bool().map(Some).ok_or_else(|| bad(format!("config.json: {k} is not a boolean"))),
            }
        };

        // Options the engine does not implement: reject rather than run a different model.
        match v.get("hidden_act") {
            None | Some(Value::Null) => {}
            Some(act) if act == "silu" => {}
            Some(act) => return Err(Error::Unsupported(format!("{}: hidden_act {act} (only silu)", path.display()))),
        }
        if opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(Error::Unsupported(format!("{}: attention_bias = true", path.display())));
        }
        if opt_usize("decoder_sparse_step")?.unwrap_or(1) != 1 {
            return Err(Error::Unsupported(format!(
                "{}: decoder_sparse_step != 1 (dense MLP layers between MoE layers)",
                path.display()
            )));
        }
        if let Some(m) = v.get("mlp_only_layers").and_then(Value::as_array) {
            if !m.is_empty() {
                return Err(Error::Unsupported(format!(
                    "{}: mlp_only_layers is not empty (dense MLP layers)",
                    path.display()
                )));
            }
        }
        if opt_bool("use_sliding_window")?.unwrap_or(false) {
            return Err(Error::Unsupported(format!("{}: use_sliding_window = true", path.display())));
        }

        // transformers 5.x: rope_parameters {rope_type, rope_theta, factor, ...};
        // 4.x: rope_theta at top level and rope_scaling {type|rope_type, ...}.
        let rope = v
            .get("rope_parameters")
            .filter(|r| r.is_object())
            .or_else(|| v.get("rope_scaling").filter(|r| r.is_object()));
        let rope_theta = match rope.map(|r| opt_f64(r, "rope_theta")).transpose()?.flatten() {
            Some(t) => t,
            None => opt_f64(&v, "rope_theta")?.unwrap_or(10000.0),
        };
        let max_position_embeddings = req_usize("max_position_embeddings")?;
        let mut rope_scaling = None;
        if let Some(r) = rope {
            let kind = match r.get("rope_type").or_else(|| r.get("type")) {
                None | Some(Value::Null) => "default",
                Some(k) => k.as_str().ok_or_else(|| bad(format!("config.json: rope type {k} is not a string")))?,
            };
            match kind {
                "default" => {}
                "yarn" => {
                    let factor = opt_f64(r, "factor")?
                        .ok_or_else(|| bad("config.json: yarn rope scaling has no factor".into()))?;
                    let l0 = match r.get("original_max_position_embeddings").and_then(Value::as_u64) {
                        Some(x) => x as usize,
                        None => max_position_embeddings,
                    };
                    rope_scaling = Some(RopeScaling {
                        factor,
                        original_max_position_embeddings: l0,
                        attention_factor: opt_f64(r, "attention_factor")?,
                        beta_fast: opt_f64(r, "beta_fast")?.unwrap_or(32.0),
                        beta_slow: opt_f64(r, "beta_slow")?.unwrap_or(1.0),
                    });
                }
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: rope type {other:?} (supported: default, yarn)",
                        path.display()
                    )))
                }
            }
        }

        // Both spellings occur (5.x repeats it inside rope_parameters); they must agree.
        let partial_rotary_factor = {
            let top = opt_f64(&v, "partial_rotary_factor")?;
            let inner = rope.map(|r| opt_f64(r, "partial_rotary_factor")).transpose()?.flatten();
            if let (Some(a), Some(b)) = (top, inner) {
                if a != b {
                    return Err(bad(format!(
                        "config.json: partial_rotary_factor {a} disagrees with rope_parameters' {b}"
                    )));
                }
            }
            // transformers' class defaults: qwen3_next rotates a quarter of each head.
            top.or(inner).unwrap_or(if arch == Arch::Qwen3Next { 0.25 } else { 1.0 })
        };

        let num_hidden_layers = req_usize("num_hidden_layers")?;
        let qwen3_next = match arch {
            Arch::Qwen3Moe => None,
            Arch::Qwen3Next => Some(Qwen3NextConfig {
                full_attention_interval: full_attention_interval(
                    opt_usize("full_attention_interval")?,
                    v.get("layer_types"),
                    num_hidden_layers,
                    path,
                )?,
                linear_num_key_heads: req_usize("linear_num_key_heads")?,
                linear_num_value_heads: req_usize("linear_num_value_heads")?,
                linear_key_head_dim: req_usize("linear_key_head_dim")?,
                linear_value_head_dim: req_usize("linear_value_head_dim")?,
                linear_conv_kernel_dim: opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
                shared_expert_intermediate_size: req_usize("shared_expert_intermediate_size")?,
                mtp_num_hidden_layers: opt_usize("mtp_num_hidden_layers")?.unwrap_or(0),
            }),
        };

        let hidden_size = req_usize("hidden_size")?;
        let num_attention_heads = req_usize("num_attention_heads")?;
        let head_dim = match opt_usize("head_dim")? {
            Some(h) => h,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: req_usize("vocab_size")?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim,
            // transformers 5.x writes num_local_experts (attribute_map alias).
            num_experts: match opt_usize("num_experts")? {
                Some(n) => n,
                None => req_usize("num_local_experts")?,
            },
            num_experts_per_tok: req_usize("num_experts_per_tok")?,
            moe_intermediate_size: req_usize("moe_intermediate_size")?,
            // transformers' class default: false for qwen3_moe (checkpoints
            // usually set it), true for qwen3_next.
            norm_topk_prob: opt_bool("norm_topk_prob")?.unwrap_or(arch == Arch::Qwen3Next),
            rms_norm_eps: opt_f64(&v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            partial_rotary_factor,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(false),
            qwen3_next,
        };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }
}

/// qwen3_next's layer pattern from `full_attention_interval` (what real
/// checkpoints write) and/or `layer_types` (what transformers 5.x writes);
/// when both are present they must agree. Neither means transformers'
/// default, 4.
fn full_attention_interval(
    interval: Option<usize>,
    layer_types: Option<&Value>,
    layers: usize,
    path: &Path,
) -> Result<usize> {
    let bad = |msg: String| Error::bad_checkpoint(path, format!("config.json: {msg}"));
    let types = match layer_types {
        None | Some(Value::Null) => return Ok(interval.unwrap_or(4)),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("layer_types is not a list".into())),
    };
    if types.len() != layers {
        return Err(bad(format!("layer_types has {} entries for {layers} layers", types.len())));
    }
    let mut full = Vec::with_capacity(layers);
    for (i, t) in types.iter().enumerate() {
        match t.as_str() {
            Some("full_attention") => full.push(true),
            Some("linear_attention") => full.push(false),
            _ => {
                return Err(Error::Unsupported(format!(
                    "{}: layer_types[{i}] is {t} (supported: full_attention, linear_attention)",
                    path.display()
                )))
            }
        }
    }
    let interval = match interval {
        Some(n) => n,
        None => match full.iter().position(|&f| f) {
            Some(first) => first + 1,
            None => {
                return Err(Error::Unsupported(format!("{}: layer_types has no full_attention layer", path.display())))
            }
        },
    };
    if interval == 0 {
        return Err(bad("full_attention_interval must be positive".into()));
    }
    for (i, &f) in full.iter().enumerate() {
        if f != ((i + 1) % interval == 0) {
            return Err(bad(format!(
                "layer_types[{i}] is {} but full_attention_interval {interval} makes layer {i} {}",
                types[i],
                if f { "linear_attention" } else { "full_attention" }
            )));
        }
    }
    Ok(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "norm_topk_prob": true, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}
        })
    }

    fn parse(v: &serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(&v.to_string(), Path::new("cfg/config.json"))
    }

    #[test]
    fn parses_transformers5_config() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.q_dim(), 64);
        assert_eq!(c.kv_dim(), 32);
        assert!(c.rope_scaling.is_none());
    }

    #[test]
    fn accepts_num_local_experts_alias() {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("num_experts");
        o.insert("num_local_experts".into(), 12.into());
        assert_eq!(parse(&v).unwrap().num_experts, 12);
        v.as_object_mut().unwrap().remove("num_local_experts");
        assert!(parse(&v).unwrap_err().to_string().contains("num_local_experts"));
    }

    #[test]
    fn parses_transformers4_yarn() {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), 5000.0.into());
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
        );
        let c = parse(&v).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
        let y = c.rope_scaling.unwrap();
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 1024));
        assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
    }

    #[test]
    fn rejects_unsupported_and_invalid_fields() {
        let mut v = base();
        v["model_type"] = "llama".into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("llama"), "{e}");

        let mut v = base();
        v["mlp_only_layers"] = serde_json::json!([0]);
        assert!(matches!(parse(&v), Err(Error::Unsupported(_))));

        let mut v = base();
        v["num_key_value_heads"] = 3.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads 3"), "{e}");

        let mut v = base();
        v["hidden_size"] = 40.into();
        assert!(parse(&v).unwrap_err().to_string().contains("hidden_size 40"));

        let mut v = base();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(parse(&v).unwrap_err().to_string().contains("vocab_size"));

        // An activation or rope type that is not a string is refused, not
        // read as the default.
        for act in [serde_json::json!("gelu"), serde_json::json!(0), serde_json::json!(true)] {
            let mut v = base();
            v["hidden_act"] = act.clone();
            let e = parse(&v).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains(&format!("hidden_act {act}")), "{e}");
        }
        let mut v = base();
        v["hidden_act"] = serde_json::Value::Null;
        assert!(parse(&v).is_ok());
        let mut v = base();
        v["rope_parameters"]["rope_type"] = 1.into();
        assert!(parse(&v).unwrap_err().to_string().contains("rope type 1 is not a string"));
    }

    fn next_base() -> serde_json::Value {
        // The shape of Qwen3-Next-80B-A3B's config.json (transformers 4.57 era:
        // top-level rope_theta, full_attention_interval, no layer_types).
        serde_json::json!({
            "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "norm_topk_prob": true, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "tie_word_embeddings": false, "rope_theta": 10000000, "rope_scaling": null,
            "partial_rotary_factor": 0.25, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "mtp_num_hidden_layers": 1, "hidden_act": "silu"
        })
    }

    #[test]
    fn parses_qwen3_next_fixture_configs() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures_next");
        let read = |m: &str| {
            let p = dir.join(m).join("bf16/config.json");
            ModelConfig::from_hf_json(&std::fs::read_to_string(&p).unwrap(), &p).unwrap()
        };
        let a = read("a");
        assert_eq!(a.arch, Arch::Qwen3Next);
        assert_eq!((a.rope_theta, a.partial_rotary_factor, a.rotary_dim()), (1e4, 0.25, 8));
        assert_eq!(a.q_proj_dim(), 256);
        let full: Vec<bool> = (0..a.num_expert_layers()).map(|l| a.is_full_attention(l)).collect();
        assert_eq!(full, [false, false, false, true, true]);
        let la = a.linear_attn().unwrap();
        assert_eq!((la.conv_dim(), la.qkvz_dim(), la.ba_dim(), la.value_heads_per_key_head()), (128, 192, 8, 2));
        assert_eq!(a.shared_expert_intermediate_size(), Some(48));
        assert_eq!((a.mtp_layers(), a.num_expert_layers()), (1, 5));

        let b = read("b");
        assert_eq!(b.rope_theta, 1e7);
        assert!(b.tie_word_embeddings);
        let full: Vec<bool> = (0..6).map(|l| b.is_full_attention(l)).collect();
        assert_eq!(full, [false, true, false, true, false, true]);
        let la = b.linear_attn().unwrap();
        assert_eq!((la.key_dim(), la.value_dim(), la.conv_dim(), la.qkvz_dim()), (64, 48, 176, 224));
    }

    #[test]
    fn parses_real_qwen3_next_config_and_manifest_round_trip() {
        let c = parse(&next_base()).unwrap();
        assert_eq!((c.rope_theta, c.num_expert_layers()), (1e7, 49));
        assert!(c.is_full_attention(3) && !c.is_full_attention(4) && c.is_full_attention(47));
        let n = c.qwen3_next.as_ref().unwrap();
        assert_eq!((n.linear_num_value_heads, n.full_attention_interval), (32, 4));
        let back: ModelConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c);

        // Defaults: no MTP, transformers' partial_rotary_factor and norm_topk_prob.
        let mut v = next_base();
        let o = v.as_object_mut().unwrap();
        for k in ["mtp_num_hidden_layers", "partial_rotary_factor", "norm_topk_prob"] {
            o.remove(k);
        }
        let c = parse(&v).unwrap();
        assert_eq!((c.mtp_layers(), c.partial_rotary_factor, c.norm_topk_prob), (0, 0.25, true));

        // A qwen3_moe manifest config has no qwen3_next key and parses without one.
        let m = parse(&base()).unwrap();
        let j = serde_json::to_value(&m).unwrap();
        assert!(j.get("qwen3_next").is_none());
        assert!(!m.has_attention_gate() && m.is_full_attention(1) && m.num_expert_layers() == 2);
        assert_eq!(serde_json::from_value::<ModelConfig>(j).unwrap(), m);
    }

    #[test]
    fn qwen3_next_layer_types_must_agree() {
        let types = |full: &[usize], n: usize| -> serde_json::Value {
            (0..n).map(|i| if full.contains(&i) { "full_attention" } else { "linear_attention" }).collect()
        };
        // layer_types alone gives the interval.
        let mut v = next_base();
        v["num_hidden_layers"] = 6.into();
        v.as_object_mut().unwrap().remove("full_attention_interval");
        v["layer_types"] = types(&[2, 5], 6);
        let c = parse(&v).unwrap();
        assert_eq!(c.qwen3_next.unwrap().full_attention_interval, 3);

        v["full_attention_interval"] = 2.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("layer_types[1]") && e.contains("full_attention_interval 2"), "{e}");

        v.as_object_mut().unwrap().remove("full_attention_interval");
        v["layer_types"] = types(&[2, 4], 6);
        assert!(parse(&v).unwrap_err().to_string().contains("layer_types[4]"));
        v["layer_types"] = types(&[2], 5);
        assert!(parse(&v).unwrap_err().to_string().contains("5 entries for 6 layers"));
        v["layer_types"] = types(&[], 6);
        assert!(matches!(parse(&v), Err(Error::Unsupported(_))));
        let mut t = types(&[2, 5], 6);
        t[0] = "sliding_attention".into();
        v["layer_types"] = t;
        assert!(matches!(parse(&v), Err(Error::Unsupported(_))));
    }

    #[test]
    fn rejects_invalid_qwen3_next_fields() {
        let mut v = next_base();
        v["linear_num_value_heads"] = 24.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("linear_num_value_heads 24") && e.contains("linear_num_key_heads 16"), "{e}");

        let mut v = next_base();
        v["shared_expert_intermediate_size"] = 520.into();
        assert!(parse(&v).unwrap_err().to_string().contains("shared_expert_intermediate_size 520"));

        let mut v = next_base();
        v.as_object_mut().unwrap().remove("linear_key_head_dim");
        assert!(parse(&v).unwrap_err().to_string().contains("linear_key_head_dim"));

        let mut v = next_base();
        v["rope_parameters"] =
            serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5});
        assert!(parse(&v).unwrap_err().to_string().contains("partial_rotary_factor 0.25"));

        let mut v = next_base();
        v["decoder_sparse_step"] = 2.into();
        assert!(matches!(parse(&v), Err(Error::Unsupported(_))));

        // The two architectures' fields do not mix.
        let mut moe = parse(&base()).unwrap();
        moe.qwen3_next = parse(&next_base()).unwrap().qwen3_next;
        assert!(moe.validate().is_err());
        let mut next = parse(&next_base()).unwrap();
        next.qwen3_next = None;
        assert!(next.validate().is_err());
    }

    #[test]
    fn with_layers_keeps_a_full_attention_layer() {
        let c = parse(&next_base()).unwrap();
        let four = c.with_layers(4).unwrap();
        assert_eq!((four.num_hidden_layers, four.num_expert_layers()), (4, 5));
        assert!(four.is_full_attention(3) && four.is_full_attention(4));
        let e = c.with_layers(3).unwrap_err().to_string();
        assert!(e.contains("no full-attention layer") && e.contains("at least 4"), "{e}");
        assert!(c.with_layers(0).is_err() && c.with_layers(49).is_err());
        assert_eq!(parse(&base()).unwrap().with_layers(1).unwrap().num_hidden_layers, 1);
    }
}
