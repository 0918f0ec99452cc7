#!/usr/bin/env bash
# The GPU checks and benches of docs/performance.md and docs/layer-split.md
# on a CUDA machine, from binaries built elsewhere (the H200 machine has no
# Rust toolchain):
#
#   STRATA_CUDA_ARCHS=90 cargo test --release --features cuda,test-hooks --test gpu --no-run
#   cargo build --release --features cuda,test-hooks --bin strata
#   # copy target/release/deps/gpu-<hash> to BIN/gpu-suite, target/release/strata to BIN/strata
#   BIN=.dev/carry OUT=/some/dir bash scripts/device-check.sh suite stress bench
#
# Phases (each prints to stdout and to OUT/<phase>.log):
#   suite     the whole GPU suite (its last line: "gpu suite: N passed, M failed")
#   stress    the split tests with STRATA_SPLIT_STRESS=1 (every producing stream
#             delayed before each event another stream waits on)
#   memcheck  compute-sanitizer memcheck over the suite, timing tests skipped
#   bench     30b-a3b synth pack, all resident: decode at context 4128 (three
#             benches) and 48, prefill 4096
#   split     the same pack split over two logical devices of GPU 0, help off and on
#   cache     the expert-cache matrix: 100/50/25/10% of the 6144 experts of
#             30b-a3b in VRAM slots, the rest in page-locked RAM, uniform
#             routing (a `--spread-routing` pack: routing stays uniform at
#             every depth) and skewed (`--zipf 1.2`), the default ring; its
#             two packs take 39 GB of disk (each 30b-a3b pack 19.4 GB: run
#             it apart from bench and split on a 64 GB disk)
#   breakdown the all-resident decode step with each kernel left out in turn
#             (STRATA_DECODE_SKIP): each kernel's share of the step
#   crossover the ring threshold's crossover: a 512-token prompt in chunks of
#             8..128 tokens (routing to 39..100% of a layer's experts) at
#             25% of the experts in slots, every miss streamed (threshold 0)
#             against misses copied into slots (threshold 2); about 3 min
#   ktrace    the all-resident decode step's kernel timeline (scripts/ktrace.c,
#             built as its header says, carried as BIN/libktrace.so): every
#             kernel's increment to the step (scripts/ktrace.py)
#   two-gpu   (issue 8, a machine with 2 GPUs) the split tests, whose matrix
#             then has cuda:0,cuda:1 paths; the spread 30b-a3b pack split
#             over the two GPUs with 1536 slots each (25% of the experts per
#             GPU) against one GPU with 3072, help off and on; the hand-off
#             line gives each hand-off's time and rate over the peer link
#   chain     (no carried binaries needed) scripts/chain-bench.cu, compiled
#             with the machine's nvcc: a chain of GEMVs as programmatic
#             launches against a persistent kernel with a streamed weight
#             ring (counter and LL hand-offs); each GEMV checked on the host
# Run from the repository root (the suite finds tests/data there).
set -uo pipefail
BIN="${BIN:-.dev/carry}"
OUT="${OUT:-/tmp/strata-device-check}"
PACK="${PACK:-/tmp/p30}"
mkdir -p "$OUT"
suite="$BIN/gpu-suite"
strata="$BIN/strata"
for p in "$@"; do
  [ "$p" = chain ] && continue
  [ -x "$suite" ] && [ -x "$strata" ] || { echo "need $suite and $strata" >&2; exit 2; }
done

pack() {
  [ -d "$PACK" ] || "$strata" synth --preset 30b-a3b --out "$PACK" >/dev/null
}

phase() {
  local name="$1"
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}

