#!/usr/bin/env bash
# Idempotent set-up for a fresh clone: Debian's OpenBLAS (Linux), a venv with tinymlx and its
# test/bench extras, and the default model in the user cache. Sourced by scripts/tinymlx and scripts/test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
openblas=/usr/lib/x86_64-linux-gnu/libopenblas.so.0

if [ "$(uname -s)" = "Linux" ] && [ ! -e "$openblas" ] && command -v apt-get >/dev/null; then
  # MLX's Linux wheel bundles reference BLAS; OpenBLAS makes float32 matmuls ~30x faster.
  echo "[setup] installing Debian's libopenblas0-pthread" >&2
  sudo_="" ; [ "$(id -u)" -ne 0 ] && sudo_="sudo"
  $sudo_ apt-get update -qq >/dev/null && $sudo_ apt-get install -y -qq libopenblas0-pthread >/dev/null
fi

stamp="$venv/.tinymlx-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] creating the venv and installing tinymlx (a few minutes the first time)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root[dev]"
  touch "$stamp"
fi

if [ "$(uname -s)" = "Linux" ] && [ -e "$openblas" ]; then
  export LD_PRELOAD="$openblas${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export PATH="$venv/bin:$PATH"
# Fetch and verify the default model once (cached in the user cache directory).
"$venv/bin/tinymlx" models fetch >/dev/null
