"""memserve vs Hugging Face transformers `generate`, one run, same weights and dtype.

Measures output tokens/s at concurrency 1 and 16 (memserve over HTTP, through a real
`memserve up`) against transformers sequential and static-batch-16 generation, and
prefill tokens/s of a 1,024-token prompt. Every request generates exactly
``--output-len`` tokens (``ignore_eos``; ``min_new_tokens`` for transformers) from the
same token ids, so the two sides do the same work. Prefix caching is off on the server
so the engine itself is measured.

    python benchmarks/real/serving_vs_transformers.py [--output-len 64] [--dtype float32] [--server-args "--cpu-gemm torch"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memserve.bench.server_process import start_server, stop_server
from memserve.model_files.gguf_convert import ensure_model_dir

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"


def sharegpt_prompts(tokenizer, n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    lines = (SHARED_DATA / "sharegpt-sample.jsonl").read_text().splitlines()
    random.Random(seed).shuffle(lines)
    prompts = []
    for line in lines:
        first = json.loads(line)["messages"][0]["content"]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": first}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if 16 <= len(ids) <= max_len:
            prompts.append(list(ids))
        if len(prompts) == n:
            return prompts
    raise RuntimeError("not enough prompts")


# --------------------------------------------------------------------- transformers
@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    """Seconds to generate ``output_len`` tokens for all prompts in one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == output_len
    return elapsed


@torch.inference_mode()
def hf_prefill(model, length: int, repeats: int = 3) -> float:
    times = []
    for r in range(repeats):
        ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(r))
        start = time.perf_counter()
        model(input_ids=ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------- memserve
async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"memserve answered {resp.status}: {data}")
        return data["usage"]["completion_tokens"]


async def memserve_throughput(url: str, model: str, prompts: list[list[int]], output_len: int,
                              concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(p):
            async with sem:
                return await complete(session, url, model, p, output_len)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return time.perf_counter() - start, tokens


async def memserve_prefill(url: str, model: str, length: int, repeats: int = 3) -> float:
    times = []
    async with aiohttp.ClientSession() as session:
        for r in range(repeats):
            prompt = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(100 + r)).tolist()
            start = time.perf_counter()
            await complete(session, url, model, prompt, 1)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--sequential-prompts", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    ap.add_argument("--server-args", default="", help="extra `memserve up` options, e.g. '--cpu-gemm torch'")
    args = ap.parse_args()

    model_dir = ensure_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = sharegpt_prompts(tokenizer, args.batch, max_len=256)
    seq_prompts = prompts[: args.sequential_prompts]
    L = args.output_len
    results: dict[str, float] = {}

    print(f"loading transformers model ({args.dtype}, {torch.get_num_threads()} threads)...", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_generate(hf, seq_prompts[:1], 4, pad)  # warm-up
    t = sum(hf_generate(hf, [p], L, pad) for p in seq_prompts)
    results["transformers_sequential_tok_s"] = len(seq_prompts) * L / t
    t = hf_generate(hf, prompts, L, pad)
    results["transformers_batch_tok_s"] = len(prompts) * L / t
    results["transformers_prefill_tok_s"] = args.prefill_len / hf_prefill(hf, args.prefill_len)
    del hf

    print("starting memserve up...", flush=True)
    import tempfile

    server = start_server(["--no-prefix-cache", "--dtype", args.dtype, *args.server_args.split()],
                          Path(tempfile.mkdtemp()) / "memserve.log", cwd=REPO)
    try:
        url, name = server.base_url, server.model
        asyncio.run(memserve_throughput(url, name, seq_prompts[:1], 4, 1))  # warm-up
        t, n = asyncio.run(memserve_throughput(url, name, seq_prompts, L, 1))
        results["memserve_c1_tok_s"] = n / t
        t, n = asyncio.run(memserve_throughput(url, name, prompts, L, args.batch))
        results[f"memserve_c{args.batch}_tok_s"] = n / t
        results["memserve_prefill_tok_s"] = args.prefill_len / asyncio.run(
            memserve_prefill(url, name, args.prefill_len))
    finally:
        stop_server(server)

    r = results
    rows = [
        ("output tok/s, concurrency 1", r["memserve_c1_tok_s"], "transformers sequential",
         r["transformers_sequential_tok_s"]),
        (f"output tok/s, concurrency {args.batch}", r[f"memserve_c{args.batch}_tok_s"],
         f"transformers static batch {args.batch}", r["transformers_batch_tok_s"]),
        (f"prefill tok/s, {args.prefill_len}-token prompt", r["memserve_prefill_tok_s"], "transformers forward",
         r["transformers_prefill_tok_s"]),
    ]
    print(f"\n{'metric':40} {'memserve':>10} {'baseline':>10}  ratio  baseline")
    for metric, ours, base_name, base in rows:
        print(f"{metric:40} {ours:10.1f} {base:10.1f}  {ours / base:5.2f}  {base_name}")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
