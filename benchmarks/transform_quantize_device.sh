#!/usr/bin/env bash
# The H200 device calls of issue #5's profile / Mosaic GPU / test work (docs/kernels.md), one mode per call:
#
#   bash benchmarks/transform_quantize_device.sh profile   # GPU tests (xdist) + variant profile + Mosaic timings
#   bash benchmarks/transform_quantize_device.sh table     # the benchmark table, Triton and Mosaic GPU side by side
#   bash benchmarks/transform_quantize_device.sh final     # GPU tests + Mosaic GPU variants + the table, in one call
#
# Writes logs and JSON under $OUT (the device tool's output folder; ./device_out elsewhere).
set -uo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mode=${1:-profile}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$mode" = profile ]; then
  timeout "${TESTS_S:-90}" python3 -m pytest -q -m gpu -n "${NPROC:-8}" -p no:cacheprovider -rA tests/gpu/ \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error|mismatch" "$OUT/gpu_tests.log" | tail -n 25
  timeout "${PROFILE_S:-130}" python3 benchmarks/transform_quantize_profile.py --iters 30 \
    --out "$OUT/transform_quantize_profile.json" --deadline "${PROFILE_DEADLINE_S:-100}" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; tail -n 60 "$OUT/profile.log"
elif [ "$mode" = final ]; then
  # Order: the Triton table first (nothing new in it can hang), then the GPU tests (per-test timeout), then the
  # Mosaic GPU / wide variants, then the Mosaic GPU columns of the table; each phase within what is left of ~228 s.
  END=$((SECONDS + ${TOTAL_S:-228}))
  left() { local l=$((END - SECONDS)); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
  timeout "$(left 55)" python3 benchmarks/transform_quantize_bench.py --candidates defaults --xla none \
    --kinds q4,scale,k1,k2 --iters 30 --deadline 45 --out "$OUT/transform_quantize.json" > "$OUT/table.log" 2>&1
  echo "table rc=$?"; tail -n 16 "$OUT/table.log"
  timeout "$(left 95)" python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider -rfE --timeout 60 \
    -o junit_logging=all --junitxml="$OUT/gpu_tests.xml" tests/gpu/ > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | cut -c1-300 | tail -n 30
  MGPU=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import transform_quantize_profile as p; print(','.join([*p.MGPU_VARIANTS, *[n for n in p.TRITON_VARIANTS if 'wide' in n], 'k1_p2', 'k2_p2']))")
  timeout "$(left 45)" python3 benchmarks/transform_quantize_profile.py --iters 30 --only "$MGPU" \
    --out "$OUT/transform_quantize_profile_mgpu.json" --deadline 32 > "$OUT/profile_mgpu.log" 2>&1
  echo "profile rc=$?"; grep -E "mgpu|wide|_p2 |ERROR" "$OUT/profile_mgpu.log" | cut -c1-200 | tail -n 36
  timeout "$(left 60)" python3 benchmarks/transform_quantize_bench.py --candidates defaults --xla none \
    --kinds mgpu_q4,mgpu_k1 --iters 30 --deadline 40 --out "$OUT/transform_quantize_mgpu_table.json" \
    > "$OUT/table_mgpu.log" 2>&1
  echo "table mgpu rc=$?"; tail -n 16 "$OUT/table_mgpu.log"
elif [ "$mode" = table ]; then
  timeout "${TABLE_S:-200}" python3 benchmarks/transform_quantize_bench.py --candidates defaults --xla big \
    --kinds q4,scale,k1,k2,fwht,mgpu_q4,mgpu_k1 --iters 30 --deadline "${TABLE_DEADLINE_S:-170}" \
    --out "$OUT/transform_quantize.json" > "$OUT/table.log" 2>&1
  echo "table rc=$?"; tail -n 40 "$OUT/table.log"
fi
