"""End-to-end W4A4 evaluation of the emoji testbed DiT (or any flow-matching pixel-space PixArt checkpoint).

    kroquant evaluate --out runs/eval_testbed            # every method (ALL_METHODS)
    kroquant evaluate --out runs/x --methods rtn kroquant kroquant+loraq kroquant+loraq@128 --rank 0.125

1. Capture: sample the calibration captions (the training records of the prompt file) with the flow-matching Euler
   sampler and CFG, recording random input rows of every quantizable linear at every step (``models.capture``'s
   ``RowSampler`` through ``models.sampling.flow_euler``; ``models.capture.capture_layer_set`` runs PixArt with
   DPM-Solver, which does not fit a velocity-predicting model).
2. Calibrate every method on that layer set (``kroquant_jax.calibrate.quantize_layer_set``, resumable per method:
   the calibrated layers are stored under ``--out``/qlayers in a folder named by the method and a hash of the capture
   settings and the recipe, so a rerun with other settings never picks up stale layers).
3. Generate the evaluation captions (held-out records; optionally also ``--eval-train-captions`` training records
   that calibration did not use) with the 16-bit model and with each W4A4 model, same seeds and sampler, and compare
   with the 16-bit images: PSNR (mean and its standard error over captions), SSIM, chroma and saturation ratios
   (``models.image_metrics``), plus the per-layer relative output errors on held-out rows (mean, max, and the mean
   per layer type).

The recipe settings (``--calib-steps``, ``--rank``, ...) are :func:`kroquant_jax.calibrate.add_recipe_arguments`'s.
The low-rank branch's rank (``--rank``, or ``<recipe>@<rank>`` for one method): an int (LoRaQ's default is the
paper's 128, meant for layers 1152 and more wide) or a fraction of each layer's ``min(o, d)``
(``kroquant_jax.lowrank.resolve_rank``; 0.125 gives rank 32 on the testbed's 256-wide layers, which is also what the
paper's share, 128 of 1152 = 1/9, rounds to).

``--compile-cache DIR`` turns on JAX's persistent compilation cache in ``DIR``
(:func:`kroquant_jax.calibrate.enable_compile_cache`), so that a later run with the same shapes and settings loads
its compiled programs instead of compiling them.

Writes (atomically) ``report.json``, ``table.md`` and ``grid.png`` (rows = captions, columns = 16-bit + methods;
``grid_train.png`` for the training captions) in ``--out``. The paper's FID, ImageReward and LPIPS need
Inception/BLIP/AlexNet weights from a hub: not offline here. Nothing here imports torch or diffusers (the checkpoint
is read by ``models.convert``'s numpy safetensors reader), so it runs on a machine with jax alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kroquant_jax import calibrate
from kroquant_jax.fileio import atomic_path, atomic_write_text
from kroquant_jax.timing import CompileWatch
from models import image_metrics, pixart, sampling, testbed, testbed_data
from models.capture import CaptureConfig, capture_layer_set
from models.layers import linears
from scripts.common_args import nonnegative_int, positive_int, quantize_with_store, verb_parser

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "emoji_pixart"
ALL_METHODS = ["rtn", "smoothquant", "hadamard32", "kroquant", "smoothed_kroquant", "rtn+loraq", "smoothquant+loraq",
               "hadamard32+loraq", "kroquant+loraq", "smoothed_kroquant+loraq", "svdquant"]


EXAMPLES = ("--out runs/eval_testbed", "--out runs/x --methods rtn kroquant kroquant+loraq --rank 0.125",
            "--checkpoint DIR --prompts PROMPTS.npz --out runs/mine --methods rtn kroquant")


def parse_args(argv=None, verb: str = "evaluate", description: str | None = None, preset: Sequence[str] = (),
               examples: Sequence[str] = EXAMPLES) -> argparse.Namespace:
    """The options of ``kroquant <verb>``; ``preset`` (a command line, e.g. the demo's fast settings) becomes the
    defaults, so ``--help`` shows them and the user's options override them."""
    parser = verb_parser(verb, __doc__ if description is None else description, examples)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="diffusers PixArt directory")
    parser.add_argument("--prompts", default=None, help="prompt .npz (default: <checkpoint>/testbed_prompts.npz)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS,
                        help="recipes, a low-rank one optionally with its own rank: kroquant+loraq@128")
    calibrate.add_recipe_arguments(parser)
    parser.add_argument("--calib-captions", type=positive_int, default=32, help="training captions sampled for capture")
    parser.add_argument("--eval-captions", type=positive_int, default=8, help="held-out captions generated per method")
    parser.add_argument("--eval-train-captions", type=nonnegative_int, default=0,
                        help="also generate this many training captions not used for calibration (own table/grid)")
    parser.add_argument("--steps", type=positive_int, default=20, help="Euler steps (capture and generation)")
    parser.add_argument("--guidance", type=float, default=3.0, help="CFG scale")
    parser.add_argument("--rows-per-layer", type=positive_int, default=1024, help="captured rows kept per layer")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="captions per sampling call (capture)")
    parser.add_argument("--grid-rows", type=positive_int, default=None,
                        help="at most this many captions per grid (default all)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="only merge the outputs of earlier runs (same settings, other methods; e.g. parallel "
                             "processes) into one report/table/grid in --out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise and the row draws")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="quantize only the first N quantizable linears")
    parser.add_argument("--overwrite", action="store_true",
                        help="capture and calibrate again instead of reusing --out's results (which are refused when "
                             "they were made from other inputs)")
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="JAX persistent compilation cache folder: a later run with the same shapes and settings "
                             "loads the compiled programs (capture, calibration, sampling) instead of compiling them "
                             "(the reported compile seconds then include the loads)")
    if preset:
        base = vars(parser.parse_args(list(preset)))
        parser.set_defaults(**base)
        for action in parser._actions:
            if base.get(action.dest) is not None:
                action.required = False
    return parser.parse_args(argv)


