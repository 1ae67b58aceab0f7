"""GPU tests of the fused transform + FP4 quantizer kernels (marker ``gpu``; run on the H200 with ``pytest -m gpu``).

Exact data (dyadic activations and transforms: every partial sum of the transform is exact in f32, so any summation
order gives the same f32 value) must give bit-exact codes and scales; general data (normal with outliers, real-valued
learned-looking transforms) must stay under a documented mismatch rate (accumulation order, see the module docstring
of ``pallas_kernels.transform_quantize``). Outputs are poisoned so that an unwritten element fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import transforms as T
from kroquant_jax.formats import MXFP4, NVFP4, ScaleMode
from pallas_kernels import transform_quantize as tq
from tq_cases import exact_activations as _exact_activations  # noqa: E402
from tq_cases import exact_transform as _exact_transform  # noqa: E402

pytestmark = pytest.mark.gpu

# (m, d, dtype): ragged m against every default block_rows, d = 32 * odd (BD = 32) and a production width.
CASES = [(1000, 1152, jnp.bfloat16), (333, 96, jnp.float16)]
FWHT_CASES = [(1000, 1024, jnp.bfloat16), (129, 4096, jnp.float16)]
# Mismatch bounds on general data (fractions of codes / scales); measured rates are printed with -s.
MAX_CODE_MISMATCH = 2e-3
MAX_SCALE_MISMATCH = 2e-3




def _random_activations(key, m, d, dtype):
    """Normal data with heavy per-channel outliers (a few channels x 30) and a few huge single values."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (m, d))
    x = x * jnp.where(jax.random.bernoulli(k2, 0.02, (1, d)), 30.0, 1.0)
    x = x * jnp.where(jax.random.bernoulli(k3, 1e-4, (m, d)), 200.0, 1.0)
    return x.astype(dtype)




def _random_transform(kind, d, key):
    ks = jax.random.split(key, 3)
    if kind == "q4":
        return tq.PreparedTransform.identity(d)
    if kind == "scale":
        return tq.prepare("diagonal", {"log_gamma": jax.random.normal(ks[0], (d,))})
    params = jax.tree.map(lambda x: x * (1 + 0.2 * jax.random.normal(ks[1], x.shape)), T.KRON_LU.init(d))
    if kind == "k1":
        return tq.prepare("kron_lu", params, kernel="k1")
    if kind == "k2":
        return tq.prepare("kron_lu", params)
    if kind == "k2s":
        return tq.prepare("smoothed_kron", {"kron": params, "log_gamma": 0.5 * jax.random.normal(ks[2], (d,))})
    if kind == "fwht":
        return tq.PreparedTransform.fwht(d)
    raise ValueError(kind)


def _reference(a, t, fmt, **kw):
    """The jnp reference; jitted for MXFP4 (fast), eager for NVFP4: under jit XLA's algebraic simplifier rewrites
    formats' ``amax / 6 / tensor_scale`` into ``amax / (6 * tensor_scale)`` (another rounding), eager keeps the
    two divisions that the kernel does."""
    if isinstance(fmt, NVFP4):
        return tq.reference_transform_quantize(a, t, fmt, **kw)
    return jax.jit(lambda a, t: tq.reference_transform_quantize(a, t, fmt, **kw))(a, t)


def _scale_bytes(q):
    s = q.scales
    return np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8) if s.dtype != jnp.uint8 else s)


