//! Zero-copy pack reader over memory-mapped files. Opening validates the
//! manifest against the files (bounds, sizes, headers, the model's tensor
//! list); `verify` additionally recomputes every checksum.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::format::*;
use crate::error::{Error, Result};
use crate::model::weights::required_dense_tensors;
use crate::model::{Arch, ModelConfig};
use crate::quant::{bf16_bytes_to_f32, f32_bytes_to_f32, Nvfp4Matrix};

pub struct Pack {
    dir: PathBuf,
    manifest: Manifest,
    by_name: HashMap<String, usize>,
    dense: Mmap,
    experts: Mmap,
}

/// A dense tensor's bytes, borrowed from the mapped file.
#[derive(Clone, Copy, Debug)]
pub enum TensorData<'a> {
    F32(&'a [u8]),
    Bf16(&'a [u8]),
    Nvfp4(Nvfp4Matrix<'a>),
}

#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub shape: &'a [u64],
    pub data: TensorData<'a>,
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }

    /// The tensor in f32, dequantizing as needed.
    pub fn to_f32(&self) -> Vec<f32> {
        match self.data {
            TensorData::F32(b) => {
                let mut v = vec![0.0; self.numel()];
                f32_bytes_to_f32(b, &mut v);
                v
            }
            TensorData::Bf16(b) => {
                let mut v = vec![0.0; self.numel()];
                bf16_bytes_to_f32(b, &mut v);
                v
            }
            TensorData::Nvfp4(m) => m.dequantize(),
        }
    }
}

/// One expert's three NVFP4 matrices, each carrying its own global scale
/// (read from the blob tail), and the blob bytes for device copies.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    pub gate: Nvfp4Matrix<'a>,
    pub up: Nvfp4Matrix<'a>,
    pub down: Nvfp4Matrix<'a>,
    /// The whole blob (`layout.used_len()` bytes), as a GPU slot holds it.
    pub blob: &'a [u8],
}

