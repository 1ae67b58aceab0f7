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


def parse_tiling(spec: str) -> tuple[str, dict]:
    """``"name:field=int,..."`` -> ``(name, fields)`` over ``BlockSizes``' fields."""
    from pallas_kernels.transform_quantize import BlockSizes

    name, sep, body = spec.partition(":")
    known = {f.name for f in dataclasses.fields(BlockSizes)}
    if not sep or not name:
        raise ValueError(f"--tilings {spec!r}: expected NAME:FIELD=VALUE,...")
    fields = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"--tilings {spec!r}: {key!r} is not a BlockSizes field ({', '.join(sorted(known))})")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"--tilings {spec!r}: {key}={value!r} must be an integer") from None
    return name, fields


def parse_shape(text: str) -> tuple[int, int]:
    m, sep, d = text.partition("x")
    if not sep or not m.isdigit() or not d.isdigit() or int(d) % 32:
        raise ValueError(f"--shapes {text!r}: expected MxD with D a multiple of 32")
    return int(m), int(d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--shapes", nargs="+", default=[f"{m}x{d}" for m, d in SHAPES], help="MxD activation shapes")
    p.add_argument("--tilings", nargs="*", default=None, metavar="NAME:FIELD=VALUE,...",
                   help="tilings to time beside the default (default: the built-in candidates)")
    p.add_argument("--n-iter", type=int, default=30)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke run)")
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        tilings = TILINGS if args.tilings is None else dict(parse_tiling(s) for s in args.tilings)
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
        record["rows"].append(row)
        atomic_write_json(args.out, record)
        print(json.dumps({k: v for k, v in row.items() if k != "tilings"}), flush=True)
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
