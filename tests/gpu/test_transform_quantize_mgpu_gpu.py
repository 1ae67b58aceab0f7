"""GPU tests of the Mosaic GPU transform + quantizer kernels (marker ``gpu``; ``pytest -m gpu`` on the H200).

Exact data (every partial sum exact in f32) must give bit-exact codes and scales for both kinds; on general data Q4 is
bit-exact and K1 stays under the documented mismatch bound (tensor-core accumulation order, as the Triton K1).
Outputs are poisoned (0x00 and 0xFF) so that an unwritten element fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import transforms as T
from kroquant_jax.formats import MXFP4, ScaleMode
from pallas_kernels import transform_quantize as tq
from pallas_kernels import transform_quantize_mgpu as tqm
from tq_cases import exact_activations, exact_transform  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_CODE_MISMATCH = 2e-3
MAX_SCALE_MISMATCH = 2e-3


def _run_poisoned(a, t, fmt, bs=None):
    m, d = a.shape
    outs = []
    for byte in (0x00, 0xFF):
        poison = (jnp.full((m, d // 2), byte, jnp.uint8), jnp.full((m, d // 32), byte, jnp.uint8))
        outs.append(tqm.transform_quantize_mgpu(a, t, fmt, impl="pallas", block_sizes=bs, poison_outputs=poison))
    np.testing.assert_array_equal(np.asarray(outs[0].codes), np.asarray(outs[1].codes))
    np.testing.assert_array_equal(np.asarray(outs[0].scales), np.asarray(outs[1].scales))
    return outs[0]


def _reference(a, t, fmt):
    return jax.jit(lambda a, t: tq.reference_transform_quantize(a, t, fmt))(a, t)


BS_CASES = {
    "q4": [tqm.MgpuBlockSizes(block_rows=64, block_cols=512), tqm.MgpuBlockSizes(block_rows=32, block_cols=256,
                                                                                   sequential_cols=True)],
    "k1": [tqm.MgpuBlockSizes(block_rows=64, block_cols=256), tqm.MgpuBlockSizes(block_rows=128, block_cols=512,
                                                                                   dot_passes=2)],
}


@pytest.mark.parametrize("kind", tqm.KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("which", [0, 1])
def test_exact_data_bit_exact(kind, dtype, which):
    m, d = 1024, 1536
    bs = BS_CASES[kind][which]
    a = exact_activations(jax.random.key(m + which), m, d, dtype)
    t = exact_transform(kind, d, jax.random.key(2))
    fmt = MXFP4(scale_mode=ScaleMode.FLOOR if which == 0 else ScaleMode.RCEIL)
    q = _run_poisoned(a, t, fmt, bs)
    r = _reference(a, t, fmt)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(r.scales))


@pytest.mark.parametrize("kind", tqm.KINDS)
def test_general_data(kind):
    m, d = 1024, 3072
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (m, d)) * jnp.where(jax.random.bernoulli(k2, 0.02, (1, d)), 30.0, 1.0)
    a = (x * jnp.where(jax.random.bernoulli(k3, 1e-4, (m, d)), 200.0, 1.0)).astype(jnp.bfloat16)
    a = a.at[3, 5].set(jnp.nan).at[10, 40].set(jnp.inf).at[20, :].set(0.0)
    if kind == "q4":
        t = tq.PreparedTransform.identity(d)
    else:
        params = jax.tree.map(lambda v: v * (1 + 0.2 * jax.random.normal(jax.random.key(4), v.shape)),
                              T.KRON_LU.init(d))
        t = tq.prepare("kron_lu", params, kernel="k1")
    q = _run_poisoned(a, t, MXFP4())
    r = _reference(a, t, MXFP4())
    code_rate = float(np.mean(np.asarray(q.codes) != np.asarray(r.codes)))
    scale_rate = float(np.mean(np.asarray(q.scales) != np.asarray(r.scales)))
    print(f"\n[mismatch mgpu] {kind}: codes {code_rate:.2e} scales {scale_rate:.2e}")
    np.testing.assert_array_equal(np.asarray(q.codes)[[3, 10, 20]], np.asarray(r.codes)[[3, 10, 20]])
    np.testing.assert_array_equal(np.asarray(q.scales)[[3, 10, 20]], np.asarray(r.scales)[[3, 10, 20]])
    if kind == "q4":
        assert code_rate == 0 and scale_rate == 0
    assert code_rate <= MAX_CODE_MISMATCH and scale_rate <= MAX_SCALE_MISMATCH


def test_same_as_triton_kernel_on_exact_data():
    m, d = 512, 4096
    a = exact_activations(jax.random.key(5), m, d, jnp.bfloat16)
    for kind in tqm.KINDS:
        t = exact_transform(kind, d, jax.random.key(6))
        q = tqm.transform_quantize_mgpu(a, t, impl="pallas")
        r = tq.transform_quantize(a, t, impl="pallas")
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(r.scales))
