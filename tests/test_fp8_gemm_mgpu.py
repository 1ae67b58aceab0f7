"""CPU tests of the fused FP8 GEMM (``pallas_kernels/fp8_gemm_mgpu.py``).

1. The jnp mirror (the kernel's steps: unscaled E4M3 product, pre-scaled bf16 low-rank term, one scaling, bias)
   against the float64 eq. 11 product, with all-zero rows and NaN rows.
2. The kernel itself in jax's GPU interpret mode (TMA pipeline, warpgroups, barriers, FP8 and bf16 ``wgmma``, a race
   detector) in a subprocess (``tests/mgpu_interpret.py``), over tilings, ragged ``m``, several CTAs, bias and rank.
3. The Mosaic GPU lowering for a CUDA target at Ideogram 4's shapes.
4. The layer and the served strategy ``fp8_mgpu`` (``fp8_gemm.fp8_linear_forward(..., gemm="mgpu")``).
5. Configuration and argument errors.

The compiled kernel runs in ``tests/gpu/test_fp8_gemm_mgpu_gpu.py`` (``pytest -m gpu`` on the H200).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mgpu_interpret
from kroquant_jax import fp8_encoding as FE
from kroquant_jax.formats import MXFP4, quantize
from pallas_kernels import fp8_gemm as G8
from pallas_kernels import fp8_gemm_mgpu as F
from pallas_kernels import served
from pallas_kernels.epilogues import rmsnorm_heads, swiglu

_OK, _REASON = mgpu_interpret.available()


# Test inputs: random values from numpy's generator (jax.random's threefry is compiled for every shape it draws, about
# a second a program at the suite's -O0); their encodings each one jitted program (eagerly, each of their dozens of ops
# is compiled on its own): the same jnp ops, integer arithmetic and exact conversions, so the same bytes.
def _normal(seed_or_rng, shape, scale=1.0) -> np.ndarray:
    rng = np.random.default_rng(seed_or_rng)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


@functools.partial(jax.jit, static_argnames=("order", "group"))
def _rows(x, order="even_odd", group=None):
    return FE.mxfp4_to_e4m3(quantize(x, MXFP4()), order=order, group=group)


_per_token_e4m3 = jax.jit(FE.per_token_e4m3, static_argnames=("order",))


def _operands(seed, m, n, k, r):
    rng = np.random.default_rng(seed)
    a, w, h = _normal(rng, (m, k), 2.0), _normal(rng, (n, k), 0.05), _normal(rng, (m, r), 0.5)
    a[:, 7] *= 60.0
    a[1] = h[1] = 0.0  # an all-zero row; h = x R^T is zero where x is (the layer's h)
    lowrank = (jnp.asarray(h.astype(jnp.bfloat16)), jnp.asarray(_normal(rng, (n, r), 0.1).astype(jnp.bfloat16)))
    return _rows(a), _rows(w), lowrank, jnp.asarray(_normal(rng, (n,)))


def test_mirror_equals_the_float64_product():
    a8, w8, lowrank, bias = _operands(0, 40, 96, 128, 32)
    y = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=lowrank, bias=bias), np.float64)
    ref = G8.fp8_matmul_reference(a8, w8, lowrank=lowrank, bias=bias)
    assert float(a8.scale[1]) == 2.0**-126  # an all-zero row: the smallest scale, h / sa stays 0
    np.testing.assert_allclose(y[1], np.asarray(bias, np.float64), rtol=1e-6)
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 1e-6, rel
    # off the GPU the wrapper runs the mirror; the layer's out dtype is honoured
    got = F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias)
    assert got.dtype == jnp.bfloat16 and got.shape == (40, 96)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        F.fp8_matmul_mgpu_reference(a8, w8, lowrank=lowrank, bias=bias, out_dtype=jnp.bfloat16)))


def test_low_rank_term_beside_the_smallest_row_scale():
    """An all-zero activation row has the smallest factor, 2**-126; its low-rank term (any h) stays exact: the kernel
    scales the accumulator by the row factors and never divides h by them."""
    a8, w8, (h, left), bias = _operands(1, 40, 96, 128, 32)
    h = h.at[1].set(300.0)
    y = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=(h, left), bias=bias), np.float64)
    ref = G8.fp8_matmul_reference(a8, w8, lowrank=(h, left), bias=bias)
    assert float(a8.scale[1]) == 2.0**-126 and np.all(np.isfinite(y))
    np.testing.assert_allclose(y[1], ref[1], rtol=1e-6)


def test_zero_scale_rows_give_their_low_rank_term_and_bias():
    x = _normal(5, (8, 64))
    x[3] = 0.0
    a8 = _per_token_e4m3(x, order="even_odd")
    assert float(a8.scale[3]) == 1.0  # the library's encoders give zero rows a non-zero scale; a caller's may not:
    a8 = dataclasses.replace(a8, scale=a8.scale.at[3].set(0.0))  # the kernel takes 1 there (the bytes are zero)
    w8 = _rows(_normal(6, (16, 64)))
    h = jnp.ones((8, 16)).at[3].set(0.0)
    y = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=(h, jnp.ones((16, 16))), bias=jnp.ones((16,))))
    assert np.all(np.isfinite(y)) and np.all(y[3] == 1.0)


def test_nan_rows_propagate():
    a = _normal(3, (8, 64))
    a[2, 5] = np.nan
    a8, w8 = _rows(a), _rows(_normal(4, (16, 64)))
    y = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=(jnp.ones((8, 16)), jnp.ones((16, 16)))))
    assert np.all(np.isnan(y[2])) and np.all(np.isfinite(np.delete(y, 2, axis=0)))


def test_row_group_scales_mirror_equals_the_float64_product():
    """Activations with one exponent per row and K group: the mirror (and so the kernel's contract) is eq. 11 of the
    exact values; the step factors keep the accumulator in the last live group's units, exactly."""
    a = _normal(8, (40, 256), 2.0)
    a[3, :128] *= np.float32(2.0**-25)
    a[4, 64:192] = 0.0
    a[5, 70] = np.nan
    a8 = _rows(a, group=64)  # 4 groups: even 0, 1, odd 0, 1
    w8 = _rows(_normal(9, (96, 256), 0.05))
    h, left = jnp.ones((40, 16), jnp.bfloat16), jnp.asarray(_normal(10, (96, 16), 0.1))
    bias = jnp.arange(96, dtype=jnp.float32) / 96
    y = np.asarray(F.fp8_matmul_mgpu_reference(a8, w8, lowrank=(h, left.astype(jnp.bfloat16)), bias=bias),
                   np.float64)
    ref = G8.fp8_matmul_reference(a8, w8, lowrank=(h, left.astype(jnp.bfloat16)), bias=bias)
    assert np.all(np.isnan(y[5])) and np.all(np.isfinite(np.delete(y, 5, axis=0)))
    ok = np.delete(np.arange(40), 5)
    rel = np.linalg.norm(y[ok] - ref[ok]) / np.linalg.norm(ref[ok])
    assert rel < 1e-6, rel
    # the factors per K step: 2 steps per group of 64 at tile_k = 32; a group's first step rescales, the other is 1
    scale = jnp.asarray([[2.0**3, 0.0, 2.0**-2, 2.0**5], [0.0, 0.0, 0.0, 0.0], [1.0, jnp.nan, 2.0, 4.0]])
    steps, row = F._group_steps(scale, 2)
    np.testing.assert_array_equal(np.asarray(steps), [[1, 1, 1, 1, 2.0**5, 1, 2.0**-7, 1],
                                                      [1] * 8, [1, 1, 1, 1, 0.5, 1, 0.5, 1]])
    assert float(row[0]) == 2.0**5 and float(row[1]) == 0.0 and np.isnan(float(row[2]))
    # the factors take one f32 (tile_m,) buffer per pipeline stage; the default tiling leaves room for them
    cfg = F.default_config(4096, 4608, 4608, 128, step_factors=True)
    assert cfg.smem_bytes(128, 2, True) - cfg.smem_bytes(128, 2) == cfg.max_concurrent_steps * cfg.tile_m * 4
    assert cfg.smem_bytes(128, 2, True) <= F.SMEM_LIMIT


def test_row_group_scales_refused_where_the_kernel_cannot_take_them():
    a8 = _rows(_normal(1, (64, 128)), group=32)
    w8 = _rows(_normal(2, (128, 128)))
    with pytest.raises(ValueError, match="group of 32 values need a tile_k dividing it"):
        F.fp8_matmul_mgpu(a8, w8, config=F.Fp8MgpuConfig(tile_k=64), impl="pallas")
    with pytest.raises(ValueError, match="delay_release=0"):
        F.fp8_matmul_mgpu(a8, w8, config=F.Fp8MgpuConfig(tile_k=32, delay_release=1), impl="pallas")
    with pytest.raises(ValueError, match="the weight takes one per row"):
        F.fp8_matmul_mgpu(w8, a8)
    with pytest.raises(ValueError, match="fp8_matmul_mgpu only"):
        G8.fp8_matmul(a8, w8)


SMALL = dict(tile_m=64, tile_n=64, tile_k=32, epi_tile_n=64)
INTERPRET_CASES = [
    ("ragged_m_3ctas_rank32_in_2_chunks_bias_zero_scales", dict(kind="fp8", m=100, n=256, k=128, rank=32, bias=True,
                                                                zero_scale_rows=True,
                                                                config=dict(SMALL, num_ctas=3, lowrank_chunk=16))),
    ("tm128_tk128_no_lowrank_2slots", dict(kind="fp8", m=128, n=128, k=256, rank=0, bias=False,
                                           config=dict(SMALL, tile_m=128, tile_k=128, epi_tile_n=32, epi_slots=2,
                                                       num_ctas=1))),
    # the SwiGLU epilogue: rows in groups of tile_n (gates | ups), output (m, n/2)
    ("swiglu_group64_ragged_m_rank32_bias", dict(kind="fp8", m=70, n=256, k=64, rank=32, bias=True, swiglu_group=64,
                                                 config=dict(SMALL, epi_tile_n=32, num_ctas=2))),
    # a warpgroup tile that is not a power of two (the narrow models' tilings): CTA 192 columns, 32-column output
    ("tile_n96_two_cta_columns_rank16", dict(kind="fp8", m=64, n=384, k=64, rank=16, bias=True,
                                            config=dict(SMALL, tile_n=96, epi_tile_n=32))),
    # one exponent per row and K group of 32 (one per K step): the accumulator rescaled between wgmmas
    ("row_groups_of_32_ragged_m_rank16_bias", dict(kind="fp8", m=70, n=128, k=128, rank=16, bias=True, row_group=32,
                                                   config=dict(SMALL, num_ctas=2))),
    # groups of 64 over 32-wide K steps: the rescale on each group's first step only (the second's factor is 1)
    ("row_groups_of_64_two_steps_each", dict(kind="fp8", m=64, n=128, k=256, rank=16, bias=True, row_group=64,
                                             config=SMALL)),
    # a K step's wgmma left running while the next is issued; its stage released one step later (4 K steps)
    ("delay_release1_rank16", dict(kind="fp8", m=64, n=128, k=128, rank=16, bias=True,
                                   config=dict(SMALL, delay_release=1, max_concurrent_steps=2))),
]


@pytest.mark.skipif(not _OK, reason=_REASON)
def test_kernel_in_gpu_interpret_mode():
    results = mgpu_interpret.run_in_subprocess([c for _, c in INTERPRET_CASES], timeout_s=900)
    for (name, case), r in zip(INTERPRET_CASES, results):
        assert r["shape"] == [case["m"], case["n"] // (2 if case.get("swiglu_group") else 1)], name
        assert r["nonfinite"] == 0, (name, r)
        assert r["max_err_over_bound"] <= 1.0, (name, r)
        assert not r["races"], (name, r)


@pytest.mark.parametrize("m,n,r,cfg,out_dtype,group", [
    (512, 4608, 128, None, jnp.bfloat16, None),  # Ideogram 4's q at m = 512: the default tiling
    (4096, 24576, 128, None, jnp.float32, None),  # w1|w3 at m = 4096 with f32 output: 16-column output tiles
    (4096, 24576, 128, None, jnp.bfloat16, 128),  # w1|w3 with the SwiGLU in the epilogue: (4096, 12288) out
    (4096, 4608, 0, F.Fp8MgpuConfig(max_concurrent_steps=3, grid_tile_width=4, epi_slots=2), jnp.bfloat16, None),
    (4096, 4608, 128, F.Fp8MgpuConfig(max_concurrent_steps=2, lowrank_chunk=32), jnp.bfloat16, None),  # 4 chunks
    (4096, 1152, 128, None, jnp.bfloat16, None),  # PixArt-Σ ff.down: the 192-wide default (CTA 384, chunks of 32)
    (512, 1152, 128, None, jnp.bfloat16, None),  # ... at m = 512: the 64-wide default
    (4096, 4608, 128, None, jnp.bfloat16, "row_groups"),  # one activation exponent per row and K step of 128
])
def test_lowers_to_mosaic_gpu(m, n, r, cfg, out_dtype, group):
    k = 4608
    out_bytes = jnp.dtype(out_dtype).itemsize
    assert (cfg or F.default_config(m, n, k, r, out_bytes=out_bytes)).smem_bytes(r, out_bytes) <= F.SMEM_LIMIT
    S = jax.ShapeDtypeStruct
    row_groups = group == "row_groups"
    group = None if row_groups else group

    def f(a8, sa, w8, sw, b, h, left):
        a, w = FE.Fp8Rows(a8, sa, jnp.int32(0), "even_odd"), FE.Fp8Rows(w8, sw, jnp.int32(0), "even_odd")
        return F.fp8_matmul_mgpu(a, w, lowrank=(h, left) if r else None, bias=b, config=cfg, impl="pallas",
                                 out_dtype=out_dtype, swiglu_group=group)

    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128) if row_groups else (m,), jnp.float32),
            S((n, k), jnp.float8_e4m3fn), S((n,), jnp.float32),
            S((n,), jnp.float32), S((m, max(r, 16)), jnp.bfloat16), S((n, max(r, 16)), jnp.bfloat16))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    dtype_name = "bf16" if out_bytes == 2 else "f32"
    assert "mosaic_gpu" in text and f"tensor<{m}x{n // 2 if group else n}x{dtype_name}>" in text


