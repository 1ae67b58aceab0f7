"""Benchmark of the fused transform + MXFP4 quantizer kernels (paper Tables 3 and 4 shapes; docs/kernels.md).

Per shape: Q4, Scale, K1, K2, FWHT (d a power of two), XLA's fusion of the jnp reference (K1's math, and Q4's), and a
device-to-device copy of the same bytes. Device time comes from the profiler (CUPTI kernel durations read back with
``jax.profiler.ProfileData``), median over many calls on rotating inputs (more bytes than the L2) after warm-up; if the
trace holds no GPU kernels, wall-clock time of back-to-back calls is used instead (flagged in the JSON).

    python benchmarks/transform_quantize_bench.py --out benchmarks/results/transform_quantize.json
    python benchmarks/transform_quantize_bench.py --sweep      # tiling variants on a few shapes

Bytes counted: ``m*d*itemsize`` in, ``m*d/2`` codes + ``m*d/32`` scales out, plus the transform's own arrays.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_text  # noqa: E402
from kroquant_jax.formats import MXFP4  # noqa: E402
from pallas_kernels import bench_inputs  # noqa: E402
from pallas_kernels import transform_quantize as tq  # noqa: E402
from pallas_kernels import transform_quantize_mgpu as tqm  # noqa: E402

TABLE3 = {  # (m, d): Q4, Scale, K1, K2, FWHT (µs, AMD MI350, fp16)
    (4096, 1024): (9.40, 10.56, 9.96, 14.00, 18.16),
    (4096, 4096): (22.64, 25.52, 23.88, 27.80, 68.04),
    (4096, 16384): (74.44, 75.44, 75.32, 78.52, 186.04),
    (512, 4096): (7.20, 9.24, 8.12, 10.28, 14.40),
    (512, 16384): (13.68, 16.36, 15.36, 19.32, 33.96),
}
TABLE4 = {  # (m, d): Q4, Scale, K1, K2
    (512, 3072): (6.72, 9.04, 7.64, 8.84),
    (512, 12288): (11.80, 14.68, 13.08, 17.00),
    (4096, 1152): (10.64, 14.00, 10.68, 14.64),
    (4096, 3072): (18.56, 21.12, 19.28, 23.32),
    (4096, 3456): (20.60, 24.20, 21.32, 25.36),
    (4096, 4608): (25.72, 28.40, 26.40, 30.36),
    (4096, 12288): (59.64, 59.12, 59.92, 62.80),
}
SHAPES = list(TABLE3) + [s for s in TABLE4 if s not in TABLE3]
SWEEP_SHAPES = [(4096, 4096), (4096, 16384), (512, 3072)]


def paper_row(m, d):
    if (m, d) in TABLE3:
        return dict(zip(("q4", "scale", "k1", "k2", "fwht"), TABLE3[(m, d)]))
    if (m, d) in TABLE4:
        return dict(zip(("q4", "scale", "k1", "k2"), TABLE4[(m, d)]))
    return {}


def extra_bytes(t):
    return sum(int(x.size) * x.dtype.itemsize for x in (t.inv_scale, t.blocks, t.kparams) if x is not None)


def mgpu_kernel_fn(t, bs, dtype, fmt=MXFP4()):
    """The Mosaic GPU kernel (``transform_quantize_mgpu``); K1's split blocks prepared once, outside the timing."""
    bs = bs or tqm.default_block_sizes(t.kind, dtype)
    parts = tqm.prepare_k1_blocks(t.blocks, dtype, bs.dot_passes) if t.kind == "k1" else None

    @jax.jit
    def f(a, parts):
        q = tqm.transform_quantize_mgpu(a, t, fmt, block_sizes=bs, impl="pallas", k1_parts=parts)
        return q.codes, q.scales
    return lambda a: f(a, parts)


def xla_fn(t, fmt=MXFP4()):
    @jax.jit
    def f(a):
        q = tq.reference_transform_quantize(a, t, fmt)
        return q.codes, q.scales
    return f


def torch_copy_bandwidth(nbytes=2**31):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    t = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e9


