"""diffusers checkpoint -> capture -> calibrate -> save the W4A4 model -> generate with both models.

    kroquant quantize-checkpoint --checkpoint DIR --out OUT [--embeddings prompts.npz | --synthetic-prompts N]
        [--recipe kroquant] [--steps 20] [--guidance 4.5] [--latent-hw 128 128] [--rows-per-layer 1024]
        [--compile-cache DIR]

``DIR`` is a diffusers transformer directory (config.json + safetensors; PixArt-Σ, SANA, FLUX.1 or Ideogram 4,
detected from ``_class_name`` by ``models.families``). Prompt embeddings come from an ``.npz`` made by
``models.diffusers_io.encode_prompts`` (torch side: PixArt/SANA ``context (P, t, c)``, ``mask (P, t)``,
``uncond_context (1, t, c)``, ``uncond_mask (1, t)``; FLUX ``context (P, t, 4096)``, ``pooled (P, 768)``; Ideogram 4
``context (P, t, 53248)``, ``mask (P, t)``, sampled with ``--guidance 1`` and ``--latent-hw`` the image-token grid)
or, for smoke tests, from random embeddings (``--synthetic-prompts``).

Outputs in OUT (each file written atomically; RECIPE is the recipe name with ``+`` -> ``_``):
``layer_set.safetensors`` (the captured layer set; ``--layer-set`` reuses one instead of capturing again),
``qlayers-RECIPE/`` (the resumable per-layer store of ``kroquant_jax.calibrate``), ``quantized-RECIPE/`` (orbax
checkpoint of ``{name: QuantizedLinear}``), ``samples-RECIPE.npz`` (16-bit and W4A4 latents of the evaluation
prompts, same seeds) and ``report-RECIPE.json`` (latent PSNR / relative error of W4A4 vs 16-bit per prompt,
per-layer held-out errors).
The last ``--eval-prompts`` prompts are only generated, never captured (unless there are no more prompts than that).
With ``--vae DIR`` (a diffusers AutoencoderKL directory, torch side) the latents are also decoded to PNGs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kroquant quantize-checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="diffusers transformer directory")
    parser.add_argument("--out", required=True, help="output directory")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--embeddings", help=".npz of precomputed prompt embeddings (see module doc)")
    prompts.add_argument("--synthetic-prompts", type=int, help="use N random prompt embeddings (smoke tests)")
    parser.add_argument("--synthetic-tokens", type=int, default=8, help="tokens per synthetic prompt")
    parser.add_argument("--recipe", default="kroquant", help="kroquant_jax.calibrate recipe name (e.g. rtn, "
                        "smoothquant, hadamard32, kroquant, svdquant, kroquant+loraq)")
    parser.add_argument("--calib-steps", type=int, help="override the recipe's optimisation steps")
    parser.add_argument("--calib-rows", type=int, help="calibration rows per layer (default: the recipe's)")
    parser.add_argument("--calib-heldout", type=int, help="held-out rows per layer (default: the recipe's)")
    parser.add_argument("--solver", choices=("dpm_solver_pp_2m", "flow_euler"),
                        help="default: DPM-Solver++ 2M for PixArt, flow Euler for SANA/FLUX; flow_euler for "
                        "flow-matching PixArt-architecture models (the emoji testbed)")
    parser.add_argument("--shift", type=float, help="flow-matching sigma shift (default: the family's)")
    parser.add_argument("--max-prompts", type=int, help="use only the first N prompts of --embeddings")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (capture and generation)")
    parser.add_argument("--guidance", type=float, default=4.5, help="CFG scale (PixArt/SANA)")
    parser.add_argument("--latent-hw", type=int, nargs=2, default=(128, 128), metavar=("H", "W"))
    parser.add_argument("--rows-per-layer", type=int, default=1024, help="captured rows kept per layer")
    parser.add_argument("--layer-set", help="reuse a captured layer set (.safetensors/.npz) instead of capturing")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per sampling run")
    parser.add_argument("--eval-prompts", type=int, default=4, help="the LAST N prompts are generated with both "
                        "models and not captured (unless there are no more than N prompts)")
    parser.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16, float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae", help="diffusers AutoencoderKL directory: decode the latents to PNGs (torch)")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX persistent compilation cache folder: a later run with the same shapes and settings "
                             "loads the compiled programs (calibration, capture, sampling) instead of compiling them")
    return parser.parse_args(argv)


def _load(checkpoint: str, dtype: str):
    """``(Family, cfg, model)``: the family recognised from config.json's ``_class_name`` (``models.families``)."""
    from models import families

    try:
        return families.load_diffusers(checkpoint, dtype)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _prompt_arrays(args, family, cfg) -> dict[str, np.ndarray]:
    if args.embeddings:
        with np.load(args.embeddings) as data:
            arrays = {k: data[k] for k in data.files}
        renames = (("mask", "context_mask"), ("uncond_context", "null_context"), ("uncond_mask", "null_mask"))
        for ours, theirs in renames:  # the emoji testbed's prompt file layout
            if ours not in arrays and theirs in arrays:
                arrays[ours] = arrays[theirs] if theirs == "context_mask" else arrays[theirs][None]
        if args.max_prompts:
            arrays = {k: v[:args.max_prompts] if not k.startswith("uncond_") and v.ndim else v
                      for k, v in arrays.items()}
    else:
        rng = np.random.default_rng(args.seed)
        count, tokens = args.synthetic_prompts, args.synthetic_tokens
        widths, arrays = family.prompt_widths(cfg), {}
        for key in family.prompt_inputs:  # random features, an all-zero unconditional caption, masks keep every token
            rows = 1 if key.startswith("uncond_") else count
            if key not in widths:
                arrays[key] = np.ones((rows, tokens))
            elif key == "pooled":
                arrays[key] = rng.standard_normal((rows, widths[key]))
            else:
                draw = np.zeros if key.startswith("uncond_") else rng.standard_normal
                arrays[key] = draw((rows, tokens, widths[key]))
    needed = family.prompt_inputs
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise SystemExit(f"prompt embeddings lack {missing} (a {family.name} model needs {list(needed)})")
    return {k: np.asarray(arrays[k], np.float32) for k in needed}


