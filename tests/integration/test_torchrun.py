"""parity under torchrun: two torchrun agents on 127.0.0.1 stand in for two nodes.

Each agent runs ``torchrun --nnodes 2 --nproc-per-node 2`` with the c10d rendezvous, so the job has
4 ranks on 2 "nodes". The cases check what a user of a real cluster relies on: one report written
by global rank 0 and equal to the built-in launcher's for the same scenario (comparison count, first
divergence of an injected ULP, golden verdict), goldens regenerated and checked under torchrun, and
a crashed or hung rank named with its step in the report, every worker exiting 3 and no process
left behind. The scenario is small (world 4, EP 2, MoE, one layer, 2-3 steps) for 2-core CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cli_fork
import pytest
from marked_processes import assert_no_orphans, command_env, kill_marked, new_marker

from parity.harness.launch import free_port

PARITY = [sys.executable, "-m", "parity.cli"]
AGENT_TIMEOUT_S = 300

TINY4 = Path(__file__).parents[1] / "assets" / "tiny4.toml"


class Agents:
    """The result of two torchrun agents run to their end."""

    def __init__(self, returncodes: list[int], outputs: list[str]):
        self.returncodes = returncodes
        self.outputs = outputs

    def assert_every_worker_exited_with(self, code: int) -> None:
        """Every worker torchrun reports exited with ``code``, and every agent reported its workers,
        except an agent that lost the rendezvous store: the agent serving it ends when its own
        workers end, and another agent still watching its workers then fails in torchrun itself,
        before printing their codes (a race between two torchrun agents, not in parity)."""
        pattern = r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)"
        per_agent = [dict(re.findall(pattern, out)) for out in self.outputs]
        assert all(set(c.values()) <= {str(code)} for c in per_agent), self.text()
        lost = [not c and "RendezvousConnectionError" in out for c, out in zip(per_agent, self.outputs)]
        assert not all(lost), self.text()  # the agent serving the store always reports
        for c, gone in zip(per_agent, lost):
            assert gone or len(c) == 2, self.text()  # --nproc-per-node 2

    def text(self) -> str:
        return "\n".join(f"--- agent {n} (exit {rc})\n{out[-6000:]}"
                         for n, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))


def run_agents(*args, timeout_s: float = AGENT_TIMEOUT_S) -> Agents:
    """``torchrun --nnodes 2 --node-rank n --nproc-per-node 2 ... -m parity.cli ARGS`` for n = 0, 1,
    c10d rendezvous on a free port of 127.0.0.1; killed (with everything they started) on timeout."""
    marker = new_marker()
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", marker, "--max-restarts", "0", "-m", "parity.cli", *[str(a) for a in args]]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=command_env(marker)))
        end = time.monotonic() + timeout_s
        outputs = [p.communicate(timeout=max(1.0, end - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        kill_marked(marker)
        for p in procs:
            p.communicate()
        raise AssertionError(f"torchrun agents did not finish within {timeout_s} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert_no_orphans(marker, within_s=20.0)
    return Agents([p.returncode for p in procs], outputs)


def _worker_tracebacks(agents: Agents) -> list[str]:
    """Tracebacks in the agents' output other than torchrun's own (its ChildFailedError)."""
    blocks = []
    for out in agents.outputs:
        for block in out.split("Traceback (most recent call last):")[1:]:
            if "ChildFailedError" not in block.split("\n\n")[0]:
                blocks.append(block[:2000])
    return blocks


def parity(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command with the built-in launcher (no torchrun), forked by tests/cli_fork.py's server."""
    return cli_fork.run(args, env=command_env(), timeout=timeout)


@pytest.fixture
def tiny4(tmp_path) -> Path:
    path = tmp_path / "tiny4.toml"
    path.write_text(TINY4.read_text())
    return path


def _entry(out: Path) -> dict:
    (entry,) = json.loads((out / "report.json").read_text())["scenarios"]
    return entry


