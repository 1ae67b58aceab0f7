"""GPU tests of the fused FP8 GEMM (``pallas_kernels/fp8_gemm_mgpu.py``; marker ``gpu``: ``pytest -m gpu -v
tests/gpu/test_fp8_gemm_mgpu_gpu.py`` on the H200).

The compiled kernel against its jnp mirror (the same steps in f32 at HIGHEST precision) and the float64 eq. 11
product, over the default tilings of Ideogram 4's shapes, the low-rank branch whole and in rank chunks, ragged ``m``,
several output tiles per CTA, a NaN row and an all-zero row, the SwiGLU epilogue. Every output is checked, so an unwritten tile
(uninitialised memory) fails.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import fp8_encoding as FE
from kroquant_jax.formats import MXFP4, quantize
from pallas_kernels import fp8_gemm as G8
from pallas_kernels import fp8_gemm_mgpu as F
from pallas_kernels.w4a4_gemm_mgpu import _num_sms

pytestmark = pytest.mark.gpu


def _rows(x):
    return FE.mxfp4_to_e4m3(quantize(x, MXFP4()), order="even_odd")


def _operands(seed, m, n, k, r):
    ka, kw, kh, kl, kb = jax.random.split(jax.random.key(seed), 5)
    a = (jax.random.normal(ka, (m, k)) * 2.0).at[:, 7].multiply(60.0).at[1].set(0.0)
    w = jax.random.normal(kw, (n, k)) / np.sqrt(k)
    h = (jax.random.normal(kh, (m, r)) * 0.5).at[1].set(0.0) if r else None
    lowrank = (h.astype(jnp.bfloat16), (jax.random.normal(kl, (n, r)) * 0.1).astype(jnp.bfloat16)) if r else None
    return _rows(a), _rows(w), lowrank, jax.random.normal(kb, (n,))


CASES = {  # m, n, k, rank, config (None: default_config)
    "q_m4096_default": (4096, 4608, 4608, 128, None),
    "q_m512_default": (512, 4608, 4608, 128, None),
    "pixart_ff_down_m4096_default_tile_n192": (4096, 1152, 4608, 128, None),
    "flux_q_m512_default_tile_n64": (512, 3072, 3072, 128, None),
    "pixart_ff_up_m512_tile_n96": (512, 4608, 1152, 128, F.Fp8MgpuConfig(tile_n=96, epi_tile_n=32)),
    "ragged_whole_rank_one_stage": (333, 1024, 1024, 128, F.Fp8MgpuConfig(max_concurrent_steps=1)),
    "chunks_of_32_two_slots": (640, 1536, 2048, 128, F.Fp8MgpuConfig(max_concurrent_steps=2, lowrank_chunk=32,
                                                                      epi_slots=2, epi_tile_n=32)),
    "no_lowrank_four_stages": (1024, 2048, 4608, 0, F.Fp8MgpuConfig(max_concurrent_steps=4, epi_tile_n=32)),
    # the f32-output default tiling (the test's out_dtype) with one wgmma left in flight
    "q_m4096_delay_release": (4096, 4608, 4608, 128, dataclasses.replace(
        F.default_config(4096, 4608, 4608, 128, out_bytes=4), delay_release=1)),
    "ragged_delay_release_two_stages": (333, 1024, 1024, 128, F.Fp8MgpuConfig(max_concurrent_steps=2,
                                                                              lowrank_chunk=32, delay_release=1)),
}


@pytest.mark.parametrize("m,group", [(4096, 128), (333, 128), (333, 256)])
def test_row_group_scales_on_gpu(m, group):
    """Activations with one exponent per row and group of 128 K values (the default tile_k; 256: the rescale on every
    other K step only): the accumulator rescaled before each group's wgmma; rows with a group 30 binades down and
    with zero groups."""
    n, k, r = 4608, 4608, 128
    _, w8, lowrank, bias = _operands(3, m, n, k, r)
    a = (jax.random.normal(jax.random.key(4), (m, k)) * 2.0).at[2, :1024].multiply(2.0**-30).at[3, 512:2048].set(0.0)
    a8 = FE.mxfp4_to_e4m3(quantize(a, MXFP4()), order="even_odd", group=group)
    out = np.asarray(F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias, impl="pallas", out_dtype=jnp.float32),
                     np.float64)
    mirror = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=lowrank, bias=bias), np.float64)
    exact = G8.fp8_matmul_reference(a8, w8, lowrank=lowrank, bias=bias)
    assert out.shape == (m, n) and np.all(np.isfinite(out))
    assert np.linalg.norm(out - mirror) / np.linalg.norm(mirror) < 1e-4
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 1e-4
    np.testing.assert_allclose(out[2], exact[2], rtol=1e-3, atol=1e-3 * np.abs(exact[2]).max())


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_mirror_on_gpu(name):
    m, n, k, r, cfg = CASES[name]
    a8, w8, lowrank, bias = _operands(len(name), m, n, k, r)
    out = F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias, config=cfg, impl="pallas", out_dtype=jnp.float32)
    mirror = F.fp8_matmul_mgpu_reference(a8, w8, lowrank=lowrank, bias=bias)
    exact = G8.fp8_matmul_reference(a8, w8, lowrank=lowrank, bias=bias)  # float64
    out, mirror = np.asarray(out, np.float64), np.asarray(mirror, np.float64)
    assert out.shape == (m, n) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out[1], np.asarray(bias, np.float64), rtol=1e-6, atol=1e-6)  # the zero row
    # FP8 wgmma accumulates in a reduced-width adder: differences to the mirror stay at the fp32-order scale
    assert np.linalg.norm(out - mirror) / np.linalg.norm(mirror) < 1e-4
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 1e-4


def test_nan_row_on_gpu():
    a8, w8, lowrank, bias = _operands(9, 256, 512, 1024, 64)
    a = jax.random.normal(jax.random.key(1), (256, 1024)).at[5, 3].set(jnp.nan)
    out = np.asarray(F.fp8_matmul_mgpu(_rows(a), w8, lowrank=lowrank, bias=bias, impl="pallas"))
    assert np.all(np.isnan(out[5])) and np.all(np.isfinite(np.delete(out, 5, axis=0)))


def test_zero_and_smallest_row_scales_on_gpu():
    """Row 1 is all zero (factor 2**-126) beside a large ``h``: the kernel scales its accumulator by the row factors
    and never divides ``h`` by them. Row 2 and weight row 3, all zero with the factor a caller's encoder may leave at
    0: the kernel takes 1 there (the bytes are zero)."""
    m, n, k, r = 512, 1024, 1024, 64
    a8, w8, (h, left), bias = _operands(13, m, n, k, r)
    h = h.at[1].set(300.0)
    zero = lambda x, i: FE.Fp8Rows(x.values.at[i].set(0), x.scale.at[i].set(0.0), x.inexact, x.order)  # noqa: E731
    a8, w8 = zero(a8, 2), zero(w8, 3)
    out = np.asarray(F.fp8_matmul_mgpu(a8, w8, lowrank=(h, left), bias=bias, impl="pallas", out_dtype=jnp.float32),
                     np.float64)
    exact = G8.fp8_matmul_reference(a8, w8, lowrank=(h, left), bias=bias)
    assert float(a8.scale[1]) == 2.0**-126 and np.all(np.isfinite(out))
    for rows in (out[1], out[2], out[:, 3]):
        assert np.any(rows != 0)
    np.testing.assert_allclose(out[1], exact[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[2], exact[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[:, 3], exact[:, 3], rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 1e-4


@pytest.mark.parametrize("m,out_dtype", [(4096, jnp.bfloat16), (333, jnp.float32)])
def test_swiglu_epilogue_equals_mirror_on_gpu(m, out_dtype):
    """w1|w3 of Ideogram 4 with the SwiGLU in the epilogue (rows in groups of 128: gates | ups), default tiling.

    Two checks, so that the accumulation order (FP8 wgmma against the f32 mirror) and the epilogue are judged apart:
    SiLU(g) u amplifies the relative error of g by |1 + g (1 - sigmoid(g))|, so the kernel-vs-mirror difference of
    the SwiGLU output is not bounded by the GEMM's. (1) The same kernel and tiling without the SwiGLU (f32 output)
    equals the mirror's pre-SwiGLU values to the GEMM tests' 1e-4. (2) The SwiGLU output equals ``swiglu_halves`` of
    that very f32 output (the same accumulator bits), up to the exp's last ulps (f32) or one bf16 rounding."""
    n, k, r = 24576, 4608, 128
    a8, w8, lowrank, bias = _operands(11, m, n, k, r)
    cfg = F.default_config(m, n, k, r, _num_sms(), 4, tile_n=F.SWIGLU_GROUP)  # f32 tiles fit: both calls take it
    out = F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias, impl="pallas", out_dtype=out_dtype, config=cfg,
                            swiglu_group=F.SWIGLU_GROUP)
    pre = F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias, impl="pallas", out_dtype=jnp.float32, config=cfg)
    pre_mirror = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=lowrank, bias=bias), np.float64)
    epilogue = np.asarray(F.swiglu_halves(pre, F.SWIGLU_GROUP).astype(out_dtype), np.float64)
    out, pre = np.asarray(out, np.float64), np.asarray(pre, np.float64)
    assert out.shape == (m, n // 2) and np.all(np.isfinite(out))
    gemm_err = np.linalg.norm(pre - pre_mirror) / np.linalg.norm(pre_mirror)
    assert gemm_err < 1e-4, f"pre-SwiGLU GEMM vs mirror: rel err {gemm_err:.3e}"
    epi_err = np.linalg.norm(out - epilogue) / np.linalg.norm(epilogue)
    if out_dtype == jnp.float32:
        assert epi_err < 1e-6, f"SwiGLU epilogue vs swiglu_halves of the kernel's own f32 output: rel err {epi_err:.3e}"
    else:  # one bf16 rounding of values that differ by f32 ulps: rare one-ulp flips, nothing larger
        ulp = np.abs(epilogue) * 2.0 ** -7 + 1e-30
        flips = np.abs(out - epilogue) > 0
        assert np.all(np.abs(out - epilogue) <= ulp), f"SwiGLU epilogue off by more than one bf16 ulp ({epi_err=:.3e})"
        assert flips.mean() < 1e-3, f"{flips.mean():.2e} of the SwiGLU outputs differ from one bf16 rounding"


def test_the_default_strategy_on_this_gpu_reads_its_compute_capability():
    # served.default_strategy parses the device's compute_capability ("9.0" on Hopper): on the GPU the tests run on,
    # an MXFP4 layer of a rank the fused kernel takes gets fp8_mgpu exactly on a 9.x device, and the served layer runs
    from kroquant_jax import qlinear
    from pallas_kernels import served

    device = jax.devices()[0]
    kw, kl, kr, kx = jax.random.split(jax.random.key(5), 4)
    w = jax.random.normal(kw, (256, 256)) * 0.05
    layer = qlinear.build_qlinear(w, lowrank=(jax.random.normal(kl, (256, 32)) * 0.05,
                                              jax.random.normal(kr, (32, 256)) * 0.05))
    name, why = served.default_strategy([layer])
    hopper = str(device.compute_capability).split(".")[0] == "9"
    assert name == ("fp8_mgpu" if hopper else "dequant"), why
    y = served.forward(served.serve(layer, strategy=name), jax.random.normal(kx, (64, 256)).astype(jnp.bfloat16),
                       options=served.ServeOptions(strategy=name))
    assert y.shape == (64, 256) and bool(jnp.isfinite(y).all())
