"""Do scenario bits survive a change of CPU? Runs scenarios under CPU-kernel variants and compares.

Each variant stands in for another CPU model: ATEN_CPU_CAPABILITY picks ATen's vectorized kernels
(an AVX-512 vs an AVX2 machine, or the scalar kernels), ONEDNN_MAX_CPU_ISA and
MKL_ENABLE_INSTRUCTIONS cap what oneDNN and MKL dispatch to, and the per-rank thread count splits
reductions. Every variant runs ``parity run SCENARIO --steps N --snapshot all --golden off`` in a
fresh process (the kernel set is chosen when a process first dispatches); the tested side's
tensors of every step, phase and rank are hashed and compared with the first variant's.

    python tools/cpu_platform_matrix.py                          # this checkout
    python tools/cpu_platform_matrix.py --code /tmp/parity-base  # another checkout (e.g. before a change)

Prints a markdown table: per scenario and variant, the tensor records that differ (of all) and
the first one (step / phase / tensor / rank), plus the median wall time of the runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("forward", "grad_local", "grad_reduce", "optimizer", "param_sync")
VARIANTS: list[tuple[str, dict[str, str], int]] = [
    ("this CPU (AVX-512, AMX), 1 thread per rank", {}, 1),
    ("ATEN_CPU_CAPABILITY=avx512", {"ATEN_CPU_CAPABILITY": "avx512"}, 1),
    ("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}, 1),
    ("ONEDNN_MAX_CPU_ISA=AVX512_CORE", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, 1),
    ("ONEDNN_MAX_CPU_ISA=AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    ("MKL_ENABLE_INSTRUCTIONS=AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
    ("an AVX2-only CPU (all three at AVX2)", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                              "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
    ("2 threads per rank", {}, 2),
]
_CLEARED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OPENBLAS_CORETYPE",
            "PARITY_GOLDENS")

# Runs `parity run` with the launcher's per-rank thread count replaced (argv[1]).
_RUNNER = """
import dataclasses, sys
import parity.harness.driver as driver
threads = int(sys.argv.pop(1))
original = driver.launch_config
driver.launch_config = lambda *a, **k: dataclasses.replace(original(*a, **k), num_threads=threads)
from parity.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _digests(out: Path) -> dict[str, str]:
    """'step/phase/tensor/rank' -> sha256 of every tested-side tensor in the run's snapshots."""
    sys.path.insert(0, str(REPO))
    from parity.harness.snapshot import read_snapshot

    res = {}
    for f in sorted(out.glob("snapshots/*/*.safetensors")):
        step, rank = int(f.name[5:10]), int(f.name[16:19])
        tensors, _ = read_snapshot(f)
        for k, t in tensors.items():
            if k.startswith("A/"):
                raw = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                res[f"{step}/{k[2:]}/{rank}"] = hashlib.sha256(raw).hexdigest()
    return res


def run_variant(code: Path, scenario: str, steps: int, env: dict[str, str], threads: int, work: Path) -> dict:
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    full.update(env)
    full["PYTHONPATH"] = str(code)
    cmd = [sys.executable, "-c", _RUNNER, str(threads), "run", scenario, "--steps", str(steps), "--snapshot", "all",
           "--golden", "off", "--quiet", "--out", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=full, capture_output=True, text=True, cwd=code)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{scenario} {env} threads={threads}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    digests = _digests(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"digests": digests, "wall_s": wall}


def _order(k: str) -> tuple:
    step, rest = k.split("/", 1)
    phase, rest = rest.split("/", 1)
    tensor, rank = rest.rsplit("/", 1)
    return int(step), PHASES.index(phase) if phase in PHASES else 9, int(rank), tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", default=str(REPO), help="the checkout to run (default: this one)")
    ap.add_argument("--scenarios", nargs="+", default=["default", "mxfp8-dense-w4-ep1-overlap-off",
                                                        "blockwise-partial-blocks-w1"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    code = Path(args.code).resolve()
    results = {}
    with tempfile.TemporaryDirectory(prefix="parity-cpu-matrix-") as tmp:
        for scen in args.scenarios:
            for label, env, threads in VARIANTS:
                r = run_variant(code, scen, args.steps, env, threads, Path(tmp))
                results[(scen, label)] = r
                print(f"  ran {scen} / {label}: {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(f"Tensor records (step x phase x tensor x rank of the tested side) that differ from the first "
          f"variant; code: {code}, {args.steps} steps")
    print()
    print("| scenario | variant | differ | first difference (step / phase / tensor / rank) | wall s |")
    print("|---|---|---|---|---|")
    table = []
    for scen in args.scenarios:
        base = results[(scen, VARIANTS[0][0])]["digests"]
        for label, _, _ in VARIANTS:
            r = results[(scen, label)]
            bad = sorted((k for k in base if r["digests"].get(k) != base[k]), key=_order)
            first = " / ".join(str(x) for x in _order(bad[0])[:1]) if bad else ""
            if bad:
                step, phase, rank, tensor = _order(bad[0])
                first = f"{step} / {PHASES[phase] if phase < 5 else '?'} / {tensor} / {rank}"
            print(f"| {scen} | {label} | {len(bad)} of {len(base)} | {first or '-'} | {r['wall_s']:.1f} |")
            table.append({"scenario": scen, "variant": label, "differ": len(bad), "of": len(base),
                          "first": first, "wall_s": round(r["wall_s"], 2)})
    if args.json:
        Path(args.json).write_text(json.dumps({"code": str(code), "steps": args.steps, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
