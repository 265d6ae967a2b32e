#!/usr/bin/env bash
# The prepared GPU check of issues 23 and 37, one script, under 8 minutes on a CUDA machine:
#   1. the CUDA-marked tests (pytest -m cuda; skipped on a machine without CUDA): the forwards
#      (eager, compiled, graphs) against transformers and the graphs' replays against eager,
#      the KV pipeline's pinned copies against the blocking ones, the pinned kv_load copy;
#   2. tests/benchmarks/gpu_check.py: KV build throughput with MFU and coinrag / turborag /
#      standard TTFT at Qwen2-7B dims (random weights, bf16), before (eager forward, blocking
#      KV copies, a copy per slice) and after (graphs forward, the KV pipeline, one pinned copy;
#      resident slices), the tables side by side and the issue's goals met or missed.
#
#   bash tests/benchmarks/gpu_check.sh            # on a GPU machine
#   bash tests/benchmarks/gpu_check.sh --dry-run  # anywhere: the CUDA tests collected (imports
#                                                 # checked, skipped without CUDA), every step
#                                                 # of gpu_check.py on a tiny model on the CPU
# PYTHON (default: .venv/bin/python, else python3) runs everything; extra arguments go to
# gpu_check.py (e.g. --peak-tflops 989 --reps 20 --before compiled).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
start=$(date +%s)

# A bare machine (the device tool's) has the repository but not the package: import it as
# `coinrag` through a link to the checkout.
if ! "$PYTHON" -c "import coinrag" 2>/dev/null; then
    link_dir=$(mktemp -d)
    ln -s "$PWD" "$link_dir/coinrag"
    export PYTHONPATH="$link_dir${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== CUDA tests (pytest -m cuda)"
# Only the files that hold CUDA tests are collected: the others import what a bare GPU machine
# lacks (prefect, lancedb, duckdb). -o addopts: the default addopts leave out nothing CUDA needs.
mapfile -t cuda_files < <(grep -rl --include='test_*.py' "pytest.mark.cuda" tests | sort)
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -m cuda \
    "${cuda_files[@]}" -rs || status=$?
case "${status:-0}" in
    0 | 5) ;;  # 5: nothing selected
    *) echo "CUDA tests failed (exit ${status})"; exit "${status}" ;;
esac

if [[ " $* " == *" --dry-run "* ]]; then
    # no CUDA: the CPU side of what the CUDA tests check (the graphs forward's static inputs
    # and buckets against eager, the pipeline's stored bits, the kv_load gather and the LRU)
    echo "== the CPU side of the CUDA tests (dry run)"
    timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -m "not cuda and not heavy" \
        tests/inference/test_kv_pipeline.py tests/inference/test_kv_transfer.py \
        tests/inference/test_forward.py -k "graph or setting or bucket or pipeline or kv_stage \
        or fill or batch or transfer or resident or cpu"
fi

echo "== KV build and TTFT (gpu_check.py $*)"
# what is left of the 8 minutes, less 20 s: phases past the budget are skipped, not cut off
left=$(( 460 - ($(date +%s) - start) ))
timeout "$left" "$PYTHON" tests/benchmarks/gpu_check.py --budget-s $(( left - 120 )) "$@"
echo "== gpu_check.sh done in $(( $(date +%s) - start )) s"
