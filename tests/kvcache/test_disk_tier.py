"""The disk tier on real files: a block file that is missing, short or corrupt is a miss
(the index forgets it and says so in a KV event), never wrong bytes; a new MemPool on an
existing directory re-indexes the valid blocks, drops chains whose parent is gone, and
publishes them as KV events that rebuild the gateway's mirror exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.mempool import BS, prompt
from helpers.tiers import (
    BLOCK_NBYTES,
    assert_no_leaks,
    cache_filled,
    settle,
    tiered_pool,
    tiers_of,
)

from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.disk_store import HEADER_NBYTES, DiskStore
from memserve.kvcache.events import REMOVED, STORED, KVEvents
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror


def on_disk(tmp_path, prompts: list[list[int]], **kw):
    """A pool whose cascade has moved ``prompts`` (cached in order) to the disk tier."""
    pool, memory = tiered_pool(tmp_path, device=8, host=4, disk_blocks=16, **kw)
    for i, tokens in enumerate(prompts):
        cache_filled(pool, memory, tokens, seed=i)
    wants = [memory.get(pool.match(tokens, take_ref=False)) for tokens in prompts]  # shared blocks: the first copy
    settle(pool)
    for tokens in prompts:
        assert tiers_of(pool, tokens) == [Tier.DISK] * (len(tokens) // BS)
    return pool, memory, wants


def block_file(pool, tokens: list[int], i: int):
    return pool.disk.dir / f"{block_hashes(tokens, BS)[i]:016x}.kv"


def load(pool, memory, tokens: list[int]) -> tuple[int, bytes]:
    """Load a cached prompt to the device the way the engine does (prepare, copy through
    the tiered mover off the MemPool's books, commit); returns (blocks that arrived,
    their bytes) and leaves nothing held."""
    hit = pool.match(tokens)
    fast = [a for a in hit if addr_tier(a) == Tier.DEVICE]
    slow = hit[len(fast) :]
    device = pool.prepare_swap_in(slow)
    for tier, src, dst in pool.swap_in_copies(slow, device):
        pool.mover.copy_blocks(tier, src, Tier.DEVICE, dst)
    intact = len(fast) + pool.commit_swap_in(slow, device)
    got = memory.get((fast + device)[:intact])
    pool.free_mem(hit)
    pool.free_mem(device)
    return intact, got


def damage(path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, HEADER_NBYTES + BLOCK_NBYTES // 2)
    else:
        data = bytearray(path.read_bytes())
        data[HEADER_NBYTES + 5] ^= 0x40  # one bit of the KV bytes
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["corrupted", "truncated", "deleted"])
def test_a_bad_block_file_is_a_miss_from_that_block_on(tmp_path, how):
    tokens = prompt(1, 4)
    pool, memory, (want,) = on_disk(tmp_path, [tokens])
    damage(block_file(pool, tokens, 2), how)
    pool.drain_events()
    intact, got = load(pool, memory, tokens)
    assert intact == 2 and got == want[: 2 * BLOCK_NBYTES]
    pool.poll_saves()  # nobody holds the bad block now: it is forgotten, with its child
    events = pool.drain_events()
    assert [e.type for e in events][-1] == REMOVED
    assert set(events[-1].hashes) == set(block_hashes(tokens, BS)[2:])
    assert tiers_of(pool, tokens) == [Tier.DEVICE] * 2  # the good part was promoted
    assert not block_file(pool, tokens, 2).exists()
    assert_no_leaks(pool)
    pool.close()


def test_a_restarted_pool_reindexes_the_disk_and_publishes_it(tmp_path):
    a, b = prompt(1, 3), prompt(1, 2) + prompt(2, 2)  # b shares a's first two blocks
    pool, memory, wants = on_disk(tmp_path, [a, b])
    c = prompt(9, 2)
    wants.append(cache_filled(pool, memory, c, seed=9))  # still on the device: close() persists it
    assert tiers_of(pool, c) == [Tier.DEVICE] * 2
    entries = {(h, parent, Tier.DISK) for h, parent, _ in pool.index.entries()}
    pool.close()
    (pool.disk.dir / ".0123456789abcdef.kv.99.tmp").write_bytes(b"a save cut short")

    again, memory2 = tiered_pool(tmp_path, device=8, host=4, disk_blocks=16)
    assert again.index.entries() == entries
    events = again.drain_events()
    assert {e.type for e in events} == {STORED}
    mirror = PromptTreeMirror(0, BS)
    mirror.apply(KVEvents(0, events))
    assert mirror.entries() == entries
    assert [p.name for p in again.disk.dir.iterdir() if p.name.endswith(".tmp")] == []
    for tokens, want in zip([a, b, c], wants):
        intact, got = load(again, memory2, tokens)
        assert intact == len(tokens) // BS and got == want
    assert_no_leaks(again)
    again.close()


def test_restart_drops_chains_whose_parent_is_missing_or_corrupt(tmp_path):
    a, b = prompt(3, 4), prompt(4, 3)
    pool, _, _ = on_disk(tmp_path, [a, b])
    pool.close()
    block_file(pool, a, 1).unlink()
    damage(block_file(pool, b, 0), "corrupted")
    again, _ = tiered_pool(tmp_path, device=8, host=4, disk_blocks=16)
    assert tiers_of(again, a) == [Tier.DISK] and tiers_of(again, b) == []
    assert sorted(p.name for p in again.disk.dir.iterdir()) == [block_file(pool, a, 0).name]
    again.close()


def test_another_model_or_instance_never_reads_the_files(tmp_path):
    tokens = prompt(5, 2)
    pool, _, _ = on_disk(tmp_path, [tokens])
    pool.close()
    other_instance, _ = tiered_pool(tmp_path, instance=1)
    assert other_instance.match(tokens, take_ref=False) == []
    other_instance.close()
    from memserve.kvcache.disk_store import DiskStore

    other_model = DiskStore(tmp_path, 16 * (BLOCK_NBYTES + HEADER_NBYTES), BLOCK_NBYTES, fingerprint=4321)
    assert other_model.scan(0) == []
    again, _ = tiered_pool(tmp_path)
    assert [addr_tier(a) for a in again.match(tokens, take_ref=False)] == [Tier.DISK] * 2
    again.close()


_SAVER_SCRIPT = """
import sys
from memserve.kvcache.disk_store import DiskStore
root, nbytes, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = DiskStore(root, blocks * (nbytes + 64), nbytes, 7)
store.scan(0)
for i in range(store.num_blocks):
    store.name(i, i + 1, i if i else None)  # one chain: block i+1's parent is block i
    store.write(i, bytes([i % 251]) * nbytes)
    print(i, flush=True)
