"""MXFP4 / NVFP4 formats: bit-exact against an independent numpy + ml_dtypes reference, and torchao where installed."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kroquant_jax import formats as F
from kroquant_jax.formats import MXFP4, NVFP4, ScaleMode

ALL_MODES = list(ScaleMode)


# ---------------------------------------------------------------------------------------------------------------------
# Independent reference: float64 log2 for the exponent, ml_dtypes' float4_e2m1fn cast for the rounding.
# ---------------------------------------------------------------------------------------------------------------------


def _flush(x):
    x = np.asarray(x, np.float32).copy()
    sub = (np.abs(x) < np.float32(2.0**-126))
    x[sub] = np.copysign(np.float32(0.0), x[sub])
    return x


def _ref_exponent(amax: np.ndarray, mode: ScaleMode) -> np.ndarray:
    amax = amax.astype(np.float64)
    safe = np.where(amax > 0, amax, 1.0)
    if mode == ScaleMode.FLOOR:
        e = np.floor(np.log2(safe)) - 2
    elif mode == ScaleMode.CEIL:
        e = np.ceil(np.log2(safe)) - 2
    elif mode == ScaleMode.EVEN:
        mant, ex = np.frexp(safe)  # safe = mant * 2**ex, mant in [0.5, 1)
        rounded = np.floor(mant * 4 + 0.5) / 4  # 2 significant bits, half up
        e = np.floor(np.log2(rounded * 2.0**ex)) - 2
    elif mode == ScaleMode.RCEIL:
        e = np.ceil(np.log2(safe / 6.0))
    e = np.where(amax > 0, e, -127)
    return np.clip(e, -127, 127).astype(np.int64)


def ref_mxfp4(x: np.ndarray, mode: ScaleMode = ScaleMode.FLOOR, block: int = 32):
    """Returns (unpacked codes uint8 (..., d), scale bytes uint8 (..., d/block))."""
    x = _flush(x)
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1)
    e = _ref_exponent(amax, mode)
    v = xb.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]
    v = _flush(np.clip(v, -6.0, 6.0).astype(np.float32))
    codes = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(x.shape), (e + 127).astype(np.uint8)


def ref_nvfp4(x: np.ndarray, block: int = 16):
    x = _flush(np.asarray(x, np.float32))
    amax_t = np.abs(x).max()
    ts = np.float32(amax_t / np.float32(448.0 * 6.0)) if amax_t > 0 else np.float32(1.0)
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1)
    s = np.clip(amax / np.float32(6.0) / ts, np.float32(2.0**-6), np.float32(448.0)).astype(np.float32)
    s8 = s.astype(ml_dtypes.float8_e4m3fn)
    recip = (np.float32(1.0) / ts) / s8.astype(np.float32)
    v = _flush(np.clip(xb * recip[..., None], -6.0, 6.0).astype(np.float32))
    codes = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(x.shape), s8, ts


def unpacked_codes(q):
    return np.asarray(F.unpack_nibbles(q.codes))


def _outlier_data(key, shape, scale=1.0):
    """Gaussian data with a few huge channels and heavy-tailed rows; never zeros."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, shape) * scale
    channel_boost = jnp.where(jax.random.uniform(k2, shape[-1:]) < 0.05, 50.0, 1.0)
    row_boost = jnp.exp(jax.random.normal(k3, shape[:-1] + (1,)))
    return np.array(x * channel_boost * row_boost, np.float32)


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("magnitude", [2.0**-120, 1e-3, 1.0, 3e4, 2.0**110])
def test_mxfp4_bit_exact_against_reference(mode, magnitude):
    x = _outlier_data(jax.random.key(1), (8, 256), magnitude)
    q = F.quantize(jnp.asarray(x), MXFP4(scale_mode=mode))
    codes, scales = ref_mxfp4(x, mode)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    np.testing.assert_array_equal(unpacked_codes(q), codes)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_e2m1_tie_and_saturation(mode):
    # Each block: amax pinned at 6 * 2**k so that the FLOOR scale is 2**k; other entries are every tie point,
    # every representable value, and values just above/below ties, in both signs.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    eps = [t * (1 + 2**-20) for t in ties] + [t * (1 - 2**-20) for t in ties]
    row = np.array(ties + vals + eps + [0.1, 4.5, 5.9], np.float64)
    assert row.size == 32
    blocks = []
    for k in (-3, 0, 5):
        for sign in (1.0, -1.0):
            b = sign * row * 2.0**k
            b[7 + 7] = 6.0 * 2.0**k  # vals[7] sits at index 14
            blocks.append(b)
    # Saturation under FLOOR: amax = 7.75 * 2**k scales to 7.75 > 6.
    sat = np.linspace(-7.75, 7.75, 32)
    blocks.append(sat)
    x = np.stack(blocks).astype(np.float32)
    q = F.quantize(jnp.asarray(x), MXFP4(scale_mode=mode))
    codes, scales = ref_mxfp4(x, mode)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    np.testing.assert_array_equal(unpacked_codes(q), codes)
    if mode == ScaleMode.FLOOR:
        # Explicit expectations, independent of ml_dtypes: ties to even on the index grid.
        expect = [0, 2, 2, 4, 4, 6, 6]  # 0.25->0, 0.75->1.0(idx2), 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
        np.testing.assert_array_equal(unpacked_codes(q)[0, :7], expect)
        np.testing.assert_array_equal(unpacked_codes(q)[1, :7], np.array(expect) | 8)
        assert unpacked_codes(q)[-1, 0] == 0xF and unpacked_codes(q)[-1, -1] == 0x7  # -7.75 -> -6, 7.75 -> 6


