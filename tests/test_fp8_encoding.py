"""CPU tests of the exact MXFP4 -> E4M3 re-encoding and of the per-token FP8 activations (kroquant_jax.fp8_encoding)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kroquant_jax import fp8_encoding as E
from kroquant_jax import formats as F
from kroquant_jax.formats import MXFP4, NVFP4, QuantizedArray


def _qarray(codes: np.ndarray, scale_bytes: np.ndarray) -> QuantizedArray:
    """A MXFP4 QuantizedArray from unpacked codes ``(rows, d)`` and E8M0 bytes ``(rows, d/32)``."""
    packed = F.pack_nibbles(jnp.asarray(codes, jnp.uint8))
    return QuantizedArray(codes=packed, scales=jnp.asarray(scale_bytes, jnp.uint8), tensor_scale=jnp.float32(1.0),
                          fmt=MXFP4(), dtype=np.dtype(np.float32))


def _exact_f64(q: QuantizedArray) -> np.ndarray:
    """The MXFP4 values in float64 with formats.dequantize's flush (from dequantize itself: exact in f32)."""
    return np.asarray(F.dequantize(q, jnp.float32), np.float64)


def _decode_f64(r: E.Fp8Rows) -> np.ndarray:
    vals = np.asarray(r.values.astype(jnp.float32), np.float64)
    return vals * np.asarray(r.scale, np.float64)[..., None]


ALL_CODES = np.tile(np.arange(16, dtype=np.uint8), 2)  # one block of 32 holding all 16 codes twice


@pytest.mark.parametrize("top_byte", [127, 140, 100, 20])
def test_every_code_at_every_offset_in_range_is_exact(top_byte):
    """Row = [a top block (a 6 in it), a block of all 16 codes at offset o]: o = 6 .. -8 relative to e_ref."""
    rows_codes, rows_bytes = [], []
    offsets = list(range(E.E4M3_MIN_OFFSET, E.E4M3_TOP_OFFSET + 1))
    for o in offsets:
        top = np.zeros(32, np.uint8)
        top[5] = 7  # 6.0 * 2**e_max
        rows_codes.append(np.concatenate([top, ALL_CODES]))
        # e_ref = e_max - 6; the second block's exponent e_max - 6 + o, i.e. byte top_byte - 6 + o
        rows_bytes.append([top_byte, top_byte - E.E4M3_TOP_OFFSET + o])
    q = _qarray(np.stack(rows_codes), np.array(rows_bytes))
    r = E.mxfp4_to_e4m3(q)
    assert int(r.inexact) == 0
    np.testing.assert_array_equal(_decode_f64(r), _exact_f64(q))  # round trip, bit for bit
    # the E4M3 value of code c at offset o is e2m1(c) * 2**o exactly
    vals = np.asarray(r.values.astype(jnp.float32), np.float64)
    for i, o in enumerate(offsets):
        np.testing.assert_array_equal(vals[i, 32:], F.E2M1_VALUES.astype(np.float64)[ALL_CODES] * 2.0 ** o)
        assert vals[i, 5] == 384.0  # the top block sits at offset +6
    assert np.all(np.asarray(E.row_spans(q)) == E.E4M3_TOP_OFFSET - np.array(offsets))
    # the scale is 2**e_ref
    np.testing.assert_array_equal(np.asarray(r.scale, np.float64), 2.0 ** (top_byte - 127 - 6))


def test_random_quantized_rows_in_range_are_exact():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 256), jnp.float32)
    x = x * jnp.exp(jax.random.uniform(jax.random.PRNGKey(1), (64, 8), minval=-4.0, maxval=4.0)).repeat(32, axis=1)
    x = x.at[::7, 32:64].set(0.0)  # all-zero blocks: exact at any offset, not counted in the span
    q = F.quantize(x, MXFP4())
    assert int(jnp.max(E.row_spans(q))) <= E.E4M3_SPAN
    r = E.mxfp4_to_e4m3(q)
    assert int(r.inexact) == 0
    np.testing.assert_array_equal(_decode_f64(r), _exact_f64(q))
    converted = E.mxfp4_to_e4m3(q, order="even_odd", arithmetic="convert")
    np.testing.assert_array_equal(np.asarray(converted.values).view(np.uint8),
                                  np.asarray(E.mxfp4_to_e4m3(q, order="even_odd").values).view(np.uint8))


