"""The cost model of one model on one kind of hardware (MemServe §5.3).

``exec(x, y)`` predicts the time to prefill a prompt of ``x`` tokens of which a ratio
``y`` is cached. It is the *operator-level* model: the sum of one fitted term per
operator class rather than one polynomial on total TTFT, because a sum of operators
keeps its meaning when a batch mixes sequences (attention is per sequence, GEMMs run
once over all new tokens) and can be rescaled per operator for other parallelism:

- compute-bound and constant operators (GEMMs, norms, activation, embedding, the
  engine's own overhead): ``per_token * N + per_seq * S + per_step`` for a step of N new
  tokens in S sequences;
- attention, per sequence: ``a*x²*y + b*x² + c*x + d`` (``a`` is negative: a cached
  prefix is attended to but not recomputed).

Decode steps, host<->device copies and worker-to-worker transfers have their own small
linear models. A model comes from ``memserve profile`` (JSON under ``cost_model_dir()``,
keyed by model, dtype and hardware; see ``store.py``) or from a preset (``presets.py``).

Pure Python, no numpy and no torch: the router, admission and the simulator evaluate it
in the gateway process."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1


def slug(text: str) -> str:
    """A file-name-safe, lower-case form of a model or hardware name."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class CostKey:
    """What a cost model is valid for."""

    model: str  # served model name, e.g. SmolLM2-135M-Instruct
    dtype: str  # resolved: float32 | bfloat16 | float16
    hardware: str  # e.g. cpu-amd-epyc-2t, cuda-nvidia-h100-80gb-hbm3

    def file_name(self) -> str:
        return f"{slug(self.model)}-{self.dtype}-{slug(self.hardware)}.json"


@dataclass(frozen=True)
class OperatorCost:
    """A compute-bound or constant operator class, summed over all layers of one step."""

    per_token: float = 0.0  # seconds per new token in the step
    per_seq: float = 0.0  # seconds per sequence in the step
    per_step: float = 0.0  # seconds per step
    kind: str = "compute"  # compute | constant | communication | overhead (documentation only)

    def __call__(self, num_tokens: float, num_seqs: int) -> float:
        return self.per_token * num_tokens + self.per_seq * num_seqs + self.per_step


@dataclass(frozen=True)
class AttentionCost:
    """Prefix attention of one sequence, all layers: ``a*x²*y + b*x² + c*x + d``."""

    a: float
    b: float
    c: float
    d: float

    def __call__(self, x: float, y: float) -> float:
        return self.a * x * x * y + self.b * x * x + self.c * x + self.d


@dataclass(frozen=True)
class DecodeCost:
    """One decode step: weights are read once per step, KV once per context token.
    ``padded``: the engine's decode attention pads every sequence to the longest context
    in the batch (memserve's SDPA path), so a step reads batch x longest context tokens of
    KV; paged kernels read each sequence's own context."""

    per_step: float
    per_seq: float
    per_context_token: float
    padded: bool = False


