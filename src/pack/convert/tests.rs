//! Tiny checkpoints of one random model, written in each supported form,
//! converted and compared byte for byte.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;
use serde_json::{json, Value};

use super::plan::{FloatData, FloatDtype};
use super::*;
use crate::model::weights::{required_dense_tensors, Role};
use crate::pack::format::DType;
use crate::pack::{Pack, TensorData};
use crate::quant::nvfp4::quantize;
use crate::quant::{f32_to_bf16_bytes, Nvfp4Owned};

const H: usize = 32;
const I: usize = 16;
const E: usize = 4;
const L: usize = 2;

/// (name, dtype, shape, bytes) of one stored tensor.
type St = (String, Dtype, Vec<usize>, Vec<u8>);

fn config_json(tied: bool) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 40, "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I,
        "norm_topk_prob": true, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
        "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}
    })
}

struct Rng(u64);

impl Rng {
    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values of magnitude about `scale`, rounded to BF16.
    fn bf16_values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| half::bf16::from_f32(self.next() * scale).to_f32()).collect()
    }
}

/// One random model: dense tensors as BF16 bytes, experts as BF16-exact f32.
struct Model {
    json: Value,

    dense: Vec<(String, Vec<usize>, Role, Vec<u8>)>,
    /// `[layer][expert]` = (gate, up, down).
    experts: Vec<Vec<[Vec<f32>; 3]>>,
}

fn model(tied: bool) -> Model {
    let json = config_json(tied);
    let cfg = ModelConfig::from_hf_json(&json.to_string(), Path::new("config.json")).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let dense = required_dense_tensors(&cfg)
        .into_iter()
        .map(|(name, shape, role)| {
            let n = shape.iter().product();
            let mut v = rng.bf16_values(n, 0.1);
            if shape.len() == 1 {
                v.iter_mut().for_each(|x| *x = half::bf16::from_f32(1.0 + *x).to_f32());
            }
            (name, shape, role, f32_to_bf16_bytes(&v))
        })
        .collect();
    // Magnitudes far from 1 and different per matrix, so a dropped or
    // swapped global scale shows.
    let experts = (0..L)
        .map(|_| {
            (0..E)
                .map(|_| [rng.bf16_values(I * H, 0.02), rng.bf16_values(I * H, 0.05), rng.bf16_values(H * I, 0.01)])
                .collect()
        })
        .collect();
    Model { json, dense, experts }
}

const PROJS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

fn shape_of(p: usize) -> [usize; 2] {
    if p == 2 {
        [H, I]
    } else {
        [I, H]
    }
}

fn expert_prefix(l: usize, e: usize, p: usize) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{}", PROJS[p])
}

fn bf16(name: &str, shape: &[usize], bytes: Vec<u8>) -> St {
    (name.to_string(), Dtype::BF16, shape.to_vec(), bytes)
}

fn f32_scalar(name: &str, shape: &[usize], v: f32) -> St {
    (name.to_string(), Dtype::F32, shape.to_vec(), v.to_le_bytes().to_vec())
}

/// Tensors a real checkpoint carries that the model does not use.
fn extras() -> Vec<St> {
    vec![
        bf16("mtp.fc.weight", &[H, 2 * H], vec![0; H * 2 * H * 2]),
        ("model.layers.0.self_attn.rotary_emb.inv_freq".into(), Dtype::F32, vec![8], vec![0; 32]),
    ]
}

fn dense_bf16(m: &Model) -> Vec<St> {
    m.dense.iter().map(|(n, s, _, b)| bf16(n, s, b.clone())).collect()
}

/// (1) BF16 with per-expert keys.
fn per_expert_bf16(m: &Model) -> Vec<St> {
    let mut out = dense_bf16(m);
    for (l, layer) in m.experts.iter().enumerate() {
        for (e, mats) in layer.iter().enumerate() {
            for (p, w) in mats.iter().enumerate() {
                let name = format!("{}.weight", expert_prefix(l, e, p));
                out.push(bf16(&name, &shape_of(p), f32_to_bf16_bytes(w)));
            }
        }
    }
    out.extend(extras());
    out
}

/// (3) BF16 with transformers 5.x fused expert tensors.
fn fused_bf16(m: &Model) -> Vec<St> {
    let mut out = dense_bf16(m);
    for (l, layer) in m.experts.iter().enumerate() {
        let gate_up: Vec<f32> = layer.iter().flat_map(|[g, u, _]| g.iter().chain(u).copied()).collect();
        let down: Vec<f32> = layer.iter().flat_map(|[_, _, d]| d.clone()).collect();
        let base = format!("model.layers.{l}.mlp.experts");
        out.push(bf16(&format!("{base}.gate_up_proj"), &[E, 2 * I, H], f32_to_bf16_bytes(&gate_up)));
        out.push(bf16(&format!("{base}.down_proj"), &[E, H, I], f32_to_bf16_bytes(&down)));
    }
    out
}