# ---------------------------------------------------------------------------------------------
# one report, equal to the built-in launcher's; goldens under torchrun
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_aggregated_report_and_goldens_match_the_built_in_launcher(tmp_path, tiny4):
    goldens = tmp_path / "goldens"
    # Goldens recorded under torchrun: rank 0 alone writes them, from every rank's records.
    regen = run_agents("golden", "regen", tiny4, "--accept", "--goldens", goldens)
    assert regen.returncodes == [0, 0], regen.text()
    assert "tiny4: golden created" in regen.outputs[0] and "golden created" not in regen.outputs[1]
    (manifest,) = goldens.glob("tiny4/*/manifest.json")
    # ... the same goldens the built-in launcher's run agrees with.
    r = parity("golden", "check", tiny4, "--goldens", goldens)
    assert r.returncode == 0 and "tiny4: golden pass" in r.stdout, r.stdout + r.stderr

    # One ULP injected at step 1: a parity failure and a golden failure, by both launchers. The
    # golden check under torchrun is shown here too, with no job of its own: its messages must
    # equal the built-in launcher's, which name step 1 as the first difference and count the
    # records that differ, so a torchrun check that compared wrongly (step 0 included) fails them.
    args = [tiny4, "--golden", "check", "--goldens", goldens, "--inject", "ulp:1:grad_reduce:*"]
    tr_out, bi_out = tmp_path / "torchrun", tmp_path / "builtin"
    tr = run_agents("run", *args, "--out", tr_out, "--junit", tmp_path / "torchrun.xml")
    bi = parity("run", *args, "--out", bi_out, "--junit", tmp_path / "builtin.xml")
    assert bi.returncode == 1, bi.stdout + bi.stderr
    # torchrun exits 1 when a worker fails; every worker exited with parity's code for a mismatch.
    assert tr.returncodes == [1, 1], tr.text()
    tr.assert_every_worker_exited_with(1)

    t, b = _entry(tr_out), _entry(bi_out)
    assert t["compared"] == b["compared"] > 0
    assert t["compared_by_phase"] == b["compared_by_phase"]
    assert t["first_divergence"] == b["first_divergence"]
    fd = t["first_divergence"]
    assert (fd["step"], fd["phase"], fd["max_ulp"], fd["n_diff"]) == (1, "grad_reduce", 1, 1)
    assert t["divergence_table"] == b["divergence_table"]
    assert (t["status"], t["golden"]) == (b["status"], b["golden"]) == ("fail", "fail")
    assert t["golden_messages"] == b["golden_messages"]
    assert "first difference at step 1 / grad_reduce" in b["golden_messages"][0], b["golden_messages"]
    assert t["loss"] == b["loss"]
    assert set(t["hosts"]) == {"0", "1", "2", "3"}

    # Written once, by rank 0: progress and verdict lines come from agent 0 only.
    assert "[parity] tiny4: FAIL" in tr.outputs[0] and "[parity]" not in tr.outputs[1], tr.text()
    assert tr.outputs[0].count("[parity] fail: 0/1 scenarios passed") == 1
    assert "<testsuite" in (tmp_path / "torchrun.xml").read_text()
    (row,) = [r for r in (tr_out / "summary.md").read_text().splitlines() if r.startswith("| tiny4 |")]
    assert row.split("|")[4].strip() == str(b["compared"])
    # Every rank wrote its own snapshot files; the index written by rank 0 lists them all.
    index = json.loads((tr_out / "snapshots" / "index.json").read_text())["scenarios"][t["name"]]
    assert {f["rank"] for f in index if f["step"] == 1} == {0, 1, 2, 3}
    for f in index:
        assert (tr_out / f["file"]).is_file()
    assert sorted(p.name for p in (tr_out / "snapshots").rglob("*.safetensors")) == \
        sorted(p.name for p in (bi_out / "snapshots").rglob("*.safetensors"))


