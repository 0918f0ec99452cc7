//! Hugging Face checkpoint to pack conversion (qwen3_moe, qwen3_next).
//!
//! [`convert`] reads `config.json` and the safetensors files of a checkpoint
//! directory and streams every tensor into a [`PackWriter`], one at a time
//! from memory-mapped files: the process holds about one layer of expert
//! blobs, never the whole model.
//!
//! - Unquantized checkpoints (BF16, F16 or F32): dense tensors are stored as
//!   BF16 (F16 and F32 sources are rounded to BF16, to nearest even), or, with
//!   [`DenseFormat::Nvfp4`], the roles where `Role::may_quantize` holds are
//!   quantized to NVFP4. Experts are always quantized with
//!   [`crate::quant::nvfp4::quantize`] (ModelOpt's algorithm), each matrix
//!   with its own global scale.
//! - NVFP4 checkpoints (ModelOpt, compressed-tensors `nvfp4-pack-quantized`):
//!   codes and block scales are carried over byte for byte; the global scale
//!   becomes the pack's multiplier (ModelOpt's `weight_scale_2` as is,
//!   compressed-tensors' `weight_global_scale` as `1 / value`). Tensors the
//!   checkpoint left unquantized are handled as above.
//! - Experts come as per-expert keys `model.layers.{l}.mlp.experts.{e}.
//!   {gate,up,down}_proj.weight`, or as transformers 5.x fused
//!   `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows first) and
//!   `mlp.experts.down_proj` `[E, H, I]`. Shapes are checked against the
//!   config for the key's convention, never guessed.
//! - qwen3_next: the MTP layers' experts (`mtp.layers.{j}.mlp.experts.*`)
//!   become expert layers `num_hidden_layers + j`; the shared expert's
//!   projections are NVFP4 in every pack (carried, or quantized by us with
//!   ModelOpt's algorithm, each matrix with its own global scale); `A_log`
//!   and `dt_bias` stay F32 unless the checkpoint has them in BF16. A
//!   checkpoint without any `mtp.*` tensor gives a pack without the MTP head
//!   (`mtp_num_hidden_layers` 0).
//!
//! See ../shared/design/formats-and-math.md sections 1 to 3.

mod checkpoint;
mod plan;
#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use self::checkpoint::{Checkpoint, Shards};
use self::plan::{DensePlan, ExpertPlan, FloatData, MatrixPlan, Source, CHUNK_ELEMS};
use super::format::{DType, Manifest};
use super::writer::{DenseTensor, PackWriter};
use crate::error::{Error, Result};
use crate::model::weights::layer_of_tensor;
use crate::model::ModelConfig;
use crate::quant::nvfp4::{self, Nvfp4Matrix, Nvfp4Owned, BLOCK};

/// How dense (non-expert) weights of an unquantized checkpoint are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DenseFormat {
    /// Everything BF16.
    #[default]
    Bf16,
    /// The large projections (attention, DeltaNet in/out, `mtp.fc`) and
    /// lm_head quantized to NVFP4 (`Role::may_quantize`); embeddings, norms,
    /// routers and small gates stay BF16.
    Nvfp4,
}

#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    pub dense: DenseFormat,
    /// Replace an existing pack at `out`.
    pub overwrite: bool,
    /// A progress bar over layers when stderr is a terminal, and a line about
    /// ignored checkpoint tensors.
    pub progress: bool,
}

/// Files copied from the checkpoint into the pack when present.
const EXTRA_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
];

