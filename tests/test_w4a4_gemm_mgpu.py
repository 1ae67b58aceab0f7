"""CPU tests of the Mosaic GPU W4A4 GEMM (``pallas_kernels/w4a4_gemm_mgpu.py``).

1. The shared per-tile decode, bit for bit against ``kroquant_jax.formats`` on every code byte x every scale byte.
2. The jnp mirror of the kernel (same decode, the kernel's per-block K order) against the fake-quant product.
3. The kernel itself in jax's GPU interpret mode (TMA pipeline, warpgroups, barriers, ``wgmma``; a race detector), in
   a subprocess (see ``tests/mgpu_interpret.py`` for why), over tilings, ragged ``m``, bias and a prepared weight.
4. The Mosaic GPU lowering for a CUDA target (layout inference and the dialect lowering run on the CPU).
5. Configuration and argument errors.

The compiled kernel runs in ``tests/gpu/test_w4a4_gemm_mgpu_gpu.py`` (``pytest -m gpu`` on the H200).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mgpu_interpret
from kroquant_jax.formats import MXFP4, NVFP4, QuantizedArray, dequantize, fake_quant, quantize
from pallas_kernels import w4a4_gemm_mgpu as M
from pallas_kernels.fp4_tile import F16_DECODE_OFFSET, mx_decode_pair

quantize = jax.jit(quantize, static_argnums=1)


def test_decode_pair_every_code_and_scale_byte():
    codes = jnp.tile(jnp.arange(256, dtype=jnp.uint8)[None, :16 * 16].reshape(1, 256), (256, 1))  # (256 scales, 256)
    scales = jnp.arange(256, dtype=jnp.uint8)  # row s: every code byte under scale byte s
    lo, hi = jax.jit(lambda c, s: mx_decode_pair(c, MXFP4().scale_factors(s, F16_DECODE_OFFSET)))(codes, scales)
    got = np.asarray(jnp.stack([lo, hi], axis=2).reshape(256, 512).astype(jnp.float32))
    # The library's dequantize of the same bytes (16 blocks of 32 per row, all with the row's scale byte).
    q = QuantizedArray(codes=codes, scales=jnp.repeat(scales[:, None], 16, axis=1), tensor_scale=jnp.float32(1.0),
                       fmt=MXFP4(), dtype=np.dtype(np.float32))
    ref = np.asarray(dequantize(q, jnp.float32))
    rows = np.arange(2, 241)  # the documented exact range
    np.testing.assert_array_equal(got[rows].view(np.uint32), ref[rows].view(np.uint32))
    assert np.all(got[0] == 0) and np.all(np.isnan(got[255]))
    for s in (241, 248, 254):  # above 240 the multiplier is clamped to 2**127: the values of scale byte 240
        np.testing.assert_array_equal(got[s], got[240])
    assert lo.dtype == jnp.bfloat16


def test_multiplier_is_a_power_of_two_from_bits():
    mult = np.asarray(MXFP4().scale_factors(jnp.arange(256, dtype=jnp.uint8), F16_DECODE_OFFSET))
    for e in range(1, 241):
        assert mult[e] == np.float32(2.0 ** (e - 113))
    assert mult[0] == 0 and np.isnan(mult[255]) and mult[250] == np.float32(2.0**127)


def _data(seed, m, n, k):
    """``A (m, k)`` with an outlier channel and a zero block, ``W (n, k)``: numpy's generator (jax.random's threefry
    would be compiled for each shape)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k), dtype=np.float32) * np.float32(2.0)
    a[:, 5] *= 80.0
    a[0, 0:32] = 0.0
    return jnp.asarray(a), jnp.asarray(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))


