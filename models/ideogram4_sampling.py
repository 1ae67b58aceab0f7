"""Ideogram 4 sampling in JAX: the denoising loop of diffusers' ``Ideogram4Pipeline`` (diffusers 0.42), jitted.

What the pipeline does, and what this module reproduces (numbers and arithmetic order):

* **Layout.** Per prompt, a packed sequence ``[left padding][text][image]`` of ``max_text_tokens + grid_h * grid_w``
  tokens (:func:`prepare_ids` = ``Ideogram4Pipeline._prepare_ids``). The unconditional branch sees only the image
  slice ``[max_text_tokens:]`` of that layout, with zero text features.
* **Schedule.** A resolution-aware logit-normal schedule: ``mu = base_mu + 0.5 log(h w / 512^2)``,
  ``sigma_i = 1 - clamp(1 - expit(mu + std * ndtri(s_i)))`` for ``s = linspace(0, 1, N + 1)``, flipped, first ``N``
  kept (float64, then float32), then ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas)`` with its default config
  (shift 1): ``timesteps = sigma * 1000`` and a terminal sigma 0 (:func:`flow_schedule`).
* **Step.** Model time ``t = 1 - timestep / 1000`` (float32, then the model dtype); the conditional transformer on the
  whole sequence, the unconditional one on the image tokens; guided velocity ``v = g_i v_cond + (1 - g_i) v_uncond``
  in float32; Euler ``x <- x + (sigma_{i+1} - sigma_i) (-v)`` (the pipeline passes ``-v`` to the scheduler).
  The default guidance schedule is 7.0 for 45 steps, then 3.0 for 3 (:data:`DEFAULT_GUIDANCE_SCHEDULE`).
* **One branch.** Not the pipeline: :func:`unguided_denoise_loop` runs the conditional transformer alone (a student
  with the guidance folded into its weights), one forward per step, optionally through linear hooks (served W4A4
  layers).

One exact saving over the pipeline: the text conditioning ``llm_cond_proj(norm(features)) * mask`` does not depend on
the step, so it is computed once per prompt (:meth:`Ideogram4Transformer.embed_text`) instead of at every step, and the
unconditional branch's all-zero features skip the 53248-wide projection entirely.

The text encoder (Qwen3-VL) and the VAE stay in diffusers/torch: :func:`encode_prompt_with_pipeline` and
:func:`decode_latents_with_pipeline` use a loaded ``Ideogram4Pipeline`` when one is installed; nothing in this module
imports torch at import time.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
    Ideogram4Transformer,
)
from models.layers import LinearHooks
from models.sampling import recorded, step_hooks

DEFAULT_GUIDANCE_SCHEDULE: tuple[float, ...] = (7.0,) * 45 + (3.0,) * 3
"""The pipeline's default: guidance 7.0 for the first 45 of 48 steps, 3.0 for the last 3 ("polish") steps."""

PIXELS_PER_TOKEN = 16
"""VAE downsampling 8 x the pipeline's patchify 2: one image token per 16 x 16 pixels."""

NUM_TRAIN_TIMESTEPS = 1000


# ----------------------------------------------------------------------------------------------------------------
# the schedule
# ----------------------------------------------------------------------------------------------------------------


def resolution_aware_mu(height: int, width: int, base_mu: float,
                        base_resolution: tuple[int, int] = (512, 512)) -> float:
    """The schedule mean shifted by half the log of the pixel-count ratio to ``base_resolution``."""
    return base_mu + 0.5 * math.log((height * width) / (base_resolution[0] * base_resolution[1]))


