"""CacheOpt's allocation arithmetic (workers/engine/policies/cacheopt/alloc.py) against hand-computed
values: demand, amortised cuts (with a floor stopping a cut), and the embedding host."""

from __future__ import annotations

import pytest

from memserve.ipc.messages import SamplingParams
from memserve.workers.engine.policies.cacheopt.alloc import (
    Host,
    amortise,
    blocks_for,
    demand_tokens,
    embedding_host,
)
from memserve.workers.engine.sequence import Sequence


def seq(prompt: int, predicted: int | None, outputs: int = 0, max_tokens: int = 100) -> Sequence:
    s = Sequence("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0,
                 predicted_output_tokens=predicted)
    s.output_token_ids = [7] * outputs
    return s


def test_demand_is_tokens_so_far_plus_predicted_rest_capped_by_max_tokens():
    assert demand_tokens(seq(20, 50, outputs=10), 8) == 30 + 40  # 50 predicted, 10 out
    assert demand_tokens(seq(20, 12, outputs=10), 8) == 30 + 8  # under-predicted: B more
    assert demand_tokens(seq(20, None, outputs=10), 8) == 30 + 8  # no prediction: on demand
    assert demand_tokens(seq(20, 500, outputs=10, max_tokens=100), 8) == 120  # never past max_tokens
    assert blocks_for(70, 16) == 5 and blocks_for(64, 16) == 4


def test_demands_that_fit_are_allocated_whole():
    assert amortise([3, 4], [1, 1], 10, [1.0, 1.0], [5, 5]) == [3, 4]


def test_excess_is_cut_by_remaining_time_times_predicted_output():
    # E = 20 - 14 = 6; w = (1/4)(2/8) = 1/16 and (3/4)(6/8) = 9/16 -> cuts 0.6 and 5.4.
    assert amortise([10, 10], [2, 2], 14, [1.0, 3.0], [2, 6]) == [9, 4]


def test_a_floor_stops_a_cut_and_the_rest_goes_to_the_others():
    # As above, but the second may not go below 8: it takes a cut of 2, the first 0.6 + 3.4.
    assert amortise([10, 10], [2, 8], 14, [1.0, 3.0], [2, 6]) == [6, 8]


@pytest.mark.parametrize("buffer, host", [(8, "h2"), (11, "h1"), (21, None)])
def test_embedding_picks_the_fitting_host_with_least_unused_allocation(buffer, host):
    # New request: 10 prompt, 20 predicted. a - (u + 20) - (10 + 20): h1 100-50-30 = 20 (unused 70),
    # h2 80-40-30 = 10 (unused 60), h3 60-30-30 = 0.
    hosts = [Host("h1", 100, 30), Host("h2", 80, 20), Host("h3", 60, 10)]
    chosen = embedding_host(10, 20, hosts, buffer)
    assert (chosen.request_id if chosen else None) == host
