"""KV block addresses: one int encodes (instance, tier, block), as in MemServe Table 1.

An address says where a block lives in the whole cluster, so the same value can travel in
KV events, transfer headers and the gateway's prompt trees. Layout (bit ops only, so that
a list of 256 addresses is built or decoded in microseconds):

    bits 0-31   block id inside one tier's pool
    bits 32-39  tier
    bits 40-    instance id
"""

from __future__ import annotations

from enum import IntEnum

BLOCK_BITS = 32
TIER_BITS = 8
TIER_SHIFT = BLOCK_BITS
INSTANCE_SHIFT = BLOCK_BITS + TIER_BITS
BLOCK_MASK = (1 << BLOCK_BITS) - 1
TIER_MASK = (1 << TIER_BITS) - 1
MAX_BLOCKS = 1 << BLOCK_BITS


class Tier(IntEnum):
    """Memory tiers, fastest first: a larger value is a slower, larger tier."""

    DEVICE = 0
    HOST = 1
    DISK = 2


_TIERS = tuple(Tier)


def make_addr(instance: int, tier: int, block: int) -> int:
    return (instance << INSTANCE_SHIFT) | (tier << TIER_SHIFT) | block


def make_addrs(instance: int, tier: int, blocks: list[int]) -> list[int]:
    """Addresses of many blocks of one tier (one list comprehension, no call per block)."""
    base = (instance << INSTANCE_SHIFT) | (tier << TIER_SHIFT)
    return [base | b for b in blocks]


def addr_instance(addr: int) -> int:
    return addr >> INSTANCE_SHIFT


def addr_tier(addr: int) -> Tier:
    return _TIERS[(addr >> TIER_SHIFT) & TIER_MASK]


def addr_block(addr: int) -> int:
    return addr & BLOCK_MASK


def addr_str(addr: int) -> str:
    """Readable form for error messages: ``i0/DEVICE/17``."""
    tier = (addr >> TIER_SHIFT) & TIER_MASK
    name = _TIERS[tier].name if tier < len(_TIERS) else f"tier{tier}"
    return f"i{addr_instance(addr)}/{name}/{addr_block(addr)}"
