"""The quantizer's FP8 output mode (``transform_quantize.transform_quantize_fp8``) on the H200: tilings of the K2
(Kronecker-LU) kernel on the activation shapes of the Ideogram 4 forward, checked, then timed.

The served FP8 strategies quantize every block linear's input with this call (two launches: the ``max_byte`` pre-pass
and the quantizing pass; ``round_to_input=False`` as the served layers run it), so its tiling is part of the W4A4
forward's time. Shapes: 4224 tokens (the packed 1K layout) x 4608 (q, k, v, o, w1|w3 inputs) and x 12288 (w2's
input); ``--shapes`` adds others. Input: bf16 activations with outlier channels (``pallas_kernels.bench_inputs``),
rotated over more bytes than the L2 holds; a random KroQuant transform near the Hadamard init.

Per tiling: the E4M3 bytes and row scales against the default tiling's, bit for bit (a tiling must not change the
result), then the device time of the whole call (CUPTI, ``kroquant_jax.timing.device_time``: both launches and the
XLA reduction between them, median per call after warm-up) and its share of the HBM bandwidth of a copy of the
bytes the call must move (bf16 in once, E4M3 out). A tiling that fails is recorded with its error.

The one-launch form (``transform_quantize_fp8(..., one_launch=True)``: programs of whole rows) at each of
``--one-launch-tilings`` (``BlockSizes`` fields; ``block_cols`` unused) for each transform kind of ``--kinds`` (K2;
K1 from the same Kronecker-LU parameters, so the same bytes), each checked bit for bit against the two-launch
default first.

The second phase of the other two ways (``act_encode="xla"`` / ``"two_phase"``): the same shapes quantized to packed
MXFP4 once, then their E4M3 re-encode timed as XLA's fusion (``fp8_encoding.mxfp4_to_e4m3``, what the served default
runs; ``xla_convert``: the same with ``arithmetic="convert"``, the f32 -> E4M3 conversion instruction instead of the
integer encoding) and as the Pallas kernel ``transform_quantize.reencode_e4m3`` at each of ``--reencode-tilings``,
every result checked bit for bit against XLA's first (bytes: packed codes and scale bytes in, E4M3 out).

    python3 benchmarks/transform_quantize_fp8_bench.py --out $OUT/tq_fp8.json
    python3 benchmarks/transform_quantize_fp8_bench.py --out $OUT/tq_fp8.json --shapes 4224x4608 \
        --tilings "br32_bd64:block_rows=32,block_cols=64"
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ((4224, 4608), (4224, 12288))
#: Tilings timed beside the default (``name: BlockSizes fields``).
TILINGS = {
    "br32_bd32": dict(block_rows=32, block_cols=32),
    "br128_bd32": dict(block_rows=128, block_cols=32, num_warps=8),
    "br64_bd64": dict(block_rows=64, block_cols=64),
    "br64_bd128": dict(block_rows=64, block_cols=128),
    "br64_bd128_s3": dict(block_rows=64, block_cols=128, num_stages=3),
    "br64_bd256_s3": dict(block_rows=64, block_cols=256, num_stages=3),
    "br32_bd256_s3": dict(block_rows=32, block_cols=256, num_stages=3),
    "br64_bd512_s3_w8": dict(block_rows=64, block_cols=512, num_stages=3, num_warps=8),
}
#: Tilings of the one-launch form timed beside its default (``default_block_sizes_one_launch``; ``BlockSizes`` fields).
ONE_LAUNCH_TILINGS = {f"br{br}_w{w}_s{st}": dict(block_rows=br, num_warps=w, num_stages=st)
                      for br, w, st in ((16, 4, 2), (16, 4, 4), (16, 8, 3), (32, 4, 3), (32, 8, 3))}
#: Tilings of the Pallas re-encode kernel (``reencode_e4m3``'s keyword arguments; ``default``: its defaults).
REENCODE_TILINGS = {
    "default": {},
    **{f"br{br}_bc{bc}_w{w}": dict(block_rows=br, block_cols=bc, num_warps=w)
       for br, bc, w in ((8, 1024, 4), (32, 256, 4), (16, 1024, 4), (16, 2048, 8), (32, 512, 4), (32, 1024, 8),
                         (64, 256, 4), (64, 512, 8), (4, 2048, 4))},
}


REENCODE_FIELDS = ("block_rows", "block_cols", "num_warps")


def parse_tiling(spec: str, known=None) -> tuple[str, dict]:
    """``"name:field=int,..."`` -> ``(name, fields)`` over ``known`` (default ``BlockSizes``' fields)."""
    if known is None:  # imported only here: a run stopped by an argument error need not import jax
        from pallas_kernels.transform_quantize import BlockSizes

        known = [f.name for f in dataclasses.fields(BlockSizes)]
    name, sep, body = spec.partition(":")
    known = set(known)
    if not sep or not name:
        raise ValueError(f"--tilings {spec!r}: expected NAME:FIELD=VALUE,...")
    fields = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"tiling {spec!r}: {key!r} is not one of the fields {', '.join(sorted(known))}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"tiling {spec!r}: {key}={value!r} must be an integer") from None
    return name, fields


def parse_shape(text: str) -> tuple[int, int]:
    m, sep, d = text.partition("x")
    if not sep or not m.isdigit() or not d.isdigit() or int(d) % 32:
        raise ValueError(f"--shapes {text!r}: expected MxD with D a multiple of 32")
    return int(m), int(d)


def time_one_launch(m: int, d: int, bufs: list, kind: str, tilings: dict, impl: str, n_iter: int,
                    copy_floor_us: float, want) -> dict:
    """The one-launch form with a ``kind`` (``"k2"``, ``"k1"``) transform at each tiling: checked bit for bit against
    ``want`` (the two-launch default's bytes and scales on the first buffer), then timed (CUPTI)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kroquant_jax import timing
    from kroquant_jax.formats import MXFP4
    from pallas_kernels import bench_inputs
    from pallas_kernels import transform_quantize as tq

    t = bench_inputs.prepared_transforms(d)["k2"]
    if kind == "k1":
        t = tq.PreparedTransform.from_blocks(t.dense_blocks())
    default = tq.default_block_sizes_one_launch(t.kind, m, d, jnp.bfloat16)
    out = {}
    for name, fields in {"default": {}, **tilings}.items():
        entry = out[name] = {"fields": fields}
        try:
            bs = dataclasses.replace(default, **fields)
            entry["block_sizes"] = str(bs)
            fn = jax.jit(lambda a, bs=bs: (lambda r: (r.values, r.scale))(tq.transform_quantize_fp8(
                a, t, MXFP4(), block_sizes=bs, impl=impl, round_to_input=False, one_launch=True)))
            got = [np.asarray(x) for x in fn(bufs[0])]
            entry["bit_exact_vs_default"] = bool(
                want is not None and np.array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
                and np.array_equal(got[1], want[1], equal_nan=True))
            tm = timing.device_time(fn, bufs, n_iter=n_iter)
            entry.update(us=tm.us, method=tm.method, kernels_us=tm.kernels_us, frac_of_copy_bw=copy_floor_us / tm.us,
                         status="ok")
        except Exception as err:  # noqa: BLE001 - recorded; the other tilings still run
            entry["status"] = f"{type(err).__name__}: {str(err)[:400]}"
    return out


def time_reencodes(m: int, d: int, bufs: list, t, tilings: dict, impl: str, n_iter: int, copy_us: float) -> dict:
    """The E4M3 re-encode of ``bufs``' packed MXFP4 (K2-quantized once): XLA's fusion, then the Pallas kernel at each
    tiling, each checked bit for bit against XLA's result on the first buffer, then timed (CUPTI)."""
    import jax
    import numpy as np

    from kroquant_jax import fp8_encoding as FE
    from kroquant_jax import timing
    from kroquant_jax.formats import MXFP4
    from pallas_kernels import transform_quantize as tq

    quantize = jax.jit(lambda a: tq.transform_quantize(a, t, MXFP4(), impl=impl, round_to_input=False))
    qs = [quantize(a) for a in bufs]
    io_bytes = m * d // 2 + m * d // 32 + m * d + 4 * m
    out = {"io_bytes": io_bytes, "copy_floor_us": io_bytes / (2 * m * d * 2 / copy_us), "variants": {}}
    rows = lambda r: (r.values, r.scale)  # noqa: E731
    fns = {"xla": jax.jit(lambda q: rows(FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False))),
           "xla_convert": jax.jit(lambda q: rows(FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False,
                                                                  arithmetic="convert")))}
    for name, fields in tilings.items():
        fns[f"pallas_{name}"] = jax.jit(lambda q, f=fields: rows(tq.reencode_e4m3(q, impl=impl, **f)))
    want = None
    for name, fn in fns.items():
        entry = out["variants"][name] = {"fields": tilings.get(name.removeprefix("pallas_"), {})}
        try:
            got = [np.asarray(x) for x in fn(qs[0])]
            want = got if want is None else want
            entry["bit_exact_vs_xla"] = bool(np.array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
                                             and np.array_equal(got[1], want[1], equal_nan=True))
            tm = timing.device_time(fn, qs, n_iter=n_iter)
            entry.update(us=tm.us, method=tm.method, frac_of_copy_bw=out["copy_floor_us"] / tm.us, status="ok")
        except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
            entry["status"] = f"{type(err).__name__}: {str(err)[:400]}"
    ok = {n: e for n, e in out["variants"].items() if e.get("status") == "ok" and e["bit_exact_vs_xla"]}
    if ok:
        out["best"] = min(ok, key=lambda n: ok[n]["us"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--shapes", nargs="+", default=[f"{m}x{d}" for m, d in SHAPES], help="MxD activation shapes")
    p.add_argument("--tilings", nargs="*", default=None, metavar="NAME:FIELD=VALUE,...",
                   help="tilings to time beside the default (default: the built-in candidates)")
    p.add_argument("--one-launch-tilings", nargs="*", default=None, metavar="NAME:FIELD=VALUE,...",
                   help="one-launch tilings beside its default (default: the built-in candidates; none given: "
                        "skip the one-launch form)")
    p.add_argument("--kinds", default="k2", help="comma-separated transform kinds of the one-launch timing (k2, k1)")
    p.add_argument("--reencode-tilings", nargs="*", default=None, metavar="NAME:FIELD=VALUE,...",
                   help="re-encode kernel tilings (block_rows, block_cols, num_warps; default: the built-in "
                        "candidates; none: skip the re-encode timing)")
    p.add_argument("--n-iter", type=int, default=30)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke run)")
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        tilings = TILINGS if args.tilings is None else dict(parse_tiling(s) for s in args.tilings)
        one_launch_tilings = (ONE_LAUNCH_TILINGS if args.one_launch_tilings is None else
                              dict(parse_tiling(s) for s in args.one_launch_tilings))
        kinds = [k for k in args.kinds.split(",") if k]
        if not kinds or set(kinds) - {"k1", "k2"}:
            raise ValueError(f"--kinds {args.kinds!r}: a comma-separated subset of k1,k2")
        reencode_tilings = (REENCODE_TILINGS if args.reencode_tilings is None else
                            dict(parse_tiling(s, REENCODE_FIELDS) for s in args.reencode_tilings))
    except ValueError as err:
        p.error(str(err))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kroquant_jax import timing
    from kroquant_jax.fileio import atomic_write_json
    from kroquant_jax.formats import MXFP4
    from pallas_kernels import bench_inputs
    from pallas_kernels import transform_quantize as tq

    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M"),
              "command": "python3 benchmarks/transform_quantize_fp8_bench.py " + " ".join(argv or sys.argv[1:]),
              "copy_GBps": None, "rows": []}
    copy = bench_inputs.copy_fn()
    impl = "interpret" if args.interpret else "pallas"
    for m, d in shapes:
        row = {"m": m, "d": d, "io_bytes": m * d * 2 + m * d + 4 * m, "tilings": {}}
        bufs = bench_inputs.activation_sets(m, d, jnp.bfloat16, max(2, min(16, math.ceil(
            4 * bench_inputs.L2_BYTES / (2 * m * d)))))
        t = bench_inputs.prepared_transforms(d)["k2"]
        default = tq.default_block_sizes(t.kind, m, d, jnp.bfloat16)
        candidates = {"default": {}, **tilings}
        copy_t = timing.device_time(copy, bufs, n_iter=args.n_iter)
        row["copy_us"] = copy_t.us
        row["copy_floor_us"] = row["io_bytes"] / (2 * m * d * 2 / copy_t.us)  # the call's bytes at copy bandwidth
        want = None
        for name, fields in candidates.items():
            entry = row["tilings"][name] = {"fields": fields}
            try:
                bs = dataclasses.replace(default, **fields)
                entry["block_sizes"] = str(bs)
                fn = jax.jit(lambda a, bs=bs: (lambda r: (r.values, r.scale))(tq.transform_quantize_fp8(
                    a, t, MXFP4(), block_sizes=bs, impl=impl, round_to_input=False)))
                got = [np.asarray(x) for x in fn(bufs[0])]
                if want is None:
                    want = got
                entry["bit_exact_vs_default"] = bool(
                    np.array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
                    and np.array_equal(got[1], want[1], equal_nan=True))
                tm = timing.device_time(fn, bufs, n_iter=args.n_iter)
                entry.update(us=tm.us, method=tm.method, kernels_us=tm.kernels_us,
                             frac_of_copy_bw=row["copy_floor_us"] / tm.us, status="ok")
            except Exception as err:  # noqa: BLE001 - recorded; the other tilings still run
                entry["status"] = f"{type(err).__name__}: {str(err)[:400]}"
        ok = {n: e for n, e in row["tilings"].items() if e.get("status") == "ok" and e["bit_exact_vs_default"]}
        if ok:
            row["best"] = min(ok, key=lambda n: ok[n]["us"])
            row["best_speedup_vs_default"] = row["tilings"]["default"].get("us", math.nan) / ok[row["best"]]["us"]
        if one_launch_tilings:
            row["one_launch"] = {kind: time_one_launch(m, d, bufs, kind, one_launch_tilings, impl, args.n_iter,
                                                       row["copy_floor_us"], want) for kind in kinds}
        if reencode_tilings:
            row["reencode"] = time_reencodes(m, d, bufs, t, reencode_tilings, impl, args.n_iter, copy_t.us)
        record["rows"].append(row)
        atomic_write_json(args.out, record)
        print(json.dumps({k: v for k, v in row.items() if k != "tilings"}), flush=True)
    if any("one_launch" in row for row in record["rows"]):
        print("| m x d | one launch | µs | of copy bandwidth | bit-exact vs two-launch default |")
        for row in record["rows"]:
            for kind, entries in row.get("one_launch", {}).items():
                for name, e in entries.items():
                    if e.get("status") == "ok":
                        print(f"| {row['m']}x{row['d']} | {kind} {name} | {e['us']:.1f} | {e['frac_of_copy_bw']:.0%} | "
                              f"{e['bit_exact_vs_default']} |")
                    else:
                        print(f"| {row['m']}x{row['d']} | {kind} {name} | {e['status'][:90]} | | |")
    if any("reencode" in row for row in record["rows"]):
        print("| m x d | re-encode | µs | of copy bandwidth | bit-exact vs XLA |")
        for row in record["rows"]:
            for name, e in row.get("reencode", {}).get("variants", {}).items():
                if e.get("status") == "ok":
                    print(f"| {row['m']}x{row['d']} | {name} | {e['us']:.1f} | {e['frac_of_copy_bw']:.0%} | "
                          f"{e['bit_exact_vs_xla']} |")
                else:
                    print(f"| {row['m']}x{row['d']} | {name} | {e['status'][:90]} | | |")
    print("| m x d | tiling | µs | of copy bandwidth | bit-exact vs default |")
    for row in record["rows"]:
        for name, e in row["tilings"].items():
            if e.get("status") == "ok":
                print(f"| {row['m']}x{row['d']} | {name} | {e['us']:.1f} | {e['frac_of_copy_bw']:.0%} | "
                      f"{e['bit_exact_vs_default']} |")
            else:
                print(f"| {row['m']}x{row['d']} | {name} | {e['status'][:90]} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