def logit_normal_sigmas(num_steps: int, mu: float, std: float = 1.0, logsnr_min: float = -15.0,
                        logsnr_max: float = 18.0) -> np.ndarray:
    """``(num_steps,)`` float32 decreasing sigmas of the Ideogram 4 logit-normal schedule (no terminal zero).

    Computed in float64 like diffusers' ``_logit_normal_sigmas``, then rounded to float32.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    normal = statistics.NormalDist()
    intervals = np.linspace(0.0, 1.0, num_steps + 1, dtype=np.float64)  # (N+1,)
    z = np.array([-np.inf if s <= 0.0 else np.inf if s >= 1.0 else normal.inv_cdf(float(s)) for s in intervals])
    y = mu + std * z  # (N+1,)
    with np.errstate(over="ignore"):
        t = 1.0 - 1.0 / (1.0 + np.exp(-y))  # model time, 0 = noise
    t_min = 1.0 / (1.0 + math.exp(0.5 * logsnr_max))
    t_max = 1.0 / (1.0 + math.exp(0.5 * logsnr_min))
    sigmas = (1.0 - np.clip(t, t_min, t_max))[::-1]  # (N+1,) decreasing
    return sigmas[:-1].astype(np.float32)  # (N,)


@dataclasses.dataclass(frozen=True)
class FlowSchedule:
    """Per-step numbers of the pipeline's loop (numpy float32).

    Attributes:
        sigmas: ``(N + 1,)`` decreasing, the last one 0 (the scheduler's terminal sigma).
        timesteps: ``(N,)`` the scheduler's ``sigma * 1000``.
        model_times: ``(N,)`` the transformer's time ``1 - timestep / 1000`` (float32 arithmetic, as the pipeline).
        guidance: ``(N,)`` the guidance weight of each step.
    """

    sigmas: np.ndarray
    timesteps: np.ndarray
    model_times: np.ndarray
    guidance: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


def flow_schedule(height: int, width: int, num_steps: int = 48, mu: float = 0.0, std: float = 1.5,
                  guidance_schedule: Sequence[float] | None = DEFAULT_GUIDANCE_SCHEDULE,
                  guidance_scale: float | None = None) -> FlowSchedule:
    """The pipeline's schedule for an image of ``height x width`` pixels (pipeline defaults: 48 steps, mu 0, std 1.5).

    Exactly one of ``guidance_schedule`` (length ``num_steps``) and ``guidance_scale`` (constant) must be given, as in
    ``Ideogram4Pipeline.__call__``.
    """
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"height={height} and width={width} must be multiples of {PIXELS_PER_TOKEN}")
    if (guidance_scale is None) == (guidance_schedule is None):
        raise ValueError("give exactly one of guidance_schedule and guidance_scale")
    if guidance_scale is not None:
        guidance_schedule = (float(guidance_scale),) * num_steps
    if len(guidance_schedule) != num_steps:
        raise ValueError(f"guidance_schedule has {len(guidance_schedule)} entries, num_steps={num_steps}")
    sigmas = logit_normal_sigmas(num_steps, resolution_aware_mu(height, width, mu), std=std)  # (N,) float32
    # FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...) with shift 1: shift * s / (1 + 0 * s) == s.
    timesteps = (sigmas * np.float32(NUM_TRAIN_TIMESTEPS)).astype(np.float32)  # (N,)
    model_times = (np.float32(1.0) - timesteps / np.float32(NUM_TRAIN_TIMESTEPS)).astype(np.float32)  # (N,)
    return FlowSchedule(sigmas=np.concatenate([sigmas, np.zeros((1,), np.float32)]), timesteps=timesteps,
                        model_times=model_times, guidance=np.asarray(guidance_schedule, np.float32))


# ----------------------------------------------------------------------------------------------------------------
# the packed layout
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Token layout of the conditional sequence (numpy int32); the unconditional branch uses ``[:, num_text_slots:]``.

    Attributes:
        position_ids: ``(B, L, 3)``; segment_ids: ``(B, L)``; indicator: ``(B, L)``, with
            ``L = num_text_slots + grid_h * grid_w``.
        num_text_slots: text slots before the image tokens (the pipeline's ``max_sequence_length``, 2048).
        single_segment: every row is one segment (no padding): attention needs no mask.
    """

    position_ids: np.ndarray
    segment_ids: np.ndarray
    indicator: np.ndarray
    num_text_slots: int
    grid: tuple[int, int]

    @property
    def single_segment(self) -> bool:
        return bool(np.all(self.segment_ids == self.segment_ids[:, :1]))

    @property
    def num_image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def prepare_ids(text_lengths: Sequence[int], grid_h: int, grid_w: int, max_text_tokens: int) -> PackedLayout:
    """``Ideogram4Pipeline._prepare_ids`` in numpy: ``[left pad][text][image]`` per prompt.

    Text token ``k`` gets position ``(k, k, k)``; image token ``(r, c)`` gets ``(0, r, c) + 65536``; the padding has
    segment -1 and indicator 0. ``max_text_tokens = max(text_lengths)`` gives the packed layout without padding for a
    single prompt.
    """
    if any(n < 0 or n > max_text_tokens for n in text_lengths):
        raise ValueError(f"text_lengths={list(text_lengths)} must lie in [0, max_text_tokens={max_text_tokens}]")
    batch = len(text_lengths)
    num_image = grid_h * grid_w
    total = max_text_tokens + num_image
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    image_pos = np.stack([np.zeros(num_image, np.int64), rows.ravel(), cols.ravel()], 1) + IMAGE_POSITION_OFFSET
    position_ids = np.zeros((batch, total, 3), np.int32)
    segment_ids = np.full((batch, total), SEQUENCE_PADDING_INDICATOR, np.int32)
    indicator = np.zeros((batch, total), np.int32)
    for b, num_text in enumerate(text_lengths):
        offset = max_text_tokens - num_text
        position_ids[b, offset:offset + num_text] = np.arange(num_text)[:, None]
        position_ids[b, offset + num_text:] = image_pos
        indicator[b, offset:offset + num_text] = LLM_TOKEN_INDICATOR
        indicator[b, offset + num_text:] = OUTPUT_IMAGE_INDICATOR
        segment_ids[b, offset:] = 1
    return PackedLayout(position_ids, segment_ids, indicator, max_text_tokens, (grid_h, grid_w))


def trim_text_padding(text_features: Any, layout: PackedLayout) -> tuple[Any, PackedLayout]:
    """Drop the text slots that no prompt of the batch uses: ``T`` slots -> ``max(text lengths)`` slots.

    The image-token velocities are unchanged (padding is its own attention segment and nothing attends to it), and a
    single prompt then needs no attention mask: the pipeline's 2048 + 4096 tokens become e.g. 128 + 4096 (see
    docs/ideogram4.md for the cost). ``text_features (B, T, F)`` (numpy or jax) -> ``(B, max_len, F)``.
    """
    lengths = [int(n) for n in (layout.indicator == LLM_TOKEN_INDICATOR).sum(axis=1)]
    expected = prepare_ids(lengths, *layout.grid, layout.num_text_slots)
    if not all(np.array_equal(a, b) for a, b in ((expected.position_ids, layout.position_ids),
                                                  (expected.segment_ids, layout.segment_ids),
                                                  (expected.indicator, layout.indicator))):
        raise ValueError("trim_text_padding needs the pipeline's [left pad][text][image] layout (prepare_ids)")
    if text_features.shape[:2] != (len(lengths), layout.num_text_slots):
        raise ValueError(f"text_features {text_features.shape} must be (B, num_text_slots={layout.num_text_slots}, F)")
    keep = max(lengths)
    return text_features[:, layout.num_text_slots - keep:], prepare_ids(lengths, *layout.grid, keep)


def grid_for(height: int, width: int) -> tuple[int, int]:
    """Image-token grid ``(height / 16, width / 16)`` of an image size in pixels."""
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"height={height} and width={width} must be multiples of {PIXELS_PER_TOKEN}")
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


