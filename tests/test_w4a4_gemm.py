"""W4A4 GEMM (pallas_kernels/w4a4_gemm.py): per-tile math, the Pallas kernel in interpret mode (the served layer's
strategies over these GEMMs: tests/test_served.py).

Exactness contract (module docstring): against the exact product of ``fake_quant(A)`` and ``fake_quant(W)`` the
kernel differs only by its fp32 additions: ``<= k * 2**-24 * (|A_hat| @ |W_hat|^T)`` (MXFP4), ``(k + 3) * ...``
(NVFP4, per-tensor scales applied once); against the f32 reference (its own additions) twice that.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax.formats import E2M1_VALUES, MXFP4, NVFP4, dequantize, fake_quant, quantize
from pallas_kernels import fp4_tile
from pallas_kernels import w4a4_gemm as g

# Jitted once per (shape, format): eager dispatch of the many small ops is what costs time on the CPU.
quantize = jax.jit(quantize, static_argnums=1)
fake_quant = jax.jit(fake_quant, static_argnums=1)
tiled_reference = jax.jit(g.w4a4_matmul_tiled_reference, static_argnames=("block_k", "compute"))


def _data(seed, m, n, k, outliers=True):
    ka, kw, ko = jax.random.split(jax.random.PRNGKey(seed), 3)
    a = jax.random.normal(ka, (m, k), jnp.float32) * 2.0
    w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
    if outliers:
        # Outlier channels and single huge values, tiny blocks, an all-zero block.
        a = a.at[:, 5].multiply(80.0).at[1, 40].set(-3.0e3)
        a = a.at[2, 64:96].multiply(1e-20)
        a = a.at[0, 0:32].set(0.0)
        w = w.at[3, :].multiply(50.0)
    return a, w


def _bound(qa, qw, k, extra_ulps=0):
    """Kernel vs the f32 reference: each is within ``(k + extra) u P`` of the exact product (u = 2**-24), so their
    difference is within twice that."""
    p = jnp.matmul(jnp.abs(dequantize(qa, jnp.float32)), jnp.abs(dequantize(qw, jnp.float32)).T, precision="highest")
    return 2 * (k + extra_ulps) * 2.0**-24 * p + 1e-30


FORMATS = [(MXFP4(), "bf16", 0), (NVFP4(), "bf16", 3), (MXFP4(), "fp8", 0)]


class TestTileMath:
    def test_e2m1_to_e4m3_bits_all_codes(self):
        codes = jnp.arange(16, dtype=jnp.int32)
        v = jax.lax.bitcast_convert_type(fp4_tile.e2m1_to_e4m3_bits(codes).astype(jnp.uint8), jnp.float8_e4m3fn)
        np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)) * 64.0, E2M1_VALUES)

    def test_unpack_tile_orders_low_nibble_first(self):
        codes = jnp.array([[0x21, 0xF7]], jnp.uint8)  # elements [1, 2, 7, 15]
        lo, hi = fp4_tile.unpack_tile_fp8(codes)
        np.testing.assert_array_equal(np.asarray(lo.astype(jnp.float32)) * 64, [[0.5, 6.0]])
        np.testing.assert_array_equal(np.asarray(hi.astype(jnp.float32)) * 64, [[1.0, -6.0]])
        full = fp4_tile.decode_tile_fp8(jnp.tile(codes, (1, 8)))
        np.testing.assert_array_equal(np.asarray(full.astype(jnp.float32))[0, :4] * 64, [0.5, 1.0, 6.0, -6.0])

    def test_mx_scale_multiplier_exact_range(self):
        s = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
        mult = np.asarray(MXFP4().scale_factors(s, fp4_tile.FP8_DECODE_OFFSET))
        for b in range(2, 249):
            assert mult[b] == np.float32(2.0 ** (b - 121))
        assert mult[0] == 0.0 and np.isnan(mult[255])

    def test_decode_tile_matches_dequantize(self):
        for fmt in (MXFP4(), NVFP4()):
            x = jax.random.normal(jax.random.PRNGKey(3), (8, 128)) * jnp.logspace(-3, 3, 128)
            q = quantize(x, fmt)
            scales = q.scales if q.scales.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
            lo, hi = jax.jit(fp4_tile.decode_tile_bf16, static_argnums=2)(q.codes, scales, fmt)
            full = jax.lax.stack([lo, hi], axis=2).reshape(8, 128).astype(jnp.float32) * q.tensor_scale
            ref = dequantize(q, jnp.float32)
            if not fmt.has_tensor_scale:
                np.testing.assert_array_equal(np.asarray(full), np.asarray(ref))
            else:  # the per-tensor scale is applied after the bf16 cast: one f32 rounding apart
                np.testing.assert_allclose(np.asarray(full), np.asarray(ref), rtol=2**-23, atol=0)

    @pytest.mark.parametrize("fmt,compute,extra", FORMATS)
    def test_tiled_reference_exact(self, fmt, compute, extra):
        m, n, k = 24, 40, 320
        a, w = _data(1, m, n, k)
        qa, qw = quantize(a, fmt), quantize(w, fmt)
        out = tiled_reference(qa, qw, block_k=64, compute=compute)
        ref = jnp.matmul(fake_quant(a, fmt), fake_quant(w, fmt).T, precision="highest")
        assert bool(jnp.all(jnp.abs(out - ref) <= _bound(qa, qw, k, extra)))

    def test_nan_scale_propagates_and_zero_block_is_zero(self):
        """A NaN block makes its whole output row NaN and no other; an all-zero block (E8M0 byte of a zero block)
        contributes exactly nothing: a row of zero blocks gives zeros, a zero block beside a live one leaves the live
        block's product (both compute modes)."""
        a, w = _data(2, 8, 16, 64, outliers=False)
        a = a.at[1, 3].set(jnp.nan)  # block (1, 0) gets the E8M0 NaN byte
        a = a.at[5].set(0.0).at[6, 32:].set(0.0)  # row 5: two zero blocks; row 6: a zero block beside a live one
        qa, qw = quantize(a, MXFP4()), quantize(w, MXFP4())
        live = np.array([0, 2, 3, 4, 5, 6, 7])
        ref = np.asarray(jnp.matmul(fake_quant(a, MXFP4()), fake_quant(w, MXFP4()).T, precision="highest"))[live]
        bound = np.asarray(_bound(qa, qw, 64))[live]
        for compute in ("bf16", "fp8"):
            out = np.asarray(tiled_reference(qa, qw, block_k=64, compute=compute))
            assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[live])), compute
            np.testing.assert_array_equal(out[5], 0.0, err_msg=compute)
            assert np.all(np.abs(out[live] - ref) <= bound), compute

    def test_choose_block_sizes(self):
        bs = g.choose_block_sizes(40, 2240, 5600)
        assert bs.block_m == 64 and 2240 % bs.block_n == 0 and bs.block_k == 32
        assert g.choose_block_sizes(4096, 4608, 4608) == g.BlockSizes(128, 128, 128, 8, 3)
        assert g.BlockSizes().n_sub == 1
        with pytest.raises(ValueError, match="block_m=48 must be a power of two"):
            g.BlockSizes(block_m=48)


