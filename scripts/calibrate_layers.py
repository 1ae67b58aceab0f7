"""Calibrate a layer set with every method side by side; print and save a per-layer table and a plot.

The metric is the relative output error ``||Ô - A W^T||_F / ||A W^T||_F`` on each layer's test rows (the same rows
for every method, used by nothing else: calibration and selection use their own disjoint slices), where ``Ô`` is the
quantized layer's eq. 11 output without its bias. The recipe settings (``--calib-steps``, ``--rank``, ...) are
:func:`kroquant_jax.calibrate.add_recipe_arguments`'s, shared with ``kroquant evaluate`` and
``kroquant quantize-checkpoint``.

Examples::

    # synthetic DiT-like layers (d in {1152, 4608}), all methods, paper settings
    kroquant calibrate --synthetic dit --out runs/calib_synthetic
    # a captured layer set (models.capture / layerset.save_layer_set), a subset of methods, a resumable store
    kroquant calibrate --layers pixart_layers.npz --methods rtn kroquant kroquant+loraq --store runs/st
    # quick check: the first layer of each shape, 3 methods (its time: compiling a program per method and shape)
    kroquant calibrate --synthetic tiny --fast
    # keep the compiled programs for the next run with the same shapes and settings (JAX's persistent cache)
    kroquant calibrate --synthetic dit --compile-cache ~/.cache/kroquant-jax

``--fast`` is a smoke test, not a measurement: only the first layer of each weight shape, the methods rtn, hadamard32
and kroquant unless ``--methods`` names others, 20 calibration steps, 128 + 32 + 64 rows, LoRaQ 30 + 10 steps at rank
<= 32, a 5 x 5 SmoothQuant grid (any of these given explicitly wins); it prints what it kept.

A ``--store`` folder is resumed only where its layers were computed from the same inputs and settings (each stored
layer carries their fingerprint); otherwise the run is refused with the layer and what changed, unless ``--overwrite``.
``--out`` is claimed the same way before any work (``calibrate_run.json``: the layer set's SHA-256 or the synthetic
set's settings, the methods and their recipes' settings): another run's results there are refused, or with
``--overwrite`` deleted first; the same run again replaces them.
"""


from __future__ import annotations

import datetime
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import calibrate, layerset, provenance, synthetic  # noqa: E402
from kroquant_jax.fileio import atomic_path, atomic_write_bytes  # noqa: E402
from scripts.common_args import (UserError, add_compile_cache, check_out_dir, check_out_file,  # noqa: E402
                                 positive_int, quantize_with_store, verb_parser)

EXAMPLES = ("--synthetic dit --out runs/calib_synthetic",
            "--layers pixart_layers.npz --methods rtn kroquant kroquant+loraq --store runs/st",
            "--synthetic tiny --fast")

FAST_METHODS = ("rtn", "hadamard32", "kroquant")
ALL_METHODS = ("rtn", "smoothquant", "hadamard32", "kroquant", "smoothed_kroquant", "rtn+loraq", "smoothquant+loraq",
               "hadamard32+loraq", "kroquant+loraq", "smoothed_kroquant+loraq", "svdquant", "smoothed_kroquant+gptq",
               "smoothed_kroquant+gptq+loraq")

SYNTHETIC = {
    # one attention projection and the two FFN projections of a PixArt-Σ-like block: d in {1152, 4608}
    "dit": {"blk.attn1.to_q": (1152, 1152), "blk.ff.net.0.proj": (4608, 1152), "blk.ff.net.2": (1152, 4608)},
    # the same three roles at a quarter of the width (CPU-sized): d in {256, 1024}
    "small": {"blk.attn1.to_q": (256, 256), "blk.ff.net.0.proj": (1024, 256), "blk.ff.net.2": (256, 1024)},
    "tiny": {"blk.attn1.to_q": (128, 128), "blk.ff.net.0.proj": (256, 128), "blk.ff.net.2": (128, 256)},
}


