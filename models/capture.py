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

**Text-only layers from many prompts.** Some linears read a function of the text alone (``Family.text_only``,
``models.families.TextOnlyInputs``: PixArt-Σ's and SANA's cross-attention keys / values read the projected caption),
the same at every step and for every image, so the sampling runs above record only the tokens of the few prompts
they sample. With ``CaptureConfig.text_rows_from_all_prompts`` those layers' rows are instead computed directly,
:func:`text_only_rows`: the family's text function of the real tokens (mask 1) of every prompt of ``text_prompts``
(by default the prompts of the sampled batches), plus the unconditional caption's when CFG is on, batched on the
device, de-duplicated, and subsampled to ``rows_per_layer`` with the config seed (memory: one batch plus the kept
rows). Every other layer's rows are exactly those of the capture without the option (same seed).

Which linears: by default the model's quantizable ones (``Linear.quantizable``: transformer-block linears and
SANA's 1x1 convs; embeddings, AdaLN modulation, caption projection and the final projection stay 16-bit).
"""

from __future__ import annotations

import dataclasses
import hashlib
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

__all__ = ["TEXT_KEYS", "CaptureConfig", "RowSampler", "capture_layer_set", "check_text_prompts", "distinct_rows",
           "text_only_rows"]

#: The keys of a ``text_prompts`` mapping (the text inputs of the PixArt-Σ / SANA denoisers).
TEXT_KEYS = ("context", "mask", "uncond_context", "uncond_mask")


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
        self._orders: dict[int, jax.Array] = {}  # {N: (len(names), N) permutations}

    def _order(self, path: str, n: int) -> jax.Array:
        """Layer ``path``'s permutation of ``n`` rows: ``permutation(fold_in(key, k), n)``. Drawn for every layer at
        once per row count (vmapped, the same values bit for bit): one shuffle in the traced program instead of one
        per layer, which each cost its own compilation."""
        if n not in self._orders:
            keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(self.key, jnp.arange(len(self.index)))
            self._orders[n] = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)  # (layers, n)
        return self._orders[n][self.index[path]]

    def wants(self, path: str) -> bool:
        return path in self.index

    def record(self, path: str, x: jax.Array, token_mask: jax.Array | None = None) -> None:
        """Draw the rows of ``x (..., d)``; ``token_mask (...)`` bool (True = real token) or None (all real)."""
        if path in self.records:
            raise ValueError(f"RowSampler: layer {path} was called twice in one forward pass")
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        count = min(self.rows, flat.shape[0])
        order = self._order(path, flat.shape[0])  # (N,)
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
        text_rows_from_all_prompts: the rows of the family's text-only layers (``Family.text_only``: PixArt-Σ's and
            SANA's ``attn2.to_k`` / ``attn2.to_v``) come from the text function of every real token of the
            ``text_prompts`` of :func:`capture_layer_set` (+ the unconditional caption when CFG is on), not from
            the sampling runs; the other layers are captured as without it.
        text_batch_size: prompts per device call of that text function.
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
    text_rows_from_all_prompts: bool = False
    text_batch_size: int = 256

    @property
    def uses_cfg(self) -> bool:
        """Whether the sampler runs the unconditional branch too (``models.sampling``: any scale but 1)."""
        return self.guidance_scale != 1.0


def check_text_prompts(family: families.Family, model: nnx.Module, text_prompts: Mapping[str, Any],
                       uses_cfg: bool, what: str = "text_prompts") -> dict[str, np.ndarray]:
    """``text_prompts`` checked against the model and as float32 numpy arrays (no device work).

    Args:
        family: the model's family; it must declare text-only layers (``Family.text_only``).
        text_prompts: ``context (P, t, c)``, optional ``mask (P, t)`` (1 = real token, 0 = padding; absent = every
            token real), and with CFG ``uncond_context (U, t', c)`` with optional ``uncond_mask (U, t')`` (the
            unconditional caption, U >= 1; repeats are harmless). ``uncond_*`` are read only when ``uses_cfg``.
        uses_cfg: the sampler runs the unconditional branch (:attr:`CaptureConfig.uses_cfg`).
        what: how errors name the mapping (e.g. a flag or a file).
    Returns:
        ``{key: float32 array}`` of the keys that are read.
    Raises:
        ValueError: naming the key and what is wrong (unknown key, shape, width, a mask that is not 0/1, a
            non-finite value, a missing unconditional caption with CFG, no real token at all).
    """
    if family.text_only is None:
        raise ValueError(f"{what}: the {family.name} family has no linear whose input depends on the text alone "
                         "(models.families.Family.text_only), so text_rows_from_all_prompts has nothing to do")
    unknown = sorted(set(text_prompts) - set(TEXT_KEYS))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown} (expected {list(TEXT_KEYS)})")
    width = family.prompt_widths(family.config_of(model))["context"]
    sources = [("context", "mask")] + ([("uncond_context", "uncond_mask")] if uses_cfg else [])
    arrays = {}
    for context_key, mask_key in sources:
        if context_key not in text_prompts:
            why = " (CFG samples the unconditional caption too)" if context_key.startswith("uncond") else ""
            raise ValueError(f"{what}: lacks {context_key!r}{why}")
        context = np.asarray(text_prompts[context_key], np.float32)
        if context.ndim != 3 or context.shape[-1] != width or context.shape[0] == 0:
            raise ValueError(f"{what}[{context_key!r}]: shape {context.shape}, the model's text-only layers need "
                             f"(prompts >= 1, tokens, {width})")
        if not np.isfinite(context).all():
            raise ValueError(f"{what}[{context_key!r}]: holds non-finite values")
        arrays[context_key] = context
        if text_prompts.get(mask_key) is None:
            continue
        mask = np.asarray(text_prompts[mask_key], np.float32)
        if mask.shape != context.shape[:2]:
            raise ValueError(f"{what}[{mask_key!r}]: shape {mask.shape} does not match {context_key!r}'s "
                             f"(prompts, tokens) = {context.shape[:2]}")
        if not np.isin(mask, (0.0, 1.0)).all():
            raise ValueError(f"{what}[{mask_key!r}]: holds values other than 0 and 1 (1 = real token)")
        arrays[mask_key] = mask
    if not any(arrays.get(mask_key, np.ones(1)).any() for _, mask_key in sources):
        raise ValueError(f"{what}: every token is masked (no real token to compute rows from)")
    return arrays


def _row_priorities(rows: np.ndarray, seed: int) -> np.ndarray:
    """A seeded pseudo-random 64-bit priority per row ``(n, d)`` -> ``(n,)`` uint64, a function of the row's bytes:
    equal rows get equal priorities, so keeping the lowest ``k`` of the distinct rows is a uniform random subset of
    them, whatever the batching or the order the rows come in."""
    key = int(seed).to_bytes(8, "little", signed=True)
    return np.fromiter((int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8, key=key).digest(), "little")
                        for row in rows), np.uint64, count=rows.shape[0])


def text_only_rows(family: str | families.Family, model: nnx.Module, text_prompts: Mapping[str, Any], *,
                   max_rows: int, seed: int, uses_cfg: bool, batch_size: int = 256, row_dtype: str = "float32",
                   what: str = "text_prompts") -> tuple[np.ndarray, int]:
    """The input rows of the family's text-only layers (``Family.text_only``), from every real token of many prompts.

    ``Family.text_only.inputs(model, context)`` of ``context`` (and of ``uncond_context`` when ``uses_cfg``), in
    device batches of ``batch_size`` prompts (the last one zero-padded: one compilation per token length), keeps the
    rows of real tokens (mask 1), drops exact repeats (the unconditional caption, captions that share tokens) and
    keeps a seeded uniform random subset of at most ``max_rows`` of the distinct rows (the lowest of a per-row hash
    priority, so memory is one batch plus ``max_rows`` rows, and the subset does not depend on the batching).

    Args:
        family: a ``models.families`` name or Family (``"pixart"``, ``"sana"``).
        model: the converted 16-bit model.
        text_prompts: see :func:`check_text_prompts`.
        max_rows: rows kept at most.
        seed: seeds the subset.
        uses_cfg: include the unconditional caption (the sampler runs that branch).
        batch_size: prompts per device call.
        row_dtype: the rows are rounded to this dtype (as the sampled capture's ``row_dtype``), then float32.
        what: how errors name ``text_prompts``.
    Returns:
        ``(rows (n, d) float32 in a random order, n <= max_rows, the number of distinct rows before the subset)``.
    """
    family = families.get(family) if isinstance(family, str) else family
    if max_rows < 1 or batch_size < 1:
        raise ValueError(f"text_only_rows: max_rows={max_rows} and batch_size={batch_size} must be >= 1")
    arrays = check_text_prompts(family, model, text_prompts, uses_cfg, what)
    graphdef, state = nnx.split(model)
    inputs = family.text_only.inputs
    project = jax.jit(lambda params, context: inputs(nnx.merge(graphdef, params), context))
    row_dtype = jnp.dtype(row_dtype)
    kept = np.zeros((0, 0), np.float32)
    kept_priority = np.zeros((0,), np.uint64)
    seen: set[int] = set()
    for context_key in ("context", "uncond_context") if uses_cfg else ("context",):
        context = arrays[context_key]  # (P, t, c)
        mask = arrays.get(context_key.replace("context", "mask"))  # (P, t) or None
        size = min(batch_size, context.shape[0])
        for start in range(0, context.shape[0], size):
            part = context[start:start + size]  # (<= size, t, c)
            count = part.shape[0]
            padded = np.concatenate([part, np.zeros((size - count,) + part.shape[1:], np.float32)])  # (size, t, c)
            out = np.asarray(project(state, jnp.asarray(padded)).astype(row_dtype), np.float32)[:count]  # (., t, d)
            real = np.ones(out.shape[:2], bool) if mask is None else mask[start:start + count] > 0  # (., t)
            rows = out[real] + 0.0  # (r, d) real tokens; + 0.0 makes -0.0 equal to 0.0 bytewise
            if not np.isfinite(rows).all():
                raise ValueError(f"{what}[{context_key!r}]: the text function gives non-finite rows "
                                 f"(prompts {start}-{start + count - 1})")
            priority = _row_priorities(rows, seed)  # (r,)
            seen.update(priority.tolist())
            if kept.shape[0] == 0:
                kept = np.zeros((0, rows.shape[1]), np.float32)
            merged, merged_priority = np.concatenate([kept, rows]), np.concatenate([kept_priority, priority])
            _, first = np.unique(merged, axis=0, return_index=True)  # exact repeats kept once
            order = first[np.argsort(merged_priority[first], kind="stable")][:max_rows]
            kept, kept_priority = merged[order], merged_priority[order]
    return kept, len(seen)


def capture_layer_set(family: str | families.Family, model: nnx.Module, prompt_batches: Sequence[Mapping[str, Any]],
                      config: CaptureConfig = CaptureConfig(), text_prompts: Mapping[str, Any] | None = None
                      ) -> dict[str, tuple[np.ndarray, Any, np.ndarray]]:
    """Sample once per prompt batch and return the layer set of the recorded linears.

    Args:
        family: a ``models.families`` name (``"pixart"``, ``"sana"``, ``"flux"``, ``"ideogram4"``) or Family.
        model: the converted 16-bit model.
        prompt_batches: each a dict of the family's text inputs (``models.sampling`` denoisers: e.g. PixArt
            ``context (b, t, c)``, ``mask (b, t)``, ``uncond_context``, ``uncond_mask``; ``Family.prompt_inputs``);
            all batches the same shapes (one compilation).
        config: see :class:`CaptureConfig`.
        text_prompts: with ``config.text_rows_from_all_prompts``, the prompts whose real tokens make the rows of the
            text-only layers (:func:`check_text_prompts`: ``context (P, t, c)``, ``mask (P, t)``, ``uncond_context``,
            ``uncond_mask``; typically many more than are sampled); None = the prompts of ``prompt_batches``.
    Returns:
        ``{name: (W (o, d) float32, bias (o,) float32 or None, A_rows (n, d) float32)}``, n <= rows_per_layer.
    Raises:
        ValueError: unknown layers; ``text_prompts`` without the option; with it, a family without text-only layers,
            no text-only layer among the recorded ones, or bad ``text_prompts`` (:func:`check_text_prompts`), all
            before any sampling.
    """
    family = families.get(family) if isinstance(family, str) else family
    if not prompt_batches:
        raise ValueError("capture_layer_set needs at least one prompt batch")
    available = linears(model)
    names = list(config.layers) if config.layers is not None else list(linears(model, quantizable_only=True))
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"capture_layer_set: no Linear at {unknown} (e.g. {sorted(available)[:4]})")
    text_layers: list[str] = []
    if config.text_rows_from_all_prompts:
        what = "capture_layer_set: text_prompts" if text_prompts is not None else "capture_layer_set: prompt_batches"
        if text_prompts is None:
            text_prompts = {key: np.concatenate([np.asarray(batch[key]) for batch in prompt_batches])
                            for key in TEXT_KEYS if all(batch.get(key) is not None for batch in prompt_batches)}
        check_text_prompts(family, model, text_prompts, config.uses_cfg, what)
        declared = family.text_only.layers(model)
        text_layers = [name for name in names if name in declared]
        if not text_layers:
            raise ValueError(f"capture_layer_set: text_rows_from_all_prompts, but none of the {len(names)} recorded "
                             f"layers reads the text alone (the {family.name} family's: {list(declared[:2])}, ...)")
    elif text_prompts is not None:
        raise ValueError("capture_layer_set: text_prompts are only read with "
                         "CaptureConfig(text_rows_from_all_prompts=True)")
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
    if text_layers:
        # the text-only layers were sampled above too, so that every other layer's draws are those of the capture
        # without the option; their rows are replaced by the rows of every prompt's tokens
        rows, _ = text_only_rows(family, model, text_prompts, max_rows=config.rows_per_layer, seed=config.seed,
                                 uses_cfg=config.uses_cfg, batch_size=config.text_batch_size,
                                 row_dtype=config.row_dtype, what=what)
        for name in text_layers:
            layer_set[name] = layer_set[name][:2] + (rows,)
    return layer_set
