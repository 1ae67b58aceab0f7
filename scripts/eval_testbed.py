"""End-to-end W4A4 evaluation of the emoji testbed DiT (or any flow-matching pixel-space PixArt checkpoint).

    kroquant evaluate --out runs/eval_testbed            # every method (ALL_METHODS)
    kroquant evaluate --out runs/x --methods rtn kroquant kroquant+loraq kroquant+loraq@128 --rank 0.125
    kroquant evaluate --out runs/eval_testbed --seeds 0 1 2   # the same run at three generation seeds

1. Capture: sample the calibration captions (the training records of the prompt file) with the flow-matching Euler
   sampler and CFG, recording random input rows of every quantizable linear at every step (real caption tokens only,
   repeated rows once: ``models.testbed.evaluation.capture_flow_layer_set`` over ``models.capture``). With
   ``--text-rows-from-all-prompts`` the cross-attention keys' / values' rows (a function of the caption alone) come
   from the caption projection of every distinct training caption of ``--text-prompts`` (default ``--prompts``) and
   the empty caption instead (docs/calibration.md, "Text-only layers").
2. Calibrate every method on that layer set (``kroquant_jax.calibrate.quantize_layer_set``, resumable per method:
   the calibrated layers are stored under ``--out``/qlayers in a folder named by the method and a hash of the capture
   settings and the recipe, so a rerun with other settings never picks up stale layers).
3. Generate the evaluation captions with the 16-bit model and with each W4A4 model, same seeds and sampler, at
   every generation seed of ``--seeds`` (default: ``--seed`` alone), in caption groups
   (``models.testbed.evaluation.select_caption_groups``, the first records of each kind in record order):
   ``--eval-captions`` held-out records of both kinds, ``--eval-train-captions`` training records that calibration
   did not use, ``--variant-captions`` held-out variants of a trained concept (another skin tone or gender of a
   trained emoji: the testbed draws them) and ``--novel-captions`` held-out novel concepts (it cannot draw them, even
   in 16 bits). Per group, compare with the 16-bit images: PSNR (mean and its standard error over
   the group's captions), SSIM, chroma and saturation ratios (``models.image_metrics``); and the 16-bit images with
   the dataset's glyphs (how well the model draws the group at all). Plus the per-layer relative output errors on
   held-out rows (mean, max, and the mean per layer type).

Seeds: ``--seed`` seeds the capture (its noise and its row draws, so the calibrated layers depend on it) and is the
default generation seed; ``--seeds S [S ...]`` are the generation seeds alone. Generation seed ``s`` draws record
``i``'s start noise from ``fold_in(key(s + 1000), i)`` (the offset keeps it apart from the capture's noise), the same
for the 16-bit and every W4A4 model, and every image is compared with the 16-bit image of the same caption and seed.
With several seeds a group's PSNR is the mean over all its caption x seed images, ± the standard error over its
captions of the per-caption means over seeds, and the report and table add the per-seed PSNR (the mean over the
group's captions at each seed) with its spread over seeds (min, max, sample standard deviation)
(``models.testbed.evaluation.seed_image_metrics``). The capture and the calibrated layers do not depend on
``--seeds``: a rerun of an ``--out`` with other ``--seeds`` (and the same other settings) reuses them and only
generates again.

The recipe settings (``--calib-steps``, ``--rank``, ...) are :func:`kroquant_jax.calibrate.add_recipe_arguments`'s.
The low-rank branch's rank (``--rank``, or ``<recipe>@<rank>`` for one method): an int (LoRaQ's default is the
paper's 128, meant for layers 1152 and more wide) or a fraction of each layer's ``min(o, d)``
(``kroquant_jax.lowrank.resolve_rank``; 0.125 gives rank 32 on the testbed's 256-wide layers, which is also what the
paper's share, 128 of 1152 = 1/9, rounds to).

``--compile-cache DIR`` turns on JAX's persistent compilation cache in ``DIR``
(:func:`kroquant_jax.calibrate.enable_compile_cache`), so that a later run with the same shapes and settings loads
its compiled programs instead of compiling them.

Writes (atomically) ``report.json`` (with the captions and records of each group), ``table.md``, ``images.npz``
(every seed's images) and ``grid.png`` (the first generation seed; rows = captions tagged with their group, columns =
dataset glyph, 16-bit, methods) in ``--out``. The paper's FID, ImageReward and LPIPS need
Inception/BLIP/AlexNet weights from a hub: not offline here. Nothing here imports torch or diffusers (the checkpoint
is read by ``models.convert``'s numpy safetensors reader), so it runs on a machine with jax alone.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from kroquant_jax import calibrate
from kroquant_jax.fileio import atomic_write_text
from kroquant_jax.timing import CompileWatch
from models import families
from models.layers import linears
from models.testbed import data as testbed_data
from models.testbed.evaluation import (CAPTION_GROUPS, capture_flow_layer_set, flow_sampler, generate_seeds,
                                       group_metrics, layer_errors_summary, markdown_table, merge_outputs,
                                       select_caption_groups, training_caption_text, write_outputs)
from scripts.common_args import (add_compile_cache, check_out_dir, finite_float, nonnegative_int, positive_int,
                                 quantize_with_store, require_paths, verb_parser)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "emoji_pixart"
ALL_METHODS = ["rtn", "smoothquant", "hadamard32", "kroquant", "smoothed_kroquant", "rtn+loraq", "smoothquant+loraq",
               "hadamard32+loraq", "kroquant+loraq", "smoothed_kroquant+loraq", "svdquant", "smoothed_kroquant+gptq",
               "smoothed_kroquant+gptq+loraq"]


EXAMPLES = ("--out runs/eval_testbed", "--out runs/x --methods rtn kroquant kroquant+loraq --rank 0.125",
            "--out runs/eval_testbed --seeds 0 1 2",
            "--checkpoint DIR --prompts PROMPTS.npz --out runs/mine --methods rtn kroquant")

#: Generation seed ``s`` draws its start noise from ``key(s + GENERATION_KEY_OFFSET)`` (apart from the capture's).
GENERATION_KEY_OFFSET = 1000


def parse_args(argv=None, verb: str = "evaluate", description: str | None = None, preset: Sequence[str] = (),
               examples: Sequence[str] = EXAMPLES) -> argparse.Namespace:
    """The options of ``kroquant <verb>``; ``preset`` (a command line, e.g. the demo's fast settings) becomes the
    defaults, so ``--help`` shows them and the user's options override them (``--out`` is required unless the
    preset gives it)."""
    parser = build_parser(verb, description, examples, out_required=True)
    if preset:
        defaults = preset_defaults(preset, verb, description, examples)
        parser = build_parser(verb, description, examples, out_required=defaults["out"] is None)
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.rows_per_layer is None:
        args.rows_per_layer = calibrate.split_rows_wanted(args)
    if args.seeds is None:
        args.seeds = [args.seed]  # the default generation seed is --seed (documented in --help)
    if args.text_prompts is not None and not args.text_rows_from_all_prompts:
        parser.error("--text-prompts is read only with --text-rows-from-all-prompts")
    repeated = sorted({s for s in args.seeds if args.seeds.count(s) > 1})
    if repeated:
        parser.error(f"--seeds: each generation seed once, got {args.seeds} (repeated: {repeated})")
    return args


def preset_defaults(preset: Sequence[str], verb: str = "evaluate", description: str | None = None,
                    examples: Sequence[str] = EXAMPLES) -> dict:
    """The option values a ``preset`` command line sets (every option; the others at their defaults)."""
    return vars(build_parser(verb, description, examples, out_required=False).parse_args(list(preset)))


def build_parser(verb: str = "evaluate", description: str | None = None, examples: Sequence[str] = EXAMPLES, *,
                 out_required: bool = True) -> argparse.ArgumentParser:
    """The parser of :func:`parse_args` (``out_required``: whether ``--out`` must be given)."""
    parser = verb_parser(verb, __doc__ if description is None else description, examples)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="diffusers PixArt directory")
    parser.add_argument("--prompts", default=None, help="prompt .npz (default: <checkpoint>/testbed_prompts.npz)")
    parser.add_argument("--out", required=out_required, help="output folder")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS,
                        help="recipes, a low-rank one optionally with its own rank: kroquant+loraq@128")
    calibrate.add_recipe_arguments(parser)
    parser.add_argument("--calib-captions", type=positive_int, default=32, help="training captions sampled for capture")
    parser.add_argument("--eval-captions", type=nonnegative_int, default=8,
                        help="held-out captions (both kinds, record order) generated per method")
    parser.add_argument("--eval-train-captions", type=nonnegative_int, default=0,
                        help="also generate this many training captions not used for calibration")
    parser.add_argument("--variant-captions", type=nonnegative_int, default=0,
                        help="held-out variants of a trained concept (instead of --eval-captions' mix)")
    parser.add_argument("--novel-captions", type=nonnegative_int, default=0,
                        help="held-out novel concepts, never trained (instead of --eval-captions' mix)")
    parser.add_argument("--steps", type=positive_int, default=20, help="Euler steps (capture and generation)")
    parser.add_argument("--guidance", type=finite_float, default=3.0, help="CFG scale")
    parser.add_argument("--rows-per-layer", type=positive_int, default=None,
                        help="captured rows kept per layer (default: what the row split asks for, --calib-rows + "
                             "--calib-validation + --calib-test)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="captions per sampling call (capture)")
    parser.add_argument("--text-rows-from-all-prompts", action="store_true",
                        help="the cross-attention keys' / values' rows (their input is the caption projection alone, "
                             "the same at every step, so sampling --calib-captions captions sees only their few "
                             "tokens) come from the caption projection of every real token of every distinct "
                             "training caption of --text-prompts and of the empty caption; the other layers' rows "
                             "are the same as without it (models.capture: text_rows_from_all_prompts)")
    parser.add_argument("--text-prompts", metavar="NPZ", default=None,
                        help="dataset .npz whose distinct training captions give those rows (with "
                             "--text-rows-from-all-prompts; default: --prompts), e.g. the whole training set "
                             "runs/emoji32.npz")
    parser.add_argument("--grid-rows", type=positive_int, default=None,
                        help="at most this many captions per grid (default all)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="only merge the outputs of earlier runs (same settings, other methods; e.g. parallel "
                             "processes) into one report/table/grid in --out")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the capture (its noise and row draws: the calibrated layers depend on it) and "
                             "the default generation seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                        help="generation noise seeds (default: --seed): every caption is generated at each, by the "
                             "16-bit and every W4A4 model; the report adds the per-seed PSNR and its spread over "
                             "seeds. The capture and calibrated layers do not depend on them (a rerun of --out with "
                             "other --seeds reuses them)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="quantize only the first N quantizable linears")
    parser.add_argument("--overwrite", action="store_true",
                        help="capture and calibrate again instead of reusing --out's results (which are refused when "
                             "they were made from other inputs)")
    add_compile_cache(parser, "capture, calibration, sampling", "the reported compile seconds then include the loads")
    return parser


def store_folder(out: Path, method: str, recipe, capture_key: str) -> Path:
    """Where ``method``'s calibrated layers are stored: named by the method and a hash of the capture settings and
    the whole recipe (every stage's settings but those that only schedule the work,
    ``provenance.EXECUTION_SETTINGS``, e.g. ``--max-layers-per-program``), so layers calibrated with other settings
    are never resumed, and a rerun that only schedules the work otherwise resumes them."""
    from kroquant_jax.provenance import without_execution_settings

    digest = hashlib.sha1(f"{capture_key}|{without_execution_settings(recipe)!r}".encode()).hexdigest()[:12]
    return out / "qlayers" / f"{method.replace('+', '_').replace('@', '_r')}-{digest}"


def capture_key(args, prompts_path: str, calib_indices, names, text_prompts=None, inputs: str | None = None) -> str:
    """What the cached capture (``layer_set.safetensors``) and the method stores (:func:`store_folder`) depend on
    besides the weights; with ``--text-rows-from-all-prompts`` also the digest of its ``text_prompts`` (so a capture
    made with the option is never reused without it, nor with other captions, and vice versa). ``inputs``
    (:func:`capture_inputs_digest`): the content the capture reads, the calibration captions of ``prompts_path``
    (not only its path and the records' indices) and the model outside the quantized linears. ``--batch-size`` is
    in the key: batch ``i`` of the capture draws its noise from ``fold_in(seed, i)``, so the batching changes the
    rows."""
    from kroquant_jax.provenance import array_digest

    # "real-tokens": the capture drops masked tokens and repeated rows (models.capture); older caches differ.
    key = (f"real-tokens|{Path(args.checkpoint).resolve()}|{prompts_path}|{list(calib_indices)}|{args.steps}|"
           f"{args.guidance}|{args.rows_per_layer}|{args.seed}|{names}|batch-size:{args.batch_size}")
    if inputs is not None:
        key = f"{key}|inputs:{inputs}"
    if text_prompts is None:
        return key
    digest = hashlib.sha256("|".join(f"{k}:{array_digest(v)}" for k, v in sorted(text_prompts.items())).encode())
    return f"{key}|text-rows-from-all-prompts:{digest.hexdigest()}"


def capture_inputs_digest(dataset, calib_indices, model, cfg, names) -> str:
    """SHA-256 of what a capture reads besides its settings: the calibration records' caption context and mask, the
    null caption (``dataset``, the prompt file) and the model less the quantized linears ``names``
    (``models.layers.params_digest``: a checkpoint at the same path whose norms, embeddings or 16-bit linears
    changed gives other activations, though its quantized weights, compared with the cache's, are the same)."""
    from kroquant_jax.provenance import array_digest
    from models.layers import params_digest

    parts = {"context": dataset.context[calib_indices], "context_mask": dataset.context_mask[calib_indices],
             "null_context": dataset.null_context, "null_mask": dataset.null_mask}
    text = "|".join(f"{k}:{array_digest(v)}" for k, v in parts.items())
    return hashlib.sha256(f"{text}|model:{params_digest(model, names, config=cfg)}".encode()).hexdigest()


def _rows(given: int | None, field: str) -> str:
    """A row-split setting as the settings line shows it: the value, marked when it is RunConfig's default."""
    return str(given) if given is not None else f"{getattr(calibrate.RunConfig(), field)} (default)"


def settings_line(args, names, calib_indices, groups, text_captions: int | None = None) -> str:
    seeds = "" if len(args.seeds) == 1 else (f", generation seeds {' '.join(map(str, args.seeds))} (mean over "
                                             "caption x seed images, standard error over captions of the per-caption "
                                             "means)")
    generated = ", ".join(f"{len(indices)} {CAPTION_GROUPS[gid].label}" for gid, indices in groups.items())
    text_rows = "" if text_captions is None else (f"; cross-attention keys/values from the caption projection of "
                                                  f"{text_captions} distinct training captions + the empty caption")
    return (f"{args.checkpoint}: {len(names)} linears W4A4 (MXFP4), capture from {len(calib_indices)} training "
            f"captions x {args.steps} Euler steps (CFG {args.guidance:g}, {args.rows_per_layer} rows/layer"
            f"{text_rows}); "
            f"calibration rows {_rows(args.calib_rows, 'num_rows')}, validation rows "
            f"{_rows(args.calib_validation, 'num_validation')}, test rows {_rows(args.calib_test, 'num_test')} "
            f"per layer (fewer where a layer has fewer: the report's fallback_split_layers), KroQuant steps "
            f"{args.calib_steps or 'default'}, LoRaQ steps "
            f"{args.loraq_steps or 'default'}+{args.rotation_steps or 'default'}, --rank {args.rank or 'default'}; "
            f"metrics vs the 16-bit images of the captions {generated}, same seeds (PSNR ± its standard error "
            f"over the group's captions){seeds}; "
            f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")


def main(argv=None, verb: str = "evaluate", description: str | None = None, preset: Sequence[str] = (),
         examples: Sequence[str] = EXAMPLES) -> int:
    """``kroquant evaluate`` (``verb``, ``description``, ``preset``, ``examples``: see :func:`parse_args`)."""
    from kroquant_jax import provenance
    from models import quantize_model

    started_run = time.perf_counter()
    args = parse_args(argv, verb, description, preset, examples)
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)  # before anything compiles
    out = Path(args.out)
    if args.merge:
        report = merge_outputs([Path(f) for f in args.merge], out, args.grid_rows)
        print(markdown_table(report), flush=True)
        return 0
    check_out_dir(out)
    require_paths(("--checkpoint", args.checkpoint), ("--prompts", args.prompts))
    prompts_path = args.prompts or str(Path(args.checkpoint) / "testbed_prompts.npz")
    dataset = testbed_data.load_dataset(prompts_path)
    cfg, model = families.PIXART.from_diffusers(args.checkpoint, "float32")
    if cfg.in_channels != 3 or cfg.sample_size != dataset.image_size:
        raise ValueError(f"{args.checkpoint}: expects a pixel-space model of size {dataset.image_size} "
                         f"(in_channels 3), got in_channels {cfg.in_channels}, sample_size {cfg.sample_size}")
    calib_indices = np.flatnonzero(~dataset.heldout)[:args.calib_captions]
    if len(calib_indices) == 0:
        raise ValueError(f"{prompts_path}: has no training records to calibrate on")
    counts = {"train": args.eval_train_captions, "variant": args.variant_captions, "novel": args.novel_captions,
              "heldout": args.eval_captions}
    try:
        groups = select_caption_groups(dataset, calib_indices, counts)
    except ValueError as e:
        raise ValueError(f"{prompts_path}: --eval-captions / --eval-train-captions / --variant-captions / "
                         f"--novel-captions: {e}") from None
    names = list(linears(model, quantizable_only=True))[:args.layers]
    # bad method names fail before the capture
    recipes = {method: calibrate.recipe_from_args(method, args, progress=True) for method in args.methods}
    # a stage flag the user gave for methods without that stage is said, not silently ignored (the preset's own values
    # are not the user's); a note rather than an error, because runs to be merged share one command line and
    # differ only in --methods
    preset_values = preset_defaults(preset, verb, description, examples) if preset else {}
    chosen = {k: None if preset and v == preset_values.get(k) else v for k, v in vars(args).items()}
    for message in calibrate.unused_stage_arguments(recipes, chosen):
        print(f"kroquant {verb}: note: {message}; it changes nothing in this run", file=sys.stderr, flush=True)

    from kroquant_jax.layerset import load_layer_set, save_layer_set

    text_prompts = None
    if args.text_rows_from_all_prompts:  # checked before any capture
        from models.capture import check_text_prompts

        text_path = args.text_prompts or prompts_path
        text_dataset = dataset if args.text_prompts is None else testbed_data.load_dataset(args.text_prompts)
        text_prompts = training_caption_text(text_dataset)
        check_text_prompts(families.PIXART, model, text_prompts, args.guidance != 1.0, f"--text-prompts {text_path}")
    started = time.perf_counter()
    key = capture_key(args, prompts_path, calib_indices, names, text_prompts,
                      capture_inputs_digest(dataset, calib_indices, model, cfg, names))
    cache = out / "layer_set.safetensors"
    cache_key_path = out / "layer_set.key"
    layer_set = None
    if not args.overwrite and cache.exists() and cache_key_path.exists() and cache_key_path.read_text() == key:
        layer_set = load_layer_set(str(cache))  # the same capture settings: reuse (methods resume from their stores)
        model_linears = linears(model)
        weights = {n: (np.asarray(model_linears[n].kernel[...], np.float32).T,
                       None if model_linears[n].bias is None else np.asarray(model_linears[n].bias[...], np.float32))
                   for n in names}
        if provenance.layer_set_mismatch(layer_set, weights) is not None:
            layer_set = None  # the checkpoint at this path changed since: capture again
        else:
            print(f"reused the capture {cache} (same capture settings)", file=sys.stderr)
    if layer_set is None:
        layer_set = capture_flow_layer_set(model, dataset, calib_indices, names, steps=args.steps,
                                           guidance=args.guidance, rows_per_layer=args.rows_per_layer,
                                           seed=args.seed, batch_size=args.batch_size, text_prompts=text_prompts)
        save_layer_set(str(cache), layer_set)
        atomic_write_text(cache_key_path, key)
    capture_s = time.perf_counter() - started

    graphdef, state = nnx.split(model)
    size, channels = cfg.sample_size, cfg.in_channels
    sample = flow_sampler(graphdef, args.steps, args.guidance, channels)
    generated = np.concatenate(list(groups.values()))  # (n,) the groups in order
    targets = dataset.images[generated]  # (n, s, s, 3) the dataset's glyphs
    noise_seeds = [seed + GENERATION_KEY_OFFSET for seed in args.seeds]
    num_seeds = len(noise_seeds)
    reference = generate_seeds(sample, state, dataset, generated, noise_seeds, channels, size)  # (S * n, s, s, 3)
    results, images = {}, {"dataset": targets, "16-bit": reference}
    text_captions = None if text_prompts is None else len(text_prompts["context"])
    report = {"settings": settings_line(args, names, calib_indices, groups, text_captions),
              "args": vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "seeds": list(args.seeds), "noise_seeds": noise_seeds,
              "capture_s": round(capture_s, 1),
              "calibration_captions": [str(c) for c in dataset.captions[calib_indices]],
              "caption_groups": {gid: {"label": CAPTION_GROUPS[gid].label,
                                       "captions": [str(c) for c in dataset.captions[indices]],
                                       "records": [int(i) for i in indices]} for gid, indices in groups.items()},
              "reference": group_metrics(reference, np.tile(targets, (num_seeds, 1, 1, 1)), groups, num_seeds),
              "results": results}
    for method, recipe in recipes.items():
        began = time.perf_counter()
        compile_watch = CompileWatch()
        store = store_folder(out, method, recipe, key)
        qlayers, reports = quantize_with_store(layer_set, recipe, str(store), args.overwrite, "--out", label=method)
        calibrate_s, calibrate_compile_s = time.perf_counter() - began, compile_watch.seconds()
        ranks = "/".join(str(r) for r in sorted({qlayers[name].config.rank for name in names}))
        branch = {"loraq": f"LoRaQ r={ranks} (MXFP4)", "svd": f"SVD r={ranks} (16-bit)"}.get(recipe.lowrank, "none")
        overrides = quantize_model.qlinear_overrides(qlayers)
        quantize_model.check_overrides(model, overrides)
        began = time.perf_counter()
        compile_watch = CompileWatch()
        quantized = generate_seeds(sample, state, dataset, generated, noise_seeds, channels, size, overrides)
        generate_s, generate_compile_s = time.perf_counter() - began, compile_watch.seconds()
        summary = layer_errors_summary({name: float(reports[name]["heldout_error"]) for name in names})
        per_layer = summary.pop("per_layer_error")
        results[method] = {
            "low_rank_branch": branch,
            "groups": group_metrics(quantized, reference, groups, num_seeds),
            **summary,
            "calibrate_s": round(calibrate_s, 1), "generate_s": round(generate_s, 1),
            "resumed_layers": sum(bool(reports[name].get("resumed")) for name in names),  # loaded from the store
            # layers short of rows: their errors rest on a fifth of their rows (calibrate.fallback_split_layers)
            "fallback_split_layers": calibrate.fallback_split_layers({n: reports[n] for n in names}, recipe.run),
            "calibrate_compile_s": round(calibrate_compile_s, 1), "generate_compile_s": round(generate_compile_s, 1),
            "per_layer_error": per_layer,
        }
        images[method] = quantized
        psnrs = ", ".join(f"{CAPTION_GROUPS[gid].tag} {m['psnr_db']:.2f}"
                          + (f" (seeds {m['psnr_seed_min_db']:.2f}-{m['psnr_seed_max_db']:.2f})" if num_seeds > 1
                             else "") for gid, m in results[method]["groups"].items())
        print(f"{method}: PSNR (dB) {psnrs}, "
              f"layer error {results[method]['layer_error_mean']:.4f} (calibration {calibrate_s:.0f} s, "
              f"generation {generate_s:.0f} s; of which compilation {calibrate_compile_s:.0f} + "
              f"{generate_compile_s:.0f} s)", flush=True)
        write_outputs(out, report, images, args.grid_rows)
    report["wall_s"] = round(time.perf_counter() - started_run, 1)
    report["date_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M")
    write_outputs(out, report, images, args.grid_rows)
    print(markdown_table(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