def settings_line(recipes: dict) -> str:
    """The settings of the methods that ran, for the table header (rows always; the others only where a method uses
    them)."""
    first = next(iter(recipes.values()))
    run = first.run
    parts = []
    trained = [r for r in recipes.values() if r.train and r.transform in ("kron_lu", "smoothed_kron")]
    if trained:
        c = trained[0].calibration
        parts.append(f"steps {c.steps} ({c.lr_schedule} lr, best of every {c.select_every})")
    parts.append(f"rows {run.num_rows}+{run.num_validation}+{run.num_test}")
    smooth = [r for r in recipes.values() if r.smooth_init]
    if smooth:
        parts.append(f"SmoothQuant grid {len(smooth[0].smoothquant.alphas)}x{len(smooth[0].smoothquant.betas)}")
    loraq = sorted({(r.loraq.rank, r.loraq.steps, r.loraq.rotation_steps) for r in recipes.values()
                    if r.lowrank == "loraq"})
    parts += [f"LoRaQ rank {k} {s}+{t} steps" for k, s, t in loraq]
    svd = sorted({(r.svdquant.rank, r.svdquant.refine_steps) for r in recipes.values() if r.lowrank == "svd"})
    parts += [f"SVD rank {k}" + (f", {n} refinements" if n else "") for k, n in svd]
    gptq = sorted({(g.damp, g.act_order, g.scales, g.lowrank_order) for g in (r.gptq for r in recipes.values())
                   if g is not None})
    parts += [f"GPTQ damp {d}" + (", act-order" if a else "") + f", {sc} scales, {o}" for d, a, sc, o in gptq]
    return ", ".join(parts)


