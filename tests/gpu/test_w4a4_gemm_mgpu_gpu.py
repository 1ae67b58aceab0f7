"""GPU tests of the Mosaic GPU W4A4 GEMM (marker ``gpu``; ``pytest -m gpu -v tests/gpu/test_w4a4_gemm_mgpu_gpu.py`` on
the H200).

The compiled kernel against the exact product of the fake-quantized operands (``fake_quant(A) fake_quant(W)^T``,
f32, ``precision="highest"``), within the fp32 accumulation-order bound ``k * 2**-24 * |A_hat| |W_hat|^T`` (twice it:
the reference sums in its own order), over tilings, ragged ``m``, bias, a prepared weight and Ideogram 4's q shape;
bf16 output within its rounding. Every output is checked, so an unwritten tile (uninitialised memory) fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax.formats import MXFP4, dequantize, quantize
from pallas_kernels import w4a4_gemm_mgpu as M

pytestmark = pytest.mark.gpu


def _operands(seed, m, n, k):
    ka, kw, kb = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (m, k)) * 2.0
    a = a.at[:, 5].multiply(80.0).at[1, 40].set(-3.0e3).at[0, 0:32].set(0.0).at[2, 64:96].multiply(1e-20)
    w = (jax.random.normal(kw, (n, k)) * 0.05).at[3, :].multiply(50.0)
    return quantize(a, MXFP4()), quantize(w, MXFP4()), jax.random.normal(kb, (n,))


def _check(out, qa, qw, bias, k):
    ah, wh = dequantize(qa, jnp.float32), dequantize(qw, jnp.float32)
    ref = jnp.matmul(ah, wh.T, precision="highest")
    p = jnp.matmul(jnp.abs(ah), jnp.abs(wh).T, precision="highest")
    if bias is not None:
        ref, p = ref + bias, p + jnp.abs(bias)
    assert out.shape == ref.shape
    assert bool(jnp.all(jnp.isfinite(out)))
    if out.dtype == jnp.bfloat16:
        err_ok = jnp.abs(out.astype(jnp.float32) - ref) <= 2 * (k + 1) * 2.0**-24 * p + 2.0**-8 * jnp.abs(ref)
    else:
        err_ok = jnp.abs(out - ref) <= 2 * (k + 1) * 2.0**-24 * p + 1e-30
    bad = int(jnp.sum(~err_ok))
    assert bad == 0, f"{bad} of {out.size} outputs outside the bound"


CASES = {
    "default": (1024, 1024, 1152, M.MgpuGemmConfig(), False),
    "ragged_m_bias": (333, 512, 1152, M.MgpuGemmConfig(), True),
    "tm64": (256, 768, 640, M.MgpuGemmConfig(tile_m=64), True),
    "wg_m_tw4": (512, 512, 1152, M.MgpuGemmConfig(wg_dimension="m", grid_tile_width=4, grid_minor_dim="m"), False),
    "tk128_one_buffer": (512, 512, 1152, M.MgpuGemmConfig(tile_k=128, wdec_slots=1, max_concurrent_steps=3), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_on_gpu(name):
    m, n, k, cfg, with_bias = CASES[name]
    qa, qw, bias = _operands(len(name), m, n, k)
    bias = bias if with_bias else None
    out = M.w4a4_matmul_mgpu(qa, qw, bias=bias, config=cfg, impl="pallas", out_dtype=jnp.float32)
    _check(out, qa, qw, bias, k)


@pytest.mark.parametrize("m", [512, 4096])
def test_ideogram4_q_shape_bf16_prepared_weight(m):
    """Ideogram 4's q projection (n = k = 4608), the default tiling, bf16 output, the weight prepared once."""
    n = k = 4608
    qa, qw, _ = _operands(m, m, n, k)
    wp = M.prepare_operand(qw)
    out = M.w4a4_matmul_mgpu(qa, wp, impl="pallas")
    assert out.dtype == jnp.bfloat16
    _check(out, qa, qw, None, k)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(M.w4a4_matmul_mgpu(qa, qw, impl="pallas")))
