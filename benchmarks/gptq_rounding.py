"""GPTQ rounding vs round-to-nearest on a captured layer set: after Hadamard-32, or inside the recipes.

Without ``--recipes``, for each layer: rows split in half (seeded), ``H = (A_fit T)^T (A_fit T)`` with ``T`` the block-diagonal normalized
Hadamard of 32, GPTQ (``kroquant_jax.gptq``) on ``W T`` against ``formats.fake_quant(W T)``; the relative output error
``||A W^T - A_T Q^T|| / ||A W^T||`` on the held-out rows, weights only and W4A4 (activations fake-quantized too).

    python -m benchmarks.gptq_rounding --layer-set runs/demo/layer_set.safetensors --out results.json \
        [--match transformer_blocks.0.] [--layers 3]

With ``--recipes [SPEC ...]`` (default :data:`RECIPE_METHODS`): ``kroquant_jax.calibrate.quantize_layer_set`` for every
method spec (``<recipe>`` or ``<recipe>:<gptq order>``, the order ``branch_first`` or ``gptq_first``,
``GPTQConfig.lowrank_order``) on the chosen layers with the same recipe settings (the flags of
``calibrate.add_recipe_arguments``); reports each layer's ``heldout_error`` (relative W4A4 output error of the stored
layer on the test rows, which nothing was chosen on), the mean over layers, for each pair (method with ``+gptq``, the
same method without) the mean per-layer reduction ``1 - error(GPTQ) / error(RTN)`` and the fraction of layers it
lowers, and for each ``:branch_first`` / ``:gptq_first`` pair the fraction of layers where branch-first is lower.
The JSON is rewritten after every method (an interrupted run keeps the methods that finished).

    python -m benchmarks.gptq_rounding --layer-set runs/demo/layer_set.safetensors --match transformer_blocks.4. \
        --recipes --rank 0.125 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import calibrate, fileio, formats, gptq, layerset
from kroquant_jax.transforms import base as tbase

_HI = jax.lax.Precision.HIGHEST


RECIPE_METHODS = ("hadamard32", "hadamard32+gptq", "hadamard32+loraq", "hadamard32+gptq+loraq:branch_first",
                   "hadamard32+gptq+loraq:gptq_first", "smoothed_kroquant", "smoothed_kroquant+gptq",
                   "smoothed_kroquant+loraq", "smoothed_kroquant+gptq+loraq:branch_first",
                   "smoothed_kroquant+gptq+loraq:gptq_first", "svdquant", "svdquant+gptq:branch_first",
                   "svdquant+gptq:gptq_first")


def _rtn_spec(spec: str) -> str:
    """The same method with round-to-nearest: ``+gptq`` and the order dropped."""
    name = spec.partition(":")[0]
    return "+".join(p for p in name.split("+") if p != "gptq")


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
    p.add_argument("--recipes", nargs="*", metavar="SPEC",
                   help="compare these recipe specs '<recipe>[:<branch_first|gptq_first>]' instead (no SPEC: "
                        "RECIPE_METHODS)")
    calibrate.add_recipe_arguments(p)
    args = p.parse_args(argv)
    recipes = {}
    for spec in ([] if args.recipes is None else args.recipes or list(RECIPE_METHODS)):
        name, _, order = spec.partition(":")
        recipe = calibrate.recipe_from_args(name, argparse.Namespace(**{**vars(args),
                                                                        "gptq_order": order or args.gptq_order}))
        if order and recipe.gptq is None:
            raise SystemExit(f"--recipes {spec!r}: an order after ':' needs a '+gptq' recipe")
        recipes[spec] = recipe
    layers = layerset.load_layer_set(args.layer_set)
    names = [n for n in sorted(layers) if args.match in n][: args.layers or None]
    if not names:
        raise SystemExit(f"--match {args.match!r}: no layer of {args.layer_set} matches")
    if recipes:
        return _compare_recipes(args, recipes, {n: layers[n] for n in names})
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


def _compare_recipes(args, recipes, subset):
    names = list(subset)
    per_method, seconds = {}, {}
    for spec, recipe in recipes.items():
        t0 = time.time()
        _, reports = calibrate.quantize_layer_set(subset, recipe)
        seconds[spec] = round(time.time() - t0, 1)
        per_method[spec] = {n: {k: reports[n][k] for k in ("heldout_error", "weight_error")} for n in names}
        print(f"{spec:48s} {np.mean([r['heldout_error'] for r in per_method[spec].values()]):.4f} "
              f"({seconds[spec]} s)", flush=True)
        summary = _write(args, names, per_method, seconds)  # after every method: an interrupted run keeps the rest
    print(json.dumps(summary, indent=1))


def _write(args, names, per_method, seconds):
    summary = {}
    for spec, rows in per_method.items():
        err = np.asarray([rows[n]["heldout_error"] for n in names])
        entry = {"heldout_error_mean": float(err.mean())}
        base = _rtn_spec(spec)
        if base != spec and base in per_method:
            rtn = np.asarray([per_method[base][n]["heldout_error"] for n in names])
            entry.update(vs=base, reduction=float(1 - np.mean(err / rtn)), better_fraction=float(np.mean(err < rtn)))
        other = spec.replace(":branch_first", ":gptq_first")
        if other != spec and other in per_method:
            err_other = np.asarray([per_method[other][n]["heldout_error"] for n in names])
            entry.update(branch_first_better_fraction=float(np.mean(err < err_other)),
                         branch_first_vs_gptq_first=float(1 - np.mean(err / err_other)))
        summary[spec] = entry
    result = {"layer_set": args.layer_set, "match": args.match, "layers": names, "device": str(jax.devices()[0]),
              "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "settings": {k: v for k, v in vars(args).items() if k not in ("recipes", "out") and v is not None},
              "seconds": seconds, "summary": summary, "per_layer": per_method}
    fileio.atomic_write_json(args.out, result)
    return summary


if __name__ == "__main__":
    main()
