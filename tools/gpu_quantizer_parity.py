"""CPU == CUDA for every quantizer: bytes and scales, on a random and an edge-case suite.

    python tools/gpu_quantizer_parity.py [--json FILE]

Prints one line per case and a total; exits 1 if any case differs, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from parity.fp8 import quantize

PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def edge_input(dtype):
    """A 384x640 input with a zero tile, a subnormal tile, +-max tiles, inf, -inf and NaN."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(384, 640, generator=g) * 3
    x[:128, :128] = 0.0
    x[128:256, :128] = 1e-39 if dtype == torch.float32 else 1e-38
    fmax = torch.finfo(dtype).max
    x[256:384, :128] = fmax
    x[256:300, 128:256] = -fmax
    x[5, 300] = float("inf")
    x[6, 301] = float("-inf")
    x[7, 302] = float("nan")
    x[0:32, 512:544] = -0.0
    return x.to(dtype)


def cases():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for name, x in (("random", (torch.randn(512, 768, generator=g) * 10).to(dtype)),
                        ("ramp", torch.linspace(-5000, 5000, 256 * 384).reshape(256, 384).to(dtype)),
                        ("edge", edge_input(dtype)),
                        ("partial", (torch.randn(303, 300, generator=g)).to(dtype))):
            for recipe, block in (("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", "1x32")):
                if recipe == "mxfp8" and (x.shape[0] % 32 or x.shape[1] % 32):
                    continue
                for fp8 in ("e4m3", "e5m2"):
                    for pow2 in ((True, False) if recipe == "blockwise" else (True,)):
                        yield (f"{name}/{str(dtype)[6:]}/{recipe}-{block}/{fp8}/pow2={pow2}",
                               x, dict(recipe=recipe, block=block, fp8_dtype=fp8, pow2_scales=pow2))


def bits(t):
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.uint8) if t.element_size() == 1 else t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 2
    rows, bad = [], 0
    for name, x, kw in cases():
        recipe = kw.pop("recipe")
        qc = quantize(x, recipe, **kw)
        qg = quantize(x.cuda(), recipe, **kw)
        diffs = {}
        for part in PARTS:
            a, b = getattr(qc, part), getattr(qg, part)
            if a is None and b is None:
                continue
            n = int((bits(a) != bits(b.cpu())).sum())
            if n:
                diffs[part] = n
        bad += bool(diffs)
        rows.append({"case": name, "differing": diffs})
        print(f"{'OK  ' if not diffs else 'DIFF'} {name} {diffs or ''}")
    print(f"{len(rows) - bad}/{len(rows)} cases identical on CPU and {torch.cuda.get_device_name(0)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "cases": rows, "identical": len(rows) - bad, "total": len(rows)}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
