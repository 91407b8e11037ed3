"""vLLM's runtime LoRA endpoints, behind ``--allow-runtime-lora-updating``:

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: every live worker reads
  the adapter and serves it from then on; 200 with vLLM's plain-text success line. 400
  with OpenAI's error object, the adapter served nowhere, when a name is missing or
  already served, or a worker refuses the adapter (not an adapter, another base model's,
  a rank over ``--max-lora-rank``: the worker's reason is the message).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: new requests naming it get 404 at
  once; requests a worker received before finish through it (it keeps the weights while
  a request it knows runs on them); once none does they are dropped, and a request that
  still names them fails with an error naming the adapter. 404 for a name not served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from memserve.gateway.errors import APIError, bad_request
from memserve.gateway.lora_adapters import AdapterRefused


class AdapterChanger(Protocol):
    async def set_adapter(self, name: str, path: str | None) -> None:
        """Serve adapter ``name`` from ``path`` on every live worker (None: no more);
        raises ``AdapterRefused`` (every worker left as it was)."""
        ...

    def served_adapters(self) -> list[str]:
        ...


def add_lora_routes(app: web.Application, changer: AdapterChanger, base_model: str,
                    read_json: Callable[[web.Request], Awaitable[dict]]) -> None:
    changing = asyncio.Lock()  # one change at a time: two loads of one name cannot both pass the check

    async def load(request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        async with changing:
            if name in changer.served_adapters() or name == base_model:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            try:
                await changer.set_adapter(name, path)
            except (AdapterRefused, FileNotFoundError) as exc:
                raise bad_request(f"Loading lora {name} failed: {exc}", "lora_path") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        body = await read_json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with changing:
            if name not in changer.served_adapters():
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
            await changer.set_adapter(name, None)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.add_routes([web.post("/v1/load_lora_adapter", load), web.post("/v1/unload_lora_adapter", unload)])
