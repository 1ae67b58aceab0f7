"""diffusers checkpoint -> capture -> calibrate -> save the W4A4 model -> generate with both models.

    kroquant quantize-checkpoint --checkpoint DIR --out OUT [--embeddings prompts.npz | --synthetic-prompts N]
        [--recipe kroquant] [--steps 20] [--guidance 4.5] [--latent-hw 128 128] [--rows-per-layer N]
        [--compile-cache DIR]

``DIR`` is a diffusers transformer directory (config.json + safetensors; PixArt-Σ, SANA, FLUX.1 or Ideogram 4,
detected from ``_class_name`` by ``models.families``). Prompt embeddings come from an ``.npz`` made by
``kroquant encode-prompts`` (PixArt/SANA ``context (P, t, c)``, ``mask (P, t)``, ``uncond_context (1, t, c)``,
``uncond_mask (1, t)``; FLUX ``context (P, t, 4096)``, ``pooled (P, 768)``; Ideogram 4 ``context (P, t, 53248)``,
``mask (P, t)``, sampled with ``--guidance 1`` and ``--latent-hw`` the image-token grid) or, for smoke tests, from
random embeddings (``--synthetic-prompts``).

Everything that can be checked from the arguments and the model's config is checked before the capture (recipe name,
low-rank rank vs ``min(o, d)``, a writable ``--out``, the prompt file, counts >= 1). Linears whose input width is not
a multiple of the format's block (SANA's ``mlp_ratio 2.5`` gives d = 80 in some layers) stay 16-bit and are listed in
the report (``left_16bit``), or with ``--unaligned pad`` are quantized with their weight columns and captured inputs
zero-padded to the next multiple (the padded layer computes the same linear map; its forward pads its inputs) and
listed in the report (``padded``).

Outputs in OUT (each file written atomically; RECIPE is the recipe name with ``+`` -> ``_``):
``layer_set.safetensors`` + ``layer_set.json`` (the captured layer set, padded layers padded, and the capture settings
it came from, ``--text-rows-from-all-prompts``, the digest of ``--text-embeddings`` and of the model outside the
quantized linears (its other parameters and config) among them; a rerun with the same settings reuses it;
``--layer-set`` reuses another one, refused unless its weights are ``--checkpoint``'s), ``qlayers-RECIPE/`` (the resumable per-layer store of ``kroquant_jax.calibrate``, each layer
with the fingerprint of its inputs: a rerun resumes the layers whose weight, activations and recipe settings match
and refuses the folder, naming the layer and what changed, when they do not, unless ``--overwrite``; its
``capture.json`` holds the capture settings the store was calibrated on, which a rerun's are checked against before
it captures, so recipes calibrated on different captures can share OUT),
``quantized-RECIPE/`` (the self-contained quantized checkpoint of ``models.quantized_checkpoint``: config, 16-bit
weights, packed W4A4 layers; ``kroquant generate --checkpoint OUT/quantized-RECIPE`` runs it), ``samples-RECIPE.npz``
(16-bit and W4A4 latents of the evaluation prompts, same seeds) and ``report-RECIPE.json`` (latent PSNR / relative
error of W4A4 vs 16-bit per prompt, per-layer held-out errors, ``left_16bit``, the sampler used).
With ``--fuse-shared-inputs`` each of the family's groups of linears that read the same input (``Family.shared_inputs``:
q|k|v, ...) is calibrated and stored as one layer named ``a|b|c`` (one transform, one low-rank branch, as the fused
GEMM serves it; the capture is the same), RECIPE becomes ``RECIPE-fused`` in every output name (its own store, so a
per-linear store is never resumed as a fused one) and the report lists the fused groups (``fused``) and the groups kept
per linear and why (``not_fused``: a member left 16-bit). Members of unequal widths (FLUX.1's single-block
q|k|v|proj_mlp) fuse too: loading splits the output at each member's width.
The last ``--eval-prompts`` prompts are only generated, never captured (unless there are no more prompts than that).
With ``--vae DIR`` (a diffusers AutoencoderKL directory, torch side) the latents are also decoded to PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import calibrate
from scripts.common_args import (UserError, add_compile_cache, add_quiet, check_out_dir, finite_float, positive_float,
                                 positive_int, quantize_with_store, require_paths, verb_parser)


STORE_CAPTURE_RECORD = "capture.json"  # in qlayers-RECIPE/: the capture settings its layers were calibrated on

EXAMPLES = (
    "--checkpoint pixart-sigma/transformer --embeddings prompts.npz --out runs/pixart",
    "--checkpoint checkpoints/emoji_pixart --embeddings checkpoints/emoji_pixart/testbed_prompts.npz "
    "--solver flow_euler --latent-hw 32 32 --recipe kroquant+loraq --out runs/emoji",
    "--checkpoint tiny/transformer --synthetic-prompts 4 --steps 2 --latent-hw 8 8 --out /tmp/smoke --quiet",
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = verb_parser("quantize-checkpoint", __doc__, EXAMPLES)
    parser.add_argument("--checkpoint", required=True,
                        help="diffusers transformer directory (the pipeline's transformer/ folder)")
    parser.add_argument("--out", required=True, help="output directory (created; resumed when its results match)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--embeddings", help=".npz of precomputed prompt embeddings (see module doc)")
    prompts.add_argument("--synthetic-prompts", type=positive_int, help="use N random prompt embeddings (smoke tests)")
    parser.add_argument("--synthetic-tokens", type=positive_int, default=8, help="tokens per synthetic prompt")
    parser.add_argument("--recipe", default="kroquant", help="kroquant_jax.calibrate recipe name (e.g. rtn, "
                        "smoothquant, hadamard32, kroquant, svdquant, kroquant+loraq, smoothed_kroquant+gptq+loraq)")
    calibrate.add_recipe_arguments(parser)
    parser.add_argument("--solver", choices=("dpm_solver_pp_2m", "flow_euler"),
                        help="default: DPM-Solver++ 2M for PixArt, flow Euler for SANA/FLUX; flow_euler for "
                        "flow-matching PixArt-architecture models (the emoji testbed)")
    parser.add_argument("--shift", type=positive_float, help="flow-matching sigma shift (default: the family's)")
    parser.add_argument("--max-prompts", type=positive_int, help="use only the first N prompts of --embeddings")
    parser.add_argument("--steps", type=positive_int, default=20, help="denoising steps (capture and generation)")
    parser.add_argument("--guidance", type=finite_float, default=4.5, help="CFG scale (PixArt/SANA)")
    parser.add_argument("--latent-hw", type=positive_int, nargs=2, default=(128, 128), metavar=("H", "W"),
                        help="latent height and width")
    parser.add_argument("--rows-per-layer", type=positive_int, default=None,
                        help="captured rows kept per layer (default: what the row split asks for, --calib-rows + "
                             "--calib-validation + --calib-test)")
    parser.add_argument("--layer-set", help="reuse a captured layer set (.safetensors/.npz) instead of capturing; "
                        "its weights must be --checkpoint's")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="prompts per sampling run")
    parser.add_argument("--text-rows-from-all-prompts", action="store_true",
                        help="PixArt-Sigma / SANA: the cross-attention keys' / values' rows (their input is the "
                             "projected caption alone, the same at every step, so the sampling runs see only the "
                             "captured prompts' few tokens) come from the caption projection of every real token of "
                             "every captured prompt, or of --text-embeddings, and of the unconditional caption; the "
                             "other layers' rows are the same as without it (models.capture: "
                             "text_rows_from_all_prompts)")
    parser.add_argument("--text-embeddings", metavar="NPZ",
                        help="with --text-rows-from-all-prompts: a prompt .npz (the layout of --embeddings, e.g. "
                             "many more prompts than are sampled) whose every prompt gives those rows")
    parser.add_argument("--eval-prompts", type=positive_int, default=4, help="the LAST N prompts are generated with "
                        "both models and not captured (unless there are no more than N prompts)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise and the row draws")
    parser.add_argument("--unaligned", default="keep-16bit", choices=("keep-16bit", "pad"),
                        help="linears whose input width is not a multiple of the format's block (32): keep-16bit "
                        "leaves them unquantized, pad zero-pads their weight and inputs to the block and quantizes "
                        "them; both are listed in the report")
    parser.add_argument("--fuse-shared-inputs", action="store_true",
                        help="calibrate each group of linears that read the same input (the family's "
                             "shared_inputs: q|k|v, Ideogram 4's w1|w3, ...) as one layer: one transform and one "
                             "low-rank branch per group, as the fused GEMM serves them (kroquant_jax.shared_inputs); "
                             "outputs are named RECIPE-fused; groups whose members are not all quantized stay per "
                             "linear and are listed in the report (not_fused)")
    parser.add_argument("--overwrite", action="store_true",
                        help="recompute everything in --out instead of refusing results made from other inputs")
    parser.add_argument("--vae", help="diffusers AutoencoderKL directory: decode the latents to PNGs (torch)")
    add_compile_cache(parser, "calibration, capture, sampling")
    add_quiet(parser)
    args = parser.parse_args(argv)
    if args.rows_per_layer is None:
        args.rows_per_layer = calibrate.split_rows_wanted(args)
    return args


def check_checkpoint_dir(checkpoint: str) -> dict:
    """The parsed ``config.json`` of a diffusers transformer folder, or a :class:`UserError` naming the problem: a
    missing folder, a pipeline root passed instead of its ``transformer/``, a missing or broken ``config.json``, an
    unknown ``_class_name``."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"--checkpoint {checkpoint}: no such folder")
    config_path = folder / "config.json"
    if not config_path.exists():
        if (folder / "model_index.json").exists() or (folder / "transformer" / "config.json").exists():
            raise UserError(f"--checkpoint {checkpoint} is a diffusers pipeline folder; pass its transformer "
                            f"folder: --checkpoint {folder / 'transformer'}")
        raise UserError(f"--checkpoint {checkpoint}: no config.json (expected a diffusers transformer folder)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    from models import families

    try:
        families.detect(config, str(config_path))
    except ValueError as err:
        raise UserError(str(err)) from None
    return config


def build_recipe(args):
    """The recipe of ``--recipe`` with the recipe flags (:func:`kroquant_jax.calibrate.add_recipe_arguments`) and the
    progress bar of ``--quiet``."""
    try:
        recipe = calibrate.recipe_from_args(args.recipe, args, progress=not args.quiet)
    except ValueError as err:
        raise UserError(f"--recipe: {err}") from None
    unused = calibrate.unused_stage_arguments({args.recipe: recipe}, args)
    if unused:
        raise UserError("; ".join(unused))
    return recipe


def plan_layers(model, recipe, recipe_name: str, unaligned: str = "keep-16bit"
                ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray | None]], dict[str, str], dict[str, int]]:
    """Which quantizable linears the recipe quantizes, checked from the model before any capture.

    Args:
      unaligned: what to do with a linear whose input width ``d`` is not a multiple of the format's block:
        ``"keep-16bit"`` (leave it) or ``"pad"`` (quantize it zero-padded to the block).

    Returns ``({name: (W (o, d) float32, bias (o,) | None)}`` of the layers to quantize (unpadded), ``{name: reason}``
    of those left 16-bit, ``{name: zero columns}`` of those padded). Raises a :class:`UserError` naming the layer if
    the recipe's low-rank branch does not fit it (``rank > min(o, d)``, or a LoRaQ rank that is not a multiple of
    the block).
    """
    from kroquant_jax import lowrank
    from models.layers import linears

    block = recipe.calibration.objective.fmt.block_size
    quantized, left, pads = {}, {}, {}
    for name, layer in linears(model, quantizable_only=True).items():
        weight = np.asarray(layer.kernel[...], np.float32).T  # (o, d)
        o, d = weight.shape
        if d % block:
            if unaligned != "pad":
                left[name] = f"input width {d} is not a multiple of the block {block}"
                continue
            pads[name] = -d % block
        if recipe.lowrank is not None:
            cfg = (recipe.loraq or lowrank.LoRaQConfig()) if recipe.lowrank == "loraq" else (
                recipe.svdquant or lowrank.SVDQuantConfig())
            fmt = cfg.fmt if recipe.lowrank == "loraq" and cfg.quantize_branch else None
            try:
                shape = (o, d + pads.get(name, 0))
                rank = lowrank.resolve_rank(cfg.rank, shape, fmt and fmt.block_size, name)
                lowrank.check_rank(name, shape, rank, fmt)
            except ValueError as err:
                raise UserError(f"--recipe {recipe_name}: {err}") from None
        quantized[name] = (weight, None if layer.bias is None else np.asarray(layer.bias[...], np.float32))
    if not quantized:
        raise UserError(f"no quantizable linear has an input width that is a multiple of {block} "
                        f"({len(left)} left 16-bit)")
    return quantized, left, pads


