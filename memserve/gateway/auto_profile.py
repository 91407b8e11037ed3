"""A cost model from the first start. When ``memserve up`` finds none for the served model
(no ``--cost-model``, no ``memserve profile`` of it), it profiles one in the background
once the workers are ready: ``memserve profile --quick`` in a child process at the
lowest CPU priority, paused while the gateway serves. A low priority alone does not
keep it out of serving's way: on a few CPU cores a worker's compute threads meet at
every operator, so one thread waiting for a core behind the profile holds them all up
(an 8-token reply took 6 to 11 s instead of 0.4 s while the profile ran). So
``PauseWhileBusy`` sends the child's process group SIGSTOP as soon as a request is in
flight and SIGCONT once none has been for ``RESUME_AFTER_IDLE_S``; the profile measures
again any run a pause fell into (``workers/resume_guard.py``), so pauses cost it time,
not accuracy, and it finishes in the gateway's idle time. The child writes where
``memserve profile`` writes, so the next start finds it and profiles nothing. Once it is
written the router takes it (``Router.use_cost_model``): the policy that waited for it
(``cost``) replaces its fallback, queued work is priced, and admission control, which
judges by the router's cost model, starts judging. Until then the log says once what is
off and why; with ``--no-auto-profile`` it says so and nothing is profiled.

The profile runs in a process of its own because it measures the engine through torch,
which only worker processes import, and so that its failure costs only a warning. It
runs in a session of its own, so a Ctrl-C meant for the gateway does not reach it, and
so its pid names a process group that holds it and the processes it starts (the
transfer probe's receiver), all paused together. When the gateway shuts down it
continues the child, if paused, and ends it. A quick profile is a first estimate; a
full ``memserve profile`` on an idle machine is newer and replaces it at the next
start."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Callable

from memserve.config import EngineConfig, ServeConfig
from memserve.costmodel.store import cost_model_dir
from memserve.gateway.router_setup import find_cost_model, profile_model_name
from memserve.gateway.routing.admission import OFF
from memserve.gateway.routing.router import Router

log = logging.getLogger("memserve.gateway")

LOWEST_PRIORITY = 19  # nice value of the profile: workers and gateway run first
STOP_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL
OUTPUT_TAIL_CHARS = 2000  # of a failed profile's output, in the warning
PAUSE_POLL_S = 0.05  # how often the gateway looks whether it serves: a reply waits at most this long for the cores
RESUME_AFTER_IDLE_S = 1.0  # idle this long before the profile goes on: a chat's next request mostly comes sooner


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
    if cfg.engine.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(cfg.engine.tensor_parallel_size)]
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

    async def run(self, busy: Callable[[], bool]) -> None:
        """Profile, paused while ``busy()`` (the gateway serves), then hand the cost model
        to the router; cancelled, the child is continued and ended."""
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
        pauser = PauseWhileBusy(proc.pid, busy)
        pausing = asyncio.create_task(pauser.run())
        try:
            output, _ = await proc.communicate()
        finally:
            pausing.cancel()  # before the SIGCONT: it pauses nothing after it
            pauser.resume()  # a paused process handles no SIGTERM until continued
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
        times = f"{pauser.pauses} time{'s' if pauser.pauses > 1 else ''}"
        paused = f" (paused {times} while serving)" if pauser.pauses else ""
        log.info("cost model of %s profiled in %.0f s%s and written to %s%s", name, time.monotonic() - start, paused,
                 path, on)


class PauseWhileBusy:
    """Keeps the process group ``pgid`` paused (SIGSTOP) while ``busy()``, and after that
    until ``busy()`` has been false for ``RESUME_AFTER_IDLE_S`` (then SIGCONT)."""

    def __init__(self, pgid: int, busy: Callable[[], bool]) -> None:
        self.pgid = pgid
        self.busy = busy
        self.paused = False
        self.pauses = 0

    async def run(self) -> None:
        """Look every ``PAUSE_POLL_S`` until cancelled (then ``resume`` is the caller's)."""
        idle_since = time.monotonic()
        while True:
            if self.busy():
                idle_since = time.monotonic()
                if not self.paused:
                    self._pause()
            elif self.paused and time.monotonic() - idle_since >= RESUME_AFTER_IDLE_S:
                self.resume()
            await asyncio.sleep(PAUSE_POLL_S)

    def _pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True
        self.pauses += 1
        if self.pauses == 1:
            log.info("the background profile (pid %d) is paused while requests are served; it goes on after "
                     "%g s without any", self.pgid, RESUME_AFTER_IDLE_S)

    def resume(self) -> None:
        """Continue the group if paused."""
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass  # it exited: the caller reads its return code


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL to its process group (the processes it started, which may
    hold its output pipe, too) if it has not exited within ``STOP_TIMEOUT_S``."""
    try:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):  # all exited meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
