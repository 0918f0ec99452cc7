#!/usr/bin/env bash
# Prints ptxas's resource report of every kernel (registers, shared memory,
# stack frame, spills) per target, from the last `--features cuda` build's
# $OUT_DIR/ptxas.tsv (written by build.rs next to the raw ptxas.txt; under
# $CARGO_TARGET_DIR when set, else target/). With no
# such build, compiles the kernels first (`cargo check --features cuda --lib`).
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
latest() {
  ls -t "$target_dir"/*/build/strata-*/out/ptxas.tsv 2>/dev/null | head -1 || true
}

report="$(latest)"
if [ -z "$report" ]; then
  echo "no kernel build under target/: compiling the kernels (cargo check --features cuda --lib)" >&2
  cargo check --quiet --features cuda --lib >&2
  report="$(latest)"
fi
if [ -z "$report" ]; then
  echo "ptxas-report.sh: no ptxas.tsv under $target_dir/*/build/strata-*/out/ after building" >&2
  exit 1
fi

echo "ptxas report: $(dirname "$report")/ptxas.txt"
column -t -s $'\t' "$report"
awk -F'\t' 'NR > 1 {
    n++; if ($3 > maxreg) { maxreg = $3; maxk = $1 " (" $2 ")" }
    if ($5 > 0 || $6 > 0 || $7 > 0) { bad++; list = list "\n  " $1 " on " $2 ": stack " $5 " B, spill stores " $6 " B, spill loads " $7 " B" }
  }
  END {
    printf "%d kernel images; most registers: %d in %s; %d with a stack frame or spills%s\n", n, maxreg, maxk, bad, list
  }' "$report"
