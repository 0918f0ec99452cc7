#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler from PyPI into <repo>/.cuda/site,
# where build.rs finds it when NVCC, CUDA_HOME and PATH have none
# (shared/tools/cuda-from-pypi.md: nvcc, cicc, headers; no driver, no GPU
# needed). Idempotent: does nothing when the pinned version is there.
# Prints the path of nvcc as its last line.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
site="$repo/.cuda/site"
nvcc="$site/nvidia/cu13/bin/nvcc"
version="13.0.88"
# Pinned to the 13.0 line as a whole (the H200 machine's driver is CUDA 13.0;
# PTX of a newer nvcc does not load there), and installed without
# dependencies so that nothing unpinned (nvvm 13.5) comes along.
packages=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cccl==13.0.85"
)

installed() {
  [ -x "$nvcc" ] && "$nvcc" --version 2>/dev/null | grep -q "V$version" || return 1
  local p name ver
  for p in "${packages[@]}"; do
    name="${p%%==*}"
    ver="${p##*==}"
    ls -d "$site/${name//-/_}-$ver.dist-info" >/dev/null 2>&1 || return 1
  done
}

if installed; then
  echo "nvcc $version is already installed" >&2
else
  if python3 -m pip --version >/dev/null 2>&1; then
    pip=(python3 -m pip)
  elif command -v pip3 >/dev/null; then
    pip=(pip3)
  else
    echo "install-nvcc.sh needs pip (python3 -m pip or pip3) to install ${packages[*]}" >&2
    exit 1
  fi
  echo "installing ${packages[*]} into $site" >&2
  rm -rf "$site.tmp"
  mkdir -p "$(dirname "$site")"
  "${pip[@]}" install --quiet --disable-pip-version-check --no-deps --no-compile --no-cache-dir \
    --target "$site.tmp" "${packages[@]}" >&2
  rm -rf "$site"
  mv "$site.tmp" "$site"
  if ! installed; then
    echo "install-nvcc.sh: $nvcc is not nvcc $version after the install" >&2
    exit 1
  fi
fi
"$nvcc" --version | tail -1 >&2
echo "$nvcc"
