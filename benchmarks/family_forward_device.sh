#!/usr/bin/env bash
# The device calls that finish issue 14's PixArt-Σ / FLUX.1 measurements (docs/w4a4.md, "PixArt-Σ and FLUX.1 at their
# real sizes"), one mode per call, each within one call's 600 s:
#
#   bash benchmarks/family_forward_device.sh tiles     # fused FP8 GEMM tilings at the narrow models' shapes
#   bash benchmarks/family_forward_device.sh flux      # the whole FLUX.1 step with cuDNN attention: bf16, fp8_mgpu
#   bash benchmarks/family_forward_device.sh errors    # FAMILY's (default pixart; flux) served output against the
#                                                      # simulated forward; FUSED=1: shared-input groups fused;
#                                                      # REPEATS timed calls (default 3)
#   bash benchmarks/family_forward_device.sh validate  # default_config's tile widths: the m = 512 shapes not swept
#                                                      # against the tuned 128 tiling, the kernel's GPU tests, then
#                                                      # PixArt-Σ and FLUX.1 whole with fp8_mgpu (cuDNN attention);
#                                                      # LAYERS_S, TESTS_S, PIXART_S, FLUX_S: each step's limit in s
#                                                      # (FLUX_S=0 skips FLUX.1)
#   bash benchmarks/family_forward_device.sh graphs    # FAMILY (default pixart; flux) bf16 vs fp8_mgpu, shared-input
#                                                      # groups fused, under each of XLA's command-buffer (CUDA graph)
#                                                      # SETTINGS (default "min1 off"; "default" adds XLA's own),
#                                                      # GRAPHS_S s each (FLUX.1: about 280, two settings a call)
#   bash benchmarks/family_forward_device.sh program   # the served strategies' per-program XLA options on the GPU:
#                                                      # their GPU test, then FAMILY (default flux) fused, each
#                                                      # system compiled as kroquant generate compiles it (PROGRAM_S)
#   bash benchmarks/family_forward_device.sh fused     # FLUX.1, then PixArt-Σ, with --fuse-shared-inputs: bf16,
#                                                      # bf16_fused, fp8_mgpu (FLUX_S, PIXART_S: each one's limit in s;
#                                                      # 0 skips it)
#
# JAX's persistent compilation cache lives in runs/dev/jax_cache (kept between back-to-back calls on a warm machine),
# so a later call loads the programs an earlier one finished compiling (not verified for the Mosaic GPU kernels).
# Writes logs and JSON under $OUT (./device_out elsewhere).
set -uo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT" runs/dev/jax_cache
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=runs/dev/jax_cache
mode=${1:-tiles}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
case "$mode" in
  tiles)
    timeout "${LIMIT_S:-560}" python3 benchmarks/fp8_mgpu_bench.py --out "$OUT/fp8_mgpu_narrow.json" --ms 4096 512 \
      --layers pixart_sigma.attn.q pixart_sigma.ff.up pixart_sigma.ff.down flux1.attn.q \
      --configs "n96:tile_n=96,epi_tile_n=32" "n64:tile_n=64" "m64:tile_m=64" \
      "n144s2:tile_n=144,epi_tile_n=48,max_concurrent_steps=2" \
      "n192s2c32:tile_n=192,epi_tile_n=64,max_concurrent_steps=2,lowrank_chunk=32" > "$OUT/tiles.log" 2>&1
    echo "tiles rc=$?"; tail -n 40 "$OUT/tiles.log" ;;
  flux)
    timeout "${LIMIT_S:-560}" python3 benchmarks/family_forward_w4a4.py --family flux --strategies fp8_mgpu \
      --kernels --repeats 3 --out "$OUT/family_forward_flux_cudnn.json" > "$OUT/flux.log" 2>&1
    echo "flux rc=$?"; tail -n 12 "$OUT/flux.log" ;;
  errors)
    family=${FAMILY:-pixart}
    case "$family" in pixart|flux) ;; *) echo "errors: unknown FAMILY '$family' (pixart, flux)" >&2; exit 2 ;; esac
    case "${FUSED:-0}" in 0) fuse=() ;; 1) fuse=(--fuse-shared-inputs) ;;
      *) echo "errors: FUSED must be 0 or 1, got '${FUSED}'" >&2; exit 2 ;; esac
    timeout "${LIMIT_S:-560}" python3 benchmarks/family_forward_w4a4.py --family "$family" \
      --strategies fp8_mgpu,simulate "${fuse[@]}" --repeats "${REPEATS:-3}" \
      --out "$OUT/family_forward_${family}_vs_simulate.json" > "$OUT/errors_${family}.log" 2>&1
    echo "errors ${family} rc=$?"; tail -n 12 "$OUT/errors_${family}.log" ;;
  validate)
    timeout "${LAYERS_S:-150}" python3 benchmarks/fp8_mgpu_bench.py --out "$OUT/fp8_mgpu_tile_choice.json" --ms 512 \
      --layers flux1.ff.down flux1.single.proj_out flux1.ff.up \
      --configs "tuned128:tile_n=128,max_concurrent_steps=3,grid_tile_width=4,epi_tile_n=32,lowrank_chunk=64" \
      > "$OUT/validate.log" 2>&1
    echo "layers rc=$?"
    timeout "${TESTS_S:-110}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gemm_mgpu_gpu.py \
      >> "$OUT/validate.log" 2>&1
    echo "gpu tests rc=$?"
    timeout "${PIXART_S:-130}" python3 benchmarks/family_forward_w4a4.py --family pixart --strategies fp8_mgpu \
      --kernels --repeats 3 --out "$OUT/family_forward_pixart_tiles.json" >> "$OUT/validate.log" 2>&1
    echo "pixart rc=$?"
    if [ "${FLUX_S:-200}" -gt 0 ]; then
      timeout "${FLUX_S:-200}" python3 benchmarks/family_forward_w4a4.py --family flux --strategies fp8_mgpu \
        --repeats 3 --out "$OUT/family_forward_flux_tiles.json" >> "$OUT/validate.log" 2>&1
      echo "flux rc=$?"
    else
      echo "flux skipped (FLUX_S=0)"
    fi
    grep -v "^{" "$OUT/validate.log" | tail -n 45 ;;
  graphs)
    # XLA's defaults capture FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL and CUDNN commands in regions of >= 5; each run
    # records its XLA_FLAGS. "min1": regions of any size; "off": no command buffers (is capture working at all?).
    # --xla-defaults: no strategy's own per-program options, so the process-wide setting is the one measured.
    declare -A flags=([default]="" [min1]="--xla_gpu_graph_min_graph_size=1" [off]="--xla_gpu_enable_command_buffer=")
    family=${FAMILY:-pixart}
    case "$family" in pixart|flux) ;; *) echo "graphs: unknown FAMILY '$family' (pixart, flux)" >&2; exit 2 ;; esac
    for setting in ${SETTINGS:-min1 off}; do
      [ -n "${flags[$setting]+set}" ] || { echo "graphs: unknown setting '$setting' (default, min1, off)" >&2; exit 2; }
    done
    for setting in ${SETTINGS:-min1 off}; do
      XLA_FLAGS="${flags[$setting]}" timeout "${GRAPHS_S:-250}" python3 benchmarks/family_forward_w4a4.py \
        --family "$family" --strategies fp8_mgpu --fuse-shared-inputs --kernels --repeats 3 --xla-defaults \
        --out "$OUT/family_forward_${family}_graphs_${setting}.json" > "$OUT/graphs_${family}_${setting}.log" 2>&1
      echo "graphs ${family} ${setting} rc=$?"; grep -v "^{" "$OUT/graphs_${family}_${setting}.log" | tail -n 6
    done ;;
  program)
    family=${FAMILY:-flux}
    case "$family" in pixart|flux) ;; *) echo "program: unknown FAMILY '$family' (pixart, flux)" >&2; exit 2 ;; esac
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_program_options_gpu.py > "$OUT/program.log" 2>&1
    echo "program options gpu test rc=$?"
    timeout "${PROGRAM_S:-300}" python3 benchmarks/family_forward_w4a4.py --family "$family" --strategies fp8_mgpu \
      --fuse-shared-inputs --kernels --repeats 5 --out "$OUT/family_forward_${family}_program_options.json" \
      >> "$OUT/program.log" 2>&1
    echo "program ${family} rc=$?"; grep -v "^{" "$OUT/program.log" | tail -n 12 ;;
  fused)
    for fam in flux pixart; do
      limit=$([ "$fam" = flux ] && echo "${FLUX_S:-330}" || echo "${PIXART_S:-200}")
      if [ "$limit" -gt 0 ]; then
        timeout "$limit" python3 benchmarks/family_forward_w4a4.py --family "$fam" --strategies fp8_mgpu \
          --fuse-shared-inputs --kernels --repeats 3 --out "$OUT/family_forward_${fam}_fused.json" \
          > "$OUT/${fam}_fused.log" 2>&1
        echo "$fam fused rc=$?"; grep -v "^{" "$OUT/${fam}_fused.log" | tail -n 9
      fi
    done ;;
  *) echo "family_forward_device.sh: unknown mode '$mode' (tiles, flux, errors, validate, graphs, program, fused)" >&2
     exit 2 ;;
esac
