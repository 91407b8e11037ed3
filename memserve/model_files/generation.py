"""What a model folder says about generation, read the way Hugging Face reads it."""

from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_dir: Path) -> set[int]:
    """EOS ids as Hugging Face ``generate`` sees them: generation_config, else config."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
                break
    return ids