def flow_sampler(graphdef, num_steps: int, guidance: float, channels: int, hooks_factory=None):
    """jit(params, noise) -> (pixels (b, c, s, s), aux per step): Euler on linspace(1, 0) sigmas with CFG."""
    denoise = sampling.pixart_denoiser(graphdef, guidance, channels, hooks_factory)
    sigmas = sampling.flow_sigmas(num_steps)
    return jax.jit(lambda params, noise: sampling.flow_euler(denoise, params, noise, sigmas))


def text_params(dataset: testbed_data.EmojiDataset, indices: np.ndarray) -> dict[str, jax.Array]:
    """The PixArt denoiser's text inputs for the records ``indices`` (empty caption as the unconditional one)."""
    n = len(indices)
    return {
        "context": jnp.asarray(dataset.context[indices], jnp.float32),  # (n, t, 384)
        "mask": jnp.asarray(dataset.context_mask[indices], jnp.float32),  # (n, t)
        "uncond_context": jnp.broadcast_to(jnp.asarray(dataset.null_context, jnp.float32),
                                           (n,) + dataset.null_context.shape),  # (n, t, 384)
        "uncond_mask": jnp.broadcast_to(jnp.asarray(dataset.null_mask, jnp.float32), (n,) + dataset.null_mask.shape),
    }


def capture_flow_layer_set(model, dataset: testbed_data.EmojiDataset, indices: np.ndarray, args, names: list[str]):
    """``{name: (W (o, d), bias (o,), A_rows (n, d))}`` from flow-matching sampling runs over ``indices``
    (``models.capture.capture_layer_set`` with the flow-Euler PixArt sampler)."""
    batches = [indices[start:start + args.batch_size] for start in range(0, len(indices), args.batch_size)]
    size = model.cfg.sample_size
    config = CaptureConfig(num_steps=args.steps, guidance_scale=args.guidance, latent_hw=(size, size),
                           rows_per_layer=args.rows_per_layer, seed=args.seed, layers=tuple(names), solver="flow_euler",
                           progress=True)
    return capture_layer_set("pixart", model, [text_params(dataset, batch) for batch in batches], config)


def store_folder(out: Path, method: str, recipe, capture_key: str) -> Path:
    """Where ``method``'s calibrated layers are stored: named by the method and a hash of the capture settings and
    the whole recipe (every stage's settings), so layers calibrated with other settings are never resumed."""
    digest = hashlib.sha1(f"{capture_key}|{recipe!r}".encode()).hexdigest()[:12]
    return out / "qlayers" / f"{method.replace('+', '_').replace('@', '_r')}-{digest}"


def layer_type(name: str) -> str:
    """``transformer_blocks.3.attn1.to_q`` -> ``attn1.to_q`` (the block index dropped)."""
    return re.sub(r"^(transformer_blocks|single_transformer_blocks|blocks)\.\d+\.", "", name)


