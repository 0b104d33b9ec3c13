import os
import socket

import pytest
import threadpoolctl
import torch
import torch.distributed as dist

# Every test process computes on one thread, as every rank does (parity.distributed.determinism):
# the two xdist workers share 2 CPUs, and an idle pool thread of torch's OpenMP or of numpy's
# OpenBLAS spins on a CPU the other worker needs. Measured: the 133 in-process tests under -n 2
# took 118 s and 233 CPU-s with the default pools, 35 s and 67 CPU-s with these (docs/measurements.md,
# twentieth session).
torch.set_num_threads(1)
threadpoolctl.threadpool_limits(1, user_api="blas")


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
    yield


# The suite's longest single test first, then every other multi-rank (`slow`) case, the unit tests
# last. With `--dist worksteal` (set below when -n is given) each xdist worker takes half of this list and an
# idle worker steals the back half of the other's queue: the long cases start early and the short
# ones fill in at the end. xdist's default `load` mode hands out fixed chunks: in file order a
# worker was left alone with the torchrun cases for the last minute, and in this order with the
# scenario cases for five (docs/measurements.md, eighth session).
def pytest_collection_modifyitems(config, items):
    def rank(item):
        if item.path.name == "test_torchrun.py":
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items[:] = [item for _, item in sorted(enumerate(items), key=lambda p: (rank(p[1]), p[0]))]


def pytest_configure(config):
    """`-n N` alone means `--dist load`; make it worksteal (see above), unless --dist was given.
    Set here, not in addopts, so that pytest without pytest-xdist (a GPU host's own) still runs."""
    explicit = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if not explicit and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "worksteal"
