"""A model runner that computes nothing: it advances virtual time by the cost model.

It executes the same ``StepPlan``s as the real runner, so the simulator drives the real
engine, scheduler, KV manager and MemPool. A step's duration is the cost model's prefill
time for its prefill chunks (each with its cached ratio) plus its decode step time for
the decoding requests, their shared fixed cost (the weights read) counted once
(``CostModel.step_s``); a KV load finishes ``copy_s(bytes)`` after it starts, plus the
disk read of its disk blocks (``DISK_READ_BYTES_S``). A disk tier of ``num_disk_blocks``
is bookkeeping only. Saves down the tiers and prefetches are synchronous and take no
simulated time, unless the runner has an asynchronous saver (``async_saves``,
``sim/saver.py``): then each copy takes its bytes over the host link (the cost model's
``copy``), or the disk's bandwidth when it reads or writes the disk tier, or
``save_bytes_s`` for every copy when given (a slow saver); a step that waited for saves
is that much longer. Sampled tokens are synthetic (``synthetic_token``) and never end a
request: the workload's lengths do (ignore_eos)."""

from __future__ import annotations

import bisect
import itertools
import math
import zlib
from collections.abc import Callable, Sequence

from memserve.costmodel.model import CostModel
from memserve.kvcache.address import Tier
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.mover import BlockMover, Buffer
from memserve.kvcache.saver import Saver, SaveJob
from memserve.sim.adapters import AdapterReads
from memserve.sim.saver import TimedSaver
from memserve.workers.engine.layer_hooks import LayerHooks
from memserve.workers.engine.step_plan import KVLoad, StepPlan, StepResult

SIM_VOCAB = 1 << 20  # synthetic token ids live below this
# An NVMe SSD's sequential read, "several GB/s" (AttentionStore §3.3): an assumption.
DISK_READ_BYTES_S = 3e9
# Its sequential write, about two thirds of the read on NVMe datasheets: an assumption.
DISK_WRITE_BYTES_S = 2e9


def synthetic_token(last_token: int, context_len: int) -> int:
    """The token a simulated greedy model samples after a context of ``context_len``
    tokens ending in ``last_token``. A function of the context, as greedy decoding is:
    the copies of a session (``--share-ratio``) get the same answers, so their next
    turns' prompts stay identical and share the cache, as on a real model."""
    return 1 + zlib.crc32(b"%d:%d" % (last_token, context_len)) % (SIM_VOCAB - 2)


def synthetic_answer(last_token: int, context_len: int, num_tokens: int) -> list[int]:
    """The next ``num_tokens`` tokens decoded after a context of ``context_len`` tokens
    ending in ``last_token``, each ``synthetic_token`` of the context before it."""
    answer = []
    crc32, vocab = zlib.crc32, SIM_VOCAB - 2
    for length in range(context_len, context_len + num_tokens):
        last_token = 1 + crc32(b"%d:%d" % (last_token, length)) % vocab
        answer.append(last_token)
    return answer


class NullMover:
    """Block copies cost time in the cost model, not work here."""

    def __init__(self, block_nbytes: int) -> None:
        self.block_nbytes = block_nbytes

    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        pass

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        return [bytes(self.block_nbytes * len(blocks))]

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        pass


