"""What serving LoRA adapters costs the engine: the same batch of ShareGPT prompts decoded
by the base model alone and by four rank-16 adapters mixed evenly (every projection
targeted, as a full fine-tune's adapter is), and how long an adapter takes to read in.

    python benchmarks/micro/lora_overhead.py [--requests 16] [--max-tokens 32] [--rounds 3] [--model DIR]

The model is the embedded SmolLM2 (float32) unless ``--model`` names a folder (such as a
larger shape from ``benchmarks/peers/random_model.py``: what an adapter costs depends on
how its bytes compare with the base weights'); the adapters are made with ``peft`` (random
weights, saved as PEFT saves them) in a temporary folder. Base and adapter rounds
alternate in one process, so both see the same machine; prints the medians, then the
ratios (adapters / base).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from memserve.testing.random_adapters import make_adapters

SHAREGPT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "sharegpt-sample.jsonl"


def prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    with SHAREGPT.open() as f:
        for line in f:
            first = next((m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"), "")
            if first:
                out.append(tokenizer.encode_chat([{"role": "user", "content": first[:1200]}]))
            if len(out) == count:
                return out
    return out


def one_round(engine, batch: list[list[int]], names: list[str | None], max_tokens: int, tag: str) -> dict:
    """All requests at once; the wall time and the decode steps' times."""
    from memserve.ipc.messages import AddRequest, SamplingParams

    for i, (prompt, name) in enumerate(zip(batch, names)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name)
        engine.add_request(AddRequest(f"{tag}-{i}", prompt, params))
    started, steps, tokens = time.perf_counter(), [], 0
    while engine.has_work:
        step_start = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - step_start)
        tokens += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - started
    return {"tokens_per_s": tokens / wall, "decode_step_ms": 1000 * statistics.median(steps[len(steps) // 2:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: the embedded SmolLM2)")
    args = p.parse_args(argv)

    from memserve.config import EngineConfig
    from memserve.model_files.gguf_convert import ensure_model_dir
    from memserve.text.tokenizer import Tokenizer
    from memserve.workers.real_engine import build_engine

    model_dir = args.model or Path(ensure_model_dir(None))
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(model_dir, Path(tmp), args.adapters, args.rank)
        cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=2048, max_num_seqs=args.requests,
                           enable_lora=True, lora_modules=[[n, f] for n, f in folders.items()],
                           max_loras=args.adapters, max_lora_rank=args.rank, enable_prefix_caching=False)
        engine = build_engine(cfg, model_dir)
        loras = engine.runner.loras
        from_disk_ms = 1000 * loras.mean_load_s  # each was read in from its folder at start
        keys = [loras.key(name, "") for name in folders]
        started = time.perf_counter()
        for key in keys:
            loras.slot(key)
        ready_us = 1e6 * (time.perf_counter() - started) / len(folders)
        batch = prompts(Tokenizer.from_folder(model_dir), args.requests)
        mixed = [f"adapter{i % args.adapters}" for i in range(len(batch))]
        results: dict[str, list[dict]] = {"base": [], "adapters": []}
        one_round(engine, batch, [None] * len(batch), 4, "warm")
        for r in range(args.rounds):
            results["base"].append(one_round(engine, batch, [None] * len(batch), args.max_tokens, f"b{r}"))
            results["adapters"].append(one_round(engine, batch, mixed, args.max_tokens, f"a{r}"))
    medians = {kind: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for kind, runs in results.items()}
    print(json.dumps({"adapter_read_from_disk_ms": round(from_disk_ms, 1), "adapter_ready_us": round(ready_us, 1)}))
    print(json.dumps(medians))
    print(json.dumps({"adapters/base tokens_per_s": round(medians["adapters"]["tokens_per_s"]
                                                          / medians["base"]["tokens_per_s"], 3),
                      "adapters/base decode_step_ms": round(medians["adapters"]["decode_step_ms"]
                                                            / medians["base"]["decode_step_ms"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
