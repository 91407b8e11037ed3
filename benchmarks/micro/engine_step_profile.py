"""Where an engine step's time goes, and how far decode is from the memory roofline.

Runs ``ModelRunner.execute`` in-process on the real SmolLM2 over hand-built step plans:
decode batches of 1, 8 and 32 sequences (``--context`` tokens each), a mixed step
(decode rows plus a prefill chunk after a cached prefix) and optionally a cold prefill. For each: the median step time,
and with ``--profile`` the torch profiler's self time grouped by kind of op (the rest of
the wall time is Python and dispatch). The roofline is the bytes a decode step must read
(every weight once, the lm_head included, plus the batch's KV) over the bandwidth of a
large tensor copy measured in the same run.

``--baseline REV`` compares with the engine at git revision REV (from ``git archive``),
``--against OPTIONS`` with the same code run with other options (dtype, threads): the two
sides run in two processes that take one step each in turn, so that the load of a shared
machine falls on both alike.

    python benchmarks/micro/engine_step_profile.py [--dtype float32] [--threads 1] [--profile]
    python benchmarks/micro/engine_step_profile.py --baseline 7570ff4 --threads 1
    python benchmarks/micro/engine_step_profile.py --against "--dtype bfloat16" --threads 1
    python benchmarks/micro/engine_step_profile.py --batches 1,4,16 --drafts 0,1,4 --prefill 0  # speculative verify steps
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Profiler op name -> the kind of work it is (anything else counts as "elementwise/other").
OP_KINDS = {
    "aten::mm": "matmul (linear, lm_head)",
    "aten::addmm": "matmul (linear, lm_head)",
    "mkldnn::_linear_pointwise": "matmul (linear, lm_head)",  # --cpu-gemm onednn (packed weights)
    "aten::bmm": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_attention_math": "attention",
    "aten::_softmax": "attention",
    "memserve::paged_decode_attention": "attention",  # --cpu-attention kernel
    "aten::index_select": "KV gather",
    "aten::_index_put_impl_": "KV write",
    "aten::index_copy_": "KV write",
    "aten::argmax": "sampling",
    "memserve::gguf_matmul": "matmul (linear, lm_head)",  # --quantization auto on a GGUF file
    "memserve::gguf_dequantize": "matmul (linear, lm_head)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--cpu-gemm", default="onednn", choices=["onednn", "torch"], help="see memserve up --help")
    p.add_argument("--cpu-attention", default="kernel", choices=["kernel", "torch"], help="see memserve up --help")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf"], help="see memserve up --help")
    p.add_argument("--context", type=int, default=512, help="tokens in each decode sequence's KV")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--drafts", default="0",
                   help="speculative drafts per decoding request, e.g. 0,4: each decode batch with each count "
                        "(its verify step: 1 + d tokens a request, logits for all of them)")
    p.add_argument("--prefill", type=int, default=256, help="mixed step: new prompt tokens after as many cached (0: no mixed step)")
    p.add_argument("--cold-prefill", type=int, default=0, help="also a step prefilling this many tokens, none cached")
    p.add_argument("--reps", type=int, default=20, help="timed steps per step kind")
    p.add_argument("--profile", action="store_true", help="print where each step kind's time goes")
    p.add_argument("--roofline", default="1,16", help="decode batch sizes to hold against the memory roofline")
    p.add_argument("--baseline", default=None, help="compare with the engine at this git revision")
    p.add_argument("--against", default=None,
                   help="compare with the same code run with these options, e.g. '--dtype bfloat16'")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # one side of a comparison
    return p.parse_args(argv)


# --------------------------------------------------------------------------- plans
class PlanMaker:
    """Step plans over scattered, disjoint KV blocks (as after some churn)."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(1, num_blocks))
        self.rng.shuffle(self.free)
        self.block_size, self.vocab = block_size, vocab
        self.count = self.next_block = 0

    def chunk(self, cached: int, new: int, sample: bool = True):
        """Blocks are taken round-robin: distinct within any plan that fits in the pool."""
        from memserve.workers.engine.step_plan import ScheduledChunk

        self.count += 1
        blocks = []
        for _ in range(-(-(cached + new) // self.block_size)):
            blocks.append(self.free[self.next_block % len(self.free)])
            self.next_block += 1
        tokens = [self.rng.randrange(self.vocab) for _ in range(new)]
        return ScheduledChunk(f"r{self.count}", tokens, cached, blocks, sample)

    def plan(self, chunks: list):
        from memserve.ipc.messages import SamplingParams
        from memserve.workers.engine.step_plan import NewRequestData, StepPlan

        greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0)
        return StepPlan(new_requests=[NewRequestData(c.request_id, greedy) for c in chunks], chunks=chunks)


def contexts(args: argparse.Namespace, batch: int) -> list[int]:
    """Decode contexts spread evenly over [context/2, 3*context/2] (mean ``context``), as
    in serving, where padding every sequence to the longest costs real work."""
    if batch == 1:
        return [args.context]
    return [args.context // 2 + i * args.context // (batch - 1) for i in range(batch)]


def decode_plan(args: argparse.Namespace, maker: PlanMaker, batch: int, drafts: int = 0):
    chunks = [maker.chunk(ctx, 1 + drafts) for ctx in contexts(args, batch)]
    for chunk in chunks:
        chunk.num_drafts = drafts
    return maker.plan(chunks)


def step_kinds(args: argparse.Namespace, maker: PlanMaker) -> dict[str, object]:
    kinds = {f"decode x{batch}" + (f", {drafts} drafts each" if drafts else ""): decode_plan(args, maker, batch, drafts)
             for batch in map(int, args.batches.split(",")) for drafts in map(int, args.drafts.split(","))}
    if args.prefill:
        decodes = [maker.chunk(ctx, 1) for ctx in contexts(args, 7)]
        kinds[f"mixed: 7 decode + {args.prefill}-token prefill"] = maker.plan(
            decodes + [maker.chunk(args.prefill, args.prefill)])
    if args.cold_prefill:
        kinds[f"cold prefill of {args.cold_prefill} tokens"] = maker.plan([maker.chunk(0, args.cold_prefill)])
    return kinds


def blocks_needed(args: argparse.Namespace, block_size: int) -> int:
    """Enough for the largest plan (the longest decode context is 3/2 of the mean)."""
    per_seq = -(-(3 * args.context // 2 + 1 + max(map(int, args.drafts.split(",")))) // block_size)
    largest = max(map(int, args.batches.split(",") + args.roofline.split(",") + ["7"]))
    return 2 + largest * per_seq + -(-2 * args.prefill // block_size) + -(-args.cold_prefill // block_size)


# --------------------------------------------------------------------------- timing
def time_step(runner, plan, reps: int) -> float:
    runner.execute(plan)  # first run: registers the requests, warms this shape
    plan.new_requests = []
    runner.execute(plan)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_step(runner, plan, reps: int = 5) -> tuple[float, dict[str, float]]:
    """Wall time per step and profiler self time per kind of op (seconds per step)."""
    import torch

    kinds: dict[str, float] = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            runner.execute(plan)
        wall = (time.perf_counter() - start) / reps
    for event in prof.key_averages():
        kinds[OP_KINDS.get(event.key, "elementwise/other ops")] += event.self_cpu_time_total / 1e6 / reps
    kinds["Python, dispatch, framework"] = max(0.0, wall - sum(kinds.values()))
    return wall, dict(kinds)


def memory_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write), best of ``reps``."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_bytes(runner, kv_tokens: int) -> int:
    """Bytes a decode step must read: every weight once (the embedding only as the
    lm_head when tied; quantized weights as stored) and the K and V of the batch's ``kv_tokens`` context tokens."""
    model, cfg = runner.model, runner.model_config
    element = runner.pools.device.element_size()
    # Linear layers (lm_head included; plain or packed) plus the norms' weights.
    linears = [m for m in model.modules() if hasattr(m, "in_features")]
    # GGUF-quantized layers read their blocks' bytes; the others every weight at ``element``.
    weights = sum(m.blocks.numel() if hasattr(m, "blocks") else m.in_features * m.out_features * element
                  for m in linears)
    weights += (2 * cfg.num_layers + 1) * cfg.hidden_size * element
    kv = kv_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element
    return weights + kv


# --------------------------------------------------------------------------- one side
def setup(args: argparse.Namespace):
    """The runner over a pool whose every page is touched (as in a server that has run a
    while), a plan maker, and the step kinds to time."""
    import torch

    from memserve.config import EngineConfig
    from memserve.model_files.gguf_convert import ensure_model_dir
    from memserve.workers.model_runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    block_size = 16
    cfg = EngineConfig(dtype=args.dtype, cpu_gemm=args.cpu_gemm, cpu_attention=args.cpu_attention,
                       quantization=args.quantization, num_blocks=blocks_needed(args, block_size), block_size=block_size,
                       async_save=False)
    runner = ModelRunner(cfg, ensure_model_dir(None))
    runner.pools.device.normal_()
    maker = PlanMaker(runner.num_blocks, block_size, runner.vocab_size)
    kinds = step_kinds(args, maker)
    for plan in kinds.values():  # registers the requests and warms each shape
        runner.execute(plan)
        plan.new_requests = []
    return runner, maker, kinds


def run_here(args: argparse.Namespace) -> None:
    import torch

    runner, maker, kinds = setup(args)
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads, context {args.context}, "
          f"median of {args.reps} steps")
    for name, plan in kinds.items():
        print(f"  {name:40s} {time_step(runner, plan, args.reps) * 1e3:8.1f} ms")
    if args.profile:
        for name, plan in kinds.items():
            wall, parts = profile_step(runner, plan)
            print(f"\n{name}: {wall * 1e3:.1f} ms per step (profiled)")
            for kind, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
                print(f"  {kind:32s} {seconds * 1e3:7.1f} ms  {100 * seconds / wall:5.1f} %")
    bandwidth = memory_bandwidth()
    print(f"\nmemory bandwidth (copy): {bandwidth / 1e9:.1f} GB/s")
    for batch in map(int, args.roofline.split(",")):
        plan = decode_plan(args, maker, batch)
        runner.execute(plan)
        plan.new_requests = []
        measured = time_step(runner, plan, args.reps)
        nbytes = decode_bytes(runner, sum(contexts(args, batch)))
        floor = nbytes / bandwidth
        print(f"  decode x{batch}: {nbytes / 1e6:.0f} MB read per step, roofline {floor * 1e3:.1f} ms, "
              f"measured {measured * 1e3:.1f} ms = {measured / floor:.2f}x the roofline")


def serve_steps(args: argparse.Namespace) -> None:
    """``--serve``: print the step kinds, then time one step of each kind named on stdin."""
    runner, _, kinds = setup(args)
    print(json.dumps(list(kinds)), flush=True)
    for line in sys.stdin:
        plan = kinds[line.strip()]
        start = time.perf_counter()
        runner.execute(plan)
        print(time.perf_counter() - start, flush=True)


# --------------------------------------------------------------------------- comparison
def export_revision(rev: str, into: Path) -> Path:
    """The ``memserve`` package as of ``rev`` under ``into`` (no checkout, no git writes)."""
    archive = subprocess.run(["git", "archive", rev, "memserve"], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Two sides in two processes, stepping in turn (one step each, the order swapped every
    round), so that the load of a shared machine falls on both alike. The speed-up is the
    median over rounds of the ratio of the two sides' times of that round."""
    own = {"--baseline": 1, "--against": 1, "--reps": 1}
    forwarded, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in own:
            skip = own[arg]
        else:
            forwarded.append(arg)
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            sides = {f"at {args.baseline}": (str(export_revision(args.baseline, Path(tmp))), forwarded),
                     "current": (str(REPO), forwarded)}
        else:
            sides = {"as given": (str(REPO), forwarded),
                     f"with {args.against}": (str(REPO), forwarded + shlex.split(args.against))}
        procs = {}
        for side, (path, side_args) in sides.items():
            procs[side] = subprocess.Popen([sys.executable, __file__, *side_args, "--serve"], cwd=path, text=True,
                                           env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE)
        ready = [json.loads(p.stdout.readline()) for p in procs.values()]  # each side's step kinds
        names = ready[0]
        times: dict[str, dict[str, list[float]]] = {side: defaultdict(list) for side in procs}
        for r in range(args.reps):
            order = list(procs) if r % 2 == 0 else list(procs)[::-1]
            for name in names:
                for side in order:
                    procs[side].stdin.write(name + "\n")
                    procs[side].stdin.flush()
                    times[side][name].append(float(procs[side].stdout.readline()))
        for p in procs.values():
            p.stdin.close()
            p.wait()
    first, second = list(procs)
    print(f"{args.reps} rounds, medians (ms); speed-up = median of per-round {first} / {second}")
    print(f"{'step':40s} {first:>14s} {second:>20s} {'speed-up':>9s}")
    for name in names:
        a, b = times[first][name], times[second][name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"{name:40s} {statistics.median(a) * 1e3:14.1f} {statistics.median(b) * 1e3:20.1f} {ratio:8.2f}x")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.serve:
        serve_steps(args)
    elif args.baseline or args.against:
        compare(args, argv)
    else:
        run_here(args)


if __name__ == "__main__":
    main()
