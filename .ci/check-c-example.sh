#!/usr/bin/env bash
# Builds the complete C example of docs/c-api.md against include/strata.h and
# the release library, and runs it on a tiny synthetic pack: the guide's
# code is a program that works, not a sketch.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release
out=${CARGO_TARGET_DIR:-target}/release
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The code between "```c" + "#include <stdio.h>" and the closing fence.
awk '/^```c$/ { getline first; if (first == "#include <stdio.h>") { grab = 1; print first; next } }
     grab && /^```$/ { exit }
     grab { print }' docs/c-api.md >"$work/example.c"
test -s "$work/example.c" || { echo "check-c-example: no complete example in docs/c-api.md" >&2; exit 1; }

cc -std=c99 -Wall -Wextra -Werror -pedantic -Iinclude "$work/example.c" -o "$work/example" \
  -L"$out" -Wl,-rpath,"$out" -lstrata
"$out/strata" synth --arch qwen3_moe --preset tiny --out "$work/pack" >/dev/null 2>&1
"$work/example" "$work/pack" >"$work/stdout" 2>"$work/stderr" || {
  cat "$work/stderr" >&2
  echo "check-c-example: the guide's example failed" >&2
  exit 1
}
lines=$(wc -l <"$work/stdout")
if [ "$lines" != 2 ] || ! grep -q "loaded pack" "$work/stderr" || ! grep -q "refused: " "$work/stderr"; then
  cat "$work/stdout" "$work/stderr" >&2
  echo "check-c-example: unexpected output (want 2 lines of tokens, a load log and a refused prefill)" >&2
  exit 1
fi
echo "check-c-example: docs/c-api.md's example builds and runs"
