//! Logits on the host as a forward returns them.

use std::ops::Deref;

/// Logits `[rows, vocab]` on the host: a vector, or (a CUDA forward of one
/// row: a decode step) the page-locked buffer the device copied them into,
/// given back to its pool when dropped, so that a decode step does not
/// copy the vocabulary's logits once more into a vector. Reads as `[f32]`;
/// a clone is a vector.
pub(crate) struct HostLogits(Repr);

enum Repr {
    Vec(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pinned(super::gpu::PinnedLogits),
}

impl HostLogits {
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(p: super::gpu::PinnedLogits) -> HostLogits {
        HostLogits(Repr::Pinned(p))
    }
}

impl From<Vec<f32>> for HostLogits {
    fn from(v: Vec<f32>) -> HostLogits {
        HostLogits(Repr::Vec(v))
    }
}

impl Deref for HostLogits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.0 {
            Repr::Vec(v) => v,
            #[cfg(feature = "cuda")]
            Repr::Pinned(p) => p,
        }
    }
}

impl Clone for HostLogits {
    fn clone(&self) -> HostLogits {
        self.to_vec().into()
    }
}

impl std::fmt::Debug for HostLogits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLogits").field("len", &self.len()).finish()
    }
}
