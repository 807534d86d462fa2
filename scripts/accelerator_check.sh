#!/usr/bin/env bash
# One command for a CUDA machine: compiled (CUDA-graph) decoding must stay lossless, and how fast it is.
#
#   scripts/accelerator_check.sh            # results in $OUT, or runs/accelerator when OUT is unset
#
# Installs nothing: run it where the repository's environment is installed (an activated venv, or
# .venv/ in the checkout, which it activates). Steps, each under its own `timeout`, sized so the whole
# check ends in under 8 minutes on one H200:
#   1. the compiled-decoding tests on CUDA (DDTREE_TEST_DEVICE=cuda): padding changes no output, 50+
#      compiled rounds never recompile and equal eager (greedy and seeded sampling), and the lossless
#      G-test / chi-square on samples drawn through CUDA graphs;
#   2. a short `ddtree bench --compile`: ar / dflash / ddtree at budgets 8-256, T = 0 and 1, 4 prompts,
#      eager and compiled side by side (results.json, results.md, plots).
# Exit code: 0 when every step passed; 2 without CUDA; else the first failing step's code (3: the bench's
# T = 0 check found a compiled or speculative output differing from plain decoding; 124: a timeout).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT:-runs/accelerator}"
TEST_TIMEOUT="${TEST_TIMEOUT:-240}"   # seconds for step 1
BENCH_TIMEOUT="${BENCH_TIMEOUT:-210}" # seconds for step 2
# Node buckets: exactly the tree sizes the bench asks for (ar 1, budget B: B + 1, dflash: 17 with the
# built-in block of 16), so the compiled engine captures 5 verify shapes instead of the 10 of the ladder.
NODE_BUCKETS="${NODE_BUCKETS:-1,9,17,65,257}"

if ! "$PYTHON" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    echo "accelerator_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is false); nothing run" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
status=0
started=$SECONDS
"$PYTHON" -c "import torch; print('accelerator_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

# run_step NAME TIMEOUT LOG COMMAND...: run COMMAND under TIMEOUT seconds into LOG; on failure print its tail
# and keep the first failing exit code in $status (the later steps still run).
run_step() {
    local name=$1 limit=$2 log=$3
    shift 3
    if timeout "$limit" "$@" >"$log" 2>&1; then
        echo "accelerator_check: $name passed: $(tail -n 1 "$log")"
    else
        local code=$?
        [[ $status -eq 0 ]] && status=$code
        echo "accelerator_check: $name FAILED (exit $code); last lines of $log:" >&2
        tail -n 30 "$log" >&2
    fi
}

echo "accelerator_check: [1/2] compiled-decoding tests on CUDA (timeout ${TEST_TIMEOUT}s) -> $OUT_DIR/tests.log"
DDTREE_TEST_DEVICE=cuda run_step tests "$TEST_TIMEOUT" "$OUT_DIR/tests.log" \
    "$PYTHON" -m pytest -q -x -rP tests/test_capture.py \
    "tests/test_sampling_lossless.py::test_compiled_samples_follow_target_distribution"

echo "accelerator_check: [2/2] bench, eager vs compiled (timeout ${BENCH_TIMEOUT}s) -> $OUT_DIR/bench.log"
run_step bench "$BENCH_TIMEOUT" "$OUT_DIR/bench.log" \
    "$PYTHON" -m ddtree bench --device cuda --compile --node-buckets "$NODE_BUCKETS" \
    --methods ar,dflash,ddtree --budgets 8,16,64,256 --temperatures 0,1 --num-prompts 4 \
    --max-new-tokens 64 --repeats 1 --tree-vocab 0 --no-progress --out "$OUT_DIR"

echo "accelerator_check: done in $((SECONDS - started)) s, exit $status; results in $OUT_DIR:"
for name in results.json results.md tests.log bench.log; do
    [[ -e "$OUT_DIR/$name" ]] && echo "  $OUT_DIR/$name"
done
exit "$status"
