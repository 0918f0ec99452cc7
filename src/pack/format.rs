//! Byte-level definitions shared by the pack reader and writer. Every offset
//! computation lives here, once.

use serde::{Deserialize, Serialize};

use crate::model::ModelConfig;
use crate::quant::nvfp4::BLOCK;

/// The pack format version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// `manifest.json`'s `format` field.
pub const FORMAT_NAME: &str = "strata-pack";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const DENSE_FILE: &str = "dense.bin";
pub const EXPERTS_FILE: &str = "experts.bin";

/// Both .bin files begin with one header page; data starts at this offset.
pub const HEADER_LEN: u64 = 4096;
pub const DENSE_MAGIC: [u8; 8] = *b"STRATADN";
pub const EXPERTS_MAGIC: [u8; 8] = *b"STRATAEX";
/// Dense tensors (and the scales of NVFP4 dense tensors) start on this boundary.
pub const DENSE_ALIGN: u64 = 256;
/// Sections inside an expert blob start on this boundary (coalesced GPU loads).
pub const SECTION_ALIGN: u64 = 256;
/// Expert blobs start on page boundaries (page-granular mmap, DMA).
pub const BLOB_ALIGN: u64 = 4096;
/// The blob tail: FP32 global scales of gate, up, down, then a zero u32.
pub const TAIL_LEN: u64 = 16;

pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The 4096-byte header of a .bin file: magic (8 bytes), format version (u32
/// LE), zero padding.
pub fn bin_header(magic: [u8; 8]) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_LEN as usize];
    h[..8].copy_from_slice(&magic);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    Nvfp4,
}

impl DType {
    /// Bytes of the main payload for `n` elements (codes only for NVFP4).
    pub fn payload_len(self, n: u64) -> u64 {
        match self {
            DType::F32 => n * 4,
            DType::Bf16 => n * 2,
            DType::Nvfp4 => n / 2,
        }
    }
}

/// One dense tensor in dense.bin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub dtype: DType,
    /// Row-major shape, outermost first (`[out, in]` for a linear weight).
    pub shape: Vec<u64>,
    /// Absolute offset in dense.bin of the payload (codes for NVFP4).
    pub offset: u64,
    pub nbytes: u64,
    /// NVFP4 only: absolute offset of the E4M3 block scales `[rows, cols/16]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales_offset: Option<u64>,
    /// NVFP4 only: the FP32 global scale, a multiplier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_scale: Option<f32>,
    /// CRC-32 (IEEE) of the payload followed by the scales, if any.
    pub crc32: u32,
}

impl TensorEntry {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Where each part of an expert blob lives, relative to the blob start.
/// gate and up are `[moe_intermediate, hidden]`, down is `[hidden, moe_intermediate]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLayout {
    pub hidden: u64,
    pub intermediate: u64,
    pub gate_codes: u64,
    pub gate_scales: u64,
    pub up_codes: u64,
    pub up_scales: u64,
    pub down_codes: u64,
    pub down_scales: u64,
    pub tail: u64,
    /// Bytes from one blob's start to the next (a multiple of 4096).
    pub stride: u64,
}

impl ExpertLayout {
    pub fn new(hidden: u64, intermediate: u64) -> Self {
        let codes = hidden * intermediate / 2;
        let scales = hidden * intermediate / BLOCK as u64;
        let a = |x| align_up(x, SECTION_ALIGN);
        let gate_codes = 0;
        let gate_scales = a(gate_codes + codes);
        let up_codes = a(gate_scales + scales);
        let up_scales = a(up_codes + codes);
        let down_codes = a(up_scales + scales);
        let down_scales = a(down_codes + codes);
        let tail = a(down_scales + scales);
        let stride = align_up(tail + TAIL_LEN, BLOB_ALIGN);
        Self {
            hidden,
            intermediate,
            gate_codes,
            gate_scales,
            up_codes,
            up_scales,
            down_codes,
            down_scales,
            tail,
            stride,
        }
    }

    pub fn for_config(c: &ModelConfig) -> Self {
        Self::new(c.hidden_size as u64, c.moe_intermediate_size as u64)
    }

    pub fn codes_len(&self) -> u64 {
        self.hidden * self.intermediate / 2
    }

    pub fn scales_len(&self) -> u64 {
        self.hidden * self.intermediate / BLOCK as u64
    }

    /// Bytes of a blob that carry data (the CRC covers exactly these).
    pub fn used_len(&self) -> u64 {
        self.tail + TAIL_LEN
    }

    /// Absolute offset in experts.bin of blob (layer, expert).
    pub fn blob_offset(&self, num_experts: usize, layer: usize, expert: usize) -> u64 {
        HEADER_LEN + (layer as u64 * num_experts as u64 + expert as u64) * self.stride
    }
}

/// One (layer, expert) blob in experts.bin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertEntry {
    pub layer: u32,
    pub expert: u32,
    /// Absolute offset in experts.bin.
    pub offset: u64,
    /// CRC-32 (IEEE) of the blob's `used_len` bytes.
    pub crc32: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertTable {
    pub file: String,
    pub layout: ExpertLayout,
    pub entries: Vec<ExpertEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always "strata-pack".
    pub format: String,
    pub version: u32,
    /// Architecture name, repeated from config for quick inspection.
    pub arch: String,
    pub config: ModelConfig,
    /// Where the weights came from (`convert <dir>`, `synth tiny seed 1`).
    pub source: String,
    /// The tokens that end generation (the checkpoint's `eos_token_id`, from
    /// generation_config.json, else config.json); absent when it names none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos_token_ids: Vec<u32>,
    pub dense_file: String,
    pub tensors: Vec<TensorEntry>,
    pub experts: ExpertTable,
    /// The .bin files with their sizes, and extra files (tokenizer) copied in.
    pub files: Vec<FileEntry>,
}

/// Checks a list of end-of-generation tokens against the vocabulary;
/// the message names the first bad id.
pub fn check_eos_token_ids(ids: &[u32], vocab_size: usize) -> std::result::Result<(), String> {
    match ids.iter().find(|&&t| t as usize >= vocab_size) {
        Some(t) => Err(format!("end-of-generation token {t} is outside the vocabulary (size {vocab_size})")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_of_30b_a3b_geometry() {
        let l = ExpertLayout::new(2048, 768);
        assert_eq!(l.codes_len(), 786_432);
        assert_eq!(l.scales_len(), 98_304);
        assert_eq!(l.gate_scales, 786_432);
        assert_eq!(l.up_codes, 884_736);
        assert_eq!(l.tail, 3 * 884_736);
        assert_eq!(l.stride, 2_658_304);
        assert_eq!(l.stride % 4096, 0);
    }

    #[test]
    fn layout_sections_are_aligned_and_disjoint() {
        let l = ExpertLayout::new(64, 32);
        let secs = [
            (l.gate_codes, l.codes_len()),
            (l.gate_scales, l.scales_len()),
            (l.up_codes, l.codes_len()),
            (l.up_scales, l.scales_len()),
            (l.down_codes, l.codes_len()),
            (l.down_scales, l.scales_len()),
            (l.tail, TAIL_LEN),
        ];
        for w in secs.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
            assert_eq!(w[1].0 % SECTION_ALIGN, 0);
        }
        assert!(l.used_len() <= l.stride);
        assert_eq!(l.blob_offset(8, 1, 2), HEADER_LEN + 10 * l.stride);
    }
}
