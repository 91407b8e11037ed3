"""`memserve up`: prepare the model folder, start the workers, serve the OpenAI API (and,
without a cost model, profile one in the background: ``auto_profile.py``) until
SIGINT/SIGTERM, then stop everything in order. With ``--ray`` the workers are placed on
the nodes of a Ray cluster (``ray_launcher.py``, imported only then)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from memserve.config import ServeConfig, served_model_name
from memserve.gateway.app import create_app
from memserve.gateway.lora_adapters import AdapterRegistry
from memserve.gateway.auth import AuthConfig
from memserve.gateway.auto_profile import AutoProfile, report_no_profile
from memserve.gateway.cluster import Cluster, Launch, launch_local, plan_workers
from memserve.gateway.connection import GatewayRunner
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.response_store import ResponseStore
from memserve.gateway.router_setup import build_router
from memserve.gateway.routing.admission import Admission
from memserve.gateway.routing.pd_topology import apply_pd_mode
from memserve.ipc.channel import GatewayChannel
from memserve.ipc.curve import ENV_VAR, CurveKeys
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.model_files.hub_cache import is_repo_id
from memserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from memserve.config import WorkerConfig
    from memserve.gateway.ray_launcher import RayLauncher
    from memserve.predictor.predictor import Predictor

log = logging.getLogger("memserve.gateway")



def _build_predictor(model_dir: Path, tokenizer: Tokenizer) -> Predictor:
    """The output-length predictor, bootstrapped (seconds of fitting: run in a thread)."""
    # scikit-learn is imported only when the predictor is on.
    from memserve.predictor.predictor import Predictor

    return Predictor.for_model(model_dir, tokenizer)


def _internal_channel(cfg: ServeConfig, internal_host: str) -> tuple[str, GatewayChannel]:
    """The gateway's worker socket and the private (0700) runtime directory. With ipc
    transport every internal socket is a file there, so only the HTTP port is TCP; with
    tcp transport the sockets listen on ``internal_host`` and speak CurveZMQ with keys
    made now, which workers get through their environment."""
    runtime_dir = tempfile.mkdtemp(prefix="memserve-")
    if cfg.internal_transport == "ipc":
        return runtime_dir, GatewayChannel(f"ipc://{runtime_dir}/gateway")
    os.environ[ENV_VAR] = CurveKeys.generate().to_env()
    return runtime_dir, GatewayChannel(f"tcp://{internal_host}:*")


def _model_for_nodes(model: str | None) -> str | None:
    """``--model`` as a worker on any node finds it: the embedded default and a repo id as
    named (each node prepares its own folder from its own files), a path made absolute
    (it must name the same model on every node)."""
    if model is None or is_repo_id(model):
        return model
    return str(Path(model).expanduser().absolute())


def _join_ray(address: str) -> str:
    """``--ray``: join the Ray cluster; returns the IP Ray knows this node by."""
    from memserve.gateway.ray_launcher import connect  # imports ray: only with --ray

    return connect(address)


def _ray_launcher(cfg: ServeConfig, workers: list[WorkerConfig]) -> RayLauncher:
    """Reserve the workers' bundles in the Ray cluster joined by ``_join_ray``."""
    from memserve.gateway.ray_launcher import RayLauncher

    return RayLauncher(workers, cfg.ray_placement)


async def serve(cfg: ServeConfig) -> None:
    name = served_model_name(cfg)
    router = build_router(cfg)
    profile = AutoProfile(cfg, router) if router.cost is None and cfg.auto_profile else None
    if router.cost is None and profile is None:
        report_no_profile(cfg, router)
    model = cfg.engine.model
    model_dir = await asyncio.to_thread(ensure_model_dir, model)
    cfg.engine.model = str(model_dir)  # local workers load the prepared folder directly
    tokenizer = Tokenizer.from_folder(model_dir)
    adapters = AdapterRegistry(cfg.engine.lora_paths)  # a folder that is not an adapter is refused here
    # Fitted while the workers load.
    predictor = asyncio.create_task(asyncio.to_thread(_build_predictor, model_dir, tokenizer)) \
        if cfg.predictor == "on" else None
    ray_ip = _join_ray(cfg.ray) if cfg.ray is not None else None
    internal_host = cfg.internal_host or ray_ip or "127.0.0.1"
    runtime_dir, channel = _internal_channel(cfg, internal_host)
    engine = cfg.engine if cfg.ray is None else replace(cfg.engine, model=_model_for_nodes(model))
    workers = plan_workers(engine, channel.address, cfg.cpu_workers, cfg.gpus, cfg.roles,
                           runtime_dir if cfg.internal_transport == "ipc" else "", internal_host,
                           kv_events_config=cfg.kv_events_config)
    apply_pd_mode(workers, cfg.pd_mode)
    try:
        ray_launcher = _ray_launcher(cfg, workers) if cfg.ray is not None else None
    except BaseException:
        channel.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    launch: Launch = ray_launcher if ray_launcher is not None else launch_local
    cluster = Cluster(workers, cfg.heartbeat_timeout_s, cfg.spare_workers, launch)
    admission = Admission(cfg.admission, cfg.admission_queue_size)  # judges once the router has a cost model
    client = ZmqEngineClient(channel, cluster, cfg.engine.block_size, router=router, admission=admission,
                             pd_mode=cfg.pd_mode, adapters=adapters)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner: GatewayRunner | None = None
    profiling: asyncio.Task | None = None
    try:
        start = asyncio.create_task(client.start())
        await asyncio.wait([start, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            start.cancel()
            return
        start.result()
        profiling = asyncio.create_task(profile.run(lambda: bool(client.streams))) if profile is not None else None
        if predictor is not None:
            client.predictor = await predictor
        slo_defaults = {k: v for k, v in (("ttft_ms", cfg.slo_ttft_ms), ("tbt_ms", cfg.slo_tbt_ms)) if v is not None}
        app = create_app(client, tokenizer, name, cfg.max_body_bytes, cfg.body_timeout_s, slo_defaults=slo_defaults,
                         truncation=cfg.truncation, block_size=cfg.engine.block_size,
                         web_ui=cfg.web_ui, tool_call_parser=cfg.tool_call_parser,
                         reasoning_parser=cfg.reasoning_parser,
                         response_store=ResponseStore(cfg.responses_store_size, cfg.responses_store_ttl_s),
                         auth=AuthConfig(tuple(cfg.api_keys), cfg.metrics_api_key, cfg.cache_salt_from_key),
                         adapters=adapters,
                         lora_changer=client.adapters if cfg.allow_runtime_lora_updating else None)
        runner = GatewayRunner(app, header_timeout_s=cfg.header_timeout_s, body_timeout_s=cfg.body_timeout_s,
                               max_connections=cfg.max_connections, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        n = len(cluster.workers)
        print(f"memserve: serving {name} on http://{cfg.host}:{cfg.port}/v1 with {n} worker(s)", flush=True)
        await stop.wait()
        log.info("shutting down")
    finally:
        if profiling is not None:
            profiling.cancel()
            await asyncio.gather(profiling, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()
        await client.close()
        if ray_launcher is not None:
            ray_launcher.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
