"""The emoji testbed DiT: a small pixel-space PixArt-Σ, its flow-matching objective and its Euler sampler.

Model: diffusers ``PixArtTransformer2DModel`` config family (the Flax port in ``models.pixart``), pixel space
(in/out channels 3, no VAE), 32x32 RGB, patch 2 (256 tokens), hidden 256 = 4 heads x 64, 10 blocks, captions from
all-MiniLM-L6-v2 token states (caption_channels 384, projected to 256). About 11.2M parameters, 22.5 MB in fp16.

Objective (rectified flow, the convention of diffusers' ``FlowMatchEulerDiscreteScheduler``):

- pixels ``x0`` in [-1, 1] (``images_to_pixels``), Gaussian noise ``eps``, noise level ``sigma`` in (0, 1) drawn
  logit-normal (``sigma = sigmoid(n)``, ``n ~ N(0, 1)``, as SD3);
- ``x_sigma = (1 - sigma) x0 + sigma eps``; the model gets timestep ``1000 sigma`` and predicts the velocity
  ``v = eps - x0``; loss = mean squared error on ``v``;
- classifier-free guidance dropout: with probability 0.1 the caption is replaced by the encoding of the empty caption
  "" (with its attention mask), which is what a diffusers pipeline feeds as the negative prompt.

Sampler (``euler_sample``): ``sigma`` from 1 to 0 on a uniform grid of ``num_steps`` steps,
``x <- x + (sigma_next - sigma) v_cfg`` with ``v_cfg = v_uncond + guidance (v_cond - v_uncond)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.fileio import atomic_path
from models.pixart import PixArtConfig

#: The shipped testbed model (checkpoints/emoji_pixart/config.json holds the same values).
TESTBED_PIXART_CONFIG = PixArtConfig(
    num_attention_heads=4, attention_head_dim=64, in_channels=3, out_channels=3, num_layers=10,
    cross_attention_dim=256, attention_bias=True, sample_size=32, patch_size=2, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    interpolation_scale=1, use_additional_conditions=False, caption_channels=384, attention_type="default")

TIMESTEP_SCALE = 1000.0  # model timestep = 1000 * sigma (diffusers' flow-matching convention)

VelocityFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class FlowMatchingConfig:
    """The training objective's settings (see the module docstring)."""

    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0
    caption_dropout: float = 0.1

    def __post_init__(self):
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"{self.caption_dropout=} must be in [0, 1)")
        if self.logit_normal_std <= 0:
            raise ValueError(f"{self.logit_normal_std=} must be > 0")


def images_to_pixels(images: jax.Array) -> jax.Array:
    """uint8 RGB (b, s, s, 3) -> float32 NCHW (b, 3, s, s) in [-1, 1]."""
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be (batch, height, width, 3), got shape {images.shape}")
    pixels = images.astype(jnp.float32) / 127.5 - 1.0  # (b, s, s, 3)
    return pixels.transpose(0, 3, 1, 2)  # (b, 3, s, s)


def pixels_to_images(pixels: np.ndarray | jax.Array) -> np.ndarray:
    """float NCHW (b, 3, s, s) in [-1, 1] -> uint8 RGB (b, s, s, 3) (clipped)."""
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise ValueError(f"pixels must be (batch, 3, height, width), got shape {pixels.shape}")
    images = np.clip((pixels.transpose(0, 2, 3, 1) + 1.0) * 127.5, 0.0, 255.0)  # (b, s, s, 3)
    return np.round(images).astype(np.uint8)


def sample_sigmas(key: jax.Array, batch: int, config: FlowMatchingConfig) -> jax.Array:
    """Logit-normal noise levels (b,) in (0, 1)."""
    normal = jax.random.normal(key, (batch,), jnp.float32)  # (b,)
    return jax.nn.sigmoid(config.logit_normal_mean + config.logit_normal_std * normal)  # (b,)


def drop_captions(key: jax.Array, context: jax.Array, mask: jax.Array, null_context: jax.Array,
                  null_mask: jax.Array, probability: float) -> tuple[jax.Array, jax.Array]:
    """CFG dropout: each caption (b, t, c) / mask (b, t) is replaced by the empty caption with ``probability``."""
    drop = jax.random.uniform(key, (context.shape[0],)) < probability  # (b,)
    context = jnp.where(drop[:, None, None], null_context[None].astype(context.dtype), context)  # (b, t, c)
    mask = jnp.where(drop[:, None], null_mask[None].astype(mask.dtype), mask)  # (b, t)
    return context, mask