def markdown_table(errors: dict, methods: list, layer_names: list) -> str:
    """Rows: layers (+ mean); columns: methods; best per row in bold."""
    lines = ["| layer | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    rows = [(n, [errors[m][n] for m in methods]) for n in layer_names]
    rows.append(("**mean**", [float(np.mean([errors[m][n] for n in layer_names])) for m in methods]))
    for name, vals in rows:
        best = int(np.argmin(vals))
        cells = [f"**{v:.4f}**" if i == best else f"{v:.4f}" for i, v in enumerate(vals)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(errors: dict, methods: list, layer_names: list, path: str, title: str,
         ylabel: str = "relative output error (test rows)") -> None:
    """Grouped bars ``errors[method][layer]`` per layer, one colour per method, written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(min(18.0, max(7.0, 1.4 * len(layer_names) + 5)), 4.5))
    x = np.arange(len(layer_names))
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, 20))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, [errors[m][n] for n in layer_names], width, label=m,
               color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20])
    ax.set_xticks(x)
    ax.set_xticklabels(layer_names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8, wrap=True)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


#: The files a calibrate run writes into --out (what another run's claim clears or refuses).
OUTPUTS = ("results.json", "table.md", "plot.png")
RUN_RECORD = "calibrate_run.json"


def claim_out(args, recipes) -> None:
    """--out as this run's (``provenance.claim_output_folder``, keyed by the layer set's SHA-256 or the synthetic
    set's settings, the methods and every numerics setting of their recipes): another run's results are refused, or
    with --overwrite deleted first."""
    source = ({"layers_sha256": provenance.file_digest(args.layers)} if args.layers else
              {"synthetic": args.synthetic, "synthetic_rows": args.synthetic_rows})
    key = {**source, "seed": args.seed, "fast": args.fast, "methods": list(args.methods),
           "recipes": {m: provenance.recipe_settings(r) for m, r in recipes.items()}}
    try:
        provenance.claim_output_folder(args.out, RUN_RECORD, key, OUTPUTS, overwrite=args.overwrite)
    except provenance.OutputFolderError as err:
        raise UserError(str(err)) from None


def main(argv=None):
    ap = verb_parser("calibrate", __doc__, EXAMPLES)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--layers", help="layer set file (.npz / .safetensors)")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="synthetic DiT-like layers")
    ap.add_argument("--synthetic-rows", type=positive_int, default=1536, help="activation rows per synthetic layer")
    ap.add_argument("--methods", nargs="+",
                    help="recipes to compare, a low-rank one optionally with its own rank: kroquant+loraq@64 "
                    f"(default: all {len(ALL_METHODS)}; with --fast: {' '.join(FAST_METHODS)})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the row draws (and the synthetic layers)")
    calibrate.add_recipe_arguments(ap)
    ap.add_argument("--fast", action="store_true",
                    help="a smoke test (its time is mostly compiling one program per method and weight shape): the "
                    "first layer of each shape, 3 methods, 20 steps, 128 + 32 + 64 "
                    "rows, LoRaQ rank <= 32 with 30 + 10 steps, a 5 x 5 SmoothQuant grid (explicit flags win)")
    ap.add_argument("--store", default=None, help="folder of resumable per-method stores")
    ap.add_argument("--overwrite", action="store_true",
                    help="recompute the layers of --store instead of refusing ones computed from other inputs, and "
                    "delete another run's results in --out instead of refusing them")
    ap.add_argument("--out", default="runs/calibrate_layers", help="folder for table.md, results.json, plot.png "
                    "(another run's there are refused; the same run's are replaced)")
    ap.add_argument("--plot", default=None, help="PNG path (default <out>/plot.png)")
    ap.add_argument("--progress", action="store_true", help="a progress bar per method")
    add_compile_cache(ap)
    args = ap.parse_args(argv)
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    chosen = dict(vars(args))  # the flags as the user gave them, before --fast fills in its settings
    if args.fast:  # each setting only where the user did not choose it
        fast = {"calib_steps": 20, "loraq_steps": 30, "rotation_steps": 10, "sq_grid": 5, "calib_rows": 128,
                "calib_validation": 32, "calib_test": 64, "rank": 32, "methods": list(FAST_METHODS)}
        for key, value in fast.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    if args.methods is None:
        args.methods = list(ALL_METHODS)
    try:  # bad method names fail before any work
        recipes = {m: calibrate.recipe_from_args(m, args, seed=args.seed, progress=args.progress)
                   for m in args.methods}
    except ValueError as err:
        ap.error(str(err))
    unused = calibrate.unused_stage_arguments(recipes, chosen)
    if unused:
        ap.error("; ".join(unused))
    check_out_dir(args.out)
    if args.plot:
        check_out_file(args.plot, "--plot")
    claim_out(args, recipes)

    if args.layers:
        layers = layerset.load_layer_set(args.layers)
        source = args.layers
    else:
        layers = synthetic.synthetic_layer_set(SYNTHETIC[args.synthetic], n=args.synthetic_rows, seed=args.seed)
        source = f"synthetic:{args.synthetic}"
    if args.fast:
        kept = [group[0] for group in layerset.group_by_shape({n: layers[n][0] for n in layers}).values()]
        layers = {n: layers[n] for n in layers if n in kept}
        print(f"--fast: {len(layers)} layer(s), the first of each weight shape, methods {' '.join(args.methods)}; "
              f"steps {args.calib_steps}, rows {args.calib_rows}+{args.calib_validation}+{args.calib_test} "
              "(a smoke test, not a measurement)", file=sys.stderr)
    names = list(layers)
    dev = jax.local_devices()[0]
    meta = {"source": source, "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "jax_version": jax.__version__, "device": dev.device_kind, "num_devices": jax.local_device_count(),
            "args": {k: v for k, v in vars(args).items() if k not in ("layers",)}}
    errors, reports, seconds = {}, {}, {}
    for m in args.methods:
        t0 = time.perf_counter()
        store = os.path.join(args.store, m.replace("+", "_")) if args.store else None
        _, rep = quantize_with_store(layers, recipes[m], store, args.overwrite, "--store", label=m)
        seconds[m] = round(time.perf_counter() - t0, 2)
        errors[m] = {n: rep[n]["heldout_error"] for n in names}
        reports[m] = rep
        print(f"{m:>26s}: mean {np.mean(list(errors[m].values())):.4f}  ({seconds[m]} s)", flush=True)
        atomic_write_bytes(os.path.join(args.out, "results.json"), json.dumps(
            {"meta": meta, "errors": errors, "seconds": seconds, "reports": reports}, indent=1, default=float).encode())
    table = markdown_table(errors, args.methods, names)
    header = (f"Relative output error on test rows ({source}; {meta['device']}, jax {meta['jax_version']}, "
              f"{meta['date_utc']} UTC; {settings_line(recipes)})")
    text = header + "\n\n" + table + "\n"
    print(text)
    atomic_write_bytes(os.path.join(args.out, "table.md"), text.encode())
    plot(errors, args.methods, names, args.plot or os.path.join(args.out, "plot.png"),
         f"{source}; {meta['device']}, jax {meta['jax_version']}, {meta['date_utc']} UTC")
    return errors


if __name__ == "__main__":
    main()
