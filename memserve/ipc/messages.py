"""Typed gateway <-> worker messages, encoded with msgpack.

Every message is a dataclass with a class-level ``kind`` tag. ``encode`` turns one into
bytes ``[version, kind, fields...]``, a dataclass inside it (a field, a list item, a dict
value) into the list of its fields; ``decode`` reverses it, rebuilding each dataclass that a
field's declared type names. Fields travel by position: new ones go at the end. Bulk KV
data never goes through here: it travels as separate zero-copy ZeroMQ frames next to a
header message.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Union

import msgpack

from memserve.kvcache.events import KVEvents
from memserve.kvcache.hashing import adapter_salt

PROTOCOL_VERSION = 1

# Temperatures below this sample greedily (as vLLM): dividing logits by a temperature
# that rounds to zero in float32 would turn them into inf and NaN.
GREEDY_TEMPERATURE = 1e-5

# One position's log-probabilities: (the chosen token's, the top token ids, their
# log-probabilities), plain lists so that msgpack carries them as they are.
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class SamplingParams:
    """What the worker needs to pick tokens. Stop *strings* are applied by the gateway,
    which owns detokenisation, and turn into an abort of the request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities of the raw logits: None = off, k = the chosen token plus the k
    # most likely ones, for each sampled token (logprobs) or prompt token (prompt_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit adjustments (workers/model/penalties.py); these defaults leave logits as they are.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Sequences sampled from the prompt (they share its KV blocks: workers/engine/parallel_sampling.py).
    n: int = 1
    # An llguidance grammar the output must match (structured output, forced tool calls:
    # workers/model/grammar.py); None leaves the output free.
    grammar: str | None = None
    # Keep the request's conversation cached at least this long after its last use, when
    # that is longer than the server's --cache-ttl (kvcache/retention.py).
    cache_ttl_s: float | None = None
    # Position-decoupled truncation (text/truncation.py, --truncation kv-shift): the
    # gateway removed these tokens from the conversation at token offset ``dropped_at``
    # (both block-aligned); the worker may reuse the KV cached for them before, shifted
    # (workers/engine/truncated_prefix.py). Empty: nothing dropped, or recompute it.
    dropped_at: int = 0
    dropped_token_ids: list[int] = field(default_factory=list)
    # vLLM's cache_salt: seeds the first KV block's name (kvcache/hashing.py), so the
    # request shares cached blocks only with requests of the same salt. Last: new fields
    # go at the end (fields travel by position).
    cache_salt: str | None = None
    # cache_control (kvcache/pinning.py): keep the blocks of the prompt's first
    # ``pin_tokens`` tokens cached for ``pin_ttl_s`` seconds. 0: no pin.
    pin_tokens: int = 0
    pin_ttl_s: float = 0.0
    # Whose pin it is (the API key's id; "" without keys): one key's pins are capped by
    # --max-pinned-fraction-per-key, so they cannot crowd every other key's out.
    pin_owner: str = ""
    # The LoRA adapter the request runs through (--lora-modules); None: the base model.
    lora_name: str | None = None
    # The digest of the adapter's files (model_files/adapter_digest.py), set by the gateway:
    # it names the adapter's blocks, and a worker serves the request only through those
    # weights. "" (a request made in-process): whatever the worker serves under the name.
    lora_digest: str = ""

    @property
    def kv_salt(self) -> str | None:
        """What the request's blocks are named with: ``cache_salt``, and the adapter, whose
        K and V are its own (kvcache/hashing.py ``adapter_salt``). Every place that names,
        finds, holds or sends the request's blocks uses this."""
        return adapter_salt(self.cache_salt, self.lora_name, self.lora_digest)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass
class AddRequest:
    kind: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    arrival_time: float = 0.0  # the gateway's wall clock (time.time()) when the request arrived
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    # The gateway predictor's output length for this request (moved by the Hoeffding
    # padding in the predicted deviation direction, at most max_tokens: memserve/predictor/),
    # or None when no prediction was made; SLO-aware policies size
    # KV allocations by it.
    predicted_output_tokens: int | None = None
    # Disaggregated prefill/decode (gateway/pd_flow.py). ``handoff``: a prefill instance
    # stops after the first token and keeps the request's KV for a ``HandoffStart``.
    # ``output_token_ids``: tokens already generated elsewhere (they count as output:
    # max_tokens, penalties, seeds); ``kv_ticket``: the prompt's KV arrived under it.
    handoff: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    kv_ticket: str = ""