def _batches(arrays: dict[str, np.ndarray], indices: list[int], batch_size: int, dtype) -> list[dict]:
    out = []
    for start in range(0, len(indices), batch_size):
        chosen = indices[start:start + batch_size]
        batch = {}
        for key, value in arrays.items():
            if key.startswith("uncond_"):
                value = np.broadcast_to(value[:1], (len(chosen),) + value.shape[1:])
            else:
                value = value[chosen]
            batch[key] = jnp.asarray(value, dtype if key in ("context", "uncond_context", "pooled") else jnp.float32)
        out.append(batch)
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    from kroquant_jax.fileio import atomic_write_bytes

    atomic_write_bytes(str(path), data)


def _psnr(reference: np.ndarray, test: np.ndarray) -> float:
    mse = float(np.mean((reference.astype(np.float64) - test) ** 2))
    peak = float(reference.max() - reference.min())
    return float("inf") if mse == 0 else 10.0 * np.log10(peak ** 2 / mse)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from flax import nnx

    from kroquant_jax import calibrate, qlinear
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    from kroquant_jax.layerset import load_layer_set, save_layer_set
    from models import capture, quantize_model

    family, cfg, model = _load(args.checkpoint, args.dtype)
    arrays = _prompt_arrays(args, family, cfg)
    dtype = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))[0].dtype
    count = arrays["context"].shape[0]

    # 1. capture
    capture_config = capture.CaptureConfig(num_steps=args.steps, guidance_scale=args.guidance,
                                           latent_hw=tuple(args.latent_hw), rows_per_layer=args.rows_per_layer,
                                           seed=args.seed, shift=args.shift, solver=args.solver)
    eval_count = min(args.eval_prompts, count)
    capture_indices = list(range(count - eval_count)) if count > eval_count else list(range(count))
    if args.layer_set:
        layer_set = load_layer_set(args.layer_set)
    else:
        batches = _batches(arrays, capture_indices, args.batch_size, dtype)
        layer_set = capture.capture_layer_set(family, model, batches, capture_config)
        save_layer_set(str(out / "layer_set.safetensors"), layer_set)

    # 2. calibrate (resumable store), 3. save the quantized layers
    recipe = calibrate.get_recipe(args.recipe)
    calib_overrides = {k: v for k, v in (("steps", args.calib_steps), ("num_rows", args.calib_rows),
                                         ("num_heldout", args.calib_heldout)) if v is not None}
    if calib_overrides:
        import dataclasses
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, **calib_overrides))
    store = out / f"qlayers-{args.recipe.replace('+', '_')}"  # one resumable store per recipe
    qlayers, reports = calibrate.quantize_layer_set(layer_set, recipe, store=str(store))
    quantized_dir = out / f"quantized-{args.recipe.replace('+', '_')}"
    tmp = Path(tempfile.mkdtemp(prefix=".quantized.", dir=out))
    shutil.rmtree(tmp)
    qlinear.save_orbax(str(tmp), qlayers)
    if quantized_dir.exists():
        shutil.rmtree(quantized_dir)
    os.replace(tmp, quantized_dir)
    overrides = quantize_model.qlinear_overrides(qlayers)
    quantize_model.check_overrides(model, overrides)

    # 4. generate with both models, same seeds, same jitted sampler
    graphdef, state = nnx.split(model)
    sample = jax.jit(family.make_sampler(graphdef, cfg, num_steps=args.steps, guidance_scale=args.guidance,
                                         latent_hw=tuple(args.latent_hw), shift=args.shift, solver=args.solver))
    eval_indices = list(range(count - eval_count, count))
    full, w4a4, per_prompt = [], [], []
    for index, batch in zip(eval_indices, _batches(arrays, eval_indices, 1, dtype)):
        key = jax.random.key(args.seed + 1000 + index)
        reference, _ = sample({"model": state, **batch}, key)
        quantized, _ = sample({"model": state, **batch, "overrides": overrides}, key)
        reference, quantized = np.asarray(reference, np.float32), np.asarray(quantized, np.float32)
        full.append(reference[0])
        w4a4.append(quantized[0])
        per_prompt.append({"prompt": index, "seed": args.seed + 1000 + index,
                           "latent_psnr_db": _psnr(reference, quantized),
                           "latent_relative_error": float(np.linalg.norm(quantized - reference)
                                                          / max(np.linalg.norm(reference), 1e-30))})
    import io
    buffer = io.BytesIO()
    np.savez(buffer, latents_16bit=np.stack(full), latents_w4a4=np.stack(w4a4),
             seeds=np.array([p["seed"] for p in per_prompt]))
    _atomic_write(out / f"samples-{args.recipe.replace('+', '_')}.npz", buffer.getvalue())
    if args.vae:
        from models import diffusers_io
        for name, latents in (("16bit", np.stack(full)), ("w4a4", np.stack(w4a4))):
            images = diffusers_io.decode_latents(args.vae, latents, family.name)
            diffusers_io.save_pngs(images, out / f"images-{args.recipe.replace('+', '_')}", f"{name}_")

    heldout = {n: r.get("heldout_error") for n, r in reports.items()}
    report = {"family": family.name, "checkpoint": str(args.checkpoint), "recipe": args.recipe, "steps": args.steps,
              "solver": args.solver, "shift": args.shift,
              "guidance": args.guidance, "latent_hw": list(args.latent_hw), "layers": len(qlayers),
              "prompts_captured": len(capture_indices), "per_prompt": per_prompt,
              "mean_latent_psnr_db": float(np.mean([p["latent_psnr_db"] for p in per_prompt])),
              "heldout_error": heldout}
    report_path = out / f"report-{args.recipe.replace('+', '_')}.json"
    _atomic_write(report_path, json.dumps(report, indent=2, default=float).encode("utf-8"))
    print(f"{family.name}: {len(qlayers)} layers quantized with {args.recipe}; mean latent PSNR W4A4 vs 16-bit "
          f"{report['mean_latent_psnr_db']:.2f} dB over {eval_count} prompt(s); outputs in {out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