def test_nibble_order_low_first():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 6.0, 0.5  # codes 7 and 1, scale 2**0 (amax 6 -> floor(log2 6) - 2 = 0)
    x[0, 2], x[0, 3] = -1.0, 3.0  # codes 0xA and 5
    q = F.quantize(jnp.asarray(x))
    assert int(q.scales[0, 0]) == 127
    assert int(q.codes[0, 0]) == 0x17
    assert int(q.codes[0, 1]) == 0x5A


def test_all_zero_block_gives_zero_codes_and_min_scale():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = np.linspace(1, 2, 32)
    q = F.quantize(jnp.asarray(x))
    assert np.all(np.asarray(q.codes)[0] == 0) and np.all(np.asarray(q.codes)[1, :16] == 0)
    assert int(q.scales[0, 0]) == 0 and int(q.scales[1, 0]) == 0
    np.testing.assert_array_equal(np.asarray(F.dequantize(q))[0], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_becomes_nan_scale(bad):
    x = _outlier_data(jax.random.key(2), (2, 64))
    x[1, 40] = bad
    q = F.quantize(jnp.asarray(x))
    assert int(q.scales[1, 1]) == 0xFF
    out = np.asarray(F.dequantize(q))
    assert np.all(np.isnan(out[1, 32:])) and np.all(np.isfinite(out[1, :32])) and np.all(np.isfinite(out[0]))
    codes, scales = ref_mxfp4(np.where(np.isfinite(x), x, 0.0))
    np.testing.assert_array_equal(np.asarray(q.scales)[0], scales[0])  # other blocks untouched
    qn = F.quantize(jnp.asarray(x), NVFP4())
    outn = np.asarray(F.dequantize(qn))
    assert np.all(np.isnan(outn[1, 32:48])) and np.all(np.isfinite(outn[1, :32])) and np.all(np.isfinite(outn[0]))
    with pytest.raises(ValueError, match=r"activations of layer blocks\.0: 1 non-finite"):
        F.check_finite(x, "activations of layer blocks.0")


def test_subnormal_inputs_flush_and_tiny_scales_are_exact():
    x = np.full((1, 32), 2.0**-125, np.float32)
    x[0, 1] = 2.0**-127  # subnormal -> flushed to +0
    x[0, 2] = -(2.0**-128)  # subnormal -> flushed to -0 (code 8)
    q = F.quantize(jnp.asarray(x))
    assert int(q.scales[0, 0]) == 0  # e = -127
    c = unpacked_codes(q)[0]
    assert c[0] == 6 and c[1] == 0 and c[2] == 8  # 2**-125 * 2**127 = 4 -> idx 6
    np.testing.assert_array_equal(np.asarray(F.dequantize(q))[0, 0], np.float32(2.0**-125))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", [MXFP4(), MXFP4(scale_mode="rceil"), NVFP4()])
def test_round_trip_equals_fake_quant_any_leading_shape(dtype, fmt):
    x = jnp.asarray(_outlier_data(jax.random.key(3), (2, 3, 128)), dtype)
    q = F.quantize(x, fmt)
    assert q.codes.shape == (2, 3, 64) and q.scales.shape == (2, 3, 128 // fmt.block_size)
    fq = F.fake_quant(x, fmt)
    assert fq.dtype == dtype and fq.shape == x.shape
    np.testing.assert_array_equal(np.asarray(F.dequantize(q)), np.asarray(fq))
    # bf16/f16 inputs quantize exactly like their f32 upcast
    q32 = F.quantize(x.astype(jnp.float32), fmt)
    np.testing.assert_array_equal(np.asarray(q32.codes), np.asarray(q.codes))
    # and jit agrees with eager
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: F.fake_quant(a, fmt))(x)), np.asarray(fq))


