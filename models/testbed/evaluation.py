"""The testbed's W4A4 evaluation: sampling, capture, image metrics, and the report / table / grid outputs.

``scripts/eval_testbed.py`` (``kroquant evaluate``, ``kroquant demo``) and ``scripts/testbed_generalisation.py`` are
thin mains over these functions:

* :func:`flow_sampler`: the jitted flow-matching Euler sampler with CFG (``models.sampling``), optionally with linear
  overrides (the W4A4 model is the same graph and the same compiled sampler);
* :func:`text_params`, :func:`generate`, :func:`generate_seeds`: the denoiser's caption inputs and uint8 images of
  dataset records, with per-record noise (a record gets the same noise whatever else is generated beside it), at one
  noise seed or at several (the images of every seed, seed-major);
* :func:`capture_flow_layer_set`: the calibration layer set of the training captions (``models.capture``), and
  :func:`training_caption_text`: every distinct training caption's text inputs, for its text-only layers' rows;
* :func:`image_metrics_of`, :func:`seed_image_metrics`, :func:`layer_errors_summary`: PSNR (with its standard error
  over captions), SSIM, colour ratios, at one seed or over several (with the per-seed PSNR and its spread over
  seeds); mean / max / per-layer-type (:func:`layer_type`) held-out layer errors;
* :func:`heldout_groups`, :func:`nearest_outcome`: how generated held-out captions relate to the dataset (the
  generalisation study of ``scripts/testbed_generalisation.py``);
* :data:`CAPTION_GROUPS`, :func:`select_caption_groups`, :func:`group_slices`, :func:`group_metrics`: which captions
  a run generates (training captions calibration did not use, held-out variants of trained concepts, novel concepts,
  or held-out captions of both kinds) and the image metrics per group;
* :func:`markdown_table`, :func:`write_outputs`, :func:`load_outputs`, :func:`merge_outputs`, :func:`report_seeds`:
  ``report.json``, ``table.md``, ``images.npz``, ``grid.png`` (atomic writes), the merge of runs over different
  methods, and the generation seeds a report was made with;
* :func:`headline_figures`: a run's figures for ``benchmarks/results/headline.json`` (the README's demo table).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.fileio import atomic_path, atomic_write_text, read_json_object, read_npz
from kroquant_jax.headline import Figure
from models import image_metrics, sampling
from models.capture import CaptureConfig, capture_layer_set
from models.testbed import data as testbed_data
from models.testbed import model as testbed

#: The two kinds of held-out record (:func:`heldout_groups`) and the three outcomes of :func:`nearest_outcome`.
GROUPS = ("sibling in training", "novel concept")
OUTCOMES = ("own glyph", "sibling", "other emoji")


@dataclasses.dataclass(frozen=True)
class CaptionGroup:
    """One group of generated captions: ``label`` for tables, ``tag`` for the grid's caption column."""

    label: str
    tag: str


#: The caption groups a run can generate (:func:`select_caption_groups`), by id, in the order they are generated,
#: tabulated and drawn. The testbed draws training captions and held-out variants of a trained concept (another skin
#: tone or gender sign of a trained emoji); it cannot draw a novel concept, even in 16 bits (docs/testbed.md).
CAPTION_GROUPS = {
    "train": CaptionGroup("training, not calibration", "training"),
    "variant": CaptionGroup("held-out variant of a trained concept", "held-out variant"),
    "novel": CaptionGroup("held-out novel concept, never trained", "NOVEL concept"),
    "heldout": CaptionGroup("held-out (both kinds)", "held-out"),
}

__all__ = ["CAPTION_GROUPS", "CaptionGroup", "GROUPS", "OUTCOMES", "capture_flow_layer_set", "flow_sampler",
           "generate", "generate_seeds", "group_metrics", "group_slices", "headline_figures", "heldout_groups",
           "image_metrics_of", "join_reports", "layer_errors_summary", "layer_type", "load_outputs", "markdown_table",
           "merge_outputs", "method_key", "nearest_outcome", "report_seeds", "seed_image_metrics",
           "select_caption_groups", "standard_error", "text_params", "training_caption_text", "write_outputs"]


