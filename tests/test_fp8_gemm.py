"""CPU tests of the FP8 W4A4 / W4A8 GEMM and layer (pallas_kernels.fp8_gemm) against the float64 eq. 11 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import fp8_encoding as FE
from kroquant_jax import formats as F
from kroquant_jax import transforms
from kroquant_jax.formats import MXFP4, NVFP4, QuantizedArray
from kroquant_jax.qlinear import build_qlinear
from pallas_kernels import fp8_gemm as G8
from pallas_kernels import served

# the re-encode and row spans the GEMM's operands are checked with, each one jitted program (the same jnp ops)
_mxfp4_to_e4m3 = jax.jit(FE.mxfp4_to_e4m3, static_argnames=("order", "count_inexact", "arithmetic", "group"))
_row_spans = jax.jit(FE.row_spans)
_prepare_weight = jax.jit(G8.prepare_weight, static_argnames=("storage", "order"))
_per_token_e4m3 = jax.jit(FE.per_token_e4m3, static_argnames=("order",))


def _acc_bound(a_abs: np.ndarray, w_abs: np.ndarray, k: int) -> np.ndarray:
    """fp32 accumulation-order bound ``k 2**-24 |A| |W|^T`` (plus one f32 output rounding)."""
    return (k + 1) * 2.0 ** -24 * (a_abs @ w_abs.T)


def _dense(q) -> np.ndarray:
    return np.asarray(F.dequantize(q, jnp.float32), np.float64)


# Random test inputs come from numpy's generator: jax.random's threefry is compiled for every shape it draws (about a
# second a program at the suite's -O0); the jnp work on them runs as one jitted program each.
def _normal(rng, shape, scale=1.0):
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


_quantize_pair = jax.jit(lambda a, w: (F.quantize(a, MXFP4()), F.quantize(w, MXFP4())))


def _operands(seed, m, n, k, spread=3.0):
    """MXFP4 ``A (m, k)`` (block magnitudes spread over ``e**+-spread``, an outlier channel) and ``W (n, k)``."""
    rng = np.random.default_rng(seed)
    a = _normal(rng, (m, k)) * np.exp(rng.uniform(-spread, spread, (m, k // 32))).astype(np.float32).repeat(32, 1)
    a[:, 7] *= 30.0  # an outlier channel
    return _quantize_pair(a, _normal(rng, (n, k), 1 / np.sqrt(k)))


def test_bit_exact_where_every_partial_sum_is_exact():
    """Small K and offsets within 3 binades of the top: every partial sum is an exact f32, so the FP8 product equals
    the float64 eq. 11 product bit for bit (any summation order)."""
    rng = np.random.default_rng(0)
    m, n, k = 16, 24, 64
    codes_a, codes_w = rng.integers(0, 16, (m, k)), rng.integers(0, 16, (n, k))
    codes_a[:, 0], codes_w[:, 0] = 7, 7  # a 6 in the first block: it sets e_ref
    bytes_a = np.stack([np.full(m, 130), 130 - rng.integers(0, 4, m)], 1)
    bytes_w = np.stack([np.full(n, 120), 120 - rng.integers(0, 4, n)], 1)

    def qa(c, b):
        return QuantizedArray(codes=F.pack_nibbles(jnp.asarray(c, jnp.uint8)), scales=jnp.asarray(b, jnp.uint8),
                              tensor_scale=jnp.float32(1.0), fmt=MXFP4(), dtype=np.dtype(np.float32))

    a, w = qa(codes_a, bytes_a), qa(codes_w, bytes_w)
    for order in ("even_odd", "natural"):
        y = G8.fp8_matmul(a, _prepare_weight(w, order=order), out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y, np.float64), G8.fp8_matmul_reference(a, w))
    assert float(jnp.max(jnp.abs(y))) > 0


@pytest.mark.parametrize("storage", ["e4m3", "mxfp4"])
def test_random_within_accumulation_bound(storage):
    m, n, k = 40, 48, 512
    a, w = _operands(1, m, n, k)
    assert int(jnp.max(_row_spans(a))) <= FE.E4M3_SPAN  # in range: only the summation order differs
    rng = np.random.default_rng(2)
    h, left = (jnp.asarray(_normal(rng, (rows, 32), 0.1).astype(jnp.bfloat16)) for rows in (m, n))
    bias = jnp.asarray(_normal(rng, (n,)))
    wp = _prepare_weight(w, storage=storage)
    y, inexact = G8.fp8_matmul(a, wp, lowrank=(h, left), bias=bias, out_dtype=jnp.float32, return_inexact=True)
    assert int(inexact) == 0
    ref = G8.fp8_matmul_reference(a, w, lowrank=(h, left), bias=bias)
    h64, l64 = np.asarray(h, np.float64), np.asarray(left, np.float64)
    bound = _acc_bound(np.abs(_dense(a)), np.abs(_dense(w)), k + 34) + _acc_bound(np.abs(h64), np.abs(l64), k + 34)
    bound += 2.0 ** -24 * np.abs(ref)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)
    # the default bf16 output: one more rounding
    yb = G8.fp8_matmul(a, wp, lowrank=(h, left), bias=bias)
    assert yb.dtype == jnp.bfloat16
    assert np.all(np.abs(np.asarray(yb, np.float64) - ref) <= bound + 2.0 ** -8 * np.abs(ref))
    # memory of the two storages
    nbytes = G8.weight_nbytes(wp)
    assert nbytes == (n * k + 4 * n if storage == "e4m3" else n * k // 2 + n * k // 32 + 4)


def test_split_k_and_bf16_gemm_output():
    m, n, k = 24, 32, 768
    a, w = _operands(3, m, n, k)
    ref = G8.fp8_matmul_reference(a, w)
    bound = _acc_bound(np.abs(_dense(a)), np.abs(_dense(w)), k) + 2.0 ** -24 * np.abs(ref)
    y = G8.fp8_matmul(a, _prepare_weight(w), k_split=256, out_dtype=jnp.float32)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)
    yb = G8.fp8_matmul(a, _prepare_weight(w), gemm_dtype=jnp.bfloat16, out_dtype=jnp.float32)
    assert np.all(np.abs(np.asarray(yb, np.float64) - ref) <= bound + 2.0 ** -8 * np.abs(ref))
    with pytest.raises(ValueError, match="k_split"):
        G8.fp8_matmul(a, _prepare_weight(w), k_split=100)


def test_out_of_range_rows_are_counted_and_bounded():
    m, n, k = 8, 16, 128
    a, w = _operands(4, m, n, k, spread=0.5)
    scales = np.asarray(a.scales).copy()
    scales[2, 3] = scales[2].max() - 20  # one block 20 binades below its row's largest: out of range
    a = QuantizedArray(codes=a.codes, scales=jnp.asarray(scales), tensor_scale=a.tensor_scale, fmt=a.fmt,
                       dtype=a.dtype)
    assert int(_row_spans(a)[2]) > FE.E4M3_SPAN
    y, inexact = G8.fp8_matmul(a, _prepare_weight(w), out_dtype=jnp.float32, return_inexact=True)
    rows = _mxfp4_to_e4m3(a)
    assert int(inexact) == int(rows.inexact) > 0
    ref = G8.fp8_matmul_reference(a, w)
    # the rounding moves each affected activation by <= 2**-10 * 2**e_ref of its row
    err_a = 2.0 ** -10 * np.asarray(rows.scale, np.float64)[:, None] * np.ones((m, k))
    bound = _acc_bound(np.abs(_dense(a)), np.abs(_dense(w)), k) + err_a @ np.abs(_dense(w)).T
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound + 2.0 ** -24 * np.abs(ref))


def test_nan_blocks_propagate_like_the_dequantized_product():
    m, n, k = 6, 8, 64
    a, w = _operands(5, m, n, k)
    sa, sw = np.asarray(a.scales).copy(), np.asarray(w.scales).copy()
    sa[1, 0], sw[3, 1] = F.E8M0_NAN, F.E8M0_NAN

    def rep(q, s):
        return QuantizedArray(codes=q.codes, scales=jnp.asarray(s), tensor_scale=q.tensor_scale, fmt=q.fmt,
                              dtype=q.dtype)

    a, w = rep(a, sa), rep(w, sw)
    y = np.asarray(G8.fp8_matmul(a, _prepare_weight(w), out_dtype=jnp.float32))
    ref = G8.fp8_matmul_reference(a, w)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert np.isnan(y[1]).all() and np.isnan(y[:, 3]).all() and np.isfinite(np.delete(np.delete(y, 1, 0), 3, 1)).all()


def test_w4a8_per_token_activations():
    m, n, k = 16, 32, 256
    x = jnp.asarray(_normal(np.random.default_rng(6), (m, k), 3.0))
    _, w = _operands(7, m, n, k)
    a8 = _per_token_e4m3(x, order="even_odd")  # the weight's K order (prepare_weight's default)
    with pytest.raises(ValueError, match="order"):
        G8.fp8_matmul(_per_token_e4m3(x), _prepare_weight(w))
    y = G8.fp8_matmul(a8, _prepare_weight(w), out_dtype=jnp.float32)
    ref = G8.fp8_matmul_reference(a8, w)
    a_abs = np.abs(np.asarray(FE.dequantize_rows(a8), np.float64))
    # products of a per-token E4M3 value (4 bits) and an E4M3 weight (<= 3 bits) times the f32 scale: 2 roundings
    bound = (k + 3) * 2.0 ** -24 * (a_abs @ np.abs(_dense(w)).T) + 2.0 ** -24 * np.abs(ref)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)
    # W4A8 is closer to the unquantized activations' product than W4A4
    exact = np.asarray(x, np.float64) @ _dense(w).T
    y4 = np.asarray(G8.fp8_matmul(F.quantize(x), _prepare_weight(w), out_dtype=jnp.float32), np.float64)
    assert np.linalg.norm(np.asarray(y, np.float64) - exact) < 0.5 * np.linalg.norm(y4 - exact)


def test_xla_program_is_one_fp8_dot():
    a, w = _operands(8, 16, 32, 128)
    jaxpr = jax.make_jaxpr(lambda a, w: G8.fp8_matmul(a, w))(a, _prepare_weight(w))
    text = str(jaxpr)
    assert text.count("dot_general") == 1
    assert "f8_e4m3fn[16,128]" in text and "f8_e4m3fn[32,128]" in text and "preferred_element_type=float32" in text


def test_errors():
    a, w = _operands(9, 8, 16, 64)
    with pytest.raises(TypeError, match="MXFP4"):
        G8.prepare_weight(F.quantize(jnp.ones((16, 64)), NVFP4()))
    with pytest.raises(ValueError, match="storage"):
        G8.prepare_weight(w, storage="fp16")
    with pytest.raises(ValueError, match="must be"):
        G8.fp8_matmul(a, _prepare_weight(F.quantize(jnp.ones((16, 96)))))
    with pytest.raises(ValueError, match="accumulation"):
        G8.fp8_matmul(a, _prepare_weight(w), accumulation="exact")
    with pytest.raises(TypeError, match="Fp8Rows"):
        G8.fp8_matmul(jnp.ones((8, 64)), _prepare_weight(w))


# ---------------------------------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------------------------------


def _kron_params(rng, d):
    """KroQuant (Kronecker-LU) parameters near the init."""
    return jax.tree.map(lambda v: np.asarray(v) + _normal(rng, np.shape(v), 0.05), transforms.get("kron_lu").init(d))


def _layer_factors(seed, o, d, rank, bias):
    """A layer's random ``W``, bias, KroQuant parameters and low-rank factors."""
    rng = np.random.default_rng(seed)
    w, params = _normal(rng, (o, d), 1 / np.sqrt(d)), _kron_params(rng, d)
    lowrank = (_normal(rng, (o, rank), 0.05), _normal(rng, (rank, d), 0.05)) if rank else None
    return w, _normal(rng, (o,), 0.3) if bias else None, params, lowrank


