"""Where cost models live and how one is named: ``memserve profile`` writes JSON under
``cost_model_dir()`` keyed by model, dtype and hardware; ``load_cost_model`` takes a
preset's name (``presets.PRESETS``) or such a file."""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

from memserve.costmodel.model import CostKey, CostModel
from memserve.costmodel.presets import PRESETS


def load_cost_model(source: str | Path) -> CostModel:
    """A preset by name or a JSON file written by ``CostModel.save``."""
    if str(source) in PRESETS:
        return PRESETS[str(source)]()
    return CostModel.from_dict(json.loads(Path(source).read_text()))


def cost_model_dir() -> Path:
    """``$MEMSERVE_CACHE/cost-models`` or ``~/.cache/memserve/cost-models``."""
    return Path(os.environ.get("MEMSERVE_CACHE", "~/.cache/memserve")).expanduser() / "cost-models"


def default_path(key: CostKey) -> Path:
    return cost_model_dir() / key.file_name()


def tensor_parallel_suffix(size: int) -> str:
    """What a hardware name ends with for a model split over ``size`` ranks ("" for one)."""
    return f"-tp{size}" if size > 1 else ""


def find_profile(model: str, dtype: str, hardware: str | None = None, tensor_parallel_size: int = 1) -> Path | None:
    """The profile for ``model`` and ``dtype`` (and ``hardware``, when given) measured at
    ``tensor_parallel_size`` ranks, in ``cost_model_dir()``; the newest when several
    hardware profiles match; None if none."""
    matches = []
    for path in cost_model_dir().glob("*.json"):
        try:
            key = json.loads(path.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a cost model: ignore it
        found = str(key.get("hardware", ""))
        split = re.search(r"-tp\d+$", found)
        if (key.get("model") == model and key.get("dtype") == dtype and hardware in (None, found)
                and (split.group() if split else "") == tensor_parallel_suffix(tensor_parallel_size)):
            matches.append(path)
    return max(matches, key=lambda p: p.stat().st_mtime, default=None)