def test_width_not_multiple_of_block_raises_or_pads():
    x = jnp.ones((4, 48))
    with pytest.raises(ValueError, match=r"d=48 must be a multiple of block=32"):
        F.quantize(x)
    with pytest.raises(ValueError, match=r"d=48 must be a multiple of block=32"):
        F.fake_quant(x)
    q = F.quantize(x, pad=True)
    assert q.codes.shape == (4, 32)
    fq = F.fake_quant(x, pad=True)
    assert fq.shape == (4, 48)
    np.testing.assert_array_equal(np.asarray(fq), 1.0)
    with pytest.raises(TypeError, match="floating"):
        F.quantize(jnp.ones((2, 32), jnp.int32))


def test_nvfp4_bit_exact_against_reference():
    for seed, mag in [(4, 1.0), (5, 1e-4), (6, 1e5)]:
        x = _outlier_data(jax.random.key(seed), (16, 128), mag)
        q = F.quantize(jnp.asarray(x), NVFP4())
        codes, s8, ts = ref_nvfp4(x)
        assert np.float32(q.tensor_scale) == ts
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), s8.view(np.uint8))
        np.testing.assert_array_equal(unpacked_codes(q), codes)
    zero = F.quantize(jnp.zeros((2, 32)), NVFP4())
    assert float(zero.tensor_scale) == 1.0 and np.all(np.asarray(zero.codes) == 0)


def test_nvfp4_tensor_of_tiny_normal_values_round_trips():
    """A tensor whose largest value is tiny but normal (below ~3e-35 the tensor scale was subnormal, its reciprocal
    inf: every code +-6 and every value dequantized to 0; below ~5e-34 an all-zero block came back as -0). The
    tensor scale is floored at NVFP4_MIN_TENSOR_SCALE: the values keep NVFP4's relative accuracy, zeros stay +0."""
    x = (np.arange(1, 17, dtype=np.float32) * np.float32(1e-37)).reshape(1, 16)
    q = F.quantize(jnp.asarray(x), NVFP4())
    assert float(q.tensor_scale) == F.NVFP4_MIN_TENSOR_SCALE
    back = np.asarray(F.dequantize(q, jnp.float32))
    assert np.all(np.abs(back - x) <= np.abs(x).max() / 6), back  # within one E2M1 unit of the block (its max is 6)
    assert abs(back[0, -1] - x[0, -1]) <= 0.1 * x[0, -1]  # the largest: 6 units, up to the scale's E4M3 rounding
    y = np.zeros((1, 32), np.float32)
    y[0, 0] = 1e-34
    out = np.asarray(F.fake_quant(jnp.asarray(y), NVFP4()))
    assert not np.any(np.signbit(out[0, 16:])) and np.all(out[0, 16:] == 0)
    # a normal tensor's scale is untouched by the floor
    assert float(F.nvfp4_tensor_scale(jnp.asarray([[2688.0] + [0.0] * 15]))) == 1.0


@pytest.mark.parametrize("fmt", [MXFP4(), NVFP4()])
def test_ste_gradients(fmt):
    x = jnp.asarray(_outlier_data(jax.random.key(7), (4, 64)))
    g = jax.random.normal(jax.random.key(8), x.shape)
    grad = jax.grad(lambda a: jnp.sum(F.fake_quant(a, fmt) * g))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(g))
    # Clipped STE: zero exactly where |x| > 6 * block scale.
    xs = np.linspace(-7.75, 7.75, 64, dtype=np.float32).reshape(1, 64)  # FLOOR scale 1 in both blocks
    grad_c = jax.grad(lambda a: jnp.sum(F.fake_quant(a, MXFP4(), ste="clipped")))(jnp.asarray(xs))
    np.testing.assert_array_equal(np.asarray(grad_c), (np.abs(xs) <= 6.0).astype(np.float32))
    assert 0 < np.asarray(grad_c).sum() < 64
    with pytest.raises(ValueError, match="ste"):
        F.fake_quant(x, fmt, ste="bogus")