/// NVFP4 tensors of `prefix` in ModelOpt's (`ct == false`) or
/// compressed-tensors' convention, quantized the way ModelOpt does.
fn nvfp4_tensors(prefix: &str, q: &Nvfp4Owned, ct: bool) -> Vec<St> {
    let (r, c) = (q.rows, q.cols);
    if ct {
        vec![
            (format!("{prefix}.weight_packed"), Dtype::U8, vec![r, c / 2], q.codes.clone()),
            // Some exporters store the E4M3 scales as U8.
            (format!("{prefix}.weight_scale"), Dtype::U8, vec![r, c / 16], q.scales.clone()),
            f32_scalar(&format!("{prefix}.weight_global_scale"), &[1], 1.0 / q.global_scale),
            f32_scalar(&format!("{prefix}.input_global_scale"), &[1], 3.0),
        ]
    } else {
        vec![
            (format!("{prefix}.weight"), Dtype::U8, vec![r, c / 2], q.codes.clone()),
            (format!("{prefix}.weight_scale"), Dtype::F8_E4M3, vec![r, c / 16], q.scales.clone()),
            f32_scalar(&format!("{prefix}.weight_scale_2"), &[], q.global_scale),
            f32_scalar(&format!("{prefix}.input_scale"), &[], 0.5),
        ]
    }
}

fn expert_q(m: &Model, l: usize, e: usize, p: usize) -> Nvfp4Owned {
    let [r, c] = shape_of(p);
    quantize(&m.experts[l][e][p], r, c)
}

/// Layer 0's q_proj, quantized in the NVFP4 checkpoints.
const Q0: &str = "model.layers.0.self_attn.q_proj";

fn q0_quantized(m: &Model) -> Nvfp4Owned {
    let (_, shape, _, bytes) = m.dense.iter().find(|d| d.0 == format!("{Q0}.weight")).unwrap();
    let mut w = vec![0.0; shape[0] * shape[1]];
    crate::quant::bf16_bytes_to_f32(bytes, &mut w);
    quantize(&w, shape[0], shape[1])
}

/// (4) ModelOpt / (5) compressed-tensors: experts and layer 0's q_proj NVFP4.
fn nvfp4_ckpt(m: &Model, ct: bool) -> Vec<St> {
    let mut out: Vec<St> = dense_bf16(m).into_iter().filter(|t| t.0 != format!("{Q0}.weight")).collect();
    out.extend(nvfp4_tensors(Q0, &q0_quantized(m), ct));
    for l in 0..L {
        for e in 0..E {
            for p in 0..3 {
                out.extend(nvfp4_tensors(&expert_prefix(l, e, p), &expert_q(m, l, e, p), ct));
            }
        }
    }
    out
}

fn modelopt_json(m: &Model) -> Value {
    let mut j = m.json.clone();
    j["quantization_config"] = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16});
    j
}

fn ct_json(m: &Model) -> Value {
    let mut j = m.json.clone();
    j["quantization_config"] = json!({
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}
    });
    j
}

fn write_st(path: &Path, tensors: &[St]) {
    let views: Vec<(String, StView<'_>)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), StView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Writes config.json and the given files (name, tensors) into `dir`.
fn write_ckpt(dir: &Path, json: &Value, files: &[(&str, &[St])]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    for (name, tensors) in files {
        write_st(&dir.join(name), tensors);
    }
}

fn write_index(dir: &Path, files: &[(&str, &[St])]) {
    let map: BTreeMap<&str, &str> =
        files.iter().flat_map(|(f, ts)| ts.iter().map(move |t| (t.0.as_str(), *f))).collect();
    let v = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join(checkpoint::INDEX_FILE), v.to_string()).unwrap();
}

fn run(dir: &Path, out: &Path, dense: DenseFormat) -> Result<Manifest> {
    convert(dir, out, &ConvertOptions { dense, ..Default::default() })
}

fn err(dir: &Path, out: &Path) -> String {
    let e = run(dir, out, DenseFormat::Bf16).unwrap_err().to_string();
    assert!(!out.exists(), "a failed conversion left {}", out.display());
    e
}

fn bytes_of(p: &Pack, name: &str) -> Vec<u8> {
    match p.tensor(name).unwrap().data {
        TensorData::Bf16(b) => b.to_vec(),
        other => panic!("{name} is not BF16: {other:?}"),
    }
}

#[test]
fn five_checkpoint_forms_give_identical_packs() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let root = t.path();

    let single = per_expert_bf16(&m);
    write_ckpt(&root.join("c1"), &m.json, &[("model.safetensors", &single)]);
    std::fs::write(root.join("c1/tokenizer.json"), "{}").unwrap();

    let (a, b): (Vec<St>, Vec<St>) = single.iter().cloned().partition(|t| !t.0.starts_with("model.layers.1."));
    let shards: [(&str, &[St]); 2] =
        [("model-00001-of-00002.safetensors", &a), ("model-00002-of-00002.safetensors", &b)];
    write_ckpt(&root.join("c2"), &m.json, &shards);
    write_index(&root.join("c2"), &shards);
    // A stray file the index does not name is not read.
    std::fs::write(root.join("c2/consolidated.safetensors"), b"junk").unwrap();

    write_ckpt(&root.join("c3"), &m.json, &[("model.safetensors", &fused_bf16(&m))]);
    write_ckpt(&root.join("c4"), &modelopt_json(&m), &[("model.safetensors", &nvfp4_ckpt(&m, false))]);
    write_ckpt(&root.join("c5"), &ct_json(&m), &[("model.safetensors", &nvfp4_ckpt(&m, true))]);

    let mut packs = Vec::new();
    for (i, scheme) in ["bf16", "bf16", "bf16", "nvfp4-modelopt", "nvfp4-compressed-tensors"].iter().enumerate() {
        let (dir, out) = (root.join(format!("c{}", i + 1)), root.join(format!("p{}", i + 1)));
        let man = run(&dir, &out, DenseFormat::Bf16).unwrap();
        assert_eq!(man.source, format!("convert {} ({scheme})", dir.display()));
        assert!(man.tensors.iter().all(|t| !t.name.starts_with("mtp.")));
        packs.push(Pack::open(&out).unwrap());
    }
    assert!(root.join("p1/tokenizer.json").is_file());
    assert!(packs[0].manifest().files.iter().any(|f| f.name == "tokenizer.json"));

    let layout = packs[0].layout();
    let tail = layout.tail as usize;
    for l in 0..L {
        for e in 0..E {
            let want = packs[0].expert(l, e).unwrap();
            // The tails hold the global scales we quantized with: one per matrix.
            let gs = [want.gate, want.up, want.down].map(|x| x.global_scale);
            for (p, g) in gs.iter().enumerate() {
                assert_eq!(*g, expert_q(&m, l, e, p).global_scale);
                assert!(*g < 1e-3, "global scale {g} is not far from 1");
            }
            assert_ne!(gs[0], gs[1]);
            assert_eq!(want.gate.codes, &expert_q(&m, l, e, 0).codes[..]);
            for (k, p) in packs.iter().enumerate().skip(1).take(3) {
                assert!(want.blob == p.expert(l, e).unwrap().blob, "pack {} ({l}, {e})", k + 1);
            }
            // compressed-tensors: g = 1 / (1 / g) may be an ulp off.
            let ct = packs[4].expert(l, e).unwrap();
            assert_eq!(want.blob[..tail], ct.blob[..tail], "codes/scales ({l}, {e})");
            for (g, c) in gs.iter().zip([ct.gate, ct.up, ct.down].map(|x| x.global_scale)) {
                assert!((g - c).abs() <= 1e-6 * g, "{g} vs {c}");
            }
        }
    }

    // Dense tensors are the source BF16 bytes, in every pack; layer 0's
    // q_proj of the NVFP4 checkpoints is carried as NVFP4.
    let q0 = q0_quantized(&m);
    for (k, p) in packs.iter().enumerate() {
        for (name, shape, _, bytes) in &m.dense {
            if k >= 3 && *name == format!("{Q0}.weight") {
                let TensorData::Nvfp4(t) = p.tensor(name).unwrap().data else {
                    panic!("{name} in pack {} is not NVFP4", k + 1)
                };
                assert_eq!((t.codes, t.scales), (&q0.codes[..], &q0.scales[..]));
                let g = q0.global_scale;
                assert!((t.global_scale - g).abs() <= 1e-6 * g);
                assert_eq!((t.rows, t.cols), (shape[0], shape[1]));
            } else {
                assert_eq!(&bytes_of(p, name), bytes, "{name} in pack {}", k + 1);
            }
        }
    }
}