def choice_request_id(request_id: str, index: int) -> str:
    """The worker's name of choice ``index`` of an n > 1 request: an ``AbortRequest`` for
    it stops that choice alone (one for ``request_id`` stops them all)."""
    return f"{request_id}#{index}"


@dataclass
class AbortRequest:
    kind: ClassVar[str] = "abort"
    request_id: str


@dataclass
class TierStats:
    """One MemPool tier's blocks (``MemPool.tier_stats``)."""

    total: int = 0
    free: int = 0  # on the free list
    cached: int = 0  # in the worker's index (what its KV events describe)
    evictable: int = 0  # cached and held by no request: allocatable by evicting them
    used: int = 0  # held by requests
    pinned: int = 0  # cached blocks pinned by requests' cache_control (kvcache/pinning.py)


@dataclass
class TierIO:
    """One tier's traffic; counts of blocks and bytes since the worker started, except
    ``bytes_used``, ``saving`` and ``queue_depth``, which are as of now."""

    bytes_used: int = 0  # of the blocks allocated there
    hits: int = 0  # cached blocks matched there
    read_bytes: int = 0  # loads and saves out of it
    write_bytes: int = 0
    saving: int = 0  # blocks being saved down out of it
    dropped_unsaved: int = 0  # cached blocks dropped though a slower tier exists
    queue_depth: int = 0  # blocks queued or in flight between it and another tier
    # The host tier above a disk tier only (None elsewhere): blocks prefetched from the
    # disk for queued requests, and those of them a request then read.
    prefetched: int | None = None
    prefetch_hits: int | None = None


@dataclass
class MemPoolStats:
    """A worker's MemPool: prompt tokens matched in its index, and per tier (by name:
    ``device``, ``host``, ``disk``, fastest first) its blocks and traffic."""

    hit_tokens: int = 0
    query_tokens: int = 0
    hit_rate: float = 0.0
    save_queue: int = 0  # save jobs not yet committed
    tiers: dict[str, TierStats] = field(default_factory=dict)
    tier_io: dict[str, TierIO] = field(default_factory=dict)

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> MemPoolStats:
        """``MemPool.stats()``'s report, typed (kvcache knows no wire format). A key this
        does not know fails here, in the worker, instead of reading as 0 at the gateway."""
        io = report["tier_io"]
        return cls(report["hit_tokens"], report["query_tokens"], report["hit_rate"], report["save_queue"],
                   {tier: TierStats(**report[tier]) for tier in io}, {tier: TierIO(**v) for tier, v in io.items()})


@dataclass
class KVAllocationStats:
    """The KV allocation of ``--schedule-policy cacheopt`` (workers/engine/policies/cacheopt)."""

    reserve_blocks: int = 0  # the global reserve
    reserve_in_use_blocks: int = 0  # lent to requests that outgrew their allocation
    unheld_blocks: int = 0  # allocated to running requests beyond what they use
    embedded_total: int = 0
    reserve_grants_total: int = 0
    proactive_top_ups_total: int = 0
    allocation_cuts_total: int = 0
    room_preemptions_total: int = 0


@dataclass
class PDStats:
    """A worker's KV handoffs (disaggregated prefill/decode), counted since it started
    except ``parked``, ``sending`` and ``holding``, which are as of now."""

    # Sent, as a prefill instance (workers/engine/pd_sender.py).
    handoffs: int = 0
    failed: int = 0
    blocks_sent: int = 0
    blocks_skipped: int = 0  # the receiver held them already
    bytes_sent: int = 0
    messages: int = 0
    transfer_s: float = 0.0
    kv_ready_s: float = 0.0  # from the end of the prefill step to the KV being at the receiver
    parked: int = 0  # requests whose KV is kept for a handoff not sent yet
    sending: int = 0
    # Received, as a decode instance (workers/engine/pd_receiver.py).
    resumed: int = 0
    resumed_without_kv: int = 0
    blocks_received: int = 0
    blocks_pinned: int = 0  # the receiver's cached prefix, kept for a transfer
    reclaimed: int = 0  # received KV freed: its request never resumed
    holding: int = 0
    # Transfers that read or wrote the other worker's pools in place, on one host (ipc/kv_transfer.py).
    in_place_sent: int = 0
    in_place_received: int = 0


