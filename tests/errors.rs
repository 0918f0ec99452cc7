//! Bad input gets a typed error whose message names the file, tensor or
//! value, and never a panic. One test per kind of bad input.

use std::fs;
use std::path::{Path, PathBuf};

use strata::engine::{Engine, EngineOptions};
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};
use strata::pack::Pack;
use strata::session::SessionOptions;
use strata::Error;

fn tiny_pack(dir: &Path) -> PathBuf {
    let p = dir.join("pack");
    let c = synth::preset(Arch::Qwen3Moe, "tiny").unwrap();
    synth::synth(&c, &p, &SynthOptions::default()).unwrap();
    p
}

fn edit_manifest(pack: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = pack.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

fn open_err(p: &Path) -> String {
    match Pack::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_path() {
    let d = tempfile::tempdir().unwrap();
    let e = open_err(&d.path().join("nope"));
    assert!(e.contains("nope"), "{e}");
    // A directory that is not a pack.
    let e = open_err(d.path());
    assert!(e.contains("manifest.json"), "{e}");
}

#[test]
fn unreadable_manifest() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    fs::remove_file(p.join("manifest.json")).unwrap();
    fs::create_dir(p.join("manifest.json")).unwrap(); // a directory cannot be read as a file
    let e = open_err(&p);
    assert!(e.contains("manifest.json"), "{e}");
}

#[test]
fn wrong_magic() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let path = p.join("experts.bin");
    let mut b = fs::read(&path).unwrap();
    b[..8].copy_from_slice(b"NOTAPACK");
    fs::write(&path, b).unwrap();
    let e = open_err(&p);
    assert!(e.contains("experts.bin") && e.contains("magic"), "{e}");
}

#[test]
fn wrong_version() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    edit_manifest(&p, |v| v["version"] = 7.into());
    match Pack::open(&p) {
        Err(Error::PackVersion { found: 7, supported: 1, .. }) => {}
        other => panic!("{:?}", other.err()),
    }
    // The header of a .bin file carries the version too.
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let path = p.join("dense.bin");
    let mut b = fs::read(&path).unwrap();
    b[8] = 9;
    fs::write(&path, b).unwrap();
    let e = open_err(&p);
    assert!(e.contains("dense.bin") && e.contains("version 9"), "{e}");
}

#[test]
fn malformed_manifest() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    fs::write(p.join("manifest.json"), "{\"format\": \"strata-pack\", ").unwrap();
    let e = open_err(&p);
    assert!(e.contains("manifest.json") && e.contains("malformed"), "{e}");

    let p = tiny_pack(&d.path().join("x"));
    edit_manifest(&p, |v| {
        v.as_object_mut().unwrap().remove("tensors");
    });
    let e = open_err(&p);
    assert!(e.contains("tensors"), "{e}");
}

#[test]
fn truncated_file() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let f = fs::OpenOptions::new().write(true).open(p.join("experts.bin")).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    let e = open_err(&p);
    assert!(e.contains("experts.bin") && e.contains("truncated"), "{e}");
}

#[test]
fn tensor_shape_mismatch() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    edit_manifest(&p, |v| {
        let t = v["tensors"].as_array_mut().unwrap().iter_mut().find(|t| t["name"] == "model.norm.weight").unwrap();
        // Same byte count (64 bf16 = 32 f32... no: keep bytes consistent), wrong shape for the role.
        t["shape"] = serde_json::json!([32, 2]);
    });
    let e = open_err(&p);
    assert!(e.contains("model.norm.weight") && e.contains("[32, 2]"), "{e}");
}

#[test]
fn tensor_dtype_mismatch() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    edit_manifest(&p, |v| {
        let t = v["tensors"].as_array_mut().unwrap().iter_mut().find(|t| t["name"] == "model.norm.weight").unwrap();
        t["dtype"] = "f32".into(); // 128 bytes cannot hold 64 f32 values
    });
    let e = open_err(&p);
    assert!(e.contains("model.norm.weight") && e.contains("F32"), "{e}");
}

