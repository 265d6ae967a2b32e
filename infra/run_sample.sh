#!/usr/bin/env bash
# The main job on the offline defaults: set up .venv, build the bundled sample corpus into
# ./store/sample (local constrained extractor, SmolLM2 KV, MiniLM indexes), then answer a
# question with each method.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
STORE=${STORE:-store/sample}
QUESTION=${QUESTION:-"Who directed 2001: A Space Odyssey?"}
.venv/bin/coinrag build sample --store "$STORE" --extractor local
for method in coinrag turborag standard; do
  .venv/bin/coinrag query "$QUESTION" --store "$STORE" --method "$method" --kc 1
done
