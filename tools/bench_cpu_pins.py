"""What the CPU pins cost: step time before and after them, interleaved run by run.

"Before" is another checkout (the code before the pins: bf16 GEMMs through oneDNN, ATen and MKL at
the CPU's widest instruction set); "after" is this checkout with the pins the rank launcher
applies (``parity.distributed.determinism.CPU_PINS``) and the fp32-GEMM formulation of the bf16
matmuls (``parity.model.matmul``). Each round runs ``tools/bench_step.py`` (one rank, bare ON and
OFF steps) in both, alternating, so that load from other processes hits both alike; the medians
over the rounds are printed, with the CPU time per lockstep step (a run of ``--steps N`` minus a
run of ``--steps 1``: on a loaded machine a steadier measure than wall time). A third column runs this checkout without the pins, which separates
the cost of the pins from the cost of the fp32 GEMMs.

    python tools/bench_cpu_pins.py --before /tmp/parity-base [--rounds 3] [--moe]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from parity.distributed.pins import CPU_PINS as PINS  # noqa: E402  (torch-free)


def bench(code: Path, env: dict[str, str], args: list[str]) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in (*PINS, "ONEDNN_MAX_CPU_ISA")}
    full.update(env)
    full["PYTHONPATH"] = str(code)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, str(code / "tools" / "bench_step.py"), "--json", f.name, *args],
                       env=full, check=True, capture_output=True, cwd=code)
        res = json.loads(Path(f.name).read_text())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="checkout of the code before the pins")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    extra = ["--steps", str(args.steps), "--warmup", "1"] + (["--moe"] if args.moe else [])
    cols = {"before (native ISA, oneDNN bf16 GEMMs)": (Path(args.before).resolve(), {}),
            "after, without pins (fp32 GEMMs, native ISA)": (REPO, {}),
            "after (fp32 GEMMs, ATen AVX2, MKL CNR COMPATIBLE, OpenBLAS Haswell)": (REPO, PINS)}
    short = ["--steps", "1", "--warmup", "1"] + (["--moe"] if args.moe else [])
    runs: dict[str, list[dict]] = {k: [] for k in cols}
    for r in range(args.rounds):
        for label, (code, env) in cols.items():
            res = bench(code, env, extra)
            # CPU seconds per lockstep step (ON + OFF): the difference to a 1-step run removes start-up
            # and model building; bench_step runs 2 * steps lockstep steps besides its warm-up.
            res["cpu_ms_per_step"] = 1e3 * (res["cpu_s"] - bench(code, env, short)["cpu_s"]) / (2 * (args.steps - 1))
            runs[label].append(res)
            print(f"  round {r + 1} {label}: ON {res['step_ms_on']} ms, {res['cpu_ms_per_step']:.0f} CPU ms per "
                  "lockstep step", file=sys.stderr, flush=True)
    print(f"bench_step.py {' '.join(extra)}: median over {args.rounds} interleaved rounds (ms per step, one rank)")
    print()
    print("| code | CPU ms per lockstep step (ON + OFF) | wall: ON step ms | OFF step ms | lockstep bare ms |")
    print("|---|---|---|---|---|")
    for label in cols:
        med = {k: statistics.median(x[k] for x in runs[label])
               for k in ("cpu_ms_per_step", "step_ms_on", "step_ms_off", "lockstep_bare_ms")}
        print(f"| {label} | {med['cpu_ms_per_step']:.0f} | {med['step_ms_on']:.1f} | {med['step_ms_off']:.1f} "
              f"| {med['lockstep_bare_ms']:.1f} |")


if __name__ == "__main__":
    main()
