#!/usr/bin/env bash
# bindings/test-all.sh: CI driver for the C API bindings.
#
# Makes a tiny pack, asks the Rust API (`strata generate`) for the tokens of a
# greedy run, of a seeded sampling run and of that run on a copy of the pack
# that names an end-of-generation token, and checks that every binding
# produces exactly those tokens through the C API: the C example, the C test
# program (also under valgrind), the dlopen plugin host, the Python example,
# and the Go package (go test + its example). Swift is built and run when a
# Swift toolchain is available. Prints PASS/FAIL/SKIP per binding; exits 1 on
# any failure. Missing tools (go, valgrind) are installed from the machine's
# Debian packages when running as root.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
LIB="$ROOT/target/release/libstrata.so"
CLI="$ROOT/target/release/strata"
START=$SECONDS

# --- inputs ------------------------------------------------------------------
PROMPT=1,2,3,4,5
N=16
SEED=42
TEMPERATURE=0.8
TOP_K=40
TOP_P=0.95
TEXT_PROMPT="The river carried"

declare -a SUMMARY=()
FAILED=0
pass() { SUMMARY+=("PASS $1${2:+: $2}"); echo "PASS $1${2:+: $2}"; }
fail() { SUMMARY+=("FAIL $1: $2"); echo "FAIL $1: $2"; FAILED=1; }
skip() { SUMMARY+=("SKIP $1: $2"); echo "SKIP $1: $2"; }
die() { echo "test-all: $*" >&2; exit 1; }

if [ ! -f "$LIB" ] || [ ! -x "$CLI" ] || [ ! -f "$ROOT/include/strata.h" ]; then
  echo "== cargo build --release"
  cargo build --release || die "cargo build --release failed"
fi
[ -f "$ROOT/include/strata.h" ] || die "include/strata.h is missing (the C API header)"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/strata-bindings.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# --- tools: install what is missing from Debian packages (root only) ----------
APT_UPDATED=0
apt_install() { # apt_install PACKAGE...
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    return 1
  fi
  if [ "$APT_UPDATED" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$TMP/apt-update.log" 2>&1 || return 1
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >"$TMP/apt-install.log" 2>&1
}
command -v go >/dev/null || { echo "== installing golang-go"; apt_install golang-go || true; }
command -v valgrind >/dev/null || { echo "== installing valgrind"; apt_install valgrind || true; }

# A Swift *language* toolchain (Debian's `swift` package is OpenStack Swift).
have_swift() { command -v swiftc >/dev/null && swift build --version >/dev/null 2>&1; }
if ! have_swift && [ "$(id -u)" = 0 ] && command -v apt-cache >/dev/null; then
  [ "$APT_UPDATED" = 1 ] || { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 && APT_UPDATED=1; }
  if apt-cache policy swiftlang 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    echo "== installing swiftlang"
    apt_install swiftlang || true
  fi
fi

# --- the pack and the Rust API's tokens ---------------------------------------
echo "== pack and expected tokens"
PACK="$TMP/tiny"
"$CLI" synth --preset tiny --out "$PACK" --seed 7 >/dev/null 2>"$TMP/synth.log" || {
  cat "$TMP/synth.log"; die "strata synth failed"; }
# A second pack, of another model, with a tokenizer (for the tokenizer checks).
TOKPACK="$TMP/fixture-a"
"$CLI" pack --from "$ROOT/tests/data/fixtures/a/bf16" --out "$TOKPACK" >/dev/null 2>"$TMP/pack.log" || {
  cat "$TMP/pack.log"; die "strata pack failed"; }

first_line() { head -n 1 | tr -s ' ' | sed 's/^ //; s/ $//'; }

EXPECT_SAMPLED=$("$CLI" generate --pack "$PACK" --tokens "$PROMPT" -n "$N" --temperature "$TEMPERATURE" \
  --top-k "$TOP_K" --top-p "$TOP_P" --seed "$SEED" 2>/dev/null | first_line)
EXPECT_GREEDY=$("$CLI" generate --pack "$PACK" --tokens "$PROMPT" -n "$N" 2>/dev/null | first_line)
EXPECT_TEXT=$("$CLI" generate --pack "$TOKPACK" --prompt "$TEXT_PROMPT" -n "$N" --temperature "$TEMPERATURE" \
  --top-k "$TOP_K" --top-p "$TOP_P" --seed "$SEED" 2>/dev/null | first_line)
echo "greedy:  $EXPECT_GREEDY"
echo "sampled: $EXPECT_SAMPLED"
echo "text:    $EXPECT_TEXT   (\"$TEXT_PROMPT\" on $(basename "$TOKPACK"))"
[ "$(wc -w <<<"$EXPECT_GREEDY")" = "$N" ] && [ "$(wc -w <<<"$EXPECT_SAMPLED")" = "$N" ] ||
  die "strata generate did not print $N tokens"
[ "$EXPECT_GREEDY" != "$EXPECT_SAMPLED" ] || die "greedy and sampled tokens are equal: the check would be weak"

GREEDY_ARGS=("$PACK" "$PROMPT" "$N" "$SEED")
SAMPLED_ARGS=("$PACK" "$PROMPT" "$N" "$SEED" "$TEMPERATURE" "$TOP_K" "$TOP_P")

# A copy of the pack that names an end-of-generation token: the first
# sampled token (after the first) not sampled before it. Generation stops
# there, before printing it; every binding must stop at the same place.
EOSPACK="$TMP/tiny-eos"
cp -r "$PACK" "$EOSPACK"
EOS_TOKEN=$(python3 - "$EOSPACK/manifest.json" $EXPECT_SAMPLED <<'PY'
import json, sys
path, toks = sys.argv[1], sys.argv[2:]
k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
m = json.load(open(path))
m["eos_token_ids"] = [int(toks[k])]
json.dump(m, open(path, "w"))
print(toks[k])
PY
) || die "could not add an end-of-generation token to the pack"
EXPECT_EOS=$("$CLI" generate --pack "$EOSPACK" --tokens "$PROMPT" -n "$N" --temperature "$TEMPERATURE" \
  --top-k "$TOP_K" --top-p "$TOP_P" --seed "$SEED" 2>/dev/null | first_line)
echo "eos:     $EXPECT_EOS   (end-of-generation token $EOS_TOKEN)"
case " $EXPECT_SAMPLED " in
  " $EXPECT_EOS $EOS_TOKEN "*) ;;
  *) die "strata generate did not stop before end-of-generation token $EOS_TOKEN" ;;
