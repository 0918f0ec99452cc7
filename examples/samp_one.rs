use strata::rng::Rng;
use strata::sampling::{Sampler, SamplingParams};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let t: f32 = args[1].parse().unwrap();
    let top_p: f32 = args[2].parse().unwrap();
    let vocab = 151_936;
    let mut rng = Rng::new(7);
    let mut uniform = move || rng.next_f64() as f32;
    let synth: Vec<f32> = (0..vocab).map(|_| (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.56).collect();
    let mut s = Sampler::new(SamplingParams { temperature: t, top_k: 0, top_p, min_p: 0.0, seed: 1 }).unwrap();
    let st = std::time::Instant::now();
    for _ in 0..2000 {
        std::hint::black_box(s.sample(&synth).unwrap());
    }
    println!("{:.1} us", st.elapsed().as_secs_f64() / 2000.0 * 1e6);
}
