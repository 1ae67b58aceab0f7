"""The block-transform interface: a parameterization is a pair of pure functions plus an initialiser (like optax).

A width-``d`` online transform ``T = blockdiag(K_1, ..., K_{d/n})`` is described by

* ``init(d, key=None) -> params``: a pytree (the trainable leaves; static metadata such as ``d`` lives in pytree
  dataclasses' static fields so stacked layers can be ``vmap``-ed);
* ``blocks(params) -> (d // n, n, n)``: the diagonal blocks ``K_j`` of ``T``;
* ``inverse_blocks(params) -> (d // n, n, n)``: the blocks ``K_j^{-1}`` of ``T^{-1}``.

and applied as ``A -> A T`` to activations (:func:`apply_to_activations`, on ``n``-wide slices of the last axis) and
``W -> W T^{-T}`` to weights (:func:`apply_to_weights`), so that ``(A T)(W T^{-T})^T = A W^T``.

The block size ``n`` is read from the blocks' shape: 32 for KroQuant and block Hadamard, 1 for diagonal scalings,
``d`` for the full-width Walsh-Hadamard transform.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

Params = Any

BLOCK = 32


class Parameterization(NamedTuple):
    """A transform family as pure functions (see the module docstring).

    Attributes:
      name: registry name.
      init: ``(d, key=None) -> params``.
      blocks: ``params -> (d // n, n, n)`` blocks of ``T``.
      inverse_blocks: ``params -> (d // n, n, n)`` blocks of ``T^{-1}``.
      trainable: whether the calibration engine optimises ``params`` (fixed transforms are only evaluated).
      num_params: ``d -> int`` number of free scalars (for reports and the paper's parameter-count claim).
    """

    name: str
    init: Callable[..., Params]
    blocks: Callable[[Params], jax.Array]
    inverse_blocks: Callable[[Params], jax.Array]
    trainable: bool
    num_params: Callable[[int], int]


@functools.partial(jax.tree_util.register_dataclass, data_fields=(), meta_fields=("d",))
@dataclasses.dataclass(frozen=True)
class WidthOnly:
    """Parameters of a fixed transform: no leaves, only the static width ``d``."""

    d: int


def check_width(d: int, block: int = BLOCK, what: str = "transform") -> None:
    """Raises a clear error unless ``d`` is a positive multiple of ``block``."""
    if not isinstance(d, (int, np.integer)) or d <= 0 or d % block:
        raise ValueError(f"{what}: {d=} must be a positive multiple of {block=}")


def apply_to_activations(x: jax.Array, blocks: jax.Array) -> jax.Array:
    """``x T`` for ``x (..., d)`` and ``blocks (d // n, n, n)``; computed in f32, returned in ``x.dtype``."""
    nb, n, _ = blocks.shape
    if x.shape[-1] != nb * n:
        raise ValueError(f"activations of shape {x.shape} do not match a transform of width {nb * n} "
                         f"({nb} blocks of {n})")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], nb, n)  # (..., nb, n)
    yb = jnp.einsum("...bi,bij->...bj", xb, blocks.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)  # (..., nb, n)
    return yb.reshape(x.shape).astype(x.dtype)


def apply_to_weights(w: jax.Array, inverse_blocks: jax.Array) -> jax.Array:
    """``W T^{-T}`` for ``W (o, d)`` (or ``(..., d)``) and ``inverse_blocks (d // n, n, n)`` (the blocks of ``T^{-1}``)."""
    nb, n, _ = inverse_blocks.shape
    if w.shape[-1] != nb * n:
        raise ValueError(f"weight of shape {w.shape} does not match a transform of width {nb * n} "
                         f"({nb} blocks of {n})")
    wb = w.astype(jnp.float32).reshape(*w.shape[:-1], nb, n)  # (o, nb, n)
    # (W T^{-T})[o, b, j] = sum_i W[o, b, i] * (K_b^{-1})^T[i, j] = sum_i W[o, b, i] * K_b^{-1}[j, i]
    yb = jnp.einsum("...bi,bji->...bj", wb, inverse_blocks.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)  # (o, nb, n)
    return yb.reshape(w.shape).astype(w.dtype)


def dense_matrix(blocks: jax.Array) -> jax.Array:
    """The dense ``(d, d)`` block-diagonal matrix of ``blocks (nb, n, n)`` (for tests and small d)."""
    return jax.scipy.linalg.block_diag(*blocks)


def normalized_hadamard(n: int) -> np.ndarray:
    """Sylvester-ordered ``H_n / sqrt(n)`` (n a power of two) as float64 numpy: ``kron`` of ``n.bit_length()-1`` copies
    of ``[[1, 1], [1, -1]] / sqrt(2)``."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size {n=} must be a power of two")
    h = np.ones((1, 1))
    h2 = np.array([[1.0, 1.0], [1.0, -1.0]]) / np.sqrt(2.0)
    for _ in range(n.bit_length() - 1):
        h = np.kron(h, h2)
    return h


def resolve_key(key: Optional[jax.Array]) -> jax.Array:
    return jax.random.key(0) if key is None else key