def image_metrics_of(quantized: np.ndarray, reference: np.ndarray) -> dict:
    """PSNR (mean, standard error over images, per image), SSIM, colour ratios of uint8 images vs the 16-bit ones."""
    q, ref = quantized.astype(np.float64) / 255, reference.astype(np.float64) / 255
    psnr = np.minimum(image_metrics.psnr(q, ref), 99.0)  # (n,) identical images -> 99 dB, not inf
    sem = float(psnr.std(ddof=1) / np.sqrt(len(psnr))) if len(psnr) > 1 else float("nan")
    return {"psnr_db": float(psnr.mean()), "psnr_sem_db": sem, "ssim": float(np.mean(image_metrics.ssim(q, ref))),
            **image_metrics.color_ratios(q, ref), "psnr_per_image_db": [round(float(x), 3) for x in psnr]}


def generate(sample, state, dataset, indices, seed: int, channels: int, size: int, overrides=None) -> np.ndarray:
    """Pixels -> uint8 images (n, s, s, 3) of the records ``indices``; the noise of record ``k`` depends on ``seed``
    and ``indices[k]`` only (so a record gets the same noise whatever else is generated beside it)."""
    noise = jnp.stack([jax.random.normal(jax.random.fold_in(jax.random.key(seed), int(i)), (channels, size, size),
                                         jnp.float32) for i in indices])  # (n, c, s, s)
    params = {"model": state, **text_params(dataset, indices)}
    if overrides is not None:
        params["overrides"] = overrides
    pixels, _ = sample(params, noise)
    return testbed.pixels_to_images(pixels)