# the layer preparations, each one jitted program (the same jnp ops; integer and exact conversions, the same bytes)
_serve = jax.jit(served.serve, static_argnames=("swiglu", "transform_kernel", "strategy"))
_prepare_fp8_layer = jax.jit(G8.prepare_fp8_layer, static_argnames=("act", "weight_storage", "act_encode"))


@functools.lru_cache(maxsize=None)  # tests that take the same layer share it (frozen pytrees)
def _served(seed, o, d, rank=32, bias=True, swiglu=False):
    w, b, params, lowrank = _layer_factors(seed, o, d, rank, bias)
    layer = build_qlinear(w, b, transform="kron_lu", transform_params=params, lowrank=lowrank)
    return _serve(layer, swiglu=swiglu)


def _dequant(s, x, impl=None, **kw):
    return served.forward(s, x, options=served.ServeOptions(impl=impl), **kw)


def _x(seed, m, d):
    x = _normal(np.random.default_rng(seed), (m, d))
    x[:, 3] *= 15.0  # an outlier channel
    return jnp.asarray(x.astype(jnp.bfloat16))


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_layer_w4a4_equals_float64_reference(impl):
    s_layer = _served(10, 64, 128)
    layer = _prepare_fp8_layer(s_layer)
    assert isinstance(layer.weight, FE.Fp8Rows) and layer.left.dtype == jnp.bfloat16
    x = _x(11, 2 * 10, 128).reshape(2, 10, 128)
    y, inexact = G8.fp8_linear_forward(layer, x, impl=impl, out_dtype=jnp.float32, return_inexact=True)
    assert y.shape == (2, 10, 64) and int(inexact) == 0
    ref = G8.fp8_linear_reference(layer, x)
    rel = np.linalg.norm(np.asarray(y, np.float64).reshape(20, 64) - ref) / np.linalg.norm(ref)
    assert rel < 1e-6  # f32 accumulation order only (the quantized activations are the same codes)
    # the same layer on the dequant strategy (bf16 output) agrees to the bf16 rounding
    yd = _dequant(s_layer, x, impl=impl, out_dtype=jnp.float32)
    yf = G8.fp8_linear_forward(layer, x, impl=impl)
    assert yf.dtype == jnp.bfloat16
    assert np.linalg.norm(np.asarray(yf, np.float64) - np.asarray(yd, np.float64)) <= 4e-3 * np.linalg.norm(ref)