@functools.lru_cache(maxsize=16)
def flow_sampler(graphdef, num_steps: int, guidance: float, channels: int, hooks_factory=None):
    """jit(params, noise) -> (pixels (b, c, s, s), aux per step): Euler on linspace(1, 0) sigmas with CFG.

    One jitted function per model structure and sampler settings in a process (the weights and overrides are
    arguments), so a second run of the same settings (e.g. ``kroquant evaluate`` called again in one process) traces
    and compiles nothing."""
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


def training_caption_text(dataset: testbed_data.EmojiDataset) -> dict[str, np.ndarray]:
    """The text inputs of every distinct training caption (held-out records left out) and of the empty caption, as
    ``models.capture.check_text_prompts`` reads them: ``context (P, t, 384)``, ``mask (P, t)``, ``uncond_context (1,
    t, 384)``, ``uncond_mask (1, t)`` (P = the number of distinct training captions, first records first)."""
    train = np.flatnonzero(~dataset.heldout)
    _, first = np.unique(dataset.captions[train], return_index=True)
    records = train[np.sort(first)]
    if len(records) == 0:
        raise ValueError("the dataset has no training records")
    return {"context": np.asarray(dataset.context[records], np.float32),
            "mask": np.asarray(dataset.context_mask[records], np.float32),
            "uncond_context": np.asarray(dataset.null_context[None], np.float32),
            "uncond_mask": np.asarray(dataset.null_mask[None], np.float32)}


def capture_flow_layer_set(model, dataset: testbed_data.EmojiDataset, indices: np.ndarray, names: list[str], *,
                           steps: int, guidance: float, rows_per_layer: int, seed: int, batch_size: int,
                           text_prompts: Mapping[str, np.ndarray] | None = None
                           ) -> dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """``{name: (W (o, d), bias (o,), A_rows (n, d))}`` from flow-matching sampling runs over the records ``indices``
    (``models.capture.capture_layer_set`` with the flow-Euler PixArt sampler, ``batch_size`` captions per run; only
    real caption tokens are recorded and repeated rows are kept once, see ``models.capture``).

    ``text_prompts`` (e.g. :func:`training_caption_text` of the whole training set): the cross-attention keys' /
    values' rows come from the caption projection of every real token of these prompts
    (``CaptureConfig.text_rows_from_all_prompts``), the other layers' rows are the same as without it."""
    batches = [indices[start:start + batch_size] for start in range(0, len(indices), batch_size)]
    size = model.cfg.sample_size
    config = CaptureConfig(num_steps=steps, guidance_scale=guidance, latent_hw=(size, size),
                           rows_per_layer=rows_per_layer, seed=seed, layers=tuple(names), solver="flow_euler",
                           progress=True, text_rows_from_all_prompts=text_prompts is not None)
    return capture_layer_set("pixart", model, [text_params(dataset, batch) for batch in batches], config,
                             text_prompts)



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


def generate_seeds(sample, state, dataset, indices, seeds, channels: int, size: int, overrides=None) -> np.ndarray:
    """:func:`generate` at every noise seed of ``seeds`` -> uint8 images ``(len(seeds) * n, s, s, 3)``, seed-major
    (rows ``[j * n, (j + 1) * n)`` are seed ``seeds[j]``; the same compiled sampler for every seed)."""
    return np.concatenate([generate(sample, state, dataset, indices, seed, channels, size, overrides)
                           for seed in seeds])


def layer_type(name: str) -> str:
    """``transformer_blocks.3.attn1.to_q`` -> ``attn1.to_q`` (the block index dropped)."""
    return re.sub(r"^(transformer_blocks|single_transformer_blocks|blocks)\.\d+\.", "", name)


def layer_errors_summary(layer_errors: dict[str, float]) -> dict:
    """``{name: held-out relative output error}`` -> mean, max, mean per layer type (:func:`layer_type`) and the
    per-layer dict, as the report stores them."""
    by_type: dict[str, list[float]] = {}
    for name, error in layer_errors.items():
        by_type.setdefault(layer_type(name), []).append(error)
    return {"layer_error_mean": float(np.mean(list(layer_errors.values()))),
            "layer_error_max": float(np.max(list(layer_errors.values()))),
            "layer_error_by_type": {t: float(np.mean(v)) for t, v in by_type.items()},
            "per_layer_error": dict(layer_errors)}


