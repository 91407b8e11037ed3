"""The served model's own input token embeddings, read from its safetensors file as a
numpy memory map (no torch in the gateway).

The pages are shared with the page cache, so the gateway does not hold a private copy of
the table. They are all faulted in at start: left to fault in as prompts touch new
tokens, the gateway's resident size crept up for the whole first hour of serving (the
table's working set filling in), which looks exactly like a leak to anyone watching RSS."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_TENSOR_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset of its data section."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


class TokenEmbeddings:
    def __init__(self, table: np.ndarray, bf16: bool = False) -> None:
        self._table = table
        self._bf16 = bf16
        self.dim = int(table.shape[1])
        self.vocab_size = int(table.shape[0])

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TokenEmbeddings:
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            header, data_start = _safetensors_header(path)
            for name in _TENSOR_NAMES:
                entry = header.get(name)
                if entry is None:
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: embeddings of dtype {entry['dtype']} are not supported")
                begin, _end = entry["data_offsets"]
                table = np.memmap(path, dtype=_DTYPES[entry["dtype"]], mode="r", offset=data_start + begin,
                                  shape=tuple(entry["shape"]))
                table.sum(dtype=np.float64)  # fault every page in now (see the module docstring)
                return cls(table, bf16=entry["dtype"] == "BF16")
        raise FileNotFoundError(f"no token embedding tensor in the safetensors files of {model_dir}")

    def mean(self, token_ids: np.ndarray) -> np.ndarray:
        """Mean embedding of ``token_ids`` (ids outside the table are skipped); zeros when none."""
        ids = token_ids[(token_ids >= 0) & (token_ids < self.vocab_size)]
        if ids.size == 0:
            return np.zeros(self.dim, dtype=np.float32)
        rows = self._table[ids]
        if self._bf16:  # bfloat16 is the top half of a float32
            rows = (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.astype(np.float32, copy=False).mean(axis=0)
