"""Layer-wise preloading (AttentionStore §3.2): a step computing on a load in flight waits
in ``before_layer(i)`` for exactly layer i; the read buffer bounds how far ahead the copy
runs; a failed copy fails the step that needs it and is reported once. In the real
engine, multi-turn conversations whose history was demoted to the host tier answer the
same greedy tokens with preloading off, on without a buffer, and on with one; a failed
load fails only its own request and leaks no block."""

from __future__ import annotations

import time

import pytest
from helpers.engine_replay import conversations, replay, run

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.address import Tier, addr_tier
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.step_plan import KVLoad, ScheduledChunk, StepPlan
from memserve.workers.layer_preload import LayerwisePreloader, LoadFailed, buffer_layers
from memserve.workers.real_engine import build_engine

LAYERS = 8


class SlowLayers:
    """A layer copier that takes ``delay_s`` per layer and checks the read buffer's bound
    against the layer the test says the compute is at (-1: its step has not started)."""

    def __init__(self, ahead: int, delay_s: float = 0.01, fail_at: int | None = None) -> None:
        self.ahead = ahead
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.computing = -1
        self.copied: list[int] = []
        self.too_far: list[tuple[int, int]] = []

    def copy_layer(self, tier: Tier, src: list[int], dst: list[int], layer: int) -> None:
        bound = self.ahead - 1 if self.computing < 0 else self.computing + 1 + self.ahead
        if layer > bound:
            self.too_far.append((layer, self.computing))
        time.sleep(self.delay_s)
        if layer == self.fail_at:
            raise OSError("copy failed")
        self.copied.append(layer)


def preloader(copier: SlowLayers) -> LayerwisePreloader:
    return LayerwisePreloader(LAYERS, copier.copy_layer, lambda tier, src, dst: None, lambda slots: False,
                              ahead=copier.ahead)


def step_of(rid: str) -> StepPlan:
    return StepPlan(chunks=[ScheduledChunk(rid, [1, 2, 3], 32, [0, 1, 2], True)])


def wait_until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


@pytest.mark.parametrize("ahead", [0, 3])
def test_before_layer_waits_for_its_layer_and_the_buffer_bounds_the_copy(ahead):
    copier = SlowLayers(ahead)
    pre = preloader(copier)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5, 6], [0, 1])], num_new_tokens=3))
    wait_until(lambda: pre.streamable() == ["r"] or copier.copied == list(range(ahead)))
    time.sleep(0.1)  # the copier stops at the buffer's depth until the step starts
    assert copier.copied == list(range(ahead))
    hooks = pre.hooks_for(step_of("r"))
    assert hooks is pre
    assert pre.hooks_for(step_of("other")) is None  # a step with no load in flight waits for nothing
    hooks = pre.hooks_for(step_of("r"))
    for layer in range(LAYERS):
        copier.computing = layer
        hooks.before_layer(layer)
        assert layer in copier.copied  # its layer is in place, and
        assert max(copier.copied) <= layer + 1 + ahead  # the copy never ran further ahead than the buffer
        time.sleep(0.005)  # "compute"
        hooks.after_layer(layer)
    assert copier.too_far == []
    wait_until(lambda: pre.finished() == (["r"], {}))
    assert pre.rates.copy_s_per_block_layer is not None and pre.rates.compute_s_per_token_layer is not None


def test_a_slow_copy_holds_the_step_at_the_layer_it_needs():
    copier = SlowLayers(ahead=0, delay_s=0.05)
    pre = preloader(copier)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5], [0])]))
    hooks = pre.hooks_for(step_of("r"))
    waited = []
    for layer in range(3):
        copier.computing = layer
        start = time.monotonic()
        hooks.before_layer(layer)
        waited.append(time.monotonic() - start)
    assert waited[0] >= 0.04  # layer 0's copy starts with the step: the step waited for it
    assert copier.copied[:3] == [0, 1, 2]
    pre.release(["r"])
    wait_until(lambda: pre.finished()[0] == ["r"])


def test_a_failed_copy_fails_the_step_and_is_reported():
    copier = SlowLayers(ahead=LAYERS, fail_at=2)
    pre = preloader(copier)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5], [0])]))
    hooks = pre.hooks_for(step_of("r"))
    hooks.before_layer(0)
    hooks.before_layer(1)
    with pytest.raises(LoadFailed):
        hooks.before_layer(2)
    wait_until(lambda: "r" in pre.finished()[1])


def test_off_copies_whole_and_never_streams():
    whole: list[tuple] = []
    pre = LayerwisePreloader(LAYERS, lambda *a: pytest.fail("no layer copies when off"),
                             lambda tier, src, dst: whole.append((tier, src, dst)), lambda slots: False,
                             layerwise=False)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5, 6], [0, 1])]))
    wait_until(lambda: pre.finished()[0] == ["r"])
    assert whole == [(Tier.HOST, [5, 6], [0, 1])] and pre.streamable() == []


def test_a_disk_miss_is_never_streamed():
    """A load that lost a disk block is copied whole and not released to run early: the
    scheduler recomputes from the miss, as without preloading."""
    copier = SlowLayers(ahead=0)
    pre = LayerwisePreloader(LAYERS, copier.copy_layer, lambda tier, src, dst: None, lambda slots: True, ahead=0)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5], [0]), (int(Tier.DISK), [9], [1])]))
    wait_until(lambda: pre.finished()[0] == ["r"])
    assert pre.streamable() == [] and copier.copied == list(range(LAYERS))


