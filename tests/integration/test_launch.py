"""parity.harness.launch: real rank processes on gloo, and what happens when ranks fail.

Most failure tests use the "forkserver" start method: after the first launch in a test process a
rank starts in ~0.1 s instead of ~1-2 s, and the failure handling is the same code. The default
"spawn" method is covered by the basic launches, one failure test and the parent-death test.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parity.distributed.determinism import CPU_PINS, DeterminismError, openblas_coretype
from parity.distributed.pins import LOAD_ENV
from parity.harness import launch as launch_module
from parity.harness.forkserver import FORK_MAX_CPUS, usable_cpus
from parity.harness.launch import LaunchConfig, RankFailure, free_port, launch

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parents[1]


# ---------------------------------------------------------------------------------------------
# Rank functions (top level, so they pickle by reference)
# ---------------------------------------------------------------------------------------------


def _sum_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1) * scale])
    dist.all_reduce(t)
    print(f"hello from rank {ctx.rank}")
    print(f"last words of rank {ctx.rank}", end="")  # no newline: written, prefixed, as the rank exits
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "sum": t.item(),
        "pid": os.getpid(),
        "device": str(ctx.device),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "nccl_algo": os.environ.get("NCCL_ALGO"),
        "extra": os.environ.get("PARITY_TEST_EXTRA"),
        "applied": ctx.determinism["env"]["CUBLAS_WORKSPACE_CONFIG"],
        "launcher": ctx.launcher,
        "openblas": openblas_coretype(),
        "start_env_blas": _start_env().get("OPENBLAS_CORETYPE"),
        "start_env_blas_threads": _start_env().get("OPENBLAS_NUM_THREADS"),
        "blas_workers": _anonymous_native_threads(),
    }


def _anonymous_native_threads() -> int:
    """This process's threads that Python does not know and that carry the main thread's name:
    OpenBLAS's pool workers (gloo's and torch's own threads are named)."""
    import threading

    known = {t.native_id for t in threading.enumerate()}
    main = Path("/proc/self/comm").read_text()
    return sum(1 for tid in os.listdir("/proc/self/task")
               if int(tid) not in known and Path(f"/proc/self/task/{tid}/comm").read_text() == main)


