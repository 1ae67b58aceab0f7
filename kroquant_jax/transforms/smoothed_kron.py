"""Smoothed KroQuant: ``T = diag(1/γ) · blockdiag(K_j)`` with Kronecker-LU ``K_j`` and learned ``log γ``.

A diagonal times a block-diagonal is block-diagonal: block ``j`` is ``diag(1/γ_j) K_j`` (rows of ``K_j`` scaled), so
it runs in the K1 kernel at no extra online cost. ``T^{-1}`` has blocks ``K_j^{-1} diag(γ_j)``.
Initialised as (γ = 1, Hadamard), or with γ from a SmoothQuant search via :func:`init_from_scales`; :data:`STARTS`
names the initial transforms a recipe can start from (:func:`start`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.transforms import kron_lu
from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    check_width(d, BLOCK, "smoothed_kron")
    return {"kron": kron_lu.init(d), "log_gamma": jnp.zeros((d,), jnp.float32)}


def init_from_scales(gamma: jax.Array, rotation: str = "hadamard") -> dict:
    """The smoothing factors ``γ (d,)`` of a SmoothQuant search with Hadamard Kronecker factors
    (``rotation="hadamard"``) or none (``"none"``: blocks ``diag(±1)``, :func:`kron_lu.sign_diagonal_init`, so the
    transform quantizes exactly as SmoothQuant's ``diag(1/γ)``)."""
    gamma = jnp.asarray(gamma, jnp.float32)
    if gamma.ndim != 1:
        raise ValueError(f"smoothing factors gamma must have shape (d,), got {gamma.shape}")
    d = gamma.shape[-1]
    if rotation == "hadamard":
        kron = kron_lu.init(d)
    elif rotation == "none":
        kron = kron_lu.sign_diagonal_init(d)
    else:
        raise ValueError(f"{rotation=} must be 'hadamard' or 'none'")
    return {"kron": kron, "log_gamma": jnp.log(gamma)}


#: The named initial transforms of smoothed KroQuant (``Recipe.starts``): what each start is.
STARTS = {
    "hadamard": "γ = 1 and Hadamard blocks (KroQuant's own start)",
    "smoothquant_hadamard": "the SmoothQuant search's γ and Hadamard blocks",
    "smoothquant": "the SmoothQuant search's γ and no rotation (blocks diag(±1)): the SmoothQuant transform itself",
}


def start(name: str, d: int, gamma: Optional[jax.Array] = None) -> dict:
    """The parameters of the start ``name`` (a key of :data:`STARTS`) for width ``d``; the SmoothQuant starts need
    the search's ``gamma (d,)``."""
    if name not in STARTS:
        raise ValueError(f"unknown smoothed_kron start {name!r}; known: {list(STARTS)}")
    if name == "hadamard":
        return init(d)
    if gamma is None:
        raise ValueError(f"smoothed_kron start {name!r} needs the SmoothQuant search's gamma")
    if np.shape(gamma) != (d,):
        raise ValueError(f"smoothed_kron start {name!r}: gamma has shape {np.shape(gamma)}, expected ({d},)")
    return init_from_scales(gamma, rotation="hadamard" if name == "smoothquant_hadamard" else "none")


def blocks(params: dict) -> jax.Array:
    k = kron_lu.blocks(params["kron"])  # (nb, 32, 32)
    inv_gamma = jnp.exp(-params["log_gamma"]).reshape(k.shape[0], BLOCK)  # (nb, 32)
    return inv_gamma[:, :, None] * k


def inverse_blocks(params: dict) -> jax.Array:
    k_inv = kron_lu.inverse_blocks(params["kron"])  # (nb, 32, 32)
    gamma = jnp.exp(params["log_gamma"]).reshape(k_inv.shape[0], BLOCK)  # (nb, 32)
    return k_inv * gamma[:, None, :]


SMOOTHED_KRON = Parameterization(
    name="smoothed_kron", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
    num_params=lambda d: 3 * kron_lu.NUM_FACTORS * (d // BLOCK) + d)
