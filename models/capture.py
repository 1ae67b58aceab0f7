"""Calibration data: record the inputs of the quantizable linears while sampling, subsampled on the device.

:func:`capture_layer_set` runs the family's jitted sampler (``models.families``: ``Family.make_sampler``) once per
batch of prompt embeddings. At every denoising step, every wanted linear's input ``x (..., d)`` is flattened to rows
and a fixed number of rows is drawn without replacement *on the device* (:class:`RowSampler`); the drawn rows leave the scan as
its per-step output, so memory is ``steps x rows_per_step x d`` per layer and batch, whatever the image size (FLUX at
1024 px has 4096 + 512 tokens per image: nothing of that size is kept). The host concatenates the batches and keeps
at most ``rows_per_layer`` rows per layer (a seeded random subset).

Only real tokens are recorded: the models pass the attention mask of the caption (PixArt-Σ, SANA: the inputs of the
cross-attention keys/values and of the caption projection) and Ideogram 4's padding segment to the hooks
(``models.layers.with_token_mask``), and the draw skips masked rows; FLUX.1 attends to every text token, so all its
rows are real. Rows that repeat exactly (cross-attention keys/values read the same caption at every step) are kept
once (:func:`distinct_rows`), so such a layer may end with fewer than ``rows_per_layer`` rows: all it has.

The result is a **layer set** ``{name: (W (o, d), bias (o,) or None, A_rows (n, d))}`` (names = diffusers key
prefixes, e.g. ``transformer_blocks.3.attn1.to_q``), saved with :func:`kroquant_jax.layerset.save_layer_set`
(``.npz`` / ``.safetensors``, atomic) and consumed by ``kroquant_jax.calibrate``.

Which linears: by default the model's quantizable ones (``Linear.quantizable``: transformer-block linears and
SANA's 1x1 convs; embeddings, AdaLN modulation, caption projection and the final projection stay 16-bit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from models import families
from models.layers import LinearHooks, linears

__all__ = ["CaptureConfig", "RowSampler", "capture_layer_set", "distinct_rows"]


class RowSampler:
    """A :class:`~models.layers.LinearHooks` recorder keeping ``rows`` random input rows of each wanted layer.

    Only rows of real tokens are drawn: when the hooks carry a token mask (``models.layers.with_token_mask``: the
    caption's attention mask at cross-attention keys/values, Ideogram 4's padding segment), the draw takes the real
    rows first, in the order of the same random permutation, and marks the rows it had to take from the masked ones
    as invalid (when fewer real rows than ``rows`` exist); the host drops those.

    Args:
        names: dotted paths of the layers to record.
        rows: rows drawn per layer per call (fewer when the input has fewer rows).
        key: PRNG key of this call (layer ``k`` of ``names`` uses ``fold_in(key, k)``).
        dtype: dtype of the kept rows.
    """

    def __init__(self, names: Sequence[str], rows: int, key: jax.Array, dtype: Any = jnp.float32):
        self.index = {name: k for k, name in enumerate(names)}
        self.rows = rows
        self.key = key
        self.dtype = dtype
        self.records: dict[str, tuple[jax.Array, jax.Array]] = {}

    def wants(self, path: str) -> bool:
        return path in self.index

    def record(self, path: str, x: jax.Array, token_mask: jax.Array | None = None) -> None:
        """Draw the rows of ``x (..., d)``; ``token_mask (...)`` bool (True = real token) or None (all real)."""
        if path in self.records:
            raise ValueError(f"RowSampler: layer {path} was called twice in one forward pass")
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        count = min(self.rows, flat.shape[0])
        order = jax.random.permutation(jax.random.fold_in(self.key, self.index[path]), flat.shape[0])  # (N,)
        if token_mask is None:
            valid = jnp.ones((count,), bool)  # (count,)
        else:
            if tuple(token_mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"RowSampler: layer {path}: token mask of shape {tuple(token_mask.shape)} does not "
                                 f"match its input of shape {tuple(x.shape)}")
            real = token_mask.reshape(-1)[order]  # (N,) in permutation order
            order = order[jnp.argsort(~real, stable=True)]  # (N,) real tokens first, each group in permutation order
            valid = jnp.sort(~real)[:count] == 0  # (count,) True while the draw is still among real tokens
        picked = order[:count]  # (count,)
        self.records[path] = (flat[picked].astype(self.dtype), valid)  # (count, d), (count,)

    def result(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        """``{path: (rows (count, d), valid (count,) bool)}``."""
        missing = sorted(set(self.index) - set(self.records))
        if missing:
            raise ValueError(f"RowSampler: these layers were never called: {missing}")
        return dict(self.records)


def distinct_rows(rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows (n, d)`` without exact repeats (the first occurrence of each kept, in order).

    Inputs that do not change between denoising steps (cross-attention keys/values read the caption, and the
    unconditional caption is the same for every prompt) are drawn again at every step; a repeat adds no information
    and would weigh that row several times in calibration.
    """
    if rows.shape[0] < 2:
        return rows
    _, first = np.unique(rows, axis=0, return_index=True)
    return rows[np.sort(first)]


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """Settings of :func:`capture_layer_set`.

    Attributes:
        num_steps: denoising steps per sampling run.
        guidance_scale: CFG scale (both branches are recorded, as both run through the quantized model).
        latent_hw: latent (H, W).
        rows_per_layer: rows kept per layer in the end (over all batches and steps).
        seed: seeds the noise (batch ``i`` uses ``fold_in(seed, i)``) and the row draws.
        layers: dotted paths to record; None = every quantizable linear.
        shift: flow-matching shift (SANA/FLUX); None = the family default.
        solver: None (the family default) or ``"flow_euler"`` (flow-matching PixArt-architecture models).
        row_dtype: dtype of the recorded rows on the device.
        progress: show a tqdm bar over the prompt batches.
    """

    num_steps: int = 20
    guidance_scale: float = 4.5
    latent_hw: tuple[int, int] = (128, 128)
    rows_per_layer: int = 1024
    seed: int = 0
    layers: tuple[str, ...] | None = None
    shift: float | None = None
    solver: str | None = None
    row_dtype: str = "float32"
    progress: bool = False


