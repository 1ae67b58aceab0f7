"""Dense learned GL(32) blocks (1024 scalars per block), initialised as the normalised Hadamard-32."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width, normalized_hadamard


def init(d: int, key: Optional[jax.Array] = None) -> dict:
    check_width(d, BLOCK, "dense32")
    h = jnp.asarray(normalized_hadamard(BLOCK), jnp.float32)
    return {"blocks": jnp.broadcast_to(h, (d // BLOCK, BLOCK, BLOCK))}


def blocks(params: dict) -> jax.Array:
    return params["blocks"]


def inverse_blocks(params: dict) -> jax.Array:
    return jnp.linalg.inv(params["blocks"])


DENSE32 = Parameterization(name="dense32", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
                           num_params=lambda d: BLOCK * BLOCK * (d // BLOCK))