#[test]
fn checksum_mismatch() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let pack = Pack::open(&p).unwrap();
    let off = pack.manifest().experts.entries[11].offset as usize + 100;
    drop(pack);
    let path = p.join("experts.bin");
    let mut b = fs::read(&path).unwrap();
    b[off] ^= 0x55;
    fs::write(&path, b).unwrap();
    // Opening is cheap and does not read every byte; verify does.
    let pack = Pack::open(&p).unwrap();
    let e = pack.verify(|_, _| {}).unwrap_err();
    assert!(matches!(e, Error::Checksum { .. }));
    let e = e.to_string();
    assert!(e.contains("layer 1 expert 3") && e.contains("experts.bin"), "{e}");
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named_with_its_pack() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let mut name = String::new();
    edit_manifest(&p, |v| {
        let t = &mut v["tensors"][0];
        name = t["name"].as_str().unwrap().to_string();
        // 3 rows of bf16, the bytes to match: only the config's shape is wrong.
        let cols = t["shape"][1].as_u64().unwrap();
        t["shape"][0] = 3.into();
        t["nbytes"] = (3 * cols * 2).into();
    });
    let e = open_err(&p);
    assert!(e.contains(&name) && e.contains("has shape [3") && e.contains("dense.bin"), "{e}");
}

#[test]
fn unsupported_architecture() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    edit_manifest(&p, |v| v["arch"] = "llama".into());
    let e = open_err(&p);
    assert!(e.contains("llama"), "{e}");
}

#[test]
fn unsupported_config_field() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    edit_manifest(&p, |v| v["config"]["num_key_value_heads"] = 3.into());
    let e = open_err(&p);
    assert!(e.contains("num_key_value_heads 3"), "{e}");
    // A dimension far past any checkpoint's is refused by name, before
    // anything is sized by it.
    edit_manifest(&p, |v| v["config"]["num_hidden_layers"] = (1u64 << 31).into());
    let e = open_err(&p);
    assert!(e.contains("num_hidden_layers 2147483648 exceeds the supported maximum 1024"), "{e}");

    // From a checkpoint: a config option the engine does not implement.
    let ck = d.path().join("ckpt");
    fs::create_dir(&ck).unwrap();
    let mut cfg: serde_json::Value = serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "max_position_embeddings": 128
    });
    cfg["use_sliding_window"] = true.into();
    fs::write(ck.join("config.json"), cfg.to_string()).unwrap();
    let e = strata::pack::convert::convert(&ck, &d.path().join("out"), &Default::default()).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("use_sliding_window"), "{e}");
}

fn session_setup() -> (tempfile::TempDir, Engine) {
    let d = tempfile::tempdir().unwrap();
    let p = tiny_pack(d.path());
    let engine = Engine::load(&p, &EngineOptions::default()).unwrap();
    (d, engine)
}

#[test]
fn token_out_of_range() {
    let (_d, engine) = session_setup();
    let mut s = engine.new_session(&SessionOptions::default()).unwrap();
    s.prefill(&[1, 2, 3]).unwrap();
    let before = s.logits().unwrap().to_vec();
    let e = s.prefill(&[4, 256, 5]).unwrap_err().to_string();
    assert!(e.contains("256"), "{e}");
    assert_eq!(s.len(), 3);
    assert_eq!(s.logits().unwrap(), &before[..]);
}

#[test]
fn empty_prompt() {
    let (_d, engine) = session_setup();
    let mut s = engine.new_session(&SessionOptions::default()).unwrap();
    let e = s.prefill(&[]).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    assert_eq!(s.len(), 0);
}