def plan_fusion(family, model, weights: dict) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """``(groups to fuse, {fused name: why not})`` of the family's shared-input groups
    (``models.families.Family.shared_inputs``) among the linears to quantize (``weights``): a group is fused when
    every member is quantized (loading splits the fused output at the members' widths,
    ``models.quantized_checkpoint.member_widths``)."""
    from kroquant_jax import shared_inputs

    fused, not_fused = [], {}
    for group in family.shared_inputs(model):
        name = shared_inputs.fused_name(group)
        left = [m for m in group if m not in weights]
        if left:
            not_fused[name] = f"{left} not quantized"
        else:
            fused.append(tuple(group))
    return fused, not_fused


def fused_weights(weights: dict, groups: list[tuple[str, ...]]) -> dict:
    """``weights`` (``{name: (W, bias)}``) with each group's members replaced by their fused layer, in the
    layer order (``kroquant_jax.shared_inputs.stack_members``)."""
    from kroquant_jax import shared_inputs

    first = {group[0]: group for group in groups}
    grouped = {m for group in groups for m in group}
    out = {}
    for name, weight in weights.items():
        if name in first:
            out[shared_inputs.fused_name(first[name])] = shared_inputs.stack_members(
                [weights[m] for m in first[name]])
        elif name not in grouped:
            out[name] = weight
    return out


