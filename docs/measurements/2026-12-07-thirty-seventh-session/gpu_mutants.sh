#!/usr/bin/env bash
# The CUDA-only code's mutants, judged by its GPU tests, on any CUDA host with Triton
# (run from the repository root; writes into $OUT, default ./gpu-mutants-out):
#   the Triton quantizers (a sample) by tests/unit/test_fp8_triton.py,
#   the scaled_mm backend's lines of parity/fp8/gemm.py by tests/unit/test_fp8_gemm.py.
# Each judging run is pytest -m gpu in its own copy of the tree; --jobs runs several at once.
set -u
OUT=${OUT:-gpu-mutants-out}; mkdir -p "$OUT"
SAMPLE=${SAMPLE:-64}; JOBS=${JOBS:-8}
{ nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; date -u; } > "$OUT/gpu.txt" 2>&1
( time PYTEST_ADDOPTS="-m gpu -n 8" python -m pytest -q -p no:cacheprovider tests/unit/test_fp8_triton.py \
    tests/unit/test_fp8_gemm.py ) > "$OUT/unmutated.txt" 2>&1
LINES=$(python tools/mutants.py --list --files parity/fp8/gemm.py \
    | awk -F'[: ]' '($2>=340 && $2<=395) || $2==204 {print $1":"$2}' | sort -u)
PYTEST_ADDOPTS="-m gpu" timeout "${GEMM_S:-150}" python tools/mutants.py --pytest tests/unit/test_fp8_gemm.py \
    --files parity/fp8/gemm.py --only $LINES --jobs "$JOBS" --timeout 120 > "$OUT/gemm-scaled-mm.txt" 2>&1
PYTEST_ADDOPTS="-m gpu -n 2" timeout "${TRITON_S:-330}" python tools/mutants.py --pytest tests/unit/test_fp8_triton.py \
    --files parity/fp8/triton_quantize.py --sample "$SAMPLE" --seed "${SEED:-1}" --jobs "$JOBS" --timeout 200 \
    > "$OUT/triton-sample.txt" 2>&1
echo done >> "$OUT/gpu.txt"
