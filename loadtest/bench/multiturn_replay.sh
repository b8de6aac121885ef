#!/usr/bin/env bash
# ShareGPT and agentic conversations replayed at a fixed conversation rate against `duet up`
# (1 prefill + 1 decode), once with KV reuse (the default) and once with --disable-prefix-cache;
# then one comparison per workload: TTFT p50/p90 and cached share by turn index, and its PNG.
#
#   bash loadtest/bench/multiturn_replay.sh [OUT_DIR]        # default ./multiturn-replay
#
# Sizes are for the embedded default model on a CPU (a few minutes a run); on a GPU raise them
# with the environment: SHAREGPT_N, SHAREGPT_RATE, AGENTIC_N, AGENTIC_RATE, SYSTEM_LEN, DUET_UP_ARGS.
set -euo pipefail
out=${1:-multiturn-replay}
port=${PORT:-18900}
mkdir -p "$out"
url="http://127.0.0.1:$port"

serve() {  # $1: label; the rest: worker flags
  local label=$1; shift
  duet up --prefill 1 --decode 1 --port "$port" --log-dir "$out/logs-$label" ${DUET_UP_ARGS:-} -- "$@" \
    > "$out/duet-up-$label.log" 2>&1 &
  stack=$!
  for _ in $(seq 600); do
    curl -sf "$url/health" > /dev/null 2>&1 && curl -sf "$url/v1/models" | grep -q '"id"' && return 0
    kill -0 "$stack" 2> /dev/null || { tail -20 "$out/duet-up-$label.log"; return 1; }
    sleep 1
  done
  echo "duet up ($label) did not become ready" >&2
  return 1
}

stop() {
  kill -INT "$stack" 2> /dev/null || true
  wait "$stack" 2> /dev/null || true
}
trap stop EXIT

for label in reuse nocache; do
  if [ "$label" = nocache ]; then serve "$label" --disable-prefix-cache; else serve "$label"; fi
  python -m loadtest multiturn --base-url "$url" --workload sharegpt \
    --conversations "${SHAREGPT_N:-24}" --max-turns 6 --max-output-len 48 --mode poisson \
    --conversation-rate "${SHAREGPT_RATE:-0.5}" --think-time 2 --think-time-dist exponential \
    --temperature 0 --no-progress --label "sharegpt-$label" -o "$out/sharegpt-$label"
  python -m loadtest multiturn --base-url "$url" --workload agentic \
    --conversations "${AGENTIC_N:-8}" --max-turns 6 --system-len "${SYSTEM_LEN:-1500}" --num-tools 8 \
    --tool-output-len 200 --output-len 32 --mode poisson --conversation-rate "${AGENTIC_RATE:-0.25}" \
    --think-time 0.5 --temperature 0 --no-progress --label "agentic-$label" -o "$out/agentic-$label"
  stop
done
trap - EXIT
for w in sharegpt agentic; do
  python -m loadtest multiturn compare "$out/$w-reuse/results.json" "$out/$w-nocache/results.json" \
    -o "$out/$w-compare"
done
