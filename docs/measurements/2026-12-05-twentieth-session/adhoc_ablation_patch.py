"""Patch a copy of the parity tree so that one part of the stack runs twice when PARITY_ABL names
it (the second result is thrown away): the added time is that part's cost inside a real run, with
the run's contention and caches, which a microbenchmark of the part alone does not see. Bits are
unchanged (each part is a pure function of its inputs), so the run still passes its golden.

    git archive HEAD | tar -x -C /tmp/abl && cd /tmp/abl && python THIS_FILE
    python tools/ab.py --pairs 3 --b-env PARITY_ABL=gemm -- --recipe blockwise --ep 8
(parts: gemm, quant, ns, cmp). Not for committing: a measurement aid only."""


def patch(path, old, new):
    s = open(path).read()
    assert old in s, (path, old)
    open(path, "w").write(s.replace(old, new, 1))


patch("parity/fp8/gemm.py", "import math\n", "import math\nimport os\n")
patch("parity/fp8/gemm.py",
      "    out = _scaled_mm(a, b, out_dtype) if use_scaled else _emulated(a, b, out_dtype)\n",
      "    out = _scaled_mm(a, b, out_dtype) if use_scaled else _emulated(a, b, out_dtype)\n"
      "    if os.environ.get(\"PARITY_ABL\") == \"gemm\":\n        _emulated(a, b, out_dtype)\n")
patch("parity/fp8/quantize.py",
      "    parts = _quantize_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)\n",
      "    parts = _quantize_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)\n"
      "    if os.environ.get(\"PARITY_ABL\") == \"quant\":\n"
      "        _quantize_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)\n")
patch("parity/optim/muon.py",
      "    return newton_schulz(u, steps, coefficient_type) * scale * extra_scale_factor\n",
      "    if __import__(\"os\").environ.get(\"PARITY_ABL\") == \"ns\":\n"
      "        newton_schulz(u, steps, coefficient_type)\n"
      "    return newton_schulz(u, steps, coefficient_type) * scale * extra_scale_factor\n")
patch("parity/harness/runner.py",
      "                self._record(step, phase, compare_tensors(ref[k], cur[k], f\"step {step}/{phase}/{k}/rank {self.rank}\"))\n",
      "                self._record(step, phase, compare_tensors(ref[k], cur[k], f\"step {step}/{phase}/{k}/rank {self.rank}\"))\n"
      "                if os.environ.get(\"PARITY_ABL\") == \"cmp\":\n                    compare_tensors(ref[k], cur[k], \"x\")\n")