#[test]
fn context_overflow() {
    let (_d, engine) = session_setup();
    let mut s = engine.new_session(&SessionOptions { context_size: 8, ..Default::default() }).unwrap();
    s.prefill(&[1, 2, 3, 4, 5]).unwrap();
    let before = s.logits().unwrap().to_vec();
    match s.prefill(&[6, 7, 8, 9]) {
        Err(Error::ContextOverflow { needed: 9, capacity: 8 }) => {}
        other => panic!("{:?}", other.err()),
    }
    assert_eq!(s.len(), 5);
    assert_eq!(s.logits().unwrap(), &before[..]);
    // A context larger than the model supports is refused when opening.
    assert!(engine.new_session(&SessionOptions { context_size: 1 << 20, ..Default::default() }).is_err());
}

/// Every number, flag and null of a manifest (the first tensors and expert
/// entries of each table), set to values from 0 to u64::MAX, negative,
/// fractional and null: opening the pack and running a prompt gives an
/// error or a working engine, never a panic (an overflow in a shape
/// product was one) nor an allocation that aborts the process (a layer
/// count of 2^31 was one). A changed shape field is always an error: the
/// tensors no longer fit it.
#[test]
fn out_of_range_manifest_values_are_errors_not_panics() {
    use serde_json::Value;
    fn leaves(v: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, x)| {
                path.push(k.clone());
                leaves(x, path, out);
                path.pop();
            }),
            Value::Array(a) => a.iter().enumerate().take(4).for_each(|(i, x)| {
                path.push(i.to_string());
                leaves(x, path, out);
                path.pop();
            }),
            Value::String(_) => {}
            _ => out.push(path.clone()),
        }
    }
    fn at<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
        path.iter().fold(v, |v, k| match v {
            Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
            o => &mut o[k.as_str()],
        })
    }
    fn run(p: &Path) -> strata::Result<()> {
        let engine = Engine::load(p, &EngineOptions::default())?;
        engine.new_session(&SessionOptions::default())?.prefill(&[1, 2, 3])?;
        Ok(())
    }
    let shape_fields = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "moe_intermediate_size",
        "full_attention_interval",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "shared_expert_intermediate_size",
        "mtp_num_hidden_layers",
    ];
    let values: Vec<Value> = vec![
        0.into(),
        1.into(),
        3.into(),
        4097.into(),
        (1u64 << 31).into(),
        (1u64 << 62).into(),
        u64::MAX.into(),
        (-1).into(),
        1.5.into(),
        1e300.into(),
        Value::Null,
    ];
    let mut failures = Vec::new();
    let mut tried = 0;
    for arch in [Arch::Qwen3Moe, Arch::Qwen3Next] {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("pack");
        synth::synth(&synth::preset(arch, "tiny").unwrap(), &p, &SynthOptions::default()).unwrap();
        let text = fs::read_to_string(p.join("manifest.json")).unwrap();
        let original: Value = serde_json::from_str(&text).unwrap();
        let mut paths = Vec::new();
        leaves(&original, &mut Vec::new(), &mut paths);
        for path in &paths {
            let is_shape = path.first().is_some_and(|k| k == "config")
                && path.last().is_some_and(|k| shape_fields.contains(&k.as_str()));
            for value in &values {
                let mut v = original.clone();
                if *at(&mut v, path) == *value {
                    continue;
                }
                *at(&mut v, path) = value.clone();
                fs::write(p.join("manifest.json"), serde_json::to_string(&v).unwrap()).unwrap();
                tried += 1;
                let what = format!("{} {} = {value}", arch.name(), path.join("."));
                match std::panic::catch_unwind(|| run(&p)) {
                    Err(_) => failures.push(format!("{what}: panicked")),
                    Ok(Ok(())) if is_shape => failures.push(format!("{what}: accepted")),
                    Ok(_) => {}
                }
            }
        }
    }
    assert!(tried > 1000, "{tried} mutations");
    assert!(failures.is_empty(), "{} of {tried} mutations failed:\n{}", failures.len(), failures.join("\n"));
}
