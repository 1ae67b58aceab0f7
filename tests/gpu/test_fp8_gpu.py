"""GPU tests of the FP8 W4A4 / W4A8 strategy (marker ``gpu``; run on the H200): XLA's FP8 GEMM on the tensor cores
against the exact float64 eq. 11 product, the accumulation modes at long K, NaN propagation, the layer with the
quantizer kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import fp8_encoding as FE
from kroquant_jax import formats as F
from kroquant_jax import transforms as T
from kroquant_jax.formats import MXFP4, QuantizedArray
from pallas_kernels import fp8_gemm as G8
from pallas_kernels import transform_quantize as TQ
from pallas_kernels import w4a4_gemm as G

pytestmark = pytest.mark.gpu


def _operands(seed, m, n, k):
    ka, kw = jax.random.split(jax.random.PRNGKey(seed))
    a = jax.random.normal(ka, (m, k)) * jnp.where(jnp.arange(k) % 97 == 0, 20.0, 1.0)
    w = jax.random.normal(kw, (n, k)) / np.sqrt(k)
    return F.quantize(a, MXFP4()), F.quantize(w, MXFP4())


def _dense(q):
    return np.asarray(F.dequantize(q, jnp.float32), np.float64)


@pytest.mark.parametrize("k", [4608, 12288])
def test_fp8_gemm_error_vs_exact_and_dequant(k):
    """Against float64: the FP8 GEMM (each accumulation mode, f32 output) next to the dequant GEMM (f32 output, fp32
    accumulation). The precise mode and split-K must stay within the fp32 accumulation bound; every mode is printed."""
    m, n = 256, 512
    a, w = _operands(1, m, n, k)
    ref = G8.fp8_matmul_reference(a, w)
    bound = (k + 1) * 2.0 ** -24 * (np.abs(_dense(a)) @ np.abs(_dense(w)).T) + 2.0 ** -24 * np.abs(ref)
    w8 = G8.prepare_weight(w)
    errs = {"dequant": np.asarray(G.w4a4_matmul_dequant(a, w, out_dtype=jnp.float32), np.float64)}
    for name, kw in {"default": {}, "precise": {"accumulation": "precise"}, "fast": {"accumulation": "fast"},
                     "split512": {"k_split": 512}}.items():
        errs[name] = np.asarray(G8.fp8_matmul(a, w8, out_dtype=jnp.float32, **kw), np.float64)
    rel = {name: float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) for name, y in errs.items()}
    over = {name: float(np.max(np.abs(y - ref) / bound)) for name, y in errs.items()}
    print(f"\n[fp8 gemm k={k}] rel err {rel}\n  max |err| / fp32 accumulation bound {over}")
    assert over["dequant"] <= 1.0
    assert over["precise"] <= 1.0 and over["split512"] <= 1.0
    assert all(np.isfinite(v) for v in rel.values())


def test_fp8_gemm_bit_exact_small_k_on_gpu():
    """Offsets within 3 binades and K = 64: every partial sum exact, so the tensor cores give the float64 bits."""
    rng = np.random.default_rng(0)
    m, n, k = 128, 128, 64
    ca, cw = rng.integers(0, 16, (m, k)), rng.integers(0, 16, (n, k))
    ca[:, 0] = cw[:, 0] = 7

    def qa(c, top):
        b = np.stack([np.full(c.shape[0], top), top - rng.integers(0, 4, c.shape[0])], 1)
        return QuantizedArray(codes=F.pack_nibbles(jnp.asarray(c, jnp.uint8)), scales=jnp.asarray(b, jnp.uint8),
                              tensor_scale=jnp.float32(1.0), fmt=MXFP4(), dtype=np.dtype(np.float32))

    a, w = qa(ca, 130), qa(cw, 118)
    for acc in ("default", "precise", "fast"):
        y = G8.fp8_matmul(a, G8.prepare_weight(w), out_dtype=jnp.float32, accumulation=acc)
        np.testing.assert_array_equal(np.asarray(y, np.float64), G8.fp8_matmul_reference(a, w), err_msg=acc)


def test_nan_rows_and_columns_on_gpu():
    a, w = _operands(2, 128, 128, 256)
    sa, sw = np.asarray(a.scales).copy(), np.asarray(w.scales).copy()
    sa[5, 2], sw[9, 0] = F.E8M0_NAN, F.E8M0_NAN
    a = QuantizedArray(a.codes, jnp.asarray(sa), a.tensor_scale, a.fmt, a.dtype)
    w = QuantizedArray(w.codes, jnp.asarray(sw), w.tensor_scale, w.fmt, w.dtype)
    y = np.asarray(G8.fp8_matmul(a, G8.prepare_weight(w), out_dtype=jnp.float32))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(G8.fp8_matmul_reference(a, w)))
    assert np.isnan(y[5]).all() and np.isnan(y[:, 9]).all() and np.isnan(y).sum() == 128 + 127


def test_layer_with_quantizer_kernel_on_gpu():
    m, n, k, r = 300, 512, 1024, 32
    kx, kw, kl, kr, kt = jax.random.split(jax.random.PRNGKey(3), 5)
    x = (jax.random.normal(kx, (m, k)) * 2.0).astype(jnp.bfloat16)
    params = jax.tree.map(lambda v: v * (1.0 + 0.1 * jax.random.normal(kt, v.shape)), T.get("kron_lu").init(k))
    transform = TQ.prepare("kron_lu", params, d=k)
    qw = F.quantize(jax.random.normal(kw, (n, k)) / np.sqrt(k), MXFP4())
    left = (jax.random.normal(kl, (n, r)) * 0.05).astype(jnp.bfloat16)
    right = (jax.random.normal(kr, (r, k)) * 0.05).astype(jnp.bfloat16)
    bias = jax.random.normal(kt, (n,))
    for act in ("mxfp4", "fp8"):
        layer = G8.Fp8Linear(transform, G8.prepare_weight(qw), right, left, bias, act=act)
        y, inexact = jax.jit(lambda lay, x: G8.fp8_linear_forward(lay, x, out_dtype=jnp.float32,
                                                                  return_inexact=True))(layer, x)
        ref = G8.fp8_linear_reference(layer, x)  # the same quantized activations (the kernel == the reference)
        rel = float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))
        print(f"\n[fp8 layer {act}] rel err vs float64 {rel:.2e}, inexact {int(inexact)}")
        assert rel < 1e-3 and int(inexact) == 0
        assert int(jnp.max(FE.row_spans(qw))) <= FE.E4M3_SPAN


def _span_rows(key, m, d):
    """Random bf16 activations with outlier channels, rows scaled by powers of two on whole 32-column blocks (rows
    spanning > 14 binades, tiny blocks), zero rows and a NaN."""
    x = jax.random.normal(key, (m, d)) * jnp.where(jnp.arange(d) % 97 == 0, 20.0, 1.0)
    e = jax.random.randint(jax.random.fold_in(key, 1), (m, d // 32), -5, 6)
    e = e.at[1::9, 0].set(20).at[1::9, -1].set(-20).at[4::13, 2].set(-30)
    x = x * jnp.repeat(2.0 ** e.astype(jnp.float32), 32, axis=1)
    return x.at[2].set(0.0).at[7, 40].set(jnp.nan).astype(jnp.bfloat16)


@pytest.mark.parametrize("one_launch", [False, True], ids=["two_launches", "one_launch"])
@pytest.mark.parametrize("kind,m,d", [("k2", 1000, 4608), ("k1", 8200, 4096), ("q4", 333, 4608), ("k2s", 77, 512),
                                      ("k1", 4224, 12288)])
def test_quantizer_fp8_output_bit_exact_on_gpu(kind, m, d, one_launch):
    """The kernel's FP8 output mode on the GPU, in two launches and in one: the bytes, row scales, codes and scales
    are those of the MXFP4 kernel re-encoded by fp8_encoding (k2 the served kind; k1 at m = 8200, d = 4096: the
    256-column pipelined tiling of large grids; ragged row tiles; k1 at w2's input shape)."""
    key = jax.random.PRNGKey(m * 7 + d + len(kind))
    x = _span_rows(key, m, d)
    if kind == "q4":
        t = TQ.PreparedTransform.identity(d)
    elif kind == "scale":
        t = TQ.PreparedTransform.from_inv_scale(jnp.exp(0.3 * jax.random.normal(key, (d,))))
    elif kind == "fwht":
        t = TQ.PreparedTransform.fwht(d)
    else:
        params = jax.tree.map(lambda v: v * (1.0 + 0.1 * jax.random.normal(key, v.shape)), T.get("kron_lu").init(d))
        t = TQ.prepare("kron_lu", params, d=d, kernel="k1" if kind == "k1" else None)
        if kind == "k2s":
            t = TQ.PreparedTransform.from_kron_params(t.kron_params(), jnp.exp(0.3 * jax.random.normal(key, (d,))))
    assert t.kind == kind
    q = TQ.transform_quantize(x, t, MXFP4(), round_to_input=False)
    want = FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
    poison = (jnp.full((m, 2, d // 2), 0xA5, jnp.uint8), jnp.full((m, d // 2), 0xA5, jnp.uint8),
              jnp.full((m, d // 32), 0xA5, jnp.uint8))
    rows, q8 = jax.jit(lambda v, p: TQ.transform_quantize_fp8(v, t, MXFP4(), with_mxfp4=True, round_to_input=False,
                                                              poison_outputs=p, one_launch=one_launch))(x, poison)
    bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
    np.testing.assert_array_equal(bits(rows.values), bits(want.values))
    np.testing.assert_array_equal(np.asarray(rows.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(np.asarray(q8.codes), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(q8.scales), np.asarray(q.scales))
    only = TQ.transform_quantize_fp8(x, t, MXFP4(), round_to_input=False, one_launch=one_launch)
    np.testing.assert_array_equal(bits(only.values), bits(want.values))
    np.testing.assert_array_equal(np.asarray(only.scale), np.asarray(want.scale))
    spans = np.asarray(FE.row_spans(q))
    print(f"\n[fp8 mode {kind} {m}x{d}] rows out of range {(spans > FE.E4M3_SPAN).sum()} of {m}, "
          f"inexact {int(FE.mxfp4_to_e4m3(q).inexact)}")


def test_layer_act_encode_kernel_equals_xla_on_gpu():
    m, n, k, r = 300, 512, 1024, 32
    kx, kw, kl, kr, kt = jax.random.split(jax.random.PRNGKey(4), 5)
    x = _span_rows(kx, m, k)
    params = jax.tree.map(lambda v: v * (1.0 + 0.1 * jax.random.normal(kt, v.shape)), T.get("kron_lu").init(k))
    transform = TQ.prepare("kron_lu", params, d=k)
    qw = F.quantize(jax.random.normal(kw, (n, k)) / np.sqrt(k), MXFP4())
    left = (jax.random.normal(kl, (n, r)) * 0.05).astype(jnp.bfloat16)
    right = (jax.random.normal(kr, (r, k)) * 0.05).astype(jnp.bfloat16)
    ys = {}
    for enc in G8.ACT_ENCODES:
        layer = G8.Fp8Linear(transform, G8.prepare_weight(qw), right, left, None, act_encode=enc)
        ys[enc] = jax.jit(lambda lay, v: G8.fp8_linear_forward(lay, v, return_inexact=True))(layer, x)
    for enc in set(G8.ACT_ENCODES) - {"xla"}:
        np.testing.assert_array_equal(np.asarray(ys[enc][0].astype(jnp.float32)),
                                      np.asarray(ys["xla"][0].astype(jnp.float32)), err_msg=enc)
        assert int(ys[enc][1]) == int(ys["xla"][1]) > 0


def test_reencode_kernel_bit_exact_on_gpu():
    x = _span_rows(jax.random.PRNGKey(5), 1000, 4608)
    q = TQ.transform_quantize(x, TQ.PreparedTransform.identity(4608), MXFP4(), round_to_input=False)
    want = FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
    got = jax.jit(TQ.reencode_e4m3)(q)
    bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
    np.testing.assert_array_equal(bits(got.values), bits(want.values))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
