"""The real engine: the torch model runner under the torch-free engine core."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from memserve.config import EngineConfig
from memserve.model_files.generation import eos_token_ids
from memserve.workers.engine.engine import Engine
from memserve.workers.model.llama import rank_config
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.tensor_parallel import TensorParallel
from memserve.workers.model_runner import ModelRunner
from memserve.workers.tensor_parallel_group import Followers


def build_runner(cfg: EngineConfig, model_dir: Path, instance: int | None = None) -> ModelRunner:
    """The runner of worker ``instance`` (None: a spare's): with ``--tensor-parallel-size``
    over 1, rank 0's, with the other ranks started and joined (one group per process)."""
    if cfg.tensor_parallel_size == 1:
        return ModelRunner(cfg, model_dir)
    # Refused here, naming both numbers, before any rank starts.
    rank_config(ModelConfig.from_folder(model_dir), TensorParallel(0, cfg.tensor_parallel_size))
    followers = Followers(cfg, model_dir, instance)
    return ModelRunner(cfg, model_dir, tp=followers.tp, followers=followers)


def build_engine(cfg: EngineConfig, model_dir: Path, instance_id: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> Engine:
    """The real engine: the model in ``model_dir`` on ``cfg.device``."""
    return Engine(cfg, build_runner(cfg, model_dir, instance_id), eos_token_ids(model_dir), instance_id, clock)