# ----------------------------------------------------------------------------------------------------------------
# the denoising loop
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Branches:
    """Precomputed per-prompt inputs of the two transformers (a pytree of arrays; see :func:`prepare_branches`), or
    of the conditional one alone (:func:`prepare_conditional`: ``uncond_text_embeddings`` is None)."""

    text_embeddings: jax.Array  # (B, L, hidden) conditional branch
    uncond_text_embeddings: jax.Array | None  # (B, N, hidden); None: one branch
    position_ids: jax.Array  # (B, L, 3)
    segment_ids: jax.Array | None  # (B, L) or None (single segment)
    indicator: jax.Array  # (B, L)


jax.tree_util.register_dataclass(Branches, data_fields=[f.name for f in dataclasses.fields(Branches)],
                                 meta_fields=[])


def prepare_branches(cond: Ideogram4Transformer, uncond: Ideogram4Transformer, text_features: jax.Array,
                     layout_arrays: tuple[jax.Array, jax.Array | None, jax.Array], num_text_slots: int) -> Branches:
    """Per-prompt inputs of both branches; the text projection runs here once, not at every step.

    Args:
        text_features: ``(B, T, llm_features_dim)`` text region of the sequence (``T = num_text_slots``).
        layout_arrays: ``(position_ids (B, L, 3), segment_ids (B, L) or None, indicator (B, L))``.
    """
    conditional = prepare_conditional(cond, text_features, layout_arrays, num_text_slots)
    uncond_text = uncond.embed_text(None, layout_arrays[2][:, num_text_slots:])  # (B, N, hidden)
    return dataclasses.replace(conditional, uncond_text_embeddings=uncond_text)


