"""``memserve profile``: measure this model on this hardware and fit its cost model.

Everything is measured through the real serving path, so the model predicts what a
worker does: prefill and decode steps run through ``Engine.add_request``/``step`` (the
real scheduler, MemPool and runner), with operator hooks (``op_timer.py``) splitting each
prefill step into MemServe's operator classes; copies go through ``KVPools.copy_blocks``
between tiers; transfers through a ``KVTransferEndpoint`` to a receiver process
(``transfer_probe.py``).

Grid: prompt lengths x cached ratios (a cached prefix is made by running a prompt first
and then one sharing its first y*x tokens, block-aligned), a few batch compositions,
decode batch sizes x context lengths, copy and transfer sizes. Some points are held out
of the fit to measure its error (``cost_fit.py``).

The grid is measured ``repeats`` times, in passes, each pass in a new random order, and
each point keeps the median of its runs. On a shared machine a burst of load then costs
one run of many points, which the median drops, instead of every run of the few points
measured during the burst (which biased whole classes of points when points were
repeated back to back). A run that a pause of the process fell into (the gateway pauses
its background profile while it serves) is run again (``resume_guard.py``)."""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from memserve.config import EngineConfig, ServeConfig, served_model_name
from memserve.costmodel.fit import (
    OVERHEAD,
    BandwidthSample,
    DecodeSample,
    FitError,
    PrefillSample,
    Samples,
    fit_cost_model,
)
from memserve.costmodel.model import CostKey, CostModel, slug
from memserve.costmodel.store import default_path, tensor_parallel_suffix
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams
from memserve.kvcache.address import Tier
from memserve.model_files.generation import eos_token_ids
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.engine.engine import Engine
from memserve.workers.kv_pools import KVPools
from memserve.workers.model_runner import ModelRunner
from memserve.workers.op_timer import OperatorTimer, llama_operator_classes
from memserve.workers.real_engine import build_runner
from memserve.workers.resume_guard import ResumeGuard
from memserve.workers.transfer_probe import TransferProbe

Batch = tuple[tuple[int, float], ...]  # one step's prompts as (tokens x, cached ratio y)
COPY_POOL_BYTES = 256 * 2**20  # per tier, cycled through by the copy measurements


class ProfileError(RuntimeError):
    """A grid point did not run as planned (e.g. a prefill took more than one step)."""


