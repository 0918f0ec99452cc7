//! The dense tensors each architecture needs, by Hugging Face name and shape.
//! The converter, the pack writer and reader, synth and the backends all read
//! this one list (docs/pack-format.md spells it out per architecture).

use super::config::{Arch, ModelConfig};

/// A dense tensor's role. Layer roles belong to a decoder layer (a main
/// layer `model.layers.{i}.` or an MTP layer `mtp.layers.{j}.`); the others
/// are model-level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Embedding,
    FinalNorm,
    LmHead,
    InputNorm,
    PostAttnNorm,
    /// `[Dq, H]`; qwen3_next `[2 * Dq, H]`: per head `[q | gate]`.
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    /// `mlp.gate`: the router.
    Router,
    /// qwen3_next Gated DeltaNet `linear_attn.in_proj_qkvz`.
    LinearInProjQkvz,
    /// `linear_attn.in_proj_ba`.
    LinearInProjBa,
    /// `linear_attn.conv1d` `[C, 1, K]` (depthwise, no bias).
    LinearConv1d,
    /// `linear_attn.dt_bias` `[Hv]` (no `.weight` suffix).
    LinearDtBias,
    /// `linear_attn.A_log` `[Hv]` (no `.weight` suffix).
    LinearALog,
    /// `linear_attn.norm` `[dv]`: the gated RMSNorm's plain weight (`w`, not `1 + w`).
    LinearNorm,
    /// `linear_attn.out_proj`.
    LinearOutProj,
    /// `mlp.shared_expert_gate` `[1, H]`: the shared expert's sigmoid gate.
    SharedExpertGate,
    /// `mlp.shared_expert.gate_proj` `[Is, H]`.
    SharedGateProj,
    /// `mlp.shared_expert.up_proj` `[Is, H]`.
    SharedUpProj,
    /// `mlp.shared_expert.down_proj` `[H, Is]`.
    SharedDownProj,
    /// `mtp.fc` `[H, 2H]`.
    MtpFc,
    MtpPreFcNormEmbedding,
    MtpPreFcNormHidden,
    /// `mtp.norm`, applied after the MTP layers.
    MtpNorm,
}

impl Role {
    /// Large matrices that may be stored as NVFP4 on request (`pack --dense nvfp4`).
    /// Embeddings are gathered by row, norms and the routers stay high precision.
    pub fn may_quantize(self) -> bool {
        use Role::*;
        matches!(
            self,
            QProj
                | KProj
                | VProj
                | OProj
                | LmHead
                | LinearInProjQkvz
                | LinearOutProj
                | SharedGateProj
                | SharedUpProj
                | SharedDownProj
                | MtpFc
        )
    }

    /// The shared expert's projections: NVFP4 in every qwen3_next pack the
    /// converter writes (quantized by us when the checkpoint has them in BF16).
    pub fn is_shared_expert(self) -> bool {
        matches!(self, Role::SharedGateProj | Role::SharedUpProj | Role::SharedDownProj)
    }

    /// A 2-D linear weight `[out, in]` applied as `x @ W^T`. Only these may be
    /// NVFP4 in a pack (carried from an NVFP4 checkpoint, or `may_quantize`).
    pub fn is_linear(self) -> bool {
        use Role::*;
        self.may_quantize() || matches!(self, Router | LinearInProjBa | SharedExpertGate)
    }

    /// Small f32 parameters that a pack keeps in F32 when the checkpoint
    /// stores them wider than BF16 (real qwen3_next checkpoints do).
    pub fn keeps_f32(self) -> bool {
        matches!(self, Role::LinearDtBias | Role::LinearALog)
    }

    /// The neutral value of a norm weight (what makes it the identity scale):
    /// 0 for zero-centered norms (`1 + w`), 1 for plain ones; `None` for
    /// other roles.
    pub fn norm_neutral(self, arch: Arch) -> Option<f32> {
        use Role::*;
        match self {
            LinearNorm => Some(1.0),
            InputNorm
            | PostAttnNorm
            | QNorm
            | KNorm
            | FinalNorm
            | MtpPreFcNormEmbedding
            | MtpPreFcNormHidden
            | MtpNorm => Some(if arch.zero_centered_norms() { 0.0 } else { 1.0 }),
            _ => None,
        }
    }
}

