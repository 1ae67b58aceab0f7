"""The served W4A4 layer's seams (pallas_kernels/served.py): options validation, impl selection, the strategy
registry, each strategy's GEMM against the f32 reference, and the layer against ``qlinear_forward(path="packed")``.

The served layers inside models (fused hooks, stacked hooks) are tested in ``tests/test_fused_hooks.py``.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import qlinear
from kroquant_jax.formats import MXFP4
from pallas_kernels import epilogues as E
from pallas_kernels import served as S
from pallas_kernels import w4a4_gemm as G

GEMM_BS = G.BlockSizes(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)


def _identity_layer(seed=7, d=128, o=64, r=32):
    """A layer with the identity transform (``x T = x``), LoRaQ factors packed in MXFP4, a bias."""
    kw, kl, kr, kx, kb = jax.random.split(jax.random.PRNGKey(seed), 5)
    wt = jax.random.normal(kw, (o, d)) * 0.05
    lowrank = (jax.random.normal(kl, (o, r)) * 0.05, jax.random.normal(kr, (r, d)) * 0.05)
    layer = qlinear.build_qlinear(wt, jax.random.normal(kb, (o,)), lowrank=lowrank)
    assert layer.lowrank_quantized
    return layer, jax.random.normal(kx, (16, d)).astype(jnp.bfloat16)


def _gemm_reference(served, x):
    """f32 ``Q(x T) W^T + h L^T + b`` on the served layer's own quantized inputs (the strategies' common start)."""
    x_q, lowrank = S.quantized_inputs(served, x, "reference")
    return np.asarray(G.w4a4_matmul_reference(x_q, served.weight, lowrank=lowrank, bias=served.bias))


# ---------------------------------------------------------------------------------------------------------------------
# Options and impl selection.
# ---------------------------------------------------------------------------------------------------------------------


def test_serve_options_reject_what_the_strategy_would_ignore():
    assert S.ServeOptions() == S.ServeOptions(strategy="dequant", impl=None)
    S.ServeOptions(fused=False)  # dequant: its op always runs after the GEMM, so "unfused" is what it does
    S.ServeOptions(lowrank="beside")
    S.ServeOptions(strategy="kernel", fused=True, compute="fp8", gemm_blocks=GEMM_BS, norm_blocks=E.EpilogueBlockSizes())
    bad = [
        (dict(strategy="cublas"), "strategy='cublas' is not registered; choose from 'dequant', 'kernel', 'mgpu'"),
        (dict(impl="gpu"), "impl='gpu' must be None, 'pallas', 'interpret', 'reference'"),
        (dict(lowrank="joined"), "lowrank='joined' must be 'fused' or 'beside'"),
        (dict(strategy="kernel", compute="fp4"), "compute='fp4'"),
        (dict(fused=True), "fused=True not read by strategy='dequant'.*apply to strategy 'kernel'"),
        (dict(norm_blocks=E.EpilogueBlockSizes(), swiglu_blocks=E.EpilogueBlockSizes()),
         "norm_blocks, swiglu_blocks not read by strategy='dequant'"),
        (dict(gemm_blocks=GEMM_BS), "gemm_blocks not read"),
        (dict(strategy="mgpu", lowrank="beside"), "lowrank='beside' not read by strategy='mgpu'.*'dequant' / 'kernel'"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            S.ServeOptions(**kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        S.ServeOptions().strategy = "kernel"


def test_resolve_impl_picks_references_off_the_gpu_and_keeps_explicit_choices():
    assert jax.default_backend() == "cpu"
    assert S.resolve_impl(None, jnp.zeros((2, 2))) == "reference"
    assert S.resolve_impl(None) == "reference"
    for impl in S.IMPLS:
        assert S.resolve_impl(impl, jnp.zeros(())) == impl
    with pytest.raises(ValueError, match="impl='triton'"):
        S.resolve_impl("triton")
    # forward with impl=None here is the jnp reference, bit for bit; "interpret" runs the Pallas kernels
    layer, x = _identity_layer()
    served = S.serve(layer)
    np.testing.assert_array_equal(np.asarray(S.forward(served, x, out_dtype=jnp.float32)),
                                  np.asarray(S.reference(served, x, out_dtype=jnp.float32)))
    text = str(jax.make_jaxpr(lambda s, a: S.forward(s, a, options=S.ServeOptions(impl="interpret")))(served, x))
    assert text.count("pallas_call") == 1  # the transform + quantize kernel (the dequant GEMM is XLA)


# ---------------------------------------------------------------------------------------------------------------------
# The strategy registry.
# ---------------------------------------------------------------------------------------------------------------------


def test_a_registered_strategy_is_selected_by_name_and_validated(monkeypatch):
    monkeypatch.setattr(S, "_REGISTRY", dict(S._REGISTRY))  # registrations below end with the test
    seen = []

    class Doubling(S.Strategy):
        """The dequant GEMM, doubled: a strategy that is easy to tell apart."""

        name = "doubling"
        options = frozenset({"gemm_blocks"})

        def gemm(self, layer, x_q, lowrank, op, options, interpret):
            seen.append((type(x_q).__name__, lowrank is not None, options.gemm_blocks, interpret))
            y = G.w4a4_matmul_dequant(x_q, layer.weight, lowrank=lowrank, bias=layer.bias)
            return S.apply_op(2 * y, op)

    S.register_strategy(Doubling())
    assert "doubling" in S.strategy_names()
    layer, x = _identity_layer()
    served = S.serve(layer, strategy="doubling")  # the default prepare: the shared ServedLinear
    options = S.ServeOptions(strategy="doubling", impl="interpret", gemm_blocks=GEMM_BS)
    y = S.forward(served, x, options=options, out_dtype=jnp.float32)
    base = S.forward(served, x, options=S.ServeOptions(impl="interpret"), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(base))
    assert seen == [("QuantizedArray", True, GEMM_BS, True)]
    # its options are its own: the kernel-only fields still raise for it, and its field is accepted only by it
    with pytest.raises(ValueError, match="fused=True not read by strategy='doubling'"):
        S.ServeOptions(strategy="doubling", fused=True)
    with pytest.raises(ValueError, match="apply to strategy 'doubling' / 'kernel'"):
        S.ServeOptions(gemm_blocks=GEMM_BS)
    with pytest.raises(ValueError, match="already registered"):
        S.register_strategy(Doubling())
    S.register_strategy(Doubling(), replace=True)

    class Bad(S.Strategy):
        name = "bad"
        options = frozenset({"tile_m"})

    with pytest.raises(ValueError, match=r"options \['tile_m'\] are no strategy fields"):
        S.register_strategy(Bad())
    with pytest.raises(TypeError, match="Strategy instance"):
        S.register_strategy(lambda *a: a)


def test_the_packages_own_strategies_are_registered_without_importing_their_modules():
    # `kroquant generate --strategy fp8` looks the name up through `served` alone: the FP8 strategies, which live in
    # pallas_kernels/fp8_gemm.py, must be there without the caller importing that module first.
    code = ("import sys; from pallas_kernels import served; assert 'pallas_kernels.fp8_gemm' not in sys.modules; "
            "print(' '.join(served.strategy_names())); print(type(served.get_strategy('fp8_w4a8')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split("\n")
    assert set(out[0].split()) >= {"dequant", "kernel", "mgpu", "fp8", "fp8_w4a8"}
    assert out[1] == "Fp8W4A8Strategy"


def test_program_compiler_options_per_strategy_never_against_the_users_flags():
    # fp8_mgpu's sampler is compiled without XLA's command buffers; the others keep XLA's defaults
    assert S.program_compiler_options("fp8_mgpu", "") == {"xla_gpu_enable_command_buffer": ""}
    assert S.program_compiler_options("dequant", "") == {} and S.program_compiler_options(None, "") == {}
    # an option the user's XLA_FLAGS sets is theirs, whatever the value or spelling
    for flags in ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS", "--xla_gpu_enable_command_buffer=",
                  "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer"):
        assert S.program_compiler_options("fp8_mgpu", flags) == {}
    assert S.program_compiler_options("fp8_mgpu", "--xla_gpu_enable_command_buffer_x=1") != {}  # another option
    with pytest.raises(ValueError, match="strategy='nope' is not registered"):
        S.program_compiler_options("nope", "")
    # every strategy's options are options this XLA knows (a misspelt one fails here, not in a user's sampler)
    for name in S.strategy_names():
        options = S.program_compiler_options(name, "")
        assert float(jax.jit(lambda x: x * 2, compiler_options=options or None)(jnp.float32(1.5))) == 3.0


def test_default_strategy_per_device_and_layers():
    # fp8_mgpu on Hopper where it serves every layer; dequant on a CPU, other GPUs, or when one layer is NVFP4 or has
    # a rank the fused kernel's bf16 wgmma cannot take (the reason names that layer's shape)
    from kroquant_jax.formats import NVFP4

    class Device:
        def __init__(self, platform, capability=None):
            self.platform, self.compute_capability = platform, capability

    kw, kl, kr = jax.random.split(jax.random.PRNGKey(3), 3)
    w = jax.random.normal(kw, (64, 128)) * 0.05

    def layer(rank=32, fmt=MXFP4()):
        lowrank = None
        if rank:
            lowrank = (jax.random.normal(kl, (64, rank)) * 0.05, jax.random.normal(kr, (rank, 128)) * 0.05)
        return qlinear.build_qlinear(w, lowrank=lowrank, weight_fmt=fmt, act_fmt=fmt, lowrank_fmt=fmt,
                                     lowrank_quantized=rank % 32 == 0)  # a 16-bit branch where MXFP4 cannot pack it

    hopper, ampere = Device("gpu", "9.0"), Device("gpu", "8.0")
    mx = [layer(), layer(rank=0), layer(rank=256)]
    assert S.default_strategy(mx, hopper) == ("fp8_mgpu", "'fp8_mgpu': the default on compute capability 9.0")
    assert S.default_strategy(mx, Device("cpu"))[0] == "dequant"
    assert S.default_strategy(mx, jax.devices("cpu")[0])[0] == "dequant"
    name, why = S.default_strategy(mx, ampere)
    assert name == "dequant" and "8.0" in why
    name, why = S.default_strategy(mx + [layer(fmt=NVFP4())], hopper)
    assert name == "dequant" and "(64, 128)" in why and "MXFP4" in why
    name, why = S.default_strategy(mx + [layer(rank=24)], hopper)
    assert name == "dequant" and "rank 24" in why
    assert S.default_strategy([], hopper)[0] == "fp8_mgpu" and S.DEFAULT_STRATEGY == "dequant"
    # asked for by name, the same reasons refuse the layer at preparation, before any work
    with pytest.raises(ValueError, match=r"layer \(64, 128\): .*needs MXFP4"):
        S.serve(layer(fmt=NVFP4()), strategy="fp8")
    with pytest.raises(ValueError, match="rank 24"):
        S.serve(layer(rank=24), strategy="fp8_mgpu")
    assert S.serve(layer(rank=24), strategy="fp8") is not None  # XLA's FP8 GEMM takes any rank


# ---------------------------------------------------------------------------------------------------------------------
# Each strategy's GEMM and low-rank placement.
# ---------------------------------------------------------------------------------------------------------------------


def test_kernel_strategy_lowrank_fused_and_beside():
    layer, x = _identity_layer()
    served = S.serve(layer)
    ref = _gemm_reference(served, x)
    options = S.ServeOptions(strategy="kernel", impl="interpret", gemm_blocks=GEMM_BS)
    # fused low-rank + bias epilogue, bf16 output: within the final bf16 rounding
    y = S.forward(served, x, options=options)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, rtol=2.0**-8, atol=1e-5)
    # low-rank branch beside the kernel (XLA), the sum rounded to bf16 once
    y = S.forward(served, x, options=dataclasses.replace(options, lowrank="beside"), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2.0**-8, atol=1e-5)
    # and against the library's own packed forward (which keeps h in f32): bf16 rounding of h only
    lib = jax.jit(qlinear.qlinear_forward, static_argnames="path")(layer, x.astype(jnp.float32), path="packed")
    np.testing.assert_allclose(ref, np.asarray(lib), rtol=2e-2, atol=2e-2)
    # beside cannot feed a fused epilogue op
    norm = dict(op="rmsnorm", norm_weight=jnp.ones((32,)), head_dim=32)
    with pytest.raises(ValueError, match="lowrank='beside'.*pass fused=False"):
        S.forward(served, x, options=dataclasses.replace(options, lowrank="beside"), **norm)
    y = S.forward(served, x, options=dataclasses.replace(options, lowrank="beside", fused=False), **norm)
    assert y.shape == (16, 64)


@pytest.mark.parametrize("strategy,lowrank", [("dequant", "fused"), ("dequant", "beside"), ("mgpu", "fused")])
def test_xla_strategies_match_the_reference(strategy, lowrank):
    """dequant (decode + one GEMM, or h L^T beside it) and mgpu (off the GPU: the Mosaic kernel's jnp mirror, the
    low-rank term beside it)."""
    layer, x = _identity_layer()
    served = S.serve(layer)
    ref = _gemm_reference(served, x)
    y = S.forward(served, x, options=S.ServeOptions(strategy=strategy, lowrank=lowrank, impl="interpret"),
                  out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2.0**-8, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The served layer against the library's packed forward (K2 transform, with and without the low-rank branch).
# ---------------------------------------------------------------------------------------------------------------------


def _learned_kron(d, key):
    from kroquant_jax import transforms

    p = transforms.get("kron_lu").init(d)
    return jax.tree.map(lambda v: v * (1 + 0.2 * jax.random.normal(key, v.shape)), p)


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("with_lowrank", [False, True])
def test_matches_packed_forward(impl, with_lowrank):
    o, d, r = 32, 64, 32
    w = jax.random.normal(jax.random.key(40), (o, d))
    lowrank = None
    if with_lowrank:
        lowrank = (0.1 * jax.random.normal(jax.random.key(41), (o, r)),
                   0.1 * jax.random.normal(jax.random.key(42), (r, d)))
    layer = qlinear.build_qlinear(w, jnp.ones((o,)), transform="kron_lu",
                                  transform_params=_learned_kron(d, jax.random.key(43)), lowrank=lowrank)
    x = jax.random.normal(jax.random.key(44), (2, 8, d)).astype(jnp.bfloat16)
    ref = np.asarray(qlinear.qlinear_forward(layer, x, path="packed"), np.float32)
    options = S.ServeOptions(strategy="kernel", impl=impl)
    y = np.asarray(S.forward(S.serve(layer), x, options=options), np.float32)
    assert y.shape == (2, 8, o)
    if not with_lowrank:
        np.testing.assert_array_equal(y, ref)
    else:  # the low-rank input h is rounded to bf16 (and T folded into R) in the GEMM path
        np.testing.assert_allclose(y, ref, atol=3e-3 * np.abs(ref).max())
    assert S.prepare_layer_transform(layer).kind == "k2"
    assert S.prepare_layer_transform(layer, kernel="k1").kind == "k1"
    assert S.serve(layer, transform_kernel="k1").transform.kind == "k1"
    assert MXFP4() == S.serve(layer).act_fmt
