"""Quick sequential GPU checks of the fused quantizer kernels, each result printed as soon as it is known.

The same checks as the GPU tests that the pytest runs of the device calls could not report (their summaries were cut
by the call's time limit), one at a time, each guarded, with the end of any traceback printed:

    python benchmarks/transform_quantize_gpu_check.py --out results.json

Mosaic GPU Q4/K1 exact and general data (plain and poisoned outputs), NVFP4 division cases through the Triton kernel,
the low-rank ``qlinear_forward_gpu`` case, ``wide_quantize``, fp16's 2-part default, and the Mosaic GPU kernels'
time at two shapes beside the Triton ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu"), os.path.dirname(__file__)]

from kroquant_jax.formats import MXFP4, NVFP4  # noqa: E402
from pallas_kernels import transform_quantize as tq  # noqa: E402
from pallas_kernels import transform_quantize_mgpu as tqm  # noqa: E402

RESULTS = {}


def check(name):
    def deco(fn):
        t0 = time.time()
        try:
            RESULTS[name] = {"ok": True, **(fn() or {})}
        except Exception as e:  # noqa: BLE001 - report and go on
            RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}",
                             "traceback": traceback.format_exc()[-2500:]}
        RESULTS[name]["s"] = round(time.time() - t0, 1)
        print(f"[{name}] {json.dumps(RESULTS[name])[:1800]}", flush=True)
        return fn
    return deco


def rates(q, r):
    sq = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8) if q.scales.dtype != jnp.uint8 else q.scales)
    sr = np.asarray(jax.lax.bitcast_convert_type(r.scales, jnp.uint8) if r.scales.dtype != jnp.uint8 else r.scales)
    return {"code_mismatch": int(np.sum(np.asarray(q.codes) != np.asarray(r.codes))),
            "scale_mismatch": int(np.sum(sq != sr)), "n_codes": int(np.asarray(q.codes).size)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    from tq_cases import (NVFP4_DIVISION_CASES, exact_activations, exact_f32_scale_case, exact_transform,
                          nvfp4_division_stress, nvfp4_found_case_vectors)
    from test_transform_quantize_gpu import _random_activations, _random_transform

    ref = jax.jit(lambda a, t: tq.reference_transform_quantize(a, t, MXFP4()))

    for kind in ("q4", "k1"):
        @check(f"mgpu_{kind}_exact_bf16")
        def _(kind=kind):
            a = exact_activations(jax.random.key(1), 1024, 1536, jnp.bfloat16)
            t = exact_transform(kind, 1536, jax.random.key(2))
            return rates(tqm.transform_quantize_mgpu(a, t, impl="pallas"), ref(a, t))

    @check("triton_nvfp4_division_cases")
    def _():
        out = {}
        cases = [(nvfp4_found_case_vectors(amax), ts) for amax, ts in NVFP4_DIVISION_CASES]
        cases.append((nvfp4_division_stress(0.0123, n_blocks=1024), 0.0123))
        for i, (v, ts) in enumerate(cases):
            a, t = exact_f32_scale_case(v)
            ts = jnp.float32(ts)
            q = tq.transform_quantize(a, t, NVFP4(), tensor_scale=ts, impl="pallas", round_to_input=False)
            r = tq.reference_transform_quantize(a, t, NVFP4(), tensor_scale=ts, round_to_input=False)
            out[f"case{i}"] = rates(q, r)
        return out

    @check("qlinear_gpu_lowrank")
    def _():
        from kroquant_jax import qlinear
        from kroquant_jax import transforms as T
        from pallas_kernels import qlinear_gpu

        o, d, r = 256, 1152, 128
        w = jax.random.normal(jax.random.key(14), (o, d))
        lowrank = (0.1 * jax.random.normal(jax.random.key(15), (o, r)),
                   0.1 * jax.random.normal(jax.random.key(16), (r, d)))
        params = jax.tree.map(lambda v: v * (1 + 0.2 * jax.random.normal(jax.random.key(17), v.shape)),
                              T.KRON_LU.init(d))
        layer = qlinear.build_qlinear(w, jnp.ones((o,)), transform="kron_lu", transform_params=params,
                                      lowrank=lowrank)
        x = _random_activations(jax.random.key(18), 300, d, jnp.bfloat16)
        refv = np.asarray(qlinear.qlinear_forward(layer, x, path="packed"), np.float32)
        y = np.asarray(qlinear_gpu.qlinear_forward_gpu(layer, x), np.float32)
        scale = np.abs(refv).max()
        return {"frac_off_2pct": float(np.mean(np.abs(y - refv) > 2e-2 * scale)),
                "max_rel": float(np.abs(y - refv).max() / scale)}

    for kind in ("q4", "k1"):
        @check(f"mgpu_{kind}_exact_fp16_poisoned")
        def _(kind=kind):
            m, d = 1024, 1536
            a = exact_activations(jax.random.key(3), m, d, jnp.float16)
            t = exact_transform(kind, d, jax.random.key(4))
            out = {}
            for byte in (0x00, 0xFF):
                p = (jnp.full((m, d // 2), byte, jnp.uint8), jnp.full((m, d // 32), byte, jnp.uint8))
                out[f"poison_{byte}"] = rates(tqm.transform_quantize_mgpu(a, t, impl="pallas", _poison=p), ref(a, t))
            return out

        @check(f"mgpu_{kind}_general_bf16")
        def _(kind=kind):
            a = _random_activations(jax.random.key(5), 1024, 3072, jnp.bfloat16)
            t = _random_transform(kind, 3072, jax.random.key(6))
            return rates(tqm.transform_quantize_mgpu(a, t, impl="pallas"), ref(a, t))

    @check("timing_mgpu_vs_triton")
    def _():
        import transform_quantize_bench as tqb
        out = {}
        for m, d in ((4096, 16384), (4096, 4096)):
            bufs = tqb.make_inputs(m, d, jnp.float16, 4 if d == 4096 else 2)
            ts = tqb.transforms_for(d)
            for kind in ("q4", "k1"):
                out[f"mgpu_{kind}_{m}x{d}"] = tqb.time_device(tqb.mgpu_kernel_fn(ts[kind], None, jnp.float16),
                                                              bufs, 30)[0]
                out[f"triton_{kind}_{m}x{d}"] = tqb.time_device(tqb.kernel_fn(ts[kind], None), bufs, 30)[0]
                print(f"  timing {kind} ({m}, {d}): mgpu {out[f'mgpu_{kind}_{m}x{d}']:.2f} us, triton "
                      f"{out[f'triton_{kind}_{m}x{d}']:.2f} us", flush=True)
            del bufs
        return out

    @check("triton_nvfp4_general_q4_k1")
    def _():
        out = {}
        a = _random_activations(jax.random.key(3), 1027, 3072, jnp.bfloat16)
        for kind in ("q4", "k1"):
            t = _random_transform(kind, 3072, jax.random.key(4))
            q = tq.transform_quantize(a, t, NVFP4(), impl="pallas")
            r = tq.reference_transform_quantize(a, t, NVFP4())
            out[kind] = {**rates(q, r), "ts_equal": bool(np.asarray(q.tensor_scale) == np.asarray(r.tensor_scale))}
        return out

    @check("triton_wide_quantize_exact_k1")
    def _():
        a = exact_activations(jax.random.key(21), 1000, 1024, jnp.bfloat16)
        t = exact_transform("k1", 1024, jax.random.key(22))
        bs = tq.BlockSizes(block_rows=64, block_cols=256, chunk_loop="fori", num_stages=3, wide_quantize=4)
        return rates(tq.transform_quantize(a, t, block_sizes=bs, impl="pallas"), ref(a, t))

    @check("triton_fp16_default_k1_k2")
    def _():
        a = _random_activations(jax.random.key(19), 1027, 3072, jnp.float16)
        return {kind: rates(tq.transform_quantize(a, t, impl="pallas"), ref(a, t))
                for kind in ("k1", "k2") for t in [_random_transform(kind, 3072, jax.random.key(20))]}

    with open(args.out, "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
