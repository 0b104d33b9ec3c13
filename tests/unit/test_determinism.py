"""parity.distributed.determinism: the fail-closed validator and apply_determinism (no processes)."""

from __future__ import annotations

import pytest
import torch

from parity.distributed.determinism import (
    DETERMINISM_ENV,
    DeterminismError,
    apply_determinism,
    empty,
    validate_determinism_env,
)


@pytest.fixture
def restore_torch_switches():
    """apply_determinism(configure_torch=True) changes process-wide state; put it back."""
    import threadpoolctl

    blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    saved_blas = blas.info()
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.get_num_threads(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    yield
    mode, warn_only, cudnn_det, cudnn_bench, threads, fill = saved
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.backends.cudnn.benchmark = cudnn_bench
    torch.set_num_threads(threads)
    for pool, info in zip(blas.lib_controllers, saved_blas):
        pool.set_num_threads(info["num_threads"])


def test_defaults_are_valid_and_empty_env_is_valid():
    assert validate_determinism_env(DETERMINISM_ENV) == []
    assert validate_determinism_env({}) == []


@pytest.mark.parametrize(
    "algo", ["Ring", "ring", "RING", "Ring,CollnetDirect", "CollnetChain", "^NVLS", "Ring, CollnetChain"]
)
def test_accepted_nccl_algo(algo):
    assert validate_determinism_env({"NCCL_ALGO": algo}) == []


@pytest.mark.parametrize(
    "algo,why",
    [
        ("Tree", "Tree"),
        ("tree", "Tree"),
        ("Ring,Tree", "Tree"),
        ("^Tree", "unknown token"),  # "all but Tree" would allow NVLS
        ("NVLS", "unknown token"),
        ("allreduce:tree;broadcast:ring", "unknown token"),
        ("", "empty"),
        ("Ring,", "empty"),
    ],
)
def test_rejected_nccl_algo(algo, why):
    violations = validate_determinism_env({"NCCL_ALGO": algo})
    assert len(violations) == 1
    assert violations[0].startswith(f"NCCL_ALGO={algo!r}")
    assert why in violations[0]
    assert "Ring" in violations[0] and "^NVLS" in violations[0]  # lists the accepted tokens


@pytest.mark.parametrize(
    "name,bad,good",
    [
        ("NCCL_NVLS_ENABLE", "1", "0"),
        ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1", "0"),
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0", ":16:8"),
        ("CUBLAS_WORKSPACE_CONFIG", "", ":4096:8"),
    ],
)
def test_other_variables(name, bad, good):
    violations = validate_determinism_env({name: bad})
    assert len(violations) == 1 and violations[0].startswith(f"{name}={bad!r}")
    assert repr(good) in violations[0]  # names the accepted value(s)
    assert validate_determinism_env({name: good}) == []


def test_a_variable_of_the_contract_without_a_rule_of_its_own_accepts_only_its_default():
    """Fail closed: CUDA_DEVICE_MAX_CONNECTIONS (one hardware queue: kernels start in issue order)
    has no rule of its own; any other value than the contract's is a violation, not a pass."""
    assert validate_determinism_env({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == []
    assert validate_determinism_env({"CUDA_DEVICE_MAX_CONNECTIONS": " 1 "}) == []
    assert validate_determinism_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == [
        "CUDA_DEVICE_MAX_CONNECTIONS='8': accepted: '1'"]


def test_tree_is_rejected_with_a_message_naming_the_variable():
    env = {"NCCL_ALGO": "Tree"}
    with pytest.raises(DeterminismError) as info:
        apply_determinism(env, configure_torch=False)
    assert info.value.exit_code == 2
    message = str(info.value)
    assert "NCCL_ALGO='Tree'" in message and "Ring" in message
    assert env == {"NCCL_ALGO": "Tree"}  # nothing set when it refuses


def test_every_violation_is_listed():
    env = {"NCCL_ALGO": "Tree", "NCCL_NVLS_ENABLE": "1", "CUBLAS_WORKSPACE_CONFIG": ":1:1"}
    with pytest.raises(DeterminismError) as info:
        apply_determinism(env, configure_torch=False)
    for name in env:
        assert name in str(info.value)


def test_defaults_fill_only_unset_variables():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "UNRELATED": "x"}
    applied = apply_determinism(env, configure_torch=False)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # an accepted value is kept
    assert env["UNRELATED"] == "x"
    for name, value in DETERMINISM_ENV.items():
        if name != "CUBLAS_WORKSPACE_CONFIG":
            assert env[name] == value
    assert "CUBLAS_WORKSPACE_CONFIG" not in applied["set_by_default"]
    assert applied["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert applied["violations"] == [] and applied["warnings"] == []
    assert "torch" not in applied


def test_allow_nondeterministic_bypasses_with_a_warning():
    env = {"NCCL_ALGO": "Tree"}
    with pytest.warns(RuntimeWarning, match="NCCL_ALGO"):
        applied = apply_determinism(env, allow_nondeterministic=True, configure_torch=False)
    assert env["NCCL_ALGO"] == "Tree"  # left as asked
    assert env["NCCL_NVLS_ENABLE"] == "0"  # the rest still gets its default
    assert len(applied["warnings"]) == 1 and "NCCL_ALGO='Tree'" in applied["warnings"][0]
    assert applied["violations"] == validate_determinism_env({"NCCL_ALGO": "Tree"})


def test_torch_switches(restore_torch_switches):
    import threadpoolctl

    # start from the opposite of every switch, so that each one is seen to be set
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    torch.set_num_threads(2)
    threadpoolctl.threadpool_limits(2, user_api="blas")
    applied = apply_determinism({}, num_threads=1)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.get_num_threads() == 1
    assert applied["torch"]["use_deterministic_algorithms"] is True
    assert applied["torch"]["num_threads"] == 1
    assert applied["torch"]["cudnn.benchmark"] is False and applied["torch"]["cudnn.deterministic"] is True
    assert applied["torch"]["blas_threads"] and set(applied["torch"]["blas_threads"]) == {1}  # numpy's BLAS
    # every variable the contract filled in is reported as set by default
    assert set(DETERMINISM_ENV) <= set(applied["set_by_default"])
    # torch's own fill of every new tensor is off (the stack's buffers come from empty()) ...
    assert applied["torch"]["fill_uninitialized_memory"] is False
    assert torch.utils.deterministic.fill_uninitialized_memory is False


@pytest.mark.parametrize("dtype, want", [
    (torch.float32, "nan"), (torch.bfloat16, "nan"), (torch.float64, "nan"),
    (torch.uint8, 255), (torch.int32, 2**31 - 1), (torch.int64, 2**63 - 1), (torch.bool, True)])
def test_empty_fills_what_nobody_wrote_so_that_a_read_of_it_shows(restore_torch_switches, dtype, want):
    # ... and empty() fills as torch's deterministic mode would, whatever memory it is handed:
    # the allocator's reused blocks are dirtied first, so a fill that did nothing would show.
    apply_determinism({}, num_threads=1)
    for _ in range(4):
        torch.full((257, 3), False if dtype == torch.bool else 7, dtype=dtype)  # anything but `want`
    t = empty((257, 3), dtype=dtype, device="cpu")
    assert t.shape == (257, 3) and t.dtype == dtype
    if want == "nan":
        assert torch.isnan(t).all()
    else:
        assert (t == want).all()


def test_num_threads_none_leaves_thread_count(restore_torch_switches):
    before = torch.get_num_threads()
    apply_determinism({}, num_threads=None)
    assert torch.get_num_threads() == before


def test_the_contract_is_read_without_torch(monkeypatch):
    """parity.distributed.env_contract is what `parity run` checks before torch loads: it imports no
    torch, and reads torch's version from the installed metadata, as the loaded torch states it."""
    import subprocess
    import sys

    from parity.distributed import env_contract

    code = "import sys, parity.distributed.env_contract; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "False"
    from packaging.version import Version

    loaded = env_contract._torch_minor_version()
    assert loaded == Version(torch.__version__).release[:2]  # parsed independently of the module
    monkeypatch.delitem(sys.modules, "torch")
    assert env_contract._torch_minor_version() == loaded


def test_an_odd_torch_version_string_does_not_stop_the_contract():
    from parity.distributed.env_contract import _leading_pair

    assert _leading_pair("2.13.0+cpu") == (2, 13)
    assert _leading_pair("2.11.0a0+git1234") == (2, 11)
    assert _leading_pair("2.13rc1") == (2, 13)
    assert _leading_pair("2") == (2, 0)
    assert _leading_pair("main") == (0, 0)
