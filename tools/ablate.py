"""Where a run's time goes, measured inside the run: one part of the stack computed twice.

Timed alone, a part misses what the run does to it (8 ranks on 2 CPUs share the cores and their
caches). So this runs `parity run ARGS` with one part computed twice, the extra result thrown away,
alternated in pairs against the same command with nothing doubled, and prints each run and, per
part, B/A of the scenario time: about 1 + that part's share of the run. Each part is a pure
function of its inputs, so the bits and the goldens stay as they are (a run that does not pass is
marked). Both sides start through this file, so they start alike, and their ranks must be forked
(the default for CPU ranks) to inherit the doubled function. A part the run never calls (the
emulated GEMM where CUDA's scaled_mm runs) shows B/A about 1 and no more rank CPU. Prints numbers;
asserts nothing. Exit 0; 1 when a run left no report; 2 on bad usage.

    python tools/ablate.py [--pairs 3] [--parts gemm,quantize,newton_schulz,compare] -- --recipe blockwise --ep 8
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tools"))

from ab import run_once  # noqa: E402  (tools/ is not a package: ab.py beside this file)

PARTS = {
    "gemm": ("parity.fp8.gemm", "_emulated"),
    "quantize": ("parity.fp8.quantize", "_quantize_parts"),
    "newton_schulz": ("parity.optim.muon", "newton_schulz"),
    "compare": ("parity.harness.runner", "compare_tensors"),
}
"""Part -> (module, function looked up there at each call): the emulated FP8 GEMM, the torch
quantizers, Muon's orthogonalization, the harness's bitwise comparison of one tensor."""


def _twice(fn):
    @functools.wraps(fn)
    def doubled(*args, **kwargs):
        fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return doubled


def _child(part: str, argv: list[str]) -> int:
    """`parity ARGV` with ``part`` doubled ("none": nothing), imported as the command imports."""
    sys.path.insert(0, str(HERE))
    from parity.distributed.pins import pin_before_torch

    pin_before_torch()  # the command's pins, before torch loads here
    from parity import cli

    cli.import_torch_uncollected()
    if part != "none":
        module, name = PARTS[part]
        mod = importlib.import_module(module)
        setattr(mod, name, _twice(getattr(mod, name)))
    return cli.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        if len(argv) < 2 or (argv[1] != "none" and argv[1] not in PARTS):
            print(f"ablate: --child takes none or one of {', '.join(PARTS)}", file=sys.stderr)
            return 2
        return _child(argv[1], argv[2:])
    own, run_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="alternated pairs a part (default 3)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ns = p.parse_args(own)
    parts = [x for x in ns.parts.split(",") if x]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts or ns.pairs < 1:
        p.error(f"--parts takes some of {', '.join(PARTS)}; --pairs at least 1")
    print(f"args: parity run {' '.join(run_args)}")
    entry = (str(Path(__file__).resolve()), "--child")
    summary = []
    with tempfile.TemporaryDirectory(prefix="parity-ablate-") as tmp:
        for part in parts:
            runs = {"A": [], "B": []}
            for i in range(ns.pairs):
                for side in ("AB" if i % 2 == 0 else "BA"):
                    r = run_once(HERE, {}, run_args, Path(tmp) / side, entry=(*entry, "none" if side == "A" else part))
                    runs[side].append(r)
                    mark = "" if set(r["status"].split(",")) == {"pass"} else "  (not a pass: not comparable)"
                    if side == "B" and r["start_methods"] - {"fork"}:
                        mark += f"  (ranks started by {sorted(map(str, r['start_methods']))}: not forked, nothing doubled)"
                    print(f"{part} pair {i + 1} {side}: scenario {r['scenario_s']:.2f} s, {r['status']}, "
                          f"golden {r['golden']}, CPU a rank (mean) user {r['user_s']:.3f} s{mark}", flush=True)
            a, b = ([r["scenario_s"] for r in runs[s]] for s in "AB")
            ua, ub = ([r["user_s"] for r in runs[s]] for s in "AB")
            summary.append(f"{part:>14}: scenario B/A {statistics.mean(b) / statistics.mean(a):.3f} "
                           f"(B slower in {sum(y > x for x, y in zip(a, b))} of {ns.pairs} pairs), rank user CPU "
                           f"{statistics.mean(ua):.2f} -> {statistics.mean(ub):.2f} s")
    print("part computed twice, against nothing doubled:")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
