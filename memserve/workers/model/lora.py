"""LoRA adapters over the model's linear layers, several in one batch (``--enable-lora``).

An adapter is a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) as
``peft`` saves it: for each targeted projection (q, k, v, o, gate, up, down) a down
projection A [r, in] and an up projection B [out, r], scaled by ``lora_alpha / r``
(rsLoRA: ``lora_alpha / sqrt(r)``). A row run through adapter i gets
``x W^T + s_i (x A_i^T) B_i^T``: the base product once for the whole batch, then per
row its adapter's low-rank update. Every adapter a layer holds is stacked (A by rows, B
by columns), so a step's updates are two products and a mask that keeps each row's own
adapter's columns, whatever the mix: a few dense operations per layer rather than a few
per adapter (the ranks are small, so computing every adapter's columns costs less than
grouping rows by adapter; S-LoRA's and punica's GPU kernels gather by segment instead).

Invariants:

- An adapter's tensors are read once (``read_adapter``) into the model's layer names:
  the parts of a fused projection (q/k/v, gate/up) side by side, A stacked by part and
  B block-diagonal (a part the adapter does not target is zero), the scale folded into B.
  Each layer then cuts them to its rank's shard as it cuts its weight
  (``ParallelLinear.shard_lora``), so adapters work at any tensor-parallel size.
- An adapter whose shapes do not fit the base model, or whose rank is over
  ``--max-lora-rank``, is refused when it is read, naming why; nothing of it is kept.
- Which slot each row runs is the step's ``LoRABatch``, set by the runner before the
  forward pass; a base-model row's slot is -1, and a step of base rows only does no
  LoRA work at all.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from memserve.model_files.adapter_digest import adapter_digest
from memserve.workers.engine.adapter_slots import AdapterSlots
from memserve.workers.model.fused_names import FUSED
from memserve.workers.model.linear import ColumnParallelLinear, LoRABatch, ParallelLinear

# The projections PEFT names -> (our layer, part index); o_proj and down_proj keep their names.
_PARTS = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-layer ranks",
                "alpha_pattern": "per-layer alphas", "layers_to_transform": "layers_to_transform"}


class AdapterError(ValueError):
    """An adapter memserve cannot serve (the message says why)."""


def _layer_of(module: str) -> tuple[str, int | None]:
    """PEFT's module path (``model.layers.0.self_attn.q_proj``) -> (our layer, part)."""
    for part, (fused, index) in _PARTS.items():
        if module.endswith("." + part):
            return module[: -len(part)] + fused, index
    return module, None


