"""Per-channel diagonal scaling (SmoothQuant): ``T = diag(1/γ)``, ``A -> A diag(γ)^{-1}``, ``W -> W diag(γ)``.

Parameters are ``log γ (d,)`` so that γ stays positive under gradient descent; :func:`from_scales` builds them from
a SmoothQuant search.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kroquant_jax.transforms.base import Parameterization, check_width


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    check_width(d, 1, "diagonal")
    return {"log_gamma": jnp.zeros((d,), jnp.float32)}


def from_scales(gamma: jax.Array) -> dict:
    """Parameters from positive smoothing factors ``γ (d,)``."""
    return {"log_gamma": jnp.log(jnp.asarray(gamma, jnp.float32))}


def blocks(params: dict) -> jax.Array:
    return jnp.exp(-params["log_gamma"])[:, None, None]  # (d, 1, 1)


def inverse_blocks(params: dict) -> jax.Array:
    return jnp.exp(params["log_gamma"])[:, None, None]  # (d, 1, 1)


DIAGONAL = Parameterization(name="diagonal", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
                            num_params=lambda d: d)