@functools.lru_cache(maxsize=None)  # tests that take the same layer share it (a frozen pytree)
def _quantized_layer(seed, o, d, rank=32):
    """A KroQuant layer: random ``W``, bias, Kronecker-LU parameters near the init, low-rank factors."""
    from kroquant_jax import transforms
    from kroquant_jax.qlinear import build_qlinear
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda v: np.asarray(v) + _normal(rng, np.shape(v), 0.05), transforms.get("kron_lu").init(d))
    lowrank = (_normal(rng, (o, rank), 0.05), _normal(rng, (rank, d), 0.05))
    return build_qlinear(_normal(rng, (o, d), 1 / np.sqrt(d)), _normal(rng, (o,), 0.3), transform="kron_lu",
                         transform_params=params, lowrank=lowrank)


# the layer preparations, each one jitted program (the same jnp ops; integer and exact conversions, the same bytes)
_serve = jax.jit(served.serve, static_argnames=("swiglu", "transform_kernel", "strategy"))
_prepare_fp8_layer = jax.jit(G8.prepare_fp8_layer, static_argnames=("act", "weight_storage", "act_encode"))


def test_layer_and_served_strategy():
    qlayer = _quantized_layer(5, 64, 128)
    layer = _prepare_fp8_layer(_serve(qlayer))
    x = _normal(6, (20, 128))
    x[:, 3] *= 15.0
    x = jnp.asarray(x.astype(jnp.bfloat16))
    y, inexact = G8.fp8_linear_forward(layer, x, out_dtype=jnp.float32, return_inexact=True, gemm="mgpu")
    ref = G8.fp8_linear_reference(layer, x)
    assert int(inexact) == 0
    assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 1e-6
    assert "fp8_mgpu" in served.strategy_names()
    mg = _serve(qlayer, strategy="fp8_mgpu")
    assert isinstance(mg, G8.Fp8Linear)
    # the strategy runs a Kronecker transform as K1 (dense blocks made once), K2 when asked: the same bytes
    mg2 = _serve(qlayer, strategy="fp8_mgpu", transform_kernel="k2")
    assert mg.transform.kind == "k1" and mg2.transform.kind == "k2"
    quantized = [G8._activations(lay, x, "interpret") for lay in (mg, mg2)]
    np.testing.assert_array_equal(np.asarray(quantized[0].codes), np.asarray(quantized[1].codes))
    np.testing.assert_array_equal(np.asarray(quantized[0].scales), np.asarray(quantized[1].scales))
    # L / sw made once at preparation: the same bytes as the per-call division
    assert mg.left_over_scale is not None and mg.left_over_scale.dtype == jnp.bfloat16
    per_call = dataclasses.replace(mg, left_over_scale=None)
    np.testing.assert_array_equal(
        np.asarray(G8.fp8_linear_forward(mg, x, gemm="mgpu", out_dtype=jnp.float32)),
        np.asarray(G8.fp8_linear_forward(per_call, x, gemm="mgpu", out_dtype=jnp.float32)))
    doubled = dataclasses.replace(mg, left_over_scale=2 * mg.left_over_scale)  # it is the operand the GEMM uses
    assert not np.array_equal(np.asarray(G8.fp8_linear_forward(doubled, x, gemm="mgpu", out_dtype=jnp.float32)),
                              np.asarray(G8.fp8_linear_forward(mg, x, gemm="mgpu", out_dtype=jnp.float32)))
    got = served.forward(mg, x, options=served.ServeOptions(strategy="fp8_mgpu", impl="interpret"))
    assert got.dtype == jnp.bfloat16
    want = G8.fp8_linear_forward(layer, x, impl="interpret", out_dtype=jnp.float32)
    assert np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= 4e-3 * np.linalg.norm(ref)
    # an op runs in XLA on the kernel's output: with f32 out the same as the XLA GEMM's layer up to summation order
    nw = jnp.asarray(1.0 + _normal(7, (32,), 0.1))
    norm = dict(op="rmsnorm", norm_weight=nw, head_dim=32, eps=1e-5)
    a = G8.fp8_linear_forward(layer, x, out_dtype=jnp.float32, gemm="mgpu", **norm)
    b = G8.fp8_linear_forward(layer, x, out_dtype=jnp.float32, **norm)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # with bf16 out (the served strategy's choice for bf16 activations) on the kernel's bf16 output, as after a bf16
    # linear
    y16 = G8.fp8_linear_forward(layer, x, out_dtype=jnp.bfloat16, gemm="mgpu")
    normed = G8.fp8_linear_forward(layer, x, out_dtype=jnp.bfloat16, gemm="mgpu", **norm)
    np.testing.assert_array_equal(np.asarray(normed, np.float32),
                                  np.asarray(rmsnorm_heads(y16, nw, head_dim=32, eps=1e-5), np.float32))
    served_normed = served.forward(mg, x, op="rmsnorm", norm_weight=nw, head_dim=32, eps=1e-5,
                                   options=served.ServeOptions(strategy="fp8_mgpu"))
    assert served_normed.dtype == jnp.bfloat16
    # jitted, XLA may keep the f32 value between the kernel's output and the norm (excess precision): within bf16
    diff = np.asarray(served_normed, np.float32) - np.asarray(normed, np.float32)
    assert np.linalg.norm(diff) <= 4e-3 * np.linalg.norm(np.asarray(normed, np.float32))


