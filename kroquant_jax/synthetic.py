"""Synthetic DiT-like linear layers: a benchmark where the expected ordering of methods can be checked.

What makes DiT activations hard for 4-bit block formats, and what this generator reproduces:

* **A few large-magnitude channels** (``num_outlier_channels`` channels scaled by ``outlier_scale``, with a non-zero
  mean as AdaLN's shift leaves them), on top of log-normal per-channel scales;
* **heavy-tailed tokens**: Student-t entries (``token_df`` degrees of freedom) times log-normal per-token scales, plus
  a few "massive" tokens;
* channels **correlated** through a shared low-rank component (so a learned transform has structure to exploit).

Weights have a **power-law spectrum** ``s_k ∝ (k + 1)^-spectrum_exponent`` (pretrained linear layers' singular values
decay smoothly, far from a random matrix's flat spectrum) and a few input columns of larger magnitude, scaled to a
standard deviation ``~ 1 / sqrt(d)`` like a trained layer.

Everything is numpy with a fixed seed: the same arguments give the same layers.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from kroquant_jax.layerset import LayerData

__all__ = ["SyntheticConfig", "synthetic_layer", "synthetic_layer_set", "pixart_sigma_shapes"]


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of :func:`synthetic_layer` (defaults give DiT-like statistics)."""

    num_outlier_channels: int = 4
    outlier_scale: float = 30.0
    channel_log_std: float = 0.5
    token_df: float = 4.0
    token_log_std: float = 0.4
    massive_token_fraction: float = 0.005
    massive_token_scale: float = 8.0
    shared_rank: int = 8
    shared_strength: float = 0.5
    spectrum_exponent: float = 0.6
    weight_outlier_columns: int = 4
    weight_outlier_scale: float = 3.0


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])


def synthetic_activations(rng: np.random.Generator, n: int, d: int, cfg: SyntheticConfig) -> np.ndarray:
    """``(n, d)`` float32 DiT-like activation rows."""
    z = rng.standard_t(cfg.token_df, size=(n, d)).astype(np.float32)
    if cfg.shared_rank:
        shared = rng.standard_normal((n, cfg.shared_rank)).astype(np.float32) @ rng.standard_normal(
            (cfg.shared_rank, d)).astype(np.float32) / np.sqrt(cfg.shared_rank)
        z = z + cfg.shared_strength * shared
    token_scale = np.exp(cfg.token_log_std * rng.standard_normal(n)).astype(np.float32)
    massive = rng.random(n) < cfg.massive_token_fraction
    token_scale[massive] *= cfg.massive_token_scale
    channel_scale = np.exp(cfg.channel_log_std * rng.standard_normal(d)).astype(np.float32)
    channel_shift = np.zeros(d, np.float32)
    outliers = rng.choice(d, size=min(cfg.num_outlier_channels, d), replace=False)
    channel_scale[outliers] *= cfg.outlier_scale
    channel_shift[outliers] = cfg.outlier_scale * rng.choice([-1.0, 1.0], size=outliers.size) * 0.5
    return (token_scale[:, None] * z * channel_scale[None, :] + channel_shift[None, :]).astype(np.float32)


def synthetic_weight(rng: np.random.Generator, o: int, d: int, cfg: SyntheticConfig) -> np.ndarray:
    """``(o, d)`` float32 weight with a power-law spectrum and a few larger input columns."""
    k = min(o, d)
    s = (np.arange(k) + 1.0) ** (-cfg.spectrum_exponent)
    left = rng.standard_normal((o, k)).astype(np.float32) / np.sqrt(o)
    right = rng.standard_normal((k, d)).astype(np.float32) / np.sqrt(d)
    w = (left * s[None, :].astype(np.float32)) @ right
    cols = rng.choice(d, size=min(cfg.weight_outlier_columns, d), replace=False)
    w[:, cols] *= cfg.weight_outlier_scale
    return (w / w.std() / np.sqrt(d)).astype(np.float32)


def synthetic_layer(name: str, o: int, d: int, n: int, seed: int = 0, cfg: SyntheticConfig = SyntheticConfig(),
                    bias: bool = True) -> LayerData:
    """One synthetic layer ``(W (o, d), bias (o,), A_rows (n, d))``; deterministic in ``(seed, name)``."""
    rng = _rng(seed, name)
    w = synthetic_weight(rng, o, d, cfg)
    a = synthetic_activations(rng, n, d, cfg)
    b = (0.02 * rng.standard_normal(o)).astype(np.float32) if bias else None
    return LayerData(w, b, a)


def pixart_sigma_shapes(num_blocks: int = 28, d: int = 1152, ffn: int = 4608, text_dim: int | None = None
                        ) -> dict[str, tuple[int, int]]:
    """``{name: (o, d_in)}`` of the 10 quantized linears per PixArt-Σ block (diffusers names): self-attention
    q, k, v, out; cross-attention q, k, v, out; feed-forward up (``d -> ffn``) and down (``ffn -> d``).

    The cross-attention k/v read the caption features *after* the model's caption projection (T5's 4096 -> ``d``,
    diffusers ``caption_projection``, ``cross_attention_dim = 1152``), so in the real model they are ``(d, d)`` too;
    ``text_dim`` overrides their input width (e.g. 4096 for a model without that projection)."""
    text_dim = d if text_dim is None else text_dim
    out = {}
    for b in range(num_blocks):
        p = f"transformer_blocks.{b}"
        for proj in ("to_q", "to_k", "to_v"):
            out[f"{p}.attn1.{proj}"] = (d, d)
        out[f"{p}.attn1.to_out.0"] = (d, d)
        out[f"{p}.attn2.to_q"] = (d, d)
        out[f"{p}.attn2.to_k"] = (d, text_dim)
        out[f"{p}.attn2.to_v"] = (d, text_dim)
        out[f"{p}.attn2.to_out.0"] = (d, d)
        out[f"{p}.ff.net.0.proj"] = (ffn, d)
        out[f"{p}.ff.net.2"] = (d, ffn)
    return out


def synthetic_layer_set(shapes: dict[str, tuple[int, int]], n: int = 1280, seed: int = 0,
                        cfg: SyntheticConfig = SyntheticConfig()) -> dict[str, LayerData]:
    """``{name: synthetic_layer(name, o, d, n, seed)}`` for ``shapes = {name: (o, d)}``."""
    return {name: synthetic_layer(name, o, d, n, seed, cfg) for name, (o, d) in shapes.items()}
