"""CPU tests of the fused transform + FP4 quantizer (``pallas_kernels.transform_quantize``).

* The per-tile functions the kernels call, bit for bit against ``kroquant_jax.formats`` (all scale modes, rounding
  boundaries, subnormals, NaN/Inf, zero blocks).
* The kernels themselves through ``pallas_call(interpret=True)`` (``TestInterpretKernels``): exact data, ragged m,
  poisoned outputs, every kind, MXFP4 and NVFP4.
* The dispatch (reference on CPU), ``prepare`` for every registered transform, and the STE ``custom_vjp``.

GPU runs of the same kernels: ``tests/gpu/test_transform_quantize_gpu.py`` (``pytest -m gpu`` on the H200).
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
from tq_cases import exact_activations as _exact_activations  # noqa: E402
from tq_cases import exact_transform as _exact_transform  # noqa: E402

ALL_MODES = list(ScaleMode)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------


def _boundary_blocks(rng, n_blocks):
    """f32 (n_blocks, 32): E2M1 thresholds and grid points (with 1-ulp jitter) at random exponents, plus specials."""
    base = rng.choice(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1, 1.5, 2, 3, 4, 7.99, 8.0]),
                      size=(n_blocks, 32))
    jitter = rng.choice([1.0, 1 + 2**-23, 1 - 2**-24, 1 + 2**-20, 1 - 2**-20], size=(n_blocks, 32))
    e = rng.integers(-130, 126, size=(n_blocks, 1)).astype(np.float64)
    with np.errstate(over="ignore"):
        y = (base * jitter * rng.choice([-1, 1], size=(n_blocks, 32)) * np.exp2(e)).astype(np.float32)
    y[::7, 3] = rng.normal(size=y[::7, 3].shape) * 1e-39  # subnormals inside normal blocks
    y[::11] = (rng.normal(size=(len(y[::11]), 32)) * 1e-38).astype(np.float32)  # blocks near/below min normal
    y[5, 7] = np.nan
    y[9, 1] = np.inf
    y[21, 4] = -np.inf
    y[13] = 0.0
    y[17] = -0.0
    y[25] = np.float32(2.0**-126) * rng.integers(0, 4, size=32)
    y[26] = np.float32(2.0**-122) * rng.random(32)
    y[27] = 3.0e38 * rng.choice([-1, 1], size=32)
    return y






def _learned_kron(d, key):
    return jax.tree.map(lambda x: x * (1 + 0.2 * jax.random.normal(key, x.shape)), T.KRON_LU.init(d))


def _scale_bytes(q):
    s = q.scales
    return np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8) if s.dtype != jnp.uint8 else s)


def _assert_same(q, r):
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.asarray(r.tensor_scale))


# ---------------------------------------------------------------------------------------------------------------------
# Per-tile functions
# ---------------------------------------------------------------------------------------------------------------------


class TestTileFunctions:
    @pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
    def test_mx_tiles_match_formats(self, mode):
        y = _boundary_blocks(np.random.default_rng(0), 6000)
        codes, scales = F.mxfp4_quantize_blocks(jnp.asarray(y), mode)
        ref_packed = np.asarray(F.pack_nibbles(codes))
        ref_scales = np.asarray(scales)
        wide = jnp.asarray(y.reshape(-1, 128))
        for fn in (fp4_tile.mx_quantize_tile, lambda y, mode: fp4_tile.quantize_tile(MXFP4(scale_mode=mode), y)):
            packed, s = jax.jit(fn, static_argnums=1)(wide, mode)
            np.testing.assert_array_equal(np.asarray(packed).reshape(-1, 16), ref_packed)
            np.testing.assert_array_equal(np.asarray(s).reshape(-1), ref_scales)
        packed, s = jax.jit(fp4_tile.mx_quantize_pair, static_argnums=2)(jnp.asarray(y[:, 0::2]), jnp.asarray(y[:, 1::2]),
                                                                   mode)
        np.testing.assert_array_equal(np.asarray(packed), ref_packed)
        np.testing.assert_array_equal(np.asarray(s)[:, 0], ref_scales)

    def test_nv_tile_matches_formats(self):
        rng = np.random.default_rng(1)
        y = (rng.normal(size=(512, 64)) * np.exp2(rng.integers(-20, 20, size=(512, 1)))).astype(np.float32)
        y[3, 5] = np.nan
        y[7, 40] = -np.inf
        y[9] = 0.0
        y[11, :16] = 1e-40
        for ts in (F.nvfp4_tensor_scale(jnp.asarray(np.where(np.isfinite(y), y, 0))), jnp.float32(1e-3)):
            codes, scales = F.nvfp4_quantize_blocks(jnp.asarray(y).reshape(512, 4, 16), ts)
            packed, s = jax.jit(fp4_tile.nv_quantize_tile)(jnp.asarray(y), ts, jnp.float32(1.0) / ts)
            np.testing.assert_array_equal(np.asarray(packed), np.asarray(F.pack_nibbles(codes.reshape(512, 64))))
            np.testing.assert_array_equal(np.asarray(s),
                                          np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)))
            packed2, s2 = fp4_tile.quantize_tile(NVFP4(), jnp.asarray(y), (ts, jnp.float32(1.0) / ts))
            np.testing.assert_array_equal(np.asarray(packed2), np.asarray(packed))
            np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
        with pytest.raises(ValueError, match="no tile quantizer"):
            fp4_tile.quantize_tile(NVFP4(block_size=32), jnp.asarray(y))

    def test_kron_block_exact_for_dyadic_params(self):
        t = _exact_transform("k2s", 64, jax.random.key(30))
        build = jax.jit(lambda kp, inv: tq._kron_block(lambda i: kp[i], inv))
        for j in range(2):
            np.testing.assert_array_equal(np.asarray(build(t.kparams[j], t.inv_scale.reshape(2, 32)[j][:, None])),
                                          np.asarray(t.dense_blocks()[j]))

    def test_kron_block_streaming_product_is_kron_lu(self):
        params = _learned_kron(64, jax.random.key(3))
        t = tq.prepare("smoothed_kron", {"kron": params, "log_gamma": 0.3 * jax.random.normal(jax.random.key(4), (64,))})
        ref = np.asarray(T.SMOOTHED_KRON.blocks({"kron": params, "log_gamma": -jnp.log(t.inv_scale)}))
        @jax.jit
        def build(kp, inv_col):
            return [tq._kron_block(lambda i: kp[i], inv_col, parity) for parity in (None, 0, 1)]

        for j in range(2):
            full, even, odd = build(t.kparams[j], t.inv_scale.reshape(2, 32)[j][:, None])
            # c*b - 1/a may be contracted into an FMA by the compiler (XLA:CPU fusions, ptxas): ~1 ulp.
            np.testing.assert_allclose(np.asarray(full), np.asarray(t.dense_blocks()[j]), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(np.asarray(full), ref[j], rtol=2e-6, atol=1e-7)
            np.testing.assert_array_equal(np.asarray(even), np.asarray(full)[:, 0::2])
            np.testing.assert_array_equal(np.asarray(odd), np.asarray(full)[:, 1::2])

    @pytest.mark.parametrize("stages", ["kernel", "reference"])
    def test_fwht_rows_exact(self, stages):
        a = _exact_activations(jax.random.key(5), 4, 256, jnp.float32)
        fn = tq._fwht_rows if stages == "kernel" else tq._fwht_rows_axis
        got = jax.jit(lambda x: fn(x) * tq._fwht_scale(256))(a)
        ref = T.apply_to_activations(a, T.FWHT.blocks(T.FWHT.init(256)))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_dot_split_is_f32_faithful(self, dtype):
        x = jax.random.normal(jax.random.key(6), (16, 32)).astype(dtype)
        k = jax.random.normal(jax.random.key(7), (32, 32), jnp.float32)
        ref = np.asarray(x, np.float64) @ np.asarray(k, np.float64)
        dot = jax.jit(tq._dot_split, static_argnums=2)
        errs = {p: np.max(np.abs(np.asarray(dot(x, k, p)) - ref) / (np.abs(ref) + 1)) for p in (1, 2, 3)}
        assert errs[3] < 1e-6 and errs[1] > 1e-4, errs


# ---------------------------------------------------------------------------------------------------------------------
# The kernels, in Pallas interpret mode (interpret=True)
# ---------------------------------------------------------------------------------------------------------------------


def _poisoned(a, t, fmt, bs):
    """Runs the kernel (interpret mode) into outputs poisoned with 0x00 and 0xFF; both runs must agree."""
    m, d = a.shape
    run = jax.jit(lambda a, t, p0, p1: tq.transform_quantize(a, t, fmt, block_sizes=bs, impl="interpret",
                                                             poison_outputs=(p0, p1)))  # one trace for both poisons
    outs = []
    for byte in (0x00, 0xFF):
        outs.append(run(a, t, jnp.full((m, d // 2), byte, jnp.uint8),
                        jnp.full((m, d // fmt.block_size), byte, jnp.uint8)))
    _assert_same(outs[0], outs[1])
    return outs[0]


SMALL = tq.BlockSizes(block_rows=16, block_cols=128)


class TestInterpretKernels:
    """``pallas_call(..., interpret=True)`` of the very kernel bodies that run on the GPU."""

    @pytest.mark.parametrize("kind", tq.KINDS)
    def test_exact_mxfp4(self, kind):
        m, d = 37, 256  # ragged last row tile (16-row tiles), two 128-column tiles of 4 blocks
        a = _exact_activations(jax.random.key(10), m, d, jnp.bfloat16)
        t = _exact_transform(kind, d, jax.random.key(11))
        _assert_same(_poisoned(a, t, MXFP4(), SMALL), tq.reference_transform_quantize(a, t, MXFP4(), dense_fwht=True))

    @pytest.mark.parametrize("kind", ["k1", "k2s", "scale"])
    def test_exact_other_tilings_fp16(self, kind):
        m, d = 21, 96  # d = 32 * 3: 32-column tiles, 2 fp16 parts
        a = _exact_activations(jax.random.key(12), m, d, jnp.float16)
        t = _exact_transform(kind, d, jax.random.key(13))
        bs = tq.BlockSizes(block_rows=16, dot_passes=2)
        _assert_same(_poisoned(a, t, MXFP4(scale_mode=ScaleMode.EVEN), bs),
                     tq.reference_transform_quantize(a, t, MXFP4(scale_mode=ScaleMode.EVEN)))

    @pytest.mark.parametrize("kind", ["q4", "k1"])
    def test_exact_nvfp4(self, kind):
        m, d = 37, 128
        a = _exact_activations(jax.random.key(14), m, d, jnp.float16)
        t = _exact_transform(kind, d, jax.random.key(15))
        _assert_same(_poisoned(a, t, NVFP4(), SMALL), tq.reference_transform_quantize(a, t, NVFP4()))
        ts = jnp.float32(0.01)  # a fixed (calibrated) tensor scale: one pass
        _assert_same(tq.transform_quantize(a, t, NVFP4(), tensor_scale=ts, block_sizes=SMALL, impl="interpret"),
                     tq.reference_transform_quantize(a, t, NVFP4(), tensor_scale=ts))

    def test_general_data_bounded_mismatch(self):
        m, d = 64, 256
        x = jax.random.normal(jax.random.key(16), (m, d)) * jnp.where(
            jax.random.bernoulli(jax.random.key(17), 0.05, (1, d)), 30.0, 1.0)
        a = x.astype(jnp.bfloat16)
        t = tq.prepare("smoothed_kron", {"kron": _learned_kron(d, jax.random.key(18)),
                                         "log_gamma": 0.5 * jax.random.normal(jax.random.key(19), (d,))})
        q = _poisoned(a, t, MXFP4(), SMALL)
        r = tq.reference_transform_quantize(a, t, MXFP4())
        assert np.mean(np.asarray(q.codes) != np.asarray(r.codes)) <= 2e-3
        assert np.mean(_scale_bytes(q) != _scale_bytes(r)) <= 2e-3


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch, prepare, STE
# ---------------------------------------------------------------------------------------------------------------------


class TestDispatch:
    @pytest.mark.parametrize("name", ["identity", "diagonal", "kron_lu", "smoothed_kron", "hadamard32", "dense32",
                                      "fwht"])
    def test_prepare_and_reference_match_library(self, name):
        d = 128
        p = T.get(name)
        params = p.init(d, jax.random.key(20))
        if p.trainable:
            params = jax.tree.map(lambda v: v + 0.1 * jax.random.normal(jax.random.key(21), v.shape), params)
        a = jax.random.normal(jax.random.key(22), (3, 5, d)).astype(jnp.bfloat16)  # leading dims are flattened
        expected = F.quantize(T.apply_to_activations(a, p.blocks(params)), MXFP4())
        for kernel in (None, "k1"):
            t = tq.prepare(name, params, kernel=kernel)
            q = tq.transform_quantize(a, t)  # CPU: the reference
            assert q.codes.shape == (3, 5, d // 2) and q.scales.shape == (3, 5, d // 32)
            if name == "fwht":  # butterflies vs the dense matrix: rounding may differ in rare elements
                assert np.mean(np.asarray(q.codes) != np.asarray(expected.codes)) < 1e-2
                continue
            _assert_same(q, expected)
        assert tq.prepare(name, params).kind == {"identity": "q4", "diagonal": "scale", "kron_lu": "k2",
                                                  "smoothed_kron": "k2s", "fwht": "fwht"}.get(name, "k1")

    def test_errors(self):
        t = tq.PreparedTransform.identity(64)
        with pytest.raises(ValueError, match="width"):
            tq.transform_quantize(jnp.ones((4, 96), jnp.bfloat16), t, impl="interpret")
        with pytest.raises(TypeError, match="bfloat16 or float16"):
            tq.transform_quantize(jnp.ones((4, 64), jnp.float32), t, impl="interpret")
        with pytest.raises(ValueError, match="block_rows"):
            tq.BlockSizes(block_rows=8)
        with pytest.raises(ValueError, match=r"BlockSizes.block_cols=96 must be 32 \* a power of two"):
            tq.BlockSizes(block_cols=96)
        with pytest.raises(ValueError, match="mxfp4 has no per-tensor scale"):
            tq.transform_quantize(jnp.ones((4, 64), jnp.bfloat16), t, MXFP4(), tensor_scale=jnp.float32(1.0))
        with pytest.raises(ValueError, match="the kernels write nvfp4 with 16-element blocks"):
            tq.transform_quantize(jnp.ones((4, 64), jnp.bfloat16), t, NVFP4(block_size=32), impl="interpret")
        with pytest.raises(ValueError, match="power of two"):
            tq.PreparedTransform.fwht(96)
        assert tq.BlockSizes(block_cols=256).cols_for(96) == 32 and tq.BlockSizes().cols_for(1152) == 128

    def test_ste_custom_vjp(self):
        m, d = 8, 64
        a = jax.random.normal(jax.random.key(23), (m, d)).astype(jnp.bfloat16)
        t = tq.prepare("kron_lu", _learned_kron(d, jax.random.key(24)))
        w = jax.random.normal(jax.random.key(25), (m, d))

        def loss(x, tt):
            return jnp.sum(tq.transform_fake_quant(x, tt).astype(jnp.float32) * w)

        out = tq.transform_fake_quant(a, t)
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(F.dequantize(tq.reference_transform_quantize(a, t)), np.float32))
        ga, gt = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, t)
        _, vjp = jax.vjp(lambda x, tt: tq._apply_f32(x, tt), a, t)
        ea, et = vjp(w.astype(jnp.bfloat16).astype(jnp.float32))  # the cotangent of a bf16 output is bf16
        np.testing.assert_allclose(np.asarray(ga, np.float32), np.asarray(ea.astype(jnp.bfloat16), np.float32))
        np.testing.assert_allclose(np.asarray(gt.kparams), np.asarray(et.kparams), rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(gt.kparams[:, :15])).sum() > 0
        # integer outputs: differentiable graph, zero gradient
        g0 = jax.grad(lambda x: jnp.sum(tq.transform_quantize(x, t).codes.astype(jnp.float32)))(a.astype(jnp.float32))
        assert not np.any(np.asarray(g0))


@pytest.mark.parametrize("kind,fmt", [("k2", MXFP4()), ("k2s", MXFP4()), ("k1", NVFP4())])
def test_interpret_fori_tiles_exact(kind, fmt):
    """Wide tiles of 32-column blocks walked by ``lax.fori_loop``, dynamic column offsets (and NVFP4's amax pass)."""
    m, d = 37, 256
    a = _exact_activations(jax.random.key(50), m, d, jnp.bfloat16)
    t = _exact_transform(kind, d, jax.random.key(51))
    bs = tq.BlockSizes(block_rows=16, block_cols=256, num_stages=3)
    _assert_same(_poisoned(a, t, fmt, bs), tq.reference_transform_quantize(a, t, fmt))


# ---------------------------------------------------------------------------------------------------------------------
# NVFP4 divisions: the block scale (amax / 6) / ts and the reciprocal (1 / ts) / s must be correctly rounded
# ---------------------------------------------------------------------------------------------------------------------


def _nv_division_cases():
    from tq_cases import NVFP4_DIVISION_CASES, nvfp4_division_stress, nvfp4_found_case_vectors

    for amax, ts in NVFP4_DIVISION_CASES:  # the found cases of tests/test_formats.py, one tensor scale each
        yield nvfp4_found_case_vectors(amax), ts
    yield nvfp4_division_stress(0.0123, n_blocks=256), 0.0123  # next to E4M3 midpoints and E2M1 thresholds


def test_nv_tile_divisions_correctly_rounded_under_jit():
    """The stress data separates exact division from XLA's reciprocal rewrite (the test has teeth)."""
    from tq_cases import nvfp4_division_stress

    ts = jnp.float32(0.0123)
    y = jnp.asarray(nvfp4_division_stress(0.0123, n_blocks=1024).reshape(-1, 32))
    ref_codes, ref_scales = F.nvfp4_quantize_blocks(y.reshape(-1, 2, 16), ts)
    ref_bytes = np.asarray(jax.lax.bitcast_convert_type(ref_scales, jnp.uint8)).reshape(-1, 2)
    packed, s = jax.jit(fp4_tile.nv_quantize_tile)(y, ts, jnp.float32(1.0) / ts)
    np.testing.assert_array_equal(np.asarray(s), ref_bytes)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(F.pack_nibbles(ref_codes.reshape(-1, 32))))
    _, s_plain = jax.jit(lambda y: fp4_tile.nv_quantize_tile(y, ts, jnp.float32(1.0) / ts, divide=lambda a, b: a / b))(y)
    assert np.sum(np.asarray(s_plain) != ref_bytes) > 10  # jitted plain division is rewritten: scales move