def pad_layer_set(layer_set, pads: dict[str, int], block: int) -> dict:
    """The layer set with the layers of ``pads`` zero-padded to the block (``kroquant_jax.qlinear.pad_to_block``)."""
    from kroquant_jax.qlinear import pad_to_block

    out = dict(layer_set)
    for name in pads:
        weight, bias, activations = layer_set[name]
        weight, activations, _ = pad_to_block(weight, activations, block)
        out[name] = (weight, bias, activations)
    return out


def check_layer_set(layer_set: dict, weights: dict, source: str, checkpoint: str) -> None:
    """Refuses a layer set that was not captured from ``checkpoint``: another set of layers, or other weights."""
    from kroquant_jax.provenance import layer_set_mismatch

    why = layer_set_mismatch(layer_set, weights)
    if why is not None:
        raise UserError(f"{source}: {why}: not captured from --checkpoint {checkpoint} (another checkpoint or "
                        f"--dtype?); capture again without --layer-set")


def check_layer_set_model(path: str, model_digest: str | None, checkpoint: str) -> None:
    """``--layer-set`` written by another quantize-checkpoint run (its ``.json`` beside it records the capture
    settings) is refused when the model outside the quantized linears differs from ``--checkpoint``'s: its
    activations came from another model even where the quantized weights agree. A layer set without that record
    (captured elsewhere, or before the digest was recorded) is checked by its weights alone (:func:`check_layer_set`).
    """
    record = Path(path).with_suffix(".json")
    if model_digest is None or not record.is_file():
        return
    from kroquant_jax.fileio import read_json_object

    try:
        recorded = read_json_object(record).get("model")
    except ValueError as err:
        raise UserError(f"--layer-set {path}: its capture record is unreadable: {err}") from None
    if recorded is not None and recorded != model_digest:
        raise UserError(f"--layer-set {path}: captured from a model whose parameters outside the quantized linears, or "
                        f"whose config, differ from --checkpoint {checkpoint}'s (recorded in {record}); capture again "
                        "without --layer-set")


