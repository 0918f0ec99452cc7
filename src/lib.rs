//! Strata: a Mixture-of-Experts inference engine for NVIDIA GPUs plus host
//! RAM, with a CPU reference backend. See README.md and docs/.

pub mod error;
pub mod model;
pub mod pack;
pub mod quant;
pub mod rng;

pub use error::{Error, Result};
