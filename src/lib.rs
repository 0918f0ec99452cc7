//! Strata: a Mixture-of-Experts inference engine for NVIDIA GPUs plus host
//! RAM, with a CPU reference backend. See README.md and docs/.

pub mod backend;
pub mod engine;
pub mod error;
pub mod experts;
pub mod ffi;
pub mod model;
pub mod moe;
pub mod pack;
pub mod quant;
pub mod rng;
pub mod sampling;
pub mod session;
pub mod tokenizer;

pub use error::{Error, Result};
