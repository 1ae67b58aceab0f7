"""End-to-end W4A4 evaluation of the emoji testbed DiT (or any flow-matching pixel-space PixArt checkpoint).

    python -m scripts.eval_testbed --out runs/eval_testbed \
        --methods rtn smoothquant hadamard32 kroquant rtn+loraq smoothquant+loraq hadamard32+loraq kroquant+loraq svdquant

1. Capture: sample the calibration captions (the training records of the prompt file) with the flow-matching Euler
   sampler and CFG, recording random input rows of every quantizable linear at every step (``models.capture``'s
   ``RowSampler`` through ``models.sampling.flow_euler``; ``models.capture.capture_layer_set`` runs PixArt with
   DPM-Solver, which does not fit a velocity-predicting model).
2. Calibrate every method on that layer set (``kroquant_jax.calibrate.quantize_layer_set``, resumable per method).
3. Generate the evaluation captions (held-out records) with the 16-bit model and with each W4A4 model, same seeds
   and sampler, and compare with the 16-bit images: PSNR, SSIM, chroma and saturation ratios
   (``models.image_metrics``), plus the per-layer relative output errors on held-out rows.

Writes (atomically) ``report.json``, ``table.md`` and ``grid.png`` (rows = captions, columns = 16-bit + methods) in
``--out``. The paper's FID, ImageReward and LPIPS need Inception/BLIP/AlexNet weights from a hub: not offline here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import image_metrics, pixart, sampling, testbed, testbed_data
from models.capture import CaptureConfig, capture_layer_set
from models.layers import linears

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "emoji_pixart"
ALL_METHODS = ["rtn", "smoothquant", "hadamard32", "kroquant", "rtn+loraq", "smoothquant+loraq", "hadamard32+loraq",
               "kroquant+loraq", "svdquant"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="diffusers PixArt directory")
    parser.add_argument("--prompts", default=None, help="prompt .npz (default: <checkpoint>/testbed_prompts.npz)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS, help=f"recipes (default: {ALL_METHODS})")
    parser.add_argument("--calib-captions", type=int, default=32, help="training captions sampled for capture")
    parser.add_argument("--eval-captions", type=int, default=8, help="held-out captions generated per method")
    parser.add_argument("--steps", type=int, default=20, help="Euler steps (capture and generation)")
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--rows-per-layer", type=int, default=1024, help="captured rows kept per layer")
    parser.add_argument("--calib-rows", type=int, default=None, help="calibration rows per layer (recipe default)")
    parser.add_argument("--calib-heldout", type=int, default=None, help="held-out rows per layer (recipe default)")
    parser.add_argument("--calib-steps", type=int, default=None, help="KroQuant Adam steps (recipe default 100)")
    parser.add_argument("--loraq-steps", type=int, default=None, help="LoRaQ Adam and rotation steps (default 500)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="quantize only the first N quantizable linears")
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


def recipe_for(name: str, args):
    from kroquant_jax import calibrate, lowrank

    recipe = calibrate.get_recipe(name)
    calibration = {k: v for k, v in (("steps", args.calib_steps), ("num_rows", args.calib_rows),
                                     ("num_heldout", args.calib_heldout)) if v is not None}
    if calibration:
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, **calibration))
    if args.loraq_steps is not None and recipe.lowrank == "loraq":
        recipe = dataclasses.replace(recipe, loraq=lowrank.LoRaQConfig(steps=args.loraq_steps,
                                                                       rotation_steps=args.loraq_steps))
    return recipe


def generate(sample, state, dataset, indices, seed: int, channels: int, size: int, overrides=None) -> np.ndarray:
    """Pixels -> uint8 images (n, s, s, 3) of the records ``indices``; the noise depends on ``seed`` only."""
    noise = jax.random.normal(jax.random.key(seed), (len(indices), channels, size, size), jnp.float32)
    params = {"model": state, **text_params(dataset, indices)}
    if overrides is not None:
        params["overrides"] = overrides
    pixels, _ = sample(params, noise)
    return testbed.pixels_to_images(pixels)


def atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def markdown_table(results: dict[str, dict], settings: str) -> str:
    lines = [settings, "",
             "| method | PSNR (dB) ↑ | SSIM ↑ | chroma ratio | saturation ratio | layer error mean | layer error max |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for method, r in results.items():
        lines.append(f"| {method} | {r['psnr_db']:.2f} | {r['ssim']:.3f} | {r['chroma_ratio']:.3f} | "
                     f"{r['saturation_ratio']:.3f} | {r['layer_error_mean']:.4f} | {r['layer_error_max']:.4f} |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, args, names, calib_indices, eval_indices, dataset, capture_s, results, images) -> str:
    """report.json, table.md and grid.png of the methods done so far (rewritten after each method, atomically)."""
    settings = (f"{args.checkpoint}: {len(names)} linears W4A4 (MXFP4), capture from {len(calib_indices)} training "
                f"captions x {args.steps} Euler steps (CFG {args.guidance:g}, {args.rows_per_layer} rows/layer); "
                f"metrics vs the 16-bit images of {len(eval_indices)} held-out captions, same seeds; "
                f"jax {jax.__version__} on {jax.devices()[0].platform}")
    captions = [str(c) for c in dataset.captions[eval_indices]]
    report = {"settings": settings, "args": vars(args), "capture_s": round(capture_s, 1), "eval_captions": captions,
              "results": results}
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "table.md", markdown_table(results, settings))
    titles = list(images)
    rows = [[images[title][k] for title in titles] for k in range(len(eval_indices))]
    testbed.save_caption_grid(str(out / "grid.png"), captions, rows, titles,
                              title="W4A4 (MXFP4) vs 16-bit, held-out captions")
    return settings


def main(argv=None) -> int:
    from kroquant_jax import calibrate
    from models import quantize_model

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts_path = args.prompts or str(Path(args.checkpoint) / "testbed_prompts.npz")
    dataset = testbed_data.load_dataset(prompts_path)
    cfg, model = pixart.from_diffusers(args.checkpoint, "float32")
    if cfg.in_channels != 3 or cfg.sample_size != dataset.image_size:
        raise ValueError(f"{args.checkpoint}: expects a pixel-space model of size {dataset.image_size} "
                         f"(in_channels 3), got in_channels {cfg.in_channels}, sample_size {cfg.sample_size}")
    calib_indices = np.flatnonzero(~dataset.heldout)[:args.calib_captions]
    eval_indices = np.flatnonzero(dataset.heldout)[:args.eval_captions]
    if len(calib_indices) == 0 or len(eval_indices) == 0:
        raise ValueError(f"{prompts_path}: needs training and held-out records "
                         f"({len(calib_indices)} and {len(eval_indices)} selected)")
    names = list(linears(model, quantizable_only=True))[:args.layers]

    from kroquant_jax.layerset import load_layer_set, save_layer_set

    started = time.perf_counter()
    capture_key = (f"{Path(args.checkpoint).resolve()}|{prompts_path}|{list(calib_indices)}|{args.steps}|"
                   f"{args.guidance}|{args.rows_per_layer}|{args.seed}|{names}")
    cache = out / "layer_set.safetensors"
    cache_key_path = out / "layer_set.key"
    if cache.exists() and cache_key_path.exists() and cache_key_path.read_text() == capture_key:
        layer_set = load_layer_set(str(cache))  # the same capture settings: reuse (methods resume from their stores)
    else:
        layer_set = capture_flow_layer_set(model, dataset, calib_indices, args, names)
        save_layer_set(str(cache), layer_set)
        atomic_write_text(cache_key_path, capture_key)
    capture_s = time.perf_counter() - started

    graphdef, state = nnx.split(model)
    size, channels = cfg.sample_size, cfg.in_channels
    sample = flow_sampler(graphdef, args.steps, args.guidance, channels)
    reference = generate(sample, state, dataset, eval_indices, args.seed + 1000, channels, size)  # (n, s, s, 3)
    reference_float = reference.astype(np.float64) / 255
    results, images = {}, {"16-bit": reference}
    for method in args.methods:
        began = time.perf_counter()
        qlayers, reports = calibrate.quantize_layer_set(layer_set, recipe_for(method, args),
                                                        store=str(out / "qlayers" / method.replace("+", "_")))
        calibrate_s = time.perf_counter() - began
        overrides = quantize_model.qlinear_overrides(qlayers)
        quantize_model.check_overrides(model, overrides)
        quantized = generate(sample, state, dataset, eval_indices, args.seed + 1000, channels, size, overrides)
        quantized_float = quantized.astype(np.float64) / 255
        layer_errors = np.array([reports[name]["heldout_error"] for name in names])
        results[method] = {
            "psnr_db": float(np.mean(np.minimum(image_metrics.psnr(quantized_float, reference_float), 99.0))),
            "ssim": float(np.mean(image_metrics.ssim(quantized_float, reference_float))),
            **image_metrics.color_ratios(quantized_float, reference_float),
            "layer_error_mean": float(layer_errors.mean()), "layer_error_max": float(layer_errors.max()),
            "calibrate_s": round(calibrate_s, 1),
            "per_layer_error": {name: float(reports[name]["heldout_error"]) for name in names},
        }
        images[method] = quantized
        print(f"{method}: PSNR {results[method]['psnr_db']:.2f} dB, SSIM {results[method]['ssim']:.3f}, "
              f"layer error {results[method]['layer_error_mean']:.4f} ({calibrate_s:.0f} s)", flush=True)
        write_outputs(out, args, names, calib_indices, eval_indices, dataset, capture_s, results, images)
    settings = write_outputs(out, args, names, calib_indices, eval_indices, dataset, capture_s, results, images)
    print(markdown_table(results, settings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