esac
EOS_ARGS=("$EOSPACK" "$PROMPT" "$N" "$SEED" "$TEMPERATURE" "$TOP_K" "$TOP_P")

# Run a command; the exit status must be 0 and the tokens as expected.
run_case() { # run_case NAME WANT COMMAND...
  local name=$1 want=$2 log got rc
  shift 2
  log="$TMP/$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
  got=$("$@" 2>"$log" | first_line; exit "${PIPESTATUS[0]}")
  rc=$?
  if [ "$rc" != 0 ] || [ "$got" != "$want" ]; then
    echo "--- $name (exit $rc): stderr tail"; tail -n 40 "$log" | sed 's/^/    /'
    echo "--- $name: got  '$got'"
    echo "--- $name: want '$want'"
    return 1
  fi
  return 0
}

# --- C -------------------------------------------------------------------------
echo "== C"
if make -s -C bindings/c clean all >"$TMP/c-build.log" 2>&1; then
  C=bindings/c
  ok=1
  run_case "c example greedy" "$EXPECT_GREEDY" "$C/example" "${GREEDY_ARGS[@]}" || ok=0
  run_case "c example sampled" "$EXPECT_SAMPLED" "$C/example" "${SAMPLED_ARGS[@]}" || ok=0
  run_case "c example eos" "$EXPECT_EOS" "$C/example" "${EOS_ARGS[@]}" || ok=0
  run_case "c example text" "$EXPECT_TEXT" "$C/example" "$TOKPACK" "$TEXT_PROMPT" "$N" "$SEED" \
    "$TEMPERATURE" "$TOP_K" "$TOP_P" || ok=0
  [ $ok = 1 ] && pass "c example" "greedy, sampled, end-of-generation stop and text prompt match strata generate" || fail "c example" "see above"

  ok=1
  export STRATA_TOKENIZER_PACK="$TOKPACK"
  run_case "c test greedy" "$EXPECT_GREEDY" "$C/test" "${GREEDY_ARGS[@]}" || ok=0
  run_case "c test sampled" "$EXPECT_SAMPLED" "$C/test" "${SAMPLED_ARGS[@]}" || ok=0
  [ $ok = 1 ] && pass "c test" "$(grep -h 'checks,' "$TMP/c_test_sampled.log" | tail -n 1 | sed 's/^test: //'); greedy and sampled match" ||
    fail "c test" "see above"

  if command -v valgrind >/dev/null; then
    # Definite leaks and memory errors fail; rayon's global pool threads stay
    # "still reachable", which is not a leak.
    if run_case "c test valgrind" "$EXPECT_SAMPLED" env STRATA_TEST_CYCLES=20 valgrind -q --leak-check=full \
      --show-leak-kinds=definite --errors-for-leak-kinds=definite --error-exitcode=1 "$C/test" "${SAMPLED_ARGS[@]}"; then
      pass "c test under valgrind" "no memory errors, no definite leaks over 20 load/free cycles"
    else
      fail "c test under valgrind" "see above"
    fi
  else
    skip "c test under valgrind" "valgrind is not installed and could not be installed (not root, or no apt-get)"
  fi
  unset STRATA_TOKENIZER_PACK

  ok=1
  run_case "plugin host greedy" "$EXPECT_GREEDY" "$C/plugin_host" "$LIB" "${GREEDY_ARGS[@]}" || ok=0
  run_case "plugin host sampled" "$EXPECT_SAMPLED" "$C/plugin_host" "$LIB" "${SAMPLED_ARGS[@]}" || ok=0
  run_case "plugin host eos" "$EXPECT_EOS" "$C/plugin_host" "$LIB" "${EOS_ARGS[@]}" || ok=0
  [ $ok = 1 ] && pass "c plugin host" "dlopen + strata_get_api only; tokens and end-of-generation stop match" || fail "c plugin host" "see above"