impl<'a> ExpertView<'a> {
    /// One blob as laid out in experts.bin (docs/pack-format.md), wherever
    /// its bytes are: the mapped pack, a cache slot or a host buffer.
    /// `blob` is the blob's first `layout.used_len()` bytes (or more);
    /// `what` names it in errors ("layer 3 expert 7 in ...").
    pub fn from_blob(l: &ExpertLayout, blob: &'a [u8], what: &str) -> Result<ExpertView<'a>> {
        let used = l.used_len() as usize;
        if blob.len() < used {
            return Err(Error::InvalidArgument(format!(
                "{what}: blob of {} bytes, the layout needs {used}",
                blob.len()
            )));
        }
        let blob = &blob[..used];
        let tail = &blob[l.tail as usize..(l.tail + TAIL_LEN) as usize];
        let g = |i: usize| f32::from_le_bytes(tail[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let sec = |o: u64, n: u64| &blob[o as usize..(o + n) as usize];
        let (h, i) = (l.hidden as usize, l.intermediate as usize);
        let (cl, sl) = (l.codes_len(), l.scales_len());
        let m = |name: &str| format!("{what}: {name}");
        Ok(ExpertView {
            gate: Nvfp4Matrix::new(i, h, sec(l.gate_codes, cl), sec(l.gate_scales, sl), g(0), &m("gate"))?,
            up: Nvfp4Matrix::new(i, h, sec(l.up_codes, cl), sec(l.up_scales, sl), g(1), &m("up"))?,
            down: Nvfp4Matrix::new(h, i, sec(l.down_codes, cl), sec(l.down_scales, sl), g(2), &m("down"))?,
            blob,
        })
    }
}

fn map(path: &Path) -> Result<Mmap> {
    let f = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the pack is never modified while mapped (packs are write-once;
    // invariant 5 of the architecture), so the mapping's bytes are stable.
    unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

fn check_header(path: &Path, bytes: &[u8], magic: [u8; 8]) -> Result<()> {
    if bytes.len() < HEADER_LEN as usize {
        return Err(Error::bad_pack(
            path,
            format!("file is {} bytes, shorter than its {HEADER_LEN}-byte header", bytes.len()),
        ));
    }
    if bytes[..8] != magic {
        return Err(Error::bad_pack(
            path,
            format!(
                "wrong magic {:?}, expected {:?}",
                String::from_utf8_lossy(&bytes[..8]),
                String::from_utf8_lossy(&magic)
            ),
        ));
    }
    let v = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if v != FORMAT_VERSION {
        return Err(Error::PackVersion { path: path.to_path_buf(), found: v, supported: FORMAT_VERSION });
    }
    Ok(())
}

impl Pack {
    /// Opens and validates a pack directory.
    pub fn open(dir: &Path) -> Result<Pack> {
        let mpath = dir.join(MANIFEST_FILE);
        if !dir.is_dir() {
            return Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "no such pack directory")));
        }
        let text = match std::fs::read_to_string(&mpath) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::bad_pack(dir, "no manifest.json (not a pack, or an incomplete one)"))
            }
            Err(e) => return Err(Error::io(&mpath, e)),
        };
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::bad_pack(&mpath, format!("malformed JSON: {e}")))?;
        if raw.get("format").and_then(|v| v.as_str()) != Some(FORMAT_NAME) {
            return Err(Error::bad_pack(&mpath, format!("format is not {FORMAT_NAME:?}")));
        }
        let version = raw.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if version != FORMAT_VERSION {
            return Err(Error::PackVersion { path: mpath, found: version, supported: FORMAT_VERSION });
        }
        // The reader validates every architecture the format describes;
        // whether a backend runs it is the engine's decision.
        let arch = raw.get("arch").and_then(|v| v.as_str()).unwrap_or("").to_string();
        if ![Arch::Qwen3Moe, Arch::Qwen3Next].iter().any(|a| a.name() == arch) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch:?} (packs hold qwen3_moe or qwen3_next)",
                mpath.display()
            )));
        }
        let manifest: Manifest =
            serde_json::from_value(raw).map_err(|e| Error::bad_pack(&mpath, format!("malformed manifest: {e}")))?;
        if manifest.config.arch.name() != arch {
            return Err(Error::bad_pack(
                &mpath,
                format!("arch {arch:?} differs from config.arch {:?}", manifest.config.arch.name()),
            ));
        }
        manifest.config.validate().map_err(|e| Error::bad_pack(&mpath, e.to_string()))?;

        let dense_path = dir.join(&manifest.dense_file);
        let experts_path = dir.join(&manifest.experts.file);
        let dense = map(&dense_path)?;
        let experts = map(&experts_path)?;
        check_header(&dense_path, &dense, DENSE_MAGIC)?;
        check_header(&experts_path, &experts, EXPERTS_MAGIC)?;
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let len = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?.len();
            if len != f.size {
                return Err(Error::bad_pack(
                    &p,
                    format!("file is {len} bytes, the manifest says {} (truncated?)", f.size),
                ));
            }
        }

        let mut pack = Pack { dir: dir.to_path_buf(), manifest, by_name: HashMap::new(), dense, experts };
        pack.validate_tables()?;
        Ok(pack)
    }

    fn validate_tables(&mut self) -> Result<()> {
        let m = &self.manifest;
        let c = &m.config;
        let dense_path = self.dir.join(&m.dense_file);
        let dense_len = self.dense.len() as u64;
        let in_bounds = |off: u64, len: u64| off.checked_add(len).is_some_and(|e| e <= dense_len) && off >= HEADER_LEN;
        for (i, t) in m.tensors.iter().enumerate() {
            let bad = |msg: String| Error::bad_pack(&dense_path, format!("tensor {}: {msg}", t.name));
            // Checked first: every later product of the shape relies on it.
            // No dtype stores more than two elements a byte.
            let numel = t.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
            if numel.is_none_or(|n| n > dense_len.saturating_mul(2)) {
                return Err(bad(format!("shape {:?} holds more than two elements per byte of the file", t.shape)));
            }
            if t.nbytes != t.dtype.payload_len(t.numel()) {
                return Err(bad(format!("{} bytes do not match shape {:?} in {:?}", t.nbytes, t.shape, t.dtype)));
            }
            if !in_bounds(t.offset, t.nbytes) {
                return Err(bad(format!("bytes {}..+{} lie outside the file ({dense_len} bytes)", t.offset, t.nbytes)));
            }
            if t.dtype == DType::Nvfp4 {
                let (Some(so), Some(g)) = (t.scales_offset, t.global_scale) else {
                    return Err(bad("NVFP4 tensor without scales_offset or global_scale".into()));
                };
                if t.shape.len() != 2 || t.shape[1] % 16 != 0 {
                    return Err(bad(format!(
                        "NVFP4 tensor must be 2-D with a multiple of 16 columns, shape {:?}",
                        t.shape
                    )));
                }
                if !in_bounds(so, t.numel() / 16) {
                    return Err(bad("block scales lie outside the file".into()));
                }
                if !(g.is_finite() && g > 0.0) {
                    return Err(bad(format!("global scale {g} is not positive and finite")));
                }
            }
            if self.by_name.insert(t.name.clone(), i).is_some() {
                return Err(bad("listed twice".into()));
            }
        }
        check_eos_token_ids(&m.eos_token_ids, c.vocab_size)
            .map_err(|msg| Error::bad_pack(self.dir.join(MANIFEST_FILE), msg))?;
        for (name, shape, role) in required_dense_tensors(c) {
            let Some(&i) = self.by_name.get(&name) else {
                return Err(Error::bad_pack(&dense_path, format!("tensor {name} is missing")));
            };
            let got: Vec<usize> = m.tensors[i].shape.iter().map(|&d| d as usize).collect();
            if got != shape {
                return Err(Error::bad_pack(
                    &dense_path,
                    format!("tensor {name} has shape {got:?}, the config needs {shape:?}"),
                ));
            }
            if m.tensors[i].dtype == DType::Nvfp4 && !role.is_linear() {
                return Err(Error::bad_pack(
                    &dense_path,
                    format!("tensor {name} is NVFP4, which only linear weights may be"),
                ));
            }
        }

        let experts_path = self.dir.join(&m.experts.file);
        let layout = ExpertLayout::for_config(c);
        if m.experts.layout != layout {
            return Err(Error::bad_pack(
                &experts_path,
                "expert layout in the manifest differs from the one the config implies",
            ));
        }
        let n = c.num_expert_layers() * c.num_experts;
        if m.experts.entries.len() != n {
            return Err(Error::bad_pack(
                &experts_path,
                format!("{} expert entries, the config needs {n}", m.experts.entries.len()),
            ));
        }
        for (i, e) in m.experts.entries.iter().enumerate() {
            let (l, x) = (i / c.num_experts, i % c.num_experts);
            if e.layer as usize != l || e.expert as usize != x || e.offset != layout.blob_offset(c.num_experts, l, x) {
                return Err(Error::bad_pack(&experts_path, format!("expert entry {i} is out of order or misplaced")));
            }
        }
        let need = HEADER_LEN + n as u64 * layout.stride;
        if (self.experts.len() as u64) < need {
            return Err(Error::bad_pack(
                &experts_path,
                format!("file is {} bytes, {need} are needed (truncated?)", self.experts.len()),
            ));
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn config(&self) -> &ModelConfig {
        &self.manifest.config
    }

    pub fn layout(&self) -> ExpertLayout {
        self.manifest.experts.layout
    }

    fn entry_bytes(&self, t: &TensorEntry) -> (&[u8], Option<&[u8]>) {
        let p = &self.dense[t.offset as usize..(t.offset + t.nbytes) as usize];
        let s = t.scales_offset.map(|so| &self.dense[so as usize..(so + t.numel() / 16) as usize]);
        (p, s)
    }

    /// A dense tensor by name (all bounds were checked at open).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i =
            self.by_name.get(name).ok_or_else(|| Error::tensor(name, format!("not in pack {}", self.dir.display())))?;
        let t = &self.manifest.tensors[i];
        let (payload, scales) = self.entry_bytes(t);
        let data = match t.dtype {
            DType::F32 => TensorData::F32(payload),
            DType::Bf16 => TensorData::Bf16(payload),
            DType::Nvfp4 => TensorData::Nvfp4(Nvfp4Matrix::new(
                t.shape[0] as usize,
                t.shape[1] as usize,
                payload,
                scales.expect("checked at open"),
                t.global_scale.expect("checked at open"),
                &t.name,
            )?),
        };
        Ok(TensorView { name: &t.name, shape: &t.shape, data })
    }

    /// The blob of (layer, expert) with its three matrices and global scales.
    /// `layer` counts the main layers, then the MTP layers: MTP layer `j` is
    /// `num_hidden_layers + j`.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<ExpertView<'_>> {
        let c = self.config();
        if layer >= c.num_expert_layers() || expert >= c.num_experts {
            return Err(Error::InvalidArgument(format!(
                "expert ({layer}, {expert}) is outside {} layers x {} experts",
                c.num_expert_layers(),
                c.num_experts
            )));
        }
        let l = self.layout();
        let off = l.blob_offset(c.num_experts, layer, expert) as usize;
        let blob = &self.experts[off..off + l.used_len() as usize];
        let what = format!("layer {layer} expert {expert} in {}", self.dir.join(EXPERTS_FILE).display());
        ExpertView::from_blob(&l, blob, &what)
    }

    /// The blobs of every expert of `layer`, as stored: `num_experts`
    /// blobs at the layout's stride (padding included), ready for one copy
    /// to a device.
    pub fn expert_layer_bytes(&self, layer: usize) -> Result<&[u8]> {
        let c = self.config();
        if layer >= c.num_expert_layers() {
            return Err(Error::InvalidArgument(format!(
                "expert layer {layer} is outside the pack's {} expert layers",
                c.num_expert_layers()
            )));
        }
        let l = self.layout();
        let off = l.blob_offset(c.num_experts, layer, 0) as usize;
        Ok(&self.experts[off..off + c.num_experts * l.stride as usize])
    }

    /// Recomputes every checksum. `progress` is called with (done, total) bytes.
    pub fn verify(&self, mut progress: impl FnMut(u64, u64)) -> Result<()> {
        self.verify_with(|done, total| {
            progress(done, total);
            true
        })
    }

    /// `verify` that can be cancelled: `progress` returning false stops it
    /// with `Error::Cancelled`.
    pub fn verify_with(&self, mut progress: impl FnMut(u64, u64) -> bool) -> Result<()> {
        let m = &self.manifest;
        let total: u64 =
            m.tensors.iter().map(|t| t.nbytes).sum::<u64>() + m.experts.entries.len() as u64 * self.layout().used_len();
        let mut done = 0;
        let dense_path = self.dir.join(&m.dense_file);
        for t in &m.tensors {
            let (p, s) = self.entry_bytes(t);
            let mut h = crc32fast::Hasher::new();
            h.update(p);
            if let Some(s) = s {
                h.update(s);
            }
            let actual = h.finalize();
            if actual != t.crc32 {
                return Err(Error::Checksum {
                    path: dense_path,
                    what: format!("tensor {}", t.name),
                    expected: t.crc32,
                    actual,
                });
            }
            done += t.nbytes;
            if !progress(done, total) {
                return Err(Error::Cancelled);
            }
        }
        let experts_path = self.dir.join(&m.experts.file);
        let used = self.layout().used_len() as usize;
        for e in &m.experts.entries {
            let blob = &self.experts[e.offset as usize..e.offset as usize + used];
            let actual = crc32fast::hash(blob);
            if actual != e.crc32 {
                return Err(Error::Checksum {
                    path: experts_path,
                    what: format!("layer {} expert {}", e.layer, e.expert),
                    expected: e.crc32,
                    actual,
                });
            }
            done += used as u64;
            if !progress(done, total) {
                return Err(Error::Cancelled);
            }
        }
        Ok(())
    }

    /// `tokenizer.json` inside the pack, if one was copied in.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        self.manifest.files.iter().any(|f| f.name == "tokenizer.json").then_some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::synth::{preset, synth, SynthOptions};

    fn edit_manifest(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
        let p = dir.join(MANIFEST_FILE);
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
    }

    fn open_err(dir: &Path) -> String {
        Pack::open(dir).err().expect("the pack should not open").to_string()
    }

    #[test]
    fn qwen3_next_pack_validation() {
        let d = tempfile::tempdir().unwrap();
        let c = preset(Arch::Qwen3Next, "tiny").unwrap();
        let dir = d.path().join("p");
        synth(&c, &dir, &SynthOptions::default()).unwrap();
        let p = Pack::open(&dir).unwrap();
        // MTP layer 0's experts are layer num_hidden_layers.
        assert_eq!(p.expert(4, 3).unwrap().blob.len() as u64, p.layout().used_len());
        let e = p.expert(5, 0).unwrap_err().to_string();
        assert!(e.contains("5 layers x 8 experts"), "{e}");
        drop(p);

        let copy = |name: &str| {
            let to = d.path().join(name);
            std::fs::create_dir(&to).unwrap();
            for f in std::fs::read_dir(&dir).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
            }
            to
        };
        let p = copy("arch");
        edit_manifest(&p, |v| v["arch"] = "qwen3_moe".into());
        assert!(open_err(&p).contains("differs from config.arch"));

        let p = copy("entries");
        edit_manifest(&p, |v| {
            v["experts"]["entries"].as_array_mut().unwrap().truncate(32);
        });
        assert!(open_err(&p).contains("32 expert entries, the config needs 40"));

        let p = copy("mtp");
        edit_manifest(&p, |v| v["config"]["qwen3_next"]["mtp_num_hidden_layers"] = 2.into());
        assert!(open_err(&p).contains("mtp.layers.1."));

        let p = copy("nvfp4-embedding");
        edit_manifest(&p, |v| {
            let t = v["tensors"].as_array_mut().unwrap().iter_mut().find(|t| t["name"] == "model.embed_tokens.weight");
            let t = t.unwrap();
            let numel = 384 * 64;
            t["dtype"] = "nvfp4".into();
            t["nbytes"] = (numel / 2).into();
            t["scales_offset"] = t["offset"].clone();
            t["global_scale"] = 1.0.into();
        });
        let e = open_err(&p);
        assert!(e.contains("model.embed_tokens.weight is NVFP4"), "{e}");
    }
}
