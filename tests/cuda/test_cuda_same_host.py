"""Same-host KV transfers on one GPU (skipped without one; ``scripts/gpu_check`` runs it):
two processes, the receiver mapping the sender's device pool by CUDA IPC handle, the same
code the CPU suite runs over shared memory (``tests/ipc/test_same_host_transfer.py``). By
layer and by request the KV arrives bit for bit, and the receiver's greedy tokens over it
equal those over ZeroMQ frames."""

from __future__ import annotations

import pytest
import torch
from helpers.same_host_engines import send_both_ways

from memserve.testing.random_models import save_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_kv_moved_by_cuda_ipc_is_bit_exact_and_decodes_as_over_zeromq(tmp_path):
    save_tiny_model(tmp_path, "llama")
    send_both_ways(tmp_path, "cuda")