class TestInterpretKernel:
    """The Pallas kernel itself, run with ``interpret=True`` on the CPU."""

    BS = g.BlockSizes(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)

    @pytest.mark.parametrize("fmt,compute,extra", FORMATS)
    def test_exact_against_fake_quant_ragged_poisoned(self, fmt, compute, extra):
        m, n, k = 37, 40, 160  # ragged m (2 * 16 + 5); n, k no multiples of block_n = 32, block_k = 64 (padded)
        a, w = _data(4, m, n, k)
        qa, qw = quantize(a, fmt), quantize(w, fmt)
        poison = jnp.full((m, n), jnp.nan, jnp.float32)
        out = g.w4a4_matmul(qa, qw, block_sizes=self.BS, compute=compute, out_dtype=jnp.float32, out=poison,
                            interpret=True)
        assert out.shape == (m, n) and bool(jnp.all(jnp.isfinite(out))), "unwritten (poisoned) outputs"
        ref = jnp.matmul(fake_quant(a, fmt), fake_quant(w, fmt).T, precision="highest")
        assert bool(jnp.all(jnp.abs(out - ref) <= _bound(qa, qw, k, extra)))

    def test_packed_lowrank_factor_matches_dense(self):
        """L packed in MXFP4 and decoded in the epilogue == the same L dequantized to bf16 (h permuted to match).

        Also two W sub-tiles per program (``n_sub=2``: one A decode shared by both)."""
        m, n, k, r = 16, 64, 64, 64
        a, w = _data(9, m, n, k, outliers=False)
        qa, qw = quantize(a, MXFP4()), quantize(w, MXFP4())
        left_q = quantize(0.1 * jax.random.normal(jax.random.PRNGKey(1), (n, r)), MXFP4())
        h = jax.random.normal(jax.random.PRNGKey(2), (m, r)).astype(jnp.bfloat16)  # natural column order
        perm = g.even_odd_permutation(r)
        np.testing.assert_array_equal(perm[:4], [0, 2, 4, 6])
        bs = g.BlockSizes(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, n_sub=2)
        bias = jax.random.normal(jax.random.PRNGKey(3), (n,))
        poison = jnp.full((m, n), jnp.nan, jnp.float32)
        y_packed = g.w4a4_matmul(qa, qw, lowrank=(h[:, perm], left_q), bias=bias, block_sizes=bs,
                                 out_dtype=jnp.float32, out=poison, interpret=True)
        dense = dequantize(left_q, jnp.float32).astype(jnp.bfloat16)
        ref = g.w4a4_matmul_reference(qa, qw, lowrank=(h, dense), bias=bias)
        np.testing.assert_allclose(np.asarray(y_packed), np.asarray(ref), rtol=1e-5, atol=1e-5)

    def test_rejects_mismatched_operands(self):
        qa = quantize(jnp.ones((16, 64)), MXFP4())
        with pytest.raises(TypeError, match="both packed in one format or both 16-bit, got mxfp4 and nvfp4"):
            g.w4a4_matmul(qa, quantize(jnp.ones((32, 64)), NVFP4()), interpret=True)
        with pytest.raises(ValueError, match=r"reduction lengths differ: a \(16, 64\), w \(32, 96\)"):
            g.w4a4_matmul(qa, quantize(jnp.ones((32, 96)), MXFP4()), interpret=True)
        with pytest.raises(ValueError, match="compute='fp8' supports MXFP4 only"):
            g.w4a4_matmul(quantize(jnp.ones((16, 64)), NVFP4()), quantize(jnp.ones((32, 64)), NVFP4()),
                          compute="fp8", interpret=True)
        with pytest.raises(TypeError, match="both packed in one format or both 16-bit, got mxfp4 and 16-bit"):
            g.check_operands(qa, jnp.ones((32, 64), jnp.bfloat16))
        with pytest.raises(ValueError, match="support mxfp4 with block_size=32"):
            g.check_operands(quantize(jnp.ones((16, 64)), MXFP4(block_size=64)),
                             quantize(jnp.ones((32, 64)), MXFP4(block_size=64)))
        assert g.check_operands(qa, qa)[0] == MXFP4()
        assert g.check_operands(jnp.ones((4, 8)), jnp.ones((2, 8)))[0] is None
        assert g.keeps_lowrank_packed(quantize(jnp.ones((32, 64)), MXFP4()))
        assert not g.keeps_lowrank_packed(quantize(jnp.ones((32, 64)), NVFP4()))
        assert not g.keeps_lowrank_packed(jnp.ones((32, 64)))