def _start_env() -> dict[str, str]:
    """The environment this process's image started with (a forkserver rank: its server's), which
    is what OpenBLAS read when numpy loaded; os.environ may have changed since."""
    raw = Path("/proc/self/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def _page_faults_of_reused_memory(ctx):
    """The fewest minor page faults of five rounds that make and free tensors of 1-4 MiB, after two
    warm-up rounds (a forked rank's heap takes more than one to settle, and now and then another
    allocation in between moves a round's tensors to fresh pages), and how many objects the
    garbage collector skips (frozen at start)."""
    import gc
    import resource

    def faults_of_a_round():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for n in (1 << 20, 3 << 19, 1 << 19, 1 << 18):
            ts = [torch.ones(n) for _ in range(8)]
            del ts
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    rounds = [faults_of_a_round() for _ in range(7)][2:]
    return {"faults": min(rounds), "rounds": rounds, "frozen": gc.get_freeze_count()}


def _rank1_segfaults(ctx):
    if ctx.rank == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.barrier()


def _rank1_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 1 never joins
    return ctx.rank


def _rank1_exits_mid_collective(ctx):
    if ctx.rank == 1:
        time.sleep(0.3)  # let the others enter the collective first
        os._exit(7)
    t = torch.ones(1)
    dist.all_reduce(t)
    return ctx.rank


def _rank1_hangs(ctx):
    """Rank 1 hangs; rank 0 returns at once (the launcher's start-up barrier keeps it from exiting
    while rank 1 is still connecting)."""
    if ctx.rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # forces the SIGKILL path
        while True:
            time.sleep(1)
    return ctx.rank


def _rank0_tidies_up_when_stopped(ctx, out_dir):
    """Rank 0 takes a moment to tidy up on SIGTERM, then dies of it; rank 1 fails once it has."""
    armed = Path(out_dir, "armed")
    if ctx.rank == 0:
        def tidy(*_):
            time.sleep(0.5)
            Path(out_dir, "tidied").write_text("yes")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        signal.signal(signal.SIGTERM, tidy)
        armed.write_text("yes")
        while True:
            time.sleep(0.05)
    while not armed.exists():
        time.sleep(0.05)
    raise ValueError("boom from rank one")


class _ExitsWhereUnpickled:
    """An argument that ends the process that unpickles it: a rank, before its process group."""

    def __reduce__(self):
        return (os._exit, (9,))


def _a_large_result(ctx):
    return bytes([ctx.rank]) * (4 << 20)


def _unpicklable_result(ctx):
    return (lambda: None) if ctx.rank == 0 else ctx.rank


def _write_pid_and_hang(ctx, out_dir):
    Path(out_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _assert_no_orphans(pids):
    assert multiprocessing.active_children() == []
    alive = [pid for pid in pids if not _gone(pid)]
    assert alive == [], f"rank processes still alive: {alive}"


def _launch_expecting_failure(fn, cfg, *args):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(fn, cfg, *args)
    return info.value, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# Successful runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size,start_method",
    # 4 spawned ranks import torch 4 times: ~5 s on 2 idle cores, hence slow
    [(2, "spawn"), pytest.param(4, "spawn", marks=[pytest.mark.slow, pytest.mark.ranks(4)]), (4, "forkserver")],
)
def test_launch_results_in_rank_order(world_size, start_method, capfd, monkeypatch):
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)  # an unpinned parent, as a pytest worker is
    cfg = LaunchConfig(
        world_size=world_size, start_method=start_method, deadline_s=120, env={"PARITY_TEST_EXTRA": "yes"}
    )
    results = launch(_sum_ranks, cfg, 2.0)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    for r in results:
        assert r["world_size"] == world_size and r["sum"] == expected_sum
        assert r["device"] == "cpu"
        assert r["deterministic"] is True and r["threads"] == 1
        assert r["nccl_algo"] == "Ring" and r["applied"] == ":4096:8"
        assert r["extra"] == "yes" and r["launcher"] == start_method
        if "OPENBLAS_CORETYPE" in CPU_PINS:  # the rank's process started pinned, and OpenBLAS runs the pin
            assert r["start_env_blas"] == r["openblas"] == CPU_PINS["OPENBLAS_CORETYPE"], r
        # numpy's OpenBLAS loaded with one thread: a pool sized to the host would start workers
        # again when the rank limits it to one, and their idle spin costs CPU (pins.LOAD_ENV)
        assert (r["start_env_blas_threads"], r["blas_workers"]) == ("1", 0), r
    _assert_no_orphans([r["pid"] for r in results])
    out = capfd.readouterr().out
    for rank in range(world_size):
        assert f"[rank {rank}] hello from rank {rank}\n" in out
        assert f"[rank {rank}] last words of rank {rank}\n" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("on", [True, False])
def test_cpu_ranks_reuse_freed_memory_and_freeze_their_start_up_objects(on):
    """A rank reuses the memory it freed: no page is faulted in again (with glibc's defaults the
    same round of tensors faults thousands of pages in afresh each time). And the ~170k objects a
    rank starts with are frozen: the garbage collector does not walk them."""
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=120,
                       retain_freed_memory=on, freeze_start_objects=on)
    results = launch(_page_faults_of_reused_memory, cfg)
    assert len(results) == 2
    for r in results:
        if on:
            assert r["faults"] < 100 and r["frozen"] > 50_000, r
        else:  # what the checks above would see without the settings
            assert r["faults"] > 2_000 and r["frozen"] < 50_000, r  # (a forkserver may freeze a few)


# ---------------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------------


def test_a_rank_killed_by_sigsegv_prints_where(capfd):
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=120, grace_s=2)
    failure, _ = _launch_expecting_failure(_rank1_segfaults, cfg)
    assert failure.rank == 1 and "SIGSEGV" in str(failure), str(failure)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "_rank1_segfaults" in err, err[-2000:]
    # the crashing thread's stack alone: not the rank's other threads (its parent watch), whose
    # frames may be moving under the handler (docs/spec/platform.md s1.3)
    assert "Stack (most recent call first)" in err and "Thread 0x" not in err, err[-2000:]