def test_nvfp4_clipped_ste_masks_exactly_the_clipped_elements():
    """NVFP4's clipped STE decides on the quantizer's own scaled value ``x * ((1 / ts) / s)`` (numpy's f32 below): the
    block's largest element, reproduced exactly, keeps its gradient (``|x| > 6 * s * ts`` computed apart rounds
    differently and zeroed it); over random one-block tensors the mask is exactly the clipped elements."""
    x = jnp.asarray([[1.0] * 15 + [15.733753]], jnp.float32)
    assert np.float32(F.fake_quant(x, NVFP4())[0, 15]) == np.float32(15.733753)
    grad = jax.grad(lambda a: jnp.sum(F.fake_quant(a, NVFP4(), ste="clipped")))(x)
    assert float(grad[0, 15]) == 1.0
    rng = np.random.default_rng(0)
    grad_of = jax.jit(jax.grad(lambda a: jnp.sum(F.fake_quant(a, NVFP4(), ste="clipped"))))
    kinds = set()
    for _ in range(200):
        one = (rng.standard_normal((1, 16)) * np.exp(rng.uniform(-3, 3))).astype(np.float32)
        q = F.quantize(jnp.asarray(one), NVFP4())
        reciprocal = (np.float32(1.0) / np.float32(q.tensor_scale)) / np.asarray(q.scales, np.float32)[0, 0]
        clipped = np.abs(one * np.float32(reciprocal)) > 6
        np.testing.assert_array_equal(np.asarray(grad_of(jnp.asarray(one))) == 0, clipped)
        kinds.add(bool(clipped.any()))
    assert kinds == {False, True}


def test_quantized_array_is_a_pytree_with_static_format():
    q = F.quantize(jnp.ones((3, 64)), MXFP4(scale_mode="ceil"))
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    q2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert q2.fmt == MXFP4(scale_mode="ceil") and q2.shape == (3, 64)
    stacked = jax.vmap(lambda a: F.quantize(a, NVFP4()))(jax.random.normal(jax.random.key(0), (5, 4, 32)))
    assert stacked.tensor_scale.shape == (5,)  # one per-tensor scale per vmapped slice
    assert q.nbytes == 3 * 32 + 3 * 2 + 4


