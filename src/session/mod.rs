//! A session: one conversation's tokens, KV cache and last logits.
//!
//! Bad input is rejected before any state changes, and a failing forward
//! leaves the session as it was before the call (tokens, KV, logits).

pub(crate) mod kv;

use crate::engine::{Engine, Logits};
use crate::error::{Error, Result};
use crate::sampling::Sampler;
use kv::KvCache;

#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// Most tokens the session holds; 0 = the model's max_position_embeddings.
    pub context_size: usize,
    /// Tokens per forward during prefill; 0 = the whole prompt in one forward.
    pub prefill_chunk: usize,
}

pub struct Session {
    engine: Engine,
    kv: KvCache,
    tokens: Vec<u32>,
    /// Logits of the last position, when they match `tokens`.
    logits: Option<Vec<f32>>,
    capacity: usize,
    prefill_chunk: usize,
}

impl Session {
    pub(crate) fn new(engine: Engine, opts: &SessionOptions) -> Result<Session> {
        let c = engine.config();
        let max = c.max_position_embeddings;
        if opts.context_size > max {
            return Err(Error::InvalidArgument(format!(
                "context_size {} exceeds the model's max_position_embeddings {max}",
                opts.context_size
            )));
        }
        let capacity = if opts.context_size == 0 { max } else { opts.context_size };
        Ok(Session {
            kv: KvCache::new(c.num_hidden_layers, c.kv_dim()),
            engine,
            tokens: Vec::new(),
            logits: None,
            capacity,
            prefill_chunk: opts.prefill_chunk,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Appends `tokens` and returns the logits of the last position.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.run_prompt(tokens, false)?;
        Ok(self.logits.as_deref().expect("set by run_prompt"))
    }

    /// Appends `tokens` and returns the logits of every new position,
    /// row-major `[tokens.len(), vocab]`.
    pub fn prefill_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.run_prompt(tokens, true)
    }

    /// Samples the next token from the current logits, appends it and runs
    /// it, so that `logits()` is fresh. Returns the token.
    pub fn step(&mut self, sampler: &mut Sampler) -> Result<u32> {
        let Some(logits) = &self.logits else {
            return Err(Error::InvalidArgument(format!(
                "step: the session has no logits (holds {} tokens): prefill a prompt first",
                self.tokens.len()
            )));
        };
        self.check_room(1)?;
        let token = sampler.sample(logits)?;
        let logits = self.engine.forward(&mut self.kv, &[token], Logits::Last)?;
        self.tokens.push(token);
        self.logits = Some(logits);
        Ok(token)
    }

    /// Logits of the last position, if the last call produced them.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Most tokens this session can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `n` tokens and their KV, dropping the rest. Logits
    /// become `None` unless `n == len()` (nothing changes then).
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n > self.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "truncate to {n} tokens: the session holds only {}",
                self.tokens.len()
            )));
        }
        if n == self.tokens.len() {
            return Ok(());
        }
        self.kv.truncate(n);
        self.tokens.truncate(n);
        self.logits = None;
        Ok(())
    }

    fn check_room(&self, more: usize) -> Result<()> {
        let needed = self.tokens.len() + more;
        if needed > self.capacity {
            return Err(Error::ContextOverflow { needed, capacity: self.capacity });
        }
        Ok(())
    }

    fn check_prompt(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("empty prompt: prefill needs at least one token".into()));
        }
        let vocab = self.engine.config().vocab_size;
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "token {t} at index {i} is outside the vocabulary (size {vocab})"
            )));
        }
        self.check_room(tokens.len())
    }

    /// Runs a prompt in chunks; commits tokens and logits only when every
    /// chunk succeeded. Returns all rows' logits when `all`, else the last row's.
    fn run_prompt(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        self.check_prompt(tokens)?;
        let start = self.kv.len();
        let chunk = match self.prefill_chunk {
            0 => tokens.len(),
            n => n,
        };
        self.kv.reserve(tokens.len());
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut out = Vec::new();
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let want = match (all, i + 1 == n_chunks) {
                (true, _) => Logits::All,
                (false, true) => Logits::Last,
                (false, false) => Logits::Skip,
            };
            match self.engine.forward(&mut self.kv, part, want) {
                Ok(l) => out.extend_from_slice(&l),
                Err(e) => {
                    self.kv.truncate(start);
                    return Err(e);
                }
            }
        }
        let vocab = self.engine.config().vocab_size;
        self.tokens.extend_from_slice(tokens);
        self.logits = Some(out[out.len() - vocab..].to_vec());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_pack::{tiny_config, write_tiny_pack, TinyPack};
    use crate::engine::EngineOptions;
    use crate::sampling::SamplingParams;
    use tempfile::TempDir;

    fn tiny_engine(opts: &TinyPack) -> (TempDir, Engine) {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), opts).unwrap();
        let e = Engine::load(dir.path(), &EngineOptions::default()).unwrap();
        (dir, e)
    }

    fn session(e: &Engine, prefill_chunk: usize) -> Session {
        e.new_session(&SessionOptions { context_size: 0, prefill_chunk }).unwrap()
    }

    const PROMPT: [u32; 11] = [3, 96, 14, 15, 92, 65, 35, 89, 79, 32, 38];

    /// max |a - b| <= 1e-5 * max |b|.
    fn assert_close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0 && b.iter().all(|v| v.is_finite()), "{what}: degenerate logits");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * scale, "{what}: index {i}: {x} vs {y}");
        }
    }

    #[test]
    fn whole_chunked_and_token_by_token_prefill_agree() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let vocab = e.config().vocab_size;
        let whole = session(&e, 0).prefill_all(&PROMPT).unwrap();
        assert_eq!(whole.len(), PROMPT.len() * vocab);
        let chunked = session(&e, 3).prefill_all(&PROMPT).unwrap();
        assert_close(&chunked, &whole, "chunk 3");
        let mut one = session(&e, 0);
        for (i, &t) in PROMPT.iter().enumerate() {
            let l = one.prefill(&[t]).unwrap().to_vec();
            assert_close(&l, &whole[i * vocab..(i + 1) * vocab], &format!("position {i}"));
        }
        // prefill returns the last row of prefill_all, and logits() keeps it.
        let mut s = session(&e, 4);
        let last = s.prefill(&PROMPT).unwrap().to_vec();
        assert_close(&last, &whole[(PROMPT.len() - 1) * vocab..], "prefill last");
        assert_eq!(s.logits().unwrap(), &last[..]);
        assert_eq!((s.len(), s.tokens()), (PROMPT.len(), &PROMPT[..]));
        // Rows differ by position: the comparison above is not vacuous.
        assert_ne!(&whole[..vocab], &whole[vocab..2 * vocab]);
    }

    #[test]
    fn greedy_generation_is_identical_across_chunk_sizes() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let generate = |chunk| {
            let mut s = session(&e, chunk);
            s.prefill(&PROMPT).unwrap();
            let mut g = Sampler::greedy();
            let out: Vec<u32> = (0..12).map(|_| s.step(&mut g).unwrap()).collect();
            assert_eq!(s.len(), PROMPT.len() + 12);
            assert_eq!(&s.tokens()[PROMPT.len()..], &out[..]);
            out
        };
        let reference = generate(0);
        for chunk in [1, 2, 3, 5, 64] {
            assert_eq!(generate(chunk), reference, "chunk {chunk}");
        }
        // Not a fixed point: the generated tokens vary.
        let mut distinct = reference.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 1, "{reference:?}");
    }

    #[test]
    fn step_logits_equal_prefill_of_the_same_tokens() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let mut a = session(&e, 0);
        a.prefill(&PROMPT[..4]).unwrap();
        let mut sampler =
            Sampler::new(SamplingParams { temperature: 0.8, seed: 11, ..SamplingParams::default() }).unwrap();
        for _ in 0..5 {
            a.step(&mut sampler).unwrap();
        }
        let mut b = session(&e, 0);
        let lb = b.prefill(a.tokens()).unwrap().to_vec();
        assert_close(a.logits().unwrap(), &lb, "step vs prefill");
    }

    #[test]
    fn truncate_then_prefill_reproduces_logits() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let vocab = e.config().vocab_size;
        let mut s = session(&e, 2);
        let all = s.prefill_all(&PROMPT).unwrap();
        // Same length: nothing changes, logits stay.
        s.truncate(PROMPT.len()).unwrap();
        assert!(s.logits().is_some());
        s.truncate(5).unwrap();
        assert_eq!((s.len(), s.tokens()), (5, &PROMPT[..5]));
        assert!(s.logits().is_none());
        let again = s.prefill_all(&PROMPT[5..]).unwrap();
        assert_close(&again, &all[5 * vocab..], "after truncate");
        // A different continuation after truncation does not see the old tail.
        s.truncate(5).unwrap();
        let other = s.prefill(&[1, 2]).unwrap().to_vec();
        let mut fresh = session(&e, 0);
        let mut p = PROMPT[..5].to_vec();
        p.extend([1, 2]);
        assert_close(&other, fresh.prefill(&p).unwrap(), "new tail");
        s.truncate(0).unwrap();
        assert!(s.is_empty());
        let e2 = s.truncate(1).unwrap_err().to_string();
        assert!(e2.contains("truncate to 1"), "{e2}");
    }

    /// The observable state of a session.
    fn state(s: &Session) -> (Vec<u32>, usize, Option<Vec<f32>>, usize) {
        (s.tokens().to_vec(), s.len(), s.logits().map(|l| l.to_vec()), s.kv.len())
    }

    #[test]
    fn bad_input_is_rejected_and_changes_nothing() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let cap = e.config().max_position_embeddings;
        let mut s = session(&e, 3);
        // No logits yet: step fails.
        let err = s.step(&mut Sampler::greedy()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("no logits")), "{err}");
        s.prefill(&PROMPT).unwrap();
        let before = state(&s);

        let err = s.prefill(&[]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.starts_with("empty prompt")), "{err}");
        assert_eq!(state(&s), before);

        let err = s.prefill_all(&[1, 2, 97, 5]).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("token 97 at index 2") && m.contains("97")),
            "{err}"
        );
        assert_eq!(state(&s), before);
        let err = s.prefill(&[u32::MAX]).unwrap_err().to_string();
        assert!(err.contains(&u32::MAX.to_string()), "{err}");
        assert_eq!(state(&s), before);

        let room = cap - PROMPT.len();
        let err = s.prefill(&vec![1; room + 1]).unwrap_err();
        assert!(
            matches!(err, Error::ContextOverflow { needed, capacity } if needed == cap + 1 && capacity == cap),
            "{err}"
        );
        assert_eq!(state(&s), before);

        let err = s.truncate(PROMPT.len() + 1).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert_eq!(state(&s), before);

        // The session still works, and fills exactly to capacity.
        s.prefill(&vec![1; room]).unwrap();
        assert_eq!(s.len(), cap);
        let full = state(&s);
        let err = s.step(&mut Sampler::greedy()).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { needed, .. } if needed == cap + 1), "{err}");
        assert_eq!(state(&s), full);
    }

    #[test]
    fn context_size_is_checked_and_limits_the_session() {
        let (_d, e) = tiny_engine(&TinyPack::default());
        let max = e.config().max_position_embeddings;
        let err = e.new_session(&SessionOptions { context_size: max + 1, prefill_chunk: 0 }).err().unwrap().to_string();
        assert!(err.contains(&format!("context_size {}", max + 1)), "{err}");
        let mut s = e.new_session(&SessionOptions { context_size: 8, prefill_chunk: 0 }).unwrap();
        assert_eq!(s.capacity(), 8);
        assert_eq!(session(&e, 0).capacity(), max);
        let err = s.prefill(&PROMPT).unwrap_err();
        assert!(matches!(err, Error::ContextOverflow { needed: 11, capacity: 8 }), "{err}");
        assert!(s.is_empty() && s.logits().is_none());
    }

    #[test]
    fn expert_global_scales_are_applied() {
        let (_a, good) = tiny_engine(&TinyPack::default());
        let (_b, unscaled) = tiny_engine(&TinyPack { expert_global_scale: Some(1.0), ..TinyPack::default() });
        // The fixture's scales are far from 1, so dropping them cannot hide.
        let g = good.pack().expert(0, 0).unwrap();
        assert!(g.gate.global_scale < 1e-2 && g.gate.global_scale != g.up.global_scale);
        assert_eq!(unscaled.pack().expert(1, 7).unwrap().down.global_scale, 1.0);
        let a = session(&good, 0).prefill_all(&PROMPT).unwrap();
        let b = session(&unscaled, 0).prefill_all(&PROMPT).unwrap();
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(&b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff > 0.1 * scale, "max diff {diff} vs max logit {scale}");
    }
}