def capture_settings(args, arrays: dict, capture_indices: list[int], names: list[str],
                     text_arrays: dict | None = None, model_digest: str | None = None) -> dict:
    """What a captured layer set depends on besides the weights (stored beside it as ``layer_set.json``).

    ``model_digest`` (``models.layers.params_digest`` of the model less the quantized linears, and of its config) is
    the rest of the model, which the quantized linears' weights (compared with the layer set's) do not cover: a
    checkpoint that differs only in a norm, an embedding or a 16-bit linear gives other activations.

    With ``--text-rows-from-all-prompts`` it also holds ``text_rows_from_all_prompts`` and the digests of the
    ``text_arrays`` the text-only rows come from (``--text-embeddings``, or None for the captured prompts); without
    it neither key is there, as in the settings of layer sets captured before the option existed."""
    from kroquant_jax.provenance import NUMERICS_VERSION, array_digest

    prompts = {k: array_digest(v if k.startswith("uncond_") else v[capture_indices]) for k, v in arrays.items()}
    settings = {"numerics_version": NUMERICS_VERSION, "steps": args.steps, "guidance": args.guidance,
                "latent_hw": list(args.latent_hw), "rows_per_layer": args.rows_per_layer, "seed": args.seed,
                "shift": args.shift, "solver": args.solver, "batch_size": args.batch_size, "dtype": args.dtype,
                "prompts": prompts, "layers": names}
    if model_digest is not None:
        settings["model"] = model_digest
    if args.text_rows_from_all_prompts:
        settings["text_rows_from_all_prompts"] = True
        settings["text_prompts"] = None if text_arrays is None else {k: array_digest(v) for k, v in
                                                                      sorted(text_arrays.items())}
    return settings


