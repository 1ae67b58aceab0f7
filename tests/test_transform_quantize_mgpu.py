"""CPU tests of the Mosaic GPU transform + quantizer (``pallas_kernels.transform_quantize_mgpu``).

There is no Mosaic GPU interpreter on CPU (jax 0.10), so CI tests (1) the shared per-tile math bit for bit against
``kroquant_jax.formats`` through the jnp path, (2) the kernel bodies through the generic Pallas interpreter
(``impl="interpret"``: the same index maps, tiles, packing and stores; warpgroup MMA replaced by ``jnp.dot`` and layout
hints by the identity), (3) that both kernels lower to Mosaic GPU MLIR for a CUDA target (cross-platform lowering, no
GPU needed), and (4) the argument checks. The compiled kernels run in ``tests/gpu/test_transform_quantize_mgpu_gpu.py``
(``pytest -m gpu`` on the H200).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import formats as F
from kroquant_jax import transforms as T
from kroquant_jax.formats import MXFP4, NVFP4, ScaleMode
from pallas_kernels import fp4_tile
from pallas_kernels import transform_quantize as tq
from pallas_kernels import transform_quantize_mgpu as tqm
from test_transform_quantize import _boundary_blocks  # noqa: E402
from tq_cases import exact_activations, exact_transform  # noqa: E402

SMALL = tqm.MgpuBlockSizes(block_rows=64, block_cols=256, row_chunk=16)


def _scale_bytes(q):
    return np.asarray(q.scales)


@pytest.mark.parametrize("mode", list(ScaleMode), ids=lambda m: m.value)
def test_pair_lastaxis_matches_formats(mode):
    y = _boundary_blocks(np.random.default_rng(0), 4096)  # (4096, 32): every threshold, subnormals, NaN/Inf, zeros
    codes, scales = F.mxfp4_quantize_blocks(jnp.asarray(y), mode)
    ref_packed, ref_scales = np.asarray(F.pack_nibbles(codes)), np.asarray(scales)
    y3 = jnp.asarray(y.reshape(256, 16, 32))  # (rows, blocks, 32): the Q4 kernel's 3-D tile
    packed, s = jax.jit(fp4_tile.mx_quantize_pair_lastaxis, static_argnums=2)(y3[..., 0::2], y3[..., 1::2], mode)
    assert packed.shape == (256, 16, 16) and s.shape == (256, 16)
    np.testing.assert_array_equal(np.asarray(packed).reshape(-1, 16), ref_packed)
    np.testing.assert_array_equal(np.asarray(s).reshape(-1), ref_scales)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pairs_from_u32_exact_on_every_bit_pattern(dtype):
    bits = np.arange(2**16, dtype=np.uint32)
    words = jnp.asarray(bits | (bits[::-1] << 16))  # every 16-bit pattern in both halves
    lo, hi = jax.jit(tqm.pairs_from_u32, static_argnums=1)(words, dtype)
    vals = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits.astype(np.uint16)), dtype)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(lo).view(np.uint32)[~np.isnan(vals)], vals.view(np.uint32)[~np.isnan(vals)])
    np.testing.assert_array_equal(np.isnan(np.asarray(lo)), np.isnan(vals))
    np.testing.assert_array_equal(np.asarray(hi)[~np.isnan(vals[::-1])], vals[::-1][~np.isnan(vals[::-1])])


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_prepare_k1_blocks_is_the_dot_split(passes):
    k = jax.random.normal(jax.random.key(1), (3, 32, 32), jnp.float32)
    parts = tqm.prepare_k1_blocks(k, jnp.bfloat16, passes)
    assert parts.shape == (3, passes, 32, 32) and parts.dtype == jnp.bfloat16
    total = np.asarray(parts, np.float32).astype(np.float64).sum(axis=1)
    order = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])
    err = np.max(np.abs(total - np.asarray(k, np.float64)[..., order]))
    assert (err == 0) if passes == 3 else (0 < err < 2.0 ** (-7 * passes)), err
    x = jax.random.normal(jax.random.key(2), (16, 32)).astype(jnp.bfloat16)
    ref = tq._dot_split(x, k[1], passes)
    got = sum(jnp.dot(x, parts[1, p], preferred_element_type=jnp.float32) for p in range(passes))
    np.testing.assert_allclose(np.asarray(got)[:, :16], np.asarray(ref)[:, 0::2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got)[:, 16:], np.asarray(ref)[:, 1::2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", tqm.KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpret_exact(kind, dtype):
    m, d = 128, 512  # 2 x 2 programs
    a = exact_activations(jax.random.key(3), m, d, dtype)
    t = exact_transform(kind, d, jax.random.key(4))
    fmt = MXFP4(scale_mode=ScaleMode.EVEN if dtype == jnp.float16 else ScaleMode.FLOOR)
    outs = []
    for byte in (0x00, 0xFF):  # poisoned outputs: an unwritten byte would differ between the two runs
        poison = (jnp.full((m, d // 2), byte, jnp.uint8), jnp.full((m, d // 32), byte, jnp.uint8))
        outs.append(tqm.transform_quantize_mgpu(a, t, fmt, block_sizes=SMALL, impl="interpret", poison_outputs=poison))
    r = tq.reference_transform_quantize(a, t, fmt)
    for q in outs:
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
        np.testing.assert_array_equal(_scale_bytes(q), np.asarray(r.scales))


def test_interpret_general_data_q4_exact_k1_bounded():
    m, d = 64, 256
    x = jax.random.normal(jax.random.key(5), (m, d)) * jnp.where(
        jax.random.bernoulli(jax.random.key(6), 0.05, (1, d)), 30.0, 1.0)
    a = x.astype(jnp.bfloat16)
    q = tqm.transform_quantize_mgpu(a, tq.PreparedTransform.identity(d), block_sizes=SMALL, impl="interpret")
    r = tq.reference_transform_quantize(a, tq.PreparedTransform.identity(d))
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    t = tq.prepare("dense32", jax.tree.map(lambda v: v + 0.1 * jax.random.normal(jax.random.key(7), v.shape),
                                           T.get("dense32").init(d, jax.random.key(8))))
    q = tqm.transform_quantize_mgpu(a, t, block_sizes=SMALL, impl="interpret")
    r = tq.reference_transform_quantize(a, t)
    assert np.mean(np.asarray(q.codes) != np.asarray(r.codes)) <= 2e-3
    assert np.mean(_scale_bytes(q) != np.asarray(r.scales)) <= 2e-3


@pytest.mark.parametrize("kind", tqm.KINDS)
def test_lowers_to_mosaic_gpu(kind):
    """Cross-platform lowering to a CUDA target: the Pallas Mosaic GPU lowering runs (layouts, shapes, ops)."""
    m, d = 128, 1024
    t = exact_transform(kind, d, jax.random.key(9))
    low = jax.jit(lambda a, t: tqm.transform_quantize_mgpu(a, t, impl="pallas", block_sizes=SMALL)).trace(
        jax.ShapeDtypeStruct((m, d), jnp.bfloat16), t).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()


def test_errors_and_supports():
    t = tq.PreparedTransform.identity(512)
    a = jnp.ones((64, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="MXFP4"):
        tqm.transform_quantize_mgpu(a, t, NVFP4(), impl="interpret")
    with pytest.raises(ValueError, match="implement"):
        tqm.transform_quantize_mgpu(a, tq.PreparedTransform.fwht(512), impl="interpret")
    with pytest.raises(ValueError, match=r"\(60, 512\)"):
        tqm.transform_quantize_mgpu(jnp.ones((60, 512), jnp.bfloat16), t, impl="interpret")
    with pytest.raises(ValueError, match="block_cols"):
        tqm.MgpuBlockSizes(block_cols=96)
    assert tqm.supports("q4", (4096, 4096), jnp.bfloat16) and not tqm.supports("q4", (4096, 1152), jnp.bfloat16)
    assert not tqm.supports("k2", (4096, 4096), jnp.bfloat16)
    q = tqm.transform_quantize_mgpu(a, t)  # CPU: the reference
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(tq.reference_transform_quantize(a, t).codes))
