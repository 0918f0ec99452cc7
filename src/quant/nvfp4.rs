//! NVFP4: 4-bit E2M1 elements, one E4M3 scale per 16 elements along the
//! input axis, one FP32 global scale per matrix (a multiplier).
//!
//! `w[r, c] = e2m1(code[r, c]) * e4m3(scale[r, c / 16]) * global_scale`
//!
//! Element 2i of a row sits in the low nibble of byte i, element 2i+1 in the
//! high nibble. Scales are row-major `[rows, cols / 16]`. See
//! docs/pack-format.md and ../shared/design/formats-and-math.md section 1.

/// Elements per block scale.
pub const BLOCK: usize = 16;

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Largest finite E4M3 (e4m3fn) magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// All 16 E2M1 code values (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

pub fn e2m1_decode(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// Rounds to the nearest E2M1 value, ties to even mantissa, saturating at 6.
/// The sign bit is set for every negative input, so small negatives give -0
/// (code 8), as ModelOpt's `_cast_fp4` does.
pub fn e2m1_encode(x: f32) -> u8 {
    let sign = if x < 0.0 { 8 } else { 0 };
    let a = x.abs();
    // Decision bounds between neighbours; at a tie the even neighbour wins:
    // codes 0, 2, 4, 6 have an even mantissa.
    let mag = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7 // also NaN lands here only if a is NaN; callers never pass NaN
    };
    sign | mag
}

/// Decodes an E4M3 (e4m3fn: no infinities, 0x7F/0xFF are NaN) byte.
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let man = (b & 0x7) as f32;
    if exp == 0xF && (b & 0x7) == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * (2.0f32).powi(-9)
    } else {
        sign * (1.0 + man / 8.0) * (2.0f32).powi(exp - 7)
    }
}

/// Rounds to the nearest E4M3 value (ties to even), saturating at +-448.
/// NaN encodes as 0x7F.
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let min_normal = (2.0f32).powi(-6);
    if a < min_normal {
        // Subnormals are multiples of 2^-9; 8 * 2^-9 is the smallest normal.
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    let e = ((a.to_bits() >> 23) as i32) - 127; // floor(log2 a) for normal f32
    let frac = a / (2.0f32).powi(e) - 1.0; // in [0, 1), exact
    let mut m = (frac * 8.0).round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) as u8) << 3) | m as u8;
    sign | code.min(0x7E)
}

/// A borrowed NVFP4 matrix `[rows, cols]` with its global scale. This is the
/// only way expert weights reach compute code, so the global scale cannot be
/// left behind.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes.
    pub codes: &'a [u8],
    /// `rows * cols / 16` E4M3 bytes.
    pub scales: &'a [u8],
    pub global_scale: f32,
}

impl<'a> Nvfp4Matrix<'a> {
    pub fn codes_len(rows: usize, cols: usize) -> usize {
        rows * cols / 2
    }

    pub fn scales_len(rows: usize, cols: usize) -> usize {
        rows * cols / BLOCK
    }

    /// Checks slice lengths against the shape; `what` names the matrix in errors.
    pub fn new(
        rows: usize,
        cols: usize,
        codes: &'a [u8],
        scales: &'a [u8],
        global_scale: f32,
        what: &str,
    ) -> crate::error::Result<Self> {
        use crate::error::Error;
        if cols % BLOCK != 0 {
            return Err(Error::tensor(what, format!("NVFP4 input dimension {cols} is not a multiple of {BLOCK}")));
        }
        if codes.len() != Self::codes_len(rows, cols) {
            return Err(Error::tensor(
                what,
                format!(
                    "NVFP4 codes are {} bytes, shape [{rows}, {cols}] needs {}",
                    codes.len(),
                    Self::codes_len(rows, cols)
                ),
            ));
        }
        if scales.len() != Self::scales_len(rows, cols) {
            return Err(Error::tensor(
                what,
                format!(
                    "NVFP4 block scales are {} bytes, shape [{rows}, {cols}] needs {}",
                    scales.len(),
                    Self::scales_len(rows, cols)
                ),
            ));
        }
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(Error::tensor(
                what,
                format!("NVFP4 global scale {global_scale} is not a positive finite number"),
            ));
        }
        Ok(Self { rows, cols, codes, scales, global_scale })
    }

    /// Dequantizes row `r` into `out` (len `cols`).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let half = self.cols / 2;
        let codes = &self.codes[r * half..(r + 1) * half];
        let scales = &self.scales[r * self.cols / BLOCK..(r + 1) * self.cols / BLOCK];
        for (b, (&s, block)) in scales.iter().zip(codes.chunks_exact(BLOCK / 2)).enumerate() {
            let scale = e4m3_decode(s) * self.global_scale;
            let o = &mut out[b * BLOCK..(b + 1) * BLOCK];
            for (i, &byte) in block.iter().enumerate() {
                o[2 * i] = e2m1_decode(byte & 0xF) * scale;
                o[2 * i + 1] = e2m1_decode(byte >> 4) * scale;
            }
        }
    }

    /// The whole matrix in f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequant_row(r, row);
        }
        out
    }

    /// `dot(row r, x)` without materializing the row. Each block's partial sum
    /// is scaled once by its E4M3 scale, then the row by the global scale.
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let half = self.cols / 2;
        let codes = &self.codes[r * half..(r + 1) * half];
        let scales = &self.scales[r * self.cols / BLOCK..(r + 1) * self.cols / BLOCK];
        let mut acc = 0.0f32;
        for (b, (&s, block)) in scales.iter().zip(codes.chunks_exact(BLOCK / 2)).enumerate() {
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            let mut part = 0.0f32;
            for (i, &byte) in block.iter().enumerate() {
                part += E2M1_VALUES[(byte & 0xF) as usize] * xb[2 * i];
                part += E2M1_VALUES[(byte >> 4) as usize] * xb[2 * i + 1];
            }
            acc += part * e4m3_decode(s);
        }
        acc * self.global_scale
    }
}

