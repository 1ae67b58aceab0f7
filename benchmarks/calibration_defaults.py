"""Old vs new calibration defaults on captured layers: per-layer TEST-row error of KroQuant (and smoothed KroQuant)
under the paper-literal settings and under each change of the new defaults (regularizer gradient, cosine learning
rate, best iterate on the validation rows), beside the Hadamard init and SmoothQuant.

Layers whose captured rows hold fewer distinct rows than the split needs (calibration + validation + test; e.g. the
testbed's cross-attention ``to_k``/``to_v``, whose rows are mostly one padding-token row) are left out and listed.

Usage::

    python benchmarks/calibration_defaults.py --layers layer_set.safetensors --out benchmarks/results/x.json \
        --plot docs/img/x.png
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import calibrate, layerset, objectives  # noqa: E402
from kroquant_jax.fileio import atomic_write_bytes  # noqa: E402
from scripts import calibrate_layers  # noqa: E402

NEW = calibrate.CalibrationConfig()
OLD = calibrate.PAPER_LITERAL
DETACHED = objectives.ObjectiveConfig(regularizer_grad="detached")
VARIANTS = {  # KroQuant calibration settings; "new" is the engine default
    "paper_literal": OLD,
    "detached": dataclasses.replace(OLD, objective=DETACHED),
    "detached+cosine": dataclasses.replace(OLD, objective=DETACHED, lr_schedule="cosine"),
    "detached+best": dataclasses.replace(OLD, objective=DETACHED, select_every=10),
    "ste+cosine+best": dataclasses.replace(NEW, objective=objectives.ObjectiveConfig(regularizer_grad="ste")),
    "new": NEW,
}


def usable_layers(layers: dict, run: calibrate.RunConfig) -> tuple[dict, dict]:
    """``(layers with enough distinct rows, {left-out name: distinct rows})``; kept layers use their distinct rows."""
    need = run.num_rows + run.num_validation + run.num_test
    kept, left_out = {}, {}
    for name, layer in layers.items():
        rows = np.unique(layer.activations, axis=0)
        if rows.shape[0] < need:
            left_out[name] = int(rows.shape[0])
        else:
            kept[name] = layerset.LayerData(layer.weight, layer.bias, rows)
    return kept, left_out


def plot(table: dict, names: list, path: str, title: str) -> None:
    """Per layer, each column's test error relative to Hadamard-32's (``kroquant calibrate``'s bar plot)."""
    base = {n: table["hadamard32"][n] for n in names}
    cols = [c for c in table if c != "hadamard32"]
    rel = {c: {n: table[c][n] / base[n] - 1 for n in names} for c in cols}
    short = [n.replace("transformer_blocks.", "b") for n in names]
    calibrate_layers.plot({c: dict(zip(short, rel[c].values())) for c in cols}, cols, short, path, title,
                          ylabel="test error / Hadamard-32 test error - 1")


def summarize(res: dict) -> dict:
    """``res`` with ``summary``: per column the mean test error and on how many layers it beats Hadamard-32."""
    had = res["test"]["hadamard32"]
    res["summary"] = {label: {"mean": float(np.mean(list(v.values()))),
                              "beats_hadamard": int(sum(v[n] < had[n] for n in v)), "layers": len(v)}
                      for label, v in res["test"].items()}
    for label, v in res["test_unguarded"].items():
        res["summary"][label]["unguarded_beats_hadamard"] = int(sum(v[n] < had[n] for n in v))
        res["summary"][label]["unguarded_mean"] = float(np.mean(list(v.values())))
    return res


def draw(record: dict, seed: int, path: str) -> None:
    """The plot of one seed's test errors from a record of :func:`main`."""
    first = record["seeds"][str(seed)]
    plot(first["test"], list(first["test"]["hadamard32"]), path, f"{record['layers_file']} (seed {seed}); {record['device']}, "
         f"jax {record['jax']}, {record['date_utc']} UTC; test rows")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", required=True, help="captured layer set (.safetensors / .npz)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="row-draw seeds")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="KroQuant calibration settings to compare")
    ap.add_argument("--smoothed", action="store_true", help="also SmoothQuant and smoothed KroQuant, old vs new")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", action="store_true", help="only draw --plot from an existing --out record")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.out) as f:
            draw(json.load(f), args.seeds[0], args.plot)
        return
    layers = layerset.load_layer_set(args.layers)
    record = {"layers_file": args.layers, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "variants": {k: repr(VARIANTS[k]) for k in args.variants}, "seeds": {}}
    for seed in args.seeds:
        run = calibrate.RunConfig(seed=seed)
        kept, left_out = usable_layers(layers, run)
        res = {"left_out_distinct_rows": left_out, "test": {}, "test_unguarded": {}, "validation": {}, "seconds": {}}
        for label in args.variants:
            cfg = VARIANTS[label]
            t0 = time.perf_counter()
            out = calibrate.calibrate_layers(kept, cfg, run=run)
            res["seconds"][label] = round(time.perf_counter() - t0, 1)
            res["test"][label] = {n: r.test_error for n, r in out.items()}
            res["test_unguarded"][label] = {n: r.test_errors["trained0"] for n, r in out.items()}
            res["validation"][label] = {n: r.validation_error for n, r in out.items()}
            res["test"]["hadamard32"] = {n: r.test_errors["init0"] for n, r in out.items()}
            print(f"seed {seed} {label:>18s}: test {np.mean(list(res['test'][label].values())):.5f} unguarded "
                  f"{np.mean(list(res['test_unguarded'][label].values())):.5f} ({res['seconds'][label]} s)",
                  flush=True)
            record["seeds"][str(seed)] = summarize(res)
            atomic_write_bytes(args.out, json.dumps(record, indent=1).encode())  # kept if a later variant is cut
        if args.smoothed:
            for label, cal in (("smoothquant", None), ("smoothed_kroquant paper_literal", OLD),
                               ("smoothed_kroquant new", NEW)):
                recipe = (calibrate.get_recipe("smoothquant", run=run) if cal is None else
                          calibrate.get_recipe("smoothed_kroquant", run=run,
                                               calibration=dataclasses.replace(cal, transform=None)))
                t0 = time.perf_counter()
                _, rep = calibrate.quantize_layer_set(kept, recipe)
                res["seconds"][label] = round(time.perf_counter() - t0, 1)
                res["test"][label] = {n: r["transform_test_error"] for n, r in rep.items()}
                print(f"seed {seed} {label}: test {np.mean(list(res['test'][label].values())):.5f}", flush=True)
                record["seeds"][str(seed)] = summarize(res)
                atomic_write_bytes(args.out, json.dumps(record, indent=1).encode())
        record["seeds"][str(seed)] = summarize(res)
        atomic_write_bytes(args.out, json.dumps(record, indent=1).encode())
    if args.plot:
        draw(record, args.seeds[0], args.plot)
    print(json.dumps({s: r["summary"] for s, r in record["seeds"].items()}, indent=1))


if __name__ == "__main__":
    main()
