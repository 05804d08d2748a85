#!/usr/bin/env bash
# HTTP figures of two trees in one device call (the same GPU, clocks and minute): bench_http on
# a base tree (BASE_DIR: e.g. `git archive <previous commit> | tar -x -C .base`) and on this one,
# route by route (ROUTES, default "completions tasks tmp"), then optionally this tree's lightning
# contents route (CONTENTS=1) and the conversation cache (CONV=1).
# Each bench_http run is ~40 s on a warm machine (the first one also builds the kernels: ~40 s more).
# STREAMS=1024 measures at 1,024 streams (T: seconds per run, default 150).
# Usage (repo root, GPU machine): OUT=/dir BASE_DIR=.base BASE_COMMIT=abc COMMIT=def bash test/bench/http_ab.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
b() {  # one bench_http run at STREAMS (default 256) streams: its summary lines only
  timeout "${T:-150}" python3 test/bench/bench_http.py --model synthetic:2.9b --out "$OUT/results.jsonl" \
    --streams "${STREAMS:-256}" "$@" 2>&1 | grep -E "streams|tok/s|rror|waited|first tokens" | tail -6
}
# one measurement for both trees: the base runs this tree's bench and its server helper
cp test/bench/bench_http.py test/bench/bench_http_host.py "$BASE_DIR/test/bench/" && cp test/util_server.py "$BASE_DIR/test/"
for route in ${ROUTES:-completions tasks tmp}; do  # base and this tree alternate per route
  echo "=== $route: base $BASE_COMMIT $(date +%T)"
  (cd "$BASE_DIR" && export COMMIT=$BASE_COMMIT PYTHONPATH=/tmp/site:$PWD && b --route "$route")
  echo "=== $route: this tree $COMMIT $(date +%T)"
  b --route "$route"
done
if [ "${CONTENTS:-0}" = 1 ]; then
  echo "=== contents $(date +%T)"; b --route contents
fi
if [ "${CONV:-0}" = 1 ]; then
  echo "=== conversation $(date +%T)"
  timeout "${TC:-200}" python3 test/bench/bench_conversation.py --model synthetic:2.9b --concurrency 256 \
    --out "$OUT/results.jsonl" 2>&1 | tail -8
fi
echo "=== done $(date +%T)"
