#!/usr/bin/env bash
# Everything the GPU issue needs, in one device call (the device tool runs it in the repo root
# and brings back what lands in $OUT). Usage: bash tools/gpu_session.sh [smoke|full]
# Each part is bounded and independent: one failing part does not lose the others' results.
set -u
MODE=${1:-full}
OUT=${OUT:-/tmp/parity-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8
PY=python3
part() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S))"; \
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -3 "$OUT/$name.txt"; }

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')

if [ "$MODE" = smoke ]; then
  part smoke_w1 240 $PY -m parity.cli run cuda-blockwise-moe-w1-overlap-off cuda-mxfp8-dense-w1-overlap-off --steps 3 --out "$OUT/run-smoke" --quiet
  [ "$NGPU" -ge 2 ] && part smoke_w2 240 $PY -m parity.cli run cuda-blockwise-moe-w2-overlap-on --steps 3 --out "$OUT/run-smoke2" --quiet
  cp "$OUT"/run-smoke/report.json "$OUT/smoke_report.json" 2>/dev/null
  exit 0
fi

part quant_parity 60 $PY tools/gpu_quantizer_parity.py --json "$OUT/quant_parity.json"
part pytest_gpu 90 $PY -m pytest tests -m gpu -q -x -p no:cacheprovider
SCEN=$($PY -m parity.cli list | awk '{print $1}' | grep '^cuda-' | { if [ "$NGPU" -ge 2 ]; then cat; else grep -- '-w1-'; fi; })
mkdir -p "$OUT/g"
part goldens 300 $PY -m parity.cli golden regen $SCEN --accept --goldens "$OUT/g/goldens"
(cd "$OUT/g" && tar czf "$OUT/goldens_gpu.tgz" goldens) && rm -rf "$OUT/g"
part bench_step 90 $PY tools/bench_step.py --device cuda --medium --json "$OUT/bench_step.json"
part bench_quantize 45 $PY tools/bench_quantize.py --sizes 4096x4096 --devices cuda
part bench_compare 45 $PY tools/bench_compare.py --devices cuda --size-mib 256
ls -la "$OUT"