class TestLowrankInput:
    """``h = x R^T`` (``lowrank_h``), the one home of the low-rank branch's input for every served strategy."""

    def test_both_dot_outputs_round_an_f32_sum_once(self):
        """``dot_output="bf16"`` (the dot writes bf16) and ``"f32"`` (a convert rounds its f32 output) are both the
        f32-accumulated product rounded once to bf16: within one bf16 rounding of the exact product, and at most one
        bf16 ulp apart (XLA may sum the two programs in different orders; on the CPU a few elements differ)."""
        x = (3.0 * jax.random.normal(jax.random.PRNGKey(5), (37, 1152))).astype(jnp.bfloat16)
        right = (jax.random.normal(jax.random.PRNGKey(6), (384, 1152)) / 34).astype(jnp.bfloat16)
        h32, h16 = g.lowrank_h(x, right, dot_output="f32"), g.lowrank_h(x, right, dot_output="bf16")
        assert h32.dtype == h16.dtype == jnp.bfloat16 and h32.shape == (37, 384)
        exact = np.asarray(x, np.float64) @ np.asarray(right, np.float64).T
        for h in (h32, h16):
            assert np.all(np.abs(np.asarray(h, np.float64) - exact) <= 2.0 ** -8 * np.abs(exact) + 1e-6)
        bits32, bits16 = (np.asarray(h).view(np.uint16).astype(np.int32) for h in (h32, h16))
        assert np.all(np.abs(bits32 - bits16) <= 1) and np.mean(bits32 != bits16) < 0.01
        # the default is the bf16-output dot
        np.testing.assert_array_equal(np.asarray(g.lowrank_h(x, right)).view(np.uint16), bits16.astype(np.uint16))

    def test_unknown_dot_output_is_refused(self):
        x, right = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((8, 32), jnp.bfloat16)
        with pytest.raises(ValueError, match=r"dot_output='fp8' must be one of \('f32', 'bf16'\)"):
            g.lowrank_h(x, right, dot_output="fp8")


