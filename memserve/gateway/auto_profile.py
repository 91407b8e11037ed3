"""A cost model from the first start. When ``memserve up`` finds none for the served model
(no ``--cost-model``, no ``memserve profile`` of it), it profiles one in the background
once the workers are ready: ``memserve profile --quick`` in a child process at the
lowest CPU priority, so that serving goes on, and goes first, meanwhile. The child
writes where ``memserve profile`` writes, so the next start finds it and profiles
nothing. Once it is written the router takes it (``Router.use_cost_model``): the policy
that waited for it (``cost``) replaces its fallback, queued work is priced, and
admission control, which judges by the router's cost model, starts judging. Until then
the log says once what is off and why; with ``--no-auto-profile`` it says so and
nothing is profiled.

The profile runs in a process of its own because it measures the engine through torch,
which only worker processes import, and so that its failure costs only a warning. It
runs in a session of its own, so a Ctrl-C meant for the gateway does not reach it; the
gateway stops it when it stops. A quick profile is a first estimate, measured on a
machine that may already be serving; a full ``memserve profile`` on an idle machine
is newer and replaces it at the next start."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from memserve.config import EngineConfig, ServeConfig
from memserve.costmodel.store import cost_model_dir
from memserve.gateway.router_setup import find_cost_model, profile_model_name
from memserve.gateway.routing.admission import OFF
from memserve.gateway.routing.router import Router

log = logging.getLogger("memserve.gateway")

LOWEST_PRIORITY = 19  # nice value of the profile: workers and gateway run first
STOP_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL
OUTPUT_TAIL_CHARS = 2000  # of a failed profile's output, in the warning


def cost_model_users(cfg: ServeConfig, router: Router) -> list[tuple[str, str]]:
    """What asks for a cost model: each one's name and what it does while there is none."""
    users = []
    if router.awaiting is not None:
        users.append((f"{router.awaiting.name} routing", f"falls back to {router.policy.name}"))
    if cfg.admission != OFF:
        users.append((f"SLO admission (--admission {cfg.admission})", "is off"))
    return users


def _without(users: list[tuple[str, str]]) -> str:
    """'cost routing falls back to prompt-tree and SLO admission (...) is off'."""
    return " and ".join(f"{name} {meanwhile}" for name, meanwhile in users)


def report_no_profile(cfg: ServeConfig, router: Router) -> None:
    """The log line for a start without a cost model and without a background profile."""
    users = cost_model_users(cfg, router)
    if users:
        log.warning("no cost model for %s in %s, and --no-auto-profile: %s; run `memserve profile` or pass "
                    "--cost-model", profile_model_name(cfg.engine), cost_model_dir(), _without(users))


def profile_command(cfg: ServeConfig) -> list[str]:
    """``memserve profile --quick`` of the served model on worker 0's device, with the
    compute threads the cluster gives a CPU worker."""
    cmd = [sys.executable, "-m", "memserve.cli", "profile", "--quick", "--dtype", cfg.engine.dtype]
    if cfg.engine.model is not None:
        cmd += ["--model", cfg.engine.model]
    if cfg.gpus:
        return [*cmd, "--device", f"cuda:{cfg.gpus[0]}"]
    threads = cfg.engine.cpu_threads
    if threads is None and cfg.cpu_workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // cfg.cpu_workers)  # as Cluster splits the cores
    return [*cmd, "--device", "cpu", *(["--threads", str(threads)] if threads else [])]


class AutoProfile:
    """One background profile for ``router``; made before the gateway replaces the model
    option by its prepared folder (the profile is keyed by the model's own name)."""

    def __init__(self, cfg: ServeConfig, router: Router) -> None:
        self.command = profile_command(cfg)
        self._engine = EngineConfig(model=cfg.engine.model, dtype=cfg.engine.dtype)
        self._router = router
        self._users = cost_model_users(cfg, router)

    async def run(self) -> None:
        """Profile, then hand the cost model to the router; cancelled, the child is stopped."""
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, LOWEST_PRIORITY)  # before it starts its threads
        except OSError:
            pass  # it exited already; its return code says how
        name = profile_model_name(self._engine) + (f" ({self._engine.dtype})" if self._engine.dtype != "auto" else "")
        until = f"; until the profile in {cost_model_dir()} is ready, {_without(self._users)}" if self._users else ""
        log.warning("no cost model for %s: profiling one in the background (`memserve profile --quick`, pid %d)%s",
                    name, proc.pid, until)
        try:
            output, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                await _stop(proc)
        why = f"exit {proc.returncode}"
        found = None
        if proc.returncode == 0:
            try:
                found = find_cost_model(self._engine)
                why = f"no profile of {name} in {cost_model_dir()}"
            except (OSError, ValueError, KeyError, TypeError) as exc:
                why = f"cannot load it: {exc}"
        if found is None:
            still = f": {_without(self._users)}" if self._users else ""
            log.warning("the background profile of %s failed (%s)%s; run `memserve profile` to see why. Its "
                        "output:\n%s", name, why, still, output.decode(errors="replace")[-OUTPUT_TAIL_CHARS:])
            return
        path, cost = found
        self._router.use_cost_model(cost)
        names = [feature for feature, _ in self._users]
        on = f": {' and '.join(names)} {'is' if len(names) == 1 else 'are'} on" if names else ""
        log.info("cost model of %s profiled in %.0f s and written to %s%s", name, time.monotonic() - start, path, on)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``STOP_TIMEOUT_S``."""
    try:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
