#!/usr/bin/env bash
# One command for a CUDA machine: compiled (CUDA-graph) decoding must stay lossless, and how fast it is.
#
#   scripts/accelerator_check.sh            # results in $OUT, or runs/accelerator when OUT is unset
#
# Installs nothing: run it where the repository's environment is installed (an activated venv, or
# .venv/ in the checkout, which it activates; with neither, PYTHONPATH=. and the machine's python). Steps,
# each under its own `timeout`, the seven summing to 480 s (the whole check ends in under 8 minutes on one
# H200, whatever hangs; a cut step keeps what it wrote, and the first lent run sets real bounds):
#   1. the lossless tests on CUDA (DDTREE_TEST_DEVICE=cuda): padding changes no output, 50+ compiled
#      rounds never recompile and equal eager (greedy and seeded sampling), the round's graphs (tree,
#      inputs, sampling filters, acceptance, KV pack) at node buckets 17 and 257 with the same eager ops a
#      step at every budget,
#      the G-test / chi-square on
#      samples drawn through CUDA graphs, and at most two host reads in a round of 16 rows;
#   2. the syncs CUDA reports in one round of 16 rows (torch.cuda.set_sync_debug_mode), greedy / sampled /
#      mixed (syncs.json);
#   3. a short `ddtree bench --compile --concurrency 1,16`: ar / dflash / ddtree at budgets 8-256, T = 0 and
#      1, eager and compiled side by side (results.json, results.md, plots);
#   4. the verify forward's cost curve of a random-weight Qwen3-8B-shaped target in bf16: milliseconds
#      against tokens verified (1, 17, 65, 257 per row) at batch 1 and 16 (verify_cost.jsonl);
#   5. flex attention compiled with ddtree's tiles at every real GQA group / head width (Qwen3, Qwen2.5,
#      Llama, Mistral, MLA 576/512) and trees of 1-257 nodes, checked against dense SDPA (flex.jsonl);
#   6. which SDPA op and kernels a masked call runs at real shapes, ddtree's against main's old call
#      (enable_gqa with the mask), with peak memory (sdpa.jsonl);
#   7. the profiling step at Qwen3-8B's shapes with the default memory flags: profiled peak, the pool it
#      leaves, then a 40,000-token prompt beside 15 decoding rows without running out of memory
#      (memory.jsonl).
# Exit code: 0 when every step passed; 2 without CUDA; else the first failing step's code (3: the bench's
# T = 0 check found a compiled or speculative output differing from plain decoding; 4: flex failed to
# compile or run at some shape; 124: a timeout).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT:-runs/accelerator}"
export PYTHONPATH="${PYTHONPATH:-.}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"   # seconds for step 1 (the round graphs compile too)
SYNC_TIMEOUT="${SYNC_TIMEOUT:-30}"    # seconds for step 2
BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}" # seconds for step 3
COST_TIMEOUT="${COST_TIMEOUT:-50}"    # seconds for step 4
FLEX_TIMEOUT="${FLEX_TIMEOUT:-65}"   # seconds for step 5 (each case is a line: a cut step keeps its cases)
SDPA_TIMEOUT="${SDPA_TIMEOUT:-25}"    # seconds for step 6
MEMORY_TIMEOUT="${MEMORY_TIMEOUT:-40}" # seconds for step 7
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

echo "accelerator_check: [1/7] lossless tests on CUDA (timeout ${TEST_TIMEOUT}s) -> $OUT_DIR/tests.log"
DDTREE_TEST_DEVICE=cuda run_step tests "$TEST_TIMEOUT" "$OUT_DIR/tests.log" \
    "$PYTHON" -m pytest -q -n 0 -x -rP -p no:cacheprovider tests/test_host_syncs.py tests/test_capture.py \
    "tests/test_sampling_lossless.py::test_compiled_samples_follow_target_distribution"

echo "accelerator_check: [2/7] syncs per round (timeout ${SYNC_TIMEOUT}s) -> $OUT_DIR/syncs.json"
run_step syncs "$SYNC_TIMEOUT" "$OUT_DIR/syncs.json" "$PYTHON" scripts/device_round.py syncs --device cuda

echo "accelerator_check: [3/7] bench, eager vs compiled (timeout ${BENCH_TIMEOUT}s) -> $OUT_DIR/bench.log"
run_step bench "$BENCH_TIMEOUT" "$OUT_DIR/bench.log" \
    "$PYTHON" -m ddtree bench --device cuda --compile --node-buckets "$NODE_BUCKETS" \
    --methods ar,dflash,ddtree --budgets 8,16,64,256 --temperatures 0,1 --num-prompts 4 \
    --concurrency 1,16 --max-new-tokens 64 --repeats 1 --tree-vocab 0 --no-progress --out "$OUT_DIR"

echo "accelerator_check: [4/7] verify cost curve, Qwen3-8B shapes (timeout ${COST_TIMEOUT}s) -> $OUT_DIR/verify_cost.jsonl"
run_step verify-cost "$COST_TIMEOUT" "$OUT_DIR/verify_cost.jsonl" \
    "$PYTHON" scripts/device_round.py verify-cost --device cuda

echo "accelerator_check: [5/7] flex at real head shapes (timeout ${FLEX_TIMEOUT}s) -> $OUT_DIR/flex.jsonl"
run_step flex "$FLEX_TIMEOUT" "$OUT_DIR/flex.jsonl" "$PYTHON" scripts/cuda_attention_check.py flex --device cuda
if grep -q '"ok": false' "$OUT_DIR/flex.jsonl"; then
    echo "accelerator_check: flex FAILED at some shapes:" >&2
    grep '"ok": false' "$OUT_DIR/flex.jsonl" >&2
    [[ $status -eq 0 ]] && status=4
fi

echo "accelerator_check: [6/7] SDPA kernels at real shapes (timeout ${SDPA_TIMEOUT}s) -> $OUT_DIR/sdpa.jsonl"
run_step sdpa "$SDPA_TIMEOUT" "$OUT_DIR/sdpa.jsonl" "$PYTHON" scripts/cuda_attention_check.py sdpa --device cuda

echo "accelerator_check: [7/7] the profiling step, Qwen3-8B shapes (timeout ${MEMORY_TIMEOUT}s) -> $OUT_DIR/memory.jsonl"
run_step memory "$MEMORY_TIMEOUT" "$OUT_DIR/memory.jsonl" "$PYTHON" scripts/device_round.py memory --device cuda

echo "accelerator_check: done in $((SECONDS - started)) s, exit $status; results in $OUT_DIR:"
for name in results.json results.md tests.log syncs.json bench.log verify_cost.jsonl flex.jsonl sdpa.jsonl memory.jsonl; do
    [[ -e "$OUT_DIR/$name" ]] && echo "  $OUT_DIR/$name"
done
exit "$status"