@pytest.mark.parametrize("fmt", [MXFP4(), MXFP4(scale_mode="even"), NVFP4()])
@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 64), (3, 0)])
def test_empty_arrays_round_trip(fmt, shape):
    """An empty batch is valid input: quantize -> dequantize, fake_quant and its gradient keep the empty shape."""
    x = jnp.zeros(shape, jnp.bfloat16)
    q = F.quantize(x, fmt)
    d = shape[-1]
    assert q.shape == shape and q.codes.shape == (*shape[:-1], d // 2)
    assert q.scales.shape == (*shape[:-1], d // fmt.block_size) and q.scales.dtype == fmt.scale_dtype
    assert float(q.tensor_scale) == 1.0  # as for an all-zero array
    out = F.dequantize(q)
    assert out.shape == shape and out.dtype == jnp.bfloat16
    for ste in ("identity", "clipped"):
        fq = F.fake_quant(x, fmt, ste=ste)
        assert fq.shape == shape and fq.dtype == x.dtype
        grad = jax.grad(lambda a: jnp.sum(F.fake_quant(a, fmt, ste=ste).astype(jnp.float32)))(x)
        assert grad.shape == shape
    assert jax.jit(lambda a: F.dequantize(F.quantize(a, fmt)))(x).shape == shape
    padded = F.fake_quant(jnp.zeros((0, 40)), fmt, pad=True)  # pad=True on an empty batch
    assert padded.shape == (0, 40)


@pytest.mark.parametrize("fmt", [MXFP4(), MXFP4(block_size=64, scale_mode="rceil"), NVFP4(), NVFP4(block_size=32)])
def test_format_describes_itself(fmt):
    """The format object carries its own dispatch: JSON round trip, scale dtype, tensor scale, per-block methods."""
    assert F.QuantFormat.from_json(fmt.to_json()) == fmt
    assert fmt.to_json()["name"] == fmt.name and fmt.is_standard == (fmt.block_size == fmt.standard_block_size)
    x = jnp.asarray(_outlier_data(jax.random.key(11), (4, 128)))
    q = F.quantize(x, fmt)
    assert q.scales.dtype == fmt.scale_dtype
    assert (q.tensor_scale != 1.0) == fmt.has_tensor_scale  # outlier data: NVFP4's tensor scale is not 1
    blocks = x.reshape(4, -1, fmt.block_size)
    codes, scales = fmt.quantize_blocks(blocks, fmt.tensor_scale(x))
    np.testing.assert_array_equal(np.asarray(F.pack_nibbles(codes.reshape(x.shape))), np.asarray(q.codes))
    values = fmt.dequantize_blocks(codes, scales, q.tensor_scale)
    np.testing.assert_array_equal(np.asarray(values.reshape(x.shape)), np.asarray(F.dequantize(q, jnp.float32)))
    # scale_factors: the block scale itself (offset 0; NaN/zero-byte blocks aside, value = e2m1 * factor * tensor
    # scale in the dequantization's order) and times 2**6 (the W4A4 kernel's decode), also from the uint8 bytes.
    assert not np.any(np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8) if scales.dtype != jnp.uint8
                                 else scales) == 0)
    rebuilt = F.flush_subnormals(F.e2m1_decode(codes) * fmt.scale_factors(scales)[..., None] * q.tensor_scale)
    np.testing.assert_array_equal(np.asarray(rebuilt), np.asarray(values))
    bytes_ = jax.lax.bitcast_convert_type(scales, jnp.uint8) if scales.dtype != jnp.uint8 else scales
    np.testing.assert_array_equal(np.asarray(fmt.scale_factors(bytes_, 6)), np.asarray(fmt.scale_factors(scales)) * 64)


def test_mxfp4_scale_factor_edge_bytes():
    b = jnp.arange(256, dtype=jnp.uint8)
    f = np.asarray(MXFP4().scale_factors(b))
    assert f[0] == 0 and np.isnan(f[255])
    np.testing.assert_array_equal(f[1:255], np.exp2(np.arange(1, 255) - 127.0).astype(np.float32))


def test_format_errors_are_clear():
    with pytest.raises(ValueError, match=r"unknown quantization format .*known: \['mxfp4', 'nvfp4'\]"):
        F.QuantFormat.from_json({"name": "int4"})
    with pytest.raises(ValueError, match=r"unknown keys \['scale_mode'\] for NVFP4"):
        F.QuantFormat.from_json({"name": "nvfp4", "block_size": 16, "scale_mode": "floor"})
    with pytest.raises(ValueError, match="'sideways' is not a valid ScaleMode"):
        F.QuantFormat.from_json({"name": "mxfp4", "block_size": 32, "scale_mode": "sideways"})
    with pytest.raises(ValueError, match="NVFP4 block_size=15 must be a positive even number"):
        NVFP4(block_size=15)
    with pytest.raises(ValueError, match="mxfp4 has no per-tensor scale"):
        F.quantize(jnp.ones((2, 32)), MXFP4(), tensor_scale=jnp.float32(2.0))
    with pytest.raises(TypeError, match="unknown quantization format"):
        F.quantize(jnp.ones((2, 32)), "mxfp4")
    # NVFP4 with a given tensor scale: the block math of that scale.
    x = jnp.asarray(_outlier_data(jax.random.key(12), (2, 64)))
    q = F.quantize(x, NVFP4(), tensor_scale=jnp.float32(0.01))
    codes, scales = F.nvfp4_quantize_blocks(x.reshape(2, 4, 16), jnp.float32(0.01))
    assert float(q.tensor_scale) == np.float32(0.01)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(scales).view(np.uint8))


# ---------------------------------------------------------------------------------------------------------------------
# torchao's reference code (test extras; its pure-torch path runs on the CPU).
# ---------------------------------------------------------------------------------------------------------------------


