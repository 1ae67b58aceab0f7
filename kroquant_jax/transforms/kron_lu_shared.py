"""Kronecker-LU with one set of five factors shared by every block of a layer (15 scalars per layer).

An example of a new parameterization in one small file: it reuses ``kron_lu``'s factor maps.
"""

from __future__ import annotations

from typing import Optional

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kroquant_jax.transforms import kron_lu
from kroquant_jax.transforms.base import BLOCK, Parameterization, check_width


@functools.partial(jax.tree_util.register_dataclass, data_fields=("a", "b", "c"), meta_fields=("d",))
@dataclasses.dataclass(frozen=True)
class SharedKronParams:
    a: jax.Array  # (5,)
    b: jax.Array  # (5,)
    c: jax.Array  # (5,)
    d: int


def init(d: int, key: Optional[jax.Array] = None) -> SharedKronParams:
    check_width(d, BLOCK, "kron_lu_shared")
    p = kron_lu.init(BLOCK)
    return SharedKronParams(a=p["a"][0], b=p["b"][0], c=p["c"][0], d=d)


def _tile(block: jax.Array, d: int) -> jax.Array:
    return jnp.broadcast_to(block, (d // BLOCK, BLOCK, BLOCK))


def blocks(params: SharedKronParams) -> jax.Array:
    return _tile(kron_lu.kron_chain(kron_lu.lu_factors(params.a, params.b, params.c)), params.d)


def inverse_blocks(params: SharedKronParams) -> jax.Array:
    return _tile(kron_lu.kron_chain(kron_lu.lu_factors_inverse(params.a, params.b, params.c)), params.d)


KRON_LU_SHARED = Parameterization(
    name="kron_lu_shared", init=init, blocks=blocks, inverse_blocks=inverse_blocks, trainable=True,
    num_params=lambda d: 3 * kron_lu.NUM_FACTORS)
