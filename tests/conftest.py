import fcntl
import os

import pytest
import threadpoolctl
import torch
import torch.distributed as dist

from parity.harness.forkserver import start_early, usable_cpus

# Every test process computes on one thread, as every rank does (parity.distributed.determinism):
# the two xdist workers share 2 CPUs, and an idle pool thread of torch's OpenMP or of numpy's
# OpenBLAS spins on a CPU the other worker needs. Measured: the 133 in-process tests under -n 2
# took 118 s and 233 CPU-s with the default pools, 35 s and 67 CPU-s with these (docs/measurements.md,
# twentieth session).
torch.set_num_threads(1)
threadpoolctl.threadpool_limits(1, user_api="blas")


@pytest.fixture(scope="session")
def single_rank():
    """A real gloo process group of world 1 in this test process (for single-rank stacks).

    Its store lives in this process: no MASTER_ADDR/MASTER_PORT in os.environ, which every later
    command of tests/cli_fork.py would inherit and, as variables torch.distributed reads, be run in a
    fresh interpreter for (39 commands of the suite were, 15 of them importing torch at about 0.9 CPU-s
    each)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


@pytest.fixture(scope="session", autouse=True)
def _fork_server_with_the_checkpoint_code():
    """The fork server of this test process (the ranks of the scenarios tests run in-process fork
    from it) imports the checkpoint code once. Many of those ranks save or load a checkpoint, and a
    server first started by a launch that does neither leaves each of them to import it: 0.65 s of
    CPU apiece, 105 ranks in the checkpointing tests (docs/measurements.md, forty-fourth session)."""
    start_early(checkpoints=True)
    yield


@pytest.fixture
def umask() -> int:
    """This process's umask (read by setting it: no other thread of a test process creates files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.fixture(autouse=True)
def _one_cpu_filling_test_at_a_time(request, tmp_path_factory):
    """Under xdist, a test whose ranks fill the CPUs (marked ``ranks(n)``, n at least the CPUs this
    process may use) holds a lock shared by the workers while it runs: two of them at once put
    twice the ranks on the CPUs, and cost more CPU than one after the other (the scenario matrix on
    2 CPUs: 282 busy CPU-s under -n 2, 252 one test at a time; docs/measurements.md, twenty-third
    session). The other worker meanwhile runs the tests that leave a CPU free."""
    marker = request.node.get_closest_marker("ranks")
    if "PYTEST_XDIST_WORKER" not in os.environ or marker is None or marker.args[0] < usable_cpus():
        yield
        return
    # the parent of a worker's base temp is the run's, shared by its workers
    with open(tmp_path_factory.getbasetemp().parent / "cpu-filling-tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


# Tests whose ranks fill the CPUs (see above) first, the one-process tests next, then the torchrun
# cases and every other multi-rank (`slow`) case. With `--dist worksteal` (set below when -n is
# given) each xdist worker takes half of this list and an idle worker steals the back half of the
# other's queue: one worker starts on the CPU-filling tests, which run one at a time anyway, while
# the other runs the one-process tests and the multi-rank ones that leave a CPU free (a torchrun
# job's agents, a rank waiting out a timeout); the short ones fill in at the end.
def pytest_collection_modifyitems(config, items):
    cpus = usable_cpus()

    def rank(item):
        marker = item.get_closest_marker("ranks")
        if marker is not None and marker.args[0] >= cpus:
            return 0
        if not item.get_closest_marker("slow"):
            return 1
        return 2 if item.path.name == "test_torchrun.py" else 3

    items[:] = [item for _, item in sorted(enumerate(items), key=lambda p: (rank(p[1]), p[0]))]


def pytest_configure(config):
    """`-n N` alone means `--dist load`; make it worksteal (see above), unless --dist was given.
    Set here, not in addopts, so that pytest without pytest-xdist (a GPU host's own) still runs."""
    explicit = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if not explicit and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "worksteal"