def _torchao():
    torch = pytest.importorskip("torch")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.kernels import unpack_uint4
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except Exception as e:  # pragma: no cover - depends on the optional install
        pytest.skip(f"torchao mx_formats not importable here: {e}")
    return torch, ScaleCalculationMode, unpack_uint4, to_mx, nvfp4_quantize, per_tensor_amax_to_scale


@pytest.mark.parametrize("mode", ALL_MODES)
def test_mxfp4_matches_torchao(mode):
    torch, SCM, unpack_uint4, to_mx, _, _ = _torchao()
    # Magnitudes where torchao's min-normal clamp of the scale does not kick in (amax >= 2**-120).
    x = _outlier_data(jax.random.key(11), (16, 256))
    scale_t, data_t = to_mx(torch.from_numpy(x), torch.float4_e2m1fn_x2, 32, scaling_mode=SCM(mode.value))
    q = F.quantize(jnp.asarray(x), MXFP4(scale_mode=mode))
    np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1), scale_t.view(torch.uint8).numpy().reshape(-1))
    codes_t = unpack_uint4(data_t.view(torch.uint8).contiguous()).numpy().reshape(16, 256)
    np.testing.assert_array_equal(unpacked_codes(q), codes_t)


def test_nvfp4_matches_torchao():
    torch, _, unpack_uint4, _, nvfp4_quantize, per_tensor_amax_to_scale = _torchao()
    x = _outlier_data(jax.random.key(12), (16, 256))
    xt = torch.from_numpy(x)
    ts = per_tensor_amax_to_scale(xt.abs().max())
    scales_t, data_t = nvfp4_quantize(xt, 16, per_tensor_scale=ts)
    q = F.quantize(jnp.asarray(x), NVFP4())
    assert np.float32(q.tensor_scale) == np.float32(ts.item())
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8).reshape(-1),
                                  scales_t.view(torch.uint8).numpy().reshape(-1))
    codes_t = unpack_uint4(data_t.view(torch.uint8).contiguous()).numpy().reshape(16, 256)
    np.testing.assert_array_equal(unpacked_codes(q), codes_t)


