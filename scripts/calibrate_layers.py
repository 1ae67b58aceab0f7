"""Calibrate a layer set with every method side by side; print and save a per-layer table and a plot.

The metric is the relative output error ``||Ô - A W^T||_F / ||A W^T||_F`` on each layer's held-out rows (the same
rows for every method), where ``Ô`` is the quantized layer's eq. 11 output without its bias.

Examples::

    # synthetic DiT-like layers (d in {1152, 4608}), all methods, paper settings
    kroquant calibrate --synthetic dit --out runs/calib_synthetic
    # a captured layer set (models.capture / layerset.save_layer_set), a subset of methods, a resumable store
    kroquant calibrate --layers pixart_layers.npz --methods rtn kroquant kroquant+loraq --store runs/st
    # quick CPU check
    kroquant calibrate --synthetic tiny --fast
    # keep the compiled programs for the next run with the same shapes and settings (JAX's persistent cache)
    kroquant calibrate --synthetic dit --compile-cache ~/.cache/kroquant-jax

A ``--store`` folder is resumed only where its layers were computed from the same inputs and settings (each stored
layer carries their fingerprint); otherwise the run is refused with the layer and what changed, unless ``--overwrite``.
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

from kroquant_jax import calibrate, layerset, lowrank, objectives, smoothquant, synthetic  # noqa: E402
from kroquant_jax.fileio import atomic_path, atomic_write_bytes  # noqa: E402
from scripts.common_args import nonnegative_int, positive_int, quantize_with_store, verb_parser  # noqa: E402

EXAMPLES = ("--synthetic dit --out runs/calib_synthetic",
            "--layers pixart_layers.npz --methods rtn kroquant kroquant+loraq --store runs/st",
            "--synthetic tiny --fast")

ALL_METHODS = ("rtn", "smoothquant", "hadamard32", "kroquant", "smoothed_kroquant", "rtn+loraq", "smoothquant+loraq",
               "hadamard32+loraq", "kroquant+loraq", "smoothed_kroquant+loraq", "svdquant")

SYNTHETIC = {
    # one attention projection and the two FFN projections of a PixArt-Σ-like block: d in {1152, 4608}
    "dit": {"blk.attn1.to_q": (1152, 1152), "blk.ff.net.0.proj": (4608, 1152), "blk.ff.net.2": (1152, 4608)},
    # the same three roles at a quarter of the width (CPU-sized): d in {256, 1024}
    "small": {"blk.attn1.to_q": (256, 256), "blk.ff.net.0.proj": (1024, 256), "blk.ff.net.2": (256, 1024)},
    "tiny": {"blk.attn1.to_q": (128, 128), "blk.ff.net.0.proj": (256, 128), "blk.ff.net.2": (128, 256)},
}


def build_recipe(method: str, args) -> calibrate.Recipe:
    grid = tuple(round(x, 4) for x in np.linspace(0.0, 1.0, args.sq_grid))
    has_branch = "+" in method or method == "svdquant"
    return calibrate.get_recipe(
        method,
        smooth_svd_rank=args.svd_rank if has_branch else 0,
        calibration=calibrate.CalibrationConfig(steps=args.steps, num_rows=args.rows, num_heldout=args.heldout,
                                                seed=args.seed, max_layers_per_program=args.max_layers_per_program,
                                                objective=objectives.ObjectiveConfig(precision=args.precision),
                                                progress=args.progress),
        smoothquant=smoothquant.SmoothQuantConfig(alphas=grid, betas=grid),
        loraq=lowrank.LoRaQConfig(rank=args.rank, steps=args.loraq_steps, rotation_steps=args.rotation_steps),
        svdquant=lowrank.SVDQuantConfig(rank=args.svd_rank, refine_steps=args.svd_refine))


def settings_line(args) -> str:
    """The settings of the methods that ran, for the table header (rows always; the others only where a method uses
    them)."""
    bases = {m.partition("+")[0] for m in args.methods}
    parts = []
    if bases & {"kroquant", "smoothed_kroquant"}:
        parts.append(f"steps {args.steps}")
    parts.append(f"rows {args.rows}+{args.heldout}")
    if bases & {"smoothquant", "smoothed_kroquant", "svdquant"}:
        parts.append(f"SmoothQuant grid {args.sq_grid}x{args.sq_grid}")
    if any(m.endswith("+loraq") for m in args.methods):
        parts.append(f"LoRaQ rank {args.rank} {args.loraq_steps}+{args.rotation_steps} steps")
    if "svdquant" in bases:
        parts.append(f"SVD rank {args.svd_rank}" + (f", {args.svd_refine} refinements" if args.svd_refine else ""))
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


def plot(errors: dict, methods: list, layer_names: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(layer_names) + 5), 4.5))
    x = np.arange(len(layer_names))
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, 20))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, [errors[m][n] for n in layer_names], width, label=m,
               color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20])
    ax.set_xticks(x)
    ax.set_xticklabels(layer_names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("relative output error (held-out rows)")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = verb_parser("calibrate", __doc__, EXAMPLES)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--layers", help="layer set file (.npz / .safetensors)")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="synthetic DiT-like layers")
    ap.add_argument("--synthetic-rows", type=positive_int, default=1280, help="activation rows per synthetic layer")
    ap.add_argument("--methods", nargs="+", default=list(ALL_METHODS), help="recipes to compare")
    ap.add_argument("--steps", type=nonnegative_int, default=100, help="transform optimisation (Adam) steps")
    ap.add_argument("--rows", type=positive_int, default=1024, help="calibration rows per layer")
    ap.add_argument("--heldout", type=positive_int, default=256, help="held-out rows per layer")
    ap.add_argument("--seed", type=int, default=0, help="seed of the row draws (and the synthetic layers)")
    ap.add_argument("--rank", type=positive_int, default=128, help="LoRaQ branch rank")
    ap.add_argument("--loraq-steps", type=nonnegative_int, default=500, help="LoRaQ factor optimisation steps")
    ap.add_argument("--rotation-steps", type=nonnegative_int, default=500, help="LoRaQ rotation optimisation steps")
    ap.add_argument("--svd-rank", type=positive_int, default=32, help="SVDQuant 16-bit branch rank")
    ap.add_argument("--svd-refine", type=nonnegative_int, default=0,
                    help="SVDQuant refinement candidates (paper: up to 100)")
    ap.add_argument("--sq-grid", type=positive_int, default=11, help="points per axis of the SmoothQuant (α, β) grid")
    ap.add_argument("--precision", default="highest", choices=["highest", "high", "default"],
                    help="matmul precision of the objective")
    ap.add_argument("--max-layers-per-program", type=positive_int, default=64,
                    help="at most this many stacked layers per compiled program (memory bound)")
    ap.add_argument("--fast", action="store_true", help="few steps, small rank and grid (a quick check)")
    ap.add_argument("--store", default=None, help="folder of resumable per-method stores")
    ap.add_argument("--overwrite", action="store_true",
                    help="recompute the layers of --store instead of refusing ones computed from other inputs")
    ap.add_argument("--out", default="runs/calibrate_layers", help="folder for table.md, results.json, plot.png")
    ap.add_argument("--plot", default=None, help="PNG path (default <out>/plot.png)")
    ap.add_argument("--progress", action="store_true", help="a progress bar per method")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="JAX persistent compilation cache folder: a later run with the same shapes and settings loads "
                         "the compiled programs instead of compiling them")
    args = ap.parse_args(argv)
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    if args.fast:
        args.steps, args.loraq_steps, args.rotation_steps, args.sq_grid = 20, 30, 10, 5
        args.rank = min(args.rank, 32)
    unknown = [m for m in args.methods if m.partition("+")[0] not in calibrate.RECIPES]
    if unknown:
        ap.error(f"unknown methods {unknown}; available: {list(ALL_METHODS)}")

    if args.layers:
        layers = layerset.load_layer_set(args.layers)
        source = args.layers
    else:
        layers = synthetic.synthetic_layer_set(SYNTHETIC[args.synthetic], n=args.synthetic_rows, seed=args.seed)
        source = f"synthetic:{args.synthetic}"
    names = list(layers)
    dev = jax.local_devices()[0]
    meta = {"source": source, "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "jax_version": jax.__version__, "device": dev.device_kind, "num_devices": jax.local_device_count(),
            "args": {k: v for k, v in vars(args).items() if k not in ("layers",)}}
    os.makedirs(args.out, exist_ok=True)
    errors, reports, seconds = {}, {}, {}
    for m in args.methods:
        t0 = time.perf_counter()
        store = os.path.join(args.store, m.replace("+", "_")) if args.store else None
        _, rep = quantize_with_store(layers, build_recipe(m, args), store, args.overwrite, "--store", label=m)
        seconds[m] = round(time.perf_counter() - t0, 2)
        errors[m] = {n: rep[n]["heldout_error"] for n in names}
        reports[m] = rep
        print(f"{m:>26s}: mean {np.mean(list(errors[m].values())):.4f}  ({seconds[m]} s)", flush=True)
        atomic_write_bytes(os.path.join(args.out, "results.json"), json.dumps(
            {"meta": meta, "errors": errors, "seconds": seconds, "reports": reports}, indent=1, default=float).encode())
    table = markdown_table(errors, args.methods, names)
    header = (f"Relative output error on held-out rows ({source}; {meta['device']}, jax {meta['jax_version']}, "
              f"{meta['date_utc']} UTC; {settings_line(args)})")
    text = header + "\n\n" + table + "\n"
    print(text)
    atomic_write_bytes(os.path.join(args.out, "table.md"), text.encode())
    plot(errors, args.methods, names, args.plot or os.path.join(args.out, "plot.png"),
         f"{source}; {meta['device']}, jax {meta['jax_version']}, {meta['date_utc']} UTC")
    return errors


if __name__ == "__main__":
    main()
