#!/usr/bin/env bash
# The main job on the offline defaults: set up .venv, build the bundled sample corpus into
# ./store/sample (local extractor, SmolLM2), then answer a question from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
STORE=${STORE:-store/sample}
.venv/bin/coinrag build sample --store "$STORE" --extractor local
