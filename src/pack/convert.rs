//! Hugging Face checkpoint to pack conversion.
