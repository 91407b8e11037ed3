"""CUDA-graph decoding on the CPU: ``EagerCapture`` stands in for graph capture (a replay
re-runs the captured forward into its output), so that an engine takes its graph path
where no GPU is."""

from __future__ import annotations

from pathlib import Path

from memserve.config import EngineConfig
from memserve.model_files.generation import eos_token_ids
from memserve.workers.engine.engine import Engine
from memserve.workers.model.decode_graphs import DecodeGraphs
from memserve.workers.model_runner import ModelRunner


class EagerCapture:
    """A stand-in for CUDA graph capture: a replay re-runs the captured forward into its output."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, forward):
        out = forward()

        def replay() -> None:
            self.replays += 1
            out.copy_(forward())

        return replay, out


def graphed_engine(cfg: EngineConfig, folder: Path, max_blocks: int, capture: EagerCapture) -> Engine:
    """An engine whose runner replays its pure decode steps from graphs of at most
    ``max_blocks`` blocks of context, captured by ``capture``, over its attention backend."""
    runner = ModelRunner(cfg, folder)
    runner.pools.num_device_blocks -= 1  # the last block becomes the scratch block
    scratch = runner.pools.num_device_blocks
    runner.graphs = DecodeGraphs(runner.model, runner.pools.device, runner.layout, runner.block_size, scratch,
                                 cfg.max_num_seqs, max_blocks, runner.attention_backend)
    runner.graphs.capture(capture)
    return Engine(cfg, runner, eos_token_ids(folder))