def standard_error(values: np.ndarray) -> float:
    """The standard error of the mean of ``values`` (n,) (sample std / sqrt(n)); nan for fewer than two."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def _image_metrics(quantized: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, dict]:
    """``(PSNR per image (n,), {ssim, chroma_ratio, saturation_ratio})`` of uint8 images (n, s, s, 3) against the
    reference ones (SSIM: the mean over images; colour ratios: of the whole set)."""
    q, ref = quantized.astype(np.float64) / 255, reference.astype(np.float64) / 255
    psnr = np.minimum(image_metrics.psnr(q, ref), 99.0)  # (n,) identical images -> 99 dB, not inf
    return psnr, {"ssim": float(np.mean(image_metrics.ssim(q, ref))), **image_metrics.color_ratios(q, ref)}


def image_metrics_of(quantized: np.ndarray, reference: np.ndarray) -> dict:
    """PSNR (mean, standard error over images, per image), SSIM, colour ratios of uint8 images vs the 16-bit ones."""
    psnr, rest = _image_metrics(quantized, reference)
    return {"psnr_db": float(psnr.mean()), "psnr_sem_db": standard_error(psnr), **rest,
            "psnr_per_image_db": [round(float(x), 3) for x in psnr]}


def seed_image_metrics(quantized: np.ndarray, reference: np.ndarray) -> dict:
    """:func:`image_metrics_of` of the same captions generated at several noise seeds.

    ``quantized``, ``reference``: uint8 ``(S, n, s, s, 3)``, seed ``j``'s image of caption ``k`` at ``[j, k]``, each
    against the reference image of the same caption and seed. With one seed (``S == 1``) exactly
    ``image_metrics_of(quantized[0], reference[0])``. With several: ``psnr_db`` the mean over all ``S * n`` images,
    ``psnr_sem_db`` the standard error over the ``n`` captions of the per-caption means over seeds (the captions are
    the independent samples; a caption's seeds are not), ``ssim`` / colour ratios over all images,
    ``psnr_per_image_db`` every image seed-major, plus ``psnr_per_caption_db`` (n,) the per-caption means,
    ``psnr_db_per_seed`` (S,) the mean over captions at each seed, and the spread of those per-seed means:
    ``psnr_seed_min_db``, ``psnr_seed_max_db``, ``psnr_seed_std_db`` (sample standard deviation over seeds)."""
    if quantized.shape != reference.shape or quantized.ndim != 5:
        raise ValueError(f"seed_image_metrics: expects two (seeds, captions, s, s, 3) arrays of one shape, got "
                         f"{quantized.shape} and {reference.shape}")
    num_seeds, n = quantized.shape[:2]
    if num_seeds == 1:
        return image_metrics_of(quantized[0], reference[0])
    flat = (-1, *quantized.shape[2:])
    psnr, rest = _image_metrics(quantized.reshape(flat), reference.reshape(flat))  # (S * n,) seed-major
    per_seed_image = psnr.reshape(num_seeds, n)  # (S, n)
    per_caption, per_seed = per_seed_image.mean(axis=0), per_seed_image.mean(axis=1)  # (n,), (S,)
    return {"psnr_db": float(psnr.mean()), "psnr_sem_db": standard_error(per_caption), **rest,
            "psnr_per_image_db": [round(float(x), 3) for x in psnr],
            "psnr_per_caption_db": [round(float(x), 3) for x in per_caption],
            "psnr_db_per_seed": [float(x) for x in per_seed], "psnr_seed_min_db": float(per_seed.min()),
            "psnr_seed_max_db": float(per_seed.max()), "psnr_seed_std_db": float(per_seed.std(ddof=1))}


def select_caption_groups(dataset: testbed_data.EmojiDataset, calib_indices: np.ndarray,
                          counts: Mapping[str, int]) -> dict[str, np.ndarray]:
    """``{group id: record indices}`` to generate, in :data:`CAPTION_GROUPS` order, groups with a zero count left out.

    Each group takes its first ``counts[id]`` records in record order (not picked by hand): ``"train"`` training
    records not in ``calib_indices``, ``"variant"`` / ``"novel"`` the two kinds of held-out record
    (:func:`heldout_groups`), ``"heldout"`` held-out records of both kinds. Raises naming the group when an id is
    unknown, a count is negative or exceeds the records there are, when nothing is selected, or when two groups
    would share a record (``"heldout"`` with ``"variant"`` / ``"novel"``); no group ever holds a calibration record.
    """
    unknown = sorted(set(counts) - set(CAPTION_GROUPS))
    if unknown:
        raise ValueError(f"unknown caption groups {unknown}; known: {list(CAPTION_GROUPS)}")
    if any(n < 0 for n in counts.values()):
        raise ValueError(f"caption group counts must be >= 0, got {dict(counts)}")
    wanted = {gid: counts.get(gid, 0) for gid in CAPTION_GROUPS if counts.get(gid, 0) > 0}
    if not wanted:
        raise ValueError(f"no captions to generate: every caption group count is 0 ({dict(counts)})")
    calib = set(int(i) for i in calib_indices)
    pools = {"train": np.array([i for i in np.flatnonzero(~dataset.heldout) if int(i) not in calib], np.int64),
             "heldout": np.flatnonzero(dataset.heldout)}
    if "variant" in wanted or "novel" in wanted:
        kinds = heldout_groups(dataset)
        pools["variant"], pools["novel"] = kinds[GROUPS[0]], kinds[GROUPS[1]]
    groups, taken = {}, {}
    for gid, n in wanted.items():
        pool = pools[gid]
        if n > len(pool):
            raise ValueError(f"caption group {gid!r} ({CAPTION_GROUPS[gid].label}): {n} captions asked for, the "
                             f"dataset has {len(pool)}")
        groups[gid] = pool[:n]
        for i in groups[gid]:
            if int(i) in calib:
                raise ValueError(f"caption group {gid!r} would hold calibration record {int(i)}")
            if int(i) in taken:
                raise ValueError(f"caption groups {taken[int(i)]!r} and {gid!r} would both hold record {int(i)} "
                                 f"({dataset.captions[i]!r}): ask for one or the other")
            taken[int(i)] = gid
    return groups


def group_slices(caption_groups: Mapping[str, object]) -> dict[str, slice]:
    """``{group id: slice}`` of each group in the generated images (groups concatenated in the given order);
    ``caption_groups`` maps id -> record indices or the report's ``{"captions": [...], ...}`` record."""
    slices, start = {}, 0
    for gid, group in caption_groups.items():
        n = len(group["captions"]) if isinstance(group, dict) else len(group)
        slices[gid] = slice(start, start + n)
        start += n
    return slices


def group_metrics(images: np.ndarray, reference: np.ndarray, caption_groups: Mapping[str, object],
                  num_seeds: int = 1) -> dict:
    """``{group id: seed_image_metrics(images of the group, reference of the group)}``; ``images``, ``reference``:
    uint8 ``(num_seeds * n, s, s, 3)``, seed-major as :func:`generate_seeds` (each seed's ``n`` images the groups
    concatenated in the order of ``caption_groups``, as :func:`group_slices`). With one seed this is
    ``{group id: image_metrics_of(images[group], reference[group])}``."""
    if len(images) != len(reference) or len(images) % num_seeds:
        raise ValueError(f"group_metrics: {len(images)} images and {len(reference)} reference images cannot be "
                         f"{num_seeds} seeds of the same captions")
    by_seed = images.reshape(num_seeds, -1, *images.shape[1:])  # (S, n, s, s, 3)
    ref_by_seed = reference.reshape(num_seeds, -1, *reference.shape[1:])
    return {gid: seed_image_metrics(by_seed[:, part], ref_by_seed[:, part])
            for gid, part in group_slices(caption_groups).items()}


def report_seeds(report: dict) -> list[int]:
    """The generation seeds (``kroquant evaluate --seeds``) of a :func:`write_outputs` report; a report written
    before ``--seeds`` existed was generated at its one ``--seed``."""
    if "seeds" in report:
        return [int(s) for s in report["seeds"]]
    args = report["args"][0] if isinstance(report["args"], list) else report["args"]  # a merged report: a list
    return [int(args["seed"])]


def psnr_text(metrics: dict) -> str:
    """``"mean ± standard error"`` of a metrics dict's PSNR; the mean alone where the standard error is undefined
    (one caption)."""
    sem = metrics["psnr_sem_db"]
    return f"{metrics['psnr_db']:.2f}" + ("" if np.isnan(sem) else f" ± {sem:.2f}")


def _seed_range(metrics: dict) -> str:
    return f"{metrics['psnr_seed_min_db']:.2f}–{metrics['psnr_seed_max_db']:.2f}"


def markdown_table(report: dict) -> str:
    """The settings line; PSNR (± its standard error over captions) per caption group for every method, with the
    16-bit model against the dataset's glyphs as the first row (can the model draw the caption at all); SSIM and
    colour ratios per group; the mean per-layer output error per layer type. ``report``: :func:`write_outputs`'.
    The calibration seconds of a method whose layers were loaded from its store (``resumed_layers``) say so.

    With several generation seeds (:func:`report_seeds`): the PSNR is the mean over every caption x seed image, ± the
    standard error over the captions of the per-caption means (:func:`seed_image_metrics`); each group gets a
    "seed range" column (the lowest and highest per-seed mean PSNR), and a second table lists the per-seed PSNR and
    the standard deviation over seeds."""
    groups, results, reference = report["caption_groups"], report["results"], report["reference"]
    seeds = report_seeds(report)
    several = len(seeds) > 1
    heads = []
    for gid, g in groups.items():
        heads.append(f"{CAPTION_GROUPS[gid].label} ({len(g['captions'])})")
        if several:
            heads.append(f"{CAPTION_GROUPS[gid].tag}: seed range")

    def cells(metrics: dict) -> str:
        return " | ".join(f"{psnr_text(metrics[gid])} | {_seed_range(metrics[gid])}" if several else psnr_text(metrics[gid])
                          for gid in groups)

    intro = ("PSNR (dB) ↑ against the 16-bit images on the same seeds, ± its standard error over the captions of each "
             "group (first row: the 16-bit images against the dataset's glyphs, i.e. how well the model draws the "
             "group at all):")
    if several:
        intro = (f"PSNR (dB) ↑ against the 16-bit image of the same caption and seed, at the generation seeds "
                 f"{', '.join(map(str, seeds))}: the mean over every caption x seed image of the group, ± the "
                 "standard error over the group's captions of the per-caption means over seeds; seed range: the "
                 "lowest and highest per-seed mean (first row: the 16-bit images against the dataset's glyphs, i.e. "
                 "how well the model draws the group at all):")
    lines = [report["settings"], "", intro, "",
             "| method | low-rank branch | " + " | ".join(heads) + " | layer error mean | layer error max | "
             "calibration (s) |", "| --- " * (len(heads) + 5) + "|",
             "| 16-bit vs dataset glyph | — | " + cells(reference) + " | — | — | — |"]
    for method, r in results.items():
        reused, total = r.get("resumed_layers", 0), len(r["per_layer_error"])  # layers loaded from the store
        reused = "" if not reused else " (reused)" if reused == total else f" ({reused} of {total} reused)"
        lines.append(f"| {method} | {r['low_rank_branch']} | " + cells(r["groups"])
                     + f" | {r['layer_error_mean']:.4f} | {r['layer_error_max']:.4f} | "
                     f"{r['calibrate_s']:.0f}{reused} |")
    if several:
        lines += ["", "PSNR (dB) per generation seed (the mean over the group's captions at that seed) and the "
                  "standard deviation of those per-seed means:", "",
                  "| method | caption group | " + " | ".join(f"seed {s}" for s in seeds) + " | std over seeds |",
                  "| --- | --- |" + " --- |" * (len(seeds) + 1)]
        for method, r in [("16-bit vs dataset glyph", {"groups": reference}), *results.items()]:
            for gid in groups:
                m = r["groups"][gid]
                lines.append(f"| {method} | {CAPTION_GROUPS[gid].label} | "
                             + " | ".join(f"{x:.2f}" for x in m["psnr_db_per_seed"])
                             + f" | {m['psnr_seed_std_db']:.2f} |")
    lines += ["", "SSIM ↑ and colour ratios against the 16-bit images, per caption group:", "",
              "| method | caption group | SSIM ↑ | chroma ratio | saturation ratio |", "| --- | --- | --- | --- | --- |"]
    for method, r in [("16-bit vs dataset glyph", {"groups": reference}), *results.items()]:
        for gid in groups:
            m = r["groups"][gid]
            lines.append(f"| {method} | {CAPTION_GROUPS[gid].label} | {m['ssim']:.3f} | {m['chroma_ratio']:.3f} | "
                         f"{m['saturation_ratio']:.3f} |")
    if results:
        types = list(next(iter(results.values()))["layer_error_by_type"])
        lines += ["", "Mean held-out relative output error per layer type:", "",
                  "| method | " + " | ".join(types) + " |", "| --- |" + " --- |" * len(types)]
        for method, r in results.items():
            lines.append(f"| {method} | " + " | ".join(f"{r['layer_error_by_type'][t]:.4f}" for t in types) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, report: dict, images: dict[str, np.ndarray], grid_rows: int | None = None) -> None:
    """report.json, table.md, images.npz (the uint8 images per column) and grid.png of the methods done so far
    (rewritten after each method, atomically). ``report`` holds ``settings``, ``caption_groups`` (``{id: {"label",
    "captions", "records"}}``, generation order), ``seeds`` (the generation seeds, :func:`report_seeds`),
    ``reference`` (the 16-bit images' metrics against the dataset's glyphs per group) and ``results`` (per method,
    image metrics per group under ``"groups"``); ``images[title]``: the groups concatenated in order, ``"dataset"``
    the glyphs (n, s, s, 3), then ``"16-bit"`` and the methods (S * n, s, s, 3), every seed's images seed-major
    (:func:`generate_seeds`). images.npz holds ``titles``, ``seeds`` and ``column{k}``. The grid has one row per
    caption of the first seed, tagged with its group; ``grid_rows``: at most this many captions per group."""
    seeds = report_seeds(report)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "table.md", markdown_table(report))
    with atomic_path(out / "images.npz", suffix=".npz") as tmp:
        np.savez_compressed(tmp, titles=np.array(list(images)), seeds=np.array(seeds, np.int64),
                            **{f"column{k}": v for k, v in enumerate(images.values())})
    titles, captions, rows = list(images), [], []
    for gid, part in group_slices(report["caption_groups"]).items():
        for k, caption in list(enumerate(report["caption_groups"][gid]["captions"]))[:grid_rows]:
            captions.append(f"[{CAPTION_GROUPS[gid].tag}] {caption}")
            rows.append([images[title][part.start + k] for title in titles])
    title = "W4A4 (MXFP4) vs 16-bit; [tag]: caption group (NOVEL: never trained)"
    if len(seeds) > 1:
        title += f"; generation seed {seeds[0]} (of {', '.join(map(str, seeds))})"
    testbed.save_caption_grid(str(out / "grid.png"), captions, rows, titles, title=title)


