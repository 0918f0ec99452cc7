//! Number formats: NVFP4 (E2M1 codes, E4M3 block scales, FP32 global scale)
//! and the BF16 helpers dense tensors use.

pub mod nvfp4;

pub use nvfp4::{Nvfp4Matrix, Nvfp4Owned, BLOCK};

/// Decodes little-endian BF16 bytes into f32.
pub fn bf16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 2);
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// Decodes little-endian F16 (IEEE half) bytes into f32 (exact).
pub fn f16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 2);
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

/// Decodes little-endian F32 bytes into f32.
pub fn f32_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 4);
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Encodes f32 values as little-endian BF16 (round to nearest even).
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 2);
    for &v in values {
        out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
    }
    out
}
