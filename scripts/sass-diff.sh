#!/usr/bin/env bash
# Which kernels' machine code a change alters: compiles kernels/ of a git
# revision and of the working tree as build.rs does (one translation unit,
# -O3 -std=c++17, per target), disassembles both (cuobjdump -sass; spacing
# squeezed: cuobjdump aligns columns to a file's longest line) and lists
# per target the kernels whose SASS differs, was added or was removed.
#
#   scripts/sass-diff.sh BASE [ARCH...]
#
# ARCH default: the H200's image as build.rs makes it (90, or 90a when a
# kernel uses wgmma/setmaxnreg, build.rs's SM90A_MARKERS).
#
# A refactor whose sm_90 SASS is identical runs on the H200 exactly as the
# code the GPU suite last ran; anything listed needs a suite run there.
# Exit status: 0 identical, 1 some kernel differs, 2 usage or tool error.
# Needs nvcc (scripts/install-nvcc.sh) and installs cuobjdump and nvdisasm
# from PyPI into .cuda/tools (13.0's are not on PyPI; 13.2's read 13.0
# cubins). Set KEEP=1 to keep the per-kernel SASS under the printed folder.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

if [ $# -lt 1 ]; then
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
base="$1"
shift
archs=("$@")
if [ ${#archs[@]} -eq 0 ]; then
  archs=(90)
  if cat kernels/*.cu kernels/*.cuh | grep -qE 'wgmma|setmaxnreg|__CUDA_ARCH_FEAT_SM90_ALL'; then archs=(90a); fi
fi
if ! git rev-parse --verify --quiet "$base^{commit}" >/dev/null; then
  echo "sass-diff.sh: $base is not a revision of this repository" >&2
  exit 2
fi

nvcc="${NVCC:-$(bash scripts/install-nvcc.sh 2>/dev/null | tail -1)}"
tools="$repo/.cuda/tools"
tools_version="13.2.86"
bin="$tools/nvidia/cu13/bin"
if [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ] ||
  ! ls -d "$tools"/nvidia_cuda_nvdisasm-"$tools_version".dist-info >/dev/null 2>&1; then
  echo "installing cuobjdump and nvdisasm $tools_version into $tools" >&2
  rm -rf "$tools.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$tools.tmp" \
    "nvidia-cuda-cuobjdump==$tools_version" "nvidia-cuda-nvdisasm==$tools_version" >&2
  rm -rf "$tools"
  mv "$tools.tmp" "$tools"
fi

work="$(mktemp -d)"
if [ -z "${KEEP:-}" ]; then
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work/base" "$work/new"
git archive "$base" kernels | tar -x -C "$work/base"
cp -r kernels "$work/new/"

# One side's SASS, one file per kernel: $work/<side>/sm_<arch>/<kernel>.sass.
disassemble() {
  local side="$1" arch="$2" dir="$work/$1"
  local unity="$dir/unity.cu" out="$dir/sm_$arch"
  mkdir -p "$out"
  : >"$unity"
  for f in "$dir"/kernels/*.cu; do echo "#include \"$f\"" >>"$unity"; done
  "$nvcc" -cubin -O3 -std=c++17 -gencode "arch=compute_$arch,code=sm_$arch" -I "$dir/kernels" \
    -o "$out/k.cubin" "$unity"
  PATH="$bin:$PATH" "$bin/cuobjdump" -sass "$out/k.cubin" |
    awk -v out="$out" '/Function : / { f = out "/" $3 ".sass"; next } f != "" && NF > 0 { $1 = $1; print > f }'
}

status=0
for a in "${archs[@]}"; do
  a="${a#sm_}"
  disassemble base "$a" &
  disassemble new "$a" &
  wait -n && wait -n || { echo "sass-diff.sh: compiling for sm_$a failed" >&2; exit 2; }
  changed=()
  for f in "$work/base/sm_$a"/*.sass "$work/new/sm_$a"/*.sass; do
    k="$(basename "$f" .sass)"
    if [ ! -f "$work/base/sm_$a/$k.sass" ]; then
      changed+=("$k (added)")
    elif [ ! -f "$work/new/sm_$a/$k.sass" ]; then
      changed+=("$k (removed)")
    elif ! cmp -s "$work/base/sm_$a/$k.sass" "$work/new/sm_$a/$k.sass"; then
      changed+=("$k")
    fi
  done
  mapfile -t changed < <(printf '%s\n' "${changed[@]+"${changed[@]}"}" | sed '/^$/d' | sort -u)
  total="$(ls "$work/new/sm_$a" | grep -c '\.sass$' || true)"
  if [ ${#changed[@]} -eq 0 ]; then
    echo "sm_$a: all $total kernels identical to $base"
  else
    status=1
    echo "sm_$a: ${#changed[@]} of $total kernels differ from $base:"
    printf '  %s\n' "${changed[@]}"
  fi
done
[ -z "${KEEP:-}" ] || echo "SASS kept under $work"
exit $status