@pytest.mark.parametrize("m,n,k", [(37, 40, 160), (64, 256, 4608 // 9)])
def test_reference_mirror_exact(m, n, k):
    a, w = _data(1, m, n, k)
    qa, qw = quantize(a, MXFP4()), quantize(w, MXFP4())
    bias = jnp.linspace(-1, 1, n)
    out = jax.jit(M.w4a4_matmul_mgpu_reference)(qa, qw, bias=bias)
    ref = jnp.matmul(fake_quant(a, MXFP4()), fake_quant(w, MXFP4()).T, precision="highest") + bias
    p = jnp.matmul(jnp.abs(dequantize(qa, jnp.float32)), jnp.abs(dequantize(qw, jnp.float32)).T) + jnp.abs(bias)
    assert out.shape == (m, n)
    assert bool(jnp.all(jnp.abs(out - ref) <= 2 * (k + 1) * 2.0**-24 * p + 1e-30))
    # impl=None on the CPU is the reference
    np.testing.assert_array_equal(np.asarray(M.w4a4_matmul_mgpu(qa, qw, bias=bias, out_dtype=jnp.float32)),
                                  np.asarray(out))


def test_prepare_operand_pads_and_transposes():
    q = quantize(jnp.asarray(np.random.default_rng(2).standard_normal((40, 96), dtype=np.float32)), MXFP4())
    p = M.prepare_operand(q, rows_multiple=64, k_multiple=128)
    assert p.shape == (40, 96) and p.codes.shape == (64, 64) and p.scales_t.shape == (4, 64)
    np.testing.assert_array_equal(np.asarray(p.codes[:40, :48]), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(p.scales_t[:3, :40]), np.asarray(q.scales).T)
    assert not np.any(np.asarray(p.codes[40:])) and not np.any(np.asarray(p.scales_t[3:]))
    assert M.prepare_operand(p, rows_multiple=64, k_multiple=128) is not None
    leaves = jax.tree_util.tree_leaves(p)
    assert len(leaves) == 2  # shape is static metadata, not a traced leaf


# ---------------------------------------------------------------------------------------------------------------------
# The kernel in GPU interpret mode (subprocess)
# ---------------------------------------------------------------------------------------------------------------------

_OK, _REASON = mgpu_interpret.available()
SMALL = dict(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, num_ctas=2)
INTERPRET_CASES = [
    # (name, case): several K steps and output tiles per CTA, both warpgroup splits, both W-buffer modes, bias,
    # ragged m (padded), a prepared weight, tile_k 32 and 128.
    ("wg_n_two_buffers_bias", dict(m=128, n=256, k=256, bias=True, config=dict(SMALL))),
    ("wg_m_one_buffer_ragged", dict(m=200, n=128, k=192, config=dict(SMALL, wg_dimension="m", wdec_slots=1))),
    ("tk32_prepared_3ctas", dict(m=64, n=384, k=96, prepared=True, config=dict(SMALL, tile_k=32, num_ctas=3))),
    ("tk128_tm128", dict(m=128, n=128, k=256, config=dict(SMALL, tile_m=128, tile_k=128, max_concurrent_steps=3,
                                                          wg_dimension="m", num_ctas=1))),
]


@pytest.mark.skipif(not _OK, reason=_REASON)
def test_kernel_in_gpu_interpret_mode_exact():
    results = mgpu_interpret.run_in_subprocess([c for _, c in INTERPRET_CASES], timeout_s=900)
    for (name, case), r in zip(INTERPRET_CASES, results):
        assert r["shape"] == [case["m"], case["n"]], name
        assert r["nonfinite"] == 0, (name, r)
        assert r["max_err_over_bound"] <= 1.0, (name, r)
        assert not r["races"], (name, r)


# ---------------------------------------------------------------------------------------------------------------------
# Lowering to Mosaic GPU for a CUDA target
# ---------------------------------------------------------------------------------------------------------------------

LOWER_CONFIGS = [
    M.MgpuGemmConfig(),  # the default (128 x 128 per warpgroup, tile_k 64, two W buffers)
    M.MgpuGemmConfig(tile_m=64),
    M.MgpuGemmConfig(tile_k=128, wdec_slots=1, max_concurrent_steps=3),
    M.MgpuGemmConfig(wg_dimension="m", grid_tile_width=4, grid_minor_dim="m"),
]


@pytest.mark.parametrize("cfg", LOWER_CONFIGS, ids=lambda c: f"tm{c.tile_m}_tk{c.tile_k}_wg{c.wg_dimension}_s"
                                                           f"{c.wdec_slots}_tw{c.grid_tile_width}")
@pytest.mark.parametrize("bias,out_dtype", [(False, jnp.bfloat16), (True, jnp.float32)])
def test_lowers_to_mosaic_gpu(cfg, bias, out_dtype):
    m, n, k = 512, 4608, 4608  # Ideogram 4's q projection at m = 512
    assert cfg.smem_bytes(jnp.dtype(out_dtype).itemsize) <= 227 * 1024
    qa = jax.ShapeDtypeStruct((m, k // 2), jnp.uint8), jax.ShapeDtypeStruct((m, k // 32), jnp.uint8)
    qw = jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 32), jnp.uint8)

    def f(ac, as_, wc, ws, b):
        a = QuantizedArray(ac, as_, jnp.float32(1.0), MXFP4(), np.dtype(np.float32))
        w = QuantizedArray(wc, ws, jnp.float32(1.0), MXFP4(), np.dtype(np.float32))
        return M.w4a4_matmul_mgpu(a, w, bias=b if bias else None, config=cfg, impl="pallas", out_dtype=out_dtype)

    low = jax.jit(f).trace(*qa, *qw, jax.ShapeDtypeStruct((n,), jnp.float32)).lower(lowering_platforms=("cuda",))
    text = low.as_text()
    assert "mosaic_gpu" in text and f"tensor<{m}x{n}x{'bf16' if out_dtype == jnp.bfloat16 else 'f32'}>" in text


# ---------------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------------


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="tile_m"):
        M.MgpuGemmConfig(tile_m=96)
    with pytest.raises(ValueError, match="tile_k"):
        M.MgpuGemmConfig(tile_k=48)
    with pytest.raises(ValueError, match="wdec_slots"):
        M.MgpuGemmConfig(wdec_slots=3)
    with pytest.raises(ValueError, match="tile_n"):
        M.MgpuGemmConfig(tile_n=512)
    assert M.MgpuGemmConfig().cta_n == 256 and M.MgpuGemmConfig(wg_dimension="m").cta_m == 256
    assert M.default_config(4096, 4608, 4608).tile_m == 128 and M.default_config(512, 4608, 4608).tile_m == 64
    assert M.default_config(512, 4608, 4640).tile_k == 32
    assert M.supports(4096, 4608, 4608) and not M.supports(4100, 4608, 4608)
    qa = quantize(jnp.ones((64, 128)), MXFP4())
    with pytest.raises(ValueError, match="MXFP4"):
        M.w4a4_matmul_mgpu(qa, quantize(jnp.ones((64, 128)), NVFP4()))
    with pytest.raises(ValueError, match="reduction lengths"):
        M.w4a4_matmul_mgpu(qa, quantize(jnp.ones((64, 256)), MXFP4()))
    with pytest.raises(ValueError, match="bias"):
        M.w4a4_matmul_mgpu(qa, qa, bias=jnp.ones((3,)))
    with pytest.raises(ValueError, match="impl"):
        M.w4a4_matmul_mgpu(qa, qa, impl="triton")
