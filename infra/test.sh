#!/usr/bin/env bash
# The test command: set up .venv, then run the default test suite (benchmarks excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec .venv/bin/python -m pytest "$@"