else
  sed 's/^/    /' "$TMP/c-build.log"
  fail "c" "build failed"
fi

# --- Python --------------------------------------------------------------------
echo "== Python"
if command -v python3 >/dev/null; then
  export STRATA_LIB="$LIB"
  ok=1
  (cd bindings/python && python3 check_layout.py "$ROOT/include") >"$TMP/py-layout.log" 2>&1 ||
    { sed 's/^/    /' "$TMP/py-layout.log"; ok=0; }
  run_case "python greedy" "$EXPECT_GREEDY" python3 bindings/python/example.py "${GREEDY_ARGS[@]}" || ok=0
  run_case "python sampled" "$EXPECT_SAMPLED" python3 bindings/python/example.py "${SAMPLED_ARGS[@]}" || ok=0
  run_case "python eos" "$EXPECT_EOS" python3 bindings/python/example.py "${EOS_ARGS[@]}" || ok=0
  run_case "python text" "$EXPECT_TEXT" python3 bindings/python/example.py "$TOKPACK" "$TEXT_PROMPT" "$N" \
    "$SEED" "$TEMPERATURE" "$TOP_K" "$TOP_P" || ok=0
  [ $ok = 1 ] && pass "python" "ctypes layout matches strata.h; greedy, sampled, end-of-generation stop and text match" ||
    fail "python" "see above"
  unset STRATA_LIB
else
  skip "python" "python3 is not installed"
fi

# --- Go ------------------------------------------------------------------------
echo "== Go"
if command -v go >/dev/null; then
  export GOPROXY=off GOTOOLCHAIN=local # no dependencies: never touch the network
  [ -n "${HOME:-}" ] || export GOCACHE="$TMP/go-cache"
  ok=1
  if ! (cd bindings/go && go vet ./... && go build -o "$TMP/go-example" ./cmd/strata-example) \
    >"$TMP/go-build.log" 2>&1; then
    sed 's/^/    /' "$TMP/go-build.log"
    ok=0
  else
    if ! (cd bindings/go && STRATA_PACK="$PACK" STRATA_PROMPT="$PROMPT" STRATA_N="$N" STRATA_SEED="$SEED" \
      STRATA_TEMPERATURE="$TEMPERATURE" STRATA_TOP_K="$TOP_K" STRATA_TOP_P="$TOP_P" \
      STRATA_EXPECT_GREEDY="$EXPECT_GREEDY" STRATA_EXPECT_SAMPLED="$EXPECT_SAMPLED" \
      go test -count=1 -v ./...) >"$TMP/go-test.log" 2>&1; then
      sed 's/^/    /' "$TMP/go-test.log" | tail -n 40
      ok=0
    elif grep -q -- '--- SKIP' "$TMP/go-test.log"; then
      sed 's/^/    /' "$TMP/go-test.log" | tail -n 20
      ok=0
    fi
    run_case "go example greedy" "$EXPECT_GREEDY" "$TMP/go-example" "${GREEDY_ARGS[@]}" || ok=0
    run_case "go example sampled" "$EXPECT_SAMPLED" "$TMP/go-example" "${SAMPLED_ARGS[@]}" || ok=0
    run_case "go example eos" "$EXPECT_EOS" "$TMP/go-example" "${EOS_ARGS[@]}" || ok=0
  fi
  [ $ok = 1 ] && pass "go" "$(go version | awk '{print $3}'): go test ($(grep -c '^--- PASS' "$TMP/go-test.log") tests) and the example match" ||
    fail "go" "see above"
else
  skip "go" "no go toolchain, and it could not be installed (not root, or no apt-get)"
fi

# --- Swift ---------------------------------------------------------------------
echo "== Swift"
if have_swift; then
  if (cd bindings/swift && swift build -c release) >"$TMP/swift-build.log" 2>&1; then
    SWIFT_EXE=$(cd bindings/swift && swift build -c release --show-bin-path)/strata-example
    ok=1
    run_case "swift greedy" "$EXPECT_GREEDY" "$SWIFT_EXE" "${GREEDY_ARGS[@]}" || ok=0
    run_case "swift sampled" "$EXPECT_SAMPLED" "$SWIFT_EXE" "${SAMPLED_ARGS[@]}" || ok=0
    run_case "swift eos" "$EXPECT_EOS" "$SWIFT_EXE" "${EOS_ARGS[@]}" || ok=0
    [ $ok = 1 ] && pass "swift" "greedy, sampled and end-of-generation stop match" || fail "swift" "see above"
  else
    tail -n 40 "$TMP/swift-build.log" | sed 's/^/    /'
    fail "swift" "swift build failed"
  fi
else
  skip "swift" "no toolchain from the machine's package sources (Debian bookworm has no swiftlang; its 'swift' is OpenStack Swift)"
fi

# --- summary -------------------------------------------------------------------
echo "== summary ($((SECONDS - START)) s)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