def test_layer_ops_and_w4a8():
    s_layer = _served(12, 64, 64)
    x = _x(13, 12, 64)
    layer = _prepare_fp8_layer(s_layer)
    nw = jnp.asarray(1.0 + _normal(np.random.default_rng(14), (32,), 0.1))
    norm = dict(op="rmsnorm", norm_weight=nw, head_dim=32, eps=1e-5)
    y = G8.fp8_linear_forward(layer, x, **norm)
    ref = G8.fp8_linear_reference(layer, x, **norm)
    assert np.linalg.norm(np.asarray(y, np.float64) - ref) <= 6e-3 * np.linalg.norm(ref)
    yd = _dequant(s_layer, x, **norm, out_dtype=jnp.float32)
    assert np.linalg.norm(np.asarray(y, np.float64) - np.asarray(yd, np.float64)) <= 6e-3 * np.linalg.norm(ref)

    served13 = _served(15, 128, 64, swiglu=True)
    l13 = _prepare_fp8_layer(served13)
    y = G8.fp8_linear_forward(l13, x, op="swiglu")
    assert y.shape == (12, 64)
    yd = _dequant(served13, x, op="swiglu", out_dtype=jnp.float32)
    assert np.linalg.norm(np.asarray(y, np.float64) - np.asarray(yd, np.float64)) <= 8e-3 * np.linalg.norm(yd)
    with pytest.raises(ValueError, match="swiglu"):
        G8.fp8_linear_forward(l13, x)

    # W4A8: closer to the unquantized-activation layer than W4A4
    l8 = _prepare_fp8_layer(s_layer, act="fp8")
    y8 = np.asarray(G8.fp8_linear_forward(l8, x, out_dtype=jnp.float32), np.float64)
    y4 = np.asarray(G8.fp8_linear_forward(layer, x, out_dtype=jnp.float32), np.float64)
    xt = np.asarray(tq_apply(s_layer, x), np.float64)
    exact = xt @ _dense(s_layer.weight).T + G8.fp8_matmul_reference(
        jnp.zeros((12, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32),
        lowrank=(jnp.matmul(x, s_layer.right.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), l8.left),
        bias=s_layer.bias)
    assert np.linalg.norm(y8 - exact) < 0.5 * np.linalg.norm(y4 - exact)


def tq_apply(s_layer, x):
    from pallas_kernels import transform_quantize as tq
    return tq.reference_apply(x.astype(jnp.float32), s_layer.transform)


def test_served_strategy_registered():
    d = 128  # test_layer_w4a4_equals_float64_reference's width and rows: its interpret-mode programs, compiled once
    rng = np.random.default_rng(17)
    qlayer = build_qlinear(_normal(rng, (32, d), 1 / 8), transform="kron_lu", transform_params=_kron_params(rng, d),
                           lowrank=(_normal(rng, (32, 32), 0.05), _normal(rng, (32, d), 0.05)))
    assert {"fp8", "fp8_w4a8"} <= set(served.strategy_names())
    x = _x(18, 20, d)
    for name in ("fp8", "fp8_w4a8"):
        layer = _serve(qlayer, strategy=name)
        assert isinstance(layer, G8.Fp8Linear) and layer.act == ("fp8" if name == "fp8_w4a8" else "mxfp4")
        opts = served.ServeOptions(strategy=name, impl="interpret")
        y = served.forward(layer, x, options=opts, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(G8.fp8_linear_forward(layer, x, impl="interpret",
                                                                                      out_dtype=jnp.float32)))
        ref = served.reference(layer, x, strategy=name, out_dtype=jnp.float32)
        assert np.linalg.norm(np.asarray(y) - np.asarray(ref)) <= 1e-5 * np.linalg.norm(np.asarray(ref))
    with pytest.raises(ValueError, match="not read"):
        served.ServeOptions(strategy="fp8", fused=True)


def test_prepare_errors():
    s_layer = _served(16, 32, 64, rank=0, bias=False)
    with pytest.raises(ValueError, match="act"):
        G8.prepare_fp8_layer(s_layer, act="int8")
    layer = _prepare_fp8_layer(s_layer, weight_storage="mxfp4")
    assert isinstance(layer.weight, QuantizedArray) and layer.left is None
    with pytest.raises(ValueError, match="features"):
        G8.fp8_linear_forward(layer, jnp.ones((4, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="impl"):
        G8.fp8_linear_forward(layer, jnp.ones((4, 64), jnp.bfloat16), impl="cuda")


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_quantizer_fp8_output_gives_the_same_layer_output(impl):
    """act_encode="kernel" (the quantizer writes E4M3 + row powers of two) and "two_phase" (packed MXFP4 re-encoded by
    a Pallas kernel) against "xla" (re-encoded by XLA): the same GEMM operands, so the same output bit for bit, and
    the same out-of-range count."""
    s_layer = _served(20, 64, 128)
    x = _x(21, 19, 128)
    x = x.at[3, :32].multiply(2.0**20).at[5].set(0.0)  # an out-of-range row (before the transform) and a zero row
    y = {}
    for enc in G8.ACT_ENCODES:
        layer = _prepare_fp8_layer(s_layer, act_encode=enc)
        assert layer.act_encode == enc
        y[enc] = G8.fp8_linear_forward(layer, x, impl=impl, out_dtype=jnp.float32, return_inexact=True)
        if impl == "interpret":  # the kernel's FP8 mode (pre-pass + quantizing pass) runs only for "kernel"
            text = str(jax.make_jaxpr(lambda v, lay=layer: G8.fp8_linear_forward(lay, v, impl=impl))(x))
            assert ("_mxfp4_max_byte" in text and "_mxfp4_fp8" in text) == (enc == "kernel")
    for enc in ("kernel", "two_phase"):
        np.testing.assert_array_equal(np.asarray(y[enc][0]), np.asarray(y["xla"][0]))
        assert int(y[enc][1]) == int(y["xla"][1]) > 0
    assert G8.DEFAULT_ACT_ENCODE in G8.ACT_ENCODES
    with pytest.raises(ValueError, match="act_encode"):
        G8.prepare_fp8_layer(s_layer, act_encode="triton")
