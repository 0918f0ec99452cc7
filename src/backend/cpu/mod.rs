//! The CPU backend: the f32 reference every other path is judged against.
//! The ops themselves are in `ops`; this type runs them on the engine's
//! thread pool (its own when the caller asked for a thread count, rayon's
//! global pool otherwise).

pub mod deltanet;
pub mod next_ops;
pub mod ops;

use rayon::{ThreadPool, ThreadPoolBuilder};

use super::{AttentionShape, Backend, DeltaNetShape, DeltaNetState, ExpertRows, GatedDeltaNetWeights, Matrix, Rope};
use crate::error::{Error, Result};

pub struct CpuBackend {
    pool: Option<ThreadPool>,
}

impl CpuBackend {
    /// `threads`: `Some(n)` runs every op on a dedicated pool of n threads;
    /// `None` uses rayon's global pool.
    pub fn new(threads: Option<usize>) -> Result<CpuBackend> {
        let pool = match threads {
            None => None,
            Some(0) => return Err(Error::InvalidArgument("threads 0: a thread pool needs at least one thread".into())),
            Some(n) => Some(
                ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("strata-cpu-{i}"))
                    .build()
                    .map_err(|e| Error::InvalidArgument(format!("cannot start {n} CPU threads: {e}")))?,
            ),
        };
        Ok(CpuBackend { pool })
    }

    /// Threads that run this backend's ops.
    pub fn threads(&self) -> usize {
        match &self.pool {
            Some(p) => p.current_num_threads(),
            None => rayon::current_num_threads(),
        }
    }

    /// Runs `f` on this backend's pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], w: &Matrix, out: &mut [f32]) {
        self.install(|| ops::matmul(x, w, out))
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        self.install(|| ops::rmsnorm(x, w, eps, out))
    }

    fn rope(&self, x: &mut [f32], heads: usize, head_dim: usize, start_pos: usize, rope: &Rope) {
        self.install(|| ops::rope(x, heads, head_dim, start_pos, rope))
    }

    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], shape: AttentionShape, start_pos: usize, out: &mut [f32]) {
        self.install(|| ops::attention(q, k, v, shape, start_pos, out))
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        self.install(|| ops::add(x, y))
    }

    fn expert_ffn(&self, groups: &[ExpertRows<'_>], x: &[f32], out: &mut [f32]) {
        self.install(|| ops::expert_ffn(groups, x, out))
    }

    fn gated_deltanet(
        &self,
        x: &[f32],
        w: &GatedDeltaNetWeights<'_>,
        shape: DeltaNetShape,
        eps: f32,
        state: &mut DeltaNetState,
        out: &mut [f32],
    ) {
        self.install(|| deltanet::gated_deltanet_layer(x, w, shape, eps, state, out))
    }

    fn output_gate(&self, attn: &mut [f32], gate: &[f32]) {
        self.install(|| next_ops::apply_output_gate(attn, gate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedicated_pool_has_the_requested_threads() {
        let b = CpuBackend::new(Some(3)).unwrap();
        assert_eq!(b.threads(), 3);
        assert_eq!(b.install(rayon::current_num_threads), 3);
        let e = CpuBackend::new(Some(0)).err().unwrap().to_string();
        assert!(e.contains("threads 0"), "{e}");
    }

    #[test]
    fn pool_and_global_give_identical_results() {
        let w = Matrix::new(70, 33, (0..70 * 33).map(|i| ((i * 13 % 29) as f32).sin()).collect());
        let x: Vec<f32> = (0..4 * 33).map(|i| (i as f32 * 0.1).cos()).collect();
        let (mut a, mut b) = (vec![0.0; 4 * 70], vec![0.0; 4 * 70]);
        CpuBackend::new(Some(2)).unwrap().matmul(&x, &w, &mut a);
        CpuBackend::new(None).unwrap().matmul(&x, &w, &mut b);
        assert_eq!(a, b);
    }
}