class TestDequantStrategy:
    """"Dequantize + cuBLAS" (``w4a4_matmul_dequant``): XLA decode fusions + one bf16 GEMM, same exactness contract."""

    def test_dequantize_bf16_bit_exact(self):
        a, w = _data(11, 24, 8, 256)
        a = a.at[3, 7].set(jnp.nan)  # the E8M0 NaN byte: the whole block decodes to NaN, as dequantize does
        for x in (a, w):
            q = quantize(x, MXFP4())
            ref = np.asarray(dequantize(q, jnp.bfloat16)).view(np.uint16)
            got = np.asarray(jax.jit(g.dequantize_bf16)(q))
            assert got.dtype == jnp.bfloat16 and got.shape == x.shape
            np.testing.assert_array_equal(got.view(np.uint16), ref)
            eo = np.asarray(jax.jit(g.dequantize_bf16, static_argnames="order")(q, order="even_odd"))
            np.testing.assert_array_equal(eo.view(np.uint16), ref[:, g.even_odd_permutation(x.shape[1])])
        q = quantize(w, NVFP4())  # e2m1 * s_blk exact in bf16; tensor_scale applied after
        got = np.asarray(jax.jit(g.dequantize_bf16)(q)).astype(np.float32) * np.float32(q.tensor_scale)
        np.testing.assert_allclose(got, np.asarray(dequantize(q, jnp.float32)), rtol=2**-23, atol=0)
        with pytest.raises(ValueError, match="order"):
            g.dequantize_bf16(q, order="odd")
        with pytest.raises(TypeError, match="packed 2-D"):
            g.dequantize_bf16(jnp.ones((4, 32)))

    @pytest.mark.parametrize("fmt,extra", [(MXFP4(), 0), (NVFP4(), 3)])
    def test_exact_against_fake_quant(self, fmt, extra):
        m, n, k = 37, 40, 320  # ragged: nothing in this path needs tile multiples
        a, w = _data(12, m, n, k)
        qa, qw = quantize(a, fmt), quantize(w, fmt)
        out = g.w4a4_matmul_dequant(qa, qw, out_dtype=jnp.float32)
        ref = jnp.matmul(fake_quant(a, fmt), fake_quant(w, fmt).T, precision="highest")
        assert bool(jnp.all(jnp.isfinite(out)))
        assert bool(jnp.all(jnp.abs(out - ref) <= _bound(qa, qw, k, extra)))
        # materialize=False (XLA may fuse the decode into its GEMM): the same contract
        out2 = g.w4a4_matmul_dequant(qa, qw, out_dtype=jnp.float32, materialize=False)
        assert bool(jnp.all(jnp.abs(out2 - ref) <= _bound(qa, qw, k, extra)))

    @pytest.mark.parametrize("packed_left", [True, False])
    def test_lowrank_joined_along_k_and_bias(self, packed_left):
        m, n, k, r = 20, 48, 128, 32
        a, w = _data(13, m, n, k, outliers=False)
        qa, qw = quantize(a, MXFP4()), quantize(w, MXFP4())
        left = 0.1 * jax.random.normal(jax.random.PRNGKey(4), (n, r))
        h = jax.random.normal(jax.random.PRNGKey(5), (m, r)).astype(jnp.bfloat16)
        bias = jax.random.normal(jax.random.PRNGKey(6), (n,))
        if packed_left:
            left = quantize(left, MXFP4())
            h_in = h[:, g.even_odd_permutation(r)]  # the kernel's convention for a packed L
            dense = dequantize(left, jnp.float32)
        else:
            left = left.astype(jnp.bfloat16)
            h_in, dense = h, left.astype(jnp.float32)
        out = g.w4a4_matmul_dequant(qa, qw, lowrank=(h_in, left), bias=bias, out_dtype=jnp.float32)
        ref = (jnp.matmul(dequantize(qa, jnp.float32), dequantize(qw, jnp.float32).T, precision="highest")
               + jnp.matmul(h.astype(jnp.float32), dense.T, precision="highest") + bias)
        p = (jnp.matmul(jnp.abs(dequantize(qa, jnp.float32)), jnp.abs(dequantize(qw, jnp.float32)).T)
             + jnp.matmul(jnp.abs(h.astype(jnp.float32)), jnp.abs(dense).T) + jnp.abs(bias))
        assert bool(jnp.all(jnp.abs(out - ref) <= 2 * (k + r + 1) * 2.0**-24 * p + 1e-30))
        # one GEMM over K = k + r, the decoded operands behind an optimization barrier
        jaxpr = str(jax.make_jaxpr(lambda *x: g.w4a4_matmul_dequant(*x[:2], lowrank=x[2:]))(qa, qw, h_in, left))
        assert jaxpr.count("dot_general") == 1 and "optimization_barrier" in jaxpr
        assert f"bf16[{m},{k + r}]" in jaxpr and f"bf16[{n},{k + r}]" in jaxpr

    def test_rejects_bad_operands(self):
        qa = quantize(jnp.ones((16, 64)), MXFP4())
        with pytest.raises(TypeError, match="both packed in one format or both 16-bit, got mxfp4 and nvfp4"):
            g.w4a4_matmul_dequant(qa, quantize(jnp.ones((32, 64)), NVFP4()))
        with pytest.raises(ValueError, match="lowrank"):
            g.w4a4_matmul_dequant(qa, quantize(jnp.ones((32, 64)), MXFP4()),
                                  lowrank=(jnp.ones((16, 32)), jnp.ones((30, 32))))


