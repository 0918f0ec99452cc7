//! The pack: Strata's on-disk model format (docs/pack-format.md).
//!
//! A pack is a directory: `manifest.json` (written last, so a pack without it
//! is incomplete), `dense.bin` (dense tensors), `experts.bin` (one contiguous,
//! page-aligned blob per (layer, expert)), and tokenizer files when present.

pub mod convert;
pub mod format;
pub mod reader;
pub mod synth;
pub mod writer;

pub use format::{DType, ExpertEntry, ExpertLayout, Manifest, TensorEntry, FORMAT_VERSION};
pub use reader::{ExpertView, Pack, TensorData, TensorView};
pub use writer::{DenseTensor, PackWriter};
