"""Where the K1/K2 time goes: variant timings of the Triton kernels, their exactness, and the Mosaic GPU kernels.

H200.md's method without hardware counters: time variants that leave one stage out or change one parameter, and take
differences. Per shape (fp16, the benchmark's inputs, CUPTI device time, median of ``--iters`` calls on rotating
buffers larger than the L2):

* Triton K1 (the default tiling: ``BD=256`` walked by a pipelined ``fori_loop``, pairs of block products joined and
  quantized at once, ``dot_passes=3``) and variants: ``dot_passes`` 1/2, other ``block_rows``/``num_warps``, the
  one-block-per-program tiling; ``stage="transform"`` (same tiles and products, ``A T`` stored in fp16, no quantizer),
  ``stage="copy"`` (same tiles loaded and stored back); the same for K2.
* Code/scale mismatch rates against the f32 reference for ``dot_passes`` 1/2/3 (K1 and K2, bf16 and fp16, general
  data with outliers), measured on the GPU.
* The Mosaic GPU kernels (``pallas_kernels/transform_quantize_mgpu.py``), Q4 and K1, over a few tilings.

    python benchmarks/transform_quantize_profile.py --out benchmarks/results/transform_quantize_profile.json

Each item is guarded (an error is recorded, the run goes on) and the JSON is rewritten after each, so a run cut by its
time limit keeps what it measured; ``--deadline`` (seconds) skips what is left after that time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_text  # noqa: E402
from kroquant_jax.formats import MXFP4  # noqa: E402
from pallas_kernels import bench_inputs  # noqa: E402
from pallas_kernels import transform_quantize as tq  # noqa: E402
from pallas_kernels import transform_quantize_mgpu as tqm  # noqa: E402

BS = tq.BlockSizes
MB = tqm.MgpuBlockSizes
K1_FORI = dict(block_rows=64, block_cols=256, num_warps=4, num_stages=3)

# name -> (kind, BlockSizes, stage); stage "quantize" is the real kernel. "k1_default" is the K1 default before the
# profile (3 parts for every dtype); fp16's default is now 2 parts ("k1_p2").
TRITON_VARIANTS = {
    "k1_default": ("k1", BS(**K1_FORI), "quantize"),
    "k1_p2": ("k1", BS(**K1_FORI, dot_passes=2), "quantize"),
    "k1_p1": ("k1", BS(**K1_FORI, dot_passes=1), "quantize"),
    "k1_transform_only": ("k1", BS(**K1_FORI), "transform"),
    "k1_transform_only_p1": ("k1", BS(**K1_FORI, dot_passes=1), "transform"),
    "k1_copy_stage": ("k1", BS(**K1_FORI), "copy"),
    "q4_default": ("q4", tq.default_block_sizes("q4", 4096, 4096), "quantize"),
    "q4_copy_stage": ("q4", tq.default_block_sizes("q4", 4096, 4096), "copy"),
    "scale_default": ("scale", tq.default_block_sizes("scale", 4096, 4096), "quantize"),
    "k1_br32": ("k1", BS(**{**K1_FORI, "block_rows": 32}), "quantize"),
    "k1_br128": ("k1", BS(**{**K1_FORI, "block_rows": 128}), "quantize"),
    "k1_w8": ("k1", BS(**{**K1_FORI, "num_warps": 8}), "quantize"),
    "k1_s2": ("k1", BS(**{**K1_FORI, "num_stages": 2}), "quantize"),
    "k1_bd32": ("k1", BS(block_rows=64, block_cols=32), "quantize"),
    "k1_bd32_p2": ("k1", BS(block_rows=64, block_cols=32, dot_passes=2), "quantize"),
    "k2_default": ("k2", BS(block_rows=64, block_cols=32), "quantize"),
    "k2_p2": ("k2", BS(block_rows=64, block_cols=32, dot_passes=2), "quantize"),
    "k2_p1": ("k2", BS(block_rows=64, block_cols=32, dot_passes=1), "quantize"),
    "k2_transform_only": ("k2", BS(block_rows=64, block_cols=32), "transform"),
    "k2_fori_p2": ("k2", BS(**K1_FORI, dot_passes=2), "quantize"),
}
# the subset also timed at the second (large) shape
BIG_SHAPE_VARIANTS = ["k1_default", "k1_p2", "k1_p1", "k1_transform_only", "k1_copy_stage", "q4_default",
                      "q4_copy_stage", "scale_default", "k2_default", "k2_p2", "k2_transform_only"]

MGPU_VARIANTS = {
    "mgpu_q4_br64_bd512": ("q4", MB(block_rows=64, block_cols=512)),
    "mgpu_q4_br32_bd512": ("q4", MB(block_rows=32, block_cols=512)),
    "mgpu_q4_br64_bd256": ("q4", MB(block_rows=64, block_cols=256)),
    "mgpu_q4_br128_bd512": ("q4", MB(block_rows=128, block_cols=512)),
    "mgpu_q4_br64_bd512_seq2": ("q4", MB(block_rows=64, block_cols=512, sequential_cols=True, max_concurrent_steps=2)),
    "mgpu_q4_br32_bd512_seq3": ("q4", MB(block_rows=32, block_cols=512, sequential_cols=True, max_concurrent_steps=3)),
    "mgpu_k1_br64_bd256_p3": ("k1", MB(block_rows=64, block_cols=256, dot_passes=3)),
    "mgpu_k1_br64_bd256_p2": ("k1", MB(block_rows=64, block_cols=256, dot_passes=2)),
    "mgpu_k1_br64_bd256_p1": ("k1", MB(block_rows=64, block_cols=256, dot_passes=1)),
    "mgpu_k1_br128_bd256_p3": ("k1", MB(block_rows=128, block_cols=256, dot_passes=3)),
    "mgpu_k1_br64_bd512_p3": ("k1", MB(block_rows=64, block_cols=512, dot_passes=3)),
    "mgpu_k1_br64_bd256_p3_seq2": ("k1", MB(block_rows=64, block_cols=256, dot_passes=3, sequential_cols=True,
                                            max_concurrent_steps=2)),
}
BIG_SHAPE_MGPU = ["mgpu_q4_br64_bd512", "mgpu_q4_br64_bd512_seq2", "mgpu_k1_br64_bd256_p3", "mgpu_k1_br64_bd256_p2",
                  "mgpu_k1_br64_bd256_p3_seq2"]


IMPL = "pallas"  # "interpret" with --interpret (a CPU smoke run of this script)


def triton_fn(t, bs, stage):
    @jax.jit
    def f(a):
        if stage == "quantize":
            q = tq.transform_quantize(a, t, MXFP4(), block_sizes=bs, impl=IMPL)
            return q.codes, q.scales
        return (tq.kernel_stage(a, t, MXFP4(), stage=stage, block_sizes=bs, impl=IMPL),)
    return f


def mgpu_fn(t, bs, parts):
    @jax.jit
    def f(a, parts):
        q = tqm.transform_quantize_mgpu(a, t, MXFP4(), block_sizes=bs, impl=IMPL, k1_parts=parts)
        return q.codes, q.scales
    return lambda a: f(a, parts)


def stage_bytes(m, d, itemsize, stage):
    """Bytes a variant must move: A in, and codes + scales (quantize) or a 16-bit (m, d) array (transform/copy)."""
    return m * d * itemsize + (m * d * itemsize if stage != "quantize" else m * d // 2 + m * d // 32)


def general_inputs(key, m, d, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (m, d)) * jnp.where(jax.random.bernoulli(k2, 0.02, (1, d)), 30.0, 1.0)
    return (x * jnp.where(jax.random.bernoulli(k3, 1e-4, (m, d)), 200.0, 1.0)).astype(dtype)


def division_probe(n=1 << 20):
    """Pallas Triton f32 division on the GPU against numpy's correctly rounded one: plain ``x / y`` (Triton lowers it
    to ``div.full.f32``), and inline ``div.rn.f32`` with ``r`` and ``f`` register constraints."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    rng = np.random.default_rng(0)
    x = rng.uniform(0.01, 100.0, n).astype(np.float32)
    y = rng.uniform(0.01, 100.0, n).astype(np.float32)
    exact = x / y
    variants = {
        "plain": lambda a, b: a / b,
        "asm_r": lambda a, b: pltriton.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0],
        "asm_f": lambda a, b: pltriton.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0],
        "kernel_default": tq.div_rn_ptx,
    }
    out = {}
    for name, div in variants.items():
        def kernel(x_ref, y_ref, o_ref, div=div):
            o_ref[...] = div(x_ref[...], y_ref[...])
        try:
            got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n // 1024, 1024), jnp.float32),
                                    grid=(n // 1024 // 16,),
                                    in_specs=[pl.BlockSpec((16, 1024), lambda i: (i, 0))] * 2,
                                    out_specs=pl.BlockSpec((16, 1024), lambda i: (i, 0)),
                                    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
                jnp.asarray(x.reshape(-1, 1024)), jnp.asarray(y.reshape(-1, 1024)))
            got = np.asarray(got).reshape(-1)
            out[name] = {"mismatch_fraction": float(np.mean(got != exact)),
                         "max_ulp": int(np.max(np.abs(got.view(np.int32).astype(np.int64)
                                                      - exact.view(np.int32).astype(np.int64))))}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    return out


