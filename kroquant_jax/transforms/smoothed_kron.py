"""Smoothed KroQuant: ``T = diag(1/γ) · blockdiag(K_j)`` with Kronecker-LU ``K_j`` and learned ``log γ``.

A diagonal times a block-diagonal is block-diagonal: block ``j`` is ``diag(1/γ_j) K_j`` (rows of ``K_j`` scaled), so
it runs in the K1 kernel at no extra online cost. ``T^{-1}`` has blocks ``K_j^{-1} diag(γ_j)``.
Initialised as (γ = 1, Hadamard), or with γ from a SmoothQuant search via :func:`init_from_scales`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kroquant_jax.transforms import kron_lu
from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    check_width(d, BLOCK, "smoothed_kron")
    return {"kron": kron_lu.init(d), "log_gamma": jnp.zeros((d,), jnp.float32)}


def init_from_scales(gamma: jax.Array) -> dict:
    """Hadamard Kronecker factors with the smoothing factors ``γ (d,)`` of a SmoothQuant search."""
    gamma = jnp.asarray(gamma, jnp.float32)
    return {"kron": kron_lu.init(gamma.shape[-1]), "log_gamma": jnp.log(gamma)}


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
