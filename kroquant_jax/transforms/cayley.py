"""Orthogonal 32x32 blocks through the Cayley map: ``K = H_32 (I - S)^{-1} (I + S)`` with ``S = U - U^T`` skew.

``U`` is the strictly upper-triangular part of the stored ``(32, 32)`` parameter (496 free scalars per block);
``S = 0`` at initialisation, so ``K = H_32 / √32``. ``K^{-1} = K^T``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width, normalized_hadamard


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    check_width(d, BLOCK, "cayley32")
    return {"upper": jnp.zeros((d // BLOCK, BLOCK, BLOCK), jnp.float32)}


def blocks(params: dict) -> jax.Array:
    u = jnp.triu(params["upper"], k=1)  # (nb, 32, 32)
    s = u - jnp.swapaxes(u, -1, -2)  # (nb, 32, 32) skew-symmetric
    eye = jnp.eye(BLOCK, dtype=jnp.float32)
    q = jnp.linalg.solve(eye - s, eye + s)  # (nb, 32, 32) orthogonal
    h = jnp.asarray(normalized_hadamard(BLOCK), jnp.float32)
    return jnp.einsum("ij,bjk->bik", h, q, precision=jax.lax.Precision.HIGHEST)  # (nb, 32, 32)


def inverse_blocks(params: dict) -> jax.Array:
    return jnp.swapaxes(blocks(params), -1, -2)


CAYLEY32 = Parameterization(name="cayley32", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
                            num_params=lambda d: (BLOCK * (BLOCK - 1) // 2) * (d // BLOCK))
