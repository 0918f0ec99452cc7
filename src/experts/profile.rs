//! Expert profiles: per layer, per expert, how many tokens were routed to
//! it while running some prompts (`strata profile`). The cache's initial
//! placement puts the most used experts in the fastest tiers. Format in
//! docs/expert-cache.md.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::ModelConfig;

pub const PROFILE_FORMAT: &str = "strata-expert-profile";
pub const PROFILE_VERSION: u32 = 1;
/// The file name a pack may ship its profile under.
pub const PACK_PROFILE_FILE: &str = "expert-profile.json";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertProfile {
    pub format: String,
    pub version: u32,
    /// The architecture it was recorded on (`qwen3_moe`, `qwen3_next`).
    pub arch: String,
    pub num_layers: usize,
    pub num_experts: usize,
    /// Tokens run while recording.
    pub tokens: u64,
    /// `[num_layers][num_experts]` routed-token counts.
    pub counts: Vec<Vec<u64>>,
}

impl ExpertProfile {
    pub fn new(c: &ModelConfig, tokens: u64, counts: Vec<Vec<u64>>) -> ExpertProfile {
        ExpertProfile {
            format: PROFILE_FORMAT.into(),
            version: PROFILE_VERSION,
            arch: c.arch.name().into(),
            num_layers: c.num_hidden_layers,
            num_experts: c.num_experts,
            tokens,
            counts,
        }
    }

    /// Reads a profile and checks it against the model that will use it.
    pub fn load(path: &Path, c: &ModelConfig) -> Result<ExpertProfile> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let bad = |m: String| Error::InvalidArgument(format!("expert profile {}: {m}", path.display()));
        let p: ExpertProfile = serde_json::from_str(&text).map_err(|e| bad(format!("malformed: {e}")))?;
        if p.format != PROFILE_FORMAT || p.version != PROFILE_VERSION {
            return Err(bad(format!(
                "format {:?} version {}, expected {PROFILE_FORMAT:?} version {PROFILE_VERSION}",
                p.format, p.version
            )));
        }
        let shape_ok = p.counts.len() == p.num_layers && p.counts.iter().all(|r| r.len() == p.num_experts);
        if !shape_ok {
            return Err(bad(format!("counts are not [{}][{}]", p.num_layers, p.num_experts)));
        }
        if p.num_layers != c.num_hidden_layers || p.num_experts != c.num_experts {
            return Err(bad(format!(
                "recorded on {} layers x {} experts, the model has {} x {}",
                p.num_layers, p.num_experts, c.num_hidden_layers, c.num_experts
            )));
        }
        Ok(p)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("a profile serializes");
        std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_another_model() {
        let dir = tempfile::tempdir().unwrap();
        let c = crate::pack::synth::preset(crate::model::Arch::Qwen3Moe, "tiny").unwrap();
        let counts = vec![vec![3, 0, 1, 0, 0, 0, 0, 4], vec![0; 8]];
        let p = ExpertProfile::new(&c, 4, counts.clone());
        let path = dir.path().join("p.json");
        p.save(&path).unwrap();
        let q = ExpertProfile::load(&path, &c).unwrap();
        assert_eq!(q, p);
        assert_eq!(q.counts, counts);
        let other = ModelConfig { num_experts: 16, ..c.clone() };
        let e = ExpertProfile::load(&path, &other).unwrap_err().to_string();
        assert!(e.contains("2 layers x 8 experts, the model has 2 x 16"), "{e}");
        let ragged = ExpertProfile { counts: vec![vec![1; 8], vec![1; 7]], ..p };
        ragged.save(&path).unwrap();
        let e = ExpertProfile::load(&path, &c).unwrap_err().to_string();
        assert!(e.contains("not [2][8]"), "{e}");
    }
}