def test_interpret_nvfp4_division_cases_exact():
    from tq_cases import exact_f32_scale_case

    for values, ts in _nv_division_cases():
        a, t = exact_f32_scale_case(values)
        q = tq.transform_quantize(a, t, NVFP4(), tensor_scale=jnp.float32(ts), block_sizes=SMALL, impl="interpret",
                                  round_to_input=False)
        _assert_same(q, tq.reference_transform_quantize(a, t, NVFP4(), tensor_scale=jnp.float32(ts),
                                                         round_to_input=False))


@pytest.mark.parametrize("block_cols", [64, 256])
def test_interpret_k1_joined_blocks_exact(block_cols):
    """K1, MXFP4, ``BD >= 64``: two block products joined into one 64-column tile (stack/transpose/reshape) and
    quantized at once (one chunk, or four walked by the ``fori_loop``)."""
    m, d = 37, 256
    a = _exact_activations(jax.random.key(52), m, d, jnp.bfloat16)
    t = _exact_transform("k1", d, jax.random.key(53))
    bs = tq.BlockSizes(block_rows=16, block_cols=block_cols, num_stages=3)
    _assert_same(_poisoned(a, t, MXFP4(), bs), tq.reference_transform_quantize(a, t, MXFP4()))
    y = tq.kernel_stage(a, t, MXFP4(), stage="transform", block_sizes=bs, impl="interpret")  # the joined tile itself
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(tq.reference_apply(a, t), np.float32))