#[test]
fn dense_nvfp4_quantizes_projections_only() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let dir = t.path().join("c");
    write_ckpt(&dir, &m.json, &[("model.safetensors", &per_expert_bf16(&m))]);
    run(&dir, &t.path().join("p"), DenseFormat::Nvfp4).unwrap();
    let p = Pack::open(&t.path().join("p")).unwrap();
    let mut quantized = 0;
    for (name, shape, role, bytes) in &m.dense {
        let data = p.tensor(name).unwrap().data;
        if role.may_quantize() {
            let mut w = vec![0.0; shape[0] * shape[1]];
            crate::quant::bf16_bytes_to_f32(bytes, &mut w);
            let q = quantize(&w, shape[0], shape[1]);
            let TensorData::Nvfp4(t) = data else { panic!("{name} should be NVFP4") };
            assert_eq!((t.codes, t.scales), (&q.codes[..], &q.scales[..]), "{name}");
            assert_eq!(t.global_scale, q.global_scale);
            quantized += 1;
        } else {
            assert_eq!(&bytes_of(&p, name), bytes, "{name} should stay BF16");
        }
    }
    // q, k, v, o per layer, and lm_head.
    assert_eq!(quantized, 4 * L + 1);
}

#[test]
fn tied_embeddings_need_no_lm_head_and_ignore_one() {
    let t = tempfile::tempdir().unwrap();
    let m = model(true);
    let tensors = per_expert_bf16(&m);
    assert!(tensors.iter().all(|t| t.0 != "lm_head.weight"));
    let dir = t.path().join("c");
    write_ckpt(&dir, &m.json, &[("model.safetensors", &tensors)]);
    let man = run(&dir, &t.path().join("p"), DenseFormat::Bf16).unwrap();
    assert!(man.tensors.iter().all(|t| t.name != "lm_head.weight"));
    assert!(man.config.tie_word_embeddings);

    let mut with_head = tensors;
    with_head.push(bf16("lm_head.weight", &[40, H], vec![0; 40 * H * 2]));
    let dir = t.path().join("c2");
    write_ckpt(&dir, &m.json, &[("model.safetensors", &with_head)]);
    let man = run(&dir, &t.path().join("p2"), DenseFormat::Nvfp4).unwrap();
    assert!(man.tensors.iter().all(|t| t.name != "lm_head.weight"));
}

