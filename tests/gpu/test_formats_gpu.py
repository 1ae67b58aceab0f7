"""GPU tests of the format helpers whose bits XLA:GPU could change (marker ``gpu``; run on the H200).

``formats.divide_rn`` exists because XLA:GPU's f32 division is not correctly rounded (measured on the H200 with jax
0.11.2: 301,718 of 2^20 random quotients one ulp off, the same as Triton's ``div.full.f32``); NVFP4's block scales go
through it, so the library's NVFP4 reference must give the CPU's bits on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import formats as F
from tq_cases import assert_division_exact, division_operands

pytestmark = pytest.mark.gpu


def test_divide_rn_exact_on_gpu():
    for tag, (x, y) in division_operands(1 << 20).items():
        assert_division_exact(np.asarray(jax.jit(F.divide_rn)(x, y)), x, y, tag)
    # For the record (printed with -s, not a requirement): how many of the same quotients XLA:GPU's own '/' misses.
    x, y = division_operands(1 << 20)["wide"]
    wrong = int(np.sum(np.asarray(jax.jit(jnp.divide)(x, y)).view(np.uint32) != (x / y).view(np.uint32)))
    print(f"\n[xla:gpu f32 division] {wrong} of {x.size} quotients not correctly rounded")


def test_nvfp4_reference_same_bits_as_numpy_on_gpu():
    """The NVFP4 block scales of the jitted reference on the GPU equal the numpy recipe (two correctly rounded
    divisions, E4M3 round to nearest even)."""
    import ml_dtypes

    amax_rows = np.asarray(jax.random.uniform(jax.random.key(13), (4096, 16), minval=0.01, maxval=100.0), np.float32)
    x = jnp.asarray(amax_rows[..., None] * np.linspace(-1, 1, 16, dtype=np.float32))  # (4096, 16, 16)
    _, scales = jax.jit(F.nvfp4_quantize_blocks)(x, jnp.float32(0.0123))
    s_ref = np.clip(np.abs(np.asarray(x)).max(-1) / np.float32(6.0) / np.float32(0.0123), 2.0**-6, 448.0)
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8),
                                  s_ref.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
