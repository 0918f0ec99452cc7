//! A Hugging Face checkpoint directory as the converter sees it: the
//! quantization scheme declared in its config, and its safetensors files
//! (one file, shards listed by `model.safetensors.index.json`, or every
//! `*.safetensors` in the directory), memory-mapped and indexed by tensor name.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{Error, Result};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
const MODELOPT_CONFIG_FILE: &str = "hf_quant_config.json";
const CT_NVFP4_FORMAT: &str = "nvfp4-pack-quantized";

/// How a checkpoint stores its quantized weights. The two NVFP4 schemes pack
/// identical bytes and differ in the global scale's name and convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// No quantized weights: BF16 (or F16/F32) everywhere.
    Unquantized,
    /// NVIDIA ModelOpt: `X.weight` (codes), `X.weight_scale` (E4M3 block
    /// scales), `X.weight_scale_2` (global scale, a multiplier).
    Modelopt,
    /// compressed-tensors `nvfp4-pack-quantized`: `X.weight_packed`,
    /// `X.weight_scale`, `X.weight_global_scale` (a divisor: g = 1 / value).
    CompressedTensors,
}

impl Scheme {
    /// The name used in the pack manifest's `source`.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Unquantized => "bf16",
            Scheme::Modelopt => "nvfp4-modelopt",
            Scheme::CompressedTensors => "nvfp4-compressed-tensors",
        }
    }
}

/// A JSON file of the checkpoint, parsed; a read or parse failure names the file.
pub(super) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::bad_checkpoint(path, format!("not valid JSON: {e}")))
}

/// The scheme config.json's `quantization_config` (or ModelOpt's
/// `hf_quant_config.json`) declares; `None` when neither says anything.
/// Schemes this converter cannot read are rejected here.
pub fn declared_scheme(dir: &Path, config: &Value) -> Result<Option<Scheme>> {
    let cfg_path = dir.join("config.json");
    let qc = config
        .get("quantization_config")
        .or_else(|| config.get("text_config")?.get("quantization_config"))
        .filter(|q| !q.is_null());
    if let Some(qc) = qc {
        let method = qc.get("quant_method").and_then(Value::as_str).unwrap_or("");
        return match method {
            "modelopt" => {
                check_modelopt_algo(qc.get("quant_algo"), &cfg_path)?;
                Ok(Some(Scheme::Modelopt))
            }
            "compressed-tensors" => {
                let mut formats: BTreeSet<&str> = BTreeSet::new();
                formats.extend(qc.get("format").and_then(Value::as_str));
                if let Some(groups) = qc.get("config_groups").and_then(Value::as_object) {
                    formats.extend(groups.values().filter_map(|g| g.get("format")?.as_str()));
                }
                if formats.contains(CT_NVFP4_FORMAT) {
                    Ok(Some(Scheme::CompressedTensors))
                } else {
                    Err(Error::Unsupported(format!(
                        "{}: compressed-tensors format {formats:?} (supported: {CT_NVFP4_FORMAT})",
                        cfg_path.display()
                    )))
                }
            }
            other => Err(Error::Unsupported(format!(
                "{}: quantization_config.quant_method {other:?} (supported: modelopt NVFP4, \
                 compressed-tensors {CT_NVFP4_FORMAT}, or an unquantized checkpoint)",
                cfg_path.display()
            ))),
        };
    }
    let hf_path = dir.join(MODELOPT_CONFIG_FILE);
    if hf_path.is_file() {
        let v = read_json(&hf_path)?;
        let algo = v.get("quantization").and_then(|q| q.get("quant_algo"));
        if algo.is_some_and(|a| !a.is_null()) {
            check_modelopt_algo(algo, &hf_path)?;
            return Ok(Some(Scheme::Modelopt));
        }
    }
    Ok(None)
}

fn check_modelopt_algo(algo: Option<&Value>, path: &Path) -> Result<()> {
    match algo {
        None | Some(Value::Null) => Ok(()),
        Some(a) if a.as_str().is_some_and(|s| s.eq_ignore_ascii_case("NVFP4")) => Ok(()),
        Some(a) => Err(Error::Unsupported(format!("{}: ModelOpt quant_algo {a} (supported: NVFP4)", path.display()))),
    }
}

/// The checkpoint's safetensors files, mapped. Owns the bytes that
/// [`Checkpoint`] borrows.
pub struct Shards {
    dir: PathBuf,
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
}