#[test]
fn f32_and_f16_sources_round_to_bf16() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    // 1 + 2^-8 is halfway between two BF16 values: ties go to even (1.0);
    // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    let norm: Vec<f32> = (0..H).map(|i| 1.0 + [1.0, 3.0][i % 2] * (2.0f32).powi(-8)).collect();
    let down = &m.experts[1][2][2];
    let mut tensors: Vec<St> = per_expert_bf16(&m)
        .into_iter()
        .filter(|t| t.0 != "model.norm.weight" && t.0 != "model.layers.1.mlp.experts.2.down_proj.weight")
        .collect();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    tensors.push(("model.norm.weight".into(), Dtype::F32, vec![H], f32_bytes(&norm)));
    let f16: Vec<u8> = down.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect();
    tensors.push(("model.layers.1.mlp.experts.2.down_proj.weight".into(), Dtype::F16, vec![H, I], f16.clone()));
    let dir = t.path().join("c");
    write_ckpt(&dir, &m.json, &[("model.safetensors", &tensors)]);
    run(&dir, &t.path().join("p"), DenseFormat::Bf16).unwrap();
    let p = Pack::open(&t.path().join("p")).unwrap();
    let got = p.tensor("model.norm.weight").unwrap().to_f32();
    assert_eq!(got[0], 1.0);
    assert_eq!(got[1], 1.0 + (2.0f32).powi(-6));
    // The F16 expert is quantized from its exact f32 values.
    let mut w = vec![0.0; H * I];
    crate::quant::f16_bytes_to_f32(&f16, &mut w);
    let q = quantize(&w, H, I);
    let d = p.expert(1, 2).unwrap().down;
    assert_eq!((d.codes, d.scales, d.global_scale), (&q.codes[..], &q.scales[..], q.global_scale));
}

#[test]
fn piecewise_quantization_equals_whole() {
    let mut rng = Rng(7);
    let (rows, cols) = (37, 48);
    let w = rng.bf16_values(rows * cols, 0.3);
    let bytes = f32_to_bf16_bytes(&w);
    let f = FloatData { dtype: FloatDtype::Bf16, bytes: &bytes };
    let whole = quantize(&w, rows, cols);
    // 5 rows per piece: 8 pieces, the last one short.
    let pieces = quantize_float(f, rows, cols, "t", 5 * cols).unwrap();
    assert_eq!(pieces, whole);
    let mut bad = w.clone();
    bad[1000] = f32::NAN;
    let bytes = f32_to_bf16_bytes(&bad);
    let f = FloatData { dtype: FloatDtype::Bf16, bytes: &bytes };
    let e = quantize_float(f, rows, cols, "the.tensor", 5 * cols).unwrap_err();
    assert!(e.to_string().contains("the.tensor"), "{e}");
}

// ---- errors: each message names the culprit --------------------------------

/// Writes a one-file checkpoint where `edit` changed the per-expert BF16 tensors.
fn broken(root: &Path, json: &Value, edit: impl FnOnce(&mut Vec<St>)) -> std::path::PathBuf {
    let m = model(false);
    let mut tensors = per_expert_bf16(&m);
    edit(&mut tensors);
    let dir = root.join("c");
    write_ckpt(&dir, json, &[("model.safetensors", &tensors)]);
    dir
}

#[test]
fn missing_config_json() {
    let t = tempfile::tempdir().unwrap();
    let dir = broken(t.path(), &config_json(false), |_| {});
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("config.json") && e.contains(&dir.display().to_string()), "{e}");
}

#[test]
fn missing_tensors() {
    let t = tempfile::tempdir().unwrap();
    let name = "model.layers.1.mlp.experts.3.down_proj.weight";
    let dir = broken(t.path(), &config_json(false), |ts| ts.retain(|t| t.0 != name));
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("missing"), "{e}");

    let t = tempfile::tempdir().unwrap();
    let dir = broken(t.path(), &config_json(false), |ts| ts.retain(|t| t.0 != "lm_head.weight"));
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("lm_head.weight") && e.contains("tie_word_embeddings"), "{e}");
}

#[test]
fn wrong_shape() {
    let t = tempfile::tempdir().unwrap();
    let name = "model.layers.1.self_attn.k_proj.weight";
    let dir = broken(t.path(), &config_json(false), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == name).unwrap();
        t.2 = vec![H, 16]; // stored transposed; the config needs [kv_dim, hidden]
    });
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("[32, 16]") && e.contains("[16, 32]"), "{e}");
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn fused_down_with_swapped_orientation() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let mut tensors = fused_bf16(&m);
    let name = "model.layers.0.mlp.experts.down_proj";
    tensors.iter_mut().find(|t| t.0 == name).unwrap().2 = vec![E, I, H];
    let dir = t.path().join("c");
    write_ckpt(&dir, &m.json, &[("model.safetensors", &tensors)]);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("[4, 16, 32]") && e.contains("[4, 32, 16]"), "{e}");
}

#[test]
fn nvfp4_without_global_scale() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_2";
    let mut tensors = nvfp4_ckpt(&m, false);
    tensors.retain(|t| t.0 != name);
    let dir = t.path().join("c");
    write_ckpt(&dir, &modelopt_json(&m), &[("model.safetensors", &tensors)]);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("missing"), "{e}");
}

#[test]
fn non_finite_or_zero_global_scale() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let name = "model.layers.0.mlp.experts.1.gate_proj.weight_scale_2";
    let mut tensors = nvfp4_ckpt(&m, false);
    tensors.iter_mut().find(|t| t.0 == name).unwrap().3 = f32::INFINITY.to_le_bytes().to_vec();
    let dir = t.path().join("c");
    write_ckpt(&dir, &modelopt_json(&m), &[("model.safetensors", &tensors)]);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("inf"), "{e}");

    // compressed-tensors divisor 0 would give g = inf.
    let t = tempfile::tempdir().unwrap();
    let name = "model.layers.1.mlp.experts.0.down_proj.weight_global_scale";
    let mut tensors = nvfp4_ckpt(&m, true);
    tensors.iter_mut().find(|t| t.0 == name).unwrap().3 = 0.0f32.to_le_bytes().to_vec();
    let dir = t.path().join("c");
    write_ckpt(&dir, &ct_json(&m), &[("model.safetensors", &tensors)]);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains(name) && e.contains("global scale 0"), "{e}");
}

