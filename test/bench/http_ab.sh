#!/usr/bin/env bash
# Figures of two trees in one device call (the same GPU, clocks and minute): this tree and a base
# tree (BASE_DIR: e.g. `git archive <previous commit> | tar -x -C .base`).
#   ENGINE=1  the engine bench on each tree: 2.9B, fp16 and fp32 state, B=1/64/256/1,024, prefill
#             1x4096 (~40 s a tree on a warm machine)
#   HTTP      bench_http on each tree: ROUTES (default completions,tasks,tmp) on one server at 256
#             streams, then completions at 1,024 (S1024=0 skips it). The base runs this tree's
#             bench (copied over), so both are measured alike.
#   CONTENTS=1 this tree's lightning contents route; CONV=1 the conversation bench (this tree)
# Every step gets the time left until BUDGET seconds (default 560) have passed, so one slow step
# cannot take the others' time past the device call's limit. MAX_TOKENS (default 256) per stream:
# 512 gives the task routes a window where all their streams decode (their delivered figure).
# Usage (repo root, GPU machine): OUT=/dir BASE_DIR=.base BASE_COMMIT=abc COMMIT=def bash test/bench/http_ab.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
END=$(($(date +%s) + ${BUDGET:-560}))
left() { local l=$((END - $(date +%s))); echo $((l > 5 ? l : 5)); }
engine() {  # the engine bench's table
  timeout "$(left)" python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp16,fp32 \
    --batches 1,64,256,1024 --prefill 1x4096 --out "$OUT/results.jsonl" 2>&1 | grep -E "^(fp16|fp32|state) "
}
http() {  # one bench_http server: its summary lines only
  timeout "$(left)" python3 test/bench/bench_http.py --model synthetic:2.9b --out "$OUT/results.jsonl" \
    --max-tokens "${MAX_TOKENS:-256}" "$@" 2>&1 | grep -E "streams:|rror|waited|first tokens"
}
base() { (cd "$BASE_DIR" && export COMMIT=$BASE_COMMIT PYTHONPATH=/tmp/site:$PWD && "$@"); }
cp test/bench/bench_http.py test/bench/bench_http_host.py "$BASE_DIR/test/bench/" && cp test/util_server.py "$BASE_DIR/test/"
if [ "${ENGINE:-0}" = 1 ]; then
  echo "=== engine: this tree $COMMIT $(date +%T)"; engine
  echo "=== engine: base $BASE_COMMIT $(date +%T)"; base engine
fi
routes=${ROUTES:-completions,tasks,tmp}
echo "=== $routes, 256 streams: this tree $COMMIT $(date +%T)"; http --streams 256 --route "$routes"
echo "=== $routes, 256 streams: base $BASE_COMMIT $(date +%T)"; base http --streams 256 --route "$routes"
if [ "${S1024:-1}" = 1 ]; then
  echo "=== completions, 1,024 streams: this tree $(date +%T)"; http --streams 1024 --route completions
  echo "=== completions, 1,024 streams: base $(date +%T)"; base http --streams 1024 --route completions
fi
if [ "${CONTENTS:-0}" = 1 ]; then
  echo "=== contents $(date +%T)"; http --streams 256 --route contents
fi
if [ "${CONV:-0}" = 1 ]; then
  echo "=== conversation $(date +%T)"
  timeout "$(left)" python3 test/bench/bench_conversation.py --model synthetic:2.9b --concurrency 256 \
    --out "$OUT/results.jsonl" 2>&1 | tail -40
fi
echo "=== done $(date +%T)"