@dataclass
class WorkerStats:
    """What a worker's heartbeats report: its scheduler's load and counters (those ending
    in ``_total`` count since it started), its schedule policy's, its MemPool's and its KV
    handoffs'."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_held_admissions: int = 0  # admitted after waiting for a running prefill to compute their blocks
    preemptions: dict[str, int] = field(default_factory=dict)  # by kind: swap, recompute
    num_swapped_in: int = 0  # blocks loaded from a slower tier
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0  # prompt tokens found cached
    cache_hit_rate: float = 0.0
    spec_draft_tokens_total: int = 0  # n-gram speculative decoding (--speculative-config)
    spec_accepted_tokens_total: int = 0
    # --schedule-policy cacheopt only: its KV allocation, step time budget and sweet spot.
    kv_allocation: KVAllocationStats | None = None
    max_step_ms: float | None = None
    sweet_spot_tokens: int | None = None
    mempool: MemPoolStats = field(default_factory=MemPoolStats)
    num_steps: int = 0
    pd: PDStats = field(default_factory=PDStats)
    loop_age_s: float = 0.0  # since the engine loop last went round: a stuck step shows here
    # Tensor parallelism: seconds rank 0's steps spent in collectives between the ranks, since start.
    tensor_parallel_comm_s: float = 0.0
    # LoRA adapters held ready in its slots (a request on one starts without reading it),
    # and the mean seconds reading one in took (0: none read yet).
    lora_adapters: list[str] = field(default_factory=list)
    lora_load_s: float = 0.0
    # Its KV pools' element type (--kv-cache-dtype), as torch names it: "float8_e4m3fn", "bfloat16".
    kv_cache_dtype: str = ""

    @classmethod
    def from_report(cls, engine_report: dict[str, Any], pd: PDStats) -> WorkerStats:
        """``Engine.stats()``'s report, typed, with the KV handoffs' counters. A key this
        does not know fails here, in the worker, instead of reading as 0 at the gateway."""
        report = dict(engine_report)
        mempool = MemPoolStats.from_report(report.pop("mempool"))
        allocation = report.pop("kv_allocation", None)
        return cls(**report, mempool=mempool, pd=pd,
                   kv_allocation=None if allocation is None else KVAllocationStats(**allocation))


@dataclass
class Heartbeat:
    """Sent both ways. From a worker it carries its load and pool statistics."""

    kind: ClassVar[str] = "heartbeat"
    instance_id: int
    time: float
    stats: WorkerStats = field(default_factory=WorkerStats)


@dataclass
class Shutdown:
    kind: ClassVar[str] = "shutdown"


@dataclass
class WorkerReady:
    kind: ClassVar[str] = "ready"
    instance_id: int
    role: str
    num_blocks: int
    block_size: int
    max_model_len: int
    stats: WorkerStats = field(default_factory=WorkerStats)
    transfer_addr: str = ""  # where peers reach this worker's KV transfer endpoint


@dataclass
class PeerAddresses:
    """Gateway -> worker: the KV transfer endpoints of the other instances."""

    kind: ClassVar[str] = "peers"
    addrs: dict[int, str]


@dataclass
class ExpectTransfer:
    """Gateway -> receiving worker, before any transfer starts: accept one transfer of at
    most ``max_blocks`` from ``src_instance`` under ``ticket``. Answered by
    ``TransferExpected``; the receiver allocates for nothing it was not told to expect."""

    kind: ClassVar[str] = "expect_transfer"
    transfer_id: int
    ticket: str
    src_instance: int
    max_blocks: int
    # Incremental transfers: the receiver pins its cached prefix of these tokens for the
    # ticket and answers how many blocks it holds, so only the rest is sent.
    token_ids: list[int] | None = None
    request_id: str = ""  # an abort of this request cancels the ticket
    # Seconds the ticket is kept without a transfer (None: the receiver's transfer timeout).
    # A handoff named while the prefill waits in P's queue needs longer.
    ttl_s: float | None = None
    cache_salt: str | None = None  # the request's: names ``token_ids``' blocks


@dataclass
class TransferExpected:
    kind: ClassVar[str] = "transfer_expected"
    transfer_id: int
    cached_blocks: int = 0  # leading blocks of ExpectTransfer.token_ids pinned at the receiver


@dataclass
class TransferPrefix:
    """Gateway -> worker: push the cached prefix of ``token_ids`` to ``dst_instance``
    (MemPool ``transfer_with_insert``) under ``ticket``, so requests routed there reuse it."""

    kind: ClassVar[str] = "transfer_prefix"
    transfer_id: int
    token_ids: list[int]
    dst_instance: int
    ticket: str = ""
    first_block: int = 0  # the receiver holds the blocks before this one: send the rest
    cache_salt: str | None = None  # the prompt's: names the blocks of ``token_ids`` (both ends)


@dataclass
class HandoffStart:
    """Gateway -> prefill instance: send request ``request_id``'s KV (kept since its first
    token) to ``dst_instance`` under ``ticket``, from block ``first_block`` on (the
    receiver holds the blocks before); ``insert``: the receiver indexes the prompt's
    full blocks (``transfer_with_insert``). A negative ``dst_instance`` drops the KV."""

    kind: ClassVar[str] = "handoff_start"
    request_id: str
    dst_instance: int
    ticket: str
    first_block: int = 0
    insert: bool = False


@dataclass
class HandoffDone:
    """Prefill instance -> gateway: the KV of ``request_id`` reached the decode instance
    (or ``error``); what it cost, for the worker's and the benchmark's accounting. The
    decode instance sends one too (``num_blocks`` only) as soon as the KV is there, so the
    request resumes without waiting for the prefill instance's next step boundary; the
    first of the two that says the KV arrived wins."""

    kind: ClassVar[str] = "handoff_done"
    request_id: str
    ticket: str
    num_blocks: int
    num_bytes: int = 0
    num_messages: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class TransferDone:
    kind: ClassVar[str] = "transfer_done"
    transfer_id: int
    num_blocks: int
    error: str | None = None


@dataclass
class RequestOutput:
    """The tokens one request produced in one engine step (a delta, not the total)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # the choice these tokens belong to (n > 1)
    # One TokenLogprobs per new token / per prompt token after the first (when asked).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With ``error``: the HTTP status the gateway answers with; None: a server error.
    error_status: int | None = None
    # Why the request's cache_control pin was not taken (pinning off, a cap passed): the
    # request is served all the same, unpinned, and the gateway says so in a header.
    pin_refused: str | None = None


