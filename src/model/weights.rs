//! The dense tensors each architecture needs, by Hugging Face name and shape.
//! The converter, the pack writer and the backends all read this one list.

use super::config::ModelConfig;

/// A dense tensor's role in a layer; `None` layer means model-level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Embedding,
    FinalNorm,
    LmHead,
    InputNorm,
    PostAttnNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    Router,
}

impl Role {
    /// Large matrices that may be stored as NVFP4 on request (`pack --dense nvfp4`).
    /// Embeddings are gathered by row, norms and the router stay high precision.
    pub fn may_quantize(self) -> bool {
        matches!(self, Role::QProj | Role::KProj | Role::VProj | Role::OProj | Role::LmHead)
    }
}

pub fn layer_tensor_name(layer: usize, role: Role) -> String {
    let suffix = match role {
        Role::InputNorm => "input_layernorm.weight",
        Role::PostAttnNorm => "post_attention_layernorm.weight",
        Role::QProj => "self_attn.q_proj.weight",
        Role::KProj => "self_attn.k_proj.weight",
        Role::VProj => "self_attn.v_proj.weight",
        Role::OProj => "self_attn.o_proj.weight",
        Role::QNorm => "self_attn.q_norm.weight",
        Role::KNorm => "self_attn.k_norm.weight",
        Role::Router => "mlp.gate.weight",
        Role::Embedding | Role::FinalNorm | Role::LmHead => unreachable!("not a layer tensor"),
    };
    format!("model.layers.{layer}.{suffix}")
}

pub fn model_tensor_name(role: Role) -> &'static str {
    match role {
        Role::Embedding => "model.embed_tokens.weight",
        Role::FinalNorm => "model.norm.weight",
        Role::LmHead => "lm_head.weight",
        _ => unreachable!("a layer tensor"),
    }
}

/// Every dense tensor of a qwen3_moe model: (name, shape, role).
pub fn required_dense_tensors(c: &ModelConfig) -> Vec<(String, Vec<usize>, Role)> {
    let (h, v) = (c.hidden_size, c.vocab_size);
    let mut out = vec![(model_tensor_name(Role::Embedding).to_string(), vec![v, h], Role::Embedding)];
    for l in 0..c.num_hidden_layers {
        let layer = [
            (Role::InputNorm, vec![h]),
            (Role::QProj, vec![c.q_dim(), h]),
            (Role::KProj, vec![c.kv_dim(), h]),
            (Role::VProj, vec![c.kv_dim(), h]),
            (Role::OProj, vec![h, c.q_dim()]),
            (Role::QNorm, vec![c.head_dim]),
            (Role::KNorm, vec![c.head_dim]),
            (Role::PostAttnNorm, vec![h]),
            (Role::Router, vec![c.num_experts, h]),
        ];
        for (role, shape) in layer {
            out.push((layer_tensor_name(l, role), shape, role));
        }
    }
    out.push((model_tensor_name(Role::FinalNorm).to_string(), vec![h], Role::FinalNorm));
    if !c.tie_word_embeddings {
        out.push((model_tensor_name(Role::LmHead).to_string(), vec![v, h], Role::LmHead));
    }
    out
}
