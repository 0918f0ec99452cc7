//! Logits on the host as a forward returns them.

use std::ops::Deref;

use crate::sampling::Drawn;

/// Logits `[rows, vocab]` on the host: a vector, or (a CUDA forward of one
/// row: a decode step) the page-locked buffer the device copied them into,
/// given back to its pool when dropped, so that a decode step does not
/// copy the vocabulary's logits once more into a vector. Reads as `[f32]`;
/// a clone is a vector. It may carry the next step's draw, made on the
/// device from these logits (`Drawn`): it goes with them.
pub(crate) struct HostLogits {
    repr: Repr,
    drawn: Option<Drawn>,
}

enum Repr {
    Vec(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pinned(super::gpu::PinnedLogits),
}

impl HostLogits {
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(p: super::gpu::PinnedLogits) -> HostLogits {
        HostLogits { repr: Repr::Pinned(p), drawn: None }
    }

    /// These logits with the draw the device made from them.
    #[cfg(feature = "cuda")]
    pub(crate) fn with_drawn(self, drawn: Option<Drawn>) -> HostLogits {
        HostLogits { drawn, ..self }
    }

    /// The draw made from these logits on the device, if any.
    pub(crate) fn drawn(&self) -> Option<&Drawn> {
        self.drawn.as_ref()
    }
}

impl From<Vec<f32>> for HostLogits {
    fn from(v: Vec<f32>) -> HostLogits {
        HostLogits { repr: Repr::Vec(v), drawn: None }
    }
}

impl Deref for HostLogits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.repr {
            Repr::Vec(v) => v,
            #[cfg(feature = "cuda")]
            Repr::Pinned(p) => p,
        }
    }
}

impl Clone for HostLogits {
    fn clone(&self) -> HostLogits {
        HostLogits { repr: Repr::Vec(self.to_vec()), drawn: self.drawn.clone() }
    }
}

impl std::fmt::Debug for HostLogits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLogits").field("len", &self.len()).finish()
    }
}
