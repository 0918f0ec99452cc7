//! The `strata` binary end to end: synth -> inspect --verify -> generate, and
//! errors that exit with status 1 and a message naming the culprit.

use std::process::Command;

fn strata(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn synth_inspect_generate() {
    let d = tempfile::tempdir().unwrap();
    let pack = d.path().join("tiny");
    let p = pack.to_str().unwrap();
    let (rc, _, err) = strata(&["synth", "--arch", "qwen3_moe", "--preset", "tiny", "--out", p, "--seed", "3"]);
    assert_eq!(rc, 0, "{err}");
    let (rc, out, err) = strata(&["inspect", p, "--verify"]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("2 layers, hidden 64") && out.contains("checksums   all match"), "{out}");

    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", "--pack", p, "--tokens", "1,2,3,4,5", "-n", "12"];
        args.extend_from_slice(extra);
        let (rc, out, err) = strata(&args);
        assert_eq!(rc, 0, "{err}");
        assert!(err.contains("prefill 5 tokens") && err.contains("decode 12 tokens"), "{err}");
        let toks: Vec<u32> = out.split_whitespace().map(|t| t.parse().unwrap()).collect();
        assert_eq!(toks.len(), 12);
        assert!(toks.iter().all(|&t| t < 256));
        toks
    };
    // Greedy is independent of chunking; seeded sampling is reproducible.
    assert_eq!(gen(&[]), gen(&["--chunk", "2"]));
    let s1 = gen(&["--temperature", "1.0", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--seed", "9"]);
    let s2 = gen(&["--temperature", "1.0", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--seed", "9"]);
    assert_eq!(s1, s2);
    // bench takes the same sampling flags, says so, and checks them first.
    let bench = |extra: &[&str]| {
        let mut args =
            vec!["bench", "--pack", p, "--device", "cpu", "--prompt-len", "4", "--gen", "3", "--repeats", "1"];
        args.extend_from_slice(extra);
        strata(&args)
    };
    let (rc, out, err) = bench(&["--temperature", "0.8", "--top-p", "0.9", "--seed", "2"]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("; sampled (temperature 0.8, top-k 0, top-p 0.9, min-p 0)"), "{out}");
    let (rc, out, err) = bench(&[]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("decode at batch 1") && !out.contains("sampled"), "{out}");
    let (rc, _, err) = bench(&["--temperature", "0.8", "--top-p", "2"]);
    assert_eq!(rc, 1);
    assert!(err.contains("top_p 2") && !err.contains("prefill"), "{err}");

    // The KV type and the GPU precision reach the engine: f32 is the CPU's
    // auto; its emulated int8 and bf16 caches run too.
    assert_eq!(gen(&[]), gen(&["--kv", "f32"]));
    gen(&["--kv", "int8", "--precision", "fast"]);
    gen(&["--kv", "bf16"]);

    // The expert cache changes where experts come from, never the tokens:
    // 2 slots of 16 (layers x experts) with a 1-slot ring miss, evict and
    // stream, and say so on stderr.
    assert_eq!(gen(&[]), gen(&["--expert-cache", "2", "--ring-slots", "1"]));
    let (rc, _, err) = strata(&[
        "generate",
        "--pack",
        p,
        "--tokens",
        "1,2,3,4,5",
        "-n",
        "4",
        "--expert-cache",
        "2",
        "--ring-slots",
        "1",
    ]);
    assert_eq!(rc, 0, "{err}");
    // The planned tiers first (a ring of 1 as asked), then the statistics.
    assert!(err.contains("expert cache: 2 slots + 1 ring slots of "), "{err}");
    let line = err.lines().find(|l| l.contains(" misses (")).unwrap_or_else(|| panic!("no stats line: {err}"));
    let misses: u64 = line.split(" misses").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
    assert!(misses > 0 && line.contains("evictions"), "{line}");
    // The default ring under a VRAM budget of 5 blobs of 4 KiB: what the
    // budget leaves beside the 2 slots one token needs.
    let budget = ["--expert-vram-budget-mib", "0.01953125"];
    let (rc, _, err) = strata(&[&["generate", "--pack", p, "--tokens", "1,2", "-n", "1"][..], &budget].concat());
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("expert cache: 2 slots + 3 ring slots of 4.0 KiB"), "{err}");
    // A layer split over two CPU devices, with prefill help on, gives the
    // same tokens and reports its stages and hand-offs.
    let split = ["--device", "cpu,cpu", "--layer-split", "1", "--prefill-help", "on"];
    assert_eq!(gen(&[]), gen(&split));
    let mut args = vec!["generate", "--pack", p, "--tokens", "1,2,3", "-n", "2"];
    args.extend_from_slice(&split);
    let (rc, _, err) = strata(&args);
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("split: stage 0 layers 0..1") && err.contains("3 hand-offs"), "{err}");

    // An end-of-generation token in the pack stops generate when it is
    // sampled (not printed); --ignore-eos runs all N steps.
    let greedy = gen(&[]);
    let k = (1..greedy.len()).find(|&k| !greedy[..k].contains(&greedy[k])).unwrap_or(0);
    let manifest = pack.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    v["eos_token_ids"] = serde_json::json!([greedy[k]]);
    std::fs::write(&manifest, v.to_string()).unwrap();
    let (rc, out, err) = strata(&["generate", "--pack", p, "--tokens", "1,2,3,4,5", "-n", "12"]);
    assert_eq!(rc, 0, "{err}");
    let toks: Vec<u32> = out.split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(toks, greedy[..k]);
    let stop = format!("stopped at end-of-generation token {} after {k} tokens", greedy[k]);
    assert!(err.contains(&stop) && err.contains(&format!("decode {} tokens", k + 1)), "{err}");
    assert_eq!(gen(&["--ignore-eos"]), greedy);
    let (rc, out, err) = strata(&["inspect", p]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains(&format!("eos         {}", greedy[k])), "{out}");
    v.as_object_mut().unwrap().remove("eos_token_ids");
    std::fs::write(&manifest, v.to_string()).unwrap();
    let (rc, _, err) = strata(&["generate", "--pack", p, "--tokens", "1", "--device", "cpu,cpu", "--layer-split", "2"]);
    assert_eq!(rc, 1);
    assert!(err.contains("layer split [2]"), "{err}");
    // The split from memory budgets: the same tokens; budgets too small are refused by name.
    assert_eq!(gen(&[]), gen(&["--device", "cpu,cpu", "--stage-memory-gib", "1,1"]));
    let (rc, _, err) =
        strata(&["generate", "--pack", p, "--tokens", "1", "--device", "cpu,cpu", "--stage-memory-gib", "0,0"]);
    assert_eq!(rc, 1);
    assert!(err.contains("memory budgets"), "{err}");
    // A cache below its minimum (one token's experts) fails the load, naming the need.
    let (rc, _, err) = strata(&["generate", "--pack", p, "--tokens", "1,2", "-n", "2", "--expert-cache", "1"]);
    assert_eq!(rc, 1);
    assert!(err.contains("the minimum is 2"), "{err}");
}

#[test]
fn errors_exit_with_status_one_and_a_message() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("missing");
    let (rc, _, err) = strata(&["inspect", missing.to_str().unwrap()]);
    assert_eq!(rc, 1);
    assert!(err.starts_with("strata inspect:") && err.contains("missing"), "{err}");

    let pack = d.path().join("tiny");
    let p = pack.to_str().unwrap();
    assert_eq!(strata(&["synth", "--preset", "tiny", "--out", p]).0, 0);
    let (rc, _, err) = strata(&["generate", "--pack", p, "--tokens", "1,999", "-n", "2"]);
    assert_eq!(rc, 1);
    assert!(err.contains("999"), "{err}");
    let (rc, _, err) = strata(&["generate", "--pack", p, "--prompt", "hello", "-n", "2"]);
    assert_eq!(rc, 1);
    assert!(err.contains("tokenizer"), "{err}");
    let (rc, _, err) = strata(&["synth", "--preset", "huge", "--out", d.path().join("x").to_str().unwrap()]);
    assert_eq!(rc, 1);
    assert!(err.contains("huge") && err.contains("30b-a3b"), "{err}");

    // A cache's settings without a cache are refused by flag, before the load.
    let (rc, _, err) = strata(&["generate", "--pack", p, "--tokens", "1", "--ring-slots", "8", "--adapt-decay", "7"]);
    assert_eq!(rc, 1);
    assert!(err.contains("--ring-slots, --adapt-decay") && err.contains("--expert-cache"), "{err}");
    // A ring larger than a layer's 8 experts is refused (it used to size an allocation from it).
    let huge = u64::MAX.to_string();
    let (rc, _, err) =
        strata(&["generate", "--pack", p, "--tokens", "1", "--expert-cache", "4", "--ring-slots", &huge]);
    assert_eq!(rc, 1);
    assert!(err.contains(&format!("ring_slots {huge} is more than one layer's 8 experts")), "{err}");
    // A bad sampling parameter fails before the ceilings and the load.
    let (rc, out, err) = strata(&["bench", "--pack", p, "--device", "cpu", "--temperature=-1"]);
    assert_eq!(rc, 1);
    assert!(err.contains("temperature") && !out.contains("measured") && !err.contains("loaded"), "{out}{err}");
    // Filters without a temperature: greedy, with a note.
    let (rc, out, err) =
        strata(&["generate", "--pack", p, "--tokens", "1,2", "-n", "2", "--top-k", "5", "--seed", "3"]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(out.split_whitespace().count(), 2, "{out}");
    assert!(err.contains("--top-k, --seed without --temperature: decoding is greedy"), "{err}");
    // More tokens than the context leaves: as many as fit, with a note (not an error after the last one).
    let (rc, out, err) = strata(&["generate", "--pack", p, "--tokens", "1", "-n", "32", "--context", "8"]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(out.split_whitespace().count(), 7, "{out}");
    assert!(err.contains("leaves room for 7 after the prompt's 1: generating 7, not 32"), "{err}");

    // A pack written into its own checkpoint directory is refused, and the checkpoint's files stay whole
    // (a copy of tokenizer.json onto itself truncated it).
    let ck = d.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures/a/bf16");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let f = entry.unwrap().path();
        std::fs::copy(&f, ck.join(f.file_name().unwrap())).unwrap();
    }
    let tok_len = std::fs::metadata(ck.join("tokenizer.json")).unwrap().len();
    let c = ck.to_str().unwrap();
    let (rc, _, err) = strata(&["pack", "--from", c, "--out", c, "--force"]);
    assert_eq!(rc, 1);
    assert!(err.contains("is the checkpoint directory itself"), "{err}");
    assert_eq!(std::fs::metadata(ck.join("tokenizer.json")).unwrap().len(), tok_len);
    assert!(tok_len > 0 && !ck.join("manifest.json").exists());
}
