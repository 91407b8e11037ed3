"""`memserve up`: prepare the model folder, start the workers, serve the OpenAI API until
SIGINT/SIGTERM, then stop everything in order."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import tempfile
from pathlib import Path

from aiohttp import web

from memserve.config import ServeConfig
from memserve.gateway.app import create_app
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.gateway.connection import GatewayRunner
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.router_setup import build_router
from memserve.gateway.tokenizer import Tokenizer
from memserve.ipc.channel import GatewayChannel
from memserve.models.gguf_convert import ensure_model_dir

log = logging.getLogger("memserve.gateway")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(cfg: ServeConfig) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.engine.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(cfg.engine.model)
    return path.stem.split(".")[0] if path.suffix == ".gguf" else path.name


async def serve(cfg: ServeConfig) -> None:
    name = served_model_name(cfg)
    router = build_router(cfg, name)
    model_dir = await asyncio.to_thread(ensure_model_dir, cfg.engine.model)
    cfg.engine.model = str(model_dir)  # workers load the prepared folder directly
    tokenizer = Tokenizer.from_folder(model_dir)
    # Private (0700) directory for the internal ipc:// sockets: only the HTTP port is TCP.
    runtime_dir = tempfile.mkdtemp(prefix="memserve-")
    channel = GatewayChannel(f"ipc://{runtime_dir}/gateway")
    cluster = Cluster(plan_workers(cfg.engine, channel.address, cfg.cpu_workers, cfg.gpus, runtime_dir=runtime_dir),
                      cfg.heartbeat_timeout_s, cfg.spare_workers)
    client = ZmqEngineClient(channel, cluster, cfg.engine.block_size, router=router)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner: GatewayRunner | None = None
    try:
        start = asyncio.create_task(client.start())
        await asyncio.wait([start, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            start.cancel()
            return
        start.result()
        app = create_app(client, tokenizer, name, cfg.max_body_bytes, cfg.body_timeout_s)
        runner = GatewayRunner(app, header_timeout_s=cfg.header_timeout_s, body_timeout_s=cfg.body_timeout_s,
                               max_connections=cfg.max_connections, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        n = len(cluster.workers)
        print(f"memserve: serving {name} on http://{cfg.host}:{cfg.port}/v1 with {n} worker(s)", flush=True)
        await stop.wait()
        log.info("shutting down")
    finally:
        if runner is not None:
            await runner.cleanup()
        await client.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