#[test]
fn duplicate_tensor_across_shards() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let all = per_expert_bf16(&m);
    let (a, mut b): (Vec<St>, Vec<St>) = all.iter().cloned().partition(|t| !t.0.starts_with("model.layers.1."));
    b.push(all.iter().find(|t| t.0 == "model.norm.weight").unwrap().clone());
    let dir = t.path().join("c");
    // No index: the directory's files are read as a union.
    write_ckpt(&dir, &m.json, &[("a.safetensors", &a), ("b.safetensors", &b)]);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("model.norm.weight") && e.contains("a.safetensors") && e.contains("b.safetensors"), "{e}");
}

#[test]
fn index_names_missing_shard() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let all = per_expert_bf16(&m);
    let (a, b): (Vec<St>, Vec<St>) = all.into_iter().partition(|t| !t.0.starts_with("model.layers.1."));
    let shards: [(&str, &[St]); 2] =
        [("model-00001-of-00002.safetensors", &a), ("model-00002-of-00002.safetensors", &b)];
    let dir = t.path().join("c");
    write_ckpt(&dir, &m.json, &shards[..1]);
    write_index(&dir, &shards);
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("missing"), "{e}");
}

#[test]
fn unsupported_model_type_and_quantization() {
    let t = tempfile::tempdir().unwrap();
    let mut j = config_json(false);
    j["model_type"] = "llama".into();
    let dir = broken(t.path(), &j, |_| {});
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("llama"), "{e}");

    let t = tempfile::tempdir().unwrap();
    let mut j = config_json(false);
    j["quantization_config"] = json!({"quant_method": "gptq", "bits": 4});
    let dir = broken(t.path(), &j, |_| {});
    let e = err(&dir, &t.path().join("p"));
    assert!(e.contains("gptq"), "{e}");
}

#[test]
fn existing_pack_needs_overwrite() {
    let t = tempfile::tempdir().unwrap();
    let dir = broken(t.path(), &config_json(false), |_| {});
    let out = t.path().join("p");
    run(&dir, &out, DenseFormat::Bf16).unwrap();
    let e = run(&dir, &out, DenseFormat::Bf16).unwrap_err().to_string();
    assert!(e.contains(&out.display().to_string()) && e.contains("already holds a pack"), "{e}");
    let opts = ConvertOptions { overwrite: true, ..Default::default() };
    convert(&dir, &out, &opts).unwrap();
    Pack::open(&out).unwrap().verify(|_, _| {}).unwrap();
}

// ---- the reference fixtures made with transformers (tests/fixtures/README.md) ----

#[test]
fn reference_fixtures_convert_alike_in_every_layout() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures");
    let t = tempfile::tempdir().unwrap();
    for model in ["a", "b"] {
        let forms = [("bf16", "bf16"), ("nvfp4_modelopt", "nvfp4-modelopt"), ("nvfp4_ct", "nvfp4-compressed-tensors")];
        let packs: Vec<Pack> = forms
            .iter()
            .map(|(dir, scheme)| {
                let (from, out) = (fixtures.join(model).join(dir), t.path().join(format!("{model}-{dir}")));
                let man = run(&from, &out, DenseFormat::Bf16).unwrap();
                assert_eq!(man.source, format!("convert {} ({scheme})", from.display()));
                Pack::open(&out).unwrap()
            })
            .collect();
        let c = packs[0].config().clone();
        assert_eq!(model == "b", c.tie_word_embeddings);
        let tail = packs[0].layout().tail as usize;
        for l in 0..c.num_hidden_layers {
            for e in 0..c.num_experts {
                let [ours, mo, ct] = [0, 1, 2].map(|k| packs[k].expert(l, e).unwrap());
                // Our quantization of the BF16 weights equals ModelOpt's bytes.
                assert!(ours.blob == mo.blob, "{model}: layer {l} expert {e}");
                assert_eq!(mo.blob[..tail], ct.blob[..tail], "{model}: layer {l} expert {e}");
                for (a, b) in [(mo.gate, ct.gate), (mo.up, ct.up), (mo.down, ct.down)] {
                    let (g, h) = (a.global_scale, b.global_scale);
                    assert!((g - h).abs() <= 1e-6 * g, "{model}: {g} vs {h}");
                }
            }
        }
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(fixtures.join(model).join("reference.json")).unwrap())
                .unwrap();
        for (e, scales) in reference["global_scales_layer0"].as_object().unwrap() {
            let x = packs[1].expert(0, e.parse().unwrap()).unwrap();
            for (proj, m) in [("gate_proj", x.gate), ("up_proj", x.up), ("down_proj", x.down)] {
                assert_eq!(m.global_scale, scales[proj].as_f64().unwrap() as f32, "{model} expert {e} {proj}");
            }
        }
        for tensor in &packs[0].manifest().tensors {
            let want = bytes_of(&packs[0], &tensor.name);
            for p in &packs[1..] {
                assert_eq!(bytes_of(p, &tensor.name), want, "{model}: {}", tensor.name);
            }
        }
    }
    assert!(t.path().join("a-bf16/tokenizer.json").is_file());
}

// ---- the qwen3_next reference fixtures (tests/fixtures/README.md, "Qwen3-Next fixtures") ----

fn next_fixture(model: &str, form: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures_next").join(model).join(form)
}

