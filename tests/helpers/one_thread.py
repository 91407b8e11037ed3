"""Tiny models on one intra-op thread: on a shared 2-core machine a second OpenMP thread
only makes them wait at barriers. Import the fixture into a test module to apply it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