def _run_poisoned(a, t, fmt, bs=None):
    """Runs the kernel twice into outputs poisoned with 0x00 and 0xFF; both results must agree."""
    m, d = a.shape
    block = fmt.block_size
    outs = []
    for byte in (0x00, 0xFF):
        poison = (jnp.full((m, d // 2), byte, jnp.uint8), jnp.full((m, d // block), byte, jnp.uint8))
        outs.append(tq.transform_quantize(a, t, fmt, impl="pallas", block_sizes=bs, poison_outputs=poison))
    np.testing.assert_array_equal(np.asarray(outs[0].codes), np.asarray(outs[1].codes))
    np.testing.assert_array_equal(_scale_bytes(outs[0]), _scale_bytes(outs[1]))
    return outs[0]


def _cases():
    for kind in tq.KINDS:
        for m, d, dtype in (FWHT_CASES if kind == "fwht" else CASES):
            yield pytest.param(kind, m, d, dtype, id=f"{kind}-{m}x{d}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("kind,m,d,dtype", list(_cases()))
def test_exact_data_bit_exact_mxfp4(kind, m, d, dtype):
    key = jax.random.key(m * 7 + d)
    a = _exact_activations(key, m, d, dtype)
    t = _exact_transform(kind, d, jax.random.key(1))
    if kind == "fwht" and (d.bit_length() - 1) % 2:
        pytest.skip("1/sqrt(d) is not a power of two: covered by the general-data bound")
    q = _run_poisoned(a, t, MXFP4())
    r = _reference(a, t, MXFP4(), dense_fwht=True)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))


@pytest.mark.parametrize("kind", tq.KINDS)
@pytest.mark.parametrize("fmt", [MXFP4(), MXFP4(scale_mode=ScaleMode.RCEIL), NVFP4()], ids=["mx", "mx-rceil", "nv"])
def test_general_data_bounded_mismatch(kind, fmt):
    if isinstance(fmt, NVFP4) and kind not in ("q4", "k1"):
        pytest.skip("NVFP4 output is offered for Q4 and K1")
    if fmt.name == "mxfp4" and fmt.scale_mode == ScaleMode.RCEIL and kind not in ("k2",):
        pytest.skip("the scale modes are shared per-tile code: one kernel on the GPU, all of them on CPU")
    m, d = (515, 4096) if kind == "fwht" else (1027, 3072)
    a = _random_activations(jax.random.key(3), m, d, jnp.bfloat16)
    t = _random_transform(kind, d, jax.random.key(4))
    q = _run_poisoned(a, t, fmt)
    r = _reference(a, t, fmt, dense_fwht=True)
    code_rate = float(np.mean(np.asarray(q.codes) != np.asarray(r.codes)))
    scale_rate = float(np.mean(_scale_bytes(q) != _scale_bytes(r)))
    print(f"\n[mismatch] {kind} {fmt.name}: codes {code_rate:.2e} scales {scale_rate:.2e}")
    if kind in ("q4", "scale"):
        assert code_rate == 0 and scale_rate == 0
    assert code_rate <= MAX_CODE_MISMATCH
    assert scale_rate <= MAX_SCALE_MISMATCH
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.asarray(r.tensor_scale))


@pytest.mark.parametrize("kind", ["q4", "k1"])
def test_nvfp4_exact(kind):
    m, d = 1000, 1152
    a = _exact_activations(jax.random.key(5), m, d, jnp.float16)
    t = _exact_transform(kind, d, jax.random.key(6))
    q = _run_poisoned(a, t, NVFP4())
    r = tq.reference_transform_quantize(a, t, NVFP4())
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.asarray(r.tensor_scale))
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))


def test_nonfinite_and_zero_rows():
    m, d = 96, 256
    a = _random_activations(jax.random.key(7), m, d, jnp.bfloat16)
    a = a.at[3, 5].set(jnp.nan).at[10, 40].set(jnp.inf).at[20, :].set(0.0)
    for kind, bs in (("q4", None), ("k1", tq.BlockSizes(block_rows=64, block_cols=32)), ("k2", None)):
        t = _random_transform(kind, d, jax.random.key(8))
        q = _run_poisoned(a, t, MXFP4(), bs)
        r = _reference(a, t, MXFP4())
        np.testing.assert_array_equal(_scale_bytes(q)[[3, 10, 20]], _scale_bytes(r)[[3, 10, 20]])
        np.testing.assert_array_equal(np.asarray(q.codes)[[3, 10, 20]], np.asarray(r.codes)[[3, 10, 20]])