@pytest.mark.parametrize("o", [-9, -10, -12, -14, -25])
def test_out_of_range_rounds_to_nearest_with_bound_and_count(o):
    top = np.zeros(32, np.uint8)
    top[0] = 7
    q = _qarray(np.concatenate([top, ALL_CODES])[None], np.array([[127, 127 - 6 + o]]))
    r = E.mxfp4_to_e4m3(q)
    exact = _exact_f64(q)
    got = _decode_f64(r)
    # policy: round to nearest E4M3 (ml_dtypes' float8_e4m3fn cast of the exact value in units of 2**e_ref)
    e_ref = -6
    expect = (exact / 2.0 ** e_ref).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** e_ref
    np.testing.assert_array_equal(got, expect)
    changed = int((got != exact).sum())
    assert changed > 0 and int(r.inexact) == changed
    # bound: |err| <= 2**-10 * 2**e_ref = 2**-16 * 2**e_max, <= 2**-15 of the row max (>= 0.5 * 2**e_max)
    err = np.abs(got - exact).max()
    assert err <= 2.0 ** (e_ref - 10)
    assert err <= 2.0 ** -15 * np.abs(exact).max()
    assert int(E.row_spans(q)[0]) == 6 - o > E.E4M3_SPAN
    st = E.span_stats(q)
    assert st["rows_in_range"] == 0 and st["inexact_elements"] == changed and st["max_span"] == 6 - o


def test_offset_minus_nine_partially_exact():
    """At offset -9 exactly the codes whose value * 2**-9 is a multiple of 2**-9 survive: 1, 2, 3, 4, 6 (x2 signs)."""
    top = np.zeros(32, np.uint8)
    top[0] = 7
    q = _qarray(np.concatenate([top, ALL_CODES])[None], np.array([[127, 127 - 15]]))
    r = E.mxfp4_to_e4m3(q)
    assert int(r.inexact) == 2 * 4  # codes 0.5 and 1.5, both signs, twice each
    changed = _decode_f64(r)[0] != _exact_f64(q)[0]
    assert not changed[:32].any()  # the top block is in range
    np.testing.assert_array_equal(np.flatnonzero(changed[32:]) % 16, [1, 3, 9, 11, 1, 3, 9, 11])  # +-0.5, +-1.5


def test_nan_blocks_and_flushed_bytes():
    codes = np.tile(np.arange(16, dtype=np.uint8), 4)[None].repeat(3, axis=0)  # (3, 64)
    bytes_ = np.array([[127, F.E8M0_NAN], [0, 3], [1, 3]])
    q = _qarray(codes, bytes_)
    r = E.mxfp4_to_e4m3(q)
    dec = _decode_f64(r)
    ref = _exact_f64(q)
    assert np.all(np.isnan(dec[0])) and np.isnan(float(r.scale[0]))  # a NaN block: the whole row NaN
    assert np.all(np.isnan(ref[0, 32:]))
    np.testing.assert_array_equal(dec[1:], ref[1:])  # byte 0 (flushed to zero) and byte 1 (code 0.5 flushed)
    bits = np.asarray(jax.lax.bitcast_convert_type(r.values, jnp.uint8))
    assert np.all((bits[0, 32:] & 0x7F) == 0x7F)
    assert int(r.inexact) == 0
    # the span ignores NaN blocks: row 1 spans bytes 0..3 (its byte-0 block keeps codes 2..6), row 2 bytes 1..3
    np.testing.assert_array_equal(np.asarray(E.row_spans(q)), [0, 3, 2])
    # a byte-0 block whose codes are all flushed (0.5, 1, 1.5) is not live
    q0 = _qarray(np.array([[1, 2, 3, 9] * 8 + [7] * 32], np.uint8), np.array([[0, 127]]))
    assert int(E.row_spans(q0)[0]) == 0
    assert E.span_stats(q)["nan_rows"] == 1


def test_zero_rows_and_leading_dims():
    x = jnp.zeros((2, 3, 64), jnp.float32).at[1, 2, 5].set(3.0)
    q = F.quantize(x)
    r = E.mxfp4_to_e4m3(q)
    assert r.values.shape == (2, 3, 64) and r.scale.shape == (2, 3) and r.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(_decode_f64(r), _exact_f64(q))
    assert float(r.scale[0, 0]) == 2.0 ** -126  # all-zero row: every byte 0, e_ref clamped to -126
    assert r.nbytes == 2 * 3 * 64 + 2 * 3 * 4


