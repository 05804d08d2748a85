#!/usr/bin/env bash
# Engine decode figures of two trees in one device call, each tree measured first once and second
# once (order H B B H, per QUANTS entry), so that whatever favours one position in a call (the
# first bench after the machine's start, clocks, another run's leftovers) lands on both trees.
# Session 42 read fp8 B=1 2.7% lower on the tree run first in two calls on two cards, with the B=1
# device path unchanged between the trees: a one-order A/B cannot tell that from a regression.
#   BASE_DIR    the base tree (e.g. `git archive <base> | tar -x -C .base`), BASE_COMMIT its commit
#   COMMIT      this tree's commit (the label of its lines); MODEL (default synthetic:2.9b)
#   QUANTS      --quant values, space-separated (default "fp8 none")
#   BATCHES     --batches (default 1,1024)
#   EXTRA       more bench_engine.py arguments (default: fp16 state, 50 steps, no prefill)
#   BUDGET      seconds for the whole script (default 560): each bench gets the time left
# Usage (repo root, GPU machine, wheels installed on PYTHONPATH as device_run.sh does):
#   OUT=/dir BASE_DIR=.base BASE_COMMIT=abc COMMIT=def bash test/bench/engine_ab.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
END=$(($(date +%s) + ${BUDGET:-560}))
left() { local l=$((END - $(date +%s))); echo $((l > 5 ? l : 5)); }
HERE=$PWD
bench() {  # tree-dir commit quant
  (cd "$1" && COMMIT=$2 PYTHONPATH="$1:${PYTHONPATH:-}" timeout "$(left)" python3 test/bench/bench_engine.py \
    --model "${MODEL:-synthetic:2.9b}" ${EXTRA:---state-dtypes fp16 --steps 50 --prefill ''} --quant "$3" \
    --batches "${BATCHES:-1,1024}" --out "$OUT/results.jsonl" 2>&1 | grep -E "^(fp16|fp32|bf16) |rror")
}
for q in ${QUANTS:-fp8 none}; do
  for w in H B B H; do
    if [ "$w" = H ]; then echo "=== $q: this tree $COMMIT $(date +%T)"; bench "$HERE" "$COMMIT" "$q"
    else echo "=== $q: base $BASE_COMMIT $(date +%T)"; bench "$(cd "$BASE_DIR" && pwd)" "$BASE_COMMIT" "$q"; fi
  done
done
