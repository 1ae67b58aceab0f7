#!/usr/bin/env bash
# The H200 call of issue #6 (docs/w4a4.md, "Next device run"), ~4 minutes, writes under $OUT:
#   1. the GPU tests of the Mosaic GPU W4A4 GEMM and of the "dequantize + cuBLAS" strategy, verbose (gpu_tests.log);
#   2. benchmarks/w4a4_device.py: bf16 XLA vs Triton W4A4 vs dequant + cuBLAS vs Mosaic GPU W4A4 at Ideogram 4's q and
#      w1|w3, m = 4096 and 512, CUPTI device time, one process (w4a4_device.json, timing.log).
# Each phase runs under `timeout` within what is left of TOTAL_S (default 235 s).
set -uo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
END=$((SECONDS + ${TOTAL_S:-235}))
left() { local l=$((END - SECONDS)); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "$(left 80)" python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 60 -o junit_logging=all \
  --junitxml="$OUT/gpu_tests.xml" tests/gpu/test_w4a4_gemm_mgpu_gpu.py \
  "tests/test_w4a4_gemm.py::TestGPU::test_dequant_strategy_exact_on_gpu" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?"
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/gpu_tests.log" | cut -c1-250 | tail -n 30
T=$(left 150)
timeout "$T" python3 benchmarks/w4a4_device.py --out "$OUT/w4a4_device.json" --budget-s $((T > 40 ? T - 30 : 10)) \
  > "$OUT/timing.log" 2>&1
echo "timing rc=$?"
tail -n 40 "$OUT/timing.log"