def markdown_table(results: dict[str, dict], settings: str) -> str:
    """The settings line, the method table (held-out captions), the training-caption table when there is one, and
    the mean per-layer output error per layer type."""
    lines = [settings, "",
             "| method | low-rank branch | PSNR (dB) ↑ | SSIM ↑ | chroma ratio | saturation ratio "
             "| layer error mean | layer error max | calibration (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, r in results.items():
        lines.append(f"| {method} | {r['low_rank_branch']} | {r['psnr_db']:.2f} ± {r['psnr_sem_db']:.2f} | "
                     f"{r['ssim']:.3f} | {r['chroma_ratio']:.3f} | {r['saturation_ratio']:.3f} | "
                     f"{r['layer_error_mean']:.4f} | {r['layer_error_max']:.4f} | {r['calibrate_s']:.0f} |")
    train = {method: r["train"] for method, r in results.items() if "train" in r}
    if train:
        lines += ["", "Training captions not used for calibration:", "",
                  "| method | PSNR (dB) ↑ | SSIM ↑ | chroma ratio | saturation ratio |",
                  "| --- | --- | --- | --- | --- |"]
        for method, r in train.items():
            lines.append(f"| {method} | {r['psnr_db']:.2f} ± {r['psnr_sem_db']:.2f} | {r['ssim']:.3f} | "
                         f"{r['chroma_ratio']:.3f} | {r['saturation_ratio']:.3f} |")
    if results:
        types = list(next(iter(results.values()))["layer_error_by_type"])
        lines += ["", "Mean held-out relative output error per layer type:", "",
                  "| method | " + " | ".join(types) + " |", "| --- |" + " --- |" * len(types)]
        for method, r in results.items():
            lines.append(f"| {method} | " + " | ".join(f"{r['layer_error_by_type'][t]:.4f}" for t in types) + " |")
    return "\n".join(lines) + "\n"


def settings_line(args, names, calib_indices, eval_indices, train_indices) -> str:
    train = f" and {len(train_indices)} training captions not used for calibration" if len(train_indices) else ""
    return (f"{args.checkpoint}: {len(names)} linears W4A4 (MXFP4), capture from {len(calib_indices)} training "
            f"captions x {args.steps} Euler steps (CFG {args.guidance:g}, {args.rows_per_layer} rows/layer); "
            f"calibration rows {args.calib_rows or 'default'}, validation rows {args.calib_validation or 'default'}, "
            f"test rows {args.calib_test or 'default'}, KroQuant steps {args.calib_steps or 'default'}, LoRaQ steps "
            f"{args.loraq_steps or 'default'}+{args.rotation_steps or 'default'}, --rank {args.rank or 'default'}; "
            f"metrics vs the 16-bit images of {len(eval_indices)} "
            f"held-out captions{train}, same seeds (PSNR ± its standard error over captions); "
            f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")


def write_outputs(out: Path, report: dict, images: dict[str, np.ndarray], grid_rows: int | None = None) -> None:
    """report.json, table.md, images.npz (the generated uint8 images per column), grid.png and grid_train.png of the
    methods done so far (rewritten after each method, atomically). ``report`` holds ``settings``, ``eval_captions``,
    ``train_captions`` and ``results``; ``images[title]``: (n_heldout + n_train, s, s, 3), held-out records first.
    ``grid_rows``: at most this many captions per grid (all by default)."""
    held, train = report["eval_captions"], report["train_captions"]
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "table.md", markdown_table(report["results"], report["settings"]))
    with atomic_path(out / "images.npz", suffix=".npz") as tmp:
        np.savez_compressed(tmp, titles=np.array(list(images)),
                            **{f"column{k}": v for k, v in enumerate(images.values())})
    titles = list(images)
    for file, captions, offset, what in (("grid.png", held, 0, "held-out"),
                                         ("grid_train.png", train, len(held), "training (not calibration)")):
        captions = captions[:grid_rows]
        if captions:
            rows = [[images[title][offset + k] for title in titles] for k in range(len(captions))]
            testbed.save_caption_grid(str(out / file), captions, rows, titles,
                                      title=f"W4A4 (MXFP4) vs 16-bit, {what} captions")


def load_outputs(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(report, images)`` written by :func:`write_outputs` in ``folder``."""
    report = json.loads((folder / "report.json").read_text())
    with np.load(folder / "images.npz") as data:
        images = {str(t): data[f"column{k}"] for k, t in enumerate(data["titles"])}
    return report, images


def merge_outputs(folders: list[Path], out: Path, grid_rows: int | None = None) -> dict:
    """One report/table/grid from runs of the same settings over different methods (e.g. parallel processes).

    Every folder must have the same settings (except the wall-clock times), captions and 16-bit images (checked
    bit for bit: the runs must have generated the same reference); methods are taken in the order given."""
    report, images = load_outputs(folders[0])
    report = {**report, "merged_from": [str(f) for f in folders], "results": dict(report["results"]),
              "args": [report["args"]]}
    for folder in folders[1:]:
        other, other_images = load_outputs(folder)
        report["args"].append(other["args"])
        for key in ("settings", "eval_captions", "train_captions"):
            if other[key] != report[key]:
                raise ValueError(f"merge: {folder}/report.json has another {key!r} than {folders[0]}:\n"
                                 f"  {other[key]!r}\n  {report[key]!r}")
        if not np.array_equal(other_images["16-bit"], images["16-bit"]):
            raise ValueError(f"merge: the 16-bit images of {folder} differ from those of {folders[0]}")
        clash = sorted(set(other["results"]) & set(report["results"]))
        if clash:
            raise ValueError(f"merge: methods {clash} are in {folder} and in an earlier folder")
        report["results"].update(other["results"])
        images.update({t: v for t, v in other_images.items() if t != "16-bit"})
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, report, images, grid_rows)
    return report


def main(argv=None, verb: str = "evaluate", description: str | None = None, preset: Sequence[str] = (),
         examples: Sequence[str] = EXAMPLES) -> int:
    """``kroquant evaluate`` (``verb``, ``description``, ``preset``, ``examples``: see :func:`parse_args`)."""
    from kroquant_jax import provenance
    from models import quantize_model

    args = parse_args(argv, verb, description, preset, examples)
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)  # before anything compiles
    out = Path(args.out)
    if args.merge:
        report = merge_outputs([Path(f) for f in args.merge], out, args.grid_rows)
        print(markdown_table(report["results"], report["settings"]), flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    prompts_path = args.prompts or str(Path(args.checkpoint) / "testbed_prompts.npz")
    dataset = testbed_data.load_dataset(prompts_path)
    cfg, model = pixart.from_diffusers(args.checkpoint, "float32")
    if cfg.in_channels != 3 or cfg.sample_size != dataset.image_size:
        raise ValueError(f"{args.checkpoint}: expects a pixel-space model of size {dataset.image_size} "
                         f"(in_channels 3), got in_channels {cfg.in_channels}, sample_size {cfg.sample_size}")
    training = np.flatnonzero(~dataset.heldout)
    calib_indices = training[:args.calib_captions]
    eval_indices = np.flatnonzero(dataset.heldout)[:args.eval_captions]
    train_indices = training[args.calib_captions:args.calib_captions + args.eval_train_captions]
    if len(calib_indices) == 0 or len(eval_indices) == 0:
        raise ValueError(f"{prompts_path}: needs training and held-out records "
                         f"({len(calib_indices)} and {len(eval_indices)} selected)")
    if len(train_indices) < args.eval_train_captions:
        raise ValueError(f"{prompts_path}: --eval-train-captions {args.eval_train_captions} asks for more training "
                         f"records than the {len(training)} - {len(calib_indices)} not used for calibration")
    names = list(linears(model, quantizable_only=True))[:args.layers]
    # bad method names fail before the capture
    recipes = {method: calibrate.recipe_from_args(method, args, progress=True) for method in args.methods}

    from kroquant_jax.layerset import load_layer_set, save_layer_set

    started = time.perf_counter()
    capture_key = (f"{Path(args.checkpoint).resolve()}|{prompts_path}|{list(calib_indices)}|{args.steps}|"
                   f"{args.guidance}|{args.rows_per_layer}|{args.seed}|{names}")
    cache = out / "layer_set.safetensors"
    cache_key_path = out / "layer_set.key"
    layer_set = None
    if not args.overwrite and cache.exists() and cache_key_path.exists() and cache_key_path.read_text() == capture_key:
        layer_set = load_layer_set(str(cache))  # the same capture settings: reuse (methods resume from their stores)
        model_linears = linears(model)
        weights = {n: (np.asarray(model_linears[n].kernel[...], np.float32).T,
                       None if model_linears[n].bias is None else np.asarray(model_linears[n].bias[...], np.float32))
                   for n in names}
        if provenance.layer_set_mismatch(layer_set, weights) is not None:
            layer_set = None  # the checkpoint at this path changed since: capture again
    if layer_set is None:
        layer_set = capture_flow_layer_set(model, dataset, calib_indices, args, names)
        save_layer_set(str(cache), layer_set)
        atomic_write_text(cache_key_path, capture_key)
    capture_s = time.perf_counter() - started

    graphdef, state = nnx.split(model)
    size, channels = cfg.sample_size, cfg.in_channels
    sample = flow_sampler(graphdef, args.steps, args.guidance, channels)
    generated = np.concatenate([eval_indices, train_indices])  # held-out records first
    held = slice(0, len(eval_indices))
    reference = generate(sample, state, dataset, generated, args.seed + 1000, channels, size)  # (n, s, s, 3)
    results, images = {}, {"16-bit": reference}
    report = {"settings": settings_line(args, names, calib_indices, eval_indices, train_indices),
              "args": vars(args), "device": jax.devices()[0].device_kind, "capture_s": round(capture_s, 1),
              "eval_captions": [str(c) for c in dataset.captions[eval_indices]],
              "train_captions": [str(c) for c in dataset.captions[train_indices]], "results": results}
    for method, recipe in recipes.items():
        began = time.perf_counter()
        compile_watch = CompileWatch()
        store = store_folder(out, method, recipe, capture_key)
        qlayers, reports = quantize_with_store(layer_set, recipe, str(store), args.overwrite, "--out", label=method)
        calibrate_s, calibrate_compile_s = time.perf_counter() - began, compile_watch.seconds()
        ranks = "/".join(str(r) for r in sorted({qlayers[name].config.rank for name in names}))
        branch = {"loraq": f"LoRaQ r={ranks} (MXFP4)", "svd": f"SVD r={ranks} (16-bit)"}.get(recipe.lowrank, "none")
        overrides = quantize_model.qlinear_overrides(qlayers)
        quantize_model.check_overrides(model, overrides)
        began = time.perf_counter()
        compile_watch = CompileWatch()
        quantized = generate(sample, state, dataset, generated, args.seed + 1000, channels, size, overrides)
        generate_s, generate_compile_s = time.perf_counter() - began, compile_watch.seconds()
        layer_errors = {name: float(reports[name]["heldout_error"]) for name in names}
        by_type: dict[str, list[float]] = {}
        for name, error in layer_errors.items():
            by_type.setdefault(layer_type(name), []).append(error)
        results[method] = {
            "low_rank_branch": branch,
            **image_metrics_of(quantized[held], reference[held]),
            "layer_error_mean": float(np.mean(list(layer_errors.values()))),
            "layer_error_max": float(np.max(list(layer_errors.values()))),
            "layer_error_by_type": {t: float(np.mean(v)) for t, v in by_type.items()},
            "calibrate_s": round(calibrate_s, 1), "generate_s": round(generate_s, 1),
            "calibrate_compile_s": round(calibrate_compile_s, 1), "generate_compile_s": round(generate_compile_s, 1),
            "per_layer_error": layer_errors,
        }
        if len(train_indices):
            results[method]["train"] = image_metrics_of(quantized[len(eval_indices):], reference[len(eval_indices):])
        images[method] = quantized
        print(f"{method}: PSNR {results[method]['psnr_db']:.2f} dB, SSIM {results[method]['ssim']:.3f}, "
              f"layer error {results[method]['layer_error_mean']:.4f} (calibration {calibrate_s:.0f} s, "
              f"generation {generate_s:.0f} s; of which compilation {calibrate_compile_s:.0f} + "
              f"{generate_compile_s:.0f} s)", flush=True)
        write_outputs(out, report, images, args.grid_rows)
    write_outputs(out, report, images, args.grid_rows)
    print(markdown_table(results, report["settings"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
