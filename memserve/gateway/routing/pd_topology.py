"""Topology of a disaggregated deployment: the ``--instances`` spec (one role per worker,
with its GPU on a GPU box) and what each ``--pd-mode`` (MemServe Table 4) means for the
context cache of each role:

============  ================  ================  ============================
mode          prefill caches    decode caches     transfer
============  ================  ================  ============================
pd-basic      no                no                the whole prompt
pd-caching-1  yes               no                the whole prompt
pd-caching-2  yes               yes (inserted)    only blocks D lacks
pd-caching-3  yes               yes (inserted)    only blocks D lacks; D sends
                                                  decode-phase KV back to P
============  ================  ================  ============================
"""

from __future__ import annotations

from memserve.config import WorkerConfig

ROLES = ("colocated", "prefill", "decode")
PD_MODES = ("pd-basic", "pd-caching-1", "pd-caching-2", "pd-caching-3")


def parse_instances(spec: str) -> tuple[list[str], list[int] | None]:
    """``prefill,decode`` -> roles (CPU workers); ``prefill:0,decode:1`` -> roles and GPUs.
    A disaggregated topology needs a prefill and a decode instance and no colocated one.
    Two instances may name one GPU (``prefill:0,decode:0``): each holds its own model and
    ``--kv-cache-gb`` of KV there, and they exchange KV over CUDA IPC as on two GPUs."""
    roles: list[str] = []
    gpus: list[int] = []
    for item in (part.strip() for part in spec.split(",")):
        role, _, gpu = item.partition(":")
        if role not in ROLES:
            raise ValueError(f"--instances: unknown role {role!r} (one of {', '.join(ROLES)})")
        roles.append(role)
        if gpu:
            gpus.append(int(gpu))
    if gpus and len(gpus) != len(roles):
        raise ValueError("--instances: give a GPU to every instance or to none")
    if ("decode" in roles or "prefill" in roles) and (
            "colocated" in roles or "decode" not in roles or "prefill" not in roles):
        raise ValueError("--instances: a disaggregated topology needs prefill and decode instances, "
                         "and no colocated one")
    return roles, gpus or None


def is_disaggregated(roles: list[str]) -> bool:
    return "decode" in roles


def role_caches(role: str, pd_mode: str) -> bool:
    """Whether an instance of ``role`` keeps a context cache under ``pd_mode``."""
    if pd_mode not in PD_MODES:
        raise ValueError(f"unknown --pd-mode {pd_mode!r} (one of {', '.join(PD_MODES)})")
    if role == "colocated":
        return True
    if pd_mode == "pd-basic":
        return False
    return role == "prefill" or pd_mode in ("pd-caching-2", "pd-caching-3")


def apply_pd_mode(configs: list[WorkerConfig], pd_mode: str) -> None:
    """Turn each worker's context cache off where ``pd_mode`` keeps none for its role
    (``--no-prefix-cache`` keeps it off everywhere)."""
    for cfg in configs:
        cfg.engine.enable_prefix_caching = cfg.engine.enable_prefix_caching and role_caches(cfg.role, pd_mode)
