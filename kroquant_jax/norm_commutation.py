"""Paper appendix C (Table 5): which normalisations commute with a rotation, ``Norm(X R) R^T == Norm(X)``?

Only a normalisation that commutes lets a transform be folded into the previous layer offline; in a DiT the
AdaLN variants between blocks do not, so KroQuant's transform runs online. :func:`deviations` returns
``max |Norm(X R) R^T - Norm(X)|`` for each normalisation with a random orthogonal ``R (d, d)`` and ``X (n, d)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def rms_norm(x, gamma=None):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
    return y if gamma is None else y * gamma


def layer_norm(x, gamma, beta):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + EPS) * gamma + beta


def batch_norm(x, gamma, beta):
    mu = jnp.mean(x, axis=0, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=0, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + EPS) * gamma + beta


def group_norm(x, gamma, beta, groups=8):
    n, d = x.shape
    xg = x.reshape(n, groups, d // groups)
    mu = jnp.mean(xg, axis=-1, keepdims=True)
    var = jnp.mean((xg - mu) ** 2, axis=-1, keepdims=True)
    return ((xg - mu) * jax.lax.rsqrt(var + EPS)).reshape(n, d) * gamma + beta


def ada_layer_norm(x, shift, scale):
    """DiT's AdaLN: LayerNorm without affine, then ``* (1 + scale) + shift`` (conditioning vectors)."""
    return layer_norm(x, 1.0, 0.0) * (1.0 + scale) + shift


def ada_rms_norm(x, scale):
    return rms_norm(x) * (1.0 + scale)


def deviations(d: int = 64, n: int = 32, seed: int = 42) -> dict[str, float]:
    """``{name: max |Norm(X R) R^T - Norm(X)|}`` with affine/conditioning parameters drawn at random (seed)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    r, _ = np.linalg.qr(rng.normal(size=(d, d)))
    r = jnp.asarray(r, jnp.float32)
    gamma = jnp.asarray(1.0 + 0.5 * rng.normal(size=(d,)), jnp.float32)
    beta = jnp.asarray(0.5 * rng.normal(size=(d,)), jnp.float32)
    shift = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
    norms = {
        "RMSNorm": lambda z: rms_norm(z),
        "LayerNorm": lambda z: layer_norm(z, gamma, beta),
        "BatchNorm": lambda z: batch_norm(z, gamma, beta),
        "GroupNorm": lambda z: group_norm(z, gamma, beta),
        "AdaLN": lambda z: ada_layer_norm(z, shift, scale),
        "AdaRMSNorm": lambda z: ada_rms_norm(z, scale),
    }
    hi = jax.lax.Precision.HIGHEST
    return {name: float(jnp.max(jnp.abs(jnp.matmul(f(jnp.matmul(x, r, precision=hi)), r.T, precision=hi) - f(x))))
            for name, f in norms.items()}
