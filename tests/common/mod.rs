//! Helpers shared by the fixture tests (tests/fixtures.rs, tests/fixtures_next.rs).

/// (max |a - b|, max |b|); panics on a non-finite value in `a`, so NaN never passes.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let mut d = 0.0f32;
    let mut m = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        assert!(x.is_finite(), "non-finite logit {x}");
        d = d.max((x - y).abs());
        m = m.max(y.abs());
    }
    (d, m)
}
