# Shared set-up for scripts/test and scripts/demo: create .venv at the repo root and
# install the project and the native runtime (native/, C++ via scikit-build-core) into it,
# again whenever pyproject.toml or the native sources change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[sakura] creating .venv with $PY"
  "$PY" -m venv .venv
fi
# Debian packages of the phone-side checks: the arm64 cross compiler and qemu-user
# (edge/backends/arm64.py), pocl, a CPU OpenCL implementation (native OpenCL kernels);
# libcurl and OpenSSL headers for the native runtime's receive stage (native/); nginx-light,
# the static origin the pack tests and `sakura bench origins` start on loopback (cloud/origins.py);
# tcpdump, the packet captures of scripts/stall_capture.py.
# utf8proc, the Unicode data of the native WordPiece tokenizer (native/src/sakura/tokenizer.cpp).
# libpng and nlohmann-json for the sakura-edge executable (native/src/edge/: the PNG, the
# catalog and manifest JSON), strace for its no-interpreter check (tests/native/test_sakura_edge.py).
apt_pkgs="g++-aarch64-linux-gnu qemu-user pocl-opencl-icd ocl-icd-opencl-dev opencl-headers
  libcurl4-openssl-dev libssl-dev nginx-light nftables tcpdump libutf8proc-dev
  libpng-dev nlohmann-json3-dev strace"
apt_missing="$(for p in $apt_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)"
if [ -n "$apt_missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[sakura] installing Debian packages:" $apt_missing
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $apt_missing
fi
# Debian's arm64 multiarch libraries of sakura-edge cross-built for arm64 and run under
# qemu-aarch64 (edge/backends/arm64_edge.py; the loader and libc run the binary, the -dev
# packages link it). Not fatal: without them only tests/native/test_sakura_edge_arm64.py and
# the arm64 key of `sakura bench phone` skip, saying which package is missing.
arm64_pkgs="libcurl4-openssl-dev:arm64 libssl-dev:arm64 libpng-dev:arm64 libutf8proc-dev:arm64
  libpython3.11:arm64 libstdc++6:arm64"
arm64_missing="$(for p in $arm64_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)"
if [ -n "$arm64_missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && [ "$(dpkg --print-architecture)" = amd64 ]; then
  echo "[sakura] installing Debian's arm64 packages:" $arm64_missing
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then dpkg --add-architecture arm64; fi
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $arm64_missing; } \
    || echo "[sakura] warning: the arm64 packages did not install; the arm64 sakura-edge tests skip"
fi
stamp=".venv/.sakura-installed"
want="$(find pyproject.toml native/pyproject.toml native/CMakeLists.txt native/cmake native/src -type f \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[sakura] installing the project into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # [all,dev]: every extra (the model with torch==2.13.0, executorch, qnn, aihub, diffusers,
  # s3, ray) and the test tools, resolved in this same pip call, with native/'s build tools.
  .venv/bin/python -m pip install -q -e ".[all,dev]" "pybind11~=3.1" "scikit-build-core~=1.1"
  # ./native builds the sakura_native extension (g++ >= 9, CMake >= 3.18) against the
  # executorch and torch just installed (its edit runtime links the executorch wheel's C++
  # runtime), so without build isolation.
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation ./native
  echo "$want" > "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
