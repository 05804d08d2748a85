#!/usr/bin/env bash
# HTTP figures of two trees in one device call (the same GPU, clocks and minute): bench_http on
# a base tree (BASE_DIR: e.g. `git archive <previous commit> | tar -x -C .base`) and on this one,
# plus this tree's direct-write switch off, the TMP and lightning routes, and the conversation cache.
# Usage (repo root, GPU machine): OUT=/dir BASE_DIR=.base BASE_COMMIT=abc COMMIT=def bash test/bench/http_ab.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
b() {  # one bench_http run: its summary lines only
  timeout "${T:-150}" python3 test/bench/bench_http.py --model synthetic:2.9b --out "$OUT/results.jsonl" "$@" 2>&1 \
    | grep -E "streams|tok/s|rror" | tail -6
}
echo "=== base $BASE_COMMIT $(date +%T)"
(cd "$BASE_DIR" && export COMMIT=$BASE_COMMIT PYTHONPATH=/tmp/site:$PWD && b --streams 256 && b --streams 256 --route tasks)
echo "=== this tree $COMMIT $(date +%T)"
cd "$here"
b --streams 256,1024
b --streams 256 --route tasks
RWKV_DIRECT_STREAM=0 b --streams 256 --route tasks --variant direct_stream_off
RWKV_DIRECT_STREAM=0 b --streams 256,1024 --variant direct_stream_off
b --streams 256 --route tmp
b --streams 256 --route contents
echo "=== conversation $(date +%T)"
timeout "${TC:-200}" python3 test/bench/bench_conversation.py --model synthetic:2.9b --concurrency 256 \
  --out "$OUT/results.jsonl" 2>&1 | tail -8
echo "=== done $(date +%T)"