/// Converts the checkpoint directory `from` into a pack at `out` and returns
/// its manifest. Every shape, dtype and global scale is checked before the
/// pack is created, so a bad checkpoint leaves nothing behind. The checkpoint
/// files must not change while they are read (they are memory-mapped).
pub fn convert(from: &Path, out: &Path, opts: &ConvertOptions) -> Result<Manifest> {
    if !from.is_dir() {
        return Err(Error::io(from, std::io::Error::new(std::io::ErrorKind::NotFound, "not a checkpoint directory")));
    }
    // A pack written into its own checkpoint would truncate the files it copies (tokenizer.json...).
    if let (Ok(a), Ok(b)) = (from.canonicalize(), out.canonicalize()) {
        if a == b {
            return Err(Error::InvalidArgument(format!(
                "{} is the checkpoint directory itself: write the pack to another directory",
                out.display()
            )));
        }
    }
    let cfg_path = from.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::bad_checkpoint(from, "no config.json (not a Hugging Face model directory)")
        } else {
            Error::io(&cfg_path, e)
        }
    })?;
    let mut config = ModelConfig::from_hf_json(&text, &cfg_path)?;
    let raw: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::bad_checkpoint(&cfg_path, format!("not valid JSON: {e}")))?;
    let declared = checkpoint::declared_scheme(from, &raw)?;

    let shards = Shards::open(from)?;
    let ck = Checkpoint::new(&shards)?;
    let scheme = ck.scheme(declared)?;
    // Quantized re-exports often drop the MTP head; the pack then has none.
    if let Some(n) = config.qwen3_next.as_mut().filter(|n| n.mtp_num_hidden_layers > 0) {
        if !ck.names().any(|name| name.starts_with("mtp.")) {
            if opts.progress {
                eprintln!(
                    "strata convert: config.json has mtp_num_hidden_layers {} but the checkpoint \
                     has no mtp.* tensors; the pack has no MTP head",
                    n.mtp_num_hidden_layers
                );
            }
            n.mtp_num_hidden_layers = 0;
        }
    }
    let plan = plan::plan(&ck, &config, scheme, opts.dense)?;
    if opts.progress && !plan.skipped.is_empty() {
        let examples: Vec<&str> = plan.skipped.iter().take(3).map(String::as_str).collect();
        eprintln!(
            "strata convert: ignoring {} checkpoint tensors {} does not use (e.g. {})",
            plan.skipped.len(),
            config.arch.name(),
            examples.join(", ")
        );
    }

    // Ids outside the vocabulary can never be sampled (checkpoints with a
    // cut-down vocabulary keep their parent's): dropped, with a note.
    let (eos, unreachable): (Vec<u32>, Vec<u32>) =
        eos_token_ids(from, &raw)?.into_iter().partition(|&t| (t as usize) < config.vocab_size);
    if opts.progress && !unreachable.is_empty() {
        eprintln!(
            "strata convert: ignoring end-of-generation tokens {unreachable:?}, outside the vocabulary (size {})",
            config.vocab_size
        );
    }

    let source = format!("convert {} ({})", from.display(), scheme.name());
    let mut w = PackWriter::create(out, &config, &source, opts.overwrite)?;
    w.set_eos_token_ids(&eos)?;
    let bar = (opts.progress && std::io::stderr().is_terminal()).then(|| {
        let pb = ProgressBar::new(config.num_expert_layers() as u64);
        if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} layers ({elapsed}, {eta} left)") {
            pb.set_style(style);
        }
        pb.set_message("converting");
        pb
    });

    // Dense tensors in the model's order; a layer's experts right after its
    // last dense tensor, so progress tracks the bytes written.
    let layers: Vec<Option<usize>> = plan.dense.iter().map(|d| layer_of_tensor(&config, &d.name)).collect();
    for (k, d) in plan.dense.iter().enumerate() {
        write_dense(&mut w, d)?;
        if let Some(l) = layers[k].filter(|&l| layers.get(k + 1) != Some(&Some(l))) {
            write_layer_experts(&mut w, l, &plan.experts[l])?;
            if let Some(pb) = &bar {
                pb.inc(1);
            }
        }
    }
    for name in EXTRA_FILES {
        let p = from.join(name);
        if p.is_file() {
            w.copy_file(&p)?;
        }
    }
    let manifest = w.finish()?;
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    Ok(manifest)
}

/// The tokens that end generation: `eos_token_id` (one id or a list) of
/// generation_config.json, which is what transformers' `generate` stops
/// on, else of config.json (or its `text_config`); none when neither
/// names one. A present but empty list means none (no fallback).
fn eos_token_ids(dir: &Path, config: &serde_json::Value) -> Result<Vec<u32>> {
    let parse = |v: &serde_json::Value, path: &Path| -> Result<Option<Vec<u32>>> {
        let id = |x: &serde_json::Value| x.as_u64().and_then(|x| u32::try_from(x).ok());
        let bad = || Error::bad_checkpoint(path, format!("eos_token_id {v} is not a token id or a list of them"));
        let ids = match v {
            serde_json::Value::Null => return Ok(None),
            serde_json::Value::Array(a) => a.iter().map(|x| id(x).ok_or_else(bad)).collect::<Result<Vec<u32>>>()?,
            x => vec![id(x).ok_or_else(bad)?],
        };
        let mut unique = Vec::with_capacity(ids.len());
        for t in ids {
            if !unique.contains(&t) {
                unique.push(t);
            }
        }
        Ok(Some(unique))
    };
    let gen_path = dir.join("generation_config.json");
    if gen_path.is_file() {
        let v = checkpoint::read_json(&gen_path)?;
        if let Some(ids) = v.get("eos_token_id").map(|e| parse(e, &gen_path)).transpose()?.flatten() {
            return Ok(ids);
        }
    }
    let cfg = [config, config.get("text_config").unwrap_or(&serde_json::Value::Null)]
        .into_iter()
        .find_map(|c| c.get("eos_token_id").filter(|e| !e.is_null()));
    Ok(cfg.map(|e| parse(e, &dir.join("config.json"))).transpose()?.flatten().unwrap_or_default())
}