/// Every stored tensor of a checkpoint directory, sorted by name.
fn load_ckpt(dir: &Path) -> Vec<St> {
    let shards = checkpoint::Shards::open(dir).unwrap();
    let ck = checkpoint::Checkpoint::new(&shards).unwrap();
    let mut names: Vec<String> = ck.names().map(str::to_string).collect();
    names.sort_unstable();
    names
        .into_iter()
        .map(|n| {
            let t = ck.get(&n).unwrap();
            (n, t.dtype, t.shape, t.data.to_vec())
        })
        .collect()
}

fn nvfp4_of<'p>(p: &'p Pack, name: &str) -> crate::quant::Nvfp4Matrix<'p> {
    match p.tensor(name).unwrap().data {
        TensorData::Nvfp4(m) => m,
        other => panic!("{name} is not NVFP4: {other:?}"),
    }
}

const SHARED: [Role; 3] = [Role::SharedGateProj, Role::SharedUpProj, Role::SharedDownProj];

#[test]
fn qwen3_next_fixtures_bf16_and_modelopt_packs_agree() {
    use crate::model::weights::tensor_name_for_layer;
    let t = tempfile::tempdir().unwrap();
    for model in ["a", "b"] {
        let packs: Vec<Pack> = [("bf16", "bf16"), ("nvfp4_modelopt", "nvfp4-modelopt")]
            .iter()
            .map(|(form, scheme)| {
                let (from, out) = (next_fixture(model, form), t.path().join(format!("{model}-{form}")));
                let man = run(&from, &out, DenseFormat::Bf16).unwrap();
                assert_eq!(man.source, format!("convert {} ({scheme})", from.display()));
                assert_eq!(man.arch, "qwen3_next");
                Pack::open(&out).unwrap()
            })
            .collect();
        let c = packs[0].config().clone();
        assert_eq!(c.mtp_layers(), 1);
        let (l_main, e_n) = (c.num_hidden_layers, c.num_experts);
        assert_eq!(packs[1].manifest().experts.entries.len(), (l_main + 1) * e_n);
        // Routed experts, MTP layer (l_main) included: our quantization of the
        // BF16 weights equals ModelOpt's bytes and scales.
        for l in 0..c.num_expert_layers() {
            for e in 0..e_n {
                let [ours, mo] = [0, 1].map(|k| packs[k].expert(l, e).unwrap());
                assert!(ours.blob == mo.blob, "{model}: layer {l} expert {e}");
            }
            // The shared expert is NVFP4 in both, byte for byte.
            for role in SHARED {
                let name = tensor_name_for_layer(&c, l, role);
                let [a, b] = [0, 1].map(|k| nvfp4_of(&packs[k], &name));
                assert_eq!((a.codes, a.scales, a.global_scale), (b.codes, b.scales, b.global_scale), "{model}: {name}");
            }
        }
        // Global scales are the checkpoint's (reference.json, layer 0).
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(next_fixture(model, "reference.json")).unwrap()).unwrap();
        let projs = ["gate_proj", "up_proj", "down_proj"];
        for (e, scales) in reference["global_scales_layer0"].as_object().unwrap() {
            let want = projs.map(|p| scales[p].as_f64().unwrap() as f32);
            for p in &packs {
                let got = if e == "shared" {
                    SHARED.map(|r| nvfp4_of(p, &tensor_name_for_layer(&c, 0, r)).global_scale)
                } else {
                    let x = p.expert(0, e.parse().unwrap()).unwrap();
                    [x.gate, x.up, x.down].map(|m| m.global_scale)
                };
                assert_eq!(got, want, "{model}: layer 0 {e}");
            }
        }
        // Every dense tensor identical between the packs; the BF16 ones are
        // the checkpoint's bytes (conv1d keeps [C, 1, K]; A_log and dt_bias
        // are BF16 in these checkpoints, so they stay BF16).
        let ckpt = load_ckpt(&next_fixture(model, "bf16"));
        let [ma, mb] = [0, 1].map(|k| packs[k].manifest());
        assert_eq!(ma.tensors.len(), mb.tensors.len());
        for (x, y) in ma.tensors.iter().zip(&mb.tensors) {
            assert_eq!(
                (&x.name, x.dtype, &x.shape, x.crc32, x.global_scale),
                (&y.name, y.dtype, &y.shape, y.crc32, y.global_scale),
                "{model}"
            );
            if x.dtype == DType::Bf16 {
                let (_, _, shape, bytes) = ckpt.iter().find(|s| s.0 == x.name).unwrap();
                assert_eq!(&bytes_of(&packs[1], &x.name), bytes, "{model}: {}", x.name);
                assert_eq!(shape.iter().map(|&d| d as u64).collect::<Vec<_>>(), x.shape);
            } else {
                assert!(x.name.contains(".mlp.shared_expert."), "{model}: {} is {:?}", x.name, x.dtype);
            }
        }
        // Every MTP tensor of the checkpoint is in the pack.
        for (name, shape) in reference["mtp_tensors"].as_object().unwrap() {
            let shape: Vec<u64> = shape.as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
            if let Some(rest) = name.strip_prefix("mtp.layers.0.mlp.experts.") {
                let e: usize = rest.split('.').next().unwrap().parse().unwrap();
                let x = packs[1].expert(l_main, e).unwrap();
                let m = [x.gate, x.up, x.down][projs.iter().position(|p| rest.contains(p)).unwrap()];
                assert_eq!([m.rows as u64, m.cols as u64], shape[..], "{name}");
            } else {
                let t = ma.tensors.iter().find(|t| &t.name == name).unwrap_or_else(|| panic!("{model}: {name}"));
                assert_eq!(t.shape, shape, "{name}");
            }
        }
    }
}