def test_buffer_formula():
    assert buffer_layers(30, load_s_per_layer=1.0, compute_s_per_layer=2.0) == 0  # the compute covers the load
    assert buffer_layers(30, load_s_per_layer=2.0, compute_s_per_layer=1.0) == 15  # half of every layer's load
    assert buffer_layers(30, load_s_per_layer=1.0, compute_s_per_layer=0.0) == 30


def test_the_automatic_buffer_follows_the_measured_rates():
    pre = LayerwisePreloader(LAYERS, lambda *a: None, lambda *a: None, lambda slots: False)

    def ahead_of_a_new_load() -> int:
        pre.start(KVLoad(f"r{pre.stats.loads}", [(int(Tier.HOST), [5, 6], [0, 1])], num_new_tokens=10))
        return pre.stats.ahead[-1]

    assert ahead_of_a_new_load() == LAYERS  # nothing measured yet: never throttled
    pre.rates.copy_s_per_block_layer = 1.0  # a layer of this load copies in 2 s
    pre.rates.compute_s_per_token_layer = 0.1  # and computes in 1 s
    assert ahead_of_a_new_load() == 4  # §3.2: 8 layers * (2 - 1) / 2
    pre.rates.wake_s = 1.5  # the copy thread starts 1.5 s after it may: 2 more layers
    assert ahead_of_a_new_load() == 6
    pre.rates.compute_s_per_token_layer = 1.0  # the compute covers the copy: only the wake-up
    assert ahead_of_a_new_load() == 1
    pre.rates.handoff_s = 0.6  # each wake-up stalls the step 0.6 s: wake once per 3 layers of 2 s
    assert ahead_of_a_new_load() == 4  # (stalls <= 10% of the load time)


# ------------------------------------------------------------ the real engine

DEVICE_BLOCKS = 12  # one conversation's history at a time: the rest goes to the host tier


def engine(model_dir, layerwise: bool, ahead: int = -1) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=DEVICE_BLOCKS, num_host_blocks=200,
                       max_num_batched_tokens=512, layerwise_preload=layerwise, preload_buffer_layers=ahead)
    return build_engine(cfg, model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_folder(model_dir)


def tokens(results) -> list[dict[int, list[int]]]:
    return [{s: t for s, (t, _) in turn.items()} for turn in results]


def test_greedy_tokens_identical_with_preloading_off_on_and_buffered(model_dir, tokenizer):
    convs = conversations(2, seed=1)
    off = engine(model_dir, layerwise=False)
    want = tokens(replay(off, tokenizer, convs, 2, "off"))
    assert off.stats()["num_swapped_in"] > 0  # histories came back from the host tier
    for ahead in (0, 30):
        on = engine(model_dir, layerwise=True, ahead=ahead)
        got = replay(on, tokenizer, convs, 2, f"on{ahead}")
        assert tokens(got) == want, f"buffer {ahead}"
        if ahead == 0:  # the copy waits for the step: the prefill ran while its history streamed in
            assert on.runner.preloader.stats.streamed > 0
        assert any(cached for turn in got[1:] for _, cached in turn.values())
        device = on.mempool.stats()["device"]
        assert device["free"] + device["evictable"] == device["total"]  # nothing leaked


@pytest.mark.parametrize("ahead", [0, 30])  # 0: fails inside the step; 30: before it
def test_a_failed_load_fails_only_its_request(model_dir, ahead):
    on = engine(model_dir, layerwise=True, ahead=ahead)
    history = [100 + i for i in range(64)]
    first = run(on, {"a": history}, max_tokens=2)["a"][0]
    run(on, {"b": [5000 + i for i in range(150)]}, max_tokens=2)  # pushes the history to the host tier
    assert Tier.HOST in {addr_tier(a) for a in on.mempool.match(history, take_ref=False)}
    pre = on.runner.preloader
    copy_layer = pre._copy_layer

    def broken(tier, src, dst, layer):
        raise OSError("host tier read failed")

    pre._copy_layer = broken
    params = SamplingParams(max_tokens=4, temperature=0.0)
    on.add_request(AddRequest("next-turn", history + first + [7, 8, 9], params))
    fresh = [3000 + i for i in range(20)]  # nothing cached: no load
    on.add_request(AddRequest("fresh", fresh, params))
    outs: dict[str, list] = {"next-turn": [], "fresh": []}
    errors: dict[str, str] = {}
    while on.has_work:
        for o in on.step():
            outs[o.request_id] += o.new_token_ids
            if o.error:
                errors[o.request_id] = o.error
    assert list(errors) == ["next-turn"]  # only the request whose load failed
    device = on.mempool.stats()["device"]
    assert device["free"] + device["evictable"] == device["total"]  # its blocks came back
    pre._copy_layer = copy_layer
    again = run(on, {"retry": history + first + [7, 8, 9], "fresh-again": fresh}, max_tokens=4)
    assert again["retry"][1] > 0 and len(again["retry"][0]) == 4  # the cached history still serves
    assert again["fresh-again"][0] == outs["fresh"]  # the request beside the failure answered as always
