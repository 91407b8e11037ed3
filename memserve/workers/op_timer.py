"""Wall time per operator class of one forward pass, from module forward hooks.

The operator-level cost model (MemServe §5.3) fits one function per operator class, so
the profiler needs each class's share of a step. Hooks time every module of interest;
a module's *exclusive* time (its own minus its timed children's) is charged to its
class, so ``Attention`` is charged only rotary, the KV write and attention itself, its
q/k/v and output projections being charged to their own classes. Whatever no hook
covers (batch preparation, scheduling, sampling) is the caller's step time minus the sum.

On CUDA each hook synchronises first, so that a kernel is charged to the module that
launched it; that serialises the step, which is what operator profiling measures."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

from torch import nn

from memserve.workers.model.linear import ParallelLinear, VocabParallelEmbedding
from memserve.workers.model.llama import MLP, Attention, DecoderLayer, RMSNorm


def llama_operator_classes(model: nn.Module) -> dict[nn.Module, str]:
    """Operator class of each timed module of a ``LlamaForCausalLM``: linear layers by
    their name (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head); containers by what
    their own code does (Attention: rotary + KV write + attention; MLP: the SwiGLU
    activation; DecoderLayer: the residual adds)."""
    by_type = {RMSNorm: "norm", Attention: "attention", MLP: "activation", DecoderLayer: "residual",
               VocabParallelEmbedding: "embedding"}
    classes: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, ParallelLinear):  # its kernel (packed, GGUF) included
            classes[module] = name.rsplit(".", 1)[-1]
        elif type(module) in by_type:
            classes[module] = by_type[type(module)]
    return classes


class OperatorTimer:
    """Context manager: while active, ``totals`` accumulates exclusive seconds per class."""

    def __init__(self, classes: dict[nn.Module, str], sync: Callable[[], None] = lambda: None) -> None:
        self.classes = classes
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, seconds spent in timed children]
        self._handles: list = []

    def __enter__(self) -> "OperatorTimer":
        self.totals.clear()
        for module, cls in self.classes.items():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit_hook(cls)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _enter(self, module: nn.Module, args: object) -> None:
        self.sync()
        self._stack.append([time.perf_counter(), 0.0])

    def _exit_hook(self, cls: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            self.sync()
            start, children = self._stack.pop()
            elapsed = time.perf_counter() - start
            self.totals[cls] += elapsed - children
            if self._stack:
                self._stack[-1][1] += elapsed

        return hook
