//! Synthetic packs of real geometries with random weights.
