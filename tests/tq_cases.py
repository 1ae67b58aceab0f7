"""Exactly representable test cases shared by the CPU (interpret) and GPU tests of the fused quantizer kernels."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

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


# (amax, tensor_scale) pairs near E4M3 rounding midpoints, where the two NVFP4 block-scale divisions must both be
# correctly rounded ((amax / 6) / t and amax / (6 t) differ): the found cases of tests/test_formats.py.
NVFP4_DIVISION_CASES = [(0.3293984532356262, 0.051670342683792114), (0.09735774248838425, 0.015271801501512527),
                        (0.6050914525985718, 0.09491629898548126), (0.20317964255809784, 0.03187131509184837)]


def nvfp4_found_case_vectors(amax):
    """Two NVFP4 blocks ``(2, 16)`` f32: ``linspace(-amax, amax, 16)`` and its reverse (maximum ``amax`` exactly)."""
    v = np.linspace(-amax, amax, 16, dtype=np.float32)
    return np.stack([v, v[::-1]])


def exact_f32_scale_case(values, m=16, seed=0):
    """A Scale-kernel case whose transform output is exactly the given f32 values (``round_to_input=False``).

    ``values float32 (n, 16)`` (``n`` even): NVFP4 blocks laid side by side, ``d = 16 n``. Returns ``(a bfloat16 (m, d),
    PreparedTransform scale)`` with ``a = ±sign(values)`` (a random sign per row and block: the magnitudes stay) and
    the per-channel factor ``|values|``, so ``(a diag(|values|))[r] = ±values`` exactly: one f32 multiply by ±1.
    (A K1 case built from one-hot activations is *not* exact on the GPU: the tensor cores' f32 accumulation of the
    three bf16 parts of a block truncates, moving some values by an ulp.)
    """
    values = np.asarray(values, np.float32)
    n = values.shape[0]
    flat = values.reshape(-1)
    flips = np.random.default_rng(seed).choice(np.float32([-1.0, 1.0]), (m, n, 1))
    a = (np.where(flat < 0, -1.0, 1.0).astype(np.float32).reshape(1, n, 16) * flips).reshape(m, 16 * n)
    return jnp.asarray(a, jnp.bfloat16), tq.PreparedTransform.from_inv_scale(jnp.asarray(np.abs(flat)))


def nvfp4_division_stress(ts, n_blocks=512, seed=0):
    """NVFP4 blocks ``(n_blocks, 16)`` f32 whose block scales ``(amax / 6) / ts`` fall within 3 f32 ulps of an E4M3
    rounding midpoint (either side), the other values at E2M1 decision thresholds of the scale (±1 ulp), so an
    approximate division or a reciprocal multiply changes codes or scales. Use with :func:`exact_f32_scale_case`."""
    rng = np.random.default_rng(seed)
    ts = np.float32(ts)
    grid = np.array([float(v) for v in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                     if np.isfinite(float(v)) and 2.0**-6 <= float(v) <= 448.0])
    mids = (grid[:-1] + grid[1:]) / 2
    n = n_blocks
    mid = rng.choice(mids, n)
    k = rng.integers(-3, 4, n)
    q = np.array([np.float32(v) for v in mid])
    for i in range(n):  # k f32 ulps away from the midpoint
        for _ in range(abs(int(k[i]))):
            q[i] = np.nextafter(q[i], np.float32(np.inf if k[i] > 0 else 0), dtype=np.float32)
    amax = (q.astype(np.float64) * float(ts) * 6.0).astype(np.float32)
    s = np.clip(amax / np.float32(6.0) / ts, 2.0**-6, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    thresholds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = (rng.choice(thresholds, (n, 15)) * (s * ts)[:, None]).astype(np.float32)
    vals = vals * rng.choice(np.float32([1 - 2**-23, 1.0, 1 + 2**-23]), (n, 15)).astype(np.float32)
    vals = vals * rng.choice(np.float32([-1.0, 1.0]), (n, 15))
    blocks = np.concatenate([amax[:, None] * rng.choice(np.float32([-1.0, 1.0]), (n, 1)), vals], axis=1)
    return np.clip(blocks, -amax[:, None], amax[:, None]).astype(np.float32)  # element 0 stays the block maximum


def division_operands(n: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """float32 ``(x, y)`` pairs for ``formats.divide_rn`` against numpy's (correctly rounded) ``x / y``: wide
    magnitudes, arbitrary bit patterns (NaN payloads, infinities, subnormals), subnormal operands, the NVFP4 divisors
    (6, 448 * 6) and every pair of special values."""
    rng = np.random.default_rng(seed)

    def bits(size):
        return rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32).view(np.float32)

    wide = lambda: (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)  # noqa: E731
    subnormal = rng.integers(1, 2**23, n).astype(np.uint32).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, 3.4e38, 1.2e-38, 6.0], np.float32)
    sx, sy = np.meshgrid(specials, specials)
    amax = rng.uniform(0, 1e3, n).astype(np.float32)
    return {"wide": (wide(), wide()), "bit_patterns": (bits(n), bits(n)), "subnormal_x": (subnormal, bits(n)),
            "subnormal_y": (bits(n), subnormal), "subnormal_both": (subnormal, subnormal[::-1].copy()),
            "by_6": (amax, np.full(n, 6.0, np.float32)), "by_2688": (amax, np.full(n, 2688.0, np.float32)),
            "specials": (sx.ravel(), sy.ravel())}


def assert_division_exact(got: np.ndarray, x: np.ndarray, y: np.ndarray, tag: str) -> None:
    """``got`` equals numpy's ``x / y`` bit for bit (any NaN for a NaN)."""
    with np.errstate(all="ignore"):
        want = x / y
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.nonzero(~same)[0]
    assert bad.size == 0, (f"{tag}: {bad.size} of {x.size} quotients differ, e.g. x={x[bad[:3]]} y={y[bad[:3]]} "
                           f"got={got[bad[:3]]} want={want[bad[:3]]}")
