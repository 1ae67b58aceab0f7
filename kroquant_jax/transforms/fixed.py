"""Fixed (not trained) transforms: identity, block Hadamard-32, full-width Walsh-Hadamard."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kroquant_jax.transforms.base import BLOCK, Parameterization, WidthOnly, check_width, normalized_hadamard


def _identity_init(d: int, key: Optional[jax.Array] = None) -> WidthOnly:
    check_width(d, 1, "identity")
    return WidthOnly(d)


def _ones(params: WidthOnly) -> jax.Array:
    return jnp.ones((params.d, 1, 1), jnp.float32)  # d blocks of size 1


IDENTITY = Parameterization(name="identity", init=_identity_init, blocks=_ones, inverse_blocks=_ones,
                            trainable=False, num_params=lambda d: 0)


def _hadamard32_init(d: int, key: Optional[jax.Array] = None) -> WidthOnly:
    check_width(d, BLOCK, "hadamard32")
    return WidthOnly(d)


def _hadamard32_blocks(params: WidthOnly) -> jax.Array:
    h = jnp.asarray(normalized_hadamard(BLOCK), jnp.float32)  # (32, 32), symmetric and orthogonal
    return jnp.broadcast_to(h, (params.d // BLOCK, BLOCK, BLOCK))


HADAMARD32 = Parameterization(name="hadamard32", init=_hadamard32_init, blocks=_hadamard32_blocks,
                              inverse_blocks=_hadamard32_blocks, trainable=False, num_params=lambda d: 0)


def _fwht_init(d: int, key: Optional[jax.Array] = None) -> WidthOnly:
    if d <= 0 or d & (d - 1):
        raise ValueError(f"full-width Walsh-Hadamard needs d a power of two, got {d=} (pad the layer or use "
                         "'hadamard32', which needs only d % 32 == 0)")
    return WidthOnly(d)


def _fwht_blocks(params: WidthOnly) -> jax.Array:
    """One dense ``(1, d, d)`` block (reference only; the GPU kernel applies the fast transform)."""
    return jnp.asarray(normalized_hadamard(params.d), jnp.float32)[None]


FWHT = Parameterization(name="fwht", init=_fwht_init, blocks=_fwht_blocks, inverse_blocks=_fwht_blocks,
                        trainable=False, num_params=lambda d: 0)
