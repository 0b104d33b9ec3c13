"""How long `parity triage` takes, and how much memory, on a run whose drift has spread, as numbers.

Makes (or reuses) a run of a mid-sized MoE scenario on 2 CPU ranks with one FP8 byte of the synced
params bumped at step 1, so nearly every tensor of the later steps differs, saved with
``--snapshot all``, and the golden of its clean configuration. Then times, each in a fresh process
(wall seconds and peak resident memory from the OS), the two triages a user runs on it:
``parity triage RUN`` (the run's own divergences, made exact from the snapshots) and ``parity
triage RUN --against golden``. Prints the run's snapshot size alongside.

    python tools/bench_triage.py                 # in a temporary directory (about 2 minutes to set up)
    python tools/bench_triage.py --keep DIR      # make the run in DIR once, then reuse it
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIO = """\
name = "triage-bench"
recipe = "blockwise"
world = 2
ep = 2
moe = true
steps = 6
golden_tensor_steps = [0, -1]
model = {hidden = 512, ffn_hidden = 1024, moe_ffn_hidden = 512, num_layers = 4, seq_len = 128}
"""
BUMP = "ulp:1:param_sync:layers.0.attn.qkv.weight.fp8.rowwise_data"
PARITY = [sys.executable, "-m", "parity"]


def _timed(args: list[str]) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit code) of one parity command in its own process."""
    t = time.perf_counter()
    pid = subprocess.Popen(PARITY + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    return time.perf_counter() - t, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def _setup(d: Path) -> None:
    scen = d / "triage-bench.toml"
    if (d / "run" / "report.json").is_file() and (d / "goldens").is_dir():
        return
    scen.write_text(SCENARIO)
    # golden checking stays on (no golden yet: reported, not failed) so the run keeps its record,
    # which --against golden reads
    for args, want in ((["run", str(scen), "--inject", BUMP, "--snapshot", "all", "--out", str(d / "run")], 1),
                       (["golden", "regen", str(scen), "--goldens", str(d / "goldens"), "--accept"], 0)):
        rc = subprocess.run(PARITY + args, stdout=subprocess.DEVNULL).returncode
        if rc != want:
            sys.exit(f"bench_triage: `parity {' '.join(args)}` exited {rc}, expected {want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="make the run here once and reuse it")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    tmp = None if a.keep else tempfile.TemporaryDirectory(prefix="bench-triage-")
    d = a.keep or Path(tmp.name)
    d.mkdir(parents=True, exist_ok=True)
    _setup(d)
    snaps = sum(p.stat().st_size for p in (d / "run" / "snapshots").rglob("*.safetensors"))
    print(f"run: {d / 'run'}: {snaps / 2**30:.2f} GiB of snapshots (2 ranks, 6 steps, drift from step 1)")
    for label, args in (("parity triage RUN", ["triage", str(d / "run"), "--out", str(d / "t")]),
                        ("parity triage RUN --against golden",
                         ["triage", str(d / "run"), "--against", "golden", "--goldens", str(d / "goldens"),
                          "--out", str(d / "tg")])):
        for r in range(a.repeats):
            wall, rss, rc = _timed(args)
            print(f"{label}: {wall:6.1f} s, peak RSS {rss:6.0f} MiB, exit {rc} (repeat {r + 1})")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
