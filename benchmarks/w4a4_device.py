"""Device times of the W4A4 GEMM strategies against bf16, in one process (issue #6; the H200 call of docs/w4a4.md).

At Ideogram 4's q projection (n = k = 4608) and fused w1|w3 (n = 24576, k = 4608), m = 4096 and 512, on packed MXFP4
operands (random bf16 data with outlier channels, quantized on the device):

* ``bf16_xla``: XLA/cuBLAS ``A W^T`` on the bf16 operands (the baseline);
* ``triton``: the Pallas-Triton W4A4 GEMM (``w4a4_gemm.w4a4_matmul``, bf16 tensor-core mode, default tiles);
* ``dequant``: "dequantize + cuBLAS" (``w4a4_gemm.w4a4_matmul_dequant``: decode fusions + one bf16 GEMM);
* ``mgpu``: the Mosaic GPU kernel (``w4a4_gemm_mgpu.w4a4_matmul_mgpu``, default tiling; the weight in its prepared
  layout, made once like the packing; the activations' scales transposed inside the timed call).

Extras at q, m = 4096 (after the main table): ``dequant_xla_fused`` (no optimization barrier) and other Mosaic GPU
tilings. Phase order: bf16/triton/dequant over all cases, then mgpu over all cases, then the extras, so that a
failing or hanging Mosaic kernel cannot cost the rest; the JSON is rewritten after every variant.

Device time: the CUPTI kernel durations of each call summed (``jax.profiler`` trace read back with ``ProfileData``,
``kroquant_jax.timing.device_time``), median over ``--iters`` calls on 3 rotating input sets (more
bytes than the L2 for the large shapes) after warm-up. Before timing, each variant's output on set 0 is checked
against the f32 product of the fake-quantized operands: relative L2 error and the largest error relative to the
accumulation-order bound plus the bf16 output rounding (``err_over_bound`` <= 1 passes).

    python benchmarks/w4a4_device.py --out $OUT/w4a4_device.json              # H200 (~2.5 min)
    python benchmarks/w4a4_device.py --small --out /tmp/w4a4_device.json      # CPU: plumbing only (no timing)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from kroquant_jax.formats import MXFP4, dequantize, quantize  # noqa: E402
from pallas_kernels import w4a4_gemm as G  # noqa: E402
from pallas_kernels import w4a4_gemm_mgpu as GM  # noqa: E402

N_SETS = 3
CASES = [("ideogram4", "attn.q", 4608, 4608, 4096), ("ideogram4", "attn.q", 4608, 4608, 512),
         ("ideogram4", "ffn.w13", 24576, 4608, 4096), ("ideogram4", "ffn.w13", 24576, 4608, 512)]
SMALL_CASES = [("small", "attn.q", 512, 256, 128), ("small", "ffn.w13", 768, 256, 64)]
MAIN = ("bf16_xla", "triton", "dequant")
EXTRA_MGPU = {  # other Mosaic GPU tilings, timed at q, m = 4096 after the main table
    "mgpu_tk128_1buf": GM.MgpuGemmConfig(tile_k=128, wdec_slots=1, max_concurrent_steps=3),
    "mgpu_wg_m": GM.MgpuGemmConfig(wg_dimension="m"),
    "mgpu_tm64": GM.MgpuGemmConfig(tile_m=64),
    "mgpu_6stages": GM.MgpuGemmConfig(max_concurrent_steps=6),
}


def make_sets(key, m, n, k):
    """``N_SETS`` tuples ``(a bf16, w bf16, qa, qw, wp)``: packed MXFP4 operands and the prepared Mosaic weight."""
    q = jax.jit(lambda x: quantize(x, MXFP4()))
    sets = []
    for i in range(N_SETS):
        ka, kw = jax.random.split(jax.random.fold_in(key, i))
        a = jax.random.normal(ka, (m, k), jnp.float32) * jnp.where(jnp.arange(k) % 97 == 0, 20.0, 1.0)
        w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
        a, w = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        qa, qw = q(a.astype(jnp.float32)), q(w.astype(jnp.float32))
        sets.append((a, w, qa, qw, GM.prepare_operand(qw)))
    return sets


def variant_fn(name, on_gpu):
    """``fn(a, w, qa, qw, wp) -> (m, n) bf16`` for a variant name."""
    impl = "pallas" if on_gpu else "reference"
    if name == "bf16_xla":
        return lambda a, w, qa, qw, wp: jnp.matmul(a, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    if name == "triton":
        return lambda a, w, qa, qw, wp: G.w4a4_matmul(qa, qw, interpret=not on_gpu)
    if name == "dequant":
        return lambda a, w, qa, qw, wp: G.w4a4_matmul_dequant(qa, qw)
    if name == "dequant_xla_fused":
        return lambda a, w, qa, qw, wp: G.w4a4_matmul_dequant(qa, qw, materialize=False)
    if name == "mgpu":
        return lambda a, w, qa, qw, wp: GM.w4a4_matmul_mgpu(qa, wp, impl=impl)
    if name in EXTRA_MGPU:
        cfg = EXTRA_MGPU[name]
        return lambda a, w, qa, qw, wp: GM.w4a4_matmul_mgpu(qa, GM.prepare_operand(wp, rows_multiple=cfg.cta_n,
                                                                                  k_multiple=cfg.tile_k),
                                                             config=cfg, impl=impl)
    raise ValueError(f"unknown variant {name!r}")


def check(y, s, bf16_input: bool):
    """Relative L2 error and max error over the bound against the f32 product of the (fake-quantized) operands."""
    a, w, qa, qw, _ = s
    if bf16_input:
        af, wf = a.astype(jnp.float32), w.astype(jnp.float32)
    else:
        af, wf = dequantize(qa, jnp.float32), dequantize(qw, jnp.float32)
    ref = jnp.matmul(af, wf.T, precision="highest")
    p = jnp.matmul(jnp.abs(af), jnp.abs(wf).T, precision="highest")
    k = af.shape[1]
    y = y.astype(jnp.float32)
    bound = 2 * (k + 1) * 2.0**-24 * p + 2.0**-8 * jnp.abs(ref) + 1e-30
    rel = float(jnp.linalg.norm(y - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    return {"rel_err": rel, "err_over_bound": float(jnp.max(jnp.abs(y - ref) / bound)),
            "nonfinite": int(jnp.sum(~jnp.isfinite(y)))}


def run_variant(name, sets, *, iters, on_gpu):
    rec = {"variant": name}
    t0 = time.time()
    try:
        fn = jax.jit(variant_fn(name, on_gpu))
        y = jax.block_until_ready(fn(*sets[0]))
        rec["compile_and_first_s"] = time.time() - t0
        rec.update(check(y, sets[0], bf16_input=name == "bf16_xla"))
        if on_gpu:
            timed = timing.device_time(lambda s: fn(*s), sets, n_iter=iters, warmup=2)
            rec.update(us=timed.us, timing=timed.method, kernels=list(timed.kernels), kernels_us=timed.kernels_us)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rec.update(error=f"{type(e).__name__}: {str(e)[:600]}", trace=traceback.format_exc()[-1500:])
    rec["wall_s"] = time.time() - t0
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="w4a4_device.json")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--budget-s", type=float, default=170.0, help="start no new variant after this many seconds")
    p.add_argument("--small", action="store_true", help="small shapes (CPU plumbing check)")
    p.add_argument("--no-extras", action="store_true")
    args = p.parse_args(argv)
    t_start = time.time()
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    result = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "method": "CUPTI kernel time per call (summed), median over iters, 3 rotating input sets",
              "iters": args.iters, "cases": [], "stopped_early": False}

    def save():
        atomic_write_json(args.out, result, indent=1, sort_keys=False)

    cases = SMALL_CASES if args.small else CASES
    data, recs = {}, {}
    for model, layer, n, k, m in cases:
        c = {"model": model, "layer": layer, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "variants": []}
        result["cases"].append(c)
        recs[(layer, m)] = c
    plan = [(name, key) for name in MAIN for key in recs] + [("mgpu", key) for key in recs]
    if not args.no_extras:
        plan += [(name, next(iter(recs))) for name in ("dequant_xla_fused", *EXTRA_MGPU)]
    for name, key in plan:
        if time.time() - t_start > args.budget_s:
            result["stopped_early"] = True
            break
        c = recs[key]
        if key not in data:
            data[key] = make_sets(jax.random.key(c["m"] + c["n"]), c["m"], c["n"], c["k"])
        rec = run_variant(name, data[key], iters=args.iters, on_gpu=on_gpu)
        base = next((v.get("us") for v in c["variants"] if v["variant"] == "bf16_xla"), None)
        if base and rec.get("us"):
            rec["bf16_over_this"] = base / rec["us"]
            rec["tflops"] = c["flops"] / rec["us"] / 1e6
        c["variants"].append(rec)
        msg = f"{rec['us']:9.1f} us" if "us" in rec else rec.get("error", "checked (no timing off the GPU)")[:120]
        print(f"{c['layer']:8s} m={c['m']:5d} {name:18s} {msg}  err/bound={rec.get('err_over_bound', float('nan')):.2f}"
              f"  rel={rec.get('rel_err', float('nan')):.1e}  {rec['wall_s']:.1f}s", flush=True)
        save()
    result["wall_s"] = time.time() - t_start
    save()
    print(table(result))
    return result


def table(result) -> str:
    """Markdown table: µs per variant and bf16 / variant, per case."""
    names = [*MAIN, "mgpu"]
    out = ["| layer | m | " + " | ".join(f"{n} µs" for n in names) + " | bf16 / best W4A4 |",
           "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for c in result["cases"]:
        v = {r["variant"]: r for r in c["variants"]}
        cells = [f"{v[n]['us']:.1f}" if n in v and "us" in v[n] else ("error" if n in v and "error" in v[n] else "–")
                 for n in names]
        w4 = [v[n]["us"] for n in names[1:] if n in v and "us" in v[n]]
        base = v.get("bf16_xla", {}).get("us")
        ratio = f"{base / min(w4):.2f}x" if base and w4 else "–"
        out.append(f"| {c['layer']} | {c['m']} | " + " | ".join(cells) + f" | {ratio} |")
    extras = [r for c in result["cases"] for r in c["variants"] if r["variant"] not in names]
    if extras:
        out += ["", "| extra (q, m = 4096) | µs |", "| --- | ---: |"]
        out += [f"| {r['variant']} | " + (f"{r['us']:.1f}" if "us" in r else ("error" if "error" in r else "–")) + " |"
                for r in extras]
    return "\n".join(out)


if __name__ == "__main__":
    main()