# ---------------------------------------------------------------------------------------------
# a rank that crashes or hangs: exit 3 on every worker, the rank and step in the report
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("inject, rank, kind, timeout_s", [
    ("crash:3:1", 3, "crash", 30),  # a rank on the other node than rank 0 dies
    ("hang:0:1", 0, "hang", 6),    # rank 0 itself stops answering: its supervisor still reports
])
def test_rank_failure_ends_the_job_with_exit_3(tmp_path, tiny4, inject, rank, kind, timeout_s):
    out = tmp_path / "out"
    t0 = time.time()
    agents = run_agents("run", tiny4, "--steps", "2", "--inject", inject, "--timeout", timeout_s, "--out", out)
    assert agents.returncodes == [1, 1], agents.text()
    agents.assert_every_worker_exited_with(3)
    assert not _worker_tracebacks(agents), agents.text()
    e = _entry(out)
    assert json.loads((out / "report.json").read_text())["status"] == "error"
    f = e["failure"]
    assert (f["rank"], f["step"], f["kind"]) == (rank, 1, kind), f
    assert f"rank {rank} failed at step 1" in e["error"]
    assert f"rank {rank} failed at step 1" in agents.outputs[0]
    assert time.time() - f["heartbeats"][str(rank)]["t"] < timeout_s + 60
    assert f["heartbeats"][str(rank)]["t"] >= t0


# ---------------------------------------------------------------------------------------------
# refusals (no torchrun agent needed: a worker's environment is enough)
# ---------------------------------------------------------------------------------------------


def _as_worker(extra: dict) -> dict:
    env = command_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", **extra)
    return env


@pytest.mark.parametrize("command", [["run", "--steps", "1"], ["golden", "check", "default"]])
def test_max_restarts_above_zero_is_refused_before_torch_loads(command):
    r = cli_fork.run_fresh_noting_torch(command, env=_as_worker({"TORCHELASTIC_MAX_RESTARTS": "2"}))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "no torch" in r.stdout
    assert "torchrun --max-restarts 2" in r.stderr and "--max-restarts 0" in r.stderr


def test_world_other_than_torchruns_is_refused(tiny4):
    # One worker (rank 0 serves the store, as env:// does without torchrun's agent store).
    r = subprocess.run(PARITY + ["run", str(tiny4)], capture_output=True, text=True, timeout=120,
                       env=_as_worker({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "world 4, but torchrun started 1 ranks" in r.stderr and "--world 1" in r.stderr


# ---------------------------------------------------------------------------------------------
# how a supervisor starts its rank
# ---------------------------------------------------------------------------------------------

_START_METHOD_PROBE = """
import os, sys
from parity.distributed.pins import pin_before_torch
if sys.argv[1] == "pinned":
    pin_before_torch()
from parity.harness import driver  # what `parity run` imports before it launches
from parity.harness import forkserver
from parity.harness.launch import LaunchConfig, _start_method, _single_threaded
forkserver.usable_cpus = lambda: int(sys.argv[2])  # a machine with that many CPUs
cpu = LaunchConfig(world_size=1, start_method="forkserver")
cuda = LaunchConfig(world_size=1, start_method="forkserver", device="cuda")
print(_start_method(cpu, "torchrun"), _start_method(cpu, "forkserver"), _start_method(cuda, "forkserver"),
      _single_threaded(), os.environ.get("ATEN_CPU_CAPABILITY"))
"""


@pytest.mark.parametrize("pinned, cpus, want", [("pinned", 2, "fork fork forkserver True avx2"),
                                                ("pinned", 16, "fork forkserver forkserver True avx2"),
                                                ("unpinned", 2, "forkserver forkserver forkserver")])
def test_a_pinned_single_threaded_process_forks_its_ranks(pinned, cpus, want):
    """The CLI pins itself (a torchrun supervisor too) before torch loads; it then runs one thread
    after importing the stack. A torchrun supervisor forks its rank instead of starting a fork
    server that imports it all again; so does the built-in launcher for CPU ranks on a machine with
    few CPUs (with more, the server started early imports beside the command), never for CUDA
    ranks. Not pinned (a library caller), it uses the fork server: its kernels may not be the
    pinned ones, and a fork would pass them on."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR",
                                                            "OPENBLAS_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", _START_METHOD_PROBE, pinned, str(cpus)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(want), r.stdout