BS = tq.BlockSizes
# Candidate tilings timed per shape; the fastest is reported (the paper autotunes BR per shape the same way).
CANDIDATES = {
    "q4": {"br32_bd128_w4": BS(block_rows=32, block_cols=128, num_warps=4),
           "br64_bd128_w8": BS(block_rows=64, block_cols=128, num_warps=8)},
    "scale": {"br32_bd128_w4": BS(block_rows=32, block_cols=128, num_warps=4),
              "br64_bd128_w8": BS(block_rows=64, block_cols=128, num_warps=8)},
    "k1": {"default": None,  # default_block_sizes(kind, m, d, dtype): fori BD=256 on large grids, 2 fp16 parts
           "br64_bd32_w4_split": BS(block_rows=64, block_cols=32, num_warps=4)},
    "fwht": {"shuffle_r1_w16": BS(fwht_rows=1, fwht_num_warps=16),
             "shuffle_r2_w16": BS(fwht_rows=2, fwht_num_warps=16)},
}
CANDIDATES["k2"] = CANDIDATES["k1"]
# Mosaic GPU kernels (kind "mgpu_q4" / "mgpu_k1"): run where transform_quantize_mgpu.supports() the shape
MB = tqm.MgpuBlockSizes
CANDIDATES["mgpu_q4"] = {"br64_bd512": MB(block_rows=64, block_cols=512),
                         "br64_bd512_seq2": MB(block_rows=64, block_cols=512, sequential_cols=True)}
CANDIDATES["mgpu_k1"] = {"br64_bd256_p3": MB(block_rows=64, block_cols=256),
                         "br64_bd256_p3_seq2": MB(block_rows=64, block_cols=256, sequential_cols=True)}
# Wide tiles walked by a lax.fori_loop (scf.for, software-pipelined by Triton over num_stages): --candidates fori
FORI_CANDIDATES = {
    "k1": {"br64_bd32_w4_split": CANDIDATES["k1"]["br64_bd32_w4_split"],
           "br64_bd256_fori_s3": BS(block_rows=64, block_cols=256, num_stages=3),
           "br64_bd512_fori_s3": BS(block_rows=64, block_cols=512, num_stages=3)},
}
FORI_CANDIDATES["k2"] = FORI_CANDIDATES["k1"]
XLA_ALL_SHAPES = {(4096, 4096), (4096, 16384)}