@pytest.mark.gpu
class TestGPU:
    """The compiled kernel on the H200 (run ``pytest -m gpu tests/test_w4a4_gemm.py`` there)."""

    @pytest.mark.parametrize("fmt,compute,extra", FORMATS)
    @pytest.mark.parametrize("m", [256, 333])
    def test_exact_on_gpu(self, fmt, compute, extra, m):
        n, k = 384, 1152
        a, w = _data(8, m, n, k)
        qa, qw = quantize(a, fmt), quantize(w, fmt)
        poison = jnp.full((m, n), jnp.nan, jnp.float32)
        out = g.w4a4_matmul(qa, qw, compute=compute, out_dtype=jnp.float32, out=poison)
        assert bool(jnp.all(jnp.isfinite(out)))
        ref = jnp.matmul(fake_quant(a, fmt), fake_quant(w, fmt).T, precision="highest")
        assert bool(jnp.all(jnp.abs(out - ref) <= _bound(qa, qw, k, extra)))

    @pytest.mark.parametrize("fmt,extra", [(MXFP4(), 0), (NVFP4(), 3)])
    def test_dequant_strategy_exact_on_gpu(self, fmt, extra):
        """Decode fusions + the cuBLAS bf16 GEMM (fp32 accumulation): within the accumulation-order bound."""
        m, n, k = 333, 384, 1152
        a, w = _data(8, m, n, k)
        qa, qw = quantize(a, fmt), quantize(w, fmt)
        out = g.w4a4_matmul_dequant(qa, qw, out_dtype=jnp.float32)
        assert bool(jnp.all(jnp.isfinite(out)))
        ref = jnp.matmul(fake_quant(a, fmt), fake_quant(w, fmt).T, precision="highest")
        assert bool(jnp.all(jnp.abs(out - ref) <= _bound(qa, qw, k, extra)))