def _settings_changes(stored: dict, current: dict) -> list[str]:
    if stored.get("layer_set"):  # a store calibrated on --layer-set (its record holds that file's digest alone)
        return ["calibrated on --layer-set, not on a capture with these settings"]

    def change(k):
        if k == "model":
            return ("capture model: the checkpoint's parameters outside the quantized linears, or its config, "
                    + ("differ" if stored.get(k) is not None else "not recorded (captured before they were keyed)"))
        if k in ("prompts", "layers", "text_prompts"):
            return f"capture {k}"
        return f"capture setting {k}: {stored.get(k)!r} -> {current.get(k)!r}"

    return [change(k) for k in sorted(set(stored) | set(current)) if stored.get(k) != current.get(k)]


def _load(checkpoint: str, dtype: str):
    """``(Family, cfg, model)``: the family recognised from config.json's ``_class_name`` (``models.families``)."""
    from models import families

    return families.load_diffusers(checkpoint, dtype)


def read_prompt_file(path: str, max_prompts: int | None = None, flag: str = "--embeddings") -> dict[str, np.ndarray]:
    """The arrays of a prompt ``.npz`` (the first ``max_prompts`` prompts), with the emoji testbed's prompt file
    layout (``context_mask``, ``null_context``, ``null_mask``) renamed to the denoisers' keys. A file that is not a
    readable ``.npz`` is a :class:`UserError` naming ``flag`` and the file."""
    from kroquant_jax.fileio import read_npz

    try:
        arrays = read_npz(path)
    except (OSError, ValueError) as err:  # read_npz's message starts with the path
        raise UserError(f"{flag} {err}") from None
    renames = (("mask", "context_mask"), ("uncond_context", "null_context"), ("uncond_mask", "null_mask"))
    for ours, theirs in renames:  # the emoji testbed's prompt file layout
        if ours not in arrays and theirs in arrays:
            arrays[ours] = arrays[theirs] if theirs == "context_mask" else arrays[theirs][None]
    if max_prompts:
        arrays = {k: v[:max_prompts] if not k.startswith("uncond_") and v.ndim else v for k, v in arrays.items()}
    return arrays


def text_prompt_arrays(args, family, model, names: list[str]) -> dict[str, np.ndarray] | None:
    """With ``--text-rows-from-all-prompts``: the text inputs of ``--text-embeddings`` (the keys the text-only rows
    read, checked against the model by ``models.capture.check_text_prompts``), or None for the captured prompts;
    None without the switch. A :class:`UserError` names the flag, file and key, and refuses the switch for a family
    without text-only layers or when none of the layers ``names`` to quantize is one."""
    from models import capture

    if not args.text_rows_from_all_prompts:
        return None
    source = f"--text-embeddings {args.text_embeddings}" if args.text_embeddings else "--text-rows-from-all-prompts"
    if family.text_only is None:
        raise UserError(f"{source}: the {family.name} family has no linear whose input depends on the text alone")
    declared = family.text_only.layers(model)
    if not any(name in declared for name in names):
        raise UserError(f"{source}: none of the {len(names)} layers to quantize reads the text alone (the "
                        f"{family.name} family's: {list(declared[:2])}, ...)")
    if not args.text_embeddings:
        return None
    arrays = {k: v for k, v in read_prompt_file(args.text_embeddings, flag="--text-embeddings").items()
              if k in capture.TEXT_KEYS}
    try:
        return capture.check_text_prompts(family, model, arrays, args.guidance != 1.0, source)
    except ValueError as err:
        raise UserError(str(err)) from None


