"""CPU tests of the quantizer kernels' FP8 output mode (``transform_quantize.transform_quantize_fp8``), interpret mode.

The kernel writes the E4M3 re-encoding of its own MXFP4 result: every byte, the row scales and (``with_mxfp4``) the
codes and scales are compared bit for bit with ``fp8_encoding.mxfp4_to_e4m3`` of ``transform_quantize``'s output, on
rows in range, rows whose block exponents span more than 14 binades (the out-of-range policy), zero rows, rows with
a NaN block, and a ragged last row tile, for every kernel kind and the tilings the defaults pick.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import fp8_encoding as FE
from kroquant_jax.formats import MXFP4, NVFP4, ScaleMode
from pallas_kernels import transform_quantize as tq
from tq_cases import exact_activations, exact_transform

SMALL = tq.BlockSizes(block_rows=16, block_cols=128)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))  # one program: its dozens of eager ops compiled one by one
def _rows_with_spans(key, m, d, dtype, nan=True):
    """Exact activations with per-row powers of two on whole 32-column blocks (the transforms act per block, so the
    data stay exact): rows in range, rows spanning 20+ binades, zero rows and (``nan``) a row with a NaN."""
    a = exact_activations(key, m, d, jnp.float32)
    nb = d // 32
    e = jax.random.randint(jax.random.fold_in(key, 1), (m, nb), -6, 7)  # spans <= 12 + transform growth
    e = e.at[1::5, 0].set(18).at[1::5, nb - 1].set(-12)  # 30 binades: out of range
    e = e.at[3::7, 1].set(-24)  # a tiny block beside normal ones
    a = a * jnp.repeat(2.0 ** e.astype(jnp.float32), 32, axis=1)
    a = a.at[2].set(0.0).at[m - 1].set(0.0)
    if nan:
        a = a.at[4, 5].set(jnp.nan)
    return a.astype(dtype)


# the re-encode and row spans the kernel's bytes are compared with, each one jitted program (the same jnp ops)
_mxfp4_to_e4m3 = jax.jit(FE.mxfp4_to_e4m3, static_argnames=("order", "count_inexact", "arithmetic", "group"))
_row_spans = jax.jit(FE.row_spans)
_exact_transform = jax.jit(exact_transform, static_argnums=(0, 1))


def _bits(v):
    return np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))


def _assert_rows_equal(got: FE.Fp8Rows, want: FE.Fp8Rows):
    assert got.order == want.order == "even_odd" and got.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(_bits(got.values), _bits(want.values))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))  # NaN == NaN here


def _check(a, t, bs, fmt=MXFP4(), round_to_input=False, one_launch=False):
    m, d = a.shape
    q = tq.transform_quantize(a, t, fmt, block_sizes=None if one_launch else bs, impl="interpret",
                              round_to_input=round_to_input)
    want = _mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
    # two poisoned starts of the E4M3 output (0xA5 with the MXFP4 outputs, 0x00 without): every byte is written
    poison = (jnp.full((m, 2, d // 2), 0xA5, jnp.uint8), jnp.full((m, d // 2), 0xA5, jnp.uint8),
              jnp.full((m, d // 32), 0xA5, jnp.uint8))
    rows, q8 = tq.transform_quantize_fp8(a, t, fmt, with_mxfp4=True, block_sizes=bs, impl="interpret",
                                         round_to_input=round_to_input, poison_outputs=poison, one_launch=one_launch)
    _assert_rows_equal(rows, want)
    np.testing.assert_array_equal(np.asarray(q8.codes), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(q8.scales), np.asarray(q.scales))
    only = tq.transform_quantize_fp8(a, t, fmt, block_sizes=bs, impl="interpret", round_to_input=round_to_input,
                                     poison_outputs=(jnp.zeros((m, 2, d // 2), jnp.uint8),), one_launch=one_launch)
    _assert_rows_equal(only, want)
    assert int(only.inexact) == -1
    return q, want


def _assert_inf_made_nan_rows(a, q, want):
    """The fp16 case the docstrings promise is there: the rows scaled by 2**18 overflowed to Inf, got a NaN block
    and a NaN row scale, and still hold live (finite, non-zero) blocks."""
    inf_rows = np.flatnonzero(np.isinf(np.asarray(a, np.float32)).any(axis=1))
    assert inf_rows.size and np.array_equal(np.flatnonzero(np.isnan(np.asarray(want.scale))), inf_rows)
    s = np.asarray(q.scales)[inf_rows]
    assert ((s == 0xFF).any(axis=1) & ((s != 0xFF) & (s != 0)).any(axis=1)).all()


@pytest.mark.parametrize("one_launch", [False, True], ids=["two_launches", "one_launch"])
@pytest.mark.parametrize("kind", tq.KINDS)
def test_every_kind_bit_exact_against_the_reencoding(kind, one_launch):
    """Two launches: ragged last 16-row tile, two 128-column tiles; K1: two 64-column joined chunks, K2: pairs. One
    launch: 16-row programs of whole rows (the chunks walked twice), the largest block anywhere in the row."""
    m, d = 21, 256
    a = _rows_with_spans(jax.random.key(1), m, d, jnp.bfloat16)
    t = _exact_transform(kind, d, jax.random.key(2))
    bs = tq.default_block_sizes_one_launch(kind, m, d, jnp.bfloat16) if one_launch else SMALL
    q, want = _check(a, t, bs, one_launch=one_launch)
    if kind != "fwht":  # the full-width Hadamard mixes every block of the row: all spans are small
        spans = np.asarray(_row_spans(q))
        assert spans.max() > FE.E4M3_SPAN and (spans <= FE.E4M3_SPAN).sum() > m // 2  # both kinds of rows
        assert int(_mxfp4_to_e4m3(q).inexact) > 0  # the out-of-range policy rounded something
    assert np.isnan(np.asarray(want.scale)[4]) and np.isfinite(np.asarray(want.scale)[[0, 1, 2, 3, 5]]).all()
    assert np.all(np.asarray(want.values[2].astype(jnp.float32)) == 0)  # a zero row
    if kind != "fwht":
        # and the same as re-encoding the jnp reference (exact data: the kernel's codes are the reference's; the
        # FWHT's f32 butterflies over rows of mixed binades are not exact)
        ref = _mxfp4_to_e4m3(tq.reference_transform_quantize(a, t, round_to_input=False),
                               order="even_odd", count_inexact=False)
        _assert_rows_equal(want, ref)


@pytest.mark.parametrize("kind,m,d", [("k2", 70, 96), ("k1", 40, 512)])
def test_default_tilings_and_fp16(kind, m, d):
    """The tilings ``default_block_sizes`` picks: K2 one block per program (d = 32 * 3), K1's large-grid tiling (256
    columns walked two blocks at a time by the pipelined loop); fp16 input, rounding A T to it,
    EVEN scales. In fp16 the rows scaled by 2**18 overflow to Inf: NaN blocks beside larger live blocks of the same
    tile (the pre-pass's per-chunk records must not let the NaN flag hide the larger byte)."""
    a = _rows_with_spans(jax.random.key(3), m, d, jnp.float16, nan=False)
    t = _exact_transform(kind, d, jax.random.key(4))
    bs = tq.default_block_sizes(kind, m, d, jnp.float16)
    if kind == "k1":  # the tiling default_block_sizes picks at >= 512 programs, with 16-row tiles
        big = tq.default_block_sizes(kind, 64 * 512, d, jnp.float16)
        assert big.block_cols == 256 and big.num_stages > 1
        bs = tq.BlockSizes(block_rows=16, block_cols=256, num_warps=4, num_stages=3, dot_passes=big.dot_passes)
    q, want = _check(a, t, bs, MXFP4(scale_mode=ScaleMode.EVEN), round_to_input=True)
    _assert_inf_made_nan_rows(a, q, want)


@pytest.mark.parametrize("kind,m,d", [("k1", 40, 96), ("k2", 33, 1152)])
def test_one_launch_fp16_and_odd_widths(kind, m, d):
    """The one-launch form on fp16 input rounding A T to it, EVEN scales, Inf-made NaN blocks beside larger live
    blocks of the same row (the running record must not let the NaN flag hide the larger byte), widths of 32 * 3
    (K1 one block per chunk) and 32 * 36 (K2: 36 chunks walked by the loop)."""
    a = _rows_with_spans(jax.random.key(3), m, d, jnp.float16, nan=False)
    t = _exact_transform(kind, d, jax.random.key(4))
    q, want = _check(a, t, None, MXFP4(scale_mode=ScaleMode.EVEN), round_to_input=True, one_launch=True)
    _assert_inf_made_nan_rows(a, q, want)


def test_general_data_same_bytes_as_the_kernels_mxfp4():
    """Random (not exact) data with a learned K2 transform: the FP8 bytes re-encode the kernel's own codes."""
    m, d = 48, 128
    x = jax.random.normal(jax.random.key(5), (m, d)) * jnp.where(jnp.arange(d) % 37 == 0, 40.0, 1.0)
    params = jax.tree.map(lambda v: v * (1 + 0.2 * jax.random.normal(jax.random.key(6), v.shape)),
                          tq.T.KRON_LU.init(d))
    _check(x.astype(jnp.bfloat16), tq.prepare("kron_lu", params), SMALL)


def test_reference_path_leading_dims_and_errors():
    a = _rows_with_spans(jax.random.key(7), 12, 64, jnp.bfloat16).reshape(3, 4, 64)
    t = _exact_transform("k2", 64, jax.random.key(8))
    rows = tq.transform_quantize_fp8(a, t)  # CPU: the reference
    assert rows.values.shape == (3, 4, 64) and rows.scale.shape == (3, 4)
    kern = tq.transform_quantize_fp8(a, t, impl="interpret", block_sizes=SMALL)
    assert kern.values.shape == (3, 4, 64) and kern.scale.shape == (3, 4)
    _assert_rows_equal(kern, rows)
    with pytest.raises(TypeError, match="MXFP4"):
        tq.transform_quantize_fp8(a, t, NVFP4())
    with pytest.raises(ValueError, match="poison"):
        tq.transform_quantize_fp8(a, t, impl="interpret", poison_outputs=(jnp.zeros((12, 2, 32), jnp.uint8),),
                                  with_mxfp4=True)


def test_reencode_kernel_bit_exact():
    """The two-phase alternative: the Pallas re-encode kernel of packed MXFP4 equals fp8_encoding's re-encode (ragged
    row tiles, several column tiles, out-of-range / zero / NaN rows)."""
    a = _rows_with_spans(jax.random.key(9), 45, 512, jnp.bfloat16)
    q = tq.reference_transform_quantize(a, tq.PreparedTransform.identity(512), round_to_input=False)
    want = _mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
    _assert_rows_equal(tq.reencode_e4m3(q, impl="interpret", block_rows=16, block_cols=64), want)
    _assert_rows_equal(tq.reencode_e4m3(q), want)  # CPU: the jnp re-encode itself
    with pytest.raises(ValueError, match="power of two"):
        tq.reencode_e4m3(q, block_rows=24)
    with pytest.raises(TypeError, match="MXFP4"):
        tq.reencode_e4m3(a)