def load_outputs(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(report, images)`` written by :func:`write_outputs` in ``folder``; a missing, truncated or foreign file
    raises naming it."""
    report = read_json_object(folder / "report.json")
    data = read_npz(folder / "images.npz")
    titles = data.get("titles")
    missing = [] if titles is None else [f"column{k}" for k in range(len(titles)) if f"column{k}" not in data]
    if titles is None or missing:
        raise ValueError(f"{folder / 'images.npz'}: not the images of kroquant evaluate (missing "
                         f"{'titles' if titles is None else ', '.join(missing)})")
    return report, {str(t): data[f"column{k}"] for k, t in enumerate(titles)}


def join_reports(reports: list[dict], sources: list[str], *, repeated: bool = False) -> dict:
    """One report from :func:`write_outputs` reports of runs of the same settings over different methods (parallel
    processes, or device calls that each fit a time limit).

    Every report must have the same generation seeds, settings line (which names the device and jax version) and
    captions; ``sources`` name them in the errors. Methods are taken in the order given. A method in more than one
    report raises, unless ``repeated``: then the first report's result is kept and every report's PSNR per caption
    group is listed under ``"repeated"`` (``{method: {group: [psnr_db, ...]}}``), with the 16-bit images' metric
    under ``"16-bit"``: a method run in each part (an anchor) shows how far two runs of the same code part when the
    GPU's results are not bit-reproducible. ``date_utc`` is the latest of the parts' (a run stopped before its end
    has none: the methods it finished are in its report); ``wall_s`` is None (the parts may have run in parallel),
    each part's is under ``parts_wall_s``."""
    if len(reports) != len(sources) or not reports:
        raise ValueError(f"join: {len(reports)} reports for {len(sources)} sources")
    first, seeds = reports[0], report_seeds(reports[0])
    joined = {**first, "merged_from": list(sources), "results": dict(first["results"]),
              "args": [first["args"]], "seeds": seeds}
    dates = [r["date_utc"] for r in reports if r.get("date_utc")]
    joined.update(date_utc=max(dates) if dates else None, wall_s=None,
                  parts_wall_s=[r.get("wall_s") for r in reports])
    for report, source in zip(reports[1:], sources[1:]):
        if report_seeds(report) != seeds:
            raise ValueError(f"join: {source} was generated at --seeds {' '.join(map(str, report_seeds(report)))}, "
                             f"{sources[0]} at --seeds {' '.join(map(str, seeds))}: join runs of the same seeds")
        joined["args"].append(report["args"])
        for key in ("settings", "caption_groups"):
            if report[key] != first[key]:
                raise ValueError(f"join: {source} has another {key!r} than {sources[0]}:\n"
                                 f"  {report[key]!r}\n  {first[key]!r}")
        clash = [m for m in report["results"] if m in joined["results"]]
        if clash and not repeated:
            raise ValueError(f"join: methods {clash} are in {source} and in an earlier report")
        joined["results"].update({m: r for m, r in report["results"].items() if m not in clash})
    if repeated:
        psnrs = {}  # method -> one {group: psnr_db} per report that ran it
        for report in reports:
            for method, result in [("16-bit", {"groups": report["reference"]}), *report["results"].items()]:
                psnrs.setdefault(method, []).append({g: m["psnr_db"] for g, m in result["groups"].items()})
        joined["repeated"] = {m: {g: [p[g] for p in parts] for g in parts[0]}
                              for m, parts in psnrs.items() if len(parts) > 1}
    return joined


def merge_outputs(folders: list[Path], out: Path, grid_rows: int | None = None) -> dict:
    """One report/table/grid from runs of the same settings over different methods (e.g. parallel processes):
    :func:`join_reports` of their reports, and their images, whose 16-bit columns must be equal bit for bit (the runs
    must have generated the same reference)."""
    outputs = [load_outputs(folder) for folder in folders]
    report = join_reports([r for r, _ in outputs], [str(f) for f in folders])
    images = dict(outputs[0][1])
    for folder, (_, other_images) in zip(folders[1:], outputs[1:]):
        if not np.array_equal(other_images["16-bit"], images["16-bit"]):
            raise ValueError(f"merge: the 16-bit images of {folder} differ from those of {folders[0]}")
        images.update({t: v for t, v in other_images.items() if t not in ("dataset", "16-bit")})
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, report, images, grid_rows)
    return report