def test_dispatch_uses_kernel_and_ste_grad():
    m, d = 256, 1152
    a = _random_activations(jax.random.key(9), m, d, jnp.bfloat16)
    t = _random_transform("k2", d, jax.random.key(10))
    auto = tq.transform_quantize(a, t)
    forced = tq.transform_quantize(a, t, impl="pallas")
    np.testing.assert_array_equal(np.asarray(auto.codes), np.asarray(forced.codes))
    w = jax.random.normal(jax.random.key(11), (m, d), jnp.float32)

    def loss(x):
        return jnp.sum(tq.transform_fake_quant(x, t).astype(jnp.float32) * w)

    g = jax.jit(jax.grad(loss))(a)
    wb = w.astype(jnp.bfloat16).astype(jnp.float32)  # the cotangent of a bf16 output is bf16
    expected = jnp.einsum("mbj,bij->mbi", wb.reshape(m, d // 32, 32), t.dense_blocks(),
                          precision=jax.lax.Precision.HIGHEST).reshape(m, d)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(expected.astype(jnp.bfloat16), np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_fori_tiles_exact(kind):
    """Multi-chunk tiles walked by the ``fori_loop`` (K1: pairs of joined blocks; K2: 32-column blocks)."""
    m, d = 1000, 1152
    a = _exact_activations(jax.random.key(12), m, d, jnp.bfloat16)
    t = _exact_transform(kind, d, jax.random.key(13))
    bs = tq.BlockSizes(block_rows=64, block_cols=256, num_stages=3)
    q = _run_poisoned(a, t, MXFP4(), bs)
    r = _reference(a, t, MXFP4())
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))


@pytest.mark.parametrize("with_lowrank", [False, True])
def test_served_layer_matches_packed_forward(with_lowrank):
    from kroquant_jax import qlinear
    from pallas_kernels import served

    o, d, r = 256, 1152, 128
    w = jax.random.normal(jax.random.key(14), (o, d))
    lowrank = None
    if with_lowrank:
        lowrank = (0.1 * jax.random.normal(jax.random.key(15), (o, r)), 0.1 * jax.random.normal(jax.random.key(16),
                                                                                                 (r, d)))
    params = jax.tree.map(lambda v: v * (1 + 0.2 * jax.random.normal(jax.random.key(17), v.shape)),
                          T.KRON_LU.init(d))
    layer = qlinear.build_qlinear(w, jnp.ones((o,)), transform="kron_lu", transform_params=params, lowrank=lowrank)
    x = _random_activations(jax.random.key(18), 300, d, jnp.bfloat16)
    ref = np.asarray(qlinear.qlinear_forward(layer, x, path="packed"), np.float32)
    s = served.serve(layer)
    kernel = served.ServeOptions(strategy="kernel")
    y = np.asarray(served.forward(s, x, options=kernel), np.float32)  # kernels (GPU)
    y_ref_impl = np.asarray(served.reference(s, x), np.float32)
    scale = np.abs(ref).max()
    # bf16 output; the K2 block entries may differ from kron_lu.blocks by ~1 ulp (FMA), flipping rare codes
    assert np.mean(np.abs(y - ref) > 2e-2 * scale) < 1e-3
    assert np.mean(np.abs(y - y_ref_impl) > 2e-2 * scale) < 1e-3


def test_nvfp4_division_cases_exact():
    """Found (amax, tensor scale) pairs and 1024 blocks next to E4M3 midpoints / E2M1 thresholds through the NVFP4
    kernel (Scale kind with ±1 activations, so the quantizer sees the f32 values exactly): the kernel's divisions must
    be correctly rounded (Triton's own f32 division is ``div.full.f32``; the kernel uses ``div.rn.f32``)."""
    from tq_cases import NVFP4_DIVISION_CASES, exact_f32_scale_case, nvfp4_division_stress, nvfp4_found_case_vectors

    cases = [(nvfp4_found_case_vectors(amax), ts) for amax, ts in NVFP4_DIVISION_CASES]
    cases.append((nvfp4_division_stress(0.0123, n_blocks=1024), 0.0123))
    cases.append((nvfp4_division_stress(0.0871, n_blocks=1024, seed=1), 0.0871))
    for values, ts in cases:
        a, t = exact_f32_scale_case(values)
        ts = jnp.float32(ts)
        q = tq.transform_quantize(a, t, NVFP4(), tensor_scale=ts, impl="pallas", round_to_input=False)
        r = tq.reference_transform_quantize(a, t, NVFP4(), tensor_scale=ts, round_to_input=False)
        np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_fp16_default_two_parts_bounded(kind):
    """fp16's default K1/K2 tiling splits the f32 block into 2 fp16 parts (``default_block_sizes``): bounded like 3."""
    m, d = 1027, 3072
    a = _random_activations(jax.random.key(19), m, d, jnp.float16)
    t = _random_transform(kind, d, jax.random.key(20))
    assert tq.default_block_sizes(kind, m, d, jnp.float16).dot_passes == 2
    q = _run_poisoned(a, t, MXFP4())
    r = _reference(a, t, MXFP4())
    code_rate = float(np.mean(np.asarray(q.codes) != np.asarray(r.codes)))
    scale_rate = float(np.mean(_scale_bytes(q) != _scale_bytes(r)))
    print(f"\n[mismatch] {kind} fp16 default (2 parts): codes {code_rate:.2e} scales {scale_rate:.2e}")
    assert code_rate <= MAX_CODE_MISMATCH and scale_rate <= MAX_SCALE_MISMATCH


