"""A process that must not outlive its parent: the worker its gateway, a tensor-parallel
rank its worker (rank 0)."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send us ``signum`` when our parent dies, even by SIGKILL
    (PR_SET_PDEATHSIG); nothing where that cannot be asked."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)
    except OSError:
        pass
