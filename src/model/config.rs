//! The normalized model config stored in a pack's manifest, and its parser
//! for Hugging Face `config.json` files (transformers 4.x and 5.x spellings).

use serde::{Deserialize, Serialize};
use serde_json::Value;
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
}

impl ModelConfig {
    /// Checks internal consistency; every later index computation relies on it.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        let nonzero = [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
            ("num_experts", c.num_experts),
            ("num_experts_per_tok", c.num_experts_per_tok),
            ("moe_intermediate_size", c.moe_intermediate_size),
            ("max_position_embeddings", c.max_position_embeddings),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return Err(Error::Config(format!("{name} must be positive")));
            }
        }
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
        Ok(())
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

        if arch == Arch::Qwen3Next {
            return Err(Error::Unsupported(format!(
                "{}: qwen3_next is not supported by this build yet",
                path.display()
            )));
        }

        // Options the engine does not implement: reject rather than run a different model.
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(Error::Unsupported(format!("{}: hidden_act {act:?} (only silu)", path.display())));
            }
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
            let kind = r.get("rope_type").or_else(|| r.get("type")).and_then(Value::as_str).unwrap_or("default");
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
            num_hidden_layers: req_usize("num_hidden_layers")?,
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
            // transformers' class default is false; checkpoints usually set it.
            norm_topk_prob: opt_bool("norm_topk_prob")?.unwrap_or(false),
            rms_norm_eps: opt_f64(&v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            partial_rotary_factor: opt_f64(&v, "partial_rotary_factor")?.unwrap_or(1.0),
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(false),
        };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }
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
    }
}
