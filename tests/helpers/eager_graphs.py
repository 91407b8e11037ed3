"""CUDA-graph decoding on the CPU: ``EagerCapture`` stands in for graph capture (a replay
re-runs the captured forward into its output), so that an engine takes its graph path
where no GPU is."""

from __future__ import annotations

from pathlib import Path

from memserve.config import EngineConfig
from memserve.model_files.generation import eos_token_ids
from memserve.workers.engine.engine import Engine
from memserve.workers.model.decode_graphs import DecodeGraphs, graph_row_tokens
from memserve.workers.model_runner import ModelRunner


class EagerCapture:
    """A stand-in for CUDA graph capture: a replay re-runs the captured forward into its
    output. ``replays_of[i]``: the replays of the i-th graph captured."""

    def __init__(self) -> None:
        self.replays_of: list[int] = []

    @property
    def replays(self) -> int:
        return sum(self.replays_of)

    def __call__(self, forward):
        out = forward()
        index = len(self.replays_of)
        self.replays_of.append(0)

        def replay() -> None:
            self.replays_of[index] += 1
            out.copy_(forward())

        return replay, out


def graphed_engine(cfg: EngineConfig, folder: Path, max_blocks: int, capture: EagerCapture) -> Engine:
    """An engine whose runner replays its pure decode steps from graphs of at most
    ``max_blocks`` blocks of context, captured by ``capture``, over its attention backend."""
    runner = ModelRunner(cfg, folder)
    runner.pools.num_device_blocks -= 1  # the last block becomes the scratch block
    scratch = runner.pools.num_device_blocks
    runner.graphs = DecodeGraphs(runner.model, runner.pools.device, runner.layout, runner.block_size, scratch,
                                 cfg.max_num_seqs, max_blocks, runner.attention_backend,
                                 graph_row_tokens(cfg, runner.attention_backend))
    runner.graphs.capture(capture)
    return Engine(cfg, runner, eos_token_ids(folder))