def flow_matching_loss(velocity_fn: VelocityFn, pixels: jax.Array, context: jax.Array, mask: jax.Array,
                       key: jax.Array, config: FlowMatchingConfig, null_context: jax.Array,
                       null_mask: jax.Array, sigma: jax.Array | None = None) -> jax.Array:
    """Rectified-flow velocity MSE on a batch.

    Args:
        velocity_fn: ``(x (b, 3, s, s), timestep (b,) in [0, 1000], context (b, t, c), mask (b, t)) -> (b, 3, s, s)``.
        pixels: clean images (b, 3, s, s) in [-1, 1]. context, mask: caption tokens (b, t, c) and keep-mask (b, t).
        key: PRNG key (noise, sigma and caption dropout). null_context (t, c), null_mask (t,): the empty caption.
        sigma: noise levels (b,) in (0, 1) to use instead of the logit-normal draw of ``config`` (None: the draw).
    Returns:
        the scalar loss (float32).
    """
    b = pixels.shape[0]
    key_sigma, key_noise, key_drop = jax.random.split(key, 3)
    if sigma is None:
        sigma = sample_sigmas(key_sigma, b, config)  # (b,)
    elif sigma.shape != (b,):
        raise ValueError(f"flow_matching_loss: sigma has shape {sigma.shape}, expected ({b},)")
    noise = jax.random.normal(key_noise, pixels.shape, jnp.float32)  # (b, 3, s, s)
    context, mask = drop_captions(key_drop, context, mask, null_context, null_mask, config.caption_dropout)
    s = sigma[:, None, None, None]  # (b, 1, 1, 1)
    noisy = (1.0 - s) * pixels + s * noise  # (b, 3, s, s)
    target = noise - pixels  # (b, 3, s, s)
    predicted = velocity_fn(noisy, sigma * TIMESTEP_SCALE, context, mask).astype(jnp.float32)  # (b, 3, s, s)
    return jnp.mean(jnp.square(predicted - target))


def euler_sample(velocity_fn: VelocityFn, noise: jax.Array, context: jax.Array, mask: jax.Array,
                 null_context: jax.Array, null_mask: jax.Array, num_steps: int, guidance: float) -> jax.Array:
    """Flow-matching Euler sampling with classifier-free guidance (both branches in one batch).

    Args:
        velocity_fn: as in :func:`flow_matching_loss`.
        noise: the start (b, 3, s, s) at sigma = 1. context (b, t, c), mask (b, t): the captions.
        null_context (t, c), null_mask (t,): the empty caption. guidance: 1.0 runs the conditional branch alone.
    Returns:
        pixels (b, 3, s, s), float32, not clipped.
    """
    if num_steps < 1:
        raise ValueError(f"{num_steps=} must be >= 1")
    b = noise.shape[0]
    sigmas = jnp.linspace(1.0, 0.0, num_steps + 1, dtype=jnp.float32)  # (steps + 1,)
    use_cfg = guidance != 1.0
    if use_cfg:
        both_context = jnp.concatenate([context, jnp.broadcast_to(null_context, context.shape)], 0)  # (2b, t, c)
        both_mask = jnp.concatenate([mask, jnp.broadcast_to(null_mask, mask.shape).astype(mask.dtype)], 0)  # (2b, t)

    def step(x, index):
        sigma, sigma_next = sigmas[index], sigmas[index + 1]
        if use_cfg:
            timestep = jnp.full((2 * b,), sigma * TIMESTEP_SCALE)  # (2b,)
            velocity = velocity_fn(jnp.concatenate([x, x], 0), timestep, both_context, both_mask)  # (2b, 3, s, s)
            conditional, unconditional = jnp.split(velocity.astype(jnp.float32), 2, axis=0)  # (b, 3, s, s) x2
            velocity = unconditional + guidance * (conditional - unconditional)  # (b, 3, s, s)
        else:
            timestep = jnp.full((b,), sigma * TIMESTEP_SCALE)  # (b,)
            velocity = velocity_fn(x, timestep, context, mask).astype(jnp.float32)  # (b, 3, s, s)
        return x + (sigma_next - sigma) * velocity, None  # (b, 3, s, s)

    pixels, _ = jax.lax.scan(step, noise.astype(jnp.float32), jnp.arange(num_steps))
    return pixels


