# Shared set-up for scripts/test and scripts/demo: create .venv at the repo root and
# install the project into it (once per change of pyproject.toml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[sakura] creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=".venv/.sakura-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[sakura] installing the project into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 is pinned in pyproject.toml, so it is resolved in this same pip call.
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