/// The name of a layer role relative to its layer's prefix.
fn layer_suffix(role: Role) -> &'static str {
    match role {
        Role::InputNorm => "input_layernorm.weight",
        Role::PostAttnNorm => "post_attention_layernorm.weight",
        Role::QProj => "self_attn.q_proj.weight",
        Role::KProj => "self_attn.k_proj.weight",
        Role::VProj => "self_attn.v_proj.weight",
        Role::OProj => "self_attn.o_proj.weight",
        Role::QNorm => "self_attn.q_norm.weight",
        Role::KNorm => "self_attn.k_norm.weight",
        Role::Router => "mlp.gate.weight",
        Role::LinearInProjQkvz => "linear_attn.in_proj_qkvz.weight",
        Role::LinearInProjBa => "linear_attn.in_proj_ba.weight",
        Role::LinearConv1d => "linear_attn.conv1d.weight",
        Role::LinearDtBias => "linear_attn.dt_bias",
        Role::LinearALog => "linear_attn.A_log",
        Role::LinearNorm => "linear_attn.norm.weight",
        Role::LinearOutProj => "linear_attn.out_proj.weight",
        Role::SharedExpertGate => "mlp.shared_expert_gate.weight",
        Role::SharedGateProj => "mlp.shared_expert.gate_proj.weight",
        Role::SharedUpProj => "mlp.shared_expert.up_proj.weight",
        Role::SharedDownProj => "mlp.shared_expert.down_proj.weight",
        Role::Embedding
        | Role::FinalNorm
        | Role::LmHead
        | Role::MtpFc
        | Role::MtpPreFcNormEmbedding
        | Role::MtpPreFcNormHidden
        | Role::MtpNorm => unreachable!("{role:?} is not a layer tensor"),
    }
}

/// A main layer's tensor: `model.layers.{layer}.<suffix>`.
pub fn layer_tensor_name(layer: usize, role: Role) -> String {
    format!("model.layers.{layer}.{}", layer_suffix(role))
}

/// The name prefix of `layer` in `0..c.num_expert_layers()`: `model.layers.{i}.`
/// for a main layer, `mtp.layers.{j}.` for `layer = num_hidden_layers + j`.
pub fn layer_prefix(c: &ModelConfig, layer: usize) -> String {
    match layer.checked_sub(c.num_hidden_layers) {
        None => format!("model.layers.{layer}."),
        Some(j) => format!("mtp.layers.{j}."),
    }
}

/// The tensor of `layer` in `0..c.num_expert_layers()`: MTP layers use the
/// main layers' names under their own prefix ([`layer_prefix`]).
pub fn tensor_name_for_layer(c: &ModelConfig, layer: usize, role: Role) -> String {
    format!("{}{}", layer_prefix(c, layer), layer_suffix(role))
}

/// The layer (in the numbering of [`tensor_name_for_layer`]) a tensor name
/// belongs to; `None` for model-level tensors.
pub fn layer_of_tensor(c: &ModelConfig, name: &str) -> Option<usize> {
    let index = |rest: &str| rest.split('.').next()?.parse::<usize>().ok();
    if let Some(rest) = name.strip_prefix("model.layers.") {
        index(rest)
    } else {
        name.strip_prefix("mtp.layers.").and_then(index).map(|j| c.num_hidden_layers + j)
    }
}

pub fn model_tensor_name(role: Role) -> &'static str {
    match role {
        Role::Embedding => "model.embed_tokens.weight",
        Role::FinalNorm => "model.norm.weight",
        Role::LmHead => "lm_head.weight",
        Role::MtpFc => "mtp.fc.weight",
        Role::MtpPreFcNormEmbedding => "mtp.pre_fc_norm_embedding.weight",
        Role::MtpPreFcNormHidden => "mtp.pre_fc_norm_hidden.weight",
        Role::MtpNorm => "mtp.norm.weight",
        _ => unreachable!("{role:?} is a layer tensor"),
    }
}

