"""GPTQ rounding vs round-to-nearest on a captured layer set, after the Hadamard-32 transform (held-out rows).

For each layer: rows split in half (seeded), ``H = (A_fit T)^T (A_fit T)`` with ``T`` the block-diagonal normalized
Hadamard of 32, GPTQ (``kroquant_jax.gptq``) on ``W T`` against ``formats.fake_quant(W T)``; the relative output error
``||A W^T - A_T Q^T|| / ||A W^T||`` on the held-out rows, weights only and W4A4 (activations fake-quantized too).

    python -m benchmarks.gptq_rounding --layer-set runs/demo/layer_set.safetensors --out results.json \
        [--match transformer_blocks.0.] [--layers 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import fileio, formats, gptq, layerset
from kroquant_jax.transforms import base as tbase

_HI = jax.lax.Precision.HIGHEST


def _errors(w, a, fmt, variants):
    n = a.shape[0]
    perm = np.random.default_rng(0).permutation(n)
    fit, held = jnp.asarray(a[perm[: n // 2]]), jnp.asarray(a[perm[n // 2:]])
    d = w.shape[1]
    blocks = jnp.asarray(np.broadcast_to(tbase.normalized_hadamard(32), (d // 32, 32, 32)), jnp.float32)
    wt = tbase.apply_to_weights(jnp.asarray(w, jnp.float32), blocks)  # W T^{-T} = W T (orthogonal)
    fit_t, held_t = tbase.apply_to_activations(fit, blocks), tbase.apply_to_activations(held, blocks)
    h = jnp.matmul(fit_t.T, fit_t, precision=_HI)
    ref = jnp.matmul(held, jnp.asarray(w, jnp.float32).T, precision=_HI)
    held_q = formats.fake_quant(held_t, fmt)
    out = {}
    for name, kw in variants.items():
        q = formats.fake_quant(wt, fmt) if kw is None else gptq.gptq_fake_quant(wt, h, fmt, **kw)
        for act, x in (("w", held_t), ("w4a4", held_q)):
            y = jnp.matmul(x, q.T, precision=_HI)
            out[f"{name}/{act}"] = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer-set", required=True, help="layer set (.safetensors/.npz) from kroquant capture / demo")
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--match", default="", help="only the layers whose name contains this (default: all)")
    p.add_argument("--layers", type=int, default=0, help="first N (matching) layers only (0: all; default 0)")
    args = p.parse_args(argv)
    layers = layerset.load_layer_set(args.layer_set)
    names = [n for n in sorted(layers) if args.match in n][: args.layers or None]
    if not names:
        raise SystemExit(f"--match {args.match!r}: no layer of {args.layer_set} matches")
    variants = {"rtn": None, "gptq": {}, "gptq_act_order": {"act_order": True}}
    per_layer, t0 = {}, time.time()
    for name in names:
        w, _, a = layers[name]
        per_layer[name] = {fmt.name: _errors(w, a, fmt, variants) for fmt in (formats.MXFP4(), formats.NVFP4())}
        print(name, {f: round(v["gptq/w"] / v["rtn/w"], 3) for f, v in per_layer[name].items()}, flush=True)
    summary = {}
    for fmt in ("mxfp4", "nvfp4"):
        for key in per_layer[names[0]][fmt]:
            summary[f"{fmt}/{key}"] = float(np.mean([per_layer[n][fmt][key] for n in names]))
        for act in ("w", "w4a4"):
            ratio = [per_layer[n][fmt][f"gptq/{act}"] / per_layer[n][fmt][f"rtn/{act}"] for n in names]
            summary[f"{fmt}/gptq_reduction/{act}"] = float(1 - np.mean(ratio))
            summary[f"{fmt}/gptq_better_fraction/{act}"] = float(np.mean(np.asarray(ratio) < 1))
    result = {"layer_set": args.layer_set, "num_layers": len(names), "device": str(jax.devices()[0]),
              "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "seconds": round(time.time() - t0, 1), "summary": summary, "per_layer": per_layer}
    fileio.atomic_write_json(args.out, result)
    for k, v in summary.items():
        print(f"{k:40s} {v:.4f}")


if __name__ == "__main__":
    main()