@pytest.mark.parametrize("kind", ["k1", "k2s"])
def test_default_wide_tiling_exact(kind):
    """The K1 default at large grids (BD=256: two block products joined into a 64-column tile, quantized at once,
    walked by the ``fori_loop``) and K2s with the same tiling (32-column even/odd pairs)."""
    m, d = 1000, 1024
    a = _exact_activations(jax.random.key(21), m, d, jnp.bfloat16)
    t = _exact_transform(kind, d, jax.random.key(22))
    bs = tq.BlockSizes(block_rows=64, block_cols=256, num_stages=3)
    q = _run_poisoned(a, t, MXFP4(), bs)
    r = _reference(a, t, MXFP4())
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    np.testing.assert_array_equal(_scale_bytes(q), _scale_bytes(r))


def test_div_rn_ptx_exact_in_a_kernel():
    """The kernel's inline-PTX ``div.rn.f32`` alone, in a Pallas Triton kernel, against numpy's correctly rounded
    quotients: elementwise on the operand sets of ``formats.divide_rn``'s test, and a scalar numerator over a tile
    (``inv_tensor_scale / s``, as the NVFP4 tile math divides). When the NVFP4 tests above fail, this says whether
    the division is the cause."""
    from pallas_kernels._compat import pl, triton_compiler_params
    from tq_cases import assert_division_exact, division_operands

    def elementwise(x_ref, y_ref, o_ref):
        o_ref[...] = tq.div_rn_ptx(x_ref[...], y_ref[...])

    def scalar_numerator(s_ref, y_ref, o_ref):
        o_ref[...] = tq.div_rn_ptx(s_ref[0, 0], y_ref[...])

    def run(body, *args):
        return np.asarray(pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
                                         compiler_params=triton_compiler_params(4, 1))(*args)).ravel()

    for tag, (x, y) in division_operands(256 * 256).items():
        if x.size != 256 * 256:  # the special-value pairs: padded with ones to the tile
            x, y = (np.concatenate([v, np.ones(256 * 256 - v.size, np.float32)]) for v in (x, y))
        assert_division_exact(run(elementwise, x.reshape(256, 256), y.reshape(256, 256)), x, y, tag)
    _, y = division_operands(256 * 256)["wide"]
    numerator = np.float32(0.37)
    assert_division_exact(run(scalar_numerator, np.full((1, 1), numerator), y.reshape(256, 256)),
                          np.full(y.size, numerator), y, "scalar numerator")


def test_nvfp4_reference_codes_same_on_gpu_and_cpu():
    """The NVFP4 reference (``reference_transform_quantize``) gives the same codes, scales and tensor scale on the
    GPU as on the CPU for the exact-data case of ``test_nvfp4_exact``: when those tests fail, this says whether the
    reference or the kernel moved."""
    cpu = jax.devices("cpu")[0]
    a = _exact_activations(jax.random.key(5), 1000, 1152, jnp.float16)
    for kind in ("q4", "k1"):
        t = _exact_transform(kind, 1152, jax.random.key(6))
        on_gpu = tq.reference_transform_quantize(a, t, NVFP4())
        with jax.default_device(cpu):
            on_cpu = tq.reference_transform_quantize(jax.device_put(a, cpu), jax.device_put(t, cpu), NVFP4())
        np.testing.assert_array_equal(np.asarray(on_gpu.tensor_scale), np.asarray(on_cpu.tensor_scale))
        np.testing.assert_array_equal(_scale_bytes(on_gpu), _scale_bytes(on_cpu))
        np.testing.assert_array_equal(np.asarray(on_gpu.codes), np.asarray(on_cpu.codes), err_msg=kind)
