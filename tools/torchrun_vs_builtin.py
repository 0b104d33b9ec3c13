"""The same `parity run` by the built-in launcher and by torchrun (two agents on this host standing
in for two nodes), and what each report says: comparisons, first divergence, golden verdict.

torchrun runs as the README's "Across nodes" section says, with the static rendezvous of the
issue's command line (``--nnodes 2 --node-rank {0,1} --master-addr 127.0.0.1 --master-port P``)
or the c10d one (``--rdzv c10d``). The scenario's world must be 2 x --nproc-per-node.

Usage:
    python tools/torchrun_vs_builtin.py default --steps 6
    python tools/torchrun_vs_builtin.py default --steps 6 --inject 'ulp:4:grad_reduce:*'
    python tools/torchrun_vs_builtin.py --nproc-per-node 2 --rdzv c10d -- my.toml --golden check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from parity.harness.launch import free_port  # noqa: E402

KEYS = ("status", "golden", "compared", "compared_by_phase", "first_divergence", "n_divergences",
        "divergence_table", "loss", "golden_messages")


def builtin(run_args: list[str], out: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "parity.cli", "run", *run_args, "--out", str(out), "--quiet"],
                       capture_output=True, text=True)
    return r.returncode, time.perf_counter() - t0


def torchrun(run_args: list[str], out: Path, nproc: int, rdzv: str) -> tuple[list[int], float]:
    port = free_port()
    t0 = time.perf_counter()
    procs = []
    for node in (0, 1):
        if rdzv == "static":
            where = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        else:
            where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "compare"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
               *where, "--max-restarts", "0", "-m", "parity.cli", "run", *run_args, "--out", str(out)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5)  # the first agent serves the store
    for p in procs:
        p.communicate()
    return [p.returncode for p in procs], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="arguments of `parity run`")
    args = ap.parse_args()
    run_args = [a for a in args.run_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="parity-compare-") as d:
        b_out, t_out = Path(d) / "builtin", Path(d) / "torchrun"
        b_rc, b_s = builtin(run_args, b_out)
        t_rc, t_s = torchrun(run_args, t_out, args.nproc_per_node, args.rdzv)
        b = json.loads((b_out / "report.json").read_text())["scenarios"]
        t = json.loads((t_out / "report.json").read_text())["scenarios"]
        print(f"command: parity run {' '.join(run_args)}")
        print(f"built-in: exit {b_rc}, {b_s:.1f} s; torchrun (2 agents x {args.nproc_per_node}, {args.rdzv}): "
              f"agents exit {t_rc}, {t_s:.1f} s")
        same = len(b) == len(t)
        for eb, et in zip(b, t):
            print(f"{eb['name']}:")
            for k in ("status", "golden", "compared", "first_divergence"):
                print(f"  {k:17s} built-in {json.dumps(eb.get(k))}")
                print(f"  {'':17s} torchrun {json.dumps(et.get(k))}")
            differ = [k for k in KEYS if eb.get(k) != et.get(k)]
            print(f"  fields that differ: {', '.join(differ) if differ else 'none'} (of {', '.join(KEYS)})")
            same = same and not differ
    print("reports agree" if same else "REPORTS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
