"""GPTQ in the recipes on a captured layer set: round-to-nearest vs GPTQ, and the order of GPTQ and the low-rank branch.

Runs ``kroquant_jax.calibrate.quantize_layer_set`` for every method spec of ``--methods`` (each ``<spec>`` or
``<spec>:<gptq order>``, the order ``branch_first`` or ``gptq_first``, ``GPTQConfig.lowrank_order``) on the chosen
layers with the same recipe settings and reports each layer's ``heldout_error`` (relative W4A4 output error of the
stored layer on the test rows, which nothing was chosen on), the mean over layers, and for each pair (method with
``+gptq``, the same method without) the mean per-layer reduction ``1 - error(GPTQ) / error(RTN)`` and the fraction of
layers it lowers; for each ``:branch_first`` / ``:gptq_first`` pair the fraction of layers where branch-first is lower.
The JSON is rewritten after every method (an interrupted run keeps the methods that finished).

    python -m benchmarks.gptq_recipes --layer-set runs/demo/layer_set.safetensors --match transformer_blocks.4. \
        --rank 0.125 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import numpy as np

from kroquant_jax import calibrate, fileio, layerset

DEFAULT_METHODS = ("hadamard32", "hadamard32+gptq", "hadamard32+loraq", "hadamard32+gptq+loraq:branch_first",
                   "hadamard32+gptq+loraq:gptq_first", "smoothed_kroquant", "smoothed_kroquant+gptq",
                   "smoothed_kroquant+loraq", "smoothed_kroquant+gptq+loraq:branch_first",
                   "smoothed_kroquant+gptq+loraq:gptq_first", "svdquant", "svdquant+gptq:branch_first",
                   "svdquant+gptq:gptq_first")


def _rtn_spec(spec: str) -> str:
    """The same method with round-to-nearest: ``+gptq`` and the order dropped."""
    name = spec.partition(":")[0]
    return "+".join(p for p in name.split("+") if p != "gptq")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer-set", required=True, help="layer set (.safetensors/.npz) from kroquant capture / demo")
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--match", default="", help="only the layers whose name contains this (default: all)")
    p.add_argument("--layers", type=int, default=0, help="first N (matching) layers only (0: all; default 0)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="method specs '<recipe>' or '<recipe>:<branch_first|gptq_first>'")
    calibrate.add_recipe_arguments(p)
    args = p.parse_args(argv)
    recipes = {}
    for spec in args.methods:
        name, _, order = spec.partition(":")
        recipe = calibrate.recipe_from_args(name, argparse.Namespace(**{**vars(args),
                                                                        "gptq_order": order or args.gptq_order}))
        if order and recipe.gptq is None:
            raise SystemExit(f"--methods {spec!r}: an order after ':' needs a '+gptq' recipe")
        recipes[spec] = recipe
    layers = layerset.load_layer_set(args.layer_set)
    names = [n for n in sorted(layers) if args.match in n][: args.layers or None]
    if not names:
        raise SystemExit(f"--match {args.match!r}: no layer of {args.layer_set} matches")
    subset = {n: layers[n] for n in names}
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
              "settings": {k: v for k, v in vars(args).items() if k not in ("methods", "out") and v is not None},
              "seconds": seconds, "summary": summary, "per_layer": per_method}
    fileio.atomic_write_json(args.out, result)
    return summary


if __name__ == "__main__":
    main()
