//! Streaming pack writer: dense tensors are appended, expert blobs are written
//! at their final offsets in any order, and the manifest is written last.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::format::*;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::quant::Nvfp4Matrix;

/// A dense tensor's bytes as handed to the writer.
pub enum DenseTensor<'a> {
    /// Little-endian F32 bytes.
    F32(&'a [u8]),
    /// Little-endian BF16 bytes.
    Bf16(&'a [u8]),
    /// A 2-D NVFP4 matrix with its global scale.
    Nvfp4(Nvfp4Matrix<'a>),
}

pub struct PackWriter {
    dir: PathBuf,
    config: ModelConfig,
    source: String,
    layout: ExpertLayout,
    dense: BufWriter<File>,
    dense_pos: u64,
    experts: File,
    tensors: Vec<TensorEntry>,
    expert_entries: Vec<Option<ExpertEntry>>,
    extra_files: Vec<FileEntry>,
    eos_token_ids: Vec<u32>,
}

impl PackWriter {
    /// Creates `dir` (or reuses an empty one). An existing pack is replaced
    /// only when `overwrite` is set; its manifest is removed first so that a
    /// failure midway never leaves a pack that looks complete.
    pub fn create(dir: &Path, config: &ModelConfig, source: &str, overwrite: bool) -> Result<Self> {
        config.validate()?;
        if dir.exists() {
            let manifest = dir.join(MANIFEST_FILE);
            if manifest.exists() {
                if !overwrite {
                    return Err(Error::InvalidArgument(format!(
                        "{} already holds a pack (use --force to replace it)",
                        dir.display()
                    )));
                }
                fs::remove_file(&manifest).map_err(|e| Error::io(&manifest, e))?;
            } else if fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.next().is_some() && !overwrite {
                return Err(Error::InvalidArgument(format!(
                    "{} exists and is not empty (use --force to write into it)",
                    dir.display()
                )));
            }
        }
        fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let dense_path = dir.join(DENSE_FILE);
        let experts_path = dir.join(EXPERTS_FILE);
        let mut dense =
            BufWriter::with_capacity(8 << 20, File::create(&dense_path).map_err(|e| Error::io(&dense_path, e))?);
        dense.write_all(&bin_header(DENSE_MAGIC)).map_err(|e| Error::io(&dense_path, e))?;
        let experts = File::create(&experts_path).map_err(|e| Error::io(&experts_path, e))?;
        experts.write_all_at(&bin_header(EXPERTS_MAGIC), 0).map_err(|e| Error::io(&experts_path, e))?;
        let layout = ExpertLayout::for_config(config);
        // MTP layers' experts follow the main layers' (docs/pack-format.md).
        let n = config.num_expert_layers() * config.num_experts;
        Ok(Self {
            dir: dir.to_path_buf(),
            config: config.clone(),
            source: source.to_string(),
            layout,
            dense,
            dense_pos: HEADER_LEN,
            experts,
            tensors: Vec::new(),
            expert_entries: vec![None; n],
            extra_files: Vec::new(),
            eos_token_ids: Vec::new(),
        })
    }

    /// The tokens that end generation, recorded in the manifest.
    pub fn set_eos_token_ids(&mut self, ids: &[u32]) -> Result<()> {
        check_eos_token_ids(ids, self.config.vocab_size).map_err(Error::InvalidArgument)?;
        self.eos_token_ids = ids.to_vec();
        Ok(())
    }

    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }

    fn dense_path(&self) -> PathBuf {
        self.dir.join(DENSE_FILE)
    }

    fn write_dense_aligned(&mut self, bytes: &[u8]) -> Result<u64> {
        let start = align_up(self.dense_pos, DENSE_ALIGN);
        let pad = (start - self.dense_pos) as usize;
        let path = self.dense_path();
        self.dense
            .write_all(&[0u8; DENSE_ALIGN as usize][..pad])
            .and_then(|_| self.dense.write_all(bytes))
            .map_err(|e| Error::io(path, e))?;
        self.dense_pos = start + bytes.len() as u64;
        Ok(start)
    }

    /// Appends a dense tensor. `shape` is checked against the byte count.
    pub fn add_tensor(&mut self, name: &str, shape: &[usize], data: DenseTensor<'_>) -> Result<()> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(Error::tensor(name, "written twice"));
        }
        let numel: u64 = shape.iter().map(|&d| d as u64).product();
        let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let entry = match data {
            DenseTensor::F32(b) | DenseTensor::Bf16(b) => {
                let dtype = if matches!(data, DenseTensor::F32(_)) { DType::F32 } else { DType::Bf16 };
                if b.len() as u64 != dtype.payload_len(numel) {
                    return Err(Error::tensor(
                        name,
                        format!("{} bytes do not match shape {shape:?} in {dtype:?}", b.len()),
                    ));
                }
                let offset = self.write_dense_aligned(b)?;
                TensorEntry {
                    name: name.to_string(),
                    dtype,
                    shape: shape64,
                    offset,
                    nbytes: b.len() as u64,
                    scales_offset: None,
                    global_scale: None,
                    crc32: crc32fast::hash(b),
                }
            }
            DenseTensor::Nvfp4(m) => {
                if shape.len() != 2 || shape[0] != m.rows || shape[1] != m.cols {
                    return Err(Error::tensor(
                        name,
                        format!("NVFP4 matrix [{}, {}] does not match shape {shape:?}", m.rows, m.cols),
                    ));
                }
                let m = Nvfp4Matrix::new(m.rows, m.cols, m.codes, m.scales, m.global_scale, name)?;
                let offset = self.write_dense_aligned(m.codes)?;
                let scales_offset = self.write_dense_aligned(m.scales)?;
                let mut h = crc32fast::Hasher::new();
                h.update(m.codes);
                h.update(m.scales);
                TensorEntry {
                    name: name.to_string(),
                    dtype: DType::Nvfp4,
                    shape: shape64,
                    offset,
                    nbytes: m.codes.len() as u64,
                    scales_offset: Some(scales_offset),
                    global_scale: Some(m.global_scale),
                    crc32: h.finalize(),
                }
            }
        };
        self.tensors.push(entry);
        Ok(())
    }

    /// Writes the blob of (layer, expert): gate and up `[I, H]`, down `[H, I]`,
    /// each with its own global scale.
    pub fn add_expert(
        &mut self,
        layer: usize,
        expert: usize,
        gate: Nvfp4Matrix<'_>,
        up: Nvfp4Matrix<'_>,
        down: Nvfp4Matrix<'_>,
    ) -> Result<()> {
        let blob = self.expert_blob(layer, expert, gate, up, down)?;
        self.write_expert_blob(layer, expert, &blob)
    }

    /// Assembles a blob in memory (used by [`Self::add_expert`]; callers that
    /// build blobs on several threads call this, then `write_expert_blob`).
    pub fn expert_blob(
        &self,
        layer: usize,
        expert: usize,
        gate: Nvfp4Matrix<'_>,
        up: Nvfp4Matrix<'_>,
        down: Nvfp4Matrix<'_>,
    ) -> Result<Vec<u8>> {
        let l = &self.layout;
        let (h, i) = (l.hidden as usize, l.intermediate as usize);
        let what = |m: &str| format!("layer {layer} expert {expert} {m}");
        for (m, name, rows, cols) in [(&gate, "gate", i, h), (&up, "up", i, h), (&down, "down", h, i)] {
            if m.rows != rows || m.cols != cols {
                return Err(Error::tensor(
                    what(name),
                    format!("shape [{}, {}], the config needs [{rows}, {cols}]", m.rows, m.cols),
                ));
            }
            Nvfp4Matrix::new(m.rows, m.cols, m.codes, m.scales, m.global_scale, &what(name))?;
        }
        let mut blob = vec![0u8; l.used_len() as usize];
        let mut put = |off: u64, b: &[u8]| blob[off as usize..off as usize + b.len()].copy_from_slice(b);
        put(l.gate_codes, gate.codes);
        put(l.gate_scales, gate.scales);
        put(l.up_codes, up.codes);
        put(l.up_scales, up.scales);
        put(l.down_codes, down.codes);
        put(l.down_scales, down.scales);
        let mut tail = [0u8; TAIL_LEN as usize];
        tail[0..4].copy_from_slice(&gate.global_scale.to_le_bytes());
        tail[4..8].copy_from_slice(&up.global_scale.to_le_bytes());
        tail[8..12].copy_from_slice(&down.global_scale.to_le_bytes());
        put(l.tail, &tail);
        Ok(blob)
    }

    /// Writes an assembled blob (exactly `layout.used_len()` bytes) at its
    /// offset. `layer` counts the main layers, then the MTP layers.
    pub fn write_expert_blob(&mut self, layer: usize, expert: usize, blob: &[u8]) -> Result<()> {
        let c = &self.config;
        if layer >= c.num_expert_layers() || expert >= c.num_experts {
            return Err(Error::InvalidArgument(format!(
                "expert ({layer}, {expert}) is outside {} layers x {} experts",
                c.num_expert_layers(),
                c.num_experts
            )));
        }
        if blob.len() as u64 != self.layout.used_len() {
            return Err(Error::InvalidArgument(format!(
                "expert blob is {} bytes, the layout needs {}",
                blob.len(),
                self.layout.used_len()
            )));
        }
        let idx = layer * c.num_experts + expert;
        if self.expert_entries[idx].is_some() {
            return Err(Error::tensor(format!("layer {layer} expert {expert}"), "written twice"));
        }
        let offset = self.layout.blob_offset(c.num_experts, layer, expert);
        let path = self.dir.join(EXPERTS_FILE);
        self.experts.write_all_at(blob, offset).map_err(|e| Error::io(&path, e))?;
        self.expert_entries[idx] =
            Some(ExpertEntry { layer: layer as u32, expert: expert as u32, offset, crc32: crc32fast::hash(blob) });
        Ok(())
    }

    /// Copies an extra file (tokenizer.json and friends) into the pack.
    pub fn copy_file(&mut self, src: &Path) -> Result<()> {
        let name = src
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::InvalidArgument(format!("{}: not a file name", src.display())))?
            .to_string();
        let dst = self.dir.join(&name);
        // A file onto itself is left as it is (a copy would truncate it first).
        let same = matches!((src.canonicalize(), dst.canonicalize()), (Ok(a), Ok(b)) if a == b);
        let size = if same {
            fs::metadata(src).map_err(|e| Error::io(src, e))?.len()
        } else {
            fs::copy(src, &dst).map_err(|e| Error::io(src, e))?
        };
        self.extra_files.retain(|f| f.name != name);
        self.extra_files.push(FileEntry { name, size });
        Ok(())
    }

    /// Checks that every tensor the model needs was written, pads the files
    /// and writes the manifest. Returns the manifest.
    pub fn finish(mut self) -> Result<Manifest> {
        let c = &self.config;
        let missing: Vec<String> = self
            .expert_entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_none())
            .take(3)
            .map(|(i, _)| format!("layer {} expert {}", i / c.num_experts, i % c.num_experts))
            .collect();
        if !missing.is_empty() {
            return Err(Error::InvalidArgument(format!("pack is missing expert blobs: {}", missing.join(", "))));
        }
        for (name, shape, role) in crate::model::weights::required_dense_tensors(c) {
            let Some(t) = self.tensors.iter().find(|t| t.name == name) else {
                return Err(Error::tensor(name, "required by the model but was not written"));
            };
            if !t.shape.iter().map(|&d| d as usize).eq(shape.iter().copied()) {
                return Err(Error::tensor(
                    name,
                    format!("written with shape {:?}, the config needs {shape:?}", t.shape),
                ));
            }
            if t.dtype == DType::Nvfp4 && !role.is_linear() {
                return Err(Error::tensor(name, "only linear weights may be NVFP4"));
            }
        }
        let dense_path = self.dense_path();
        // Pad dense.bin so the last tensor's alignment region is whole.
        let end = align_up(self.dense_pos, DENSE_ALIGN);
        let pad = (end - self.dense_pos) as usize;
        self.dense.write_all(&vec![0u8; pad]).map_err(|e| Error::io(&dense_path, e))?;
        self.dense_pos = end;
        let dense_file = self.dense.into_inner().map_err(|e| Error::io(&dense_path, e.into_error()))?;
        dense_file.sync_all().map_err(|e| Error::io(&dense_path, e))?;

        let experts_path = self.dir.join(EXPERTS_FILE);
        let experts_len = HEADER_LEN + (c.num_expert_layers() * c.num_experts) as u64 * self.layout.stride;
        self.experts.set_len(experts_len).map_err(|e| Error::io(&experts_path, e))?;
        self.experts.sync_all().map_err(|e| Error::io(&experts_path, e))?;

        let mut files = vec![
            FileEntry { name: DENSE_FILE.into(), size: self.dense_pos },
            FileEntry { name: EXPERTS_FILE.into(), size: experts_len },
        ];
        files.extend(self.extra_files.iter().cloned());
        let manifest = Manifest {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            arch: c.arch.name().into(),
            config: c.clone(),
            source: self.source.clone(),
            eos_token_ids: self.eos_token_ids.clone(),
            dense_file: DENSE_FILE.into(),
            tensors: std::mem::take(&mut self.tensors),
            experts: ExpertTable {
                file: EXPERTS_FILE.into(),
                layout: self.layout,
                entries: self.expert_entries.iter().map(|e| e.clone().expect("checked above")).collect(),
            },
            files,
        };
        let text = serde_json::to_string_pretty(&manifest)
            .map_err(|e| Error::InvalidArgument(format!("manifest serialization: {e}")))?;
        let path = self.dir.join(MANIFEST_FILE);
        let tmp = self.dir.join("manifest.json.tmp");
        fs::write(&tmp, text).map_err(|e| Error::io(&tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        Ok(manifest)
    }
}