def method_key(method: str) -> str:
    """A method name as a headline key part: ``kroquant+loraq@64`` -> ``kroquant_loraq_r64``."""
    return method.replace("+", "_").replace("@", "_r")


def headline_figures(report: dict, prefix: str, *, device: str, command: str, source: str) -> dict:
    """``{key: kroquant_jax.headline.Figure}`` of a run's report (:func:`write_outputs`): per caption group the PSNR,
    its standard error, the SSIM and, with several generation seeds, the standard deviation, lowest and highest of the
    per-seed PSNR (``{prefix}_psnr_seed_{std,min,max}_db_{group}_{method}``) of every method (``{prefix}_psnr_db_{group}_{method}``, ...) and
    of the 16-bit images against the dataset's glyphs (method ``16bit``), the mean and max layer error per method,
    and the run's wall time (``{prefix}_wall_s``; none for a :func:`join_reports` report). ``device``: the machine in words; ``source``: the report's copy under
    ``benchmarks/results/``."""
    for key in ("jax", "date_utc", "wall_s"):
        if key not in report:
            raise ValueError(f"headline_figures: the report has no {key!r} (written by an older kroquant evaluate)")
    for key in ("jax", "date_utc"):
        if report[key] is None:
            raise ValueError(f"headline_figures: the report's {key!r} is empty (joined from runs that did not finish)")

    def figure(value, unit, higher_is_better):
        return Figure(value=float(value), unit=unit, higher_is_better=higher_is_better, device=device,
                      jax=report["jax"], date_utc=report["date_utc"], command=command, source=source)

    figures = {} if report["wall_s"] is None else {f"{prefix}_wall_s": figure(report["wall_s"], "s", False)}
    columns = [("16bit", {"groups": report["reference"]}), *((method_key(m), r) for m, r in report["results"].items())]
    for key, r in columns:
        for gid, m in r["groups"].items():
            figures[f"{prefix}_psnr_db_{gid}_{key}"] = figure(m["psnr_db"], "dB", True)
            if np.isfinite(m["psnr_sem_db"]):
                figures[f"{prefix}_psnr_sem_db_{gid}_{key}"] = figure(m["psnr_sem_db"], "dB", False)
            figures[f"{prefix}_ssim_{gid}_{key}"] = figure(m["ssim"], "fraction", True)
            if "psnr_seed_std_db" in m:  # several generation seeds
                figures[f"{prefix}_psnr_seed_std_db_{gid}_{key}"] = figure(m["psnr_seed_std_db"], "dB", False)
                figures[f"{prefix}_psnr_seed_min_db_{gid}_{key}"] = figure(m["psnr_seed_min_db"], "dB", True)
                figures[f"{prefix}_psnr_seed_max_db_{gid}_{key}"] = figure(m["psnr_seed_max_db"], "dB", True)
        if key != "16bit":
            figures[f"{prefix}_layer_error_mean_{key}"] = figure(r["layer_error_mean"], "fraction", False)
            figures[f"{prefix}_layer_error_max_{key}"] = figure(r["layer_error_max"], "fraction", False)
    return figures