def test_even_odd_order():
    x = jax.random.normal(jax.random.PRNGKey(5), (6, 128)) * 4.0
    q = F.quantize(x)
    nat, eo = E.mxfp4_to_e4m3(q), E.mxfp4_to_e4m3(q, order="even_odd")
    assert eo.order == "even_odd" and nat.order == "natural"
    np.testing.assert_array_equal(np.asarray(eo.values.astype(jnp.float32)),
                                  np.asarray(E.even_odd_columns(nat.values.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(E.dequantize_rows(eo)), np.asarray(E.dequantize_rows(nat)))
    np.testing.assert_array_equal(_decode_f64(nat), _exact_f64(q))
    assert int(E.mxfp4_to_e4m3(q, count_inexact=False).inexact) == -1
    p_eo = E.per_token_e4m3(x, order="even_odd")
    np.testing.assert_array_equal(np.asarray(E.dequantize_rows(p_eo)), np.asarray(E.dequantize_rows(E.per_token_e4m3(x))))
    with pytest.raises(ValueError, match="order"):
        E.mxfp4_to_e4m3(q, order="odd")


@pytest.mark.parametrize("order, group", [("natural", 64), ("natural", 128), ("even_odd", 32), ("even_odd", 64)])
def test_row_groups_exact_where_each_group_fits(order, group):
    """One exponent per group of values: exact wherever each group's blocks span <= 14 binades, even where the row's
    blocks span more (the per-row encoding rounds there); zero groups get scale 0, NaN groups NaN, nothing else."""
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (5, 256)), np.float32) * 3.0
    x[1, :128] *= 2.0**-20  # row span about 20 binades, each group's at most ~8
    x[2, 64:128] = 0.0  # a zero group (natural order, 64)
    x[3, 200] = np.nan
    q = F.quantize(jnp.asarray(x))
    rows, grouped = E.mxfp4_to_e4m3(q, order=order), E.mxfp4_to_e4m3(q, order=order, group=group)
    assert grouped.group == group and grouped.scale.shape == (5, 256 // group) and rows.group is None
    exact = _exact_f64(q)
    finite = [0, 1, 2, 4]
    np.testing.assert_array_equal(np.asarray(E.dequantize_rows(grouped), np.float64)[finite], exact[finite])
    assert int(grouped.inexact) == 0 < int(rows.inexact)  # the per-row encoding rounds row 1's small blocks
    scale = np.asarray(grouped.scale)
    # the NaN block's group: once in natural order, in both halves (even, odd elements) in even_odd order
    assert np.isnan(scale[3]).sum() == (1 if order == "natural" else 2)
    assert np.all(np.isfinite(np.delete(scale, 3, axis=0)))
    if order == "natural" and group == 64:
        assert scale[2, 1] == 0.0 and np.all(scale[2, [0, 2, 3]] > 0)
    bits = scale[np.isfinite(scale) & (scale > 0)].view(np.int32)
    assert np.all(bits & 0x7FFFFF == 0)  # powers of two


def test_row_groups_stay_within_64_binades_of_the_earlier_groups():
    # group 1 sits 95 binades below group 0: its exponent is raised to 64 below, its values rounded (and counted)
    x = np.ones((1, 128), np.float32)
    x[0, 64:] = 2.0**-95
    q = F.quantize(jnp.asarray(x))
    r = E.mxfp4_to_e4m3(q, group=64)
    s0, s1 = np.asarray(r.scale)[0]
    assert s0 / s1 == 2.0**E.GROUP_GAP and int(r.inexact) == 64  # 2**-95 is below E4M3's reach at that exponent
    x[0, 64:] = 2.0**-60  # within the gap: exact
    assert int(E.mxfp4_to_e4m3(F.quantize(jnp.asarray(x)), group=64).inexact) == 0
    for group, order in ((48, "natural"), (64, "natural_x"), (24, "even_odd"), (96, "even_odd")):
        with pytest.raises(ValueError, match="group=|order"):
            E.mxfp4_to_e4m3(q, order=order, group=group)


def test_under_jit_and_vmap_identical():
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 128)) * 10.0
    q = F.quantize(x)
    eager = E.mxfp4_to_e4m3(q)
    jitted = jax.jit(E.mxfp4_to_e4m3)(q)
    np.testing.assert_array_equal(np.asarray(eager.values.astype(jnp.float32)),
                                  np.asarray(jitted.values.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(eager.scale), np.asarray(jitted.scale))


def test_errors():
    with pytest.raises(TypeError, match="MXFP4"):
        E.mxfp4_to_e4m3(F.quantize(jnp.ones((2, 32)), NVFP4()))
    with pytest.raises(TypeError, match="MXFP4"):
        E.mxfp4_to_e4m3(jnp.ones((2, 32)))
    with pytest.raises(TypeError, match="floating"):
        E.per_token_e4m3(jnp.ones((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="empty"):
        E.per_token_e4m3(jnp.ones((2, 0)))


def test_per_token_e4m3():
    x = jax.random.normal(jax.random.PRNGKey(4), (5, 96)) * jnp.array([1.0, 1e-4, 1e4, 0.0, 3.0])[:, None]
    x = x.at[4, 7].set(jnp.inf)
    r = E.per_token_e4m3(x)
    xs = np.asarray(x, np.float64)
    amax = np.abs(xs[:3]).max(axis=1)
    np.testing.assert_array_equal(np.asarray(r.scale[:3]), (amax / 448.0).astype(np.float32))
    vals = np.asarray(r.values.astype(jnp.float32), np.float64)
    assert np.abs(vals[:3]).max(axis=1).tolist() == [448.0] * 3  # the row max lands on 448
    # values: round to nearest E4M3 of x * (448 / amax): relative error <= 2**-4 for normals
    dec = _decode_f64(r)[:3]
    normal = np.abs(vals[:3]) >= 2.0 ** -6
    rel = np.abs(dec - xs[:3])[normal] / np.abs(xs[:3])[normal]
    assert rel.max() <= 2.0 ** -4 * (1 + 1e-6)
    assert float(r.scale[3]) == 1.0 and np.all(vals[3] == 0)  # zero row
    assert np.isnan(float(r.scale[4]))  # Inf in the row: NaN scale, visible downstream
    assert int(r.inexact) == 0


def test_per_token_e4m3_row_of_tiny_normal_values():
    """Below a row maximum of ~7.6e-37, 448 / amax overflowed: the zeros became NaN and the rest +-448. Such a row now
    gets scale 2**-126 and values below 448 that decode to the row within E4M3's rounding."""
    x = jnp.asarray([[1e-37, 0.0, -5e-38, 3e-38]], jnp.float32)
    r = E.per_token_e4m3(x)
    vals = np.asarray(r.values.astype(jnp.float32))
    assert not np.any(np.isnan(vals)) and vals[0, 1] == 0 and float(r.scale[0]) == 2.0 ** -126
    back = np.asarray(E.dequantize_rows(r), np.float64)
    np.testing.assert_allclose(back, np.asarray(x, np.float64), rtol=2.0 ** -3)


@pytest.mark.parametrize("arithmetic", E.ARITHMETICS)
def test_e4m3_bits_equals_rounding_the_exact_value_for_every_code_byte_and_offset(arithmetic):
    """Both encoders (the integer one shared with the quantizer kernels' FP8 output; the f32 -> E4M3 conversion one)
    against f32 -> E4M3 rounding of the exact value in numpy: every code x every E8M0 byte x every offset the row's
    own e_ref can give (6 down to far out of range), signed zeros, flushed elements and NaN blocks included."""
    nib, byte, off = np.meshgrid(np.arange(16), np.arange(256), np.arange(-40, 7), indexing="ij")
    e_ref = byte - 127 - off
    bits = np.asarray(jax.jit(functools.partial(E.e4m3_bits, arithmetic=arithmetic))(
        jnp.asarray(nib), jnp.asarray(byte), jnp.asarray(e_ref)))
    floor_log2 = np.array([127, -1, 0, 0, 1, 1, 2, 2])[nib & 7]
    dead = (floor_log2 + byte - 127 < -126) | (byte == 255)
    exact = np.where(dead, 0.0, F.E2M1_VALUES[nib].astype(np.float64) * 2.0 ** np.clip(off, -30, 127))
    want = exact.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64)
    want = np.where(byte == 255, 0x7F, want)
    np.testing.assert_array_equal(bits, want)
    assert bits.min() >= 0 and bits.max() <= 255
    assert E.e4m3_bits(jnp.int32(7), jnp.int32(127), E.reference_exponent(jnp.int32(127)),
                       arithmetic=arithmetic) == 0x7C  # 6 at +6: 384
    with pytest.raises(ValueError, match="arithmetic='float' must be one of \\('integer', 'convert'\\)"):
        E.e4m3_bits(jnp.int32(7), jnp.int32(127), jnp.int32(0), arithmetic="float")
