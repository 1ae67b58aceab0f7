"""Per-linear vs shared-input-group calibration on the testbed's real layers: what one transform per group costs.

Serving runs linears that read the same input as one GEMM under one activation transform (``kroquant_jax.
shared_inputs``). This main calibrates the testbed's groups (``models.families.PIXART.shared_inputs``: every block's
``attn1.to_q|to_k|to_v`` and ``attn2.to_k|to_v``) both ways, on the same rows, and reports each member's error:

1. **Capture** (or ``--layer-set`` of an earlier run of this main): ``models.testbed.evaluation.capture_flow_layer_set``
   of every quantizable linear over the first ``--calib-captions`` training captions (flow Euler, CFG, real tokens,
   repeated rows once): the capture of docs/calibration.md's "All 100 testbed layers". With ``--blocks`` (tests) only
   the linears of the groups calibrated are recorded (each recorded layer adds to the sampler's compile). A layer set
   captured with other capture options is refused before the model is loaded.
2. **Rows.** The members of a group read one tensor, so every member gets the first member's rows (the rows the
   fused layer calibrates on; ``fuse_shared_inputs``). Of those, ``--heldout`` rows per group (at most a fifth;
   seeded by the group's fused name) are held out from both arms: every member's error is measured on them, with
   its per-linear layer and with its slice of the fused layer. The rest go to ``quantize_layer_set`` (its own
   calibration / validation / test split; its test rows are not used here).
3. **Calibrate** every ``--methods`` recipe twice: per linear (the members, one transform / branch each) and fused
   (one per group), recipe settings from the usual flags (``calibrate.add_recipe_arguments``).

    python benchmarks/calibrate_shared_inputs.py --out-json benchmarks/results/x.json --out-md benchmarks/results/x.md \
        --layer-set runs/shared_inputs/layer_set.safetensors --calib-rows 1024 --calib-validation 512
    python benchmarks/calibrate_shared_inputs.py --render benchmarks/results/x.json --out-png docs/img/x.png

The JSON is rewritten after every method (an interrupted run keeps the methods that finished).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_METHODS = ("hadamard32", "smoothquant", "kroquant", "smoothed_kroquant")


def parse_args(argv=None) -> argparse.Namespace:
    from scripts.common_args import add_compile_cache, positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                add_help=False)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "emoji_pixart"), help="diffusers PixArt folder")
    p.add_argument("--prompts", default=None, help="prompt .npz (default: <checkpoint>/testbed_prompts.npz)")
    p.add_argument("--layer-set",
                   help="the capture (.safetensors): read when it exists (its weights must be --checkpoint's), "
                        "else captured and written there")
    p.add_argument("--calib-captions", type=positive_int, default=32, help="training captions sampled for the capture")
    p.add_argument("--steps", type=positive_int, default=20, help="Euler steps of the capture")
    p.add_argument("--guidance", type=float, default=3.0, help="CFG scale of the capture")
    p.add_argument("--rows-per-layer", type=positive_int, default=2048, help="captured rows kept per layer")
    p.add_argument("--batch-size", type=positive_int, default=8, help="captions per sampling call (capture)")
    p.add_argument("--text-rows-from-all-prompts", action="store_true",
                   help="the attn2.to_k / to_v rows from the caption projection of every training caption's real "
                        "tokens (models.capture: text_rows_from_all_prompts), not only the captured captions'")
    p.add_argument("--seed", type=int, default=0, help="seed of the capture, the held-out rows and the row split")
    p.add_argument("--heldout", type=positive_int, default=256, help="held-out rows per group (at most a fifth of its rows)")
    p.add_argument("--blocks", type=positive_int, default=None, help="only the groups of the first N blocks (tests)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="recipes (calibrate.get_recipe)")
    p.add_argument("--fused-rank-sum", action="store_true",
                   help="low-rank recipes: also calibrate the fused layers with a branch of the members' ranks "
                        "together (reported as '<method> [fused rank = sum]'; the recipe's own rank gives the fused "
                        "layer one branch of that rank for all its members)")
    p.add_argument("--out-json", help="result JSON")
    p.add_argument("--out-md", default=None, help="result table (markdown)")
    p.add_argument("--out-png", default=None, help="plot: each member's fused vs per-linear error, per method")
    p.add_argument("--render", metavar="JSON", help="run nothing: write --out-md / --out-png of this result JSON")
    add_compile_cache(p, "capture, calibration")
    if p.parse_known_args(argv)[0].render is None:
        # the recipe flags need kroquant_jax.calibrate (and so jax); --render only reads a JSON and plots
        from kroquant_jax import calibrate

        calibrate.add_recipe_arguments(p)
    p.add_argument("-h", "--help", action="help", help="show this help message and exit")
    args = p.parse_args(argv)
    if args.render is None and (args.layer_set is None or args.out_json is None):
        p.error("--layer-set and --out-json are required (unless --render)")
    for flag in ("calib_captions", "steps", "rows_per_layer", "batch_size", "heldout"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    return args


#: The options a capture depends on (besides the checkpoint's weights, checked from the layer set itself).
CAPTURE_OPTIONS = ("prompts", "calib_captions", "steps", "guidance", "rows_per_layer", "batch_size", "seed",
                   "text_rows_from_all_prompts")


def check_capture_options(args) -> bool:
    """Whether ``args.layer_set`` exists (to be read); a layer set captured with other capture options than
    ``args``' (``<layer set>.json``, written beside it) is refused. Reads no more than that JSON: called before the
    model is loaded or anything is compiled."""
    path = Path(args.layer_set)
    if not path.exists():
        return False
    options_path = Path(str(path) + ".json")
    options = {k: getattr(args, k) for k in CAPTURE_OPTIONS}
    stored = json.loads(options_path.read_text()) if options_path.exists() else None
    if stored != options:
        changed = sorted(k for k in options if stored is None or stored.get(k) != options[k])
        raise ValueError(f"--layer-set {path}: captured with other options than these ({changed}; "
                         f"{options_path} {'differs' if stored is not None else 'is missing'}): another "
                         f"--layer-set path, or the same options")
    return True


def load_or_capture(args, model, names):
    """The layer set of ``names`` from ``args.layer_set``, or captured (and written there, with its capture options
    beside it in ``<layer set>.json``) when it does not exist: every quantizable linear, or with ``--blocks`` only
    ``names``. A layer set captured with other options (:func:`check_capture_options`), from other weights, or
    without some of ``names`` (a capture of fewer ``--blocks``) is refused."""
    import numpy as np

    from kroquant_jax import fileio, layerset, provenance
    from models.layers import linears
    from models.testbed import data as testbed_data
    from models.testbed.evaluation import capture_flow_layer_set, training_caption_text

    path = Path(args.layer_set)
    options_path = Path(str(path) + ".json")
    options = {k: getattr(args, k) for k in CAPTURE_OPTIONS}
    if check_capture_options(args):
        layer_set = layerset.load_layer_set(str(path))
        missing = [n for n in names if n not in layer_set]
        if missing:
            raise ValueError(f"--layer-set {path}: lacks {len(missing)} of the {len(names)} linears calibrated here "
                             f"(e.g. {missing[0]!r}; a capture with --blocks records only its blocks' groups): "
                             f"another --layer-set path")
        found = linears(model)
        weights = {n: (np.asarray(found[n].kernel[...], np.float32).T,
                       None if found[n].bias is None else np.asarray(found[n].bias[...], np.float32)) for n in names}
        why = provenance.layer_set_mismatch(layer_set, weights)
        if why is not None:
            raise ValueError(f"--layer-set {path}: {why}: not captured from --checkpoint {args.checkpoint}")
        return layer_set, "read"
    dataset = testbed_data.load_dataset(args.prompts or str(Path(args.checkpoint) / "testbed_prompts.npz"))
    indices = np.flatnonzero(~dataset.heldout)[:args.calib_captions]
    text = training_caption_text(dataset) if args.text_rows_from_all_prompts else None
    recorded = list(names) if args.blocks is not None else list(linears(model, quantizable_only=True))
    layer_set = capture_flow_layer_set(model, dataset, indices, recorded,
                                       steps=args.steps, guidance=args.guidance, rows_per_layer=args.rows_per_layer,
                                       seed=args.seed, batch_size=args.batch_size, text_prompts=text)
    path.parent.mkdir(parents=True, exist_ok=True)
    layerset.save_layer_set(str(path), layer_set)
    fileio.atomic_write_text(options_path, json.dumps(options, indent=1) + "\n")
    return layerset.as_layer_set(layer_set), "captured"


def shared_rows(layer_set, groups, heldout: int, seed: int):
    """``(per-linear layer set, {fused name: held-out rows})``: every member with its group's first member's rows
    minus ``heldout`` of them (at most a fifth; a seeded draw per fused name), the held-out rows apart."""
    from kroquant_jax import shared_inputs
    from kroquant_jax.layerset import LayerData, layer_seed

    members, held = {}, {}
    for group in groups:
        name = shared_inputs.fused_name(group)
        rows = layer_set[group[0]].activations  # (n, d): the input every member reads
        count = min(heldout, rows.shape[0] // 5)
        perm = layer_seed(seed, name).permutation(rows.shape[0])
        held[name] = rows[sorted(perm[:count])]
        pool = rows[sorted(perm[count:])]
        for member in group:
            layer = layer_set[member]
            members[member] = LayerData(layer.weight, layer.bias, pool)
    return members, held


def per_linear_errors(layers, groups, qlayers, held) -> dict[str, float]:
    """Each member's relative output error (bias removed, float64 reference) of its own quantized layer on its
    group's held-out rows (``kroquant_jax.shared_inputs.layer_errors``: the measure of ``member_errors``)."""
    from kroquant_jax import shared_inputs

    rows = {member: held[shared_inputs.fused_name(group)] for group in groups for member in group}
    return shared_inputs.layer_errors(layers, qlayers, rows)


