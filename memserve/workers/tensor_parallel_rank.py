"""Ranks 1..N-1 of a tensor-parallel worker (``tensor_parallel_group.py``): each loads its
shard of the model and its heads' KV pools, then does what rank 0 asks, call by call, to
its own shard, until rank 0 goes (it dies with it: Linux's parent-death signal).

Run by rank 0 as ``python -m memserve.workers.tensor_parallel_rank RANK PORT MODEL_DIR
ENGINE_CONFIG_JSON INSTANCE`` (INSTANCE: the worker's id, -1 for a spare)."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memserve.config import EngineConfig
from memserve.workers.cpu_threads import pin_compute_threads, rank_cpus, rank_threads
from memserve.workers.parent_death import die_with_parent
from memserve.workers.tensor_parallel_disk import ANSWERED, REPORTED, follow

if TYPE_CHECKING:
    import torch.distributed as dist

    from memserve.workers.model_runner import ModelRunner

log = logging.getLogger("memserve.worker")


def serve(runner: ModelRunner, control: dist.ProcessGroup) -> None:
    """Do rank 0's calls, in its order, until it goes."""
    import torch.distributed as dist

    while True:
        call: list[Any] = [None]
        try:
            dist.broadcast_object_list(call, src=0, group=control)
        except RuntimeError:  # rank 0 closed the group: it exited (or died), and this rank goes with it
            log.info("rank 0 is gone: exiting")
            return
        method, args = call[0]
        if method == "execute":
            try:
                runner.execute(*args)
            except Exception:  # noqa: BLE001 - rank 0 meets the same error in the same step and fails its requests
                log.exception("step failed on this rank")
            runner.finished_loads()  # the engine on rank 0 tracks loads; this rank only copies its share
            runner.failed_loads()
        elif method == "read_blocks":
            _answer(lambda: [bytes(b) for b in runner.mover.read_blocks(*args)], control)
        elif method in ANSWERED:
            _answer(lambda: follow(runner.disk, runner.preloader, method, args), control)
        elif method in REPORTED:
            _report(lambda: follow(runner.disk, runner.preloader, method, args), control)
        elif method in ("write_blocks", "write_layer"):
            piece: list[Any] = [None]
            dist.scatter_object_list(piece, None, src=0, group=control)
            write = getattr(runner.mover, method)  # (the rank's pools, or its tiers over them)
            _report(lambda: write(*args, piece[0]), control)
        elif method == "copy_blocks":
            _report(lambda: runner.mover.copy_blocks(*args), control)
        elif method == "shift_blocks":
            _report(lambda: runner.shift_blocks(*args), control)
        elif method == "set_adapter":
            _report(lambda: runner.set_adapter(*args), control)
        else:
            raise ValueError(f"unknown call {method!r} from rank 0")


def _answer(fn: Any, control: dist.ProcessGroup) -> None:
    """Send rank 0 ``(fn(), None)``, or ``(None, error)`` if it raised."""
    import torch.distributed as dist

    reply: tuple[Any, str | None]
    try:
        reply = (fn(), None)
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it
        reply = (None, repr(exc))
    dist.gather_object(reply, None, dst=0, group=control)


def _report(fn: Any, control: dist.ProcessGroup) -> None:
    import torch.distributed as dist

    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it
        error = repr(exc)
    dist.gather_object(error, None, dst=0, group=control)


def main(argv: list[str] | None = None) -> None:
    rank_arg, port, model_dir, cfg_json, instance_arg = sys.argv[1:] if argv is None else argv
    rank, instance = int(rank_arg), int(instance_arg)
    cfg = EngineConfig(**json.loads(cfg_json))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    die_with_parent(signal.SIGKILL)  # nothing of a rank is worth saving once rank 0 is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cfg.device == "cpu":  # before torch loads
        cpus = rank_cpus(cfg.cpu_threads_bind, None if instance < 0 else instance, rank, cfg.tensor_parallel_size)
        pin_compute_threads(cpus, rank_threads(cfg.cpu_threads, cpus, cfg.tensor_parallel_size))
    import torch

    from memserve.workers.model_runner import ModelRunner
    from memserve.workers.tensor_parallel_group import join_group

    tp, control = join_group(rank, cfg.tensor_parallel_size, int(port), torch.device(cfg.rank_device(rank)))
    serve(ModelRunner(cfg, Path(model_dir), tp=tp), control)


if __name__ == "__main__":
    main()