/// Fixture `a` rewritten in the other layouts: compressed-tensors NVFP4
/// (from the ModelOpt file), and BF16 with fused experts, F32 `A_log` /
/// `dt_bias`; then without its MTP tensors.
#[test]
fn qwen3_next_other_layouts_and_f32_parameters() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(next_fixture("a", "bf16").join("config.json")).unwrap()).unwrap();
    let mo_pack = root.join("mo");
    run(&next_fixture("a", "nvfp4_modelopt"), &mo_pack, DenseFormat::Bf16).unwrap();
    let bf_pack = root.join("bf");
    run(&next_fixture("a", "bf16"), &bf_pack, DenseFormat::Bf16).unwrap();
    let (mo, bf) = (Pack::open(&mo_pack).unwrap(), Pack::open(&bf_pack).unwrap());

    // compressed-tensors: codes as weight_packed, the global scale as a divisor.
    let mut ct = Vec::new();
    for (n, d, s, b) in load_ckpt(&next_fixture("a", "nvfp4_modelopt")) {
        if let Some(p) = n.strip_suffix(".weight_scale_2") {
            let g = f32::from_le_bytes(b[..4].try_into().unwrap());
            ct.push(f32_scalar(&format!("{p}.weight_global_scale"), &[1], 1.0 / g));
        } else if n.ends_with(".input_scale") {
        } else if d == Dtype::U8 && n.ends_with(".weight") {
            ct.push((format!("{n}_packed"), d, s, b));
        } else {
            ct.push((n, d, s, b));
        }
    }
    let mut j = config.clone();
    j["quantization_config"] = ct_json(&model(false))["quantization_config"].clone();
    write_ckpt(&root.join("ct"), &j, &[("model.safetensors", &ct)]);
    let man = run(&root.join("ct"), &root.join("ct-pack"), DenseFormat::Bf16).unwrap();
    assert!(man.source.ends_with("(nvfp4-compressed-tensors)"));
    let ctp = Pack::open(&root.join("ct-pack")).unwrap();
    let tail = mo.layout().tail as usize;
    for l in 0..5 {
        for e in 0..8 {
            let (a, b) = (mo.expert(l, e).unwrap(), ctp.expert(l, e).unwrap());
            assert_eq!(a.blob[..tail], b.blob[..tail], "layer {l} expert {e}");
            for (x, y) in [(a.gate, b.gate), (a.up, b.up), (a.down, b.down)] {
                assert!((x.global_scale - y.global_scale).abs() <= 1e-6 * x.global_scale);
            }
        }
    }
    let se = "model.layers.2.mlp.shared_expert.up_proj.weight";
    let (x, y) = (nvfp4_of(&mo, se), nvfp4_of(&ctp, se));
    assert_eq!((x.codes, x.scales), (y.codes, y.scales));
    assert!((x.global_scale - y.global_scale).abs() <= 1e-6 * x.global_scale);

    // BF16 with fused experts (MTP layer too) and F32 A_log / dt_bias.
    let mut fused: Vec<St> = Vec::new();
    let all = load_ckpt(&next_fixture("a", "bf16"));
    for (n, d, s, b) in &all {
        if n.contains(".mlp.experts.") {
            continue;
        }
        if n.ends_with(".A_log") || n.ends_with(".dt_bias") {
            let mut v = vec![0.0f32; b.len() / 2];
            crate::quant::bf16_bytes_to_f32(b, &mut v);
            // Off the BF16 grid: an F32 value the pack must keep exactly.
            v.iter_mut().for_each(|x| *x += 1e-4);
            fused.push((n.clone(), Dtype::F32, s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()));
        } else {
            fused.push((n.clone(), *d, s.clone(), b.clone()));
        }
    }
    for prefix in ["model.layers.0.", "model.layers.1.", "model.layers.2.", "model.layers.3.", "mtp.layers.0."] {
        let get =
            |e: usize, p: &str| &all.iter().find(|x| x.0 == format!("{prefix}mlp.experts.{e}.{p}.weight")).unwrap().3;
        let gu: Vec<u8> = (0..8).flat_map(|e| [get(e, "gate_proj").as_slice(), get(e, "up_proj")].concat()).collect();
        let dn: Vec<u8> = (0..8).flat_map(|e| get(e, "down_proj").clone()).collect();
        fused.push(bf16(&format!("{prefix}mlp.experts.gate_up_proj"), &[8, 64, 64], gu));
        fused.push(bf16(&format!("{prefix}mlp.experts.down_proj"), &[8, 64, 32], dn));
    }
    write_ckpt(&root.join("fused"), &config, &[("model.safetensors", &fused)]);
    run(&root.join("fused"), &root.join("fused-pack"), DenseFormat::Bf16).unwrap();
    let fp = Pack::open(&root.join("fused-pack")).unwrap();
    for l in 0..5 {
        for e in 0..8 {
            assert!(fp.expert(l, e).unwrap().blob == bf.expert(l, e).unwrap().blob, "layer {l} expert {e}");
        }
    }
    for name in ["model.layers.1.linear_attn.A_log", "model.layers.2.linear_attn.dt_bias"] {
        let v = fp.tensor(name).unwrap();
        let TensorData::F32(bytes) = v.data else { panic!("{name} is not F32") };
        let src = &fused.iter().find(|x| x.0 == name).unwrap().3;
        assert_eq!(bytes, &src[..], "{name}");
    }

    // No mtp.* tensors at all: a pack without the MTP head.
    let no_mtp: Vec<St> = fused.into_iter().filter(|x| !x.0.starts_with("mtp.")).collect();
    write_ckpt(&root.join("no-mtp"), &config, &[("model.safetensors", &no_mtp)]);
    let man = run(&root.join("no-mtp"), &root.join("no-mtp-pack"), DenseFormat::Bf16).unwrap();
    assert_eq!((man.config.mtp_layers(), man.experts.entries.len()), (0, 4 * 8));
    assert!(man.tensors.iter().all(|t| !t.name.starts_with("mtp.")));
    assert!(Pack::open(&root.join("no-mtp-pack")).unwrap().expert(4, 0).is_err());
}