class SimulatedRunner:
    def __init__(self, cost: CostModel, num_blocks: int, block_size: int, max_model_len: int,
                 clock: Callable[[], float], num_disk_blocks: int = 0, async_saves: bool = False,
                 save_bytes_s: float | None = None, adapters: AdapterReads | None = None) -> None:
        self.cost = cost
        self.num_blocks = num_blocks
        self.num_disk_blocks = num_disk_blocks
        # None: saves are bookkeeping here, synchronous and exact (the MemPool's InlineSaver).
        self.timed_saver = TimedSaver(clock, self.save_s) if async_saves else None
        self.saver: Saver | None = self.timed_saver
        self.save_bytes_s = save_bytes_s
        self.disk: DiskStore | None = None
        self.num_layers = 1  # a step is timed whole, not layer by layer
        self.block_size = block_size
        self.vocab_size = SIM_VOCAB
        self.max_position_embeddings = max_model_len
        self.mover: BlockMover = NullMover(cost.kv_bytes_per_token * block_size)
        self.clock = clock
        self.last_step_s = 0.0  # duration of the latest execute()
        self.last_stall_s = 0.0  # of which waiting for saves
        self._loads: dict[str, float] = {}  # request id -> virtual time its load is done
        self.adapters = adapters  # LoRA adapter slots (None: no adapters served)
        self._adapter_of: dict[str, str] = {}  # request id -> the LoRA adapter it runs through

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.loads:
            self.start_loads(plan.loads)
        reading_s = self._read_adapters(plan) if self.adapters is not None else 0.0
        prefills: list[tuple[int, float]] = []  # (tokens, ratio cached) of each prefill chunk
        decodes = context = longest = 0  # the decoding requests, their context tokens and the longest
        sampled: dict[str, int] = {}
        for c in plan.chunks:
            start, num_tokens = c.start_pos, len(c.token_ids)
            end = start + num_tokens
            if num_tokens > 1 or start == 0:
                prefills.append((end, start / end))
            elif num_tokens == 1:
                decodes += 1
                context += end
                longest = max(longest, end)
            if c.sample:
                sampled[c.request_id] = synthetic_token(c.token_ids[-1], end)
        cost = self.cost
        self.last_stall_s = self.timed_saver.take_stall() if self.timed_saver is not None else 0.0
        self.last_step_s = self.last_stall_s + reading_s + (
            cost.step_s(prefills, decodes, context, longest) if prefills else cost.decode_step_s(decodes, context,
                                                                                                  longest))
        return StepResult(sampled)

    def _read_adapters(self, plan: StepPlan) -> float:
        """Seconds reading in the LoRA adapters this step's requests run and the slots lack."""
        assert self.adapters is not None
        for rid in plan.finished_ids:
            self._adapter_of.pop(rid, None)
        for new in plan.new_requests:
            if new.params.lora_name is not None:
                self._adapter_of[new.request_id] = new.params.lora_name
        needed = {self._adapter_of[c.request_id] for c in plan.chunks if c.request_id in self._adapter_of}
        return self.adapters.step_s(needed)

    def save_s(self, job: SaveJob) -> float:
        """How long the asynchronous saver copies ``job``'s blocks."""
        nbytes = len(job.src_blocks) * self.mover.block_nbytes
        if self.save_bytes_s:
            return nbytes / self.save_bytes_s
        if job.dst_tier == Tier.DISK:
            return nbytes / DISK_WRITE_BYTES_S
        if job.src_tier == Tier.DISK:
            return nbytes / DISK_READ_BYTES_S
        return self.cost.copy_s(nbytes)

    def decode_run(self, last_tokens: Sequence[int], positions: Sequence[int], max_steps: int, start: float,
                   until: float) -> tuple[list[float], list[list[int]]]:
        """What ``execute`` gives for plans of single-token decodes, request i's last token
        ``last_tokens[i]`` at ``positions[i]``, without the plans (plain decode steps,
        ``sim/plain_decodes.py``): up to ``max_steps`` such steps in a row from ``start``, each
        request fed its token of the step before; the first, then each that starts before
        ``until``, and none from one that would take no time on (nor any that starts before
        ``until`` only by being shorter than the first: a cost model whose decode time
        falls as the context grows). Returns when each ends and each request's tokens over
        them. A step's duration is ``CostModel.step_s`` without prefills: its decode part."""
        n = len(positions)
        total, longest = sum(positions) + n, max(positions) + 1  # the context tokens, as execute counts them
        first = self.cost.decode_step_s(n, total, longest)
        if first <= 0:
            return [], []
        if until < math.inf:  # steps no shorter than the first: at most this many start before ``until``
            max_steps = min(max_steps, int((until - start) / first) + 2)
        durations = self.cost.decode_steps_s(n, total, longest, max_steps)
        if min(durations) <= 0:
            del durations[next(k for k, d in enumerate(durations) if d <= 0):]
        ends = list(itertools.accumulate(durations, initial=start))
        del ends[0]
        del ends[bisect.bisect_left(ends, until) + 1:]  # each step starts when the one before ends
        return ends, [synthetic_answer(t, p + 1, len(ends)) for t, p in zip(last_tokens, positions)]

    def start_loads(self, loads: list[KVLoad]) -> None:
        now = self.clock()
        for load in loads:
            nbytes = sum(len(src) for _, src, _ in load.copies) * self.mover.block_nbytes
            disk_bytes = sum(len(src) for tier, src, _ in load.copies if tier == Tier.DISK) * self.mover.block_nbytes
            self._loads[load.request_id] = now + self.cost.copy_s(nbytes) + disk_bytes / DISK_READ_BYTES_S

    def next_load_done(self) -> float | None:
        return min(self._loads.values(), default=None)

    def next_done(self) -> float | None:
        """When the next load or save in flight is done (None: none is)."""
        saved = self.timed_saver.next_done() if self.timed_saver is not None else None
        loaded = self.next_load_done()
        return loaded if saved is None else saved if loaded is None else min(saved, loaded)

    def finished_loads(self) -> list[str]:
        if not self._loads:
            return []
        now = self.clock()
        done = [rid for rid, at in self._loads.items() if at <= now]
        for rid in done:
            del self._loads[rid]
        return done

    def failed_loads(self) -> dict[str, BaseException]:
        return {}  # simulated loads never fail

    def streamable_loads(self) -> list[str]:
        return []  # a simulated load is whole: its request runs once it is done

    def shift_blocks(self, src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
        """Nothing to move: the simulator keeps no KV, only the index the shift fills."""


    def add_step_hooks(self, make: Callable[[StepPlan], LayerHooks | None]) -> None:
        raise NotImplementedError("the simulator times a step whole: it has no per-layer hooks (by-layer transfers)")

    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        raise NotImplementedError("the simulator keeps no KV to read: by-layer transfers are not simulated")