fn write_dense(w: &mut PackWriter, d: &DensePlan<'_>) -> Result<()> {
    match (d.src, d.store) {
        (Source::Nvfp4(m), _) => {
            check_block_scales(&d.name, m.scales)?;
            w.add_tensor(&d.name, &d.shape, DenseTensor::Nvfp4(m))
        }
        (Source::Float(f), DType::Nvfp4) => {
            let q = quantize_float(f, d.shape[0], d.shape[1], &d.name, CHUNK_ELEMS)?;
            w.add_tensor(&d.name, &d.shape, DenseTensor::Nvfp4(q.view()))
        }
        (Source::Float(f), DType::F32) => w.add_tensor(&d.name, &d.shape, DenseTensor::F32(&f.to_f32())),
        (Source::Float(f), DType::Bf16) => w.add_tensor(&d.name, &d.shape, DenseTensor::Bf16(&f.to_bf16())),
    }
}

/// Builds the blobs of one layer on rayon's threads, a few per thread at a
/// time, and writes them in order; memory stays well under one layer.
fn write_layer_experts(w: &mut PackWriter, layer: usize, experts: &[ExpertPlan<'_>]) -> Result<()> {
    let group = rayon::current_num_threads().max(1) * 2;
    for (gi, chunk) in experts.chunks(group).enumerate() {
        let writer = &*w;
        let blobs = chunk
            .par_iter()
            .enumerate()
            .map(|(j, p)| {
                let (g, u, d) = (to_nvfp4(&p.gate)?, to_nvfp4(&p.up)?, to_nvfp4(&p.down)?);
                writer.expert_blob(layer, gi * group + j, g.view(), u.view(), d.view())
            })
            .collect::<Result<Vec<Vec<u8>>>>()?;
        for (j, blob) in blobs.iter().enumerate() {
            w.write_expert_blob(layer, gi * group + j, blob)?;
        }
    }
    Ok(())
}

/// An expert matrix as NVFP4: carried from the checkpoint or quantized by us.
enum Matrix<'a> {
    Carried(Nvfp4Matrix<'a>),
    Quantized(Nvfp4Owned),
}

impl Matrix<'_> {
    fn view(&self) -> Nvfp4Matrix<'_> {
        match self {
            Matrix::Carried(m) => *m,
            Matrix::Quantized(q) => q.view(),
        }
    }
}

fn to_nvfp4<'a>(m: &MatrixPlan<'a>) -> Result<Matrix<'a>> {
    match m.src {
        Source::Nvfp4(q) => {
            check_block_scales(&m.name, q.scales)?;
            Ok(Matrix::Carried(q))
        }
        Source::Float(f) => quantize_float(f, m.rows, m.cols, &m.name, CHUNK_ELEMS).map(Matrix::Quantized),
    }
}

/// E4M3 has no infinities; 0x7F and 0xFF are NaN and would poison every
/// activation the block touches.
fn check_block_scales(name: &str, scales: &[u8]) -> Result<()> {
    if let Some(i) = scales.iter().position(|&b| b & 0x7F == 0x7F) {
        return Err(Error::tensor(name, format!("NVFP4 block scale {i} is NaN (byte {:#04x})", scales[i])));
    }
    Ok(())
}

/// [`nvfp4::quantize`] of a row-major `[rows, cols]` float matrix. Matrices
/// over `chunk_elems` elements are decoded piecewise: the global scale from
/// the whole matrix's amax first, then each piece with it, which gives the
/// same bytes (blocks never straddle rows) without an f32 copy of the matrix.
fn quantize_float(f: FloatData<'_>, rows: usize, cols: usize, name: &str, chunk_elems: usize) -> Result<Nvfp4Owned> {
    debug_assert!(cols % BLOCK == 0 && f.len() == rows * cols);
    let non_finite = || Error::tensor(name, "holds NaN or infinite values; cannot quantize it");
    let rows_per = (chunk_elems / cols).max(1);
    if rows <= rows_per {
        let mut w = vec![0.0f32; rows * cols];
        f.decode(0, &mut w);
        if !w.iter().all(|x| x.is_finite()) {
            return Err(non_finite());
        }
        return Ok(nvfp4::quantize(&w, rows, cols));
    }
    let mut buf = vec![0.0f32; rows_per * cols];
    let mut amax = 0.0f32;
    for r0 in (0..rows).step_by(rows_per) {
        let n = (rows - r0).min(rows_per) * cols;
        f.decode(r0 * cols, &mut buf[..n]);
        for &x in &buf[..n] {
            if !x.is_finite() {
                return Err(non_finite());
            }
            amax = amax.max(x.abs());
        }
    }
    let global_scale = nvfp4::global_scale_for_amax(amax);
    let mut codes = Vec::with_capacity(rows * cols / 2);
    let mut scales = Vec::with_capacity(rows * cols / BLOCK);
    for r0 in (0..rows).step_by(rows_per) {
        let nr = (rows - r0).min(rows_per);
        f.decode(r0 * cols, &mut buf[..nr * cols]);
        let q = nvfp4::quantize_with_global(&buf[..nr * cols], nr, cols, global_scale);
        codes.extend_from_slice(&q.codes);
        scales.extend_from_slice(&q.scales);
    }
    Ok(Nvfp4Owned { rows, cols, codes, scales, global_scale })
}
