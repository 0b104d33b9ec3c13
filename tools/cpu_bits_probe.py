"""Which CPU ops of the stack give different bits under other instruction sets or thread counts.

Each op the model and optimizers run on the CPU is evaluated on fixed inputs with the shapes the
default scenario uses, and its output bits are hashed. The probe runs once per environment variant
in a fresh interpreter (the kernel ISA is chosen when torch first dispatches), and prints, per op,
whether the bits match the first variant (the machine's own choice). The variants stand in for
other CPU models: ATEN_CPU_CAPABILITY picks ATen's vectorized kernels (default = scalar, avx2,
avx512), ONEDNN_MAX_CPU_ISA caps oneDNN's JIT kernels (the bf16 GEMMs), MKL_ENABLE_INSTRUCTIONS
caps MKL's (fp32 GEMMs, vector math), and the thread count splits reductions.

    python tools/cpu_bits_probe.py                 # the table, as markdown
    python tools/cpu_bits_probe.py --pinned        # with the parity CPU pins applied in every variant

``--pinned`` applies what the rank launcher applies on CPU
(:data:`parity.distributed.determinism.CPU_PINS`): ATen kernels at AVX2, MKL on its strict
conditional-reproducibility COMPATIBLE branch. An explicit ATEN_CPU_CAPABILITY in a variant overrides
the pin (it names another platform). bf16 GEMMs still go to oneDNN; the stack has none left
(parity.model.matmul), the rows marked "bf16 GEMM" show why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

from parity.distributed.pins import CPU_PINS, cpu_flags  # torch-free

VARIANTS: list[tuple[str, dict[str, str], int]] = [
    ("native (this CPU), 1 thread", {}, 1),
    ("ATEN_CPU_CAPABILITY=avx512", {"ATEN_CPU_CAPABILITY": "avx512"}, 1),
    ("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}, 1),
    ("ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, 1),
    ("ONEDNN_MAX_CPU_ISA=AVX512_CORE", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, 1),
    ("ONEDNN_MAX_CPU_ISA=AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    ("MKL_ENABLE_INSTRUCTIONS=AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
    ("MKL_ENABLE_INSTRUCTIONS=SSE4_2", {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, 1),
    ("2 threads", {}, 2),
    ("avx2 everywhere (AVX2-only CPU)", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                         "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
]


def _ops():
    """name -> zero-argument callable returning a tensor or a tuple of tensors."""
    import torch
    import torch.nn.functional as F

    from parity.model import matmul
    from parity.model.gpt import RMSNorm, init_value
    from parity.optim.adam import Adam
    from parity.optim.muon import fp32_matmul_precision, newton_schulz

    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    x = randn(128, 128, dtype=torch.bfloat16)           # tokens x hidden
    w_head = randn(128, 128, dtype=torch.bfloat16, std=0.02)
    w_router = randn(8, 128, dtype=torch.bfloat16, std=0.02)
    dy = randn(128, 128, dtype=torch.bfloat16, std=0.01)
    q, k, v = (randn(2, 4, 64, 32) for _ in range(3))
    scores = randn(2, 4, 64, 64)
    mask = torch.ones(64, 64, dtype=torch.bool).triu(1)
    logits = randn(128, 128)
    labels = torch.randint(0, 128, (128,), generator=g)
    h = randn(2, 64, 128, dtype=torch.bfloat16)
    upd = randn(384, 128, std=0.01)
    big = randn(65536, std=0.01).abs()

    def linear_fwd_bwd(w, fn=F.linear):
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        y = fn(xr, wr)
        y.backward(dy[:, : w.shape[0]].contiguous())
        return y, xr.grad, wr.grad

    def attention():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        s = qq @ kk.transpose(-1, -2) / 32 ** 0.5
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        o = p @ vv
        o.sum().backward()
        return s, o, qq.grad, kk.grad, vv.grad

    def rmsnorm():
        n = RMSNorm(128, "cpu")
        hr = h.clone().requires_grad_(True)
        y = n(hr)
        y.float().pow(2).sum().backward()
        return y, hr.grad, n.weight.grad

    def cross_entropy():
        lr = logits.clone().requires_grad_(True)
        loss = F.cross_entropy(lr, labels)
        loss.backward()
        return loss, lr.grad

    def adam():
        p = torch.nn.Parameter(randn(4096, std=0.02))
        p.grad = randn(4096, std=1e-3)
        opt = Adam([p], lr=1e-3)
        for _ in range(3):
            opt.step()
        return p.detach()

    def silu():
        t = randn(128, 256)
        return F.silu(t), torch.exp(t), torch.rsqrt(t.abs() + 1e-5)

    def ns_medium():
        with fp32_matmul_precision("medium"):  # as the stack runs Muon
            return newton_schulz(upd)

    def ns_bf16_gemm():  # the loop as it was: bf16 GEMMs
        X = F.normalize(upd.mT, p=2, dim=(-2, -1), eps=1e-7).to(torch.bfloat16)
        for a, b, c in [(4.0848, -6.8946, 2.9270)] * 5:
            A = X @ X.mT
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a, alpha=1.0)
        return X

    return {
        "randn init (parity.model.gpt.init_value, 384x128)": lambda: init_value(1234, "w", (384, 128), 0.02),
        "bf16 linear fwd+bwd, head 128x128, bf16 GEMM (F.linear)": lambda: linear_fwd_bwd(w_head),
        "bf16 linear fwd+bwd, router 8x128, bf16 GEMM (F.linear)": lambda: linear_fwd_bwd(w_router),
        "bf16 linear fwd+bwd, head, fp32 GEMM (parity.model.matmul)": lambda: linear_fwd_bwd(w_head, matmul.linear),
        "bf16 linear fwd+bwd, router, fp32 GEMM (parity.model.matmul)": lambda: linear_fwd_bwd(w_router, matmul.linear),
        "fp32 attention q@k^T, softmax, p@v + bwd": attention,
        "fp32 softmax alone (64 wide, masked)": lambda: torch.softmax(scores.masked_fill(mask, float("-inf")), -1),
        "RMSNorm fwd+bwd (mean over 128)": rmsnorm,
        "cross_entropy fwd+bwd (128 classes)": cross_entropy,
        "silu / exp / rsqrt (elementwise)": silu,
        "sum over 65536 (1-D reduction)": lambda: big.sum(),
        "sqrt / div over 65536": lambda: (big.sqrt(), big / 3.0),
        "Adam, 3 steps over 4096": adam,
        "Newton-Schulz 128x384, bf16 GEMMs (before)": ns_bf16_gemm,
        "Newton-Schulz 128x384, fp32 GEMMs (parity.optim.muon)": ns_medium,
        "F.normalize (Frobenius)": lambda: F.normalize(upd, p=2, dim=(-2, -1)),
    }


def _digest(out) -> str:
    import torch

    ts = out if isinstance(out, tuple) else (out,)
    h = hashlib.sha256()
    for t in ts:
        t = t.detach().contiguous()
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _child(threads: int, pinned: bool, repeat: int) -> None:
    import torch

    if pinned:
        from parity.distributed.determinism import apply_cpu_pins
        apply_cpu_pins()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    res = {}
    for name, fn in _ops().items():
        fn()  # warm up (JIT kernels, caches)
        t0 = time.process_time()  # CPU time: one thread, steadier than wall time on a shared machine
        for _ in range(repeat):
            out = fn()
        res[name] = {"digest": _digest(out), "ms": 1e3 * (time.process_time() - t0) / repeat}
    res["_capability"] = torch.backends.cpu.get_cpu_capability()
    print(json.dumps(res))


def run_variant(env: dict[str, str], threads: int, pinned: bool, repeat: int) -> dict:
    full = {k: v for k, v in os.environ.items()
            if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                         "OPENBLAS_CORETYPE")}
    if pinned:  # OpenBLAS reads its pin when numpy loads, before the child could apply it
        full.update({k: v for k, v in CPU_PINS.items() if k == "OPENBLAS_CORETYPE"})
    full.update(env)
    cmd = [sys.executable, __file__, "--child", str(threads), "--repeat", str(repeat)] + (["--pinned"] if pinned else [])
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pinned", action="store_true", help="apply parity's CPU pins in every variant")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions per op")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _child(args.child, args.pinned, args.repeat)
        return
    runnable = []
    for label, env, threads in VARIANTS:
        flags = cpu_flags()
        if env.get("ATEN_CPU_CAPABILITY") == "avx512" and flags is not None and "avx512f" not in flags:
            # ATen takes the variable at its word (oneDNN's is a cap, which is harmless)
            print(f"skipped: {label} (this CPU has no AVX-512: ATen would run AVX-512 kernels and die)")
            continue
        runnable.append((label, env, threads))
    results = [(label, run_variant(env, threads, args.pinned, args.repeat)) for label, env, threads in runnable]
    base = results[0][1]
    ops = [k for k in base if not k.startswith("_")]
    print(f"CPU op bits by variant ({'with' if args.pinned else 'without'} parity's CPU pins); "
          f"'=' same bits as the first column, 'X' different")
    print()
    print("| op | CPU ms (first column) | " + " | ".join(label for label, _ in results) + " |")
    print("|---|---|" + "---|" * len(results))
    for op in ops:
        cells = ["=" if r[op]["digest"] == base[op]["digest"] else "X" for _, r in results]
        print(f"| {op} | {base[op]['ms']:.2f} | " + " | ".join(cells) + " |")
    print("| (ATen capability in effect) | | " + " | ".join(r["_capability"] for _, r in results) + " |")


if __name__ == "__main__":
    main()