@dataclass
class StepOutputs:
    kind: ClassVar[str] = "step"
    instance_id: int
    outputs: list[RequestOutput]


@dataclass
class WorkerError:
    """A fatal worker error, sent before the worker exits."""

    kind: ClassVar[str] = "error"
    instance_id: int
    message: str


MESSAGE_TYPES: dict[str, type] = {
    cls.kind: cls
    for cls in (AddRequest, AbortRequest, Heartbeat, Shutdown, WorkerReady, StepOutputs, WorkerError, PeerAddresses,
                ExpectTransfer, TransferExpected, TransferPrefix, TransferDone, HandoffStart, HandoffDone)
}


class Message(Protocol):
    """A message type: a dataclass with a class-level ``kind`` tag."""

    kind: ClassVar[str]


def register(cls: type[Message]) -> type[Message]:
    """Add a message type defined elsewhere (KV events, transfers) to the codec."""
    MESSAGE_TYPES[cls.kind] = cls
    return cls


def _plain(value: Any) -> Any:
    """``value`` as msgpack carries it: a dataclass, also in a list or as a dict's values,
    becomes the list of its fields."""
    if dataclasses.is_dataclass(value):
        return [_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and value and dataclasses.is_dataclass(next(iter(value.values()))):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _rebuilder(hint: Any) -> Callable[[Any], Any] | None:
    """What turns a decoded value of the declared type ``hint`` back into it: the
    dataclasses it names rebuilt, as a field, in a list, as a dict's values or optional.
    None where msgpack's value is already right."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decoder(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        one = _rebuilder(inner[0]) if len(inner) == 1 else None
        return None if one is None else (lambda v: None if v is None else one(v))
    if origin is list:
        item = _rebuilder(args[0])
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        entry = _rebuilder(args[1])
        return None if entry is None else (lambda v: {k: entry(x) for k, x in v.items()})
    return None


@functools.cache
def _decoder(cls: type) -> Callable[[list[Any]], Any]:
    """Builds ``cls`` from its encoded fields; worked out once per class, since step
    outputs are decoded many times a second."""
    hints = typing.get_type_hints(cls)
    rebuild = [_rebuilder(hints[f.name]) for f in dataclasses.fields(cls)]
    if not any(rebuild):
        return lambda values: cls(*values)
    return lambda values: cls(*[v if r is None else r(v) for r, v in zip(rebuild, values)])


def encode(msg: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, msg.kind, *_plain(msg)], use_bin_type=True)


def decode(data: bytes) -> Any:
    version, kind, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {version} != {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind!r}")
    return _decoder(cls)(values)


# kvcache's types that travel between processes; kvcache itself knows no wire format.
register(KVEvents)