@pytest.mark.parametrize("start_method,world_size", [("spawn", 2), ("forkserver", 3)])
def test_rank_that_raises(start_method, world_size, capfd):
    # a long grace: the peers die of the SIGTERM at once, and the launcher must not wait it out
    cfg = LaunchConfig(world_size=world_size, start_method=start_method, deadline_s=120, grace_s=90)
    failure, elapsed = _launch_expecting_failure(_rank1_raises, cfg)
    assert failure.exit_code == 3 and failure.rank == 1
    message = str(failure)
    assert message.startswith("rank 1 failed: raised ValueError: boom from rank one")
    assert "_rank1_raises" in message  # the rank's traceback, as text
    assert failure.failures[0].error == "ValueError: boom from rank one"
    # the peers blocked in all_reduce were stopped, not waited for (nor the grace period after)
    assert set(failure.stopped) | {f.rank for f in failure.failures} == set(range(world_size))
    assert elapsed < 60
    _assert_no_orphans(failure.pids.values())
    assert "Traceback" not in capfd.readouterr().err  # neither the rank nor the parent printed one


def test_stopped_ranks_get_their_grace_period(tmp_path):
    """SIGTERM first, SIGKILL only for a rank still there after grace_s: a rank that tidies up
    on SIGTERM gets to finish."""
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=120, grace_s=30)
    failure, _ = _launch_expecting_failure(_rank0_tidies_up_when_stopped, cfg, str(tmp_path))
    assert failure.rank == 1 and failure.stopped == [0]
    assert (tmp_path / "tidied").read_text() == "yes"


def test_rank_that_exits_mid_collective():
    cfg = LaunchConfig(world_size=3, start_method="forkserver", deadline_s=120, grace_s=2)
    failure, elapsed = _launch_expecting_failure(_rank1_exits_mid_collective, cfg)
    assert failure.rank == 1 and failure.failures[0].exitcode == 7
    assert str(failure).startswith("rank 1 failed: exited with code 7\n")  # once running: no "start-up"
    assert elapsed < 30
    _assert_no_orphans(failure.pids.values())


def test_a_rank_that_dies_before_its_process_group_is_said_to_have_died_starting():
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=120, grace_s=2)
    failure, _ = _launch_expecting_failure(_sum_ranks, cfg, _ExitsWhereUnpickled())
    assert failure.failures[0].exitcode == 9
    assert str(failure).startswith(f"rank {failure.rank} failed: exited with code 9 during start-up "
                                   "(before init_process_group returned)"), str(failure)
    _assert_no_orphans(failure.pids.values())


def test_hung_rank_is_ended_by_the_watchdog():
    deadline, grace = 3.0, 0.5
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=deadline, grace_s=grace)
    failure, elapsed = _launch_expecting_failure(_rank1_hangs, cfg)
    assert failure.exit_code == 3
    hung = {f.rank: f for f in failure.failures}
    assert 1 in hung and "did not finish within deadline_s=3.0 s" in hung[1].reason
    assert hung[1].exitcode is None and hung[1].error is None
    assert "rank 1" in str(failure)
    assert elapsed < 30  # ended by the watchdog, not left hanging (start-up included: slow on a busy machine)
    _assert_no_orphans(failure.pids.values())  # rank 1 ignored SIGTERM: it took SIGKILL


def test_a_result_larger_than_a_pipe_holds_comes_back():
    """A rank's result goes through a pipe (64 KiB on Linux): the launcher reads it while the rank
    runs, or the rank blocks in its send until the deadline. A scenario's result is larger than
    that once it has a few steps of digests."""
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=60)
    assert launch(_a_large_result, cfg) == [bytes([0]) * (4 << 20), bytes([1]) * (4 << 20)]