def prompt_arrays(args, family, cfg, flag: str = "--embeddings") -> dict[str, np.ndarray]:
    """The family's text inputs from ``args.embeddings`` (first ``args.max_prompts``; the verb's option is ``flag``) or
    ``args.synthetic_prompts`` random ones, checked against the model (:func:`check_prompt_arrays`: a
    :class:`UserError` names the flag, file, key and shape)."""
    widths = family.prompt_widths(cfg)
    if args.embeddings:
        arrays = read_prompt_file(args.embeddings, args.max_prompts, flag)
    else:
        rng = np.random.default_rng(args.seed)
        count, tokens = args.synthetic_prompts, args.synthetic_tokens
        arrays = {}
        for key in family.prompt_inputs:  # random features, an all-zero unconditional caption, masks keep every token
            rows = 1 if key.startswith("uncond_") else count
            if key not in widths:
                arrays[key] = np.ones((rows, tokens))
            elif key == "pooled":
                arrays[key] = rng.standard_normal((rows, widths[key]))
            else:
                draw = np.zeros if key.startswith("uncond_") else rng.standard_normal
                arrays[key] = draw((rows, tokens, widths[key]))
    source = f"{flag} {args.embeddings}" if args.embeddings else "prompt embeddings"
    return check_prompt_arrays(arrays, family, widths, source)


def check_prompt_arrays(arrays: dict[str, np.ndarray], family, widths: dict[str, int], source: str
                        ) -> dict[str, np.ndarray]:
    """``{key: float32 array}`` of the family's text inputs (``Family.prompt_inputs``) in ``arrays``, or a
    :class:`UserError` naming ``source`` and the key, before any sampling: a missing key; features of another width
    than the model's (``widths``); a mask that is not ``(prompts, tokens)`` of its features or not 0/1; keys that
    disagree on the number of prompts; no prompt; a NaN or Inf (sampled, it would give NaN latents silently)."""
    needed = family.prompt_inputs
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise UserError(f"{source}: lacks {missing} (a {family.name} model needs {list(needed)}; it holds "
                        f"{sorted(arrays)})")
    for key, width in widths.items():
        rank, shape = (2, "(prompts, ") if key == "pooled" else (3, "(prompts, tokens, ")
        if arrays[key].ndim != rank or arrays[key].shape[-1] != width:
            raise UserError(f"{source}: {key!r} has shape {arrays[key].shape}, the model needs {shape}{width})")
    count = arrays["context"].shape[0]
    if count == 0:
        raise UserError(f"{source}: no prompts")
    for key in needed:
        value = arrays[key]
        features = "uncond_context" if key == "uncond_mask" else "context" if key == "mask" else None
        if features is not None and value.shape != arrays[features].shape[:2]:
            raise UserError(f"{source}: {key!r} has shape {value.shape}, not the (prompts, tokens) of {features!r}, "
                            f"{arrays[features].shape[:2]}")
        if not key.startswith("uncond_") and value.shape[0] != count:
            raise UserError(f"{source}: {key!r} has {value.shape[0]} prompts, 'context' has {count}")
        if not np.isfinite(value).all():
            raise UserError(f"{source}: {key!r} holds NaN or Inf values")
        if features is not None and not np.isin(value, (0, 1)).all():
            raise UserError(f"{source}: {key!r} holds values other than 0 and 1 (1 = real token)")
    return {k: np.asarray(arrays[k], np.float32) for k in needed}