def test_an_all_zero_weight_row_keeps_its_low_rank_term_finite():
    """A weight row quantized to all zeros (scale byte 0) with a low-rank branch: the re-encode gives it the clamped
    factor 2**-126, and the kernel's operand L / sw scaled that row's branch by 2**126 (inf). A prepared weight gives
    such a row factor 0 (the kernel takes 1), and so does the per-call division; the row's output is its branch, as
    the dequantize strategy computes it."""
    qlayer = _quantized_layer(8, 64, 128)
    codes, scales = np.array(qlayer.weight.codes), np.array(qlayer.weight.scales)
    codes[0], scales[0] = 0, 0  # what quantize gives for an all-zero residual row
    weight = dataclasses.replace(qlayer.weight, codes=jnp.asarray(codes), scales=jnp.asarray(scales))
    qlayer = dataclasses.replace(qlayer, weight=weight)
    x = jnp.asarray(_normal(9, (8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    want = np.asarray(served.forward(_serve(qlayer, strategy="dequant"), x,
                                     options=served.ServeOptions(strategy="dequant")), np.float32)
    mg = _serve(qlayer, strategy="fp8_mgpu")
    assert float(mg.weight.scale[0]) == 0.0 and float(jnp.min(mg.weight.scale[1:])) > 0.0
    for impl in ("reference", "interpret"):
        got = np.asarray(served.forward(mg, x, options=served.ServeOptions(strategy="fp8_mgpu", impl=impl)),
                         np.float32)
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max(), err_msg=impl)
    raw = FE.mxfp4_to_e4m3(weight, order="even_odd")  # not prepared: the zero row's factor is the clamp's
    assert float(raw.scale[0]) == 2.0 ** -126
    a8 = FE.mxfp4_to_e4m3(quantize(jnp.asarray(_normal(10, (8, 128)), jnp.float32), MXFP4()), order="even_odd")
    lowrank = (jnp.ones((8, 32), jnp.bfloat16), jnp.full((64, 32), 4.0, jnp.bfloat16))  # L / 2**-126 = 2**128: inf
    y = np.asarray(F.fp8_matmul_mgpu(a8, raw, lowrank=lowrank, impl="reference"))
    assert np.all(np.isfinite(y)) and np.allclose(y[:, 0], 32 * 4.0)


def test_swiglu_pairs_reads_gate_up_pairs_in_place():
    c = jnp.asarray(_normal(8, (6, 16)).astype(jnp.bfloat16))
    gathered = swiglu(jnp.concatenate([c[:, 0::2], c[:, 1::2]], axis=1))  # gate | up, then SiLU(gate) * up
    got = served.swiglu_pairs(c)
    assert got.shape == (6, 8) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(gathered, np.float32))


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="tile_m"):
        F.Fp8MgpuConfig(tile_m=96)
    with pytest.raises(ValueError, match="tile_k"):
        F.Fp8MgpuConfig(tile_k=48)
    with pytest.raises(ValueError, match="tile_n"):
        F.Fp8MgpuConfig(tile_n=512)
    with pytest.raises(ValueError, match="epi_slots"):
        F.Fp8MgpuConfig(epi_slots=3)
    with pytest.raises(ValueError, match="delay_release"):
        F.Fp8MgpuConfig(delay_release=1, max_concurrent_steps=1)
    assert F.default_config(4096, 4608, 4608).tile_m == 128 and F.default_config(512, 4608, 4608).tile_m == 128
    assert F.default_config(64, 4608, 4608).tile_m == 64
    assert F.default_config(512, 4608, 4640).tile_k == 32
    assert F.supports(4096, 4608, 4608) and not F.supports(4096, 4600, 4608)
    for r in (0, 128, 256):
        for out_bytes in (2, 4):
            assert F.default_config(4096, 4608, 4608, r, out_bytes=out_bytes).smem_bytes(r, out_bytes) <= F.SMEM_LIMIT
    # rank 128 whole would leave one pipeline stage; in chunks of 64 three fit
    cfg = F.default_config(4096, 4608, 4608, 128)
    assert (cfg.max_concurrent_steps, cfg.chunk(128), cfg.epi_tile_n) == (3, 64, 32)
    # f32 output tiles take twice the bytes: narrower ones keep the three stages (this default overflowed before)
    cfg32 = F.default_config(4096, 4608, 4608, 128, out_bytes=4)
    assert (cfg32.max_concurrent_steps, cfg32.chunk(128), cfg32.epi_tile_n) == (3, 64, 16)
    assert cfg.smem_bytes(128, 4) > F.SMEM_LIMIT
    assert F.Fp8MgpuConfig(max_concurrent_steps=3).smem_bytes(128) > F.SMEM_LIMIT
    with pytest.raises(ValueError, match="lowrank_chunk"):
        F.Fp8MgpuConfig(lowrank_chunk=24)
    # the model's count is at least Mosaic GPU's own (which refused 232,560 bytes for this one)
    assert F.Fp8MgpuConfig(max_concurrent_steps=4, epi_slots=2).smem_bytes(0) > F.SMEM_LIMIT
    a8, w8, lowrank, bias = _operands(1, 40, 96, 128, 32)  # the mirror tests' shapes (one compiled program)
    with pytest.raises(TypeError, match="Fp8Rows"):
        F.fp8_matmul_mgpu(quantize(jnp.ones((40, 128)), MXFP4()), w8)
    with pytest.raises(ValueError, match="reduction lengths"):
        F.fp8_matmul_mgpu(a8, _rows(jnp.ones((96, 96))))
    with pytest.raises(ValueError, match="column order"):
        F.fp8_matmul_mgpu(a8, _rows(jnp.ones((96, 128)), order="natural"))
    with pytest.raises(ValueError, match="bias"):
        F.fp8_matmul_mgpu(a8, w8, bias=jnp.ones((3,)))
    with pytest.raises(ValueError, match="lowrank"):
        F.fp8_matmul_mgpu(a8, w8, lowrank=(lowrank[0], lowrank[1][:5]))
    with pytest.raises(ValueError, match="multiple of 16"):
        F.fp8_matmul_mgpu(a8, w8, lowrank=(lowrank[0][:, :8], lowrank[1][:, :8]))
    with pytest.raises(ValueError, match="impl"):
        F.fp8_matmul_mgpu(a8, w8, impl="triton")
    with pytest.raises(ValueError, match="lowrank_chunk"):  # rank 48 in chunks of 32
        F.fp8_matmul_mgpu(a8, w8, lowrank=(jnp.ones((40, 48)), jnp.ones((96, 48))), impl="pallas",
                          config=F.Fp8MgpuConfig(lowrank_chunk=32))
    with pytest.raises(ValueError, match="shared memory"):
        F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, impl="pallas",
                          config=F.Fp8MgpuConfig(max_concurrent_steps=8, tile_k=128))
    layer = _prepare_fp8_layer(_serve(_quantized_layer(5, 64, 128)))  # test_layer_and_served_strategy's layer
    x = jnp.ones((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="gemm="):
        G8.fp8_linear_forward(layer, x, gemm="cublas")
    with pytest.raises(ValueError, match="accumulation"):
        G8.fp8_linear_forward(layer, x, gemm="mgpu", accumulation="precise")


def test_swiglu_layer_runs_the_swiglu_in_the_kernel():
    """The fp8_mgpu strategy prepares a SwiGLU layer's rows in the kernel's order (groups of 128: gates | ups) and
    runs the SwiGLU in the GEMM's epilogue: the same output as the XLA FP8 strategy's gate/up pairs."""
    qlayer = _quantized_layer(9, 512, 128)
    x = _normal(10, (20, 128))  # 20 rows: test_layer_and_served_strategy's (its activation programs compiled once)
    x[:, 7] *= 12.0
    x = jnp.asarray(x.astype(jnp.bfloat16))
    pairs = _serve(qlayer, strategy="fp8", swiglu=True)
    fused = _serve(qlayer, strategy="fp8_mgpu", swiglu=True)
    assert (pairs.swiglu_group, fused.swiglu_group) == (0, F.SWIGLU_GROUP)
    order = F.swiglu_halves_order(512, F.SWIGLU_GROUP)
    np.testing.assert_array_equal(np.asarray(fused.weight.values, np.float32),
                                  np.asarray(pairs.weight.values, np.float32)[order])
    np.testing.assert_array_equal(np.asarray(fused.bias), np.asarray(pairs.bias)[order])
    want = served.forward(pairs, x, op="swiglu", options=served.ServeOptions(strategy="fp8"), out_dtype=jnp.float32)
    got = served.forward(fused, x, op="swiglu", options=served.ServeOptions(strategy="fp8_mgpu"),
                         out_dtype=jnp.float32)
    assert got.shape == want.shape == (20, 256)
    # the same f32 math in another summation order (the mirror's pre-scaled low-rank term)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    ref = served.reference(fused, x, op="swiglu", strategy="fp8_mgpu", out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(ref))))
    f64 = G8.fp8_linear_reference(fused, x, op="swiglu")
    assert np.linalg.norm(np.asarray(got, np.float64) - f64) <= 1e-3 * np.linalg.norm(f64)
    with pytest.raises(ValueError, match="gemm='mgpu' only"):
        G8.fp8_linear_forward(fused, x, op="swiglu")
    # out_features not a multiple of 2 x 128: the pairs stay, the SwiGLU runs in XLA
    small = _serve(_quantized_layer(9, 192, 128), strategy="fp8_mgpu", swiglu=True)
    assert small.swiglu_group == 0
    assert served.forward(small, x, op="swiglu", options=served.ServeOptions(strategy="fp8_mgpu")).shape == (20, 96)


# (m, n, k) -> (tile_n, stages, rank chunk, output-tile width, snake width) that default_config takes, against the
# H100 sweeps (benchmarks/results/fp8_mgpu_narrow_tiles_2026-12-06.json, fp8_mgpu_tile_choice_2026-12-06.json)
TUNED_128 = (128, 3, 64, 32, 4)
DEFAULT_AT_MEASURED_SHAPES = {
    (4096, 1152, 1152): (192, 2, 32, 64, 1),  # PixArt-Σ attn.q: the best, 21.0 µs against 37.4 with padded 128
    (512, 1152, 1152): (64, 2, None, 64, 1),  # the best
    (4096, 1152, 4608): (192, 2, 32, 64, 1),  # PixArt-Σ ff.down: the best
    (512, 1152, 4608): (64, 2, None, 64, 1),  # the best
    (512, 3072, 3072): (64, 2, None, 64, 1),  # FLUX.1 q: the best, 17.8 µs against 22.0 with 128
    (4096, 3072, 3072): TUNED_128,  # the best
    (4096, 4608, 1152): TUNED_128,  # PixArt-Σ ff.up: the best
    (512, 4608, 1152): TUNED_128,  # 13.5 µs, 3% behind 96 (13.1): under the modelled gain that leaves 128
    (512, 4608, 4608): TUNED_128,  # Ideogram 4 q: 30.5 µs against the modelled best 96's 33.1
}


@pytest.mark.parametrize("shape", list(DEFAULT_AT_MEASURED_SHAPES))
def test_default_tiling_at_the_measured_shapes(shape):
    cfg = F.default_config(*shape, 128)
    assert (cfg.tile_n, cfg.max_concurrent_steps, cfg.lowrank_chunk, cfg.epi_tile_n, cfg.grid_tile_width,
            cfg.tile_m, cfg.tile_k) == (*DEFAULT_AT_MEASURED_SHAPES[shape], 128, 128)
    assert shape[1] % cfg.cta_n == 0 and cfg.smem_bytes(128) <= F.SMEM_LIMIT


def test_tile_width_choice():
    for m in (4096, 4224):  # Ideogram 4's q / w2 keep the tuned tiling of the H200 sweeps
        assert F.choose_tile_n(m, 4608) == 128
    assert F.choose_tile_n(4096, 2240) == 128  # SANA's 2240: no candidate CTA divides it, so 128 with padding
    assert F.choose_tile_n(4096, 1152) == 192 and F.choose_tile_n(512, 1152) == 64
    assert F.choose_tile_n(512, 3072, num_sms=24) == 128  # fewer SMs: 128-wide tiles already fill them
    # a given tile_n (the SwiGLU group) is kept, whatever the shape
    assert F.default_config(512, 1152, 1152, 128, tile_n=128).tile_n == 128
    for m, n in ((4096, 1152), (512, 4608), (64, 1152), (512, 12288)):
        for r, out_bytes in ((0, 2), (128, 2), (256, 4)):
            cfg = F.default_config(m, n, 1152, r, out_bytes=out_bytes)
            assert cfg.smem_bytes(r, out_bytes) <= F.SMEM_LIMIT and n % cfg.cta_n == 0, (m, n, r, out_bytes, cfg)


def test_swiglu_epilogue_arguments():
    # the arguments are checked on the operands' shapes before anything runs: zero operands, nothing to compile
    a8, w8 = (FE.Fp8Rows(jnp.zeros((rows, 64), jnp.float8_e4m3fn), jnp.ones((rows,)), jnp.int32(0), "even_odd")
              for rows in (8, 256))
    with pytest.raises(ValueError, match="2 \\* swiglu_group must divide n"):
        F.fp8_matmul_mgpu(a8, w8, swiglu_group=96, impl="pallas")
    with pytest.raises(ValueError, match="tile_n == swiglu_group"):
        F.fp8_matmul_mgpu(a8, w8, swiglu_group=64, config=F.Fp8MgpuConfig(tile_n=128), impl="pallas")
    assert F.default_config(4096, 24576, 4608, 128, tile_n=128).tile_n == 128
    assert F.default_config(4096, 256, 64, 0, tile_n=64).tile_n == 64
    with pytest.raises(ValueError, match="group"):
        F.swiglu_halves_order(100, 8)
