"""Exactly representable test cases shared by the CPU (interpret) and GPU tests of the fused quantizer kernels."""

import jax
import jax.numpy as jnp

from pallas_kernels import transform_quantize as tq


def exact_activations(key, m, d, dtype):
    """``±k * 2**-2``, k in 1..31, 1% outliers x4: every transform below is exact in f32 (any summation order)."""
    k1, k2, k3 = jax.random.split(key, 3)
    mag = jax.random.randint(k1, (m, d), 1, 32).astype(jnp.float32) * 0.25
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, (m, d)), 1.0, -1.0)
    return (mag * sign * jnp.where(jax.random.bernoulli(k3, 0.01, (m, d)), 4.0, 1.0)).astype(dtype)


def exact_transform(kind, d, key):
    ks = jax.random.split(key, 4)
    nb = d // 32
    if kind == "q4":
        return tq.PreparedTransform.identity(d)
    if kind == "scale":
        return tq.PreparedTransform.from_inv_scale(2.0 ** jax.random.randint(ks[0], (d,), -2, 3).astype(jnp.float32))
    if kind == "k1":
        vals = jnp.array([0.0, 0.25, -0.25, 0.5, -0.5, 1.0, -1.0], jnp.float32)
        return tq.PreparedTransform.from_blocks(vals[jax.random.randint(ks[0], (nb, 32, 32), 0, 7)])
    if kind in ("k2", "k2s"):
        a = jnp.where(jax.random.bernoulli(ks[0], 0.5, (nb, 5)), 1.0, -1.0)
        b = jnp.array([0.0, 0.5, -0.5])[jax.random.randint(ks[1], (nb, 5), 0, 3)]
        c = jnp.array([0.0, 1.0, -1.0])[jax.random.randint(ks[2], (nb, 5), 0, 3)]
        inv = 2.0 ** jax.random.randint(ks[3], (d,), -1, 2).astype(jnp.float32) if kind == "k2s" else None
        return tq.PreparedTransform.from_kron_params({"a": a, "b": b, "c": c}, inv)
    if kind == "fwht":
        return tq.PreparedTransform.fwht(d)
    raise ValueError(kind)
