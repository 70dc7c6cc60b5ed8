#!/usr/bin/env bash
# Idempotent set-up for a fresh clone: Debian's OpenBLAS (Linux) and a venv with tinymlx and the extras
# the caller sets in $extras before sourcing this ("" for running it, "test", "serve", "bench", "dev").
# Sourced by scripts/tinymlx and scripts/test. No model is fetched here: `tinymlx chat` downloads its model
# itself, with the download's bytes, speed and time on its loading screen (generate and serve show a bar).
set -euo pipefail
extras="${extras:-}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
openblas=/usr/lib/x86_64-linux-gnu/libopenblas.so.0

if [ "$(uname -s)" = "Linux" ] && [ ! -e "$openblas" ] && command -v apt-get >/dev/null; then
  # MLX's Linux wheel bundles reference BLAS; OpenBLAS makes float32 matmuls ~30x faster.
  echo "[setup] installing Debian's libopenblas0-pthread" >&2
  sudo_="" ; [ "$(id -u)" -ne 0 ] && sudo_="sudo"
  $sudo_ apt-get update -qq >/dev/null && $sudo_ apt-get install -y -qq libopenblas0-pthread >/dev/null
fi

# One stamp per extras set: asking for a set not installed yet (or a newer pyproject.toml) installs it,
# and only it: running tinymlx never pulls the test suite's torch and transformers.
stamp="$venv/.tinymlx-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing tinymlx${extras:+[$extras]} into .venv (a few minutes the first time)" >&2
  # pip's own chatter (build warnings, index notices) goes to a log, shown only when something fails.
  log="$root/.venv-install.log"
  if ! {
    { [ -x "$venv/bin/python" ] || { python3 -m venv "$venv" && "$venv/bin/python" -m pip install --upgrade pip; }; } &&
      "$venv/bin/python" -m pip install -e "$root${extras:+[$extras]}"
  } >"$log" 2>&1; then
    echo "[setup] the install failed; the end of its log ($log):" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
  touch "$stamp"
fi

if [ "$(uname -s)" = "Linux" ] && [ -e "$openblas" ]; then
  export LD_PRELOAD="$openblas${LD_PRELOAD:+:$LD_PRELOAD}"
  # Debian's OpenBLAS (0.3.21) takes CPUs newer than itself for Haswell and runs AVX2 kernels on AVX-512
  # (an AMD EPYC of family 26 here: float32 GEMMs of 512 rows ran 1.9x faster with SkylakeX's, of 85 rows up to 1.7x; 1-16 rows level).
  if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo &&
    grep -qw avx512vl /proc/cpuinfo && grep -qw avx512dq /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SKYLAKEX
  fi
fi
export PATH="$venv/bin:$PATH"
