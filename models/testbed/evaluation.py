"""The testbed's W4A4 evaluation: sampling, capture, image metrics, and the report / table / grid outputs.

``scripts/eval_testbed.py`` (``kroquant evaluate``, ``kroquant demo``) and ``scripts/testbed_generalisation.py`` are
thin mains over these functions:

* :func:`flow_sampler`: the jitted flow-matching Euler sampler with CFG (``models.sampling``), optionally with linear
  overrides (the W4A4 model is the same graph and the same compiled sampler);
* :func:`text_params`, :func:`generate`: the denoiser's caption inputs and uint8 images of dataset records, with
  per-record noise (a record gets the same noise whatever else is generated beside it);
* :func:`capture_flow_layer_set`: the calibration layer set of the training captions (``models.capture``);
* :func:`image_metrics_of`, :func:`layer_errors_summary`: PSNR (with its standard error over captions), SSIM, colour
  ratios; mean / max / per-layer-type (:func:`layer_type`) held-out layer errors;
* :func:`heldout_groups`, :func:`nearest_outcome`: how generated held-out captions relate to the dataset (the
  generalisation study of ``scripts/testbed_generalisation.py``);
* :func:`markdown_table`, :func:`write_outputs`, :func:`load_outputs`, :func:`merge_outputs`: ``report.json``,
  ``table.md``, ``images.npz``, ``grid.png`` / ``grid_train.png`` (atomic writes), and the merge of runs over
  different methods.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.fileio import atomic_path, atomic_write_text
from models import image_metrics, sampling
from models.capture import CaptureConfig, capture_layer_set
from models.testbed import data as testbed_data
from models.testbed import model as testbed

#: The two kinds of held-out record (:func:`heldout_groups`) and the three outcomes of :func:`nearest_outcome`.
GROUPS = ("sibling in training", "novel concept")
OUTCOMES = ("own glyph", "sibling", "other emoji")

__all__ = ["GROUPS", "OUTCOMES", "heldout_groups", "nearest_outcome", "capture_flow_layer_set", "flow_sampler", "generate", "image_metrics_of", "layer_errors_summary",
           "layer_type", "load_outputs", "markdown_table", "merge_outputs", "text_params", "write_outputs"]


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


def capture_flow_layer_set(model, dataset: testbed_data.EmojiDataset, indices: np.ndarray, names: list[str], *,
                           steps: int, guidance: float, rows_per_layer: int, seed: int, batch_size: int
                           ) -> dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """``{name: (W (o, d), bias (o,), A_rows (n, d))}`` from flow-matching sampling runs over the records ``indices``
    (``models.capture.capture_layer_set`` with the flow-Euler PixArt sampler, ``batch_size`` captions per run; only
    real caption tokens are recorded and repeated rows are kept once, see ``models.capture``)."""
    batches = [indices[start:start + batch_size] for start in range(0, len(indices), batch_size)]
    size = model.cfg.sample_size
    config = CaptureConfig(num_steps=steps, guidance_scale=guidance, latent_hw=(size, size),
                           rows_per_layer=rows_per_layer, seed=seed, layers=tuple(names), solver="flow_euler",
                           progress=True)
    return capture_layer_set("pixart", model, [text_params(dataset, batch) for batch in batches], config)



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


def image_metrics_of(quantized: np.ndarray, reference: np.ndarray) -> dict:
    """PSNR (mean, standard error over images, per image), SSIM, colour ratios of uint8 images vs the 16-bit ones."""
    q, ref = quantized.astype(np.float64) / 255, reference.astype(np.float64) / 255
    psnr = np.minimum(image_metrics.psnr(q, ref), 99.0)  # (n,) identical images -> 99 dB, not inf
    sem = float(psnr.std(ddof=1) / np.sqrt(len(psnr))) if len(psnr) > 1 else float("nan")
    return {"psnr_db": float(psnr.mean()), "psnr_sem_db": sem, "ssim": float(np.mean(image_metrics.ssim(q, ref))),
            **image_metrics.color_ratios(q, ref), "psnr_per_image_db": [round(float(x), 3) for x in psnr]}


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


def heldout_groups(dataset: testbed_data.EmojiDataset) -> dict[str, np.ndarray]:
    """``{kind: indices of held-out records}`` in record order: ``"sibling in training"`` when the record's base emoji
    (``models.testbed.data.base_sequence``: skin tones and gender signs removed) is also the base of a training
    record, ``"novel concept"`` when nothing in training shares its base."""
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in dataset.sequences]
    trained = {base for base, held in zip(bases, dataset.heldout) if not held}
    held = np.flatnonzero(dataset.heldout)
    return {GROUPS[0]: np.array([i for i in held if bases[i] in trained], dtype=np.int64),
            GROUPS[1]: np.array([i for i in held if bases[i] not in trained], dtype=np.int64)}


def nearest_outcome(image: np.ndarray, target: int, dataset: testbed_data.EmojiDataset, pool: np.ndarray,
                    bases: list[tuple[int, ...]]) -> tuple[str, int, float]:
    """``(outcome, nearest record, MSE to the target image)`` of a generated uint8 image ``(s, s, 3)``."""
    x = image.astype(np.float32) / 255
    nearest = int(np.argmin(np.mean(np.square(pool - x), axis=(1, 2, 3))))
    mse = float(np.mean(np.square(pool[target] - x)))
    if np.array_equal(dataset.images[nearest], dataset.images[target]):
        return OUTCOMES[0], nearest, mse
    return (OUTCOMES[1] if bases[nearest] == bases[target] else OUTCOMES[2]), nearest, mse
