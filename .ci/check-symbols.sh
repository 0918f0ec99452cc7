#!/usr/bin/env bash
# Checks the exported C symbols of the release cdylib against the committed
# list include/strata.symbols (sorted, one per line). A listed symbol that is
# missing means a released symbol disappeared (never allowed); an exported
# strata_* symbol that is not listed is new API and must be added to the list.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release
lib=${CARGO_TARGET_DIR:-target}/release/libstrata.so
want=include/strata.symbols
have=$(mktemp)
trap 'rm -f "$have"' EXIT
nm -D --defined-only "$lib" | awk '{print $3}' | grep '^strata_' | LC_ALL=C sort -u >"$have"

fail=0
missing=$(LC_ALL=C comm -23 <(LC_ALL=C sort -u "$want") "$have")
extra=$(LC_ALL=C comm -13 <(LC_ALL=C sort -u "$want") "$have")
if [ -n "$missing" ]; then
  echo "check-symbols: released symbols missing from $lib (a symbol, once released, stays):" >&2
  echo "$missing" | sed 's/^/  /' >&2
  fail=1
fi
if [ -n "$extra" ]; then
  echo "check-symbols: new exported symbols; add them to $want (sorted) and to docs/c-api.md:" >&2
  echo "$extra" | sed 's/^/  /' >&2
  fail=1
fi
if ! LC_ALL=C sort -c "$want" 2>/dev/null; then
  echo "check-symbols: $want is not sorted (LC_ALL=C sort)" >&2
  fail=1
fi
if [ "$fail" = 0 ]; then
  echo "check-symbols: $(wc -l <"$have") exported symbols match $want"
fi
exit "$fail"
