"""Typed configuration shared by the gateway and every worker process.

The gateway builds one ``ServeConfig`` from the command line and hands each worker a
``WorkerConfig`` (msgpack-friendly: plain fields only).

Each ``memserve up`` flag is declared here, once, on the field it sets (``option()``,
memserve/options.py): its flag, help, choices and default; the command line and
docs/configuration.md are made from these fields. Flags appear in field order,
EngineConfig's before ServeConfig's. Choices that live in an application's registry
(routing, admission, PD modes, schedule policies, tool-call and reasoning parsers) are
``REGISTERED`` here and bound by the command line, since this library may not import
them. ``ServeConfig.validate`` holds the rules between fields; checks that need an
application's code (a schedule policy's options, a JSON option's keys, CPU lists) stay
with the command line.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memserve.ipc.same_host import KV_SAME_HOST_TRANSPORTS
from memserve.kvcache.eviction import EVICTION_POLICIES
from memserve.model_files.hub_cache import is_repo_id
from memserve.options import REGISTERED, fraction, json_object, non_negative_int, option, positive_float
from memserve.text.truncation import DEFAULT_TRUNCATION, TRUNCATION_MODES

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = ["auto", "float32", "bfloat16", "float16"]
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3"]  # fp8 and fp8_e4m3: float8_e4m3fn
ATTENTION_BACKENDS = ["auto", "sdpa", "xformers", "triton"]  # workers/model/attention_backend.py
ON_OFF = {"on": True, "off": False}


def _buffer_layers(text: str) -> int:
    """``--preload-buffer-layers``: a layer count, or ``auto`` (-1: §3.2's formula)."""
    return -1 if text == "auto" else non_negative_int(text)


def lora_module(text: str) -> list[str]:
    """``--lora-modules`` entry, ``name=path`` or vLLM's JSON object with name and path: [name, path]."""
    if text.lstrip().startswith("{"):
        entry = json_object(text)
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise argparse.ArgumentTypeError("a JSON LoRA module needs string 'name' and 'path'")
        return [entry["name"], entry["path"]]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return [name, path]


def attention_backend_name(text: str) -> str:
    """``--attention-backend``: lower-cased, vLLM's TRITON_ATTN and TORCH_SDPA read as triton
    and sdpa (its XFORMERS is ours lower-cased), so that a vLLM command line works as is."""
    name = text.strip().lower()
    return {"triton_attn": "triton", "torch_sdpa": "sdpa"}.get(name, name)


def _gpu_ids(text: str) -> list[int] | None:
    """``--gpus 0,1``: GPU ids; empty: none."""
    return [int(g) for g in text.split(",")] if text else None


@dataclass
class EngineConfig:
    model: str | None = option(
        None, help="HF folder, .gguf file, or a repo id (org/name): from the local Hugging Face cache, "
                   "else downloaded (default: embedded SmolLM2-135M-Instruct)")
    dtype: str = option("auto", choices=DTYPES)
    # "cpu", or the worker's GPUs as the box numbers them, one per tensor-parallel rank:
    # "cuda:2" or "cuda:2,3" (``rank_device``).
    device: str = "cpu"
    cpu_threads: int | None = option(
        None, type=int, help="compute threads per CPU worker (default: one per CPU of --cpu-threads-bind, else all)")
    # CPUs of each CPU worker, "0-1|2-3" (workers/cpu_threads.py)
    cpu_threads_bind: str | None = option(
        None, env="MEMSERVE_CPU_THREADS_BIND",
        help="pin each CPU worker's compute threads, one per CPU: CPU lists per worker separated "
             "by '|', e.g. '1' or '0-1|2-3'; the gateway moves to the CPUs left over "
             "(env MEMSERVE_CPU_THREADS_BIND)")
    # onednn (prepacked weights) | torch (F.linear); workers/model/packed_linear.py
    cpu_gemm: str = option(
        "onednn", choices=["onednn", "torch"],
        help="CPU matrix products: oneDNN over weights prepacked at load (default; "
             "benchmarks/micro/packed_linear_micro.py measures both) "
             "or torch's F.linear")
    # kernel (compiled decode attention, workers/model/cpu_kernels.py) | torch (SDPA)
    cpu_attention: str = option(
        "kernel", choices=["kernel", "torch"],
        help="CPU decode attention: a compiled kernel reading the KV blocks in place (default; built "
             "on first use with g++, falls back to torch where it cannot be) or torch's SDPA over "
             "gathered blocks")
    # auto (the faster here) | blocked | sdpa: workers/model/prefill_probe.py
    cpu_prefill_attention: str = option(
        "auto", choices=["auto", "blocked", "sdpa"],
        help="CPU prefill attention: oneDNN products over query blocks in float32, torch's SDPA, or "
             "auto (default): whichever a short probe at start-up measures faster on this CPU")
    # sdpa | xformers | triton (workers/model/attention_backend.py); auto: the first that loads here
    attention_backend: str = option(
        "auto", type=attention_backend_name, choices=ATTENTION_BACKENDS,
        help="attention over the paged KV cache (vLLM's flag; its TRITON_ATTN, XFORMERS, TORCH_SDPA are read "
             "too): triton (a Triton kernel reading the KV blocks in place: Ampere or newer GPUs; on the CPU "
             "only under Triton's interpreter, TRITON_INTERPRET=1, for tests), xformers (one call over "
             "gathered blocks, CUDA), sdpa (torch's SDPA over gathered blocks; on the CPU the paths of "
             "--cpu-attention and --cpu-prefill-attention); auto (default): on a GPU the first of triton, "
             "xformers, sdpa that loads, on the CPU sdpa (docs/architecture.md)")
    # GGUF weights (workers/model/gguf_linear.py) and Hugging Face quantized checkpoints
    # (workers/model/quantization_config.py) run quantized
    quantization: str = option(
        "auto", flags=["--quantization", "-q"], choices=["auto", "none", "gguf", "fp8", "awq", "gptq"],
        help="weights as the checkpoint ships them (docs/quantization.md): auto (default) runs a GGUF "
             "file's quantized linear weights on the CPU, and a checkpoint's quantization_config (FP8, "
             "AWQ, GPTQ) as it ships; none widens a GGUF file's weights to --dtype; gguf, awq, gptq "
             "insist on that method; fp8 also quantizes a float checkpoint to FP8 at load")
    load_format: str = option(
        "auto", choices=["auto", "dummy"],
        help="auto reads the checkpoint's weights; dummy (vLLM's) gives every weight small random values "
             "on the device and reads only config.json: for timing a model's shape without its files")
    # Ranks per worker, each holding a shard of every layer (workers/tensor_parallel_group.py)
    tensor_parallel_size: int = option(
        1, flags=["--tensor-parallel-size", "-tp"], type=int,
        help="split each worker's model over this many rank processes (vLLM's flag): one per GPU "
             "(--gpus 0,1,2,3 -tp 2: two workers of two GPUs), or CPU processes; the attention "
             "heads, KV heads and MLP widths must divide by it (docs/parallelism.md)")
    # LoRA adapters over the base model, several in one batch (workers/model/lora.py)
    enable_lora: bool = option(False, help="serve LoRA adapters (--lora-modules), several in one batch")
    lora_modules: list[list[str]] | None = option(
        None, type=lora_module, nargs="+", metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) a request names as its model: name=path, or vLLM's JSON form "
             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; needs --enable-lora")
    max_loras: int = option(1, type=int, help="LoRA adapters one step may run, kept ready (vLLM's flag); "
                                              "requests on another adapter wait")
    max_lora_rank: int = option(16, type=int, help="the highest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(None, type=int, help="LoRA adapters kept in host memory (vLLM's flag; "
                                                               "on the CPU the same memory as --max-loras)")
    # On CUDA, no decode graphs (workers/model/decode_graphs.py)
    enforce_eager: bool = option(
        False, help="on a GPU, run every step eagerly: no CUDA graphs, which otherwise replay decode steps "
                    "(captured at start-up per batch size and context width)")
    # PD handoffs (workers/engine/pd_sender.py)
    transfer_mode: str = option(
        "by-request-agg", choices=["by-request-agg", "by-request", "by-layer"],
        help="prefill-to-decode KV transfers (MemServe §4.3, §5.2): after the prefill, one frame per "
             "run of aggregated blocks, or one per layer's K or V of each block; by-layer: one "
             "message per layer during the prefill, overlapping its compute")
    # KV transfers to workers on this machine: shm (the receiver copies out of the sender's
    # mapped pool: ipc/same_host.py, workers/kv_share.py) | zmq (frames, as to other hosts)
    kv_same_host_transport: str = option(
        "shm", choices=KV_SAME_HOST_TRANSPORTS,
        help="KV transfers between workers on one machine: shm (the receiver copies the blocks "
             "straight out of the sender's KV pool, mapped once per connection: shared memory on "
             "CPU, CUDA IPC on a GPU both see; ZeroMQ carries only the control messages) or zmq (the "
             "blocks as ZeroMQ frames, as between machines). shm falls back to frames for a peer "
             "that cannot map the pool")
    # num_blocks, when set, overrides kv_cache_gb; the flags go one without the other.
    num_blocks: int | None = option(None, type=int, exclusive="kv size", help="KV blocks per worker")
    kv_cache_gb: float = option(1.0, type=float, exclusive="kv size", help="KV cache size per worker")
    # The KV pools' element type in every tier (workers/kv_pools.py): auto is --dtype's.
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES,
        help="KV cache element type (vLLM's flag): auto (default) keeps K and V in --dtype; fp8 (or "
             "fp8_e4m3) stores them as float8_e4m3fn with scale 1.0, half bf16's bytes and a quarter of "
             "float32's in every tier, widened where attention reads them (docs/quantization.md); "
             "vLLM's fp8_e5m2 is not offered")
    # Host-DRAM tier (same layout as the device's).
    num_host_blocks: int = option(0, type=int, help="host-DRAM KV tier blocks per worker")
    # Disk tier: one file per KV block (workers/kv_disk.py).
    disk_cache_dir: str | None = option(
        None, help="disk KV tier: cached blocks saved here as files (kept across restarts); off by default")
    disk_cache_gb: float = option(10.0, type=float, help="size of the disk KV tier per worker")
    async_save: bool = True  # save cached KV down the tiers on a background thread (False: inside the step)
    save_watermark: float = 0.1  # fraction of a tier kept free or being saved down, ahead of need
    block_size: int = option(16, type=int)
    max_num_seqs: int = option(64, type=int)
    max_num_batched_tokens: int = option(2048, type=int)
    long_prefill_token_threshold: int = option(
        0, type=int,
        help="a prefill computes at most this many tokens a step, so that short prompts admitted "
             "beside a long one are not held behind it (vLLM's option); 0: no cap")
    # Hold requests sharing blocks a running prefill is computing.
    hold_shared_prefills: bool = option(
        True, flags=["--no-shared-prefill-hold"],
        help="admit a request at once even when a running prefill is computing blocks of its "
             "prompt (by default it waits for them and finds them cached)")
    # vLLM's --speculative-config for n-gram drafts (workers/engine/ngram_proposer.py); None: off
    speculative_config: dict | None = option(
        None, type=json_object, metavar="JSON",
        help="speculative decoding by prompt lookup, vLLM's option and keys: e.g. '{\"method\": "
             "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
             "\"prompt_lookup_min\": 2}'; greedy requests without logprobs, penalties or "
             "grammars take drafts (docs/speculative_decoding.md); off by default")
    max_model_len: int | None = option(None, type=int)  # defaults to the model's context window
    enable_prefix_caching: bool = option(
        True, flags=["--no-prefix-cache"], help="disable context caching (the baseline)")
    kv_layout: str = option("aggregated", choices=["aggregated", "layer-major"])
    # workers/engine/policies/__init__.py
    schedule_policy: str = option(
        "fcfs", choices=REGISTERED,
        help="order of admission and choice of preemption victims in each worker; lpm: the "
             "longest cached prefix first (SGLang's), so returning conversations skip the queue; "
             "cacheopt: SLO-aware batching, KV allocation and preemption (CacheOpt §3)")
    # workers/engine/policies/cacheopt/options.py
    schedule_policy_options: str = option(
        "", help="options of the schedule policy, e.g. cacheopt's 'disable=PA,GR;reserve=8;m=2;b=8'")
    # JSON or preset: cacheopt weighs swap against recompute by it (ServeConfig.cost_model's flag)
    cost_model: str | None = None
    # kvcache/eviction.py
    eviction_policy: str = option(
        "lru", choices=sorted(EVICTION_POLICIES),
        help="which cached KV blocks a tier gives up first (scheduler-aware: those the waiting "
             "queue needs go last, and its disk blocks are prefetched to the host tier)")
    # workers/layer_preload.py
    layerwise_preload: bool = option(
        True, choices=ON_OFF,
        help="on: a prefill whose cached prefix sits in a slower tier runs while that prefix is "
             "copied in layer by layer, each layer waited for just before it computes "
             "(AttentionStore §3.2); off: the request waits for the whole copy first")
    # -1: AttentionStore §3.2's formula, per load.
    preload_buffer_layers: int = option(
        -1, type=_buffer_layers, metavar="N|auto",
        help="layers a preload may copy ahead of the compute (its read buffer): 0 starts the copy "
             "with the request's step, one layer ahead; N copies N layers before it and stays N "
             "ahead; auto (default) sizes it per load by §3.2's formula from measured copy and "
             "compute rates")
    # kvcache/retention.py
    cache_ttl_s: float | None = option(
        None, flags=["--cache-ttl"], type=float, metavar="SECONDS",
        help="drop cached conversations unused for this long from every tier (default: kept until "
             "capacity evicts them); a request may ask for longer with the body field cache_ttl_s")
    # kvcache/pinning.py
    max_pinned_fraction: float = option(
        0.25, type=fraction, metavar="F",
        help="at most this fraction of each KV tier may be pinned by requests' cache_control "
             "(a message's {\"type\": \"ephemeral\", \"ttl\": \"5m\"|\"1h\"}); a request whose pin "
             "would pass it is served unpinned (header x-memserve-cache-pin); 0 turns pinning off")
    max_pinned_fraction_per_key: float | None = option(
        None, type=fraction, metavar="F",
        help="at most this fraction of each KV tier may be pinned by one API key's requests, so one "
             "tenant's pins cannot crowd out the others' (default: --max-pinned-fraction)")
    seed: int = option(0, type=int)

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step: what the router prices a
        prefill's chunks by."""
        cap = self.long_prefill_token_threshold
        return min(cap, self.max_num_batched_tokens) if cap > 0 else self.max_num_batched_tokens

    def rank_device(self, rank: int = 0) -> str:
        """The torch device of tensor-parallel rank ``rank``: ``cuda:3`` for rank 1 of
        ``cuda:2,3``. Every GPU of the box stays visible to a worker (so a peer's KV pool
        opens on the peer's GPU, workers/kv_share.py); each rank binds to its own."""
        kind, _, gpus = self.device.partition(":")
        if kind != "cuda" or not gpus:
            return self.device
        ids = gpus.split(",")
        if rank >= len(ids):
            raise ValueError(f"device {self.device!r} names {len(ids)} GPUs: none for tensor-parallel rank {rank}")
        return f"cuda:{ids[rank]}"

    @property
    def lora_paths(self) -> dict[str, str]:
        """``--lora-modules`` as adapter name -> folder."""
        return {name: path for name, path in self.lora_modules or []}

    def validate(self) -> None:
        """Raise ValueError, naming the flag, for a value the engine cannot run with."""
        if self.cache_ttl_s is not None and self.cache_ttl_s <= 0:
            raise ValueError(f"--cache-ttl must be positive, got {self.cache_ttl_s}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if len(self.lora_paths) != len(self.lora_modules or []):
            raise ValueError("--lora-modules names an adapter twice")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")


@dataclass
class WorkerConfig:
    instance_id: int
    role: str  # colocated | prefill | decode
    engine: EngineConfig
    gateway_addr: str  # ZeroMQ address of the gateway's ROUTER socket
    heartbeat_s: float = 1.0
    runtime_dir: str = ""  # private directory for ipc:// sockets ("" = TCP on internal_host)
    internal_host: str = "127.0.0.1"  # where the KV transfer socket listens when on TCP
    # --kv-events-config (vLLM's KVEventsConfig as a dict): KV events published in vLLM's
    # format (workers/kv_event_publisher.py); None: off.
    kv_events_config: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerConfig":
        d = dict(d)
        d["engine"] = EngineConfig(**d["engine"])
        return cls(**d)


@dataclass
class ServeConfig:
    served_model_name: str | None = option(None)
    host: str = option("127.0.0.1")
    port: int = option(8000, type=int)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cpu_workers: int = option(1, type=int, help="worker processes on a machine without a GPU")
    gpus: list[int] | None = option(None, type=_gpu_ids, help="comma-separated GPU ids, one worker each (e.g. 0,1)")
    roles: list[str] | None = None  # one per worker (the command line's --instances); None: all colocated
    # Disaggregated caching milestone (gateway/routing/pd_topology.py).
    pd_mode: str = option(
        "pd-caching-3", choices=REGISTERED,
        help="disaggregated prefill/decode caching (MemServe Table 4): pd-basic (transfer only), "
             "pd-caching-1 (cache at prefill), pd-caching-2 (decode caches too: incremental "
             "transfers), pd-caching-3 (decode-phase KV returns to prefill)")
    max_body_bytes: int = 4 * 1024 * 1024
    router: str = option("least-load", choices=REGISTERED,  # gateway/routing/router.py
                         help="how the gateway picks a worker for each request")
    # A cost-model JSON or preset; default: this model's `memserve profile`. The flag sets
    # the engine's cost_model too.
    cost_model: str | None = option(
        None, help="cost model for routing and TTFT predictions: a `memserve profile` JSON or a preset "
                   "(default: this model's profile; without one, one is made in the background)")
    # Without a cost model, profile one in the background (gateway/auto_profile.py).
    auto_profile: bool = option(
        True, flags=["--no-auto-profile"],
        help="without a cost model, do not profile one in the background (`memserve profile --quick`, "
             "about 30 s of CPU, written where `memserve profile` writes); cost routing then stays on "
             "its prompt-tree fallback and SLO admission stays off")
    # Load-imbalance guard (gateway/route_types.Balance).
    router_balance_abs: int = option(
        16, type=int,
        help="prompt-tree/cost: requests in flight beyond the least loaded worker after which the "
             "least loaded one is chosen instead (with --router-balance-rel)")
    router_balance_rel: float = option(
        1.5, type=float, help="... and the ratio to the least loaded worker's requests it must also exceed")
    router_cache_threshold: float = option(
        0.5, type=float, help="prompt-tree: follow a cached prefix only when it covers this share of the prompt")
    # Default SLOs of requests that name none (body field or header).
    slo_ttft_ms: float | None = option(
        None, type=positive_float,
        help="TTFT SLO of requests that set none (body slo_ttft_ms or header x-slo-ttft-ms)")
    slo_tbt_ms: float | None = option(
        None, type=positive_float,
        help="TBT SLO of requests that set none (body slo_tbt_ms or header x-slo-tbt-ms)")
    # off | reject | queue (gateway/routing/admission.py); needs a cost model.
    admission: str = option(
        "reject", choices=REGISTERED,
        help="requests the cost model predicts to miss their TTFT SLO on every worker: reject "
             "(429 with Retry-After), queue (hold them until they fit), off (admit all); "
             "judges once there is a cost model (--cost-model, `memserve profile`, or the background "
             "profile of a first start)")
    admission_queue_size: int = option(
        256, type=non_negative_int, help="--admission queue: requests held at most; one more is answered 429")
    # Gateway output-length prediction for AddRequest (memserve/predictor/).
    predictor: str = option(
        "on", choices=["on", "off"],
        help="predict each request's output length in the gateway (learned online from finished "
             "requests, padded by the Hoeffding bound) for the cacheopt schedule policy")
    heartbeat_timeout_s: float = option(
        5.0, flags=["--heartbeat-timeout"], type=float,
        help="seconds of silence after which a worker is declared dead, failed and restarted")
    spare_workers: int = option(
        0, type=int,
        help="CPU workers kept loaded and warmed up to replace one that dies within a second "
             "(each holds the model and a KV pool in memory)")
    # ipc: sockets in a private directory | tcp: CurveZMQ on internal_host. None: ipc, or
    # tcp with ``ray`` (made so at construction).
    internal_transport: str | None = option(
        None, choices=["ipc", "tcp"],
        help="gateway-worker and KV transfer sockets: ipc files in a private directory (one "
             "machine), or TCP on --internal-host encrypted and authenticated with CurveZMQ "
             "(default: ipc; tcp with --ray, which needs it)")
    # The address internal TCP sockets listen on; None: 127.0.0.1, or with ``ray`` the IP
    # Ray knows the gateway's node by.
    internal_host: str | None = option(
        None, help="address of the gateway's internal TCP sockets (default: 127.0.0.1; with --ray, the IP "
                   "Ray knows the gateway's node by; workers under Ray listen on their own node's IP)")
    # Place and supervise the workers with Ray (gateway/ray_launcher.py, docs/multi-node.md),
    # joining the cluster at this address ("": ray.init's default); None: local processes.
    ray: str | None = option(
        None, group="Ray", nargs="?", const="", metavar="ADDRESS",
        help="place and supervise the workers with Ray, one actor per worker on the nodes of a Ray "
             "cluster: --ray alone joins $RAY_ADDRESS or the cluster last started on this machine, "
             "else starts a local one; 'auto' joins this machine's cluster; HOST:PORT or "
             "ray://HOST:PORT joins that one (needs pip install 'memserve[ray]')")
    ray_placement: str = option(  # spread | pack: the workers' bundles over the Ray nodes
        "spread", group="Ray", choices=["spread", "pack"],
        help="with --ray, one placement group holds a bundle per worker ({GPU: 1}, or {CPU: "
             "--cpu-threads, default 1}): spread puts them on as many nodes as it can, pack on as "
             "few")
    header_timeout_s: float = option(
        10.0, flags=["--header-timeout"], type=float,
        help="seconds a connection has to send a complete request head (from connect or the last response)")
    body_timeout_s: float = option(
        10.0, flags=["--body-timeout"], type=float, help="seconds a request body has to arrive (408)")
    max_connections: int = option(
        1024, type=int, help="open HTTP connections; a new one past this is answered 503")
    # A chat over the context window (text/truncation.py).
    truncation: str = option(
        DEFAULT_TRUNCATION, choices=TRUNCATION_MODES,
        help="a chat over the context window: drop whole blocks of its oldest turns (keeping the "
             "system prompt) and reuse their successors' cached KV shifted (kv-shift) or recompute "
             "it (recompute); or refuse it with 400 (error)")
    # How tool calls are read from the text (gateway/tool_parsers.py).
    tool_call_parser: str = option(
        "auto", choices=REGISTERED,
        help="how the model writes tool calls for tool_choice auto: hermes (<tool_call> tags), "
             "llama3_json (Llama 3.1's JSON), mistral ([TOOL_CALLS]); auto: the one the chat template "
             "writes, else hermes")
    # <think> text to reasoning_content (gateway/reasoning.py).
    reasoning_parser: str | None = option(
        None, choices=REGISTERED,
        help="put the model's <think>...</think> text in the message's reasoning_content instead of "
             "its content: qwen3 (the model opens <think>), deepseek_r1 (the template opens it)")
    # Stored /v1/responses responses (gateway/response_store.py): at most this many, none older.
    responses_store_size: int = option(
        1000, type=int, metavar="N",
        help="stored /v1/responses responses (store: true) kept for GET and previous_response_id, per "
             "server; past it the oldest goes first; 0: none is kept")
    responses_store_ttl_s: float = option(
        3600.0, flags=["--responses-store-ttl"], type=float, metavar="SECONDS",
        help="seconds a stored /v1/responses response is kept")
    web_ui: bool = option(
        True, flags=["--no-web-ui"],
        help="do not serve the chat page (/) and the cache dashboard (/dashboard); the stats API "
             "(/v1/stats, /v1/stats/stream) stays")
    # API keys (gateway/auth.py): --api-key (repeatable) and MEMSERVE_API_KEY, which the
    # command line adds; empty: the API is open. --metrics-api-key protects /metrics;
    # --cache-salt-from-key salts unsalted requests with their key's id. Kept out of repr:
    # the keys must never reach a log.
    api_keys: list[str] = option(
        default_factory=list, repr=False, flags=["--api-key"], group="API keys", append=True, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 "
             "otherwise); repeat for several keys. Also read from MEMSERVE_API_KEY (comma-separated "
             "keys). /health stays open")
    metrics_api_key: str | None = option(
        None, repr=False, group="API keys", metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /metrics (open without it)")
    cache_salt_from_key: bool = option(
        False, group="API keys",
        help="salt every request's KV cache with its API key (combined with a body's cache_salt, "
             "never replaced by it), so clients with different keys never share cached KV blocks "
             "(needs --api-key)")
    allow_runtime_lora_updating: bool = option(
        False, help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which change the LoRA "
                    "adapters served while running (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs --enable-lora)")
    # vLLM-format KV events (workers/kv_event_publisher.py).
    kv_events_config: dict | None = option(
        None, group="KV events", type=json_object, metavar="JSON",
        help="publish each worker's KV cache events in vLLM's format (ZeroMQ PUB + replay "
             "ROUTER), e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
             "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5600\", "
             "\"topic\": \"kv-events\"}'; worker i binds each TCP port + i, or replaces "
             "{instance} (docs/observability.md)")

    def __post_init__(self) -> None:
        if self.internal_transport is None:  # workers under Ray may run on other nodes: TCP
            self.internal_transport = "ipc" if self.ray is None else "tcp"

    def validate(self) -> None:
        """Raise ValueError, naming the flags, for values that cannot serve together."""
        self.engine.validate()
        if self.responses_store_size < 0 or self.responses_store_ttl_s <= 0:
            raise ValueError("--responses-store-size must be at least 0 and --responses-store-ttl positive")
        if self.ray is not None:
            if importlib.util.find_spec("ray") is None:  # found, not imported: the gateway imports it later
                raise ValueError("--ray needs Ray, which is not installed: pip install 'memserve[ray]'")
            if self.internal_transport == "ipc":
                raise ValueError("--ray needs --internal-transport tcp: the workers may run on other nodes")
            if self.spare_workers:
                raise ValueError("--spare-workers starts local processes; it does not go with --ray")
        if self.cache_salt_from_key and not self.api_keys:
            raise ValueError("--cache-salt-from-key needs --api-key or MEMSERVE_API_KEY")
        if self.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")


def served_model_name(cfg: ServeConfig) -> str:
    """The name clients ask for: ``--served-model-name``, else the folder's or GGUF's name."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.engine.model is None:
        return DEFAULT_MODEL_NAME
    if is_repo_id(cfg.engine.model):
        return cfg.engine.model  # a Hugging Face repo id is served under its own name, as vLLM does
    path = Path(cfg.engine.model)
    return path.stem.split(".")[0] if path.suffix == ".gguf" else path.name
