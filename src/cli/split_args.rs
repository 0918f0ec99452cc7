//! The device options of `strata generate` and `strata bench`: the layer
//! split and prefill help (docs/layer-split.md), the KV cache type and the
//! GPU's activation precision.

use clap::Args;

use strata::engine::{EngineOptions, GpuPrecision, Help, SplitStats};
use strata::session::KvType;

use super::cache_args::ExpertCacheArgs;

#[derive(Args, Clone, Debug, Default)]
pub struct SplitArgs {
    /// With several devices (--device cpu,cpu or cuda:0,cuda:1): the first layer of each
    /// stage after the first, comma-separated (default: layers divided
    /// evenly).
    #[arg(long, value_delimiter = ',')]
    layer_split: Option<Vec<usize>>,
    /// With several devices, instead of --layer-split: each device's memory
    /// budget in GiB, comma-separated; the split is chosen so that every
    /// stage's layers fit its budget, as evenly filled as they can be.
    #[arg(long, value_delimiter = ',', conflicts_with = "layer_split")]
    stage_memory_gib: Option<Vec<f64>>,
    /// With --stage-memory-gib: each budget also holds one session's KV
    /// cache for this many tokens, and its recurrent states.
    #[arg(long, default_value_t = 0, requires = "stage_memory_gib")]
    stage_memory_context: usize,
    /// Whether an idle stage computes part of the active layer's expert
    /// rows during prefill: auto (chunks of at least 64 tokens), on or off.
    #[arg(long, value_enum, default_value = "auto")]
    prefill_help: HelpArg,
}

#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
pub enum HelpArg {
    #[default]
    Auto,
    On,
    Off,
}

/// `--precision`: the activation precision of the GPU's tensor-core
/// products (prefill; `GpuPrecision`).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum PrecisionArg {
    Accurate,
    Fast,
}

impl PrecisionArg {
    pub fn gpu(self) -> GpuPrecision {
        match self {
            PrecisionArg::Accurate => GpuPrecision::Accurate,
            PrecisionArg::Fast => GpuPrecision::Fast,
        }
    }
}

/// `--kv`: the element type of a session's KV cache (`KvType`; auto is the
/// backend's choice: f32 on the CPU, int8 on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvArg {
    Auto,
    Int8,
    Bf16,
    F32,
}

impl KvArg {
    pub fn kv_type(self) -> KvType {
        match self {
            KvArg::Auto => KvType::Auto,
            KvArg::Int8 => KvType::Int8,
            KvArg::Bf16 => KvType::Bf16,
            KvArg::F32 => KvType::F32,
        }
    }
}

impl SplitArgs {
    /// The engine options of a command that runs a model: `threads` CPU
    /// threads, `devices`, this split, `cache`'s expert cache and the GPU's
    /// `precision`; the rest default.
    pub fn engine_options(
        &self,
        threads: Option<usize>,
        devices: &[String],
        cache: &ExpertCacheArgs,
        precision: PrecisionArg,
    ) -> EngineOptions {
        EngineOptions {
            threads,
            devices: devices.to_vec(),
            layer_split: self.layer_split(),
            stage_memory: self.stage_memory(),
            stage_memory_context: self.stage_memory_context(),
            prefill_help: self.help(),
            expert_cache: cache.options(),
            gpu_precision: precision.gpu(),
            ..Default::default()
        }
    }

    pub fn layer_split(&self) -> Option<Vec<usize>> {
        self.layer_split.clone()
    }

    pub fn stage_memory(&self) -> Option<Vec<u64>> {
        self.stage_memory_gib.as_ref().map(|v| v.iter().map(|g| (g.max(0.0) * (1u64 << 30) as f64) as u64).collect())
    }

    pub fn stage_memory_context(&self) -> usize {
        self.stage_memory_context
    }

    pub fn help(&self) -> Help {
        match self.prefill_help {
            HelpArg::Auto => Help::Auto,
            HelpArg::On => Help::On,
            HelpArg::Off => Help::Off,
        }
    }
}

/// "split: stage 0 layers 0..2 (threads 4) 1.234 s, ...; 12 hand-offs,
/// 1.5 MB, 0.001 s (83 us and 1.5 GB/s a hand-off); help: 48 layers, 9000
/// expert rows".
pub fn split_line(s: &SplitStats) -> String {
    let stages: Vec<String> = s
        .stages
        .iter()
        .enumerate()
        .map(|(i, st)| {
            let rate = st.expert_rows_per_second.map_or(String::new(), |r| format!(", {r:.0} expert rows/s"));
            // A CUDA stage has no threads of its own (0).
            let threads = if st.threads > 0 { format!(" (threads {})", st.threads) } else { String::new() };
            format!("stage {i} layers {}..{}{threads} {:.3} s{rate}", st.layers.start, st.layers.end, st.seconds)
        })
        .collect();
    // A hand-off's mean time and its bytes over that time (the peer link's
    // rate between GPUs, the copy engine's on one).
    let each = if s.handoffs > 0 && s.handoff_seconds > 0.0 {
        format!(
            " ({:.0} us and {:.1} GB/s a hand-off)",
            1e6 * s.handoff_seconds / s.handoffs as f64,
            s.handoff_bytes as f64 / s.handoff_seconds / 1e9
        )
    } else {
        String::new()
    };
    format!(
        "split: {}; {} hand-offs, {:.2} MB, {:.4} s{each}; prefill help: {} layers, {} expert rows on the helper",
        stages.join(", "),
        s.handoffs,
        s.handoff_bytes as f64 / 1e6,
        s.handoff_seconds,
        s.helped_layers,
        s.helper_rows
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_line_gives_each_hand_off_its_time_and_rate() {
        let s = SplitStats { handoffs: 4, handoff_bytes: 8_000_000, handoff_seconds: 0.002, ..Default::default() };
        let line = split_line(&s);
        assert!(line.contains("4 hand-offs, 8.00 MB, 0.0020 s (500 us and 4.0 GB/s a hand-off)"), "{line}");
        // CPU stages hand off in no measured time: no rate.
        let line = split_line(&SplitStats { handoffs: 4, ..Default::default() });
        assert!(line.contains("0.0000 s; prefill help"), "{line}");
    }
}
