"""How GPU workers of one box see their GPUs, checked on the CPU with the CUDA boundary
faked: every worker sees every GPU the gateway sees and binds each rank to its own
(``EngineConfig.rank_device``), so a peer's KV pool opens on the peer's GPU over CUDA IPC
(``kv_share._open_cuda`` finds it by UUID), where a worker that saw only its own GPU
would get ZeroMQ frames."""

from __future__ import annotations

import pytest
import torch

from memserve.config import EngineConfig, WorkerConfig
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.workers import kv_share


def test_each_rank_binds_to_its_gpu_of_the_box():
    assert EngineConfig(device="cuda:2,3").rank_device(0) == "cuda:2"
    assert EngineConfig(device="cuda:2,3").rank_device(1) == "cuda:3"
    assert EngineConfig(device="cuda:5").rank_device() == "cuda:5"
    assert EngineConfig().rank_device(1) == "cpu"
    with pytest.raises(ValueError, match="names 1 GPUs: none for tensor-parallel rank 1"):
        EngineConfig(device="cuda:5").rank_device(1)


def test_a_gpu_worker_starts_seeing_every_gpu(monkeypatch):
    """The worker process keeps the gateway's GPU visibility and its own device names:
    worker 1 of ``--gpus 0,1,2,3 -tp 2`` runs on cuda:2,3 of the box."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    started: list[tuple[WorkerConfig, dict[str, str]]] = []

    def launch(config: WorkerConfig, env: dict[str, str]) -> object:
        started.append((config, env))
        return type("Process", (), {"pid": 1})()

    configs = plan_workers(EngineConfig(tensor_parallel_size=2), "tcp://x", 0, [0, 1, 2, 3])
    cluster = Cluster(configs, launch=launch)  # type: ignore[arg-type]
    cluster.spawn(1)
    config, env = started[-1]
    assert config.engine.device == "cuda:2,3"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_peers_pool_opens_on_the_peers_gpu(monkeypatch):
    """Three GPUs visible; the peer's pool lives on the one whose UUID is GPU-c: it is
    opened there (device 2), and a UUID no visible GPU has maps nothing."""
    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(kv_share, "_gpu_uuid", lambda device: uuids[device])
    opened: list[int] = []

    def rebuild(*args: object) -> str:
        opened.append(args[6])  # type: ignore[arg-type]  # rebuild_cuda_tensor's device argument
        return "pool"

    monkeypatch.setattr(kv_share, "rebuild_cuda_tensor", rebuild)
    description = {"kind": "cuda", "uuid": "GPU-c", "shape": [4, 8], "stride": [8, 1], "offset": 0,
                   "dtype": "float16", "handle": b"h", "size_bytes": 64, "offset_bytes": 0, "ref_counter": b"r",
                   "ref_counter_offset": 0, "event": b"e", "event_sync": False}
    assert kv_share._open_cuda(description) == "pool" and opened == [2]
    with pytest.raises(ValueError, match="GPU-z is not visible here"):
        kv_share._open_cuda({**description, "uuid": "GPU-z"})
