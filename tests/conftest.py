import os
import socket

import pytest
import torch
import torch.distributed as dist


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def single_rank():
    """A real gloo process group of world 1 in this test process (for single-rank stacks)."""
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        torch.set_num_threads(1)
    yield


@pytest.fixture
def one_intra_op_thread():
    """Small tensors: one intra-op thread is much faster, above all with xdist workers on 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