impl Shards {
    /// With an index, exactly the files its `weight_map` names (each must
    /// exist); without one, every `*.safetensors` file in `dir`.
    pub fn open(dir: &Path) -> Result<Shards> {
        let index_path = dir.join(INDEX_FILE);
        let paths = if index_path.is_file() {
            let v = read_json(&index_path)?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::bad_checkpoint(&index_path, "has no weight_map object"))?;
            // file -> first tensor (by name) it is said to hold, for messages.
            let mut files: BTreeMap<&str, &str> = BTreeMap::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    Error::bad_checkpoint(&index_path, format!("weight_map entry for {tensor} is not a file name"))
                })?;
                let first = files.entry(file).or_insert(tensor);
                *first = (*first).min(tensor.as_str());
            }
            if files.is_empty() {
                return Err(Error::bad_checkpoint(&index_path, "weight_map is empty"));
            }
            let mut paths = Vec::with_capacity(files.len());
            for (file, tensor) in files {
                let p = dir.join(file);
                if !p.is_file() {
                    return Err(Error::bad_checkpoint(
                        &index_path,
                        format!("weight_map puts {tensor} in shard {file}, which is missing from {}", dir.display()),
                    ));
                }
                paths.push(p);
            }
            paths
        } else {
            let mut paths = Vec::new();
            for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
                let p = entry.map_err(|e| Error::io(dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") && p.is_file() {
                    paths.push(p);
                }
            }
            paths.sort();
            paths
        };
        if paths.is_empty() {
            return Err(Error::bad_checkpoint(dir, format!("no *.safetensors files (and no {INDEX_FILE})")));
        }
        let mut maps = Vec::with_capacity(paths.len());
        for p in &paths {
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            // SAFETY: checkpoint files must not change while we convert them
            // (documented on `convert`); we only read the mapping.
            maps.push(unsafe { Mmap::map(&f) }.map_err(|e| Error::io(p, e))?);
        }
        Ok(Shards { dir: dir.to_path_buf(), paths, maps })
    }
}

/// One tensor as stored, borrowed from its mapped file.
#[derive(Clone, Debug)]
pub struct Tensor<'a> {
    pub name: String,
    pub file: &'a Path,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl Tensor<'_> {
    /// An error about this tensor that names it and its file.
    pub fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::tensor(&self.name, format!("{msg} (in {})", self.file.display()))
    }
}

/// Every tensor of a checkpoint by name; names are unique across files.
pub struct Checkpoint<'a> {
    dir: &'a Path,
    paths: &'a [PathBuf],
    files: Vec<SafeTensors<'a>>,
    by_name: HashMap<String, usize>,
}

impl<'a> Checkpoint<'a> {
    pub fn new(shards: &'a Shards) -> Result<Checkpoint<'a>> {
        let mut files = Vec::with_capacity(shards.maps.len());
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (i, (path, map)) in shards.paths.iter().zip(&shards.maps).enumerate() {
            let st = SafeTensors::deserialize(&map[..])
                .map_err(|e| Error::bad_checkpoint(path, format!("not a valid safetensors file: {e}")))?;
            let mut names = st.names();
            names.sort_unstable();
            for name in names {
                if let Some(prev) = by_name.insert(name.to_string(), i) {
                    return Err(Error::bad_checkpoint(
                        path,
                        format!(
                            "tensor {name} is also in {}; tensor names must be unique across files",
                            shards.paths[prev].display()
                        ),
                    ));
                }
            }
            files.push(st);
        }
        Ok(Checkpoint { dir: &shards.dir, paths: &shards.paths, files, by_name })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<Tensor<'a>> {
        let &i = self.by_name.get(name)?;
        let v = self.files[i].tensor(name).ok()?;
        Some(Tensor {
            name: name.to_string(),
            file: &self.paths[i],
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data: v.data(),
        })
    }

    /// The error for a tensor the model needs but the checkpoint lacks; it
    /// lists stored tensors that share the name's stem, which usually shows
    /// the mix-up (a quantized tensor under another convention, a typo).
    pub fn missing(&self, name: &str) -> Error {
        let stem = name.rsplit_once('.').map_or(name, |(s, _)| s);
        let mut near: Vec<&str> = self.names().filter(|n| n.rsplit_once('.').is_some_and(|(s, _)| s == stem)).collect();
        near.sort_unstable();
        let hint = if near.is_empty() { String::new() } else { format!(" (it has {})", near.join(", ")) };
        Error::tensor(name, format!("missing from the checkpoint {}{hint}", self.dir.display()))
    }

    /// The scheme of the stored tensors: the declared one, else the one their
    /// names show. A declaration the names contradict is an error, since the
    /// two conventions read the global scale differently.
    pub fn scheme(&self, declared: Option<Scheme>) -> Result<Scheme> {
        let find = |suffix: &str| {
            let mut v: Vec<&str> = self.names().filter(|n| n.ends_with(suffix)).collect();
            v.sort_unstable();
            v.first().map(|s| s.to_string())
        };
        let ct = find(".weight_global_scale").or_else(|| find(".weight_packed"));
        let mo = find(".weight_scale_2");
        let seen = match (&ct, &mo) {
            (Some(a), Some(b)) => {
                return Err(Error::bad_checkpoint(
                    self.dir,
                    format!("mixes compressed-tensors ({a}) and ModelOpt ({b}) NVFP4 tensors"),
                ))
            }
            (Some(a), None) => Some((Scheme::CompressedTensors, a)),
            (None, Some(b)) => Some((Scheme::Modelopt, b)),
            (None, None) => None,
        };
        match (declared, seen) {
            (Some(d), Some((s, example))) if d != s => Err(Error::bad_checkpoint(
                self.dir,
                format!("config declares {} but tensor {example} follows the {} convention", d.name(), s.name()),
            )),
            (Some(d), _) => Ok(d),
            (None, Some((s, _))) => Ok(s),
            (None, None) => Ok(Scheme::Unquantized),
        }
    }
}