def prompt_batches(arrays: dict[str, np.ndarray], indices: list[int], batch_size: int, dtype) -> list[dict]:
    """The prompts ``indices`` in batches of ``batch_size`` (the unconditional inputs broadcast to each batch)."""
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


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    out = Path(args.out)
    # validate everything that can be checked from the arguments and the config before the capture
    check_checkpoint_dir(args.checkpoint)
    recipe = build_recipe(args)
    require_paths(("--embeddings", args.embeddings), ("--layer-set", args.layer_set), ("--vae", args.vae),
                  ("--text-embeddings", args.text_embeddings))
    if args.text_embeddings and not args.text_rows_from_all_prompts:
        raise UserError("--text-embeddings is read only with --text-rows-from-all-prompts")
    if args.text_rows_from_all_prompts and args.layer_set:
        raise UserError("--text-rows-from-all-prompts is a capture option, and --layer-set captures nothing")
    check_out_dir(out)
    tag = args.recipe.replace("+", "_") + ("-fused" if args.fuse_shared_inputs else "")
    from flax import nnx
    from tqdm.auto import tqdm

    from kroquant_jax import provenance, qlinear
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    from kroquant_jax.fileio import atomic_write_json, read_json_object
    from kroquant_jax.layerset import load_layer_set, save_layer_set
    from models import capture, image_metrics, quantize_model, sampling

    family, cfg, model = _load(args.checkpoint, args.dtype)
    try:  # the sampler would fail inside its trace, after the capture's setup
        family.check_latent_hw(cfg, tuple(args.latent_hw))
    except ValueError as err:
        raise UserError(f"--latent-hw {' '.join(map(str, args.latent_hw))}: {err}") from None
    solver, shift = sampling.resolve_sampler(family.name, args.solver, args.shift)
    arrays = prompt_arrays(args, family, cfg)
    dtype = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))[0].dtype
    count = arrays["context"].shape[0]
    weights, left_16bit, pads = plan_layers(model, recipe, args.recipe, args.unaligned)
    block = recipe.calibration.objective.fmt.block_size
    widths = {n: weights[n][0].shape[1] for n in pads}
    weights = {n: (qlinear.pad_to_block(w, None, block)[0], b) for n, (w, b) in weights.items()}  # what is calibrated
    names = list(weights)
    groups, not_fused = plan_fusion(family, model, weights) if args.fuse_shared_inputs else ([], {})
    calibrated = fused_weights(weights, groups)  # what is calibrated and stored: fused layers and the others
    text_arrays = text_prompt_arrays(args, family, model, names)
    eval_count = min(args.eval_prompts, count)
    capture_indices = list(range(count - eval_count)) if count > eval_count else list(range(count))

    # a result folder made from other inputs is refused now, not after the capture
    store_dir = out / f"qlayers-{tag}"  # one resumable store per recipe
    store = qlinear.QLinearStore(str(store_dir))
    from models.layers import params_digest

    settings = capture_settings(args, arrays, capture_indices, names, text_arrays,
                                params_digest(model, names, config=cfg))
    cached, cached_key = out / "layer_set.safetensors", out / "layer_set.json"
    # (--overwrite recaptures and recomputes, so it reads neither record)
    stored_settings = read_json_object(cached_key) if cached_key.exists() and not args.overwrite else None
    # the capture this recipe's store was calibrated on: its own record, since another recipe's run into the same
    # --out may have captured again since (stores from before the record: the folder's layer_set.json)
    store_key = store_dir / STORE_CAPTURE_RECORD
    store_settings = (read_json_object(store_key) if store_key.exists() and not args.overwrite else stored_settings)
    if not args.overwrite:
        try:
            partial = {n: provenance.layer_fingerprint(w, b, None, recipe) for n, (w, b) in calibrated.items()}
            stored = store.verify(partial)
            # (a --layer-set run is checked layer by layer against its rows, in the calibration below)
            if stored and not args.layer_set and store_settings is not None and store_settings != settings:
                raise provenance.StaleResultError(
                    next(n for n in calibrated if n in store), _settings_changes(store_settings, settings),
                    str(store_dir))
        except provenance.StaleResultError as err:
            raise UserError(f"{err}; rerun with --overwrite to recompute, or choose another --out") from None

    # 1. capture (or reuse the layer set captured with the same settings)
    if args.layer_set:
        layer_set = load_layer_set(args.layer_set)
        check_layer_set(layer_set, weights, f"--layer-set {args.layer_set}", args.checkpoint)
        check_layer_set_model(args.layer_set, settings.get("model"), args.checkpoint)
        layer_set = {n: layer_set[n] for n in names}
    elif not args.overwrite and cached.exists() and stored_settings == settings:
        layer_set = load_layer_set(str(cached))
        check_layer_set(layer_set, weights, str(cached), args.checkpoint)
        print(f"reused the layer set captured with the same settings: {cached}", file=sys.stderr)
    else:
        capture_config = capture.CaptureConfig(num_steps=args.steps, guidance_scale=args.guidance,
                                               latent_hw=tuple(args.latent_hw), rows_per_layer=args.rows_per_layer,
                                               seed=args.seed, shift=args.shift, solver=args.solver,
                                               layers=tuple(names), progress=not args.quiet,
                                               text_rows_from_all_prompts=args.text_rows_from_all_prompts)
        batches = prompt_batches(arrays, capture_indices, args.batch_size, dtype)
        captured = capture.capture_layer_set(family, model, batches, capture_config, text_arrays)
        layer_set = pad_layer_set(captured, pads, block)
        save_layer_set(str(cached), layer_set)
        atomic_write_json(cached_key, settings)

    # 2. calibrate (resumable store), 3. save the quantized layers
    from kroquant_jax.shared_inputs import fuse_shared_inputs, members_of

    if groups:  # each group one layer (its first member's rows, the members' weights stacked)
        layer_set = fuse_shared_inputs(layer_set, groups)
    # recorded before the store's first layer from this capture (a --layer-set: that file's digest)
    atomic_write_json(store_key, {"layer_set": provenance.file_digest(args.layer_set)} if args.layer_set else settings)
    qlayers, reports = quantize_with_store(layer_set, recipe, store, args.overwrite, "--out")
    qlayers = {n: qlinear.with_input_pad(q, pads.get(members_of(n)[0], 0)) for n, q in qlayers.items()}
    resumed = sum(bool(r.get("resumed")) for r in reports.values())
    from models.quantized_checkpoint import linear_overrides, save_quantized_checkpoint
    save_quantized_checkpoint(out / f"quantized-{tag}", model, qlayers, recipe_name=args.recipe, recipe=recipe,
                              reports=reports, left_16bit=left_16bit,
                              extra={"solver": solver, "shift": shift, "steps": args.steps, "guidance": args.guidance,
                                     "latent_hw": list(args.latent_hw), "source_checkpoint": str(args.checkpoint)})
    overrides = linear_overrides(qlayers, model)  # a fused layer's members take their rows of its output
    quantize_model.check_overrides(model, overrides)

    # 4. generate with both models, same seeds, same jitted sampler
    graphdef, state = nnx.split(model)
    sample = jax.jit(family.make_sampler(graphdef, cfg, num_steps=args.steps, guidance_scale=args.guidance,
                                         latent_hw=tuple(args.latent_hw), shift=args.shift, solver=args.solver))
    eval_indices = list(range(count - eval_count, count))
    full, w4a4, per_prompt = [], [], []
    batches = zip(eval_indices, prompt_batches(arrays, eval_indices, 1, dtype))
    for index, batch in tqdm(batches, total=len(eval_indices), desc="generate", unit="prompt", disable=args.quiet):
        key = jax.random.key(args.seed + 1000 + index)
        reference, _ = sample({"model": state, **batch}, key)
        quantized, _ = sample({"model": state, **batch, "overrides": overrides}, key)
        reference, quantized = np.asarray(reference, np.float32), np.asarray(quantized, np.float32)
        full.append(reference[0])
        w4a4.append(quantized[0])
        per_prompt.append({"prompt": index, "seed": args.seed + 1000 + index,
                           "latent_psnr_db": image_metrics.range_psnr(quantized, reference),
                           "latent_relative_error": float(np.linalg.norm(quantized - reference)
                                                          / max(np.linalg.norm(reference), 1e-30))})
    import io
    buffer = io.BytesIO()
    np.savez(buffer, latents_16bit=np.stack(full), latents_w4a4=np.stack(w4a4),
             seeds=np.array([p["seed"] for p in per_prompt]))
    _atomic_write(out / f"samples-{tag}.npz", buffer.getvalue())
    if args.vae:
        from models import diffusers_io
        for name, latents in (("16bit", np.stack(full)), ("w4a4", np.stack(w4a4))):
            images = diffusers_io.decode_latents(args.vae, latents, family.name)
            diffusers_io.save_pngs(images, out / f"images-{tag}", f"{name}_")

    heldout = {n: r.get("heldout_error") for n, r in reports.items()}
    report = {"family": family.name, "checkpoint": str(args.checkpoint), "recipe": args.recipe, "steps": args.steps,
              "solver": solver, "shift": shift,
              "guidance": args.guidance, "latent_hw": list(args.latent_hw), "layers": len(qlayers),
              "layers_resumed": resumed, "left_16bit": left_16bit,
              "padded": {n: f"input width {widths[n]} zero-padded to {widths[n] + p}" for n, p in pads.items()},
              "fused": {n: list(members_of(n)) for n in qlayers if len(members_of(n)) > 1}, "not_fused": not_fused,
              "prompts_captured": len(capture_indices), "per_prompt": per_prompt,
              "mean_latent_psnr_db": float(np.mean([p["latent_psnr_db"] for p in per_prompt])),
              "heldout_error": heldout}
    report_path = out / f"report-{tag}.json"
    _atomic_write(report_path, json.dumps(report, indent=2, default=float).encode("utf-8"))
    left = f"; {len(left_16bit)} left 16-bit (see the report)" if left_16bit else ""
    left += f"; {len(pads)} zero-padded to the block (see the report)" if pads else ""
    left += f"; {len(report['fused'])} of them shared-input groups fused" if report["fused"] else ""
    print(f"{family.name}: {len(qlayers)} layers quantized with {args.recipe}{left}; mean latent PSNR W4A4 vs 16-bit "
          f"{report['mean_latent_psnr_db']:.2f} dB over {eval_count} prompt(s); outputs in {out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
