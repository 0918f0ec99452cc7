//! The NVFP4 quantizer against ModelOpt's algorithm: codes, block scales and
//! global scales produced by tests/fixtures/make_fixtures.py (cross-checked
//! there against nvidia-modelopt 0.47.0) must come out bit-identical.

use safetensors::SafeTensors;
use strata::quant::f32_bytes_to_f32;
use strata::quant::nvfp4::quantize;

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    let mut v = vec![0.0; t.data().len() / 4];
    f32_bytes_to_f32(t.data(), &mut v);
    v
}

#[test]
fn codes_and_scales_match_modelopt() {
    let bytes = std::fs::read("tests/data/fixtures/nvfp4_codec.safetensors").unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut cases = 0;
    for i in 0.. {
        let name = format!("case{i}.input");
        let Ok(t) = st.tensor(&name) else { break };
        let (rows, cols) = (t.shape()[0], t.shape()[1]);
        let input = f32s(&st, &name);
        let q = quantize(&input, rows, cols);
        let g = f32s(&st, &format!("case{i}.global_scale"))[0];
        assert_eq!(q.global_scale.to_bits(), g.to_bits(), "case {i} global scale");
        assert_eq!(q.scales, st.tensor(&format!("case{i}.scales")).unwrap().data(), "case {i} block scales");
        assert_eq!(q.codes, st.tensor(&format!("case{i}.codes")).unwrap().data(), "case {i} codes");
        // Dequantized values agree to an ulp (ModelOpt multiplies e2m1 * (s8 * g)).
        let want = f32s(&st, &format!("case{i}.dequant"));
        for (a, b) in q.view().dequantize().iter().zip(&want) {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs(), "case {i}: {a} vs {b}");
        }
        cases += 1;
    }
    assert_eq!(cases, 4);
}