/// An owned NVFP4 matrix, as produced by [`quantize`].
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Owned {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<u8>,
    pub global_scale: f32,
}

impl Nvfp4Owned {
    pub fn view(&self) -> Nvfp4Matrix<'_> {
        Nvfp4Matrix {
            rows: self.rows,
            cols: self.cols,
            codes: &self.codes,
            scales: &self.scales,
            global_scale: self.global_scale,
        }
    }
}

/// Quantizes a row-major `[rows, cols]` f32 matrix with ModelOpt's choice of
/// scales: `g = amax / (6 * 448)`; block scale `block_amax / (6 g)`, 1.0 for
/// an all-zero block, clamped to [2^-9, 448] and rounded to E4M3; codes
/// `e2m1(x / (e4m3(scale) * g))`. The f32 operation order matches ModelOpt so
/// codes and scales are bit-identical. An all-zero matrix gets g = 1.
/// `cols` must be a multiple of 16 (checked by callers through [`Nvfp4Matrix::new`]).
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Nvfp4Owned {
    assert!(cols % BLOCK == 0 && w.len() == rows * cols, "quantize: bad shape");
    let amax = w.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    quantize_with_global(w, rows, cols, global_scale_for_amax(amax))
}

/// ModelOpt's global scale for a matrix whose largest magnitude is `amax`:
/// `amax / (6 * 448)`, or 1 for an all-zero matrix. Callers that see a large
/// matrix in pieces compute `amax` first, then quantize each piece with
/// [`quantize_with_global`]; the result equals [`quantize`] on the whole.
pub fn global_scale_for_amax(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / (E2M1_MAX * E4M3_MAX)
    } else {
        1.0
    }
}