def capture_layer_set(family: str | families.Family, model: nnx.Module, prompt_batches: Sequence[Mapping[str, Any]],
                      config: CaptureConfig = CaptureConfig()) -> dict[str, tuple[np.ndarray, Any, np.ndarray]]:
    """Sample once per prompt batch and return the layer set of the recorded linears.

    Args:
        family: a ``models.families`` name (``"pixart"``, ``"sana"``, ``"flux"``, ``"ideogram4"``) or Family.
        model: the converted 16-bit model.
        prompt_batches: each a dict of the family's text inputs (``models.sampling`` denoisers: e.g. PixArt
            ``context (b, t, c)``, ``mask (b, t)``, ``uncond_context``, ``uncond_mask``; ``Family.prompt_inputs``);
            all batches the same shapes (one compilation).
        config: see :class:`CaptureConfig`.
    Returns:
        ``{name: (W (o, d) float32, bias (o,) float32 or None, A_rows (n, d) float32)}``, n <= rows_per_layer.
    """
    family = families.get(family) if isinstance(family, str) else family
    if not prompt_batches:
        raise ValueError("capture_layer_set needs at least one prompt batch")
    available = linears(model)
    names = list(config.layers) if config.layers is not None else list(linears(model, quantizable_only=True))
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"capture_layer_set: no Linear at {unknown} (e.g. {sorted(available)[:4]})")
    rows_per_step = max(1, math.ceil(config.rows_per_layer / (len(prompt_batches) * config.num_steps)))
    row_dtype = jnp.dtype(config.row_dtype)

    def hooks_factory(params, step):
        key = jax.random.fold_in(params["capture_key"], step)
        return LinearHooks(params.get("overrides"), RowSampler(names, rows_per_step, key, row_dtype))

    graphdef, state = nnx.split(model)
    sample = jax.jit(family.make_sampler(graphdef, family.config_of(model), num_steps=config.num_steps,
                                         guidance_scale=config.guidance_scale, latent_hw=tuple(config.latent_hw),
                                         shift=config.shift, solver=config.solver, hooks_factory=hooks_factory))
    base = jax.random.key(config.seed)
    collected: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for index, batch in enumerate(tqdm(prompt_batches, desc="capture", unit="batch", disable=not config.progress)):
        noise_key, capture_key = jax.random.split(jax.random.fold_in(base, index))
        params = {"model": state, **batch, "capture_key": capture_key}
        _, records = sample(params, noise_key)  # {name: ((steps, rows_per_step, d), (steps, rows_per_step))}
        for name in names:
            rows, valid = (np.asarray(a) for a in records[name])
            collected[name].append(rows.astype(np.float32).reshape(-1, rows.shape[-1])[valid.reshape(-1)])
    rng = np.random.default_rng(config.seed)
    layer_set = {}
    for name in names:
        rows = distinct_rows(np.concatenate(collected[name], axis=0))  # (n_all, d): real tokens, no repeats
        if rows.shape[0] == 0:
            raise ValueError(f"capture_layer_set: layer {name} saw no real token (every input row was masked)")
        if rows.shape[0] > config.rows_per_layer:
            rows = rows[np.sort(rng.choice(rows.shape[0], config.rows_per_layer, replace=False))]
        layer = available[name]
        weight = np.asarray(layer.kernel[...], np.float32).T  # (o, d)
        bias = None if layer.bias is None else np.asarray(layer.bias[...], np.float32)  # (o,)
        layer_set[name] = (weight, bias, rows)
    return layer_set