def layer_type(name: str) -> str:
    """``transformer_blocks.3.attn1.to_q`` -> ``attn1.to_q``."""
    return name.split(".", 2)[2]


def summary(errors: dict[str, dict[str, float]]) -> list[dict]:
    """Per layer type (and all): members, mean per-linear and fused error, relative change, members worse fused."""
    import numpy as np

    types = sorted({layer_type(n) for n in errors}) + ["all"]
    rows = []
    for kind in types:
        names = [n for n in errors if kind == "all" or layer_type(n) == kind]
        per = np.array([errors[n]["per_linear"] for n in names])
        fused = np.array([errors[n]["fused"] for n in names])
        rows.append({"layer_type": kind, "members": len(names), "per_linear": float(per.mean()),
                     "fused": float(fused.mean()), "change": float(fused.mean() / per.mean() - 1.0),
                     "worse_fused": int((fused > per).sum()),
                     "max_change": float((fused / per - 1.0).max())})
    return rows


def markdown(result: dict) -> str:
    """The result's tables: per method, per layer type."""
    lines = [f"# Per-linear vs shared-input-group calibration, testbed ({result['date']})", "",
             result["description"], "",
             "| method | layer type | members | per-linear | fused | change | worse fused | worst member |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for method, rec in result["methods"].items():
        for row in rec["summary"]:
            kind = f"**{row['layer_type']}**" if row["layer_type"] == "all" else row["layer_type"]
            lines.append(f"| {method} | {kind} | {row['members']} | {row['per_linear']:.4f} | {row['fused']:.4f} | "
                         f"{100 * row['change']:+.1f}% | {row['worse_fused']} | {100 * row['max_change']:+.1f}% |")
    return "\n".join(lines) + "\n"


def rank_sum_recipes(recipe, members, groups) -> dict:
    """``{fused name: recipe}`` whose low-rank branch has the rank of the group's members' branches together (each
    member's rank resolved from ``recipe``'s, e.g. a fraction of its ``min(o, d)``)."""
    import dataclasses

    from kroquant_jax import lowrank, shared_inputs

    stage = "loraq" if recipe.lowrank == "loraq" else "svdquant"
    cfg = getattr(recipe, stage)
    block = cfg.fmt.block_size if stage == "loraq" and cfg.quantize_branch else None
    out = {}
    for group in groups:
        rank = sum(lowrank.resolve_rank(cfg.rank, members[m].weight.shape, block, m) for m in group)
        out[shared_inputs.fused_name(group)] = dataclasses.replace(
            recipe, **{stage: dataclasses.replace(cfg, rank=int(rank))})
    return out


def quantize_by_recipe(layers, recipes: dict):
    """``quantize_layer_set`` of ``layers`` with ``recipes[name]`` per layer (one call per distinct recipe)."""
    from kroquant_jax import calibrate

    qlayers, reports = {}, {}
    for recipe in {id(r): r for r in recipes.values()}.values():
        part = {n: layer for n, layer in layers.items() if recipes[n] is recipe or recipes[n] == recipe}
        q, rep = calibrate.quantize_layer_set(part, recipe)
        qlayers.update(q)
        reports.update(rep)
    return qlayers, reports


def plot(result: dict, path: str) -> None:
    """One panel per method: every member's held-out error fused (y) against per linear (x), by layer type; points
    above the diagonal got worse fused."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kroquant_jax import fileio

    methods = list(result["methods"])
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.0 * rows), squeeze=False)
    types = sorted({layer_type(n) for rec in result["methods"].values() for n in rec["errors"]})
    for ax, method in zip(axes.flat, methods):
        errors = result["methods"][method]["errors"]
        values = [v for e in errors.values() for v in e.values()]
        low, high = min(values), max(values)
        ax.plot([low, high], [low, high], color="grey", lw=0.8)
        for kind in types:
            names = [n for n in errors if layer_type(n) == kind]
            ax.scatter([errors[n]["per_linear"] for n in names], [errors[n]["fused"] for n in names], s=12,
                       label=kind)
        total = result["methods"][method]["summary"][-1]
        ax.set_title(f"{method}\nmean {100 * total['change']:+.1f}%, {total['worse_fused']}/{total['members']} "
                     f"worse fused", fontsize=9)
        ax.set_xlabel("per-linear error", fontsize=8)
        ax.set_ylabel("fused error", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"testbed shared-input groups: per-linear vs fused calibration ({result['date']})", fontsize=10)
    fig.tight_layout()
    try:
        with fileio.atomic_path(path, suffix=Path(path).suffix) as tmp:  # the suffix picks the format
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        from kroquant_jax import fileio

        result = json.loads(Path(args.render).read_text())
        if args.out_md:
            fileio.atomic_write_text(args.out_md, markdown(result))
        if args.out_png:
            plot(result, args.out_png)
        return 0

    check_capture_options(args)  # a refused layer set costs no model load, capture or compile

    import jax
    import numpy as np

    from kroquant_jax import calibrate, fileio, shared_inputs
    from models import families

    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    recipes = {m: calibrate.recipe_from_args(m, args, seed=args.seed, progress=True) for m in args.methods}
    for message in calibrate.unused_stage_arguments(recipes, args):
        raise SystemExit(f"calibrate_shared_inputs: {message}")
    started = time.perf_counter()
    _, model = families.PIXART.from_diffusers(args.checkpoint, "float32")
    groups = families.PIXART.shared_inputs(model)
    if args.blocks is not None:
        groups = tuple(g for g in groups if int(g[0].split(".")[1]) < args.blocks)
    names = [m for g in groups for m in g]
    layer_set, how = load_or_capture(args, model, names)
    capture_s = time.perf_counter() - started
    members, held = shared_rows(layer_set, groups, args.heldout, args.seed)
    fused = shared_inputs.fuse_shared_inputs(members, groups)
    rows = {n: int(layer.activations.shape[0]) for n, layer in fused.items()}
    device = jax.devices()[0]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/calibrate_shared_inputs.py " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]),
        "machine": {"platform": device.platform, "device": device.device_kind, "cpu": platform.processor()
                    or platform.machine(), "jax": jax.__version__, "python": platform.python_version()},
        "description": (
            f"{args.checkpoint}: {len(groups)} shared-input groups ({len(names)} linears) of "
            f"models.families.PIXART.shared_inputs; capture ({how} {args.layer_set}) from {args.calib_captions} "
            f"training captions x {args.steps} flow-Euler steps, CFG {args.guidance}, {args.rows_per_layer} rows "
            f"per layer at most (real tokens, repeats once"
            + ("; attn2.to_k / to_v: every training caption's tokens" if args.text_rows_from_all_prompts else "")
            + f"); every member calibrated on its group's first member's "
            f"rows minus {args.heldout} held-out rows per group (at most a fifth), on which every error is measured "
            f"(relative output error, bias removed); per-linear: one transform per linear, fused: one per group "
            f"(kroquant_jax.shared_inputs.fuse_shared_inputs)"),
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("out_")},
        "groups": [list(g) for g in groups],
        "calibration_rows_per_group": rows,
        "heldout_rows_per_group": {n: int(a.shape[0]) for n, a in held.items()},
        "capture_s": round(capture_s, 1),
        "methods": {},
    }
    for method, recipe in recipes.items():
        t0 = time.perf_counter()
        q_per, _ = calibrate.quantize_layer_set(members, recipe)
        per_s = time.perf_counter() - t0
        per = per_linear_errors(members, groups, q_per, held)
        arms = [(method, {n: recipe for n in fused})]
        if args.fused_rank_sum and recipe.lowrank is not None:
            arms.append((f"{method} [fused rank = sum]", rank_sum_recipes(recipe, members, groups)))
        for label, fused_recipes in arms:
            t1 = time.perf_counter()
            q_fused, reports = quantize_by_recipe(fused, fused_recipes)
            fused_s = time.perf_counter() - t1
            fus = shared_inputs.member_errors(members, groups, q_fused, held)
            errors = {n: {"per_linear": per[n], "fused": fus[n]} for n in names}
            result["methods"][label] = {
                "recipe": repr(recipe), "per_linear_s": round(per_s, 1), "fused_s": round(fused_s, 1),
                "fused_ranks": {n: q.config.rank for n, q in q_fused.items()},
                "summary": summary(errors), "errors": errors,
                "fused_chosen": {n: reports[n].get("chosen") for n in reports}}
            fileio.atomic_write_text(args.out_json, json.dumps(result, indent=1) + "\n")
            row = result["methods"][label]["summary"][-1]
            print(f"{label}: per-linear {row['per_linear']:.4f}, fused {row['fused']:.4f} "
                  f"({100 * row['change']:+.1f}%), {row['worse_fused']} of {row['members']} members worse fused "
                  f"({per_s:.0f} s + {fused_s:.0f} s)", flush=True)
    if args.out_md:
        fileio.atomic_write_text(args.out_md, markdown(result))
    if args.out_png:
        plot(result, args.out_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