/// As [`quantize`] with a given global scale (for tensors that must share one).
pub fn quantize_with_global(w: &[f32], rows: usize, cols: usize, global_scale: f32) -> Nvfp4Owned {
    assert!(cols % BLOCK == 0 && w.len() == rows * cols, "quantize: bad shape");
    let mut codes = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / BLOCK];
    let six_g = E2M1_MAX * global_scale;
    for (bi, block) in w.chunks_exact(BLOCK).enumerate() {
        let bamax = block.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
        let mut s = bamax / six_g;
        if s == 0.0 {
            s = 1.0;
        }
        let s = s.clamp((2.0f32).powi(-9), E4M3_MAX);
        let sb = e4m3_encode(s);
        scales[bi] = sb;
        let denom = e4m3_decode(sb) * global_scale;
        for (i, pair) in block.chunks_exact(2).enumerate() {
            let lo = e2m1_encode(pair[0] / denom);
            let hi = e2m1_encode(pair[1] / denom);
            codes[bi * BLOCK / 2 + i] = lo | (hi << 4);
        }
    }
    Nvfp4Owned { rows, cols, codes, scales, global_scale }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_table_round_trips() {
        for code in 0u8..16 {
            let v = e2m1_decode(code);
            let back = e2m1_encode(v);
            // -0 encodes to +0 (it is not < 0); every other code is exact.
            if code == 8 {
                assert_eq!(back, 0);
            } else {
                assert_eq!(back, code, "code {code} value {v}");
            }
        }
        assert_eq!(E2M1_VALUES[7], 6.0);
        assert_eq!(E2M1_VALUES[13], -3.0);
    }

    #[test]
    fn e2m1_bounds_and_ties() {
        // (input, expected magnitude code): ties go to the even mantissa.
        let cases = [
            (0.25, 0),
            (0.2501, 1),
            (0.75, 2),
            (0.7499, 1),
            (1.25, 2),
            (1.2501, 3),
            (1.75, 4),
            (1.7499, 3),
            (2.5, 4),
            (2.5001, 5),
            (3.5, 6),
            (3.4999, 5),
            (5.0, 6),
            (5.0001, 7),
            (6.0, 7),
            (1e9, 7),
            (0.0, 0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_encode(x), want, "{x}");
            assert_eq!(e2m1_encode(-x), if x == 0.0 { 0 } else { want | 8 }, "-{x}");
        }
        // Small negatives keep the sign bit (ModelOpt: sign = x < 0).
        assert_eq!(e2m1_encode(-0.1), 8);
    }

    #[test]
    fn e4m3_full_table() {
        // Every non-NaN code decodes to a value that encodes back to itself.
        for b in 0u8..=255 {
            let v = e4m3_decode(b);
            if b & 0x7F == 0x7F {
                assert!(v.is_nan());
                continue;
            }
            let back = e4m3_encode(v);
            if b == 0x80 {
                assert_eq!(back, 0x80); // -0 keeps its sign
            } else {
                assert_eq!(back, b, "code {b:#x} value {v}");
            }
        }
        assert_eq!(e4m3_decode(0x7E), 448.0);
        assert_eq!(e4m3_decode(0x01), (2.0f32).powi(-9));
        assert_eq!(e4m3_decode(0x08), (2.0f32).powi(-6));
        assert_eq!(e4m3_decode(0x38), 1.0);
    }

    #[test]
    fn e4m3_rounding_and_saturation() {
        assert_eq!(e4m3_encode(1000.0), 0x7E);
        assert_eq!(e4m3_encode(-1000.0), 0xFE);
        assert_eq!(e4m3_encode(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_encode(f32::NAN), 0x7F);
        // 1.0625 is halfway between 1.0 (m=0) and 1.125 (m=1): even wins.
        assert_eq!(e4m3_encode(1.0625), 0x38);
        // 1.1875 is halfway between 1.125 (m=1) and 1.25 (m=2): even wins.
        assert_eq!(e4m3_encode(1.1875), 0x3A);
        // Subnormal tie: 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(e4m3_encode(1.5 * (2.0f32).powi(-9)), 0x02);
        assert_eq!(e4m3_encode(0.4 * (2.0f32).powi(-9)), 0x00);
        // Mantissa carry: 1.97 rounds up to 2.0.
        assert_eq!(e4m3_decode(e4m3_encode(1.97)), 2.0);
    }

    #[test]
    fn zero_blocks_use_unit_scale() {
        let mut w = vec![0.0f32; 2 * 32];
        w[20] = 3.0;
        let q = quantize(&w, 2, 32);
        assert_eq!(e4m3_decode(q.scales[0]), 1.0);
        assert_eq!(e4m3_decode(q.scales[2]), 1.0);
        assert_eq!(e4m3_decode(q.scales[3]), 1.0);
        let d = q.view().dequantize();
        assert_eq!(d[20], 3.0);
        assert!(d.iter().enumerate().all(|(i, &v)| i == 20 || v == 0.0));

        let z = quantize(&[0.0; 16], 1, 16);
        assert_eq!(z.global_scale, 1.0);
        assert!(z.view().dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn quantize_error_is_bounded_and_global_scale_applies() {
        // Values spread over a few binades, scaled far from 1.
        let rows = 8;
        let cols = 64;
        let w: Vec<f32> =
            (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-4 * (1.0 + (i % 7) as f32)).collect();
        let q = quantize(&w, rows, cols);
        let amax = w.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
        assert_eq!(q.global_scale, amax / 2688.0);
        let d = q.view().dequantize();
        for (blk_w, blk_d) in w.chunks(16).zip(d.chunks(16)) {
            let bamax = blk_w.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
            for (a, b) in blk_w.iter().zip(blk_d) {
                // Half a step of the coarsest E2M1 spacing (2 at the top), plus
                // the E4M3 scale's rounding.
                assert!((a - b).abs() <= bamax / 6.0 * 1.07 + 1e-12, "{a} vs {b}");
            }
        }
        // row_dot agrees with dequantize-then-dot.
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        for r in 0..rows {
            let want: f32 = d[r * cols..(r + 1) * cols].iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = q.view().row_dot(r, &x);
            assert!((want - got).abs() <= 1e-5 * want.abs().max(1e-3), "{want} {got}");
        }
        // A dropped global scale would be ~2688/amax off.
        let unscaled = Nvfp4Matrix { global_scale: 1.0, ..q.view() }.row_dot(0, &x);
        assert!((unscaled - q.view().row_dot(0, &x)).abs() > 1.0);
    }

    #[test]
    fn nibble_order_low_first() {
        let mut w = vec![0.0f32; 16];
        w[0] = 6.0; // code 7 in the low nibble of byte 0
        w[1] = -1.0; // code 10 in the high nibble
        let q = quantize_with_global(&w, 1, 16, 1.0 / 448.0 * 6.0 / 6.0);
        assert_eq!(q.codes[0] & 0xF, 7);
        assert_eq!(q.codes[0] >> 4, 10);
    }

    #[test]
    fn new_checks_lengths_and_scale() {
        let codes = vec![0u8; 16];
        let scales = vec![0x38u8; 2];
        assert!(Nvfp4Matrix::new(1, 32, &codes, &scales, 1.0, "t").is_ok());
        assert!(Nvfp4Matrix::new(2, 32, &codes, &scales, 1.0, "t").is_err());
        assert!(Nvfp4Matrix::new(1, 24, &codes, &scales, 1.0, "t").is_err());
        let e = Nvfp4Matrix::new(1, 32, &codes, &scales, f32::NAN, "layer.gate").unwrap_err();
        assert!(e.to_string().contains("layer.gate"));
    }
}
