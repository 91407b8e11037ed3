#!/usr/bin/env bash
# Replays the ShareGPT sample against memserve and against Hugging Face's
# `transformers serve --continuous-batching`, one after the other, on the same SmolLM2
# weights (the Hugging Face folder memserve converts its embedded GGUF into), at two
# session rates, then writes the side-by-side comparison and plots.
#
# Needs: pip install "transformers[serving]"  (fastapi, uvicorn, ...)
# Usage: benchmarks/peers/vs_transformers_serve.sh   (settings below, overridable by env)
# Output: $OUT/{memserve,transformers}.json, $OUT/compare.txt, $OUT/plots/*.png
#
# Greedy decoding with natural output lengths: both servers produce the same tokens on
# the same weights, so both are replayed with the same conversations and answers.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
OUT=${OUT:-bench-results/vs-transformers}
RATES=${RATES:-0.25,0.5}              # session starts per second, one run each
NUM_SESSIONS=${NUM_SESSIONS:-16}      # per rate
MAX_TURNS=${MAX_TURNS:-4}
MAX_TOKENS=${MAX_TOKENS:-64}
MAX_SESSION_TOKENS=${MAX_SESSION_TOKENS:-3000}
SEED=${SEED:-0}
DTYPE=${DTYPE:-float32}
MEMSERVE_PORT=${MEMSERVE_PORT:-8011}
TRANSFORMERS_PORT=${TRANSFORMERS_PORT:-8012}
STARTUP_TIMEOUT_S=${STARTUP_TIMEOUT_S:-600}

mkdir -p "$OUT"
# transformers serve lists models from the hub cache and fails when the folder is missing.
export HF_HUB_CACHE=${HF_HUB_CACHE:-$OUT/hf-hub}
mkdir -p "$HF_HUB_CACHE"
SERVER_PID=""

log() { printf '[vs_transformers_serve] %s\n' "$*" >&2; }

stop_server() {
  # Each server runs in its own session (setsid), so this reaches its workers too.
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 40); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'log "interrupted"; exit 130' INT TERM

start_server() {  # start_server NAME PORT COMMAND...: background it, wait for /health
  local name=$1 port=$2
  shift 2
  log "starting $name on port $port: $*"
  setsid "$@" >"$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$((SECONDS + STARTUP_TIMEOUT_S))
  until $PY -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
      "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "$name exited during startup; last lines of $OUT/$name.log:"
      tail -n 20 "$OUT/$name.log" >&2
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$name not healthy after ${STARTUP_TIMEOUT_S}s; see $OUT/$name.log"
      exit 1
    fi
    sleep 1
  done
  log "$name is up"
}

bench() {  # bench LABEL PORT EXTRA_ARGS...
  local label=$1 port=$2
  shift 2
  $PY -m memserve.cli bench --base-url "http://127.0.0.1:$port" --label "$label" \
    --workload sharegpt --num-sessions "$NUM_SESSIONS" --max-turns "$MAX_TURNS" \
    --max-session-tokens "$MAX_SESSION_TOKENS" --max-tokens "$MAX_TOKENS" --temperature 0 \
    --sweep-rate "$RATES" --seed "$SEED" --warmup 2 --output "$OUT/$label.json" "$@"
}

$PY -c "import fastapi, uvicorn" 2>/dev/null || {
  log 'transformers serve needs its extra: pip install "transformers[serving]"'
  exit 1
}
# The Hugging Face folder memserve converts its embedded GGUF into (override: MODEL_DIR=...).
MODEL_DIR=${MODEL_DIR:-$($PY -c "from memserve.model_files.gguf_convert import ensure_model_dir; print(ensure_model_dir(None))")}
log "model folder: $MODEL_DIR"
# transformers serve picks the model class from config.json's "architectures".
$PY -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("architectures") else 1)' \
    "$MODEL_DIR/config.json" || {
  log "$MODEL_DIR/config.json has no \"architectures\": transformers serve cannot load it"
  exit 1
}

start_server memserve "$MEMSERVE_PORT" \
  $PY -m memserve.cli up --no-auto-profile --model "$MODEL_DIR" --port "$MEMSERVE_PORT" --dtype "$DTYPE"
bench memserve "$MEMSERVE_PORT"
stop_server

start_server transformers "$TRANSFORMERS_PORT" \
  transformers serve "$MODEL_DIR" --continuous-batching --host 127.0.0.1 --port "$TRANSFORMERS_PORT" \
  --dtype "$DTYPE"
# transformers serve is pinned to MODEL_DIR and rejects fields outside the OpenAI schema.
bench transformers "$TRANSFORMERS_PORT" --model "$MODEL_DIR" --dialect transformers
stop_server

$PY -m memserve.cli bench compare "$OUT/memserve.json" "$OUT/transformers.json" --plot "$OUT/plots" \
  | tee "$OUT/compare.txt"
log "done: $OUT"
