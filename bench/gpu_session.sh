#!/usr/bin/env bash
# One call on the GPU machine: install this checkout, run the GPU tests, then the benchmarks named in
# $BENCH, separated by ';' (default: the load benchmark; a name below, or any command line). With a
# .baseline/ copy of an older tree travelling along, "baseline" runs that worker under the same load.
# Everything lands in $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
# Wheels the GPU image lacks, from .whl (bench/gpu_wheels.sh fills it; carry it): grpc health and
# reflection (pure Python), llguidance, gguf; py-spy's binary beside them. For OpenAI HTTP benches,
# aiohttp's closure for CPython 3.12 (aiohttp, aiohappyeyeballs, aiosignal, attrs, frozenlist,
# multidict, propcache, yarl: bench/openai_bench_wheels.sh puts them in .benchwhl-b).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
# The host too: two machines of one card model can differ in their CPUs, and the engine thread's pace with them.
echo "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) x$(nproc)" | tee -a "$out/gpu.txt"
# The card in every output's name (h200, h100, or gpu): a call may get either kind.
case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) in
  *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;;
esac
export PYTHONUNBUFFERED=1
# The commit to record in results: pass GRAPHKEEPER_COMMIT=$(git rev-parse HEAD) from the checkout
# that sent this tree (a copied tree's git metadata can name an older commit).
if [ "${TESTS:-1}" = 1 ]; then
  # PYTEST_X="" runs every test past a failure (the whole picture in one call). TEST_SELECT: the
  # files; TEST_K: a -k expression, spaces allowed (TEST_K="sleep or sampling"). A -k that matches
  # nothing deselects everything and the call tests nothing. The whole suite ran 257 s (185 tests, 95ddd56) on one
  # H100 host and did not finish in 330 s on another (2026-12-07): give it a call of its own with
  # TEST_TIMEOUT=450, or split it with TEST_SELECT.
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m cuda -q ${PYTEST_X--x} -p no:cacheprovider ${TEST_SELECT:-tests/gpu} ${TEST_K:+-k "$TEST_K"} 2>&1 \
    | tee "$out/pytest-cuda-$card.log" | tail -25