def prepare_conditional(cond: Ideogram4Transformer, text_features: jax.Array,
                        layout_arrays: tuple[jax.Array, jax.Array | None, jax.Array], num_text_slots: int) -> Branches:
    """The conditional branch's per-prompt inputs alone (``uncond_text_embeddings`` None), for one-branch sampling;
    the text projection runs here once. Shapes as in :func:`prepare_branches`."""
    position_ids, segment_ids, indicator = layout_arrays
    text_region = cond.embed_text(text_features, indicator[:, :num_text_slots])  # (B, T, hidden)
    # Image positions carry zero features in the pipeline: their contribution is exactly bias * [text token].
    image_region = cond.embed_text(None, indicator[:, num_text_slots:])  # (B, N, hidden)
    text_embeddings = jnp.concatenate([text_region, image_region], axis=1)  # (B, L, hidden)
    return Branches(text_embeddings, None, position_ids, segment_ids, indicator)


def conditional_velocity(cond: Ideogram4Transformer, branches: Branches, latents: jax.Array, model_time: jax.Array,
                         num_text_slots: int, hooks: LinearHooks | None = None) -> jax.Array:
    """The conditional branch's velocity ``(B, N, C)`` float32 on the image tokens, for ``latents (B, N, C)``
    float32 at ``model_time`` (scalar or ``(B,)``); ``hooks`` route the transformer's linears."""
    batch, _, channels = latents.shape
    dtype = cond.config.dtype
    t = jnp.broadcast_to(model_time.astype(jnp.float32), (batch,)).astype(dtype)  # (B,)
    text_padding = jnp.zeros((batch, num_text_slots, channels), jnp.float32)  # (B, T, C)
    cond_latents = jnp.concatenate([text_padding, latents], axis=1).astype(dtype)  # (B, L, C)
    cond_out = cond(cond_latents, t, None, branches.position_ids, branches.segment_ids, branches.indicator,
                    text_embeddings=branches.text_embeddings, hooks=hooks)  # (B, L, C)
    return cond_out[:, num_text_slots:].astype(jnp.float32)  # (B, N, C)


def guided_velocity(cond: Ideogram4Transformer, uncond: Ideogram4Transformer, branches: Branches,
                    latents: jax.Array, model_time: jax.Array, guidance: jax.Array, num_text_slots: int,
                    hooks: LinearHooks | None = None) -> jax.Array:
    """``g v_cond + (1 - g) v_uncond`` in float32 for ``latents (B, N, C)`` float32 at ``model_time`` (scalar or
    ``(B,)``) and ``guidance`` (scalar or broadcastable to ``(B, N, C)``); ``hooks`` route both transformers'
    linears (one set: the two branches of one model)."""
    batch = latents.shape[0]
    t = jnp.broadcast_to(model_time.astype(jnp.float32), (batch,))  # (B,)
    cond_v = conditional_velocity(cond, branches, latents, t, num_text_slots, hooks)  # (B, N, C)
    uncond_segments = None if branches.segment_ids is None else branches.segment_ids[:, num_text_slots:]
    uncond_v = uncond(latents.astype(uncond.config.dtype), t.astype(cond.config.dtype).astype(uncond.config.dtype),
                      None, branches.position_ids[:, num_text_slots:], uncond_segments,
                      branches.indicator[:, num_text_slots:], text_embeddings=branches.uncond_text_embeddings,
                      hooks=hooks).astype(jnp.float32)  # (B, N, C)
    return guidance * cond_v + (1.0 - guidance) * uncond_v  # (B, N, C)


def euler_step(latents: jax.Array, velocity: jax.Array, sigma: jax.Array, sigma_next: jax.Array) -> jax.Array:
    """The scheduler's step on ``-v``: ``x + (sigma_next - sigma) * (-v)`` in float32."""
    return latents + (sigma_next - sigma) * (-velocity)  # (B, N, C)