def pixart_velocity_fn(model: Any) -> VelocityFn:
    """The velocity function of a ``models.pixart.PixArtTransformer2DModel`` (mask passed as keep-mask)."""

    def velocity(x, timestep, context, mask):
        return model(x, context, timestep, encoder_attention_mask=mask)  # (b, 3, s, s)

    return velocity


def init_for_training(params: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """DiT/PixArt training initialisation of a flat ``{dotted path: array}`` PixArt state.

    Linear and patch kernels Xavier-uniform, biases zero, timestep MLP and ``adaln_single.linear`` N(0, 0.02),
    cross-attention output and ``proj_out`` zero (PixArt's init), ``scale_shift_table`` kept (randn / sqrt(dim)).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for key, value in params.items():
        value = np.asarray(value)
        if key.endswith("scale_shift_table"):
            out[key] = value
        elif key.endswith(".bias"):
            out[key] = np.zeros_like(value)
        elif key.endswith(".kernel"):
            if key.startswith("proj_out") or ".attn2.to_out" in key:
                out[key] = np.zeros_like(value)
            elif key.startswith("adaln_single"):
                out[key] = (0.02 * rng.standard_normal(value.shape)).astype(value.dtype)
            else:
                fan_in = int(np.prod(value.shape[:-1]))
                fan_out = int(value.shape[-1])
                bound = math.sqrt(6.0 / (fan_in + fan_out))
                out[key] = rng.uniform(-bound, bound, value.shape).astype(value.dtype)
        else:
            raise KeyError(f"init_for_training: no rule for parameter {key!r} of shape {value.shape}")
    return out


def image_grid(images: np.ndarray, columns: int, scale: int = 1, pad: int = 2) -> np.ndarray:
    """(n, s, s, 3) uint8 -> one (rows (s scale + pad) + pad, ...) uint8 grid on white, nearest-neighbour upscaled."""
    n, s, _, _ = images.shape
    rows = math.ceil(n / columns)
    big = np.repeat(np.repeat(images, scale, axis=1), scale, axis=2)  # (n, s scale, s scale, 3)
    cell = s * scale + pad
    grid = np.full((rows * cell + pad, columns * cell + pad, 3), 255, np.uint8)
    for index in range(n):
        row, column = divmod(index, columns)
        grid[pad + row * cell: pad + row * cell + s * scale, pad + column * cell: pad + column * cell + s * scale] = \
            big[index]
    return grid


def save_caption_grid(path: str, captions: list[str], rows: list[list[np.ndarray]], column_titles: list[str],
                      title: str = "") -> None:
    """A PNG with one row per caption: the caption text, then the row's images (each (s, s, 3) uint8).

    Written atomically (temporary file in the same folder, then rename). Needs matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(captions) != len(rows) or any(len(row) != len(column_titles) for row in rows):
        raise ValueError(f"{len(captions)} captions, {len(rows)} rows, {len(column_titles)} column titles: "
                         "every row needs one image per column title")
    num_rows, num_columns = len(rows), len(column_titles)
    figure, axes = plt.subplots(num_rows, num_columns + 1, figsize=(1.1 * num_columns + 3.2, 1.1 * num_rows + 0.4),
                                gridspec_kw={"width_ratios": [3.0] + [1.0] * num_columns}, squeeze=False)
    for row_index, (caption, row) in enumerate(zip(captions, rows)):
        text_axis = axes[row_index, 0]
        text_axis.axis("off")
        text_axis.text(1.0, 0.5, caption, ha="right", va="center", fontsize=8, wrap=True,
                       transform=text_axis.transAxes)
        for column_index, image in enumerate(row):
            axis = axes[row_index, column_index + 1]
            axis.imshow(image, interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
            if row_index == 0:
                # Long method names ("smoothed_kroquant+loraq") would run into their neighbours: break at '+'.
                axis.set_title(column_titles[column_index].replace("+", "\n+"), fontsize=7)
    if title:
        figure.suptitle(title, fontsize=9)
        figure.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.3 / figure.get_figheight()))  # room for the title
    else:
        figure.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as temporary:
            figure.savefig(temporary, dpi=110)
    finally:
        plt.close(figure)