def mismatch_rates(m, d, dtype):
    """Fraction of codes / scale bytes that differ from the jitted f32 reference, per kind and dot_passes."""
    a = general_inputs(jax.random.key(11), m, d, dtype)
    ts = bench_inputs.prepared_transforms(d)
    out = {}
    for kind in ("k1", "k2"):
        ref = jax.jit(lambda a, t: tq.reference_transform_quantize(a, t, MXFP4()))(a, ts[kind])
        rc, rs = np.asarray(ref.codes), np.asarray(ref.scales)
        for passes in (1, 2, 3):
            base = dict(K1_FORI) if kind == "k1" else dict(block_rows=64, block_cols=32)
            q = jax.jit(lambda a, t, bs=BS(**base, dot_passes=passes): tq.transform_quantize(
                a, t, MXFP4(), block_sizes=bs, impl=IMPL))(a, ts[kind])
            out[f"triton_{kind}_p{passes}"] = {"codes": float(np.mean(np.asarray(q.codes) != rc)),
                                               "scales": float(np.mean(np.asarray(q.scales) != rs))}
            if kind == "k1":
                try:
                    bs = MB(block_rows=64, block_cols=256, dot_passes=passes)
                    q = jax.jit(lambda a, t: tqm.transform_quantize_mgpu(a, t, MXFP4(), block_sizes=bs,
                                                                         impl=IMPL))(a, ts[kind])
                    out[f"mgpu_k1_p{passes}"] = {"codes": float(np.mean(np.asarray(q.codes) != rc)),
                                                 "scales": float(np.mean(np.asarray(q.scales) != rs))}
                except Exception as e:  # noqa: BLE001 - record and go on
                    out[f"mgpu_k1_p{passes}"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/transform_quantize_profile.json")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining items are skipped")
    ap.add_argument("--shapes", default="4096x4096,4096x16384")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--mismatch-shape", default="4096x4096")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: interpret mode, tiny copy probe")
    args = ap.parse_args(argv)
    global IMPL
    IMPL = "interpret" if args.interpret else "pallas"
    t_start = time.time()
    dev = jax.devices()[0]
    meta = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "dtype": "float16",
            "iters": args.iters, "variants": {k: [v[0], dataclasses.asdict(v[1]), v[2]]
                                              for k, v in TRITON_VARIANTS.items()},
            "mgpu_variants": {k: [v[0], dataclasses.asdict(v[1])] for k, v in MGPU_VARIANTS.items()}}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out = {"meta": meta, "shapes": [], "errors": {}}

    def save():
        atomic_write_text(args.out, json.dumps(out, indent=1, default=str) + "\n")

    def late():
        return time.time() - t_start > args.deadline

    only = set(filter(None, args.only.split(",")))
    if not args.interpret:
        out["division_probe"] = division_probe()
        print("division probe:", json.dumps(out["division_probe"]), flush=True)
        save()
    big = bench_inputs.activation_sets(*((64, 512) if args.interpret else (8192, 65536)), jnp.float16, 2)
    copy_us = timing.device_time(bench_inputs.copy_fn(), big, n_iter=20).us
    copy_bw = 2 * big[0].size * 2 / (copy_us * 1e-6) / 1e9
    meta["copy_GBps_xla"] = copy_bw
    del big
    print(f"{meta['device']} jax {meta['jax']}: copy {copy_bw:.0f} GB/s", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for si, (m, d) in enumerate(shapes):
        in_bytes = m * d * 2
        bufs = bench_inputs.activation_sets(m, d, jnp.float16, max(2, min(32, math.ceil(4 * bench_inputs.L2_BYTES / in_bytes))))
        ts = bench_inputs.prepared_transforms(d)
        row = {"m": m, "d": d, "us": {}, "GBps": {}, "frac_of_copy_bw": {}}
        out["shapes"].append(row)
        names = [n for n in TRITON_VARIANTS if si == 0 or n in BIG_SHAPE_VARIANTS]
        mnames = [n for n in MGPU_VARIANTS if si == 0 or n in BIG_SHAPE_MGPU]
        for name in names + mnames:
            if (only and name not in only) or late():
                continue
            try:
                if name in TRITON_VARIANTS:
                    kind, bs, stage = TRITON_VARIANTS[name]
                    fn = triton_fn(ts[kind], bs, stage)
                else:
                    kind, bs = MGPU_VARIANTS[name]
                    stage = "quantize"
                    if not tqm.supports(kind, (m, d), jnp.float16, bs):
                        continue
                    parts = (tqm.prepare_k1_blocks(ts["k1"].blocks, jnp.float16, bs.dot_passes)
                             if kind == "k1" else None)
                    fn = mgpu_fn(ts[kind], bs, parts)
                timed = timing.device_time(fn, bufs, n_iter=args.iters)
                us, method, kernels = timed.us, timed.method, list(timed.kernels)
            except Exception as e:  # noqa: BLE001 - record the compiler's message and go on
                msg = f"{type(e).__name__}: {e}"
                out["errors"][f"{name}@{m}x{d}"] = msg[:6000] + "\n" + traceback.format_exc()[-3000:]
                print(f"  {name}: ERROR {msg[:400]}", flush=True)
                save()
                continue
            nbytes = stage_bytes(m, d, 2, stage)
            row["us"][name] = us
            row.setdefault("kernels", {})[name] = kernels
            row["GBps"][name] = nbytes / (us * 1e-6) / 1e9
            row["frac_of_copy_bw"][name] = row["GBps"][name] / copy_bw
            print(f"  ({m},{d}) {name:32s} {us:9.2f} us  {row['GBps'][name]:7.0f} GB/s  {method} {kernels}",
                  flush=True)
            save()
        del bufs
    mm, md = (int(v) for v in args.mismatch_shape.split("x"))
    if not late():
        for dtype in (jnp.bfloat16, jnp.float16):
            try:
                out.setdefault("mismatch", {"shape": [mm, md]})[jnp.dtype(dtype).name] = mismatch_rates(mm, md, dtype)
            except Exception as e:  # noqa: BLE001
                out["errors"][f"mismatch_{jnp.dtype(dtype).name}"] = f"{type(e).__name__}: {str(e)[:3000]}"
            save()
        print(json.dumps(out.get("mismatch"), indent=1), flush=True)
    meta["elapsed_s"] = time.time() - t_start
    save()
    for row in out["shapes"]:
        print(f"({row['m']}, {row['d']}):")
        for name, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
            print(f"  {name:32s} {us:9.2f} us {100 * row['frac_of_copy_bw'][name]:5.1f}% of copy BW")
    for k, v in out["errors"].items():
        print(f"ERROR {k}: {v[:300]}")


if __name__ == "__main__":
    main()