def bench_shape(m, d, dtype, kinds, bs, n_iter, with_xla=True):
    itemsize = jnp.dtype(dtype).itemsize
    in_bytes = m * d * itemsize
    n_buf = max(2, min(32, math.ceil(4 * bench_inputs.L2_BYTES / in_bytes)))
    bufs = bench_inputs.activation_sets(m, d, dtype, n_buf)
    ts = bench_inputs.prepared_transforms(d)
    io_bytes = in_bytes + m * d // 2 + m * d // 32
    row = {"m": m, "d": d, "dtype": jnp.dtype(dtype).name, "io_bytes": io_bytes, "n_buffers": n_buf, "us": {},
           "method": {}, "kernels": {}}
    _t = timing.device_time(bench_inputs.copy_fn(), bufs, n_iter=n_iter)
    t_copy, meth = _t.us, _t.method
    row["us"]["copy"] = t_copy
    row["copy_GBps"] = 2 * in_bytes / (t_copy * 1e-6) / 1e9
    for kind in kinds:
        base = kind[5:] if kind.startswith("mgpu_") else kind
        if base not in ts:
            continue
        t = ts[base]
        cands = {"given": bs} if bs is not None else CANDIDATES[kind]
        if DEFAULTS_ONLY:
            cands = {"default": None}
        best = None
        for vname, cbs in cands.items():
            if kind.startswith("mgpu_") and not tqm.supports(base, (m, d), dtype, cbs):
                continue
            try:
                fn = mgpu_kernel_fn(t, cbs, dtype) if kind.startswith("mgpu_") else bench_inputs.quantize_fn(t, cbs)
                _t = timing.device_time(fn, bufs, n_iter=n_iter)
                us, meth, names = _t.us, _t.method, list(_t.kernels)
            except Exception as e:  # noqa: BLE001 - record and go on
                row.setdefault("errors", {})[f"{kind}/{vname}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {kind}/{vname}: ERROR {type(e).__name__}: {str(e)[:300]}")
                continue
            row.setdefault("candidates_us", {})[f"{kind}/{vname}"] = us
            if best is None or us < best[0]:
                best = (us, meth, names, vname)
        if best is None:
            row["us"][kind] = None
            continue
        us, meth, names, vname = best
        row["us"][kind] = us
        row["method"][kind] = meth
        row["kernels"][kind] = names
        row.setdefault("variant", {})[kind] = vname
        row.setdefault("GBps", {})[kind] = (io_bytes + extra_bytes(t)) / (us * 1e-6) / 1e9
    if with_xla:
        for kind in (kinds if (m, d) in XLA_ALL_SHAPES else ("k1",)):
            if kind not in ts:
                continue
            try:
                _t = timing.device_time(xla_fn(ts[kind]), bufs, n_iter=max(10, n_iter // 4))
                us, meth, names = _t.us, _t.method, list(_t.kernels)
                row["us"][f"xla_{kind}"] = us
                row["method"][f"xla_{kind}"] = meth
            except Exception as e:  # noqa: BLE001
                row["us"][f"xla_{kind}"] = None
                print(f"  xla_{kind}: ERROR {e!r}"[:300])
    del bufs
    return row


DEFAULTS_ONLY = False  # --candidates defaults: each kind with its default tiling only


def derive(row, copy_bw):
    us = row["us"]
    row["copy_floor_us"] = row["io_bytes"] / (copy_bw * 1e9) * 1e6
    row["frac_of_copy_bw"] = {k: row["GBps"][k] / copy_bw for k in row.get("GBps", {})}

    def ratio(a, b):
        return us[a] / us[b] if us.get(a) and us.get(b) else None

    row["ratios"] = {"scale/k1": ratio("scale", "k1"), "scale/k2": ratio("scale", "k2"),
                     "fwht/k2": ratio("fwht", "k2"), "xla/k1": ratio("xla_k1", "k1"),
                     "scale/mgpu_k1": ratio("scale", "mgpu_k1"), "k1/mgpu_k1": ratio("k1", "mgpu_k1"),
                     "q4/mgpu_q4": ratio("q4", "mgpu_q4")}
    for k in ("q4", "scale", "k2", "fwht"):
        if us.get(f"xla_{k}"):
            row["ratios"][f"xla_{k}/{k}"] = ratio(f"xla_{k}", k)
    p = paper_row(row["m"], row["d"])
    row["paper_us"] = p
    row["paper_ratios"] = {
        "scale/k1": p["scale"] / p["k1"] if p else None, "scale/k2": p["scale"] / p["k2"] if p else None,
        "fwht/k2": p["fwht"] / p["k2"] if "fwht" in p else None}
    return row


def fmt_table(rows):
    head = (f"{'m':>5} {'d':>6} | {'Q4':>7} {'Scale':>7} {'K1':>7} {'K2':>7} {'FWHT':>7} {'XLA':>7} {'copy':>7} "
            f"{'mQ4':>7} {'mK1':>7} | "
            f"{'K1 %cp':>6} | {'S/K1':>5} {'S/K2':>5} {'F/K2':>5} {'X/K1':>5} | paper S/K1 S/K2 F/K2")
    lines = [head, "-" * len(head)]

    def f(v, w=7, p=2):
        return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) and v is not None else f"{'-':>{w}}"

    for r in rows:
        us, ra, pr = r["us"], r["ratios"], r["paper_ratios"]
        lines.append(
            f"{r['m']:>5} {r['d']:>6} | {f(us.get('q4'))} {f(us.get('scale'))} {f(us.get('k1'))} {f(us.get('k2'))} "
            f"{f(us.get('fwht'))} {f(us.get('xla_k1'))} {f(us.get('copy'))} {f(us.get('mgpu_q4'))} "
            f"{f(us.get('mgpu_k1'))} | "
            f"{f(100 * r['frac_of_copy_bw'].get('k1', float('nan')), 6, 1)} | {f(ra['scale/k1'], 5)} "
            f"{f(ra['scale/k2'], 5)} {f(ra['fwht/k2'], 5)} {f(ra['xla/k1'], 5)} | {f(pr['scale/k1'], 5)} "
            f"{f(pr['scale/k2'], 5)} {f(pr['fwht/k2'], 5)}")
    return "\n".join(lines)


def sweep(dtype, n_iter):
    """Tiling variants on a few shapes: prints and returns µs per (kind, variant)."""
    variants = {
        "br32_bd128_w4": tq.BlockSizes(block_rows=32, block_cols=128, num_warps=4),
        "br64_bd128_w4": tq.BlockSizes(block_rows=64, block_cols=128, num_warps=4),
        "br128_bd128_w4": tq.BlockSizes(block_rows=128, block_cols=128, num_warps=4),
        "br64_bd128_w8": tq.BlockSizes(block_rows=64, block_cols=128, num_warps=8),
        "br64_bd256_w4": tq.BlockSizes(block_rows=64, block_cols=256, num_warps=4),
        "br64_bd32_w4": tq.BlockSizes(block_rows=64, block_cols=32, num_warps=4),
        "br64_bd128_w4_p1": tq.BlockSizes(block_rows=64, block_cols=128, num_warps=4, dot_passes=1),
    }
    fwht_variants = {
        "shuffle_r1_w8": tq.BlockSizes(fwht_rows=1, fwht_num_warps=8),
        "shuffle_r1_w16": tq.BlockSizes(fwht_rows=1, fwht_num_warps=16),
        "shuffle_r2_w16": tq.BlockSizes(fwht_rows=2, fwht_num_warps=16),
    }
    results = []
    for m, d in SWEEP_SHAPES:
        in_bytes = m * d * jnp.dtype(dtype).itemsize
        bufs = bench_inputs.activation_sets(m, d, dtype, max(2, min(32, math.ceil(4 * bench_inputs.L2_BYTES / in_bytes))))
        ts = bench_inputs.prepared_transforms(d)
        t_copy = timing.device_time(bench_inputs.copy_fn(), bufs, n_iter=n_iter).us
        print(f"sweep ({m}, {d}) copy {t_copy:.2f} us")
        for kind in ("q4", "scale", "k1", "k2"):
            for vname, bs in variants.items():
                if kind in ("k1", "k2") and vname.endswith("_loop"):
                    continue
                if kind in ("q4", "scale") and vname.endswith("_p1"):
                    continue
                try:
                    us = timing.device_time(bench_inputs.quantize_fn(ts[kind], bs), bufs, n_iter=n_iter).us
                except Exception as e:  # noqa: BLE001
                    print(f"  {kind:5s} {vname:22s} ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                print(f"  {kind:5s} {vname:22s} {us:8.2f} us")
                results.append({"m": m, "d": d, "kind": kind, "variant": vname, "us": us, "copy_us": t_copy})
        if "fwht" in ts:
            for vname, bs in fwht_variants.items():
                try:
                    us = timing.device_time(bench_inputs.quantize_fn(ts["fwht"], bs), bufs, n_iter=n_iter).us
                except Exception as e:  # noqa: BLE001
                    print(f"  fwht  {vname:22s} ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                print(f"  fwht  {vname:22s} {us:8.2f} us")
                results.append({"m": m, "d": d, "kind": "fwht", "variant": vname, "us": us, "copy_us": t_copy})
        del bufs
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/transform_quantize.json")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--shapes", default="all", help="'all' or a list like 4096x4096,512x3072")
    ap.add_argument("--sweep", action="store_true", help="tiling sweep instead of the table")
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--kinds", default="q4,scale,k1,k2,fwht")
    ap.add_argument("--candidates", default="default", choices=["default", "fori", "defaults"],
                    help="'default': the CANDIDATES tilings per kind, fastest reported; 'fori': the wide-tile ones; "
                         "'defaults': only each kind's default tiling (one timing per kind)")
    ap.add_argument("--xla", default="all", choices=["all", "big", "none"],
                    help="XLA's fusion of the reference: K1 at every shape ('all'), only at 4096x4096/4096x16384 "
                         "('big'), or not at all")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining shapes are skipped")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="size of each buffer of the copy-bandwidth probe")
    args = ap.parse_args(argv)
    t_start = time.time()
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    meta = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "dtype": dtype.name, "block_sizes": dataclasses.asdict(tq.BlockSizes()), "iters": args.iters}
    if args.sweep:
        res = sweep(dtype, args.iters)
        out = {"meta": meta, "sweep": res}
    else:
        shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in
                                                      args.shapes.split(",")]
        rows_big = max(1, int(8192 * args.copy_gib))
        big = bench_inputs.activation_sets(rows_big, 65536, jnp.float16, 2) if dev.platform == "gpu" else bench_inputs.activation_sets(256, 1024,
                                                                                                     jnp.float16, 2)
        _t = timing.device_time(bench_inputs.copy_fn(), big, n_iter=30)
        copy_us, copy_method = _t.us, _t.method
        copy_bw = 2 * big[0].size * 2 / (copy_us * 1e-6) / 1e9
        del big
        meta.update(copy_GBps_xla=copy_bw, copy_method=copy_method, copy_GBps_torch=torch_copy_bandwidth())
        print(f"device {meta['device']} jax {meta['jax']}: copy {copy_bw:.0f} GB/s (XLA), "
              f"{meta['copy_GBps_torch'] or float('nan'):.0f} GB/s (torch copy_)")
        rows = []
        out = {"meta": meta, "rows": rows}
        global DEFAULTS_ONLY
        DEFAULTS_ONLY = args.candidates == "defaults"
        meta["candidates"] = args.candidates
        for m, d in shapes:
            t0 = time.time()
            if t0 - t_start > args.deadline:
                print(f"deadline: skipping ({m}, {d})")
                continue
            if args.candidates == "fori":
                CANDIDATES.update(FORI_CANDIDATES)
            with_xla = not args.no_xla and (args.xla == "all" or (args.xla == "big" and (m, d) in XLA_ALL_SHAPES))
            row = derive(bench_shape(m, d, dtype, tuple(args.kinds.split(",")), None, args.iters,
                                     with_xla=with_xla), copy_bw)
            rows.append(row)
            print(f"({m}, {d}) done in {time.time() - t0:.1f}s: " +
                  " ".join(f"{k}={v:.2f}" for k, v in row["us"].items() if v))
            # after every shape, so that a cut-off run keeps what it measured
            atomic_write_text(args.out, json.dumps(out, indent=1, default=str) + "\n")
        print(fmt_table(rows))
    atomic_write_text(args.out, json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
