"""Typed configuration shared by the gateway and every worker process.

The gateway builds one ``ServeConfig`` from the command line and hands each worker a
``WorkerConfig`` (msgpack-friendly: plain fields only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from memserve.model_files.hub_cache import is_repo_id

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or .gguf path; None means the embedded SmolLM2
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"  # "cpu" or "cuda:N"
    cpu_threads: int | None = None  # a CPU worker's compute threads (default: one per bound CPU, else torch's)
    cpu_threads_bind: str | None = None  # CPUs of each CPU worker, "0-1|2-3" (workers/cpu_threads.py)
    cpu_gemm: str = "onednn"  # onednn (prepacked weights) | torch (F.linear); workers/model/packed_linear.py
    cpu_attention: str = "kernel"  # kernel (compiled decode attention, workers/model/cpu_kernels.py) | torch (SDPA)
    cpu_prefill_attention: str = "auto"  # auto (the faster here) | blocked | sdpa: workers/model/prefill_probe.py
    quantization: str = "auto"  # auto | none | gguf: GGUF weights run quantized on the CPU (workers/model/gguf_linear.py)
    enforce_eager: bool = False  # on CUDA, no decode graphs (workers/model/decode_graphs.py)
    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_gb
    kv_cache_gb: float = 1.0
    num_host_blocks: int = 0  # host-DRAM tier (same layout); 0 disables it
    disk_cache_dir: str | None = None  # disk tier: one file per KV block here; None disables it
    disk_cache_gb: float = 10.0  # the disk tier's budget
    async_save: bool = True  # save cached KV down the tiers on a background thread (False: inside the step)
    save_watermark: float = 0.1  # fraction of a tier kept free or being saved down, ahead of need
    layerwise_preload: bool = True  # a prefill computes while its slower-tier prefix loads, layer by layer
    preload_buffer_layers: int = -1  # layers a load may run ahead of the compute; -1: AttentionStore §3.2's formula
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # a prefill computes at most this many tokens a step; 0: no cap
    hold_shared_prefills: bool = True  # pass over requests sharing blocks a running prefill is computing
    max_model_len: int | None = None  # defaults to the model's context window
    enable_prefix_caching: bool = True
    kv_layout: str = "aggregated"  # aggregated | layer-major
    transfer_mode: str = "by-request-agg"  # PD handoffs: by-request-agg | by-request | by-layer (workers/engine/pd_sender.py)
    # KV transfers to workers on this machine: shm (the receiver copies out of the sender's
    # mapped pool: ipc/same_host.py, workers/kv_share.py) | zmq (frames, as to other hosts)
    kv_same_host_transport: str = "shm"
    schedule_policy: str = "fcfs"  # workers/engine/policies/__init__.py
    schedule_policy_options: str = ""  # e.g. cacheopt's "disable=PA,GR;reserve=8" (workers/engine/policies/cacheopt/options.py)
    cost_model: str | None = None  # JSON or preset: cacheopt weighs swap against recompute by it
    eviction_policy: str = "lru"  # kvcache/eviction.py
    cache_ttl_s: float | None = None  # cached blocks unused this long are dropped (kvcache/retention.py)
    max_pinned_fraction: float = 0.25  # of each tier, at most, pinned by cache_control (kvcache/pinning.py); 0: off
    max_pinned_fraction_per_key: float | None = None  # of each tier, at most, pinned by one API key; None: the above
    # vLLM's --speculative-config for n-gram drafts (workers/engine/ngram_proposer.py); None: off
    speculative_config: dict | None = None
    seed: int = 0

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step: what the router prices a
        prefill's chunks by."""
        cap = self.long_prefill_token_threshold
        return min(cap, self.max_num_batched_tokens) if cap > 0 else self.max_num_batched_tokens


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
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig = field(default_factory=EngineConfig)
    cpu_workers: int = 1
    gpus: list[int] | None = None
    roles: list[str] | None = None  # one per worker (--instances); None: all colocated
    pd_mode: str = "pd-caching-3"  # disaggregated caching milestone (gateway/routing/pd_topology.py)
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    router: str = "least-load"  # gateway/routing/router.py
    cost_model: str | None = None  # a cost-model JSON or preset; default: this model's `memserve profile`
    auto_profile: bool = True  # without a cost model, profile one in the background (gateway/auto_profile.py)
    router_balance_abs: int = 16  # load-imbalance guard (gateway/route_types.Balance)
    router_balance_rel: float = 1.5
    router_cache_threshold: float = 0.5  # prompt-tree follows prefixes covering at least this share
    slo_ttft_ms: float | None = None  # default SLOs of requests that name none (body field or header)
    slo_tbt_ms: float | None = None
    admission: str = "reject"  # off | reject | queue (gateway/routing/admission.py); needs a cost model
    admission_queue_size: int = 256  # requests held at most by --admission queue; 429 beyond
    predictor: str = "on"  # on | off: gateway output-length prediction for AddRequest (memserve/predictor/)
    heartbeat_timeout_s: float = 5.0  # a worker silent this long is declared dead and restarted
    spare_workers: int = 0  # CPU workers loaded and warmed up ahead, to replace one that dies
    internal_transport: str = "ipc"  # ipc: sockets in a private directory | tcp: CurveZMQ on internal_host
    # The address internal TCP sockets listen on; None: 127.0.0.1, or with ``ray`` the IP
    # Ray knows the gateway's node by.
    internal_host: str | None = None
    header_timeout_s: float = 10.0  # a request head must arrive this soon after connect / the last response
    body_timeout_s: float = 10.0  # a request body must arrive within this
    max_connections: int = 1024  # open HTTP connections; past it a new one is answered 503
    truncation: str = "kv-shift"  # a chat over the context window: kv-shift | recompute | error (text/truncation.py)
    tool_call_parser: str = "auto"  # how tool calls are read from the text (gateway/tool_parsers.py)
    reasoning_parser: str | None = None  # <think> text to reasoning_content (gateway/reasoning.py)
    # Stored /v1/responses responses (gateway/response_store.py): at most this many, none older.
    responses_store_size: int = 1000
    responses_store_ttl_s: float = 3600.0
    # API keys (gateway/auth.py): --api-key (repeatable) and MEMSERVE_API_KEY; empty: the API is
    # open. --metrics-api-key protects /metrics; --cache-salt-from-key salts unsalted requests
    # with their key's id. Kept out of repr: the keys must never reach a log.
    api_keys: list[str] = field(default_factory=list, repr=False)
    metrics_api_key: str | None = field(default=None, repr=False)
    cache_salt_from_key: bool = False
    web_ui: bool = True  # serve the chat page (/) and the dashboard (/dashboard); --no-web-ui: off
    kv_events_config: dict | None = None  # --kv-events-config: vLLM-format KV events (workers/kv_event_publisher.py)
    # --ray: place and supervise the workers with Ray (gateway/ray_launcher.py), joining the
    # cluster at this address ("": ray.init's default); None: local processes, no Ray.
    ray: str | None = None
    ray_placement: str = "spread"  # spread | pack: the workers' bundles over the Ray nodes


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
