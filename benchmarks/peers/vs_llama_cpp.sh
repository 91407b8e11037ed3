#!/usr/bin/env bash
# memserve vs llama.cpp's server on the same weights in the same precision: one stream at
# a time (batch-1 decode speed) or CONCURRENCY streams.
#
# llama.cpp is built from the source that the llama-cpp-python sdist on PyPI vendors (the
# one registry this machine reaches; PyPI has no llama.cpp binary for it), with its CPU
# backend tuned for this CPU (GGML_NATIVE). WEIGHTS=q4_1 (the default) serves the default
# SmolLM2 GGUF as it ships, Q4_1 with a Q8_0 embedding, on both sides (memserve at
# --quantization auto runs it quantized). WEIGHTS=f32 writes it out as float32 with
# llama-quantize (dequantizing is exact), so llama.cpp computes on the very float32
# weights memserve dequantizes the same file into (--quantization none). Both servers use
# every core and serve CONCURRENCY requests at a time (llama.cpp with as many slots); `memserve bench` sends the same random prompts to each (a
# fixed answer length, EOS ignored) and the report prints TBT, JCT and output tokens/s with
# the ratio memserve / llama.cpp.
#
#   benchmarks/peers/vs_llama_cpp.sh              # build (once, ~15 min on 2 cores) and compare
#   REQUESTS=4 OUTPUT_LEN=128 benchmarks/peers/vs_llama_cpp.sh
#   WEIGHTS=f32 benchmarks/peers/vs_llama_cpp.sh        # both on the widened float32 weights
#   CONCURRENCY=8 REQUESTS=32 benchmarks/peers/vs_llama_cpp.sh
#
# Run it on a quiet machine. Environment: PYTHON (memserve's interpreter), LLAMA_CPP_DIR
# (build folder, default ~/.cache/memserve/llama.cpp), LLAMA_CPP_PYTHON_VERSION (the sdist,
# default 0.3.36), WEIGHTS (q4_1 or f32), CONCURRENCY (1), REQUESTS (8), INPUT_LEN (128),
# OUTPUT_LEN (256), OUT (results folder), LLAMA_ARGS (extra llama-server options, e.g.
# --no-repack where its weight repacking crashes, as llama.cpp 0.5.0-dev's does on Q4_1
# weights on an AMX Xeon).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/memserve/llama.cpp}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WEIGHTS=${WEIGHTS:-q4_1}
CONCURRENCY=${CONCURRENCY:-1}
REQUESTS=${REQUESTS:-8}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-256}
OUT=${OUT:-$REPO/results/vs-llama-cpp-$(date +%Y%m%d-%H%M%S)}
MEMSERVE_PORT=${MEMSERVE_PORT:-8100}
LLAMA_PORT=${LLAMA_PORT:-8300}
NAME=bench-model
THREADS=$(nproc)

build_llama_cpp() {
  local src=$LLAMA_CPP_DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
  if [ -x "$src/build/bin/llama-server" ] && [ -x "$src/build/bin/llama-quantize" ]; then
    echo "$src/build/bin"; return
  fi
  mkdir -p "$LLAMA_CPP_DIR/src"
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    -d "$LLAMA_CPP_DIR" >&2
  tar xzf "$LLAMA_CPP_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$LLAMA_CPP_DIR/src"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
  cmake --build "$src/build" -j "$THREADS" --target llama-server llama-quantize >&2
  echo "$src/build/bin"
}

BIN=$(build_llama_cpp)
GGUF=$("$PYTHON" -c "from memserve.model_files.default_model import default_gguf_path; print(default_gguf_path())")
if [ "$WEIGHTS" = f32 ]; then
  LLAMA_GGUF=$LLAMA_CPP_DIR/$(basename "${GGUF%.gguf}").F32.gguf
  [ -f "$LLAMA_GGUF" ] || "$BIN/llama-quantize" --allow-requantize "$GGUF" "$LLAMA_GGUF" F32 "$THREADS" >&2
  QUANTIZATION=none
else
  LLAMA_GGUF=$GGUF
  QUANTIZATION=auto
fi
TOKENIZER=$("$PYTHON" -c "from memserve.model_files.gguf_convert import ensure_model_dir; print(ensure_model_dir(None))")

mkdir -p "$OUT"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $THREADS cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "llama.cpp: $("$BIN/llama-server" --version 2>&1 | head -1) from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION;" \
       "-t $THREADS -tb $THREADS --parallel $CONCURRENCY ${LLAMA_ARGS:-}, weights $LLAMA_GGUF"
  echo "memserve: --dtype float32 --quantization $QUANTIZATION, weights $GGUF"
  echo "workload: $REQUESTS random prompts of $INPUT_LEN tokens, $OUTPUT_LEN tokens out, concurrency $CONCURRENCY"
} | tee "$OUT/settings.txt"

# shellcheck source=server_control.sh
source "$REPO/benchmarks/peers/server_control.sh"

bench() {  # $1: server name, $2: base URL
  # A first request warms each server (kernels, caches) before the measured ones.
  for phase in warmup measured; do
    local n=$REQUESTS c=$CONCURRENCY
    [ "$phase" = warmup ] && n=1 && c=1
    "$PYTHON" -m memserve.cli bench --base-url "$2" --model "$NAME" --tokenizer "$TOKENIZER" --no-progress \
      --workload random --num-requests "$n" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --fixed-output-len --concurrency "$c" --seed "$([ "$phase" = warmup ] && echo 1 || echo 0)" \
      --output "$OUT/$phase/$WEIGHTS-c$CONCURRENCY-$1-1.json" >/dev/null
  done
}

(cd "$REPO" && exec "$PYTHON" -m memserve.cli up --no-auto-profile --port "$MEMSERVE_PORT" --dtype float32 \
   --quantization "$QUANTIZATION" --served-model-name "$NAME") >"$OUT/memserve.log" 2>&1 &
SERVER_PID=$!
wait_healthy "http://127.0.0.1:$MEMSERVE_PORT" "$OUT/memserve.log"
bench memserve "http://127.0.0.1:$MEMSERVE_PORT"
stop_server

"$BIN/llama-server" -m "$LLAMA_GGUF" --alias "$NAME" --port "$LLAMA_PORT" -t "$THREADS" -tb "$THREADS" \
  --parallel "$CONCURRENCY" -c $((4096 * CONCURRENCY)) ${LLAMA_ARGS:-} >"$OUT/llama-server.log" 2>&1 &
SERVER_PID=$!
wait_healthy "http://127.0.0.1:$LLAMA_PORT" "$OUT/llama-server.log"
bench llama.cpp "http://127.0.0.1:$LLAMA_PORT"
stop_server

"$PYTHON" "$REPO/benchmarks/peers/peer_report.py" "$OUT/measured"
