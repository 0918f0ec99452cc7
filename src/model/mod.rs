//! Architecture descriptions: configs and the tensors each layer needs. Pure data.

pub mod config;
pub mod weights;

pub use config::{Arch, ModelConfig, RopeScaling};
