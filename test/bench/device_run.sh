#!/usr/bin/env bash
# One device call: GPU parity tests, kernel micro-bench, engine bench (+ accuracy check).
# Usage on the GPU machine (repo root):  OUT=/some/dir COMMIT=abc123 bash test/bench/device_run.sh [steps...]
# steps: info build tests blocks quant_tests quant_gemm quant_sweep w8_gemm engine_quant mem72 kernels e2e_constrained conversation http_contents http_gpus tmix gemm engine e2e partition sampler ab_sampler quick engine_nofused profile profile_nofused engine72 prefill4096 engine_torch http http_tasks http_routes tasks_spy http1024 quality
# (default: info tests kernels engine). The fused decode path and long prefill chunks are the
# model's defaults on CUDA (bench flags --no-fused / --chunk-len N to compare).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
steps=${*:-info tests kernels engine}
if [ -d .whl ]; then  # the HTTP server's dependencies as wheels (a GPU machine without a package index), installed once
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
for s in $steps; do
  echo "=== $s $(date +%T)"
  case $s in
    info) nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv; python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; which nvcc ;;
    tests) timeout ${TESTS_TIMEOUT:-360} python3 -m pytest -q -m gpu test/test_kernels_gpu.py test/test_kernels_fused_gpu.py test/test_kernels_gemv_gpu.py test/test_model_gpu.py test/test_engine_gpu.py test/test_kernel_loader.py test/test_sampler_kernel_gpu.py test/test_quant_gpu.py test/test_prefill_graphs_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    quant_tests) timeout 300 python3 -m pytest -q -m gpu test/test_quant_gpu.py test/test_kernels_gemv_gpu.py -p no:cacheprovider -rf \
              2>&1 | tee "$OUT/quant_tests.log" | tail -25 ;;
    quant_gemm) timeout 150 python3 test/bench/bench_quant_gemm.py 2>&1 | tee "$OUT/quant_gemm.log" ;;
    quant_sweep) for q in int8 fp8; do timeout 150 python3 test/bench/bench_gemm.py --sweep --batches 1 --quant $q; done 2>&1 \
              | tee "$OUT/quant_sweep.log" | grep -v "cfg[123] GB" ;;
    w8_gemm) timeout 500 python3 test/bench/bench_w8_gemm.py --batches ${W8_BATCHES:-16,32,64,128,256,1024} --modes int8,fp8 \
              --json "$OUT/w8_gemm.json" 2>&1 | grep -v "OutOfResources\|Reducing block" | tee "$OUT/w8_gemm.log" ;;
    engine_quant) for q in ${QUANTS:-none int8 fp8}; do timeout 200 python3 test/bench/bench_engine.py --model synthetic:2.9b \
              --state-dtypes fp16 --batches ${QUANT_BATCHES:-1,64,256,1024} --prefill 1x4096 --quant $q \
              --out "$OUT/results.jsonl" 2>&1 | tail -7; done | tee "$OUT/engine_quant.log" ;;
    mem72) timeout 200 python3 test/bench/bench_engine.py --model synthetic:7.2b --state-dtypes fp16 --batches 1,64 \
              --prefill '' --quant int8 --out "$OUT/results.jsonl" 2>&1 | tail -6 | tee "$OUT/mem72.log" ;;
    kernels) timeout 200 python3 test/bench/bench_kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    blocks) timeout 150 python3 -m pytest -q -m gpu test/test_kernels_blocks_gpu.py -p no:cacheprovider -rf 2>&1 \
              | tee "$OUT/blocks_tests.log" | tail -12  # the blocked WKV prefill: tests, steps vs blocks, engine A/B
             timeout 90 python3 test/bench/bench_wkv_blocks.py 2>&1 | tee "$OUT/blocks.log"
             timeout 300 python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp16 --batches '' \
               --prefill 1x4096,16x512,1x512 --prefill-graph-len 512 --blocks-min-t 0,64,0,64 \
               --out "$OUT/results.jsonl" 2>&1 | tee -a "$OUT/blocks.log" | tail -14 ;;
    tmix) timeout 200 python3 test/bench/bench_kernels.py --tmix 2>&1 | tee "$OUT/tmix.log" ;;
    gemm) timeout 200 python3 test/bench/bench_gemm.py --batches 1,8,64,256 2>&1 | tee "$OUT/gemm.log" ;;
    build) python3 -c "import logging; logging.basicConfig(level=logging.INFO); from kernels import loader; print(loader.load())" 2>&1 | tail -3 ;;
    engine) timeout 400 python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp16,fp32 \
              --accuracy 256 --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/engine.log" ;;
    profile) timeout 150 python3 test/bench/profile_decode.py --batches 1,256,1024 2>&1 | tee "$OUT/profile.log" ;;
    profile_nofused)
             timeout 150 python3 test/bench/profile_decode.py --batches 1,256,1024 --no-fused 2>&1 | tee -a "$OUT/profile.log" ;;
    quick) timeout ${QUICK_TIMEOUT:-200} python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp32 \
              --batches 1,64,256 --prefill 1x4096 --variant "${VARIANT:-model defaults}" --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/quick.log" ;;
    engine_nofused) timeout 400 python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp16,fp32 \
              --no-fused --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/engine_nofused.log" ;;
    engine72) timeout 300 python3 test/bench/bench_engine.py --model synthetic:7.2b --state-dtypes fp32 \
              --batches 1,64,256,1024 --prefill 1x4096 --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/engine72.log" ;;
    prefill4096) timeout 200 python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp32,fp16 \
              --batches '' --prefill 1x4096,16x512 --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/prefill4096.log" ;;
    engine_torch) timeout 200 python3 test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp32 \
              --kernels torch --batches 1,64,256 --prefill '' --variant torch-wkv --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/engine_torch.log" ;;
    e2e) timeout 300 python3 test/bench/bench_engine_e2e.py --model synthetic:2.9b --batches 1,64,256,1024 \
              --state-dtype ${STATE_DTYPE:-fp32} --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/e2e.log" ;;
    e2e_constrained) timeout 300 python3 test/bench/bench_engine_e2e.py --model synthetic:2.9b --batches 256 \
              --constrained 0.25 --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/e2e_constrained.log" ;;
    conversation) timeout 400 python3 test/bench/bench_conversation.py --model synthetic:2.9b --concurrency 256 \
              --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/conversation.log" ;;
    http_gpus) n=$(python3 -c 'import torch; print(torch.cuda.device_count())')  # one GPU, then an engine per GPU (issue 28)
              { timeout 250 python3 test/bench/bench_http.py --model synthetic:2.9b --state-dtype fp16 --streams 256 \
                  --out "$OUT/results.jsonl"; timeout 340 python3 test/bench/bench_http.py --model synthetic:2.9b \
                  --state-dtype fp16 --devices all --streams $((256 * n)) --out "$OUT/results.jsonl"; } 2>&1 \
              | tee "$OUT/http_gpus.log" | grep -E "streams:|server up" ;;
    http_contents) timeout 200 python3 test/bench/bench_http.py --model synthetic:2.9b --streams 256 --route contents \
              --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/http_contents.log" ;;
    sampler) timeout 200 python3 test/bench/bench_sampler.py --B 1 32 64 128 256 512 1024 2>&1 | tee "$OUT/sampler.log" ;;
    ab_sampler) timeout 400 python3 test/bench/ab_sampler.py ${AB_SAMPLER_ARGS:---ref main} 2>&1 | tee "$OUT/ab_sampler.log" | tail -12 ;;
    partition) for r in ${PARTITION_ROWS:-512 1024}; do timeout 150 python3 test/bench/bench_partition.py --rows $r; done 2>&1 | tee "$OUT/partition.log" ;;
    http) timeout 400 python3 test/bench/bench_http.py --model synthetic:2.9b --streams ${HTTP_STREAMS:-64,256} --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/http.log" ;;
    http_routes)  # completions, tmp and tasks on one 256-stream server, with a py-spy record of it (.whl has py-spy)
             spy=/tmp/site/bin/py-spy
             if [ -x $spy ]; then (for i in $(seq 300); do p=$(pgrep -f '[s]erver.cli serve' | head -1); [ -n "$p" ] && break; sleep 0.2; done
               $spy record --pid $p --nonblocking -r 50 -f raw --threads -o "$OUT/spy_routes.txt" >/dev/null 2>&1) & fi
             timeout 300 python3 test/bench/bench_http.py --model synthetic:2.9b --streams 256 --route completions,tmp,tasks \
               --out "$OUT/results.jsonl" 2>&1 | grep -E "streams:|first tokens|waited|rror" | tee "$OUT/http_routes.log"; wait
             [ -f "$OUT/spy_routes.txt" ] && python3 test/bench/spy_top.py "$OUT/spy_routes.txt" --top 25 ;;
    tasks_spy)  # issue 22's open question: tasks and tmp at 512 tokens on one server, with a py-spy
             # record (threads, GIL idle included), vmstat each second and the server's page faults
             spy=/tmp/site/bin/py-spy
             (for i in $(seq 300); do p=$(pgrep -f '[s]erver.cli serve' | head -1); [ -n "$p" ] && break; sleep 0.2; done
              (while kill -0 $p 2>/dev/null; do echo "$(date +%T.%N | cut -c1-12) $(awk '{print $10, $12, $14, $15}' /proc/$p/stat)"; sleep 0.5; done) > "$OUT/faults.txt" &
              [ -x $spy ] && $spy record --pid $p --nonblocking --idle -r 50 -f raw --threads -o "$OUT/spy_tasks.txt" >/dev/null 2>&1) &
             (vmstat -t 1 > "$OUT/vmstat.txt" 2>&1 &) ; echo "faults.txt: time minflt majflt utime stime (ticks)"
             timeout 300 python3 test/bench/bench_http.py --model synthetic:2.9b --streams 256 --route tasks,tmp --max-tokens 512 \
               --out "$OUT/results.jsonl" 2>&1 | grep -E "streams:|first tokens|waited|rror" | tee "$OUT/tasks_spy.log"; wait; pkill vmstat
             [ -f "$OUT/spy_tasks.txt" ] && python3 test/bench/spy_top.py "$OUT/spy_tasks.txt" --top 30 ;;
    http1024) timeout 300 python3 test/bench/bench_http.py --model synthetic:2.9b --streams 1024 --route completions \
              --out "$OUT/results.jsonl" 2>&1 | grep -E "streams:|first tokens|rror" | tee "$OUT/http1024.log" ;;
    quality) timeout 500 python3 test/bench/quality.py --model synthetic:2.9b --device cuda --tokens 4096 --stride 16 \
              --prompts 8 --gen 64 --modes ${QUALITY_MODES:-ref,state_fp16,act_fp16,act_bf16,served,served+wint8,served+wfp8} --out "$OUT/results.jsonl" 2>&1 | tee "$OUT/quality.log" ;;
    http_tasks) for r in ${HTTP_ROUTES:-tasks tmp}; do timeout 200 python3 test/bench/bench_http.py --model synthetic:2.9b \
              --streams 256 --route $r --out "$OUT/results.jsonl"; done 2>&1 | tee "$OUT/http_tasks.log" ;;
  esac
done
echo "=== done $(date +%T)"