fi
# py-spy (a static binary: carry it as .whl/py-spy) on the worker and its engine core while the
# benchmark with pid $2 runs: 3-second raw records, headed "### <n> <unix time> <worker pid>", into
# $out/$1.txt.gz (read them with bench/spy_report.py). Each block records the newest worker, so a
# benchmark that starts one worker after another (start_bench) is followed from one to the next.
spy() {
  local worker="" i=0
  : > "/tmp/$1.txt"
  while [ "$i" -lt 80 ] && kill -0 "$2" 2>/dev/null; do
    worker=$(pgrep -n -f "graphkeeper.cli worker")
    if [ -z "$worker" ]; then sleep 0.2; continue; fi  # between workers: waiting is not a block
    i=$((i + 1))
    timeout 12 .whl/py-spy record -d 3 -r 250 --idle --subprocesses --format raw -o /tmp/spy-block.txt \
      --pid "$worker" >/dev/null 2>&1
    echo "### $i $(date +%s) $worker" >> "/tmp/$1.txt"; cat /tmp/spy-block.txt >> "/tmp/$1.txt" 2>/dev/null
    rm -f /tmp/spy-block.txt
  done
  wait "$2"; gzip -c "/tmp/$1.txt" > "$out/$1.txt.gz"
}
# The .baseline/ tree (an older commit's, carried along) installed apart, at /tmp/oldpkg.
install_baseline() {
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldpkg ./.baseline >/dev/null 2>&1
}
# Entries are split at every ';', so a command given here cannot contain one (not even quoted).
IFS=';' read -ra benches <<< "${BENCH-load}"
for b in "${benches[@]}"; do  # BENCH="" runs the tests alone
  case $b in
    load) timeout 330 python3 bench/load_bench.py --seconds "${SECONDS_PER:-12}" ${SCENARIOS:+--scenarios "$SCENARIOS"} \
        --label "${LABEL:-}" --out "$out/load-$card.json" ;;
    baseline)
      install_baseline
      # BASELINE_ARGS="" for a baseline that has --control-port (newer than 8e2591a).
      timeout 330 python3 bench/load_bench.py --scenarios "${SCENARIOS:-mixed}" ${BASELINE_ARGS---legacy} \
        --worker-pythonpath /tmp/oldpkg:/tmp/site \
        --seconds "${SECONDS_PER:-12}" --label "baseline ${BASELINE:-8e2591a}" --out "$out/load-baseline-$card.json" ;;
    apart)  # the engine core in its own process (the default) against it on a thread of the API process
      timeout 330 python3 bench/load_bench.py --scenarios one,decode,mixed --seconds "${SECONDS_PER:-12}" \
        --worker-args=--no-engine-process --no-step-times --label "engine core in-process" --out "$out/load-engine-inproc-$card.json"
      timeout 330 python3 bench/load_bench.py --scenarios one,decode,mixed --seconds "${SECONDS_PER:-12}" \
        --label "engine core apart" --out "$out/load-engine-apart-$card.json" ;;
    sweep) timeout 300 python3 bench/load_bench.py --scenarios "" --budgets 128,256,512,1024 \
        --seconds "${SECONDS_PER:-12}" --out "$out/load-budget-sweep-$card.json" ;;
    budget-sweep)  # issue 35: TTFT against ITL per (token budget, ITL target), long/mixed/decode. Run it
      # alone (TESTS=0 BENCH=budget-sweep): 3 scenarios x 5 settings = 15 fresh workers. A cell is ~20 s
      # to READY + ~2 s client spawn + SECONDS_PER (6) of load + ~3 s for the last requests to finish
      # = ~31 s; 15 x 31 = 465 s, + ~30 s the first start's empty compile/tuning caches, + ~30 s timing
      # the FULL decode step afterwards, + ~10 s install = ~535 s of the call's 570. The JSON is
      # written after every cell, so a cut-short run keeps what it measured.
      # Plot elsewhere: python bench/plot_budget_sweep.py gpu-out/budget-sweep-$card.json
      timeout 540 python3 bench/budget_sweep.py --preset llama-1b --scenarios long,mixed,decode \
        --settings "${SETTINGS:-512:default,2048:default,8192:default,8192:8,8192:12}" \
        --seconds "${SECONDS_PER:-6}" --logs "$out/logs-$b" --label "${LABEL:-}" --out "$out/budget-sweep-$card" ;;
    economics-1b|economics-8b)  # the graph-economics sweep: 2 modes x 3 ladders, a fresh worker per cell
      preset=llama-${b#economics-}
      timeout 570 python3 bench/sweep.py --preset "$preset" --modes "${MODES:-FullAndPiecewise,FullDecodeOnly}" \
        --ladders "${LADDERS:-default,traffic,fixed:1,2,4,8,16,32,64}" --budgets 0 \
        --traffic-max-graphs "${MAX_GRAPHS:-16}" --scenario mixed \
        --seconds "${SECONDS_PER:-10}" --worker-args=-O1 --logs "$out/logs-$b" \
        --out "$out/sweep-${preset/-/}-$card" ;;
    graph-memory)  # graph memory through a fresh capture, a reload, idle release, an empty budget; track B
      timeout 300 python3 bench/graph_memory.py --preset llama-1b --out "$out/graph-memory-$card.json" ;;
    economics-nothing)  # a graph memory budget that fits no graph: what stays held
      timeout 300 python3 bench/sweep.py --preset llama-1b --modes FullAndPiecewise --ladders default \
        --budgets 1Mi --scenario mixed --seconds "${SECONDS_PER:-10}" --worker-args=-O1 \
        --logs "$out/logs-$b" --out "$out/sweep-llama1b-budget-nothing-$card" ;;
    shared)  # 64 streams on one 2,000-token prefix: TTFT p50 with prefix caching against without
      timeout 330 python3 bench/load_bench.py --scenarios shared,shared_nocache --no-step-times \
        --seconds "${SECONDS_PER:-12}" --out "$out/load-shared-prefix-$card.json" ;;
    capacity)  # llama-8b at context 8192 in 16 GiB of KV cache: short sequences at once, paged vs static
      timeout 300 python3 bench/kv_capacity.py --kv-cache-memory 16Gi --seconds "${SECONDS_PER:-12}" \
        --out "$out/kv-capacity-$card.json" ;;
    sampling)  # issue 34: half the streams parameterised against plain, and each kind alone (~90 s)
      timeout 200 python3 bench/sampling_bench.py --preset llama-1b --attribute --seconds "${SECONDS_PER:-12}" \
        --out "$out/sampling-$card.json" ;;
    openai-1b|openai-8b)  # issue 34: OpenAI HTTP (plain client) against gRPC at 1/16/64 streams (~150 s / ~250 s)
      timeout 330 python3 bench/openai_bench.py --preset "llama-${b#openai-}" --clients plain \
        --seconds "${SECONDS_PER:-8}" --models /tmp/obm --out "$out" ;;
    sleep)  # issue 36: sleep (levels 1 and 2) and wake on one worker each of llama-1b and llama-8b:
      # memory given back, a request's wake to its first token, tokens and graphs kept (~4 min)
      timeout 300 python3 bench/sleep_bench.py --out "$out/sleep-$card.json" ;;
    checkpoint)  # issue 36: a process's device memory through the driver's checkpoint and back, its
      # graphs replayed after (the mechanism of the sleep's context offload, alone; ~15 s)
      timeout 120 python3 bench/checkpoint_probe.py --out "$out/checkpoint-probe-$card.json" ;;
    vmm)  # issue 36: a graph replays after its memory was released and mapped again (~15 s)
      timeout 60 python3 bench/vmm_probe.py --out "$out/vmm-probe-$card.json" ;;
    start)  # issue 36: READY cold, warm and warm again, stage by stage, llama-1b and llama-8b (3 starts each;
      # PRESETS and STARTS narrow it), each worker's log kept in $out/logs-start
      timeout 470 python3 bench/start_bench.py ${PRESETS:+--presets "$PRESETS"} ${STARTS:+--starts "$STARTS"} \
        --logs "$out/logs-start" --out "$out/start-ii-$card.json" ;;
    start-shipped)  # issue 36: cold starts that measure their tuning (the worker's tables set aside),
      # bench/ship_tuning.py adds it to the worker's tables (copied to $out), then a cold start on
      # fresh compile caches installs it and a warm one follows (~4 min for llama-1b and llama-8b)
      rm -rf /tmp/measured-caches; mkdir -p /tmp/tables-set-aside
      mv worker/model/tuned/*.json /tmp/tables-set-aside/ 2>/dev/null
      timeout 200 python3 bench/start_bench.py ${PRESETS:+--presets "$PRESETS"} --starts cold \
        --cache-root /tmp/measured-caches --logs "$out/logs-measured" --label "cold, tuning measured" \
        --out "$out/start-ii-measured-$card.json"
      python3 bench/ship_tuning.py /tmp/measured-caches && cp worker/model/tuned/*.json "$out/"
      timeout 240 python3 bench/start_bench.py ${PRESETS:+--presets "$PRESETS"} --starts cold,warm \
        --logs "$out/logs-shipped" --label "the tuning shipped" --out "$out/start-ii-shipped-$card.json" ;;
    start-baseline)  # issue 36: this tree's starts, then .baseline's warm ones on the caches they filled
      # (the step's modules unchanged between the two: one compile key), in one call (~4-6 min). The
      # baseline's first start also writes its tree's bytecode: compare the "warm again" rows.
      timeout 300 python3 bench/start_bench.py --cache-root /tmp/start-caches --out "$out/start-ii-$card.json"
      install_baseline
      timeout 240 python3 bench/start_bench.py --cache-root /tmp/start-caches --starts "warm,warm again" \
        --worker-pythonpath /tmp/oldpkg --label "baseline ${BASELINE:-}" --out "$out/start-ii-baseline-$card.json" ;;
    start-cold-baseline)  # issue 36: .baseline's cold starts on caches of their own (~2 min), beside this
      # tree's "start" in the same call: BENCH="start-cold-baseline;start"
      install_baseline
      timeout 240 python3 bench/start_bench.py --cache-root /tmp/baseline-caches --starts cold \
        --worker-pythonpath /tmp/oldpkg --label "baseline ${BASELINE:-}" --out "$out/start-ii-baseline-cold-$card.json" ;;
    defaults)  # issue 35: defaults only (the budget sized to the device, coarse graphs kept where they pay):
      # long prompts, mixed and decode streams, 64 each (~100 s); the tests: TEST_K=large_steps. The
      # workers' lines about steps past the budget's bound (where each one's time went) are kept
      # beside the figures, in step-overruns-$card.log.
      timeout 330 python3 bench/load_bench.py --scenarios long,mixed,decode --seconds "${SECONDS_PER:-10}" \
        --logs "$out/logs-defaults" --label "defaults: budget sized to the device" --out "$out/load-defaults-$card.json"
      grep -H "past the step budget" "$out"/logs-defaults/*.log | cut -c1-900 > "$out/step-overruns-$card.log"
      tail -n 6 "$out/step-overruns-$card.log" ;;
    pieces)  # issue 35: the same long and mixed load with each PIECEWISE key recorded as pieces around
      # eager attention (as before 2026-12-06), beside "defaults" for what recording the mixed step's
      # attention buys (~70 s): BENCH="defaults;pieces"
      timeout 330 python3 bench/load_bench.py --scenarios long,mixed --seconds "${SECONDS_PER:-10}" \
        --worker-args=--no-record-mixed-attention --label "defaults, attention eager between pieces" \
        --out "$out/load-pieces-$card.json" ;;
    mixed-step)  # issue 35: where a recorded mixed step's GPU time goes, by kernel kind, in each of the
      # varlen kernel's launch layouts; then that kernel alone against .baseline's, if one travels (~120 s)
      timeout 150 python3 bench/mixed_step_bench.py --layouts blocks,split,branch --out "$out/mixed-step-$card.json"
      timeout 90 python3 bench/attention_kernel_bench.py --kernel varlen --layouts branch,split,blocks \
        ${BASELINE:+--baseline .baseline} --length 656 --max-len 1024 --out "$out/attention-varlen-$card.json" ;;
    guard-off)  # issue 35: the same long and mixed load with the TTFT guard never stretching (the target
      # alone), beside "defaults" for what the guard buys (~70 s): BENCH="defaults;guard-off"
      timeout 330 python3 bench/load_bench.py --scenarios long,mixed --seconds "${SECONDS_PER:-10}" \
        --worker-args=--ttft-target-ms=1000000 --label "defaults, TTFT guard off" --out "$out/load-guard-off-$card.json" ;;
    profile-penalties|profile-logprobs|profile-json_schema)  # issue 34: plain, then half the streams
      # with one kind, the engine profiled throughout (~100 s); report: bench/spy_report.py
      timeout 200 python3 bench/sampling_bench.py --preset llama-1b --only "${b#profile-}" --seconds 12 \
        --out "$out/sampling-$b-$card.json" > "$out/$b.txt" 2>&1 &
      spy "spy-${b#profile-}" $!; tail -3 "$out/$b.txt" ;;
    profile-parameterised)  # issue 34: plain, then half the streams parameterised (every kind at once),
      # the engine profiled throughout (~60 s)
      timeout 200 python3 bench/sampling_bench.py --preset llama-1b --seconds 12 \
        --out "$out/sampling-profile-parameterised-$card.json" > "$out/$b.txt" 2>&1 &
      spy spy-parameterised $!; tail -3 "$out/$b.txt" ;;
    profile-long|profile-mixed)  # issue 35: one scenario at the defaults, the engine profiled throughout (~60 s)
      timeout 200 python3 bench/load_bench.py --scenarios "${b#profile-}" --seconds 10 --no-step-times \
        --out "$out/load-${b#profile-}-profiled-$card.json" > "$out/$b.txt" 2>&1 &
      spy "spy-${b#profile-}" $!; grep "^${b#profile-}" "$out/$b.txt" ;;
    profile-start)  # issue 36: cold, warm and warm-again starts (PRESETS, default llama-8b; STARTS narrows
      # them), each worker and its engine core profiled from its first seconds to READY (~100 s)
      timeout 200 python3 bench/start_bench.py --presets "${PRESETS:-llama-8b}" ${STARTS:+--starts "$STARTS"} \
        --logs "$out/logs-profiled" --out "$out/start-profiled-$card.json" \
        > "$out/$b.txt" 2>&1 &
      spy spy-start $!; tail -4 "$out/$b.txt" ;;
    pacing)  # issue 35: long and decode streams with the stream pacing capped at 8 ms (the default since
      # 2026-12-05), then at 16 ms (before: 12.8 ms at 64 streams); both through thread_sampler (~150 s)
      timeout 200 python3 bench/load_bench.py --scenarios long,decode --seconds "${SECONDS_PER:-8}" \
        --max-flush-gap 0.008 --label "pacing capped at 8 ms" --out "$out/load-pacing-8ms-$card.json"
      timeout 200 python3 bench/load_bench.py --scenarios long,decode --seconds "${SECONDS_PER:-8}" --no-step-times \
        --max-flush-gap 0.016 --label "pacing capped at 16 ms (before)" --out "$out/load-pacing-16ms-$card.json" ;;
    *) eval "$b" ;;
  esac
done
# PACK=1: everything in $out as one gpu-out.tgz (a device call brings back at most 8 files; a few
# benchmarks and profiles together write more).
if [ "${PACK:-0}" = 1 ]; then
  (cd "$out" && tar czf /tmp/gpu-out.tgz --exclude=gpu-out.tgz . && rm -rf ./* && mv /tmp/gpu-out.tgz .)
fi
