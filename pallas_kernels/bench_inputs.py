"""Inputs and jitted callables shared by the transform + quantize benchmarks (``benchmarks/transform_quantize_*``).

* :func:`activation_sets`: ``n_buf`` random ``(m, d)`` activation buffers with outlier channels (rotated through by
  the timers, :data:`L2_BYTES` sizing how many keep the working set out of the L2 cache).
* :func:`prepared_transforms`: one :class:`~pallas_kernels.transform_quantize.PreparedTransform` per kernel kind
  (``q4``, ``scale``, ``k1``, ``k2``, and ``fwht`` for a power-of-two ``d``), a random KroQuant transform near the
  Hadamard init.
* :func:`quantize_fn` (the Triton kernel), :func:`copy_fn` (XLA's elementwise copy of the same bytes: the bandwidth
  yardstick).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kroquant_jax import transforms
from kroquant_jax.formats import MXFP4
from pallas_kernels import transform_quantize as tq

__all__ = ["L2_BYTES", "activation_sets", "copy_fn", "prepared_transforms", "quantize_fn"]

#: The H200's L2 cache (60 MiB): rotate through at least 4x this many input bytes.
L2_BYTES = 60 * 2**20


def activation_sets(m: int, d: int, dtype, n_buf: int, seed: int = 0) -> list[jax.Array]:
    """``n_buf`` buffers ``(m, d)`` of normal data with 2% of the channels scaled by 30 (outlier channels)."""
    key = jax.random.key(seed)
    bufs = []
    for _ in range(n_buf):
        k1, k2, key = jax.random.split(key, 3)
        x = jax.random.normal(k1, (m, d), jnp.float32)
        x = x * jnp.where(jax.random.bernoulli(k2, 0.02, (1, d)), 30.0, 1.0)
        bufs.append(x.astype(dtype))
    jax.block_until_ready(bufs)
    return bufs


def prepared_transforms(d: int, key: jax.Array | None = None) -> dict[str, tq.PreparedTransform]:
    """``{kind: PreparedTransform}`` of ``d`` channels for every kernel kind (``fwht`` only for a power of two)."""
    key = jax.random.key(1) if key is None else key
    params = jax.tree.map(lambda x: x * (1 + 0.2 * jax.random.normal(key, x.shape)),
                          transforms.get("kron_lu").init(d))
    out = {
        "q4": tq.PreparedTransform.identity(d),
        "scale": tq.prepare("diagonal", {"log_gamma": 0.5 * jax.random.normal(key, (d,))}),
        "k1": tq.prepare("kron_lu", params, kernel="k1"),
        "k2": tq.prepare("kron_lu", params),
    }
    if d & (d - 1) == 0:
        out["fwht"] = tq.PreparedTransform.fwht(d)
    return out


def quantize_fn(t: tq.PreparedTransform, block_sizes: tq.BlockSizes | None, fmt=MXFP4()):
    """Jitted ``a -> (codes, scales)`` of the Triton transform + quantize kernel (``impl="pallas"``)."""
    @jax.jit
    def f(a):
        q = tq.transform_quantize(a, t, fmt, block_sizes=block_sizes, impl="pallas")
        return q.codes, q.scales
    return f


def copy_fn():
    """Jitted ``a -> a`` with the sign bit flipped: one read and one write of the same bytes (XLA's copy)."""
    @jax.jit
    def f(a):
        bits = jax.lax.bitcast_convert_type(a, jnp.uint16)
        return jax.lax.bitcast_convert_type(bits ^ jnp.uint16(0x8000), a.dtype)
    return f
