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

/// The int8 quantization of one KV block (one position's vector of one kv
/// head), the rule of the CUDA KV cache (`attn_kv_append_i8`): scale =
/// amax / 127, value = round-half-even(x / scale) clamped to +-127, all
/// zero when the block is zero. Returns the scale and fills `out`.
pub fn quantize_int8_block(x: &[f32], out: &mut [i8]) -> f32 {
    assert_eq!(x.len(), out.len(), "quantize_int8_block: lengths");
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if scale > 0.0 { (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8 } else { 0 };
    }
    scale
}

/// `x` as an int8 KV block stores it: quantized, then dequantized
/// (`value * scale`), in place.
pub fn int8_block_round_trip(x: &mut [f32]) {
    let mut q = vec![0i8; x.len()];
    let scale = quantize_int8_block(x, &mut q);
    for (v, &c) in x.iter_mut().zip(&q) {
        *v = c as f32 * scale;
    }
}

/// `x` rounded to bf16 and back (round to nearest even), in place.
pub fn bf16_round_trip(x: &mut [f32]) {
    for v in x {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}
