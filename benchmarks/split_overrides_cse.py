"""Does a fused layer served as per-member slices run once? (``models.quantize_model.split_qlinear_overrides``)

A fused quantized layer ``[W_a; W_b; W_c]`` in a model without that fused site runs as three per-linear overrides,
each taking its rows of the layer's whole output. This compiles the three members' overrides on one input and one
member's alone, per served strategy, and counts the compiled program's GEMMs (``dot``) and kernels (``custom-call``:
Pallas / Mosaic GPU): equal counts mean XLA merged the members' identical calls into one forward.

    python3 benchmarks/split_overrides_cse.py --out $OUT/split_overrides_cse.json     # on the H200
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from kroquant_jax.qlinear import random_qlinear  # noqa: E402
from models.quantize_model import split_qlinear_overrides  # noqa: E402
from pallas_kernels import served as S  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--width", type=int, default=1024, help="d and each member's outputs (default 1024)")
    p.add_argument("--strategies", nargs="+", default=["dequant", "fp8_mgpu"])
    args = p.parse_args(argv)
    d = args.width
    layer = random_qlinear(jax.random.normal(jax.random.key(0), (3 * d, d)) / d ** 0.5, jax.random.key(1), 32)
    x = jax.random.normal(jax.random.key(2), (1024, d)).astype(jnp.bfloat16)
    counts = {}
    for strategy in args.strategies:
        options = S.ServeOptions(strategy=strategy)
        forward = functools.partial(lambda layer_, y, o: S.forward(layer_, y, options=o), o=options)
        overrides = split_qlinear_overrides(S.serve(layer, strategy=strategy), ["a", "b", "c"], forward)
        for label, keys in (("three_members", "abc"), ("one_member", "a")):
            text = jax.jit(lambda y, keys=keys: [overrides[k](y) for k in keys]).lower(x).compile().as_text()
            counts[f"{strategy}_{label}"] = {"custom_calls": text.count("custom-call("), "dots": text.count(" dot(")}
    device = jax.local_devices()[0]
    record = {"what": __doc__.split("\n")[0], "device": getattr(device, "device_kind", str(device)),
              "jax": jax.__version__, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat("T", "minutes"),
              "layer": [3 * d, d], "x": [1024, d], "counts": counts,
              "merged": {s: counts[f"{s}_three_members"] == counts[f"{s}_one_member"] for s in args.strategies}}
    atomic_write_json(args.out, record)
    print(json.dumps(record["counts"]), record["merged"])
    return record


if __name__ == "__main__":
    main()