def test_unpicklable_result_is_a_rank_failure():
    cfg = LaunchConfig(world_size=2, start_method="forkserver", deadline_s=120)
    failure, _ = _launch_expecting_failure(_unpicklable_result, cfg)
    assert failure.rank == 0 and "not picklable" in str(failure)
    _assert_no_orphans(failure.pids.values())


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_ranks_die_with_their_parent(start_method, tmp_path):
    """SIGKILL the launching process: its ranks must not outlive it."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(TESTS_DIR)!r}]
        from parity.harness.launch import LaunchConfig, launch
        from test_launch import _write_pid_and_hang
        if __name__ == "__main__":
            launch(_write_pid_and_hang, LaunchConfig(world_size=2, start_method={start_method!r}), {str(tmp_path)!r})
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)])
    try:
        end = time.monotonic() + 180  # a bound on start-up, generous for a loaded 2-core machine
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert parent.poll() is None, "launching process ended early"
            assert time.monotonic() < end, "ranks did not start"
            time.sleep(0.1)
        time.sleep(0.2)  # let both files be complete
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    finally:
        parent.kill()
        parent.wait()
    end = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), f"orphaned ranks: {[p for p in pids if not _gone(p)]}"


def test_cause_first_ordering():
    """Events seen together: a silent death outranks the peer errors it caused; raisers by time."""
    from parity.harness.launch import _Monitor

    mon = _Monitor(world_size=4)
    mon.errors[0] = ("RuntimeError: Connection closed by peer", "tb0", 200.0)
    mon.fail(0, None)
    mon.errors[3] = ("ValueError: first", "tb3", 100.0)
    mon.fail(3, None)
    mon.fail(1, 7)
    mon.cause_first()
    assert [f.rank for f in mon.failures] == [1, 3, 0]
    assert mon.failures[0].reason == "exited with code 7"
    assert mon.failures[1].reason == "raised ValueError: first"
    mon.deadline_missed.add(2)
    mon.fail(2, None, "did not finish within deadline_s=1 s")
    mon.cause_first()
    assert [f.rank for f in mon.failures] == [2, 1, 3, 0]


# ---------------------------------------------------------------------------------------------
# Refusals before anything starts, configuration, torchrun
# ---------------------------------------------------------------------------------------------


def test_nondeterministic_env_refused_before_spawning():
    with pytest.raises(DeterminismError, match="NCCL_ALGO='Tree'") as info:
        launch(_sum_ranks, LaunchConfig(world_size=2, env={"NCCL_ALGO": "Tree"}), 1.0)
    assert info.value.exit_code == 2
    assert multiprocessing.active_children() == []


def test_unpicklable_fn_refused_before_spawning():
    with pytest.raises(TypeError, match="picklable"):
        launch(lambda ctx: None, LaunchConfig(world_size=2))
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"world_size": 0}, "world_size"),
        ({"backend": "mpi"}, "backend"),
        ({"device": "tpu"}, "device"),
        ({"backend": "nccl", "device": "cpu"}, "nccl"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"grace_s": -1}, "grace_s"),
        ({"master_port": 70000}, "master_port"),
        ({"env": {"A": 1}}, "env"),
        ({"start_method": "fork"}, "start_method"),
        ({"num_threads": 0}, "num_threads"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(**kwargs)


@pytest.mark.parametrize("gpus,backend,local_ranks,want", [
    (2, "nccl", 2, ["cuda:0", "cuda:1"]),
    (1, "nccl", 2, "nccl needs one GPU per rank: 2 local ranks, 1 GPU(s) visible"),
    (1, "gloo", 2, ["cuda:0", "cuda:0"]),  # gloo may share a GPU
    (3, "nccl", 2, ["cuda:0", "cuda:1"]),
    (0, "nccl", 1, "no CUDA device is visible"),
])
def test_each_local_rank_gets_its_own_gpu_where_nccl_needs_one(monkeypatch, gpus, backend, local_ranks, want):
    """A CUDA rank's device, decided in the rank before its process group (any host: the GPU count
    is stood in for). NCCL refuses two ranks on one GPU, so too few GPUs is one clear error at the
    start, not a hang in the first collective."""
    from parity.harness import launch as launch_mod

    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(str(d)))
    cfg = LaunchConfig(world_size=local_ranks, device="cuda", backend=backend)
    if isinstance(want, str):
        with pytest.raises(RuntimeError, match=re.escape(want)):
            launch_mod._rank_device(cfg, 0, local_ranks)
        return
    got = [str(launch_mod._rank_device(cfg, r, local_ranks)) for r in range(local_ranks)]
    assert got == want and current == want  # and made current, for the kernels the rank launches


def test_a_ranks_last_partial_line_is_flushed_before_it_exits():
    """A rank ends with os._exit, which flushes nothing: its streams' buffers must be empty by then
    (a rank's stdout to a pipe or file is block-buffered where PYTHONUNBUFFERED is not set)."""
    import io

    from parity.harness.launch import _PrefixedStream

    raw = io.BytesIO()
    stream = _PrefixedStream(io.TextIOWrapper(raw, encoding="utf-8", write_through=False), "[rank 3] ")
    stream.write("done\nno newline")
    stream.close_partial()
    assert raw.getvalue() == b"[rank 3] done\n[rank 3] no newline\n"


def test_free_port():
    port = free_port()
    with socket.socket() as s:  # free: a store can listen on it
        s.bind(("127.0.0.1", port))
        s.listen(1)


def test_free_port_stays_out_of_the_ports_the_kernel_hands_out(tmp_path, monkeypatch):
    # the ports gloo and the stores take by bind(0) and connect() come from the ephemeral range: a
    # port chosen there for a later server was taken meanwhile in a CI run
    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(launch_module, "_EPHEMERAL_RANGE_FILE", str(ranges))
    ranges.write_text("32768\t60999\n")
    ports = [free_port() for _ in range(20)]
    assert all(10000 <= p < 32768 for p in ports) and len(set(ports)) > 1, ports
    ranges.write_text("1024 50000")  # more room above than below
    assert all(50000 < free_port() <= 65535 for _ in range(20))
    for text in ("10000 65535", None):  # no room outside, or no range to read: a port bind(0) gives
        if text is None:
            ranges.unlink()
        else:
            ranges.write_text(text)
        port = free_port()
        assert port > 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_passes_over_a_port_in_use(tmp_path, monkeypatch):
    with socket.socket() as taken, socket.socket() as other:
        taken.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], other.getsockname()[1]
        other.close()

        class FirstTheBusyOne:  # stands in for random.Random: offers the busy port, then the free one
            def __init__(self):
                self.offered = []

            def choice(self, pool):
                self.offered.append(busy if not self.offered else free)
                return self.offered[-1]

        ranges = tmp_path / "ip_local_port_range"
        ranges.write_text("65000 65535")
        monkeypatch.setattr(launch_module, "_EPHEMERAL_RANGE_FILE", str(ranges))
        monkeypatch.setattr(launch_module.random, "Random", FirstTheBusyOne)
        assert free_port() == free != busy


