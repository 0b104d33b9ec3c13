#!/usr/bin/env bash
# The GPU tests written without a GPU in the thirty-seventh session, then the mutants they were
# written to kill, on any CUDA host with Triton (run from the repository root; writes into $OUT):
#   1. the two tests, then both GPU test files whole;
#   2. every mutant of the scaled_mm lines of parity/fp8/gemm.py, judged by test_fp8_gemm.py;
#   3. every mutant of triton_unavailable_reason, judged by test_fp8_triton.py.
set -u
OUT=${OUT:-gpu-new-tests-out}; mkdir -p "$OUT"
JOBS=${JOBS:-8}
{ nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; date -u; } > "$OUT/gpu.txt" 2>&1
( time python -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_fp8_gemm.py tests/unit/test_fp8_triton.py \
    -k "hopper or default_where" -rA ) > "$OUT/new-tests.txt" 2>&1
( time python -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/unit/test_fp8_gemm.py tests/unit/test_fp8_triton.py ) \
    > "$OUT/gpu-files.txt" 2>&1
LINES=$(python tools/mutants.py --list --files parity/fp8/gemm.py \
    | awk -F'[: ]' '($2>=340 && $2<=395) || $2==204 {print $1":"$2}' | sort -u)
PYTEST_ADDOPTS="-m gpu" timeout "${GEMM_S:-200}" python tools/mutants.py --pytest tests/unit/test_fp8_gemm.py \
    --files parity/fp8/gemm.py --only $LINES --jobs "$JOBS" --timeout 120 > "$OUT/gemm-scaled-mm.txt" 2>&1
TLINES=$(python tools/mutants.py --list --files parity/fp8/triton_quantize.py \
    | awk -F'[: ]' '$2>=122 && $2<=136 {print $1":"$2}' | sort -u)
PYTEST_ADDOPTS="-m gpu -n 2" timeout "${TRITON_S:-250}" python tools/mutants.py --pytest tests/unit/test_fp8_triton.py \
    --files parity/fp8/triton_quantize.py --only $TLINES --jobs "$JOBS" --timeout 200 \
    > "$OUT/triton-reason.txt" 2>&1
echo done >> "$OUT/gpu.txt"
