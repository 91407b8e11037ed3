"""Policies are chosen by name from a flag; one lookup serves every kind of them."""

from __future__ import annotations

from typing import Any


def make(table: dict[str, type], name: str, what: str) -> Any:
    """An instance of ``table[name]``; a clear error naming the choices otherwise."""
    try:
        return table[name]()
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(table)}") from None
