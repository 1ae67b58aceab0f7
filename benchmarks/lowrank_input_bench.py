"""The low-rank branch's input ``h = x R^T`` (``pallas_kernels.w4a4_gemm.lowrank_h``), the two ways of rounding it
to bf16: the dot writes f32 and a convert rounds it (``dot_output="f32"``), or the dot writes bf16 itself
(``"bf16"``, the served layers' default). Checked (how many output elements differ between the two, on every input set, and
the largest difference in bf16 ulps), then timed: device time
(CUPTI, ``kroquant_jax.timing.device_time``: median per call over rotating input sets after warm-up), with the
kernels each launches per call.

Shapes are ``D:R`` pairs: the models' widths with the stand-in rank 128 of ``family_forward_w4a4.py`` per linear and
per shared-input group (PixArt-Σ 1152 with q|k|v = 384 and k|v = 256; FLUX.1 3072 with q|k|v = 384 and the single
block's q|k|v|proj_mlp = 512; Ideogram 4 4608).

    python3 benchmarks/lowrank_input_bench.py --out $OUT/lowrank_input.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPES = ("1152:128", "1152:256", "1152:384", "3072:128", "3072:384", "3072:512", "4608:128", "4608:384")


def _shape(spec: str) -> tuple[int, int]:
    try:
        d, r = (int(v) for v in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not D:R (two integers, e.g. 1152:384)") from None
    if d <= 0 or r <= 0:
        raise argparse.ArgumentTypeError(f"{spec!r}: D and R must be positive")
    return d, r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(s) for s in DEFAULT_SHAPES], metavar="D:R")
    p.add_argument("--ms", nargs="+", type=int, default=[4096, 512])
    p.add_argument("--n-iter", type=int, default=30)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kroquant_jax import timing
    from kroquant_jax.fileio import atomic_write_json
    from pallas_kernels.w4a4_gemm import LOWRANK_DOTS, lowrank_h

    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M"),
              "command": "python3 benchmarks/lowrank_input_bench.py " + " ".join(argv or sys.argv[1:]), "cases": []}
    fns = {dot: jax.jit(lambda s, dot=dot: lowrank_h(s[0], s[1], dot_output=dot)) for dot in LOWRANK_DOTS}
    for d, r in args.shapes:
        right = (jax.random.normal(jax.random.key(d + r), (r, d)) / np.sqrt(d)).astype(jnp.bfloat16)
        for m in args.ms:
            sets = [((jax.random.normal(jax.random.key(1000 * s + m), (m, d)) * 2.0).astype(jnp.bfloat16), right)
                    for s in range(3)]
            outs = {dot: [np.asarray(f(s)).view(np.uint16) for s in sets] for dot, f in fns.items()}
            diff = [np.abs(a.astype(np.int32) - b.astype(np.int32)) for a, b in zip(outs["f32"], outs["bf16"])]
            case = {"m": m, "d": d, "r": r, "differing_elements": int(sum(np.count_nonzero(e) for e in diff)),
                    "max_ulp_difference": int(max(e.max() for e in diff))}
            case["bit_equal"] = case["differing_elements"] == 0
            for dot, f in fns.items():
                t = timing.device_time(f, sets, n_iter=args.n_iter)
                case[dot] = {"us": t.us, "method": t.method, "kernels_us": t.kernels_us,
                             "launches": sum(t.kernel_launches.values())}
            case["bf16_speedup"] = case["f32"]["us"] / case["bf16"]["us"]
            record["cases"].append(case)
            atomic_write_json(args.out, record)
            print(json.dumps(case), flush=True)
    print("| m | d | r | f32 + convert µs (kernels) | bf16 dot µs (kernels) | f32 / bf16 | elements differing (max ulp) |")
    for c in record["cases"]:
        print(f"| {c['m']} | {c['d']} | {c['r']} | {c['f32']['us']:.2f} ({c['f32']['launches']}) | "
              f"{c['bf16']['us']:.2f} ({c['bf16']['launches']}) | {c['bf16_speedup']:.2f}x | "
              f"{c['differing_elements']} ({c['max_ulp_difference']}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
