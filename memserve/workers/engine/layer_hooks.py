"""Per-layer hooks of a forward pass: where KV that is still arriving is waited for, layer
by layer, and where a layer's freshly written KV can be saved or sent on.

Layer-wise preloading (AttentionStore §3.2) waits in ``before_layer(i)`` for layer i's KV
while layer i-1 computes; by-layer transfer (MemServe §4.3) starts sending layer i's KV in
``after_layer(i)`` while layer i+1 computes. The model calls both for every layer; the
default does nothing."""

from __future__ import annotations

from typing import Protocol


class LayerHooks(Protocol):
    def before_layer(self, layer: int) -> None:
        """Return once layer ``layer``'s KV for this step is in place."""
        ...

    def after_layer(self, layer: int) -> None:
        """Layer ``layer``'s KV for this step has been written."""
        ...


class NoHooks:
    def before_layer(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        pass


NO_HOOKS = NoHooks()


class ChainedHooks:
    """Several hooks for one forward pass, called in order: a step can both wait for KV
    still loading (preloading) and send what it wrote (by-layer transfer)."""

    def __init__(self, hooks: list[LayerHooks]) -> None:
        self.hooks = hooks

    def before_layer(self, layer: int) -> None:
        for hook in self.hooks:
            hook.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        for hook in self.hooks:
            hook.after_layer(layer)