@dataclass(frozen=True)
class Grid:
    name: str
    prompt_lengths: tuple[int, ...]
    held_out_lengths: tuple[int, ...]
    cached_ratios: tuple[float, ...]
    batches: tuple[Batch, ...]
    held_out_batches: tuple[Batch, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_context_lens: tuple[int, ...]
    held_out_decode: tuple[tuple[int, int], ...]  # (batch size, context length)
    copy_blocks: tuple[int, ...]  # also the transfer sizes, in KV blocks
    held_out_copy_blocks: tuple[int, ...]

    def prefill_points(self) -> list[tuple[Batch, bool]]:
        singles = [(((x, y),), held) for lengths, held in ((self.prompt_lengths, False),
                                                           (self.held_out_lengths, True))
                   for x in lengths for y in self.cached_ratios]
        return singles + [(b, False) for b in self.batches] + [(b, True) for b in self.held_out_batches]

    def decode_points(self) -> list[tuple[int, int, bool]]:
        grid = [(b, c, False) for b in self.decode_batch_sizes for c in self.decode_context_lens]
        return grid + [(b, c, True) for b, c in self.held_out_decode]

    def size_points(self) -> list[tuple[int, bool]]:
        return [(n, False) for n in self.copy_blocks] + [(n, True) for n in self.held_out_copy_blocks]


FULL = Grid(
    name="full",
    prompt_lengths=(64, 128, 256, 512, 1024, 2048),
    held_out_lengths=(96, 384, 768, 1536),
    cached_ratios=(0.0, 0.25, 0.5, 0.75),
    batches=(((256, 0.0),) * 4, ((512, 0.5), (512, 0.5), (128, 0.0)), ((1024, 0.75), (256, 0.25), (64, 0.0))),
    held_out_batches=(((384, 0.25),) * 3, ((768, 0.5), (192, 0.0)), ((128, 0.0),) * 8),
    decode_batch_sizes=(1, 4, 16, 32),
    decode_context_lens=(64, 256, 1024),
    held_out_decode=((2, 128), (8, 512), (24, 256)),
    copy_blocks=(1, 4, 16, 64),
    held_out_copy_blocks=(8, 32),
)
QUICK = Grid(
    name="quick",
    prompt_lengths=(32, 64, 128),
    held_out_lengths=(96,),
    cached_ratios=(0.0, 0.5),
    batches=(((64, 0.0), (64, 0.0)), ((128, 0.5), (32, 0.0))),
    held_out_batches=(((64, 0.5), (32, 0.0)),),
    decode_batch_sizes=(1, 4),
    decode_context_lens=(32, 96),
    held_out_decode=((2, 64),),
    copy_blocks=(1, 4, 16),
    held_out_copy_blocks=(8,),
)


def device_sync(device: torch.device) -> Callable[[], None]:
    """Wait for queued kernels before reading the clock (CPU work is synchronous)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def hardware_name(device: torch.device, tensor_parallel_size: int = 1) -> str:
    """``cuda-<device name>`` or ``cpu-<model name>-<torch threads>t``, then ``-tp<N>``
    for a model split over N ranks (each rank's device and threads)."""
    return _device_name(device) + tensor_parallel_suffix(tensor_parallel_size)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return slug(f"cuda-{torch.cuda.get_device_name(device)}")
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1]
                break
    except OSError:
        pass
    return slug(f"cpu-{name}-{torch.get_num_threads()}t")


class Profiler:
    """Runs prefill and decode steps of one engine through its public API, one run a call;
    ``runner``, the engine's, has the model its operator hooks go on."""

    def __init__(self, engine: Engine, runner: ModelRunner, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.block_size = engine.cfg.block_size
        self.vocab_size = runner.model_config.vocab_size
        self.sync = device_sync(runner.device)
        self.timer = OperatorTimer(llama_operator_classes(runner.model), self.sync)
        self._ids = itertools.count()

    def tokens(self, n: int) -> list[int]:
        """Fresh random tokens: no prefix of them is cached by accident."""
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def cached_tokens(self, x: int, y: float) -> int:
        """y*x rounded down to whole blocks, leaving at least one token to compute."""
        return min(int(y * x), x - 1) // self.block_size * self.block_size

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"profile-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rejected = self.engine.add_request(AddRequest(request_id, prompt, params))
        if rejected is not None:
            raise ProfileError(f"the engine rejected a {len(prompt)}-token prompt: {rejected.error}")
        return request_id

    def _step(self) -> tuple[float, list[RequestOutput]]:
        self.sync()
        start = time.perf_counter()
        outputs = self.engine.step()
        self.sync()
        return time.perf_counter() - start, outputs

    def _drain(self) -> None:
        while self.engine.has_work:
            self.engine.step()

    def _prime(self, prefixes: list[list[int]]) -> None:
        """Make each prefix cached: a full prefill the first time (or after eviction), one
        block's worth later on."""
        for prefix in prefixes:
            if prefix:
                self._add(prefix, 1)
        self._drain()

    @staticmethod
    def _check(outputs: list[RequestOutput], expected_cached: dict[str, int], what: str) -> None:
        got = {o.request_id: o.num_cached_tokens for o in outputs if o.error is None}
        if got != expected_cached:
            raise ProfileError(f"{what} did not run as one step with the planned cache hits: "
                               f"expected {expected_cached}, got {got}")

    def warm_up(self, prompt_len: int, batch_size: int) -> None:
        """Pay one-time costs (allocator growth, kernel selection) before measuring."""
        self._add(self.tokens(prompt_len), 2)
        self._drain()
        for _ in range(batch_size):
            self._add(self.tokens(self.block_size), 2)
        self._drain()

    def prefill(self, lengths: list[int], prefixes: list[list[int]]) -> tuple[float, dict[str, float]]:
        """One step prefilling prompts of ``lengths`` tokens that start with the cached
        ``prefixes``: its wall time and exclusive seconds per operator class."""
        self._prime(prefixes)
        ids = [self._add(p + self.tokens(x - len(p)), 1) for p, x in zip(prefixes, lengths)]
        with self.timer:
            seconds, outputs = self._step()
        self._check(outputs, {i: len(p) for i, p in zip(ids, prefixes)}, f"a prefill of {lengths}")
        ops = dict(self.timer.totals)
        ops[OVERHEAD] = seconds - sum(ops.values())
        return seconds, ops

    def decode(self, batch_size: int, prefix: list[int]) -> tuple[int, float]:
        """One decode step of ``batch_size`` sequences sharing the cached ``prefix``
        (attention still reads every sequence's blocks): KV tokens attended, wall time."""
        self._prime([prefix])
        ids = [self._add(prefix + self.tokens(1), 3) for _ in range(batch_size)]
        _, outputs = self._step()  # each sequence computes its one uncached prompt token
        self._check(outputs, {i: len(prefix) for i in ids}, f"the decode setup of {batch_size} sequences")
        seconds, outputs = self._step()
        if len(outputs) != batch_size:
            raise ProfileError(f"a decode step ran {len(outputs)} of {batch_size} sequences")
        self._drain()
        return batch_size * (len(prefix) + 2), seconds


class CopyProbe:
    """Copies between the device and host tiers of a KV pool of its own (``copy_blocks``,
    as swapping does). Each copy reads blocks no copy touched for at least
    ``COPY_POOL_BYTES`` of other traffic, more than any last-level cache: swapped blocks
    are cold, and cached sources made small copies look several times faster."""

    def __init__(self, runner: ModelRunner, cfg: EngineConfig, max_blocks: int, sync: Callable[[], None]) -> None:
        n = max(2 * max_blocks, COPY_POOL_BYTES // runner.mover.block_nbytes)
        pool_cfg = EngineConfig(**{**vars(cfg), "num_blocks": n, "num_host_blocks": n})
        self.pools = KVPools.create(runner.model_config, pool_cfg, runner.dtype, runner.device)
        self.num_blocks = n
        self.sync = sync
        self._next = 0
        everything = list(range(n))  # write both pools once: fresh pages fault, and read as one zero page
        self.pools.copy_blocks(Tier.DEVICE, everything, Tier.HOST, everything)
        self.pools.copy_blocks(Tier.HOST, everything, Tier.DEVICE, everything)

    def measure(self, num_blocks: int, src: Tier, dst: Tier) -> float:
        """Seconds of one ``copy_blocks`` of ``num_blocks`` consecutive blocks."""
        if self._next + num_blocks > self.num_blocks:
            self._next = 0
        blocks = list(range(self._next, self._next + num_blocks))
        self._next += num_blocks
        start = time.perf_counter()
        self.pools.copy_blocks(src, blocks, dst, blocks)
        self.sync()
        return time.perf_counter() - start


@dataclass
class Point:
    """One grid point: ``run`` measures it once; ``sample`` turns its runs into a sample
    of ``kind`` (a field of ``Samples``)."""

    kind: str
    label: str
    run: Callable[[], Any]
    sample: Callable[[list[Any]], Any]


def _prefill_sample(seqs: list[tuple[int, int]], held: bool,
                    runs: list[tuple[float, dict[str, float]]]) -> PrefillSample:
    median = statistics.median
    return PrefillSample(seqs, median(t for t, _ in runs), {k: median(ops[k] for _, ops in runs) for k in runs[0][1]},
                         held)


def _decode_sample(batch_size: int, held: bool, runs: list[tuple[int, float]]) -> DecodeSample:
    median = statistics.median
    return DecodeSample(batch_size, int(median(c for c, _ in runs)), median(t for _, t in runs), held)


def _bandwidth_sample(nbytes: int, held: bool, runs: list[float]) -> BandwidthSample:
    return BandwidthSample(nbytes, statistics.median(runs), held)


def _plan(grid: Grid, profiler: Profiler, copy: CopyProbe, transfer: TransferProbe) -> list[Point]:
    points = []
    for batch, held in grid.prefill_points():
        lengths = [x for x, _ in batch]
        prefixes = [profiler.tokens(profiler.cached_tokens(x, y)) for x, y in batch]
        seqs = [(x, len(p)) for x, p in zip(lengths, prefixes)]
        points.append(Point("prefill", f"prefill {' + '.join(f'{x}@{y:g}' for x, y in batch)}",
                            partial(profiler.prefill, lengths, prefixes), partial(_prefill_sample, seqs, held)))
    for batch_size, context_len, held in grid.decode_points():
        prefix = profiler.tokens(max(1, context_len // profiler.block_size) * profiler.block_size)
        points.append(Point("decode", f"decode {batch_size} x {context_len}",
                            partial(profiler.decode, batch_size, prefix), partial(_decode_sample, batch_size, held)))
    for n, held in grid.size_points():
        for src, dst in ((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DEVICE)):
            points.append(Point("copy", f"copy {n} blocks {src.name.lower()}->{dst.name.lower()}",
                                partial(copy.measure, n, src, dst),
                                partial(_bandwidth_sample, n * copy.pools.block_nbytes, held)))
        points.append(Point("transfer", f"transfer {n} blocks", partial(transfer.measure, n),
                            partial(_bandwidth_sample, n * transfer.block_nbytes, held)))
    return points


def profile(model: str | None, dtype: str, device: str, grid: Grid, repeats: int,
            on_run: Callable[[str], None] = lambda _: None,
            tensor_parallel_size: int = 1) -> tuple[CostModel, list[FitError]]:
    """Measure ``grid`` on ``model`` (split over ``tensor_parallel_size`` ranks) and fit
    its cost model; returns it and its held-out errors. ``on_run`` is called after each
    of the ``repeats * points`` runs."""
    model_dir = ensure_model_dir(model)
    prefill_points, decode_points = grid.prefill_points(), grid.decode_points()
    cfg = EngineConfig(
        model=str(model_dir), dtype=dtype, device=device,
        max_num_seqs=max(max(len(b) for b, _ in prefill_points), max(b for b, _, _ in decode_points)),
        max_num_batched_tokens=max(sum(x for x, _ in b) for b, _ in prefill_points),
        tensor_parallel_size=tensor_parallel_size,
    )
    runner = build_runner(cfg, model_dir)
    engine = Engine(cfg, runner, eos_token_ids(model_dir))
    profiler = Profiler(engine, runner)
    max_blocks = max(n for n, _ in grid.size_points())
    copy = CopyProbe(runner, cfg, max_blocks, profiler.sync)
    with TransferProbe(model_dir, cfg, max_blocks, profiler.sync) as transfer, ResumeGuard() as guard:
        profiler.warm_up(max(x for b, _ in prefill_points for x, _ in b), max(b for b, _, _ in decode_points))
        transfer.measure(max_blocks)  # connects the sockets and faults the receiver's pages in
        points = _plan(grid, profiler, copy, transfer)
        runs: list[list[Any]] = [[] for _ in points]
        order = list(range(len(points)))
        shuffle = random.Random(0).shuffle
        for _ in range(repeats):
            shuffle(order)
            for i in order:
                runs[i].append(guard.run(points[i].run))
                on_run(points[i].label)
    samples: dict[str, list] = defaultdict(list)
    for point, point_runs in zip(points, runs):
        samples[point.kind].append(point.sample(point_runs))
    key = CostKey(served_model_name(ServeConfig(engine=EngineConfig(model=model))),
                  str(runner.dtype).removeprefix("torch."), hardware_name(runner.device, tensor_parallel_size))
    meta = {"source": "profiled", "grid": grid.name, "repeats": repeats, "runs_repeated_after_a_pause": guard.repeats,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device)}}
    return fit_cost_model(key, cfg.block_size, runner.mover.block_nbytes // cfg.block_size, Samples(**samples), meta)


def num_runs(grid: Grid, repeats: int) -> int:
    """Runs in a profile: every point once a pass (copies both ways)."""
    return repeats * (len(grid.prefill_points()) + len(grid.decode_points()) + 3 * len(grid.size_points()))


def main(args: argparse.Namespace) -> int:
    """The ``memserve profile`` command: progress bar, JSON, error table."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table

    grid = QUICK if args.quick else FULL
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda:0" if torch.cuda.is_available() else "cpu")
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("loading the model", total=num_runs(grid, args.repeats))
        model, errors = profile(args.model, args.dtype, device, grid, args.repeats,
                                lambda label: progress.update(task, advance=1, description=label),
                                args.tensor_parallel_size)
    path = model.save(args.output or default_path(model.key))
    table = Table(title=f"held-out error: {model.key.model} {model.key.dtype} on {model.key.hardware}")
    for column in ("model", "points", "mean rel. error", "max rel. error"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for e in errors:
        table.add_row(e.name, str(e.points), f"{e.mean:.1%}", f"{e.max:.1%}")
    Console().print(table)
    print(f"memserve: cost model written to {path}")
    return 0