/// The dense tensors of one layer, in pack order.
fn layer_tensors(c: &ModelConfig, layer: usize) -> Vec<(Role, Vec<usize>)> {
    let h = c.hidden_size;
    let mut out = vec![(Role::InputNorm, vec![h])];
    match c.linear_attn() {
        Some(la) if !c.is_full_attention(layer) => out.extend([
            (Role::LinearInProjQkvz, vec![la.qkvz_dim(), h]),
            (Role::LinearInProjBa, vec![la.ba_dim(), h]),
            (Role::LinearConv1d, vec![la.conv_dim(), 1, la.conv_kernel]),
            (Role::LinearDtBias, vec![la.num_value_heads]),
            (Role::LinearALog, vec![la.num_value_heads]),
            (Role::LinearNorm, vec![la.value_head_dim]),
            (Role::LinearOutProj, vec![h, la.value_dim()]),
        ]),
        _ => out.extend([
            (Role::QProj, vec![c.q_proj_dim(), h]),
            (Role::KProj, vec![c.kv_dim(), h]),
            (Role::VProj, vec![c.kv_dim(), h]),
            (Role::OProj, vec![h, c.q_dim()]),
            (Role::QNorm, vec![c.head_dim]),
            (Role::KNorm, vec![c.head_dim]),
        ]),
    }
    out.push((Role::PostAttnNorm, vec![h]));
    out.push((Role::Router, vec![c.num_experts, h]));
    if let Some(is) = c.shared_expert_intermediate_size() {
        out.extend([
            (Role::SharedExpertGate, vec![1, h]),
            (Role::SharedGateProj, vec![is, h]),
            (Role::SharedUpProj, vec![is, h]),
            (Role::SharedDownProj, vec![h, is]),
        ]);
    }
    out
}