def read_adapter(folder: Path, layers: dict[str, ParallelLinear], max_rank: int,
                 dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter in ``folder`` as (A, B) per layer of ``layers`` (full, unsharded)."""
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"{folder} is not a LoRA adapter: it has no adapter_config.json")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type {config.get('peft_type')!r} is not LoRA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{folder}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: LoRA biases (bias={config['bias']!r}) are not supported")
    rank = int(config["r"])
    if rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} is over --max-lora-rank {max_rank}")
    scale = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        for name in f.keys():
            module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
            pairs.setdefault(module, {})[kind.removesuffix(".weight")] = f.get_tensor(name).float()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    by_layer: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in pairs.items():
        layer, part = _layer_of(module)
        if layer not in layers or set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {module} is not a linear layer of this base model")
        by_layer.setdefault(layer, {})[part] = (ab["A"], ab["B"] * scale)
    for layer, parts in by_layer.items():
        a, b = _assemble(layers[layer], parts, rank, folder, layer)
        out[layer] = (a.to(dtype), b.to(dtype))
    return out


def _assemble(layer: ParallelLinear, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]], rank: int,
              folder: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one layer: a fused layer's parts stacked, B block-diagonal."""
    in_features = layer.in_features * (layer.tp.size if not isinstance(layer, ColumnParallelLinear) else 1)
    sizes = [p.size for p in layer.parts] if isinstance(layer, ColumnParallelLinear) else [layer.out_features]
    if None in parts:
        parts = {0: parts[None]}
    a = torch.zeros(len(sizes) * rank, in_features)
    b = torch.zeros(sum(sizes), len(sizes) * rank)
    for index, (part_a, part_b) in parts.items():
        assert index is not None
        if part_a.shape != (rank, in_features) or part_b.shape != (sizes[index], rank):
            raise AdapterError(f"{folder}: {name} part {index} is A {list(part_a.shape)}, B {list(part_b.shape)}; "
                               f"this base model needs A [{rank}, {in_features}], B [{sizes[index]}, {rank}] "
                               "(an adapter of another base model?)")
        a[index * rank : (index + 1) * rank] = part_a
        row = sum(sizes[:index])
        b[row : row + sizes[index], index * rank : (index + 1) * rank] = part_b
    return a, b


AdapterKey = tuple[str, str]  # (name, digest of its files): the weights a slot holds


class LoRAAdapters:
    """The adapters a runner serves and the slots that hold them ready.

    Served adapters start as ``--lora-modules``' folders (each read at start: refused
    there, naming why) and change at run time (``serve``, ``stop``). A slot holds one
    adapter's weights by name and digest, so a name loaded again from other files is
    other weights. The ``capacity`` most recently used are kept; others are read again
    when asked for. An adapter no longer served keeps its slot while a request the
    runner knows still runs on it, and is dropped once none does."""

    def __init__(self, model: nn.Module, modules: dict[str, str], max_rank: int, capacity: int,
                 dtype: torch.dtype) -> None:
        self.max_rank, self.dtype = max_rank, dtype
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, ParallelLinear)}
        self.batch = LoRABatch()
        for layer in self.layers.values():
            layer.lora_batch = self.batch
        self.served: dict[str, tuple[str, str]] = {}  # name -> (folder, digest)
        self.slots: AdapterSlots[AdapterKey] = AdapterSlots(capacity)
        self.loads = 0
        self._load_s = 0.0  # reading adapters in and setting them on the layers, in all
        for name, folder in modules.items():  # refused at start, naming why, rather than at a request
            try:
                self.serve(name, folder)
            except (AdapterError, FileNotFoundError) as exc:
                raise AdapterError(f"--lora-modules {name}: {exc}") from None

    def serve(self, name: str, folder: str, digest: str | None = None) -> None:
        """Serve ``folder``'s adapter as ``name`` from now on (read now, refused naming why;
        kept in a slot if one is free). ``digest``: its files' (computed when not given)."""
        started = time.perf_counter()
        digest = digest or adapter_digest(folder)
        try:
            weights = read_adapter(Path(folder), self.layers, self.max_rank, self.dtype)
        except FileNotFoundError as exc:
            raise AdapterError(str(exc)) from None
        self.served[name] = (folder, digest)
        if self.slots.has_free and (name, digest) not in self.slots:
            self._install((name, digest), weights, started)

    def stop(self, name: str) -> None:
        """Serve ``name`` no more; requests running on it keep its slot until they end."""
        if self.served.pop(name, None) is None:
            raise AdapterError(f"LoRA adapter {name!r} is not served")

    def key(self, name: str, digest: str) -> AdapterKey:
        """The slot key of a request's adapter: ``digest`` "" means the one served as ``name``."""
        if digest:
            return name, digest
        if name not in self.served:
            raise AdapterError(f"unknown LoRA adapter {name!r}")
        return name, self.served[name][1]

    def slot(self, key: AdapterKey, keep: Collection[AdapterKey] = ()) -> int:
        """The adapter's slot, reading it in (in place of the least recently used adapter
        not in ``keep``) if needed."""
        held = self.slots.use(key)
        if held is not None:
            return held
        name, digest = key
        folder, served_digest = self.served.get(name, ("", ""))
        if served_digest != digest:
            raise AdapterError(f"LoRA adapter {name!r} was unloaded" if not folder else
                               f"LoRA adapter {name!r} was replaced by other weights")
        started = time.perf_counter()
        return self._install(key, read_adapter(Path(folder), self.layers, self.max_rank, self.dtype), started, keep)

    @property
    def mean_load_s(self) -> float:
        """Mean seconds an adapter took to read in (0: none yet): what the router prices
        a request on an adapter a worker does not hold."""
        return self._load_s / self.loads if self.loads else 0.0

    def ready(self) -> list[str]:
        """The served adapters held in a slot: a request on one starts without reading it."""
        return sorted(name for name, digest in self.slots.keys() if self._is_served((name, digest)))

    def _is_served(self, key: AdapterKey) -> bool:
        return self.served.get(key[0], ("", ""))[1] == key[1]

    def _install(self, key: AdapterKey, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 started: float, keep: Collection[AdapterKey] = ()) -> int:
        """Put ``weights`` (read since ``started``) on the layers in a slot of their own."""
        slot, evicted = self.slots.place(key, keep)
        if evicted is not None:
            self._clear(slot)
        for layer_name, (a, b) in weights.items():
            layer = self.layers[layer_name]
            layer.set_lora(slot, layer.shard_lora(a.to(layer_device(layer)), b.to(layer_device(layer))))
        self.loads += 1
        self._load_s += time.perf_counter() - started
        return slot

    def _clear(self, slot: int) -> None:
        """Take the adapter in ``slot`` off every layer."""
        for layer in self.layers.values():
            if slot in layer.loras:
                layer.set_lora(slot, None)

    def set_rows(self, rows_by_adapter: dict[AdapterKey, list[int]], num_rows: int, device: torch.device,
                 running: Collection[AdapterKey] = ()) -> None:
        """The step's rows of each adapter. ``running``: the adapters of every request the
        runner knows; an adapter no longer served keeps its slot while one of them runs on
        it (it cannot be read again), and is dropped once none does."""
        running = set(running)
        unserved = {k for k in self.slots.keys() if not self._is_served(k)}
        for key in unserved - running:
            self._clear(self.slots.drop(key))
        if not rows_by_adapter:
            self.batch.set(None)
            return
        keep = set(rows_by_adapter) | (unserved & running)
        row_slots = [-1] * num_rows
        for key, rows in rows_by_adapter.items():
            slot = self.slot(key, keep)
            for row in rows:
                row_slots[row] = slot
        self.batch.set(torch.tensor(row_slots, dtype=torch.long, device=device))


def layer_device(layer: ParallelLinear) -> torch.device:
    """Where the layer's product runs (its weight may have become a kernel)."""
    for tensor in (*layer.parameters(), *layer.buffers()):
        return tensor.device
    return torch.device("cpu")