def heldout_groups(dataset: testbed_data.EmojiDataset) -> dict[str, np.ndarray]:
    """``{kind: indices of held-out records}`` in record order: ``"sibling in training"`` when the record's base emoji
    (``models.testbed.data.base_sequence``: skin tones and gender signs removed) is also the base of a training
    record of the full dataset (``dataset.trained_concept``), ``"novel concept"`` when nothing in training shares its
    base. Raises when the dataset file predates ``trained_concept``."""
    if dataset.trained_concept is None:
        raise ValueError("the dataset has no 'trained_concept' array (written before it existed), so its held-out "
                         "records cannot be told apart: rebuild it with `kroquant build-emoji-dataset`")
    held = np.flatnonzero(dataset.heldout)
    return {GROUPS[0]: held[dataset.trained_concept[held]], GROUPS[1]: held[~dataset.trained_concept[held]]}


def nearest_outcome(image: np.ndarray, target: int, dataset: testbed_data.EmojiDataset, pool: np.ndarray,
                    bases: list[tuple[int, ...]]) -> tuple[str, int, float]:
    """``(outcome, nearest record, MSE to the target image)`` of a generated uint8 image ``(s, s, 3)``."""
    x = image.astype(np.float32) / 255
    nearest = int(np.argmin(np.mean(np.square(pool - x), axis=(1, 2, 3))))
    mse = float(np.mean(np.square(pool[target] - x)))
    if np.array_equal(dataset.images[nearest], dataset.images[target]):
        return OUTCOMES[0], nearest, mse
    return (OUTCOMES[1] if bases[nearest] == bases[target] else OUTCOMES[2]), nearest, mse