status=0
for p in "$@"; do
  case "$p" in
    suite) phase suite "$suite" || status=1 ;;
    stress) phase stress env STRATA_SPLIT_STRESS=1 "$suite" split_ || status=1 ;;
    memcheck)
      phase memcheck env STRATA_GPU_SKIP=timing compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$suite" || status=1
      ;;
    bench)
      pack
      for i in 1 2 3; do
        phase "bench-4096-$i" "$strata" bench --pack "$PACK" --prompt-len 4096 --gen 64 --repeats 3 || status=1
      done
      phase bench-16 "$strata" bench --pack "$PACK" --prompt-len 16 --gen 64 --repeats 3 || status=1
      ;;
    split)
      pack
      for help in off on; do
        phase "split-help-$help" "$strata" bench --pack "$PACK" --device cuda:0,cuda:0 --prefill-help "$help" \
          --prompt-len 4096 --gen 32 --repeats 3 || status=1
      done
      ;;
    cache)
      spread="${PACK}-spread"
      skewed="${PACK}-zipf"
      [ -d "$spread" ] || "$strata" synth --preset 30b-a3b --spread-routing --out "$spread" >/dev/null
      [ -d "$skewed" ] || "$strata" synth --preset 30b-a3b --spread-routing --zipf 1.2 --out "$skewed" >/dev/null
      for p in "$spread" "$skewed"; do
        for pct in 100 50 25 10; do
          phase "cache-$(basename "$p")-$pct" "$strata" bench --pack "$p" --expert-cache $((6144 * pct / 100)) \
            --resident-budget-gib 20 --prompt-len 4096 --gen 16 --repeats 3 || status=1
        done
      done
      ;;
    breakdown)
      pack
      phase breakdown-all "$strata" bench --pack "$PACK" --prompt-len 4096 --gen 64 --repeats 2 || status=1
      for k in qkv prep attn oproj router gateup down head; do
        phase "breakdown-$k" env STRATA_DECODE_SKIP="$k" "$strata" bench --pack "$PACK" --prompt-len 4096 --gen 64 \
          --repeats 2 || status=1
      done
      ;;
    crossover)
      spread="${PACK}-spread"
      [ -d "$spread" ] || "$strata" synth --preset 30b-a3b --spread-routing --out "$spread" >/dev/null
      for chunk in 8 16 32 64 128; do
        for th in 0 2; do
          phase "crossover-$chunk-$th" timeout 100 "$strata" bench --pack "$spread" --expert-cache 1536 \
            --resident-budget-gib 20 --ring-slots 64 --ring-threshold "$th" --prompt-len 512 --chunk "$chunk" \
            --gen 16 --repeats 3 || status=1
        done
      done
      ;;
    ktrace)
      pack
      cupti=$(find /usr/local/cuda*/ -name 'libcupti.so.13*' 2>/dev/null | head -1)
      [ -f "$BIN/libktrace.so" ] && [ -n "$cupti" ] || { echo "ktrace: need $BIN/libktrace.so and CUPTI" >&2; status=1; continue; }
      phase ktrace-bench env LD_LIBRARY_PATH="$(dirname "$cupti"):${LD_LIBRARY_PATH:-}" \
        CUDA_INJECTION64_PATH="$(realpath "$BIN/libktrace.so")" KTRACE_OUT="$OUT/ktrace.csv" \
        "$strata" bench --pack "$PACK" --prompt-len 4096 --gen 24 --repeats 1 || status=1
      phase ktrace python3 "$(dirname "$0")/ktrace.py" "$OUT/ktrace.csv" || status=1
      ;;
    two-gpu)
      phase two-gpu-tests "$suite" split_ || status=1
      phase two-gpu-stress env STRATA_SPLIT_STRESS=1 "$suite" split_ || status=1
      spread="${PACK}-spread"
      [ -d "$spread" ] || "$strata" synth --preset 30b-a3b --spread-routing --out "$spread" >/dev/null
      common=(--resident-budget-gib 40 --prompt-len 4096 --gen 32 --repeats 3)
      phase two-gpu-one "$strata" bench --pack "$spread" --device cuda:0 --expert-cache 3072 "${common[@]}" || status=1
      for help in off on; do
        phase "two-gpu-split-$help" "$strata" bench --pack "$spread" --device cuda:0,cuda:1 --expert-cache 1536 \
          --prefill-help "$help" "${common[@]}" || status=1
      done
      pack
      phase two-gpu-resident "$strata" bench --pack "$PACK" --device cuda:0,cuda:1 --prompt-len 4096 --gen 64 \
        --repeats 3 || status=1
      ;;
    chain)
      nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
      "$nvcc" -O3 -std=c++17 -arch=sm_90a -Xcompiler -fopenmp -o "$OUT/chain-bench" \
        "$(dirname "$0")/chain-bench.cu" || { status=1; continue; }
      phase chain "$OUT/chain-bench" all 20 || status=1
      ;;
    *) echo "unknown phase $p (suite, stress, memcheck, bench, split, cache, breakdown, crossover, ktrace, two-gpu, chain)" >&2; status=2 ;;
  esac
done
exit "$status"
