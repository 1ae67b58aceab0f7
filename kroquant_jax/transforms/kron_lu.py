"""KroQuant's Kronecker-LU parameterization (paper §3.2; docs/formats_and_transforms.md, "Block-transform
parameterizations").

Each 32x32 block is ``K = G_1 ⊗ G_2 ⊗ G_3 ⊗ G_4 ⊗ G_5`` (numpy ``kron`` order: ``G_1`` acts on the most significant
bit of the 5-bit index, ``K[r, c] = prod_k G_k[bit_{5-k}(r), bit_{5-k}(c)]``) with unit-|det| LU factors

    G_k = [[1, 0], [c_k, 1]] @ [[a_k, b_k], [0, -1/a_k]] = [[a, b], [c a, c b - 1/a]],   det G_k = -1,
    G_k^{-1} = [[1/a - c b, b], [c a, -a]].

3 scalars per factor, 15 per block, ``15 d / 32`` per layer. ``(a, b, c) = (1/√2, 1/√2, 1)`` gives
``G_k = [[cos π/4, sin π/4], [sin π/4, -cos π/4]]`` and ``K = H_32 / √32``: the initialisation is the normalised block
Hadamard transform.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width

NUM_FACTORS = 5  # log2(32)


def lu_factors(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """2x2 factors ``G (..., 2, 2)`` from ``a, b, c (...)``."""
    row0 = jnp.stack([a, b], axis=-1)  # (..., 2)
    row1 = jnp.stack([c * a, c * b - 1.0 / a], axis=-1)  # (..., 2)
    return jnp.stack([row0, row1], axis=-2)  # (..., 2, 2)


def lu_factors_inverse(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """Closed-form inverses ``G^{-1} (..., 2, 2)`` (det G = -1)."""
    row0 = jnp.stack([1.0 / a - c * b, b], axis=-1)  # (..., 2)
    row1 = jnp.stack([c * a, -a], axis=-1)  # (..., 2)
    return jnp.stack([row0, row1], axis=-2)  # (..., 2, 2)


def kron_chain(factors: jax.Array) -> jax.Array:
    """``factors (..., k, 2, 2)`` -> ``(..., 2**k, 2**k)`` = ``factors[0] ⊗ ... ⊗ factors[k-1]`` (numpy order)."""
    out = factors[..., 0, :, :]  # (..., 2, 2)
    for i in range(1, factors.shape[-3]):
        g = factors[..., i, :, :]  # (..., 2, 2)
        n = out.shape[-1]
        # An outer product; explicit HIGHEST: at the default precision an f32 dot may run as TF32 on NVIDIA GPUs.
        out = jnp.einsum("...ij,...kl->...ikjl", out, g,
                         precision=jax.lax.Precision.HIGHEST).reshape(*out.shape[:-2], 2 * n, 2 * n)
    return out


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    """Hadamard initialisation: ``a = b = 1/√2``, ``c = 1`` for every factor of every block (``key`` unused)."""
    check_width(d, BLOCK, "kron_lu")
    nb = d // BLOCK
    s = np.float32(1.0 / np.sqrt(2.0))
    return {
        "a": jnp.full((nb, NUM_FACTORS), s, jnp.float32),
        "b": jnp.full((nb, NUM_FACTORS), s, jnp.float32),
        "c": jnp.ones((nb, NUM_FACTORS), jnp.float32),
    }


def sign_diagonal_init(d: int) -> dict:
    """The non-rotating start: ``a = 1, b = c = 0`` gives ``G_k = diag(1, -1)`` and blocks ``K_j = diag(±1)``.

    MXFP4 / NVFP4 quantization is sign-symmetric (``Q(-x) = -Q(x)``) and the weight side ``W K^{-T}`` flips the same
    columns, so this transform quantizes exactly as the identity does (``det G_k = -1`` rules out the identity
    itself). Training from here refines an unrotated layer instead of a Hadamard-rotated one."""
    check_width(d, BLOCK, "kron_lu")
    nb = d // BLOCK
    return {"a": jnp.ones((nb, NUM_FACTORS), jnp.float32), "b": jnp.zeros((nb, NUM_FACTORS), jnp.float32),
            "c": jnp.zeros((nb, NUM_FACTORS), jnp.float32)}


def blocks(params: dict) -> jax.Array:
    """``(d/32, 32, 32)`` blocks ``K_j``."""
    return kron_chain(lu_factors(params["a"], params["b"], params["c"]))


def inverse_blocks(params: dict) -> jax.Array:
    """``(d/32, 32, 32)`` blocks ``K_j^{-1} = G_1^{-1} ⊗ ... ⊗ G_5^{-1}``."""
    return kron_chain(lu_factors_inverse(params["a"], params["b"], params["c"]))


KRON_LU = Parameterization(
    name="kron_lu", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
    num_params=lambda d: 3 * NUM_FACTORS * (d // BLOCK))