"""


def test_a_saver_killed_mid_write_leaves_only_whole_blocks(tmp_path):
    """``kill -9`` of a real process while it writes block files: a store opened on the
    directory afterwards adopts every block the dead process finished, each byte for byte,
    nothing else, and deletes what the kill cut short."""
    nbytes, blocks = 1 << 24, 24  # 16 MiB blocks: a write takes tens of ms, long enough to be cut
    proc = subprocess.Popen([sys.executable, "-c", _SAVER_SCRIPT, str(tmp_path), str(nbytes), str(blocks)],
                            stdout=subprocess.PIPE, text=True)
    start, finished = time.perf_counter(), -1
    while finished < 5:
        finished = int(proc.stdout.readline())
    time.sleep((time.perf_counter() - start) / (finished + 1) / 2)  # about half-way into the next write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = max([finished, *(int(line) for line in proc.stdout.read().split())])

    store = DiskStore(tmp_path, blocks * (nbytes + 64), nbytes, 7)
    adopted = store.scan(0)
    assert adopted[: finished + 1] == [(i + 1, i if i else None) for i in range(finished + 1)]
    assert len(adopted) <= finished + 2  # at most the one block written after the last report
    for slot, (block_hash, _) in enumerate(adopted):
        assert store.read(slot) == bytes([(block_hash - 1) % 251]) * nbytes
    assert sorted(p.name for p in store.dir.iterdir()) == sorted(f"{h:016x}.kv" for h, _ in adopted)