@pytest.mark.parametrize("kind", ["scale", "k2"])
def test_interpret_kernel_stages(kind):
    """``kernel_stage``: the transform stage stores ``A T`` (the reference on exact data), the copy stage ``A``
    itself, for a leading batch shape and ragged m; a bad stage or impl is refused by name."""
    m, d = 21, 128
    a = _exact_activations(jax.random.key(54), m, d, jnp.float16).reshape(3, 7, d)
    t = _exact_transform(kind, d, jax.random.key(55))
    y = tq.kernel_stage(a, t, stage="transform", block_sizes=SMALL, impl="interpret")
    assert y.shape == a.shape and y.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(tq.reference_apply(a, t), np.float32))
    copied = tq.kernel_stage(a, t, stage="copy", block_sizes=SMALL, impl="interpret")
    np.testing.assert_array_equal(np.asarray(copied), np.asarray(a))
    with pytest.raises(ValueError, match="stage='quantize'"):
        tq.kernel_stage(a, t, stage="quantize", impl="interpret")
    with pytest.raises(ValueError, match="impl='reference'"):
        tq.kernel_stage(a, t, stage="copy", impl="reference")


@pytest.mark.parametrize("fmt", [MXFP4(), NVFP4()])
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_empty_batch_round_trips(fmt, impl):
    """An empty batch ``(0, d)`` (and ``(2, 0, d)``) through the reference and the interpret path: same empty shape,
    fake-quant and its gradient too."""
    t = _exact_transform("k1", 64, jax.random.key(54))
    for shape in ((0, 64), (2, 0, 64)):
        a = jnp.zeros(shape, jnp.bfloat16)
        q = tq.transform_quantize(a, t, fmt, impl=impl)
        assert q.shape == shape and q.scales.shape == (*shape[:-1], 64 // fmt.block_size)
        assert q.scales.dtype == fmt.scale_dtype and float(q.tensor_scale) == 1.0
        assert F.dequantize(q).shape == shape
        fq = tq.transform_fake_quant(a, t, fmt, impl=impl)
        assert fq.shape == shape and fq.dtype == a.dtype
        ga, gt = jax.grad(lambda x, tt: jnp.sum(tq.transform_fake_quant(x, tt, fmt, impl=impl).astype(jnp.float32)),
                          argnums=(0, 1))(a, t)
        assert ga.shape == shape and gt.blocks.shape == t.blocks.shape
        np.testing.assert_array_equal(np.asarray(gt.blocks), 0.0)