#[test]
fn qwen3_next_dense_nvfp4_and_bad_dtypes() {
    let t = tempfile::tempdir().unwrap();
    let man = run(&next_fixture("b", "bf16"), &t.path().join("p"), DenseFormat::Nvfp4).unwrap();
    let dtype = |n: &str| man.tensors.iter().find(|t| t.name == n).unwrap().dtype;
    for n in [
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.0.linear_attn.out_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "mtp.fc.weight",
        "mtp.layers.0.self_attn.o_proj.weight",
        "model.layers.5.mlp.shared_expert.gate_proj.weight",
    ] {
        assert_eq!(dtype(n), DType::Nvfp4, "{n}");
    }
    for n in [
        "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.A_log",
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.1.mlp.gate.weight",
        "mtp.norm.weight",
    ] {
        assert_eq!(dtype(n), DType::Bf16, "{n}");
    }
    Pack::open(&t.path().join("p")).unwrap();

    // A checkpoint's NVFP4 is carried for linear weights (here in_proj_ba),
    // and refused for others (the embedding) before anything is written.
    let mut ts = load_ckpt(&next_fixture("a", "nvfp4_modelopt"));
    let ba = "model.layers.0.linear_attn.in_proj_ba";
    let q = quantize(&[0.5f32; 8 * 64], 8, 64);
    ts.retain(|x| x.0 != format!("{ba}.weight"));
    ts.extend(nvfp4_tensors(ba, &q, false));
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(next_fixture("a", "nvfp4_modelopt").join("config.json")).unwrap(),
    )
    .unwrap();
    let dir = t.path().join("c");
    write_ckpt(&dir, &config, &[("model.safetensors", &ts)]);
    run(&dir, &t.path().join("p2"), DenseFormat::Bf16).unwrap();
    let p2 = Pack::open(&t.path().join("p2")).unwrap();
    assert_eq!(nvfp4_of(&p2, &format!("{ba}.weight")).codes, &q.codes[..]);

    let emb = "model.embed_tokens";
    ts.retain(|x| x.0 != format!("{emb}.weight"));
    ts.extend(nvfp4_tensors(emb, &quantize(&[0.5f32; 384 * 64], 384, 64), false));
    let dir = t.path().join("c3");
    write_ckpt(&dir, &config, &[("model.safetensors", &ts)]);
    let e = err(&dir, &t.path().join("p3"));
    assert!(e.contains(emb) && e.contains("only linear weights"), "{e}");
}

#[test]
fn eos_tokens_come_from_generation_config_then_config() {
    let t = tempfile::tempdir().unwrap();
    let m = model(false);
    let tensors = per_expert_bf16(&m);
    let convert_with = |name: &str, config_eos: Value, generation: Option<Value>| {
        let mut json = m.json.clone();
        json["eos_token_id"] = config_eos;
        let dir = t.path().join(name);
        write_ckpt(&dir, &json, &[("model.safetensors", &tensors)]);
        if let Some(g) = generation {
            std::fs::write(dir.join("generation_config.json"), g.to_string()).unwrap();
        }
        let out = t.path().join(format!("{name}.pack"));
        run(&dir, &out, DenseFormat::Bf16).map(|man| {
            // What was written is what a reader sees.
            assert_eq!(Pack::open(&out).unwrap().manifest().eos_token_ids, man.eos_token_ids);
            man.eos_token_ids
        })
    };
    // Neither names one: none (and no key in the manifest).
    assert_eq!(convert_with("none", Value::Null, None).unwrap(), Vec::<u32>::new());
    let text = std::fs::read_to_string(t.path().join("none.pack").join("manifest.json")).unwrap();
    assert!(!text.contains("eos_token_ids"), "{text}");
    // config.json alone, one id.
    assert_eq!(convert_with("cfg", json!(7), None).unwrap(), vec![7]);
    // generation_config.json wins, a list (repeats dropped, order kept).
    assert_eq!(convert_with("gen", json!(7), Some(json!({"eos_token_id": [39, 3, 39]}))).unwrap(), vec![39, 3]);
    // A generation config without the key falls back to config.json.
    assert_eq!(convert_with("fallback", json!([5, 6]), Some(json!({"do_sample": true}))).unwrap(), vec![5, 6]);
    // Ids outside the vocabulary (40) can never be sampled: dropped.
    assert_eq!(convert_with("big", json!([40, 2, 1 << 20]), None).unwrap(), vec![2]);
    // Not an id: an error, and no pack.
    let e = convert_with("str", Value::Null, Some(json!({"eos_token_id": ["</s>"]}))).unwrap_err().to_string();
    assert!(e.contains("generation_config.json") && e.contains("eos_token_id"), "{e}");
}
