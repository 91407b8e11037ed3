"""A worker's death costs clients nothing, on a real `memserve up --cpu-workers 2`: one
worker is SIGKILLed while 12 collected and 4 streamed greedy completions are in flight,
and every one is answered 200 with the text a run without the kill gives. The collected
ones on the dead worker are re-run on the other; the streamed ones resume there after
their last sent token, and the client sees one stream (one id, no error event, a
logprob for every token, usage as without the kill). The surviving worker holds no KV block once the requests are done,
and the dead one is being restarted."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from helpers.in_flight import assert_as_without_the_fault, idle_and_whole, run
from helpers.live_server import wait_until, workers
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start_server(["--cpu-workers", "2", "--num-blocks", str(NUM_BLOCKS), "--router", "least-load"],
                          tmp_path_factory.mktemp("worker-death") / "memserve.log", threads=1, cwd=REPO)
    yield handle
    stop_server(handle)


@pytest.mark.slow  # a 2-worker server and two runs of 16 requests: 35-90 s on 2 cores
def test_a_killed_worker_costs_the_clients_nothing(server):
    reference = asyncio.run(run(server.base_url, None))
    assert all(status == 200 for status, _ in reference[0]), reference[0]
    wait_until(lambda: all(map(idle_and_whole, workers(server).values())), 30, "the reference run to settle")
    victim = workers(server)[0]

    assert_as_without_the_fault(asyncio.run(run(server.base_url, lambda: os.kill(victim["pid"], signal.SIGKILL))),
                                reference)
    log = server.log_path.read_text()
    assert "worker 0 died" in log and "resume on worker 1" in log and "rerun on worker 1" in log
    # The survivor took them all and holds no block for any; the dead worker is being restarted.
    wait_until(lambda: idle_and_whole(workers(server)[1]), 30, "worker 1 to free every KV block")
    restarted = workers(server)[0]
    assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
