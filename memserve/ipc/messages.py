"""Typed gateway <-> worker messages, encoded with msgpack.

Every message is a dataclass with a class-level ``kind`` tag. ``encode`` turns one into
bytes ``[version, kind, fields...]``; ``decode`` reverses it. Bulk KV data never goes
through here: it travels as separate zero-copy ZeroMQ frames next to a header message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgpack

from memserve.kvcache.events import KVEvent, KVEvents

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
class Heartbeat:
    """Sent both ways. From a worker it carries its load and pool statistics."""

    kind: ClassVar[str] = "heartbeat"
    instance_id: int
    time: float
    stats: dict[str, Any] = field(default_factory=dict)


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
    stats: dict[str, Any] = field(default_factory=dict)
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

# Nested dataclass fields that need rebuilding on decode.
_NESTED: dict[tuple[str, str], type] = {
    ("add", "params"): SamplingParams,
}
_NESTED_LISTS: dict[tuple[str, str], type] = {
    ("step", "outputs"): RequestOutput,
}


class Message(Protocol):
    """A message type: a dataclass with a class-level ``kind`` tag."""

    kind: ClassVar[str]


def register(cls: type[Message], nested: dict[str, type] | None = None,
             nested_lists: dict[str, type] | None = None) -> type[Message]:
    """Add a message type defined elsewhere (KV events, transfers) to the codec."""
    MESSAGE_TYPES[cls.kind] = cls
    for name, sub in (nested or {}).items():
        _NESTED[(cls.kind, name)] = sub
    for name, sub in (nested_lists or {}).items():
        _NESTED_LISTS[(cls.kind, name)] = sub
    return cls


def _fields(obj: Any) -> list[Any]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _fields(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_fields(v) for v in value]
        out.append(value)
    return out


def encode(msg: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, msg.kind, *_fields(msg)], use_bin_type=True)


def decode(data: bytes) -> Any:
    version, kind, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {version} != {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind!r}")
    kwargs = {}
    for f, value in zip(dataclasses.fields(cls), values):
        if (kind, f.name) in _NESTED:
            value = _NESTED[(kind, f.name)](*value)
        elif (kind, f.name) in _NESTED_LISTS:
            value = [_NESTED_LISTS[(kind, f.name)](*v) for v in value]
        kwargs[f.name] = value
    return cls(**kwargs)


# kvcache's types that travel between processes; kvcache itself knows no wire format.
register(KVEvents, nested_lists={"events": KVEvent})