def layout_arrays(layout: PackedLayout, use_mask: bool | None = None
                  ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``(position_ids, segment_ids or None, indicator)`` device arrays; ``segment_ids`` is dropped (no attention
    mask) when ``use_mask`` is False, by default when the layout is one segment per row."""
    use_mask = (not layout.single_segment) if use_mask is None else use_mask
    if not use_mask and not layout.single_segment:
        raise ValueError("use_mask=False needs a single-segment layout (no padding); this layout has padding")
    return (jnp.asarray(layout.position_ids), jnp.asarray(layout.segment_ids) if use_mask else None,
            jnp.asarray(layout.indicator))


def _check_inputs(cond: Ideogram4Transformer, noise: jax.Array, text_features: jax.Array, layout: PackedLayout):
    batch = layout.indicator.shape[0]
    cfg = cond.config
    if noise.shape != (batch, layout.num_image_tokens, cfg.in_channels):
        raise ValueError(f"noise {noise.shape} must be (B, grid_h * grid_w, in_channels) = "
                         f"{(batch, layout.num_image_tokens, cfg.in_channels)}")
    if text_features.shape != (batch, layout.num_text_slots, cfg.llm_features_dim):
        raise ValueError(f"text_features {text_features.shape} must be (B, num_text_slots, llm_features_dim) = "
                         f"{(batch, layout.num_text_slots, cfg.llm_features_dim)}")


def denoise_loop(cond: Ideogram4Transformer, uncond: Ideogram4Transformer, noise: jax.Array, text_features: jax.Array,
                 layout_arrays: tuple[jax.Array, jax.Array | None, jax.Array], sigmas: jax.Array,
                 model_times: jax.Array, guidance: jax.Array, num_text_slots: int) -> jax.Array:
    """The whole guided Euler loop as one ``lax.scan`` (pure; call it under jit). Shapes as in :func:`sample`;
    ``sigmas (N + 1,)``, ``model_times (N,)``, ``guidance (N,)`` float32 from a :class:`FlowSchedule`."""
    branches = prepare_branches(cond, uncond, text_features, layout_arrays, num_text_slots)
    cond_graph, cond_state = nnx.split(cond)
    uncond_graph, uncond_state = nnx.split(uncond)

    def velocity(latents, model_time, g):
        return guided_velocity(nnx.merge(cond_graph, cond_state), nnx.merge(uncond_graph, uncond_state),
                               branches, latents, model_time, g, num_text_slots)  # (B, N, C)

    return _euler_scan(velocity, noise, sigmas, model_times, guidance)  # (B, N, C)


def unguided_denoise_loop(cond: Ideogram4Transformer, noise: jax.Array, text_features: jax.Array,
                          layout_arrays: tuple[jax.Array, jax.Array | None, jax.Array], sigmas: jax.Array,
                          model_times: jax.Array, num_text_slots: int, hooks: LinearHooks | None = None) -> jax.Array:
    """One branch: the conditional transformer alone, no guidance, as one ``lax.scan`` over the steps (pure; call it
    under jit). For a student with the guidance folded into its weights (the QAD / DMD2 students): one forward per
    step, ``x <- x + (sigma_{i+1} - sigma_i) (-v_cond)``; the same latents as :func:`denoise_loop` at guidance 1
    (``1 v_cond + 0 v_uncond``) without the unconditional transformer. The text projection runs once, inside.

    Args:
        cond: the (conditional) transformer.
        noise: ``(B, N, in_channels)`` initial latents, ``N = grid_h * grid_w``.
        text_features: ``(B, T, llm_features_dim)`` the text region (``T = num_text_slots``).
        layout_arrays: ``(position_ids (B, T + N, 3), segment_ids (B, T + N) or None, indicator (B, T + N))``
            (:func:`layout_arrays`).
        sigmas: ``(S + 1,)`` float32 decreasing, the last one 0; model_times: ``(S,)`` float32 (a
            :class:`FlowSchedule`'s, whose guidance is not used).
        hooks: routes ``cond``'s linears at every step (e.g. served W4A4 layers; ``FusedLinearHooks(stacked=True)``
            for a ``scan_layers`` model). Build them inside the caller's jit from traced entries
            (``FusedLinearHooks.from_entries``) so the layers' arrays are arguments, not constants.
    Returns:
        ``(B, N, in_channels)`` float32 denoised latents.
    """
    if sigmas.shape != (model_times.shape[0] + 1,):
        raise ValueError(f"sigmas {sigmas.shape} must be (steps + 1,) for model_times {model_times.shape}")
    conditional = prepare_conditional(cond, text_features, layout_arrays, num_text_slots)
    cond_graph, cond_state = nnx.split(cond)

    def velocity(latents, model_time):
        return conditional_velocity(nnx.merge(cond_graph, cond_state), conditional, latents, model_time,
                                    num_text_slots, hooks)  # (B, N, C)

    return _euler_scan(velocity, noise, sigmas, model_times)  # (B, N, C)


def _euler_scan(velocity: Any, noise: jax.Array, sigmas: jax.Array, model_times: jax.Array,
                *per_step: jax.Array) -> jax.Array:
    """``x <- euler_step(x, velocity(x, model_times[i], *per_step[i]), sigmas[i], sigmas[i + 1])`` for every step,
    one ``lax.scan``: ``noise (B, N, C)`` -> ``(B, N, C)`` float32; ``per_step`` arrays have a leading ``(S,)``."""

    def step(latents, xs):
        model_time, sigma, sigma_next, *extra = xs
        return euler_step(latents, velocity(latents, model_time, *extra), sigma, sigma_next), None

    latents, _ = jax.lax.scan(step, noise.astype(jnp.float32), (model_times, sigmas[:-1], sigmas[1:], *per_step))
    return latents  # (B, N, C)


_sample_jit = nnx.jit(denoise_loop, static_argnames=("num_text_slots",))


def sample(cond: Ideogram4Transformer, uncond: Ideogram4Transformer, noise: jax.Array, text_features: jax.Array,
           layout: PackedLayout, schedule: FlowSchedule, use_mask: bool | None = None) -> jax.Array:
    """Run the whole guided flow-matching loop, jitted (one ``lax.scan`` over the steps).

    Args:
        cond, uncond: the conditional ``transformer`` and the ``unconditional_transformer``.
        noise: ``(B, grid_h * grid_w, in_channels)`` initial latents (the pipeline's ``latents``), float32.
        text_features: ``(B, num_text_slots, llm_features_dim)`` the text region of the pipeline's prompt embeddings
            (left-padded; zeros on padding).
        layout: from :func:`prepare_ids` (the same text lengths the features were built with).
        schedule: from :func:`flow_schedule`.
        use_mask: attention mask from ``segment_ids``; default: only when the layout has padding.
    Returns:
        ``(B, grid_h * grid_w, in_channels)`` float32 denoised latents (the pipeline's ``output_type="latent"``).
    """
    _check_inputs(cond, noise, text_features, layout)
    return _sample_jit(cond, uncond, noise, text_features, layout_arrays(layout, use_mask),
                       jnp.asarray(schedule.sigmas), jnp.asarray(schedule.model_times),
                       jnp.asarray(schedule.guidance), num_text_slots=layout.num_text_slots)


@nnx.jit(static_argnames=("num_text_slots",))
def _cfg_step_jit(cond, uncond, branches, latents, model_time, sigma, sigma_next, guidance, num_text_slots):
    velocity = guided_velocity(cond, uncond, branches, latents, model_time, guidance, num_text_slots)
    return euler_step(latents, velocity, sigma, sigma_next)


@nnx.jit(static_argnames=("num_text_slots",))
def _prepare_branches_jit(cond, uncond, text_features, layout_arrays, num_text_slots):
    return prepare_branches(cond, uncond, text_features, layout_arrays, num_text_slots)


class CFGStepper:
    """One jitted guided Euler step at a time (for step-by-step comparisons and per-step timing).

    ``stepper = CFGStepper(cond, uncond, text_features, layout)``, then ``latents = stepper(latents, schedule, i)``.
    """

    def __init__(self, cond: Ideogram4Transformer, uncond: Ideogram4Transformer, text_features: jax.Array,
                 layout: PackedLayout, use_mask: bool | None = None):
        if text_features.shape[:2] != (layout.indicator.shape[0], layout.num_text_slots):
            raise ValueError(f"text_features {text_features.shape} must be (B, num_text_slots={layout.num_text_slots},"
                             f" llm_features_dim)")
        self.cond, self.uncond, self.layout = cond, uncond, layout
        self.branches = _prepare_branches_jit(cond, uncond, text_features, layout_arrays(layout, use_mask),
                                              num_text_slots=layout.num_text_slots)

    def __call__(self, latents: jax.Array, schedule: FlowSchedule, step: int) -> jax.Array:
        if not 0 <= step < schedule.num_steps:
            raise ValueError(f"step={step} outside the schedule's {schedule.num_steps} steps")
        return _cfg_step_jit(self.cond, self.uncond, self.branches, latents.astype(jnp.float32),
                             jnp.float32(schedule.model_times[step]), jnp.float32(schedule.sigmas[step]),
                             jnp.float32(schedule.sigmas[step + 1]), jnp.float32(schedule.guidance[step]),
                             num_text_slots=self.layout.num_text_slots)


# ----------------------------------------------------------------------------------------------------------------
# one transformer behind the families' sampler interface (capture, quantize-checkpoint)
# ----------------------------------------------------------------------------------------------------------------


def mask_layout(mask: jax.Array, grid_h: int, grid_w: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed layout of text keep-masks, traced: ``mask (B, T)`` (1 = text token; the pipeline left-pads) ->
    ``(position_ids (B, T + N, 3), segment_ids (B, T + N), indicator (B, T + N))``, N = grid_h grid_w. For a
    left-padded mask it equals :func:`prepare_ids`; text token ``k`` of a row gets position ``(k, k, k)``."""
    batch, _ = mask.shape
    text = mask.astype(bool)  # (B, T)
    text_pos = jnp.where(text, jnp.cumsum(text, axis=1) - 1, 0).astype(jnp.int32)  # (B, T)
    image = prepare_ids([0], grid_h, grid_w, 0)  # the image slots of every row (no text)
    num_image = grid_h * grid_w
    position_ids = jnp.concatenate([jnp.repeat(text_pos[..., None], 3, axis=-1),
                                    jnp.broadcast_to(jnp.asarray(image.position_ids), (batch, num_image, 3))], axis=1)
    segment_ids = jnp.concatenate([jnp.where(text, 1, SEQUENCE_PADDING_INDICATOR),
                                   jnp.ones((batch, num_image), jnp.int32)], axis=1).astype(jnp.int32)
    indicator = jnp.concatenate([jnp.where(text, LLM_TOKEN_INDICATOR, 0),
                                 jnp.full((batch, num_image), OUTPUT_IMAGE_INDICATOR)], axis=1).astype(jnp.int32)
    return position_ids, segment_ids, indicator


def make_sampler(graphdef: nnx.GraphDef, cfg: Any, *, num_steps: int, guidance_scale: float,
                 latent_hw: tuple[int, int], shift: float | None = None, solver: str | None = None,
                 hooks_factory: Any = None):
    """One Ideogram 4 transformer as ``sample(params, key) -> (latents (B, N, C), aux per step)``, the interface of
    ``models.sampling.make_sampler`` (``models.families``).

    The pipeline's guidance needs its second checkpoint (``unconditional_transformer``); one transformer runs the
    conditional branch alone (``guidance_scale`` 1.0, the pipeline's ``v = g v_cond + (1 - g) v_uncond`` at g = 1),
    on the pipeline's schedule (:func:`flow_schedule`) and Euler step. ``latent_hw`` is the image-token grid
    ``(grid_h, grid_w)`` (``grid_for(height, width)``). ``params``: ``"model"`` (the nnx state), ``"context"``
    ``(B, T, llm_features_dim)`` text features and ``"mask"`` ``(B, T)`` (1 = text token, left-padded), optional
    ``"overrides"``; ``hooks_factory(params, step)`` as in ``models.sampling``. Wrap in ``jax.jit``.
    """
    if guidance_scale != 1.0:
        raise ValueError(f"Ideogram 4 with one transformer samples the conditional branch only: guidance_scale must "
                         f"be 1.0, got {guidance_scale} (the pipeline's guidance needs its unconditional_transformer)")
    if shift is not None or solver not in (None, "flow_euler"):
        raise ValueError(f"Ideogram 4 uses its resolution-aware flow schedule: shift={shift}, solver={solver!r} are "
                         f"not options (None, None or 'flow_euler')")
    grid_h, grid_w = latent_hw
    schedule = flow_schedule(grid_h * PIXELS_PER_TOKEN, grid_w * PIXELS_PER_TOKEN, num_steps,
                             guidance_schedule=None, guidance_scale=1.0)
    per_step = (jnp.arange(num_steps, dtype=jnp.int32), jnp.asarray(schedule.model_times),
                jnp.asarray(schedule.sigmas[:-1]), jnp.asarray(schedule.sigmas[1:]))
    num_image = grid_h * grid_w

    def sample(params, key):
        context, mask = params["context"], params["mask"]
        batch, num_text, _ = context.shape
        position_ids, segment_ids, indicator = mask_layout(mask, grid_h, grid_w)  # (B, L, 3), (B, L), (B, L)
        model = nnx.merge(graphdef, params["model"])
        image_text = model.embed_text(None, indicator[:, num_text:])  # (B, N, hidden): zero features
        text_embeddings = jnp.concatenate([model.embed_text(context, indicator[:, :num_text]), image_text], axis=1)
        noise = jax.random.normal(key, (batch, num_image, cfg.in_channels), jnp.float32)  # (B, N, C)

        def step(latents, inputs):
            index, model_time, sigma, sigma_next = inputs
            hooks = step_hooks(params, hooks_factory, index)
            model = nnx.merge(graphdef, params["model"])
            t = jnp.broadcast_to(model_time, (batch,)).astype(cfg.dtype)  # (B,)
            padded = jnp.concatenate([jnp.zeros((batch, num_text, cfg.in_channels)), latents], axis=1)  # (B, L, C)
            out = model(padded.astype(cfg.dtype), t, None, position_ids, segment_ids, indicator,
                        text_embeddings=text_embeddings, hooks=hooks)  # (B, L, C)
            velocity = out[:, num_text:].astype(jnp.float32)  # (B, N, C)
            return euler_step(latents, velocity, sigma, sigma_next), recorded(hooks)

        return jax.lax.scan(step, noise, per_step)

    return sample


# ----------------------------------------------------------------------------------------------------------------
# the torch side (optional): text encoder and VAE of a loaded diffusers pipeline
# ----------------------------------------------------------------------------------------------------------------


def encode_prompt_with_pipeline(pipeline: Any, prompts: Sequence[str], height: int, width: int,
                                max_sequence_length: int = 2048) -> tuple[np.ndarray, PackedLayout]:
    """Text features and layout from a loaded diffusers ``Ideogram4Pipeline`` (needs torch and diffusers).

    Returns:
        ``(text_features (B, max_sequence_length, llm_features_dim) float32, layout)``, ready for :func:`sample`.
    """
    import torch  # noqa: PLC0415 (the torch side is optional)

    grid_h, grid_w = grid_for(height, width)
    with torch.no_grad():
        prompt_embeds, position_ids, segment_ids, indicator = pipeline.encode_prompt(
            prompt=list(prompts), grid_h=grid_h, grid_w=grid_w, max_sequence_length=max_sequence_length,
            device=pipeline._execution_device)
    layout = PackedLayout(position_ids.cpu().numpy().astype(np.int32), segment_ids.cpu().numpy().astype(np.int32),
                          indicator.cpu().numpy().astype(np.int32), max_sequence_length, (grid_h, grid_w))
    features = prompt_embeds[:, :max_sequence_length].float().cpu().numpy()
    return features, layout


def decode_latents_with_pipeline(pipeline: Any, latents: np.ndarray, height: int, width: int) -> np.ndarray:
    """Decode ``latents (B, grid_h * grid_w, C)`` with the pipeline's VAE, as ``Ideogram4Pipeline.__call__`` does
    (batch-norm de-normalisation, un-patchify 2x2, VAE decode). Returns ``(B, height, width, 3)`` float in [0, 1]."""
    import torch  # noqa: PLC0415

    grid_h, grid_w = grid_for(height, width)
    vae = pipeline.vae
    z = torch.from_numpy(np.array(latents, np.float32)).to(pipeline._execution_device)  # a writable copy
    with torch.no_grad():
        bn_mean = vae.bn.running_mean.view(1, 1, -1).to(z)
        bn_std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1).to(z)
        z = z * bn_std + bn_mean
        patch = pipeline.patch_size
        channels = z.shape[-1] // (patch * patch)
        z = z.view(z.shape[0], grid_h, grid_w, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
        z = z.reshape(z.shape[0], channels, grid_h * patch, grid_w * patch)
        decoded = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        images = pipeline.image_processor.postprocess(decoded.float(), output_type="np")
    return np.asarray(images)