def test_results_gathered_to_rank_0_under_torchrun(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, os, sys
        sys.path[:0] = [{str(REPO)!r}, {str(TESTS_DIR)!r}]
        from parity.harness.launch import LaunchConfig, launch
        from parity.harness.launch import RankFailure
        from test_launch import _rank1_raises, _sum_ranks
        if __name__ == "__main__":
            # Rank 0's torchrun worker gets every rank's result; the others get None. Two launches in
            # one job: the second must see its own ranks' results, not the first's.
            results = [launch(_sum_ranks, LaunchConfig(world_size=2), scale) for scale in (1.0, 3.0)]
            rank = int(os.environ["RANK"])
            results = None if results == [None, None] else results
            # and a third launch that fails fails on every worker (not only where the rank failed)
            try:
                launch(_rank1_raises, LaunchConfig(world_size=2, grace_s=1.0))
            except RankFailure as e:
                with open({str(tmp_path)!r} + f"/failed{{rank}}.txt", "w") as f:
                    f.write(str(e.failures[0].rank))
            with open({str(tmp_path)!r} + f"/returned{{rank}}.json", "w") as f:
                json.dump(results, f)
        """
    )
    path = tmp_path / "under_torchrun.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", str(path)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"failed{r}.txt").read_text() for r in range(2)] == ["1", "1"]
    first, second = json.loads((tmp_path / "returned0.json").read_text())
    assert json.loads((tmp_path / "returned1.json").read_text()) is None
    assert len(first) == len(second) == 2
    for results, total in ((first, 3.0), (second, 9.0)):
        for rank, result in enumerate(results):
            assert result["launcher"] == "torchrun"
            assert result["rank"] == rank and result["world_size"] == 2 and result["sum"] == total
            assert result["nccl_algo"] == "Ring" and result["threads"] == 1 and result["deterministic"] is True
        assert results[0]["pid"] != results[1]["pid"]


def test_ranks_that_save_or_load_have_the_checkpoint_code_imported_for_them():
    # torch.distributed.checkpoint costs a process 0.65 s of CPU to import: the process the ranks
    # fork from imports it once, when they will save or load, and not otherwise
    from parity.harness import driver, forkserver
    from parity.harness.runner import RunOptions
    from parity.harness.scenario import Scenario

    assert forkserver.preload(False) == forkserver.PRELOAD
    assert forkserver.preload(True) == forkserver.PRELOAD + ["parity.harness.resume"]
    s, plain = Scenario("x"), RunOptions()
    cases = {"plain": plain, "saves": dataclasses.replace(plain, save_at=1, save_to="/c"),
             "loads": dataclasses.replace(plain, load_from="/c")}
    assert {k: driver.launch_config(s, o, 60.0, False).checkpoints for k, o in cases.items()} == \
        {"plain": False, "saves": True, "loads": True}


_START_EARLY_PROBE = """
import sys
from multiprocessing import forkserver
from parity.distributed.pins import pin_before_torch
from parity.harness.forkserver import start_early
if sys.argv[1] == "pinned":
    pin_before_torch()
start_early(set(sys.argv[2].split(",")))
print(forkserver._forkserver._forkserver_pid is not None)
"""


@pytest.mark.parametrize("pinned, devices", [("unpinned", "cpu"), ("pinned", "cpu"), ("pinned", "cpu,cuda")])
def test_start_early_starts_the_server_at_once_unless_the_process_forks_its_ranks(pinned, devices):
    # a command starts the server as soon as its input is valid, so its imports run beside the
    # command's; a pinned process with few CPUs forks its CPU ranks itself and starts none
    env = {k: v for k, v in os.environ.items() if k not in LOAD_ENV}
    r = subprocess.run([sys.executable, "-c", _START_EARLY_PROBE, pinned, devices], capture_output=True, text=True,
                       timeout=60, env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    forks_itself = pinned == "pinned" and devices == "cpu" and usable_cpus() <= FORK_MAX_CPUS
    assert r.stdout.strip() == str(not forks_itself)


def _checkpoint_code_at_entry(ctx):
    return {m: m in sys.modules for m in ("parity.harness.resume", "torch.distributed.checkpoint")}


def test_ranks_forked_from_the_server_find_the_checkpoint_code_imported():
    # the server of this test process was started early with the checkpoint code (tests/conftest.py,
    # as `parity run` does for a run that saves or loads): its ranks do not import it again
    results = launch(_checkpoint_code_at_entry, LaunchConfig(world_size=2, start_method="forkserver", checkpoints=True))
    assert results == [{"parity.harness.resume": True, "torch.distributed.checkpoint": True}] * 2


def test_a_command_starts_its_server_for_the_devices_and_checkpoints_of_its_scenarios(monkeypatch):
    # `parity run` and `parity golden` start the fork server once their input is valid: on the
    # scenarios' devices, with the checkpoint code where one resumes or the run resumes from one
    from parity.harness import forkserver
    from parity.harness.scenario import Scenario

    calls = []
    monkeypatch.setattr(forkserver, "start_early", lambda devices, checkpoints: calls.append((devices, checkpoints)))
    plain, resumes = Scenario("p"), Scenario("r", resume_at=2, steps=4)
    gpu = dataclasses.replace(plain, device="cuda")
    forkserver.start_early_for([plain, gpu])
    forkserver.start_early_for([plain, resumes])
    forkserver.start_early_for([plain], resume_from=True)
    assert calls == [({"cpu", "cuda"}, False), ({"cpu"}, True), ({"cpu"}, True)]