/// Every dense tensor of the model, in pack order: (name, shape, role).
///
/// qwen3_moe: the embedding, each layer's tensors, the final norm and (unless
/// tied) lm_head. qwen3_next adds, per layer, Gated DeltaNet tensors in
/// place of attention on linear-attention layers and the shared expert, and
/// after lm_head the MTP head: its two input norms, `mtp.fc`, each MTP layer
/// (full attention + MoE) and `mtp.norm`.
pub fn required_dense_tensors(c: &ModelConfig) -> Vec<(String, Vec<usize>, Role)> {
    let (h, v) = (c.hidden_size, c.vocab_size);
    let model = |role: Role, shape: Vec<usize>| (model_tensor_name(role).to_string(), shape, role);
    let mut out = vec![model(Role::Embedding, vec![v, h])];
    let push_layer = |out: &mut Vec<_>, l: usize| {
        for (role, shape) in layer_tensors(c, l) {
            out.push((tensor_name_for_layer(c, l, role), shape, role));
        }
    };
    for l in 0..c.num_hidden_layers {
        push_layer(&mut out, l);
    }
    out.push(model(Role::FinalNorm, vec![h]));
    if !c.tie_word_embeddings {
        out.push(model(Role::LmHead, vec![v, h]));
    }
    if c.mtp_layers() > 0 {
        out.push(model(Role::MtpPreFcNormEmbedding, vec![h]));
        out.push(model(Role::MtpPreFcNormHidden, vec![h]));
        out.push(model(Role::MtpFc, vec![h, 2 * h]));
        for l in c.num_hidden_layers..c.num_expert_layers() {
            push_layer(&mut out, l);
        }
        out.push(model(Role::MtpNorm, vec![h]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Qwen3NextConfig;
    use std::path::Path;

    fn fixture_config(model: &str) -> ModelConfig {
        let p =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures_next").join(model).join("bf16/config.json");
        ModelConfig::from_hf_json(&std::fs::read_to_string(&p).unwrap(), &p).unwrap()
    }

    #[test]
    fn qwen3_moe_list_is_unchanged() {
        let c = crate::pack::synth::preset(Arch::Qwen3Moe, "tiny").unwrap();
        let t = required_dense_tensors(&c);
        let names: Vec<&str> = t.iter().map(|x| x.0.as_str()).collect();
        let layer = |i: usize| {
            [
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "post_attention_layernorm.weight",
                "mlp.gate.weight",
            ]
            .map(|s| format!("model.layers.{i}.{s}"))
        };
        let mut want = vec!["model.embed_tokens.weight".to_string()];
        want.extend(layer(0));
        want.extend(layer(1));
        want.extend(["model.norm.weight".to_string(), "lm_head.weight".to_string()]);
        assert_eq!(names, want);
        assert_eq!(t[2].1, vec![c.q_dim(), c.hidden_size]);
        assert_eq!(layer_of_tensor(&c, "model.layers.1.mlp.gate.weight"), Some(1));
        assert_eq!(layer_of_tensor(&c, "model.norm.weight"), None);
    }

    /// The list matches the checkpoint names and shapes of
    /// tests/fixtures/README.md for fixture `b` (tied, interval 2, dk != dv).
    #[test]
    fn qwen3_next_list_matches_the_fixture_names() {
        let c = fixture_config("b");
        let n: &Qwen3NextConfig = c.qwen3_next.as_ref().unwrap();
        assert_eq!((n.full_attention_interval, n.mtp_num_hidden_layers), (2, 1));
        let t = required_dense_tensors(&c);
        let shape = |name: &str| t.iter().find(|x| x.0 == name).map(|x| x.1.clone());
        assert_eq!(shape("model.layers.0.linear_attn.in_proj_qkvz.weight"), Some(vec![224, 96]));
        assert_eq!(shape("model.layers.0.linear_attn.in_proj_ba.weight"), Some(vec![4, 96]));
        assert_eq!(shape("model.layers.4.linear_attn.conv1d.weight"), Some(vec![176, 1, 4]));
        assert_eq!(shape("model.layers.2.linear_attn.dt_bias"), Some(vec![2]));
        assert_eq!(shape("model.layers.2.linear_attn.A_log"), Some(vec![2]));
        assert_eq!(shape("model.layers.2.linear_attn.norm.weight"), Some(vec![24]));
        assert_eq!(shape("model.layers.2.linear_attn.out_proj.weight"), Some(vec![96, 48]));
        assert_eq!(shape("model.layers.1.self_attn.q_proj.weight"), Some(vec![192, 96]));
        assert_eq!(shape("model.layers.1.self_attn.o_proj.weight"), Some(vec![96, 96]));
        assert_eq!(shape("model.layers.5.self_attn.k_norm.weight"), Some(vec![16]));
        assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), None);
        assert_eq!(shape("model.layers.1.linear_attn.A_log"), None);
        assert_eq!(shape("model.layers.3.mlp.shared_expert_gate.weight"), Some(vec![1, 96]));
        assert_eq!(shape("model.layers.3.mlp.shared_expert.down_proj.weight"), Some(vec![96, 32]));
        assert_eq!(shape("mtp.fc.weight"), Some(vec![96, 192]));
        assert_eq!(shape("mtp.layers.0.self_attn.q_proj.weight"), Some(vec![192, 96]));
        assert_eq!(shape("mtp.layers.0.mlp.shared_expert.gate_proj.weight"), Some(vec![32, 96]));
        assert_eq!(shape("lm_head.weight"), None);
        assert_eq!(t.last().unwrap().0, "mtp.norm.weight");
        // 3 DeltaNet layers x 14, 3 attention layers x 13, embedding and norm, MTP 4 + 13:
        // the checkpoint's 436 tensors less 7 MoE layers x 16 experts x 3 matrices.
        assert_eq!(t.len(), 3 * 14 + 3 * 13 + 2 + 17);
        assert_eq!(t.len(), 436 - 7 * 16 * 3);
        assert_eq!(layer_of_tensor(&c, "mtp.layers.0.mlp.gate.weight"), Some(6));
        assert_eq!(tensor_name_for_layer(&c, 6, Role::Router), "mtp.layers.0.mlp.gate.weight");
        assert_eq!(tensor_name_for_layer(&c, 5, Role::Router), "model.layers.5.mlp.gate.weight");
        assert_eq!(layer_of_tensor(&c, "mtp.fc.weight"), None);
    }

    #[test]
    fn fixture_a_counts_and_norm_neutrals() {
        let c = fixture_config("a");
        let t = required_dense_tensors(&c);
        // 3 DeltaNet layers x 14, 1 attention layer x 13, embedding, norm, lm_head, MTP 4 + 13:
        // the checkpoint's 195 tensors less 5 MoE layers x 8 experts x 3 matrices.
        assert_eq!(t.len(), 3 * 14 + 13 + 3 + 17);
        assert_eq!(t.len(), 195 - 5 * 8 * 3);
        assert_eq!(Role::InputNorm.norm_neutral(Arch::Qwen3Next), Some(0.0));
        assert_eq!(Role::MtpNorm.norm_neutral(Arch::Qwen3Next), Some(0.0));
        assert_eq!(Role::LinearNorm.norm_neutral(Arch::Qwen3Next), Some(1.0));
        assert_eq!(Role::QNorm.norm_neutral(Arch::Qwen3Moe), Some(1.0));
        assert_eq!(Role::LinearALog.norm_neutral(Arch::Qwen3Next), None);
        assert!(Role::Router.is_linear() && !Role::Router.may_quantize());
        assert!(!Role::LinearConv1d.is_linear() && !Role::Embedding.is_linear());
    }
}