def test_nvfp4_block_scales_identical_under_jit():
    """XLA rewrites (a / 6) / t into a / (6 t) under jit unless prevented: block scales must not depend on jit."""
    amax_rows = np.asarray(jax.random.uniform(jax.random.key(13), (4096, 16), minval=0.01, maxval=100.0), np.float32)
    x = jnp.asarray(amax_rows[..., None] * np.linspace(-1, 1, 16, dtype=np.float32))  # (4096, 16, 16)
    ts = jnp.float32(0.0123)
    eager = F.nvfp4_quantize_blocks(x, ts)
    jitted = jax.jit(F.nvfp4_quantize_blocks)(x, ts)
    np.testing.assert_array_equal(np.asarray(eager[1]).view(np.uint8), np.asarray(jitted[1]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
    s_ref = np.clip(np.abs(np.asarray(x)).max(-1) / np.float32(6.0) / np.float32(0.0123), 2.0**-6, 448.0)
    np.testing.assert_array_equal(np.asarray(jitted[1]).view(np.uint8),
                                  s_ref.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


# (amax, tensor_scale) pairs where (amax / 6) / t and amax / (6 t) round to different E4M3 block scales (found by a
# search next to E4M3 rounding midpoints): without the optimization barriers, jit gives the second.
_DIVISION_ORDER_CASES = [(0.3293984532356262, 0.051670342683792114), (0.09735774248838425, 0.015271801501512527),
                         (0.6050914525985718, 0.09491629898548126), (0.20317964255809784, 0.03187131509184837)]


@pytest.mark.parametrize("amax,ts", _DIVISION_ORDER_CASES)
def test_nvfp4_block_scale_keeps_division_order_under_jit(amax, ts):
    x = jnp.asarray(np.linspace(-amax, amax, 16, dtype=np.float32)[None])  # (1, 16), amax exact at both ends
    s_ref = (np.float32(np.float32(amax) / np.float32(6.0)) / np.float32(ts)).astype(ml_dtypes.float8_e4m3fn)
    s_fused = (np.float32(amax) / (np.float32(6.0) * np.float32(ts))).astype(ml_dtypes.float8_e4m3fn)
    assert s_ref.view(np.uint8) != s_fused.view(np.uint8)  # the case really separates the two orders
    _, s_jit = jax.jit(F.nvfp4_quantize_blocks)(x, jnp.float32(ts))
    assert np.asarray(s_jit).view(np.uint8)[0] == s_ref.view(np.uint8)


def test_nvfp4_tensor_scale_correctly_rounded_under_jit():
    amax = np.asarray(jax.random.uniform(jax.random.key(14), (4096,), minval=0.01, maxval=1e4), np.float32)
    x = jnp.asarray(amax[:, None] * np.array([1.0, -0.5], np.float32))  # (4096, 2): one tensor per row
    got = np.asarray(jax.jit(jax.vmap(F.nvfp4_tensor_scale))(x))
    np.testing.assert_array_equal(got, amax / np.float32(448.0 * 6.0))


def test_nvfp4_quantizer_never_widens_its_rounded_scale():
    """The NVFP4 quantizer divides by its E4M3-rounded block scale: that value must come from integer ops
    (``e4m3_round``), not from the f8 scale widened back to f32, because XLA:GPU drops an ``f32 -> f8 -> f32`` chain
    inside one program and the codes would be those of the unrounded scale (up to one E2M1 step off, while the
    stored scale bytes stay right; docs/kernels.md, "Tests", the NVFP4 failures on the GPU)."""
    from jaxpr_checks import float8_widenings

    x = jnp.ones((4, 32), jnp.float32)
    assert float8_widenings(lambda v: F.quantize(v, NVFP4()), x) == []
    # the check sees such a chain where there is one
    assert float8_widenings(lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32), x)


def test_e4m3_round_matches_ml_dtypes():
    """``e4m3_round``'s value and byte are the float8_e4m3fn cast's, jitted, on every E4M3 number in range, the
    midpoints between them, their neighbours and random values."""
    rng = np.random.default_rng(2)
    grid = np.array([float(v) for v in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                     if np.isfinite(float(v)) and F.E4M3_TINY <= float(v) <= F.E4M3_MAX], np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    s = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000),
                        rng.uniform(F.E4M3_TINY, F.E4M3_MAX, 5000).astype(np.float32)]).astype(np.float32)
    value, byte = jax.jit(F.e4m3_round)(jnp.asarray(s))
    cast = s.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(value), cast.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(byte), cast.view(np.uint8).astype(np.int32))


def test_divide_rn_matches_numpy_bit_for_bit():
    """``divide_rn`` is IEEE f32 division (round to nearest even, subnormals, specials), jitted and vmapped."""
    from tq_cases import assert_division_exact, division_operands

    for tag, (x, y) in division_operands(1 << 16).items():
        assert_division_exact(np.asarray(jax.jit(F.divide_rn)(x, y)), x, y, tag)
    x, y = division_operands(4096, seed=1)["wide"]
    got = jax.jit(jax.vmap(F.divide_rn, in_axes=(0, None)))(x.reshape(64, 64), y[0])  # a broadcast scalar divisor
    assert_division_exact(np.asarray(got).ravel(), x, np.full_like(x, y[0]), "scalar divisor under vmap")


def test_divide_rn_catches_a_one_ulp_error():
    """The comparison has teeth: a quotient one ulp off fails it."""
    from tq_cases import assert_division_exact

    x, y = np.float32([1.0, 2.0]), np.float32([3.0, 7.0])
    got = np.asarray(F.divide_rn(x, y))
    with pytest.raises(AssertionError, match="1 of 2 quotients differ"):
        assert_division_exact(got.copy() + np.float32([0.0, 1.0]) * np.spacing(got[1]), x, y, "planted")


def test_as_float32_dequantizes_packed_and_casts_dense():
    x = jax.random.normal(jax.random.key(7), (4, 64), jnp.float32) * 3
    for fmt in (F.MXFP4(), F.NVFP4()):
        q = F.quantize(x, fmt)
        got = F.as_float32(q)
        assert got.dtype == jnp.float32 and got.shape == x.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(F.dequantize(q, jnp.float32)))
        assert not np.array_equal(np.asarray(got), np.asarray(x))  # rounded, not the input passed through
    dense = F.as_float32(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert dense.dtype == jnp.float32 and dense.tolist() == [[0, 1, 2], [3, 4, 5]]
