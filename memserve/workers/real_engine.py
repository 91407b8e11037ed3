"""The real engine: the torch model runner under the torch-free engine core."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from memserve.config import EngineConfig
from memserve.model_files.generation import eos_token_ids
from memserve.workers.engine.engine import Engine
from memserve.workers.model_runner import ModelRunner


def build_engine(cfg: EngineConfig, model_dir: Path, instance_id: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> Engine:
    """The real engine: the model in ``model_dir`` on ``cfg.device``."""
    return Engine(cfg, ModelRunner(cfg, model_dir), eos_token_ids(model_dir), instance_id, clock)