@dataclass(frozen=True)
class BandwidthCost:
    """Moving ``n`` bytes takes ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass
class CostModel:
    key: CostKey
    block_size: int
    kv_bytes_per_token: int  # K and V of every layer for one token
    operators: dict[str, OperatorCost]
    attention: AttentionCost
    decode: DecodeCost
    copy: BandwidthCost  # host <-> device, within a worker
    transfer: BandwidthCost  # worker -> worker
    meta: dict[str, Any] = field(default_factory=dict)  # source, notes, fit errors, samples

    # ------------------------------------------------------------ evaluation
    def prefill_s(self, x: int, y: float = 0.0) -> float:
        """MemServe's exec(x, y): one prompt of ``x`` tokens, ratio ``y`` cached, alone in a step."""
        return self.prefill_batch_s([(x, y)])

    def prefill_batch_s(self, seqs: Iterable[tuple[int, float]]) -> float:
        """One step prefilling several prompts, each given as (x, y): operators run once
        over all new tokens, attention once per sequence."""
        seqs = [(x, y) for x, y in seqs if x > 0]
        if not seqs:
            return 0.0
        new_tokens = sum(x * (1.0 - y) for x, y in seqs)
        ops = sum(op(new_tokens, len(seqs)) for op in self.operators.values())
        return ops + sum(self.attention(x, y) for x, y in seqs)

    def decode_step_s(self, batch_size: int, total_context_tokens: int, longest_context: int | None = None) -> float:
        """One decode step of ``batch_size`` sequences holding ``total_context_tokens`` in KV,
        the longest holding ``longest_context`` (when known: a padded decode reads it for
        every sequence)."""
        if batch_size <= 0:
            return 0.0
        d = self.decode
        if d.padded and longest_context is not None:
            total_context_tokens = batch_size * longest_context
        return d.per_step + d.per_seq * batch_size + d.per_context_token * total_context_tokens

    def decode_steps_s(self, batch_size: int, total_context_tokens: int, longest_context: int,
                       num_steps: int) -> list[float]:
        """``decode_step_s`` of ``num_steps`` decode steps in a row of the same sequences,
        each holding one more token in every step (the simulator times a run of them at
        once); the same sums, without a call per step."""
        if batch_size <= 0:
            return [0.0] * num_steps
        d = self.decode
        fixed, per_token = d.per_step + d.per_seq * batch_size, d.per_context_token
        if d.padded:
            return [fixed + per_token * (batch_size * (longest_context + k)) for k in range(num_steps)]
        return [fixed + per_token * (total_context_tokens + k * batch_size) for k in range(num_steps)]

    def step_s(self, prefills: Iterable[tuple[int, float]], batch_size: int, total_context_tokens: int,
               longest_context: int | None = None) -> float:
        """One step that prefills ``prefills`` (as in ``prefill_batch_s``) and decodes
        ``batch_size`` sequences (as in ``decode_step_s``) in one forward pass: its fixed
        cost (the weights read, the launch overhead) is paid once, not once per part."""
        prefill = self.prefill_batch_s(prefills)
        decode = self.decode_step_s(batch_size, total_context_tokens, longest_context)
        return prefill + decode - (self.shared_step_s() if prefill and decode else 0.0)

    def shared_step_s(self) -> float:
        """The fixed cost a prefill and a decode batch share when they run in one step:
        the smaller of the two parts' per-step terms."""
        return min(self.decode.per_step, sum(op.per_step for op in self.operators.values()))

    def transfer_s(self, nbytes: float) -> float:
        """Worker-to-worker KV transfer of ``nbytes`` (MemServe eq. 2's transfer())."""
        return self.transfer(nbytes) if nbytes > 0 else 0.0

    def copy_s(self, nbytes: float) -> float:
        """Host <-> device copy of ``nbytes`` inside one worker (swap in/out)."""
        return self.copy(nbytes) if nbytes > 0 else 0.0

    def slowed(self, factor: float) -> CostModel:
        """This model with every compute term (prefill operators and attention, decode
        steps) ``factor`` times longer and copies and transfers unchanged: workers that
        get a share of the cores they were profiled on (3 one-thread workers on 2 cores:
        1.5)."""
        def op(o: OperatorCost) -> OperatorCost:
            return OperatorCost(o.per_token * factor, o.per_seq * factor, o.per_step * factor, o.kind)

        a, d = self.attention, self.decode
        return dataclasses.replace(
            self, operators={k: op(o) for k, o in self.operators.items()},
            attention=AttentionCost(a.a * factor, a.b * factor, a.c * factor, a.d * factor),
            decode=DecodeCost(d.per_step * factor, d.per_seq * factor, d.per_context_token * factor, d.padded),
            meta={**self.meta, "slowed_by": factor})

    # ----------------------------------------------------------------- storage
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "key": vars(self.key),
            "block_size": self.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill": {"operators": {k: vars(v) for k, v in self.operators.items()},
                        "attention": vars(self.attention)},
            "decode": vars(self.decode),
            "copy": vars(self.copy),
            "transfer": vars(self.transfer),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"cost model schema version {d.get('schema_version')!r}; expected {SCHEMA_VERSION}")
        prefill = d["prefill"]
        return cls(
            key=CostKey(**d["key"]),
            block_size=d["block_size"],
            kv_bytes_per_token=d["kv_bytes_per_token"],
            operators={k: OperatorCost(**v) for k, v in prefill["operators"].items()},
            attention=AttentionCost(**prefill["attention"]),
            decode=DecodeCost(**d["decode"]),
            copy=BandwidthCost(**d["copy"]),
            transfer=BandwidthCost(**d["transfer"]),
            meta=d.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)  # readers never see a half-written file
        return path
