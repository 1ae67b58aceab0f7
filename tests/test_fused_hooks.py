"""The quantized Ideogram 4 forward on the W4A4 kernels: served layers, fused-epilogue hooks, stacked (scanned) hooks.

Kernels run with ``interpret=True`` on the CPU (``impl="interpret"``); the whole-model plumbing tests use the served
layers' jnp references (``impl="reference"``) to stay fast. The H200 numbers come from
``benchmarks/dit_forward_w4a4.py`` (docs/w4a4.md).
"""

import dataclasses
import functools
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kroquant_jax import transforms
from kroquant_jax.formats import MXFP4, NVFP4
from kroquant_jax.qlinear import build_qlinear, lowrank_factors, qlinear_forward, random_kron_params, random_qlinear
from models import convert
from models import ideogram4 as ig
from models.layers import LinearHooks
from models.quantize_model import (FusedLinearHooks, build_stacked_qlinears, layer_at, serve_stacked, served_hooks,
                                   split_qlinear_overrides)
from pallas_kernels import epilogues as E
from pallas_kernels import served as S
from pallas_kernels import w4a4_gemm as G

GEMM_BS = G.BlockSizes(16, 32, 32, 4, 2)
NORM_BS = E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, tile=16, num_warps=4, num_stages=2)  # 2 tiles/head
SWIGLU_BS = E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2)
# the Pallas-Triton kernels, interpreted
KERNELS = S.ServeOptions(strategy="kernel", impl="interpret", gemm_blocks=GEMM_BS, norm_blocks=NORM_BS,
                         swiglu_blocks=SWIGLU_BS)
UNFUSED = dataclasses.replace(KERNELS, fused=False)
# the default strategy: transform + quantize kernel interpreted, then XLA (any backend)
DEQUANT = S.ServeOptions(impl="interpret")
REPO = Path(__file__).resolve().parents[1]


def _rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(y).all()
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _layer(seed: int, o: int, d: int, rank: int | None = 32, lowrank_quantized: bool = True, bias: bool = False,
           fmt=MXFP4()):
    """A real W4A4 layer: random KroQuant transform near the Hadamard init, LoRaQ-style factors of ``W T^{-T}``
    (weight and activations in ``fmt``; ``L``, ``R`` stored in MXFP4 when ``lowrank_quantized``)."""
    kw, kt, kl = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(kw, (o, d), jnp.float32) / np.sqrt(d)
    params = random_kron_params(kt, d)
    lowrank = None
    if rank:
        w_tilde = transforms.apply_to_weights(w, transforms.get("kron_lu").inverse_blocks(params))
        lowrank = lowrank_factors(w_tilde, kl, rank)
    b = 0.3 * jax.random.normal(jax.random.fold_in(kw, 1), (o,)) if bias else None
    return build_qlinear(w, b, transform="kron_lu", transform_params=params, lowrank=lowrank,
                         lowrank_quantized=lowrank_quantized, weight_fmt=fmt, act_fmt=fmt)


def _x(seed: int, m: int, d: int) -> jax.Array:
    x = jax.random.normal(jax.random.PRNGKey(seed), (m, d), jnp.float32)
    return x.at[:, 5].multiply(12.0).astype(jnp.bfloat16)  # an outlier channel


# ---------------------------------------------------------------------------------------------------------------------
# The stacked device-side layer builders (models.quantize_model).
# ---------------------------------------------------------------------------------------------------------------------


def test_stacked_builders_slice_to_the_single_layer_builders():
    """The stacked layer builders: each slice is the single-layer builder's layer; two kernels give the fused layer;
    ``serve_stacked`` serves each slice as ``serve`` does. The kernels have the shape and dtype of the f32 tiny model's
    attention projections, so the builder programs are those of test_stacked_hooks_in_scan_layout_equal_list_layout."""
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 64), jnp.float32) * 0.2
    # Stacked on a layer axis (lax.map), from (layers, d, o) Linear kernels: the same layer per slice.
    kernels = jnp.stack([w.T, 2.0 * w.T])  # (2, 64, 64)
    stacked = build_stacked_qlinears((kernels,), jax.random.PRNGKey(3), 32)
    assert stacked.weight.codes.shape == (2, 64, 32)
    one = random_qlinear(kernels[1].T, jax.random.split(jax.random.PRNGKey(3), 2)[1], 32)
    np.testing.assert_array_equal(np.asarray(layer_at(stacked, 1).weight.codes), np.asarray(one.weight.codes))
    # Two kernels: the fused [k_1^T; k_2^T] layer.
    fused = build_stacked_qlinears((kernels, kernels[:, :, :16]), jax.random.PRNGKey(3), 32)
    assert fused.weight.codes.shape == (2, 80, 32) and fused.config.out_features == 80
    # serve_stacked == serve per layer.
    s_stacked, s_one = serve_stacked(stacked, swiglu=False), S.serve(layer_at(stacked, 1))
    for a, b in zip(jax.tree_util.tree_leaves(layer_at(s_stacked, 1)), jax.tree_util.tree_leaves(s_one)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------------------------------
# One served layer: kernels (interpret) == the library's packed layer.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowrank", ["mxfp4", "bf16", "none"])
def test_served_linear_matches_qlinear(lowrank):
    layer = _layer(1, 64, 96, rank=None if lowrank == "none" else 32, lowrank_quantized=lowrank == "mxfp4")
    served = S.serve(layer)
    assert (served.left is None) == (lowrank == "none")
    x = _x(2, 20, 96)
    ref = qlinear_forward(layer, x.astype(jnp.float32), "packed")  # f32 (20, 64)
    y = S.forward(served, x, out_dtype=jnp.float32, options=KERNELS)
    assert _rel(y, ref) < 4e-3  # bf16 output (2^-9) + bf16 low-rank input h
    jnp_ref = S.reference(served, x, out_dtype=jnp.float32)
    assert _rel(y, jnp_ref) < 3e-3
    assert S.forward(served, x.reshape(4, 5, 96)).shape == (4, 5, 64)


def test_served_linear_fused_ops_match_unfused():
    x = _x(3, 20, 64)
    layer = _layer(4, 64, 64)
    norm_w = 1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(5), (32,))
    norm = dict(op="rmsnorm", norm_weight=norm_w, head_dim=32, eps=1e-5, out_dtype=jnp.float32)
    ref = E.rmsnorm_heads(qlinear_forward(layer, x.astype(jnp.float32), "packed"), norm_w, head_dim=32, eps=1e-5)
    served = S.serve(layer)
    fused = S.forward(served, x, options=KERNELS, **norm)
    unfused = S.forward(served, x, options=UNFUSED, **norm)
    assert _rel(fused, ref) < 4e-3 and _rel(unfused, ref) < 6e-3 and _rel(fused, unfused) < 6e-3

    layer13 = _layer(6, 128, 64)  # [W_gate; W_up] (2 x 64, 64), one transform and one low-rank branch
    ref = E.swiglu(qlinear_forward(layer13, x.astype(jnp.float32), "packed"))  # (20, 64)
    served13 = S.serve(layer13, swiglu=True)
    fused = S.forward(served13, x, op="swiglu", out_dtype=jnp.float32, options=KERNELS)
    unfused = S.forward(served13, x, op="swiglu", out_dtype=jnp.float32, options=UNFUSED)
    assert fused.shape == (20, 64)
    assert _rel(fused, ref) < 4e-3 and _rel(unfused, ref) < 6e-3
    with pytest.raises(ValueError, match="swiglu_rows"):
        S.forward(served, x, op="swiglu")
    with pytest.raises(ValueError, match="swiglu_rows"):
        S.forward(served13, x)
    with pytest.raises(ValueError, match="norm_weight"):
        S.forward(served, x, op="rmsnorm", norm_weight=norm_w, head_dim=48)
    with pytest.raises(ValueError, match="has 32 features"):
        S.forward(served, x[:, :32])


# ---------------------------------------------------------------------------------------------------------------------
# The "dequant" strategy (decode + one cuBLAS GEMM, the op in XLA): the served layers' default.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mxfp4", "mxfp4_bf16_lowrank", "nvfp4"])
def test_served_dequant_strategy_matches_reference(case):
    fmt = NVFP4() if case == "nvfp4" else MXFP4()
    quantized_lr = case != "mxfp4_bf16_lowrank"  # NVFP4: L packed in MXFP4 (build_qlinear's lowrank_fmt)
    x = _x(21, 20, 64)
    served = S.serve(_layer(22, 64, 64, bias=True, fmt=fmt, lowrank_quantized=quantized_lr))
    assert served.bias is not None and served.weight.fmt == fmt
    assert (type(served.left).__name__ == "QuantizedArray") == quantized_lr  # packed L decoded in even/odd order
    y = S.forward(served, x, options=DEQUANT)  # the default strategy
    assert y.dtype == jnp.bfloat16 and y.shape == (20, 64)
    assert _rel(y, S.reference(served, x, out_dtype=jnp.float32)) < 3e-3

    norm_w = 1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(23), (32,))
    norm = dict(op="rmsnorm", norm_weight=norm_w, head_dim=32, eps=1e-5)
    y = S.forward(served, x, options=DEQUANT, **norm)
    assert _rel(y, S.reference(served, x, out_dtype=jnp.float32, **norm)) < 6e-3  # + GEMM rounding

    layer13 = _layer(24, 128, 64, bias=True, fmt=fmt, lowrank_quantized=quantized_lr)  # [W_gate; W_up]
    served13 = S.serve(layer13, swiglu=True)  # rows, L and bias in gate/up pairs
    y = S.forward(served13, x.reshape(4, 5, 64), op="swiglu", options=DEQUANT)
    assert y.shape == (4, 5, 64)
    y = y.reshape(20, 64)
    assert _rel(y, S.reference(served13, x, op="swiglu", out_dtype=jnp.float32)) < 6e-3
    # against the library's layer on the unpermuted weight: the gate/up pairing is honoured
    assert _rel(y, E.swiglu(qlinear_forward(layer13, x.astype(jnp.float32), "packed"))) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("strategy", ["dequant", "kernel"])
def test_served_layers_on_gpu(strategy, fmt_name):
    """On the H200: both strategies of a served layer (none / rmsnorm over heads of 256 / swiglu, bias, packed L)
    against the served jnp reference, at a ragged m and the 256-wide heads the kernels' epilogues are built for."""
    fmt = NVFP4() if fmt_name == "nvfp4" else MXFP4()
    options = S.ServeOptions(strategy=strategy)
    assert S.resolve_impl(options.impl, jnp.zeros(())) == "pallas"  # the compiled kernels on the GPU
    x = _x(31, 300, 512)
    served = S.serve(_layer(32, 512, 512, bias=True, fmt=fmt))
    y = S.forward(served, x, options=options)
    assert y.dtype == jnp.bfloat16 and y.shape == (300, 512)
    assert _rel(y, S.reference(served, x, out_dtype=jnp.float32)) < 3e-3
    norm_w = 1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(33), (256,))
    norm = dict(op="rmsnorm", norm_weight=norm_w, head_dim=256, eps=1e-6)
    y = S.forward(served, x, options=options, **norm)
    assert _rel(y, S.reference(served, x, out_dtype=jnp.float32, **norm)) < 6e-3
    served13 = S.serve(_layer(34, 1024, 512, bias=True, fmt=fmt), swiglu=True)
    y = S.forward(served13, x, op="swiglu", options=options)
    assert y.shape == (300, 512)
    assert _rel(y, S.reference(served13, x, op="swiglu", out_dtype=jnp.float32)) < 6e-3


def test_served_strategy_default_structure_and_errors(monkeypatch):
    assert S.DEFAULT_STRATEGY == "dequant" and S.ServeOptions().strategy == "dequant"
    assert S.strategy_names()[:3] == ("dequant", "kernel", "mgpu")
    m, d, o, r = 20, 64, 64, 32
    served, x = S.serve(_layer(4, o, d)), _x(3, m, d)
    norm_w = jnp.ones((32,))

    def jaxpr(**options):
        opts = S.ServeOptions(impl="interpret", **options)
        return str(jax.make_jaxpr(lambda s, a: S.forward(s, a, options=opts, op="rmsnorm", norm_weight=norm_w,
                                                         head_dim=32))(served, x))

    # dequant: one transform + quantize kernel, the joined GEMM [Q(xT) | h] [W | L]^T over K = d + r, no W4A4 kernel
    text = jaxpr()
    assert text.count("pallas_call") == 1 and "name=w4a4_matmul_dequant" in text
    assert f"bf16[{m},{d + r}]" in text and f"bf16[{o},{d + r}]" in text and "gemm_rmsnorm" not in text
    text = jaxpr(strategy="kernel", norm_blocks=NORM_BS)
    assert text.count("pallas_call") == 2 and "name=gemm_rmsnorm_mxfp4" in text and "w4a4_matmul_dequant" not in text

    # served_hooks: the default reaches every entry; an explicit choice is kept
    calls = []

    def spy(name, fn):
        return lambda *a, **k: calls.append(name) or fn(*a, **k)

    for name in ("w4a4_matmul_dequant", "w4a4_matmul", "gemm_rmsnorm", "gemm_swiglu"):
        monkeypatch.setattr(S, name, spy(name, getattr(S, name)))
    served13 = S.serve(_layer(6, 128, d), swiglu=True)
    for options, expected in ((S.ServeOptions(impl="interpret"), ["w4a4_matmul_dequant"] * 3),
                              (KERNELS, ["w4a4_matmul", "gemm_rmsnorm", "gemm_swiglu"]),
                              (UNFUSED, ["w4a4_matmul"] * 3)):
        calls.clear()
        hooks = served_hooks({"a": served}, {"b": served}, {"c": served13}, options=options)
        jax.eval_shape(hooks.overrides["a"], x)
        jax.eval_shape(lambda a: hooks.projection_norm["b"](a, norm_w, 1e-5), x)  # eps static, as the model calls
        jax.eval_shape(hooks.swiglu["c"], x)
        assert calls == expected, options
    with pytest.raises(TypeError, match="served_hooks: options must be a pallas_kernels.served.ServeOptions"):
        served_hooks({"a": served}, options={"strategy": "kernel"})
    with pytest.raises(ValueError, match="must share one FP4 format"):
        S.serve(dataclasses.replace(_layer(4, o, d), config=dataclasses.replace(
            _layer(4, o, d).config, act_fmt=NVFP4())))


# ---------------------------------------------------------------------------------------------------------------------
# Fused hooks in the Ideogram 4 modules.
# ---------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _tiny_split(dtype) -> tuple:
    """``(config, graphdef, state)`` of the tiny model in ``dtype``, initialised by one jitted program (op by op,
    every parameter shape's initialiser compiles on its own): built once per dtype for the whole file."""
    cfg = ig.tiny_config(dtype=dtype, param_dtype=dtype)
    return cfg, *nnx.split(nnx.jit(lambda: ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(3)))())


def _tiny_model(dtype=jnp.bfloat16):
    """A fresh tiny model (its own Variables: a test may set its weights) of the file's one initialisation."""
    cfg, graphdef, state = _tiny_split(jnp.dtype(dtype))
    return cfg, nnx.merge(graphdef, state, copy=True)


def _qlayer(linears, seed, rank=32):
    """``build_qlinear`` of one or several (output-stacked) Linears of the model, random KroQuant transform."""
    kernels = tuple(lin.kernel[...][None] for lin in linears)  # (1, d, o_i)
    return layer_at(build_stacked_qlinears(kernels, jax.random.PRNGKey(seed), rank), 0)


def test_fused_hooks_match_unfused_in_attention_and_mlp():
    cfg, model = _tiny_model()
    block = model.layers[0]
    attn, mlp = block.attention, block.feed_forward
    x = jax.random.normal(jax.random.PRNGKey(7), (1, 9, cfg.hidden_size), jnp.bfloat16)
    position_ids = jnp.asarray(np.stack([np.arange(9)] * 3, axis=-1)[None])
    cos, sin = (a.astype(jnp.bfloat16) for a in ig.mrope_cos_sin(position_ids, cfg.attention_head_dim,
                                                                 cfg.rope_theta, cfg.mrope_section))
    # Non-trivial norm weights, so a fused norm that ignored the model's weight would show.
    attn.norm_q.scale[...] = (1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(8), (32,))).astype(jnp.bfloat16)
    attn.norm_k.scale[...] = (1.0 - 0.3 * jax.random.normal(jax.random.PRNGKey(9), (32,))).astype(jnp.bfloat16)
    sq, sk = S.serve(_qlayer([attn.to_q], 10)), S.serve(_qlayer([attn.to_k], 11))
    q_path, k_path = attn.to_q.path, attn.to_k.path
    fused = served_hooks(projection_norm={q_path: sq, k_path: sk}, options=KERNELS)
    gemm_then_op = served_hooks(projection_norm={q_path: sq, k_path: sk}, options=UNFUSED)
    per_linear = served_hooks({q_path: sq, k_path: sk}, options=KERNELS)  # the model's own norm_q / norm_k after it
    out = {name: attn(x, None, cos, sin, hooks) for name, hooks in
           (("fused", fused), ("gemm_then_op", gemm_then_op), ("per_linear", per_linear), ("bf16", None))}
    out["dequant"] = attn(x, None, cos, sin, served_hooks(projection_norm={q_path: sq, k_path: sk}, options=DEQUANT))
    assert _rel(out["fused"], out["per_linear"]) < 1e-2  # bf16 tolerance (one more rounding before the norm)
    assert _rel(out["gemm_then_op"], out["per_linear"]) < 1e-2
    assert _rel(out["dequant"], out["per_linear"]) < 1e-2  # the default strategy, the model's norm weights
    assert _rel(out["fused"], out["bf16"]) > 2e-2  # the W4A4 layers really ran (quantization error)

    layer13 = _qlayer([mlp.w1, mlp.w3], 12)
    w1, w3 = mlp.w1.path, mlp.w3.path
    fused = served_hooks(swiglu={w1: S.serve(layer13, swiglu=True)}, options=KERNELS)
    plain13 = S.serve(layer13)
    forward = functools.partial(S.forward, options=KERNELS)
    per_linear = LinearHooks(split_qlinear_overrides(plain13, [w1, w3], forward=forward))  # model: silu(w1) * w3
    y_fused, y_split, y_bf16 = mlp(x, fused), mlp(x, per_linear), mlp(x, None)
    y_dequant = mlp(x, served_hooks(swiglu={w1: S.serve(layer13, swiglu=True)}, options=DEQUANT))
    assert _rel(y_fused, y_split) < 1e-2
    assert _rel(y_dequant, y_split) < 1e-2
    assert _rel(y_fused, y_bf16) > 2e-2


def test_shared_input_qkv_site_splits_one_output_among_q_k_v():
    """q | k | v as one fused linear: its output's slices take the places of q, k, v (the q / k norms after them), so
    an entry computing the three dense projections at once reproduces the model exactly; a fused W4A4 [W_q; W_k; W_v]
    layer served on the default strategy runs there too, and the recorder still sees each member's input."""
    cfg, model = _tiny_model(jnp.float32)
    attn = model.layers[0].attention
    attn.norm_q.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(8), (32,))
    attn.norm_k.scale[...] = 1.0 - 0.3 * jax.random.normal(jax.random.PRNGKey(9), (32,))
    x = jax.random.normal(jax.random.PRNGKey(7), (1, 9, cfg.hidden_size), jnp.float32)
    position_ids = jnp.asarray(np.stack([np.arange(9)] * 3, axis=-1)[None])
    cos, sin = ig.mrope_cos_sin(position_ids, cfg.attention_head_dim, cfg.rope_theta, cfg.mrope_section)
    members = (attn.to_q, attn.to_k, attn.to_v)
    dense = lambda x_: jnp.concatenate([lin.dense(x_) for lin in members], axis=-1)  # noqa: E731
    reference = attn(x, None, cos, sin, None)
    np.testing.assert_array_equal(np.asarray(attn(x, None, cos, sin, FusedLinearHooks(
        shared_input={attn.to_q.path: dense}))), np.asarray(reference))
    # A permuted output would be caught: q and k swapped changes the attention.
    swapped = lambda x_: jnp.concatenate([members[i].dense(x_) for i in (1, 0, 2)], axis=-1)  # noqa: E731
    assert _rel(attn(x, None, cos, sin, FusedLinearHooks(shared_input={attn.to_q.path: swapped})), reference) > 1e-2

    _, model16 = _tiny_model()  # bf16, the served layers' activation dtype
    attn16 = model16.layers[0].attention
    x16, cos16, sin16 = (a.astype(jnp.bfloat16) for a in (x, cos, sin))
    served_qkv = S.serve(_qlayer([attn16.to_q, attn16.to_k, attn16.to_v], 13))
    y = attn16(x16, None, cos16, sin16, served_hooks(shared_input={attn16.to_q.path: served_qkv}, options=DEQUANT))
    assert 2e-2 < _rel(y, attn16(x16, None, cos16, sin16, None)) < 0.5  # the W4A4 layer ran: quantization error

    seen = []

    class Recorder:
        def wants(self, path):
            return True

        def record(self, path, x_, token_mask=None):
            seen.append(path)

    attn(x, None, cos, sin, FusedLinearHooks(recorder=Recorder(), shared_input={attn.to_q.path: dense}))
    assert seen[:3] == [lin.path for lin in members]


def _served_tables(model, cfg, stacked: bool):
    """Served layers of every block linear (per path, or stacked along the layer axis for the scanned model)."""
    if stacked:
        blocks, prefixes = [model.layers], ["layers"]
    else:
        blocks, prefixes = list(model.layers), [f"layers.{i}" for i in range(cfg.num_layers)]
    plain, norm, swiglu = {}, {}, {}
    for block, prefix in zip(blocks, prefixes):
        a, f = block.attention, block.feed_forward

        def build(linears, seed):
            kernels = tuple(lin.kernel[...] if stacked else lin.kernel[...][None] for lin in linears)
            layers = build_stacked_qlinears(kernels, jax.random.PRNGKey(seed), 32)
            return layers if stacked else layer_at(layers, 0)

        # The same random transforms per layer in both layouts: build the stacked layers, slice them for the list.
        for seed, (name, lin) in enumerate((("attention.to_v", a.to_v), ("attention.to_out.0", a.to_out[0]),
                                            ("feed_forward.w2", f.w2))):
            plain[f"{prefix}.{name}"] = build([lin], seed)
        for seed, (name, lin) in enumerate((("attention.to_q", a.to_q), ("attention.to_k", a.to_k)), start=5):
            norm[f"{prefix}.{name}"] = build([lin], seed)
        swiglu[f"{prefix}.feed_forward.w1"] = build([f.w1, f.w3], 9)
    return plain, norm, swiglu


def test_stacked_hooks_in_scan_layout_equal_list_layout():
    # f32 activations: the two layouts then round identically, and the quantizers see the same inputs (in bf16 a
    # rounding difference between the two XLA programs flips FP4 codes, which the next layers amplify).
    cfg, model = _tiny_model(jnp.float32)
    scan_cfg = dataclasses.replace(cfg, scan_layers=True)
    params = ig.stack_layer_params(convert.flat_state_dict(model), cfg.num_layers)
    scan_model = convert.merge_flat_state(lambda: ig.Ideogram4Transformer(scan_cfg, rngs=nnx.Rngs(0)), params)
    plain, norm, swiglu = _served_tables(scan_model, scan_cfg, stacked=True)
    # The list layout gets each layer's slice of the stacked layers (same transforms, same quantized weights).
    unstack = {}
    for table in (plain, norm, swiglu):
        unstack[id(table)] = {name.replace("layers.", f"layers.{i}.", 1): jax.tree_util.tree_map(lambda t: t[i], layer)
                              for name, layer in table.items() for i in range(cfg.num_layers)}

    def serve(table, swiglu_rows=False):
        return {p: S.serve(layer, swiglu=swiglu_rows) for p, layer in table.items()}

    def serve_table(table, swiglu_rows=False):
        return {p: serve_stacked(layer, swiglu=swiglu_rows) for p, layer in table.items()}

    opts = S.ServeOptions(impl="reference")
    list_hooks = served_hooks(serve(unstack[id(plain)]), serve(unstack[id(norm)]),
                              serve(unstack[id(swiglu)], True), options=opts)
    scan_hooks = served_hooks(serve_table(plain), serve_table(norm), serve_table(swiglu, True), stacked=True,
                              options=opts)
    position_ids, segment_ids, indicator = (jnp.asarray(a) for a in _layout())
    latents = jax.random.normal(jax.random.PRNGKey(4), (*indicator.shape, cfg.in_channels), jnp.float32)
    args = (latents, jnp.array([0.5], jnp.float32), None, position_ids, segment_ids, indicator)
    run = nnx.jit(lambda m, e, stacked: m(*args, hooks=FusedLinearHooks.from_entries(e, stacked)),
                  static_argnums=2)  # the entries (pytrees of Partials) are traced arguments
    y_list = run(model, list_hooks.entries(), False)
    y_scan = run(scan_model, scan_hooks.entries(), True)
    y_bf16 = nnx.jit(lambda m: m(*args))(model)  # one program (eager, every primitive compiles on its own)
    image = np.asarray(indicator[0]) == ig.OUTPUT_IMAGE_INDICATOR
    np.testing.assert_allclose(np.asarray(y_scan), np.asarray(y_list), rtol=1e-6, atol=1e-6)  # exact on the CPU
    assert _rel(y_scan[0][image], y_bf16[0][image]) > 2e-2  # the quantized layers ran in the scan

    # The stacked hooks route through the chosen strategy inside the scanned block (traced, not run): the default
    # runs every served layer (q, k, v, out, w1|w3, w2) as the transform + quantize kernel and one dequant GEMM with
    # K = d + rank; "kernel" as that kernel and a Pallas-Triton W4A4 GEMM (the norm / SwiGLU fused).
    graphdef, state = nnx.split(scan_model)
    tables = (serve_table(plain), serve_table(norm), serve_table(swiglu, True))
    m, d, f = indicator.shape[1], cfg.hidden_size, cfg.intermediate_size
    for options in (DEQUANT, KERNELS):
        entries = served_hooks(*tables, stacked=True, options=options).entries()
        text = str(jax.make_jaxpr(lambda st, e: nnx.merge(graphdef, st)(
            *args, hooks=FusedLinearHooks.from_entries(e, True)))(state, entries))
        # call sites of the jitted GEMM wrappers (identical sub-jaxprs are printed once, their call sites each time)
        calls = [len(re.findall(rf"name={name}\b", text)) for name in
                 ("w4a4_matmul_dequant", "w4a4_matmul", "gemm_rmsnorm", "gemm_swiglu")]
        if options.strategy == "kernel":
            assert calls == [0, 3, 2, 1]  # v, out, w2 plain; q, k with the norm; w1|w3 with the SwiGLU
        else:
            assert calls == [6, 0, 0, 0]
            for k in (d, f):  # [Q(xT) | h] over K = d + 32 (q, k, v, out, w1|w3) and K = f + 32 (w2)
                assert f"bf16[{m},{k + 32}]" in text


def _layout():
    from models import ideogram4_sampling as sampling

    layout = sampling.prepare_ids([3], 2, 3, 4)
    return layout.position_ids, layout.segment_ids, layout.indicator


def test_bad_fused_hooks_raise():
    cfg = ig.tiny_config()
    model = nnx.eval_shape(lambda: ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(0)))
    scan_model = nnx.eval_shape(lambda: ig.Ideogram4Transformer(dataclasses.replace(cfg, scan_layers=True),
                                                                rngs=nnx.Rngs(0)))
    position_ids, segment_ids, indicator = (jnp.asarray(a) for a in _layout())
    args = (jnp.zeros((*indicator.shape, cfg.in_channels)), jnp.array([0.5]), None, position_ids, segment_ids,
            indicator)
    norm_sites, swiglu_sites, shared_sites = model.fused_sites()
    assert set(norm_sites) == {f"layers.{i}.attention.to_{p}" for i in range(2) for p in "qk"}
    assert swiglu_sites["layers.1.feed_forward.w1"] == ("layers.1.feed_forward.w1", "layers.1.feed_forward.w3")
    assert shared_sites == {f"layers.{i}.attention.to_q": tuple(f"layers.{i}.attention.to_{p}" for p in "qkv")
                            for i in range(2)}
    f = lambda x, *_: x  # noqa: E731
    bad = [
        (model, FusedLinearHooks(projection_norm={"layers.0.attention.to_v": f}), "names no projection_norm site"),
        (model, FusedLinearHooks(projection_norm={"layers.0.attention.to_q.typo": f}), "to_q.typo"),
        (model, FusedLinearHooks(swiglu={"layers.0.feed_forward.w3": f}), "names no swiglu site"),
        (model, FusedLinearHooks({"layers.1.feed_forward.w3": f}, swiglu={"layers.1.feed_forward.w1": f}),
         "also have per-linear overrides"),
        (model, FusedLinearHooks(stacked=True), "need scan_layers=True"),
        (scan_model, LinearHooks({}), "list layout"),
        (scan_model, FusedLinearHooks(projection_norm={"layers.attention.to_q": jax.tree_util.Partial(
            f, jnp.ones((3,)))}, stacked=True), "no leading num_layers=2 axis"),
        (scan_model, FusedLinearHooks({"final_layer.linear": f}, stacked=True), "only name block linears"),
        (scan_model, FusedLinearHooks(swiglu={"layers.feed_forward.w2": jax.tree_util.Partial(
            f, jnp.ones((2,)))}, stacked=True), "names no swiglu site"),
        (model, FusedLinearHooks(shared_input={"layers.0.attention.to_k": f}), "names no shared_input site"),
        (model, FusedLinearHooks({"layers.0.attention.to_v": f}, shared_input={"layers.0.attention.to_q": f}),
         "also have per-linear overrides"),
        (model, FusedLinearHooks(projection_norm={"layers.0.attention.to_k": f},
                                 shared_input={"layers.0.attention.to_q": f}), "which projection_norm entry"),
    ]
    for target, hooks, message in bad:
        with pytest.raises(ValueError, match=message):
            target(*args, hooks=hooks)
    # A fused function returning the wrong shape is named: the bf16 model traced (shapes are checked while tracing,
    # so nothing needs to compile and run).
    real_cfg, real = _tiny_model()
    wrong = FusedLinearHooks(projection_norm={"layers.0.attention.to_k": lambda x, s, e: x[..., :16]})
    with pytest.raises(ValueError, match="projection_norm entry layers.0.attention.to_k: returned shape"):
        nnx.eval_shape(lambda m: m(*args, hooks=wrong), real)
    wrong = FusedLinearHooks(shared_input={"layers.0.attention.to_q": lambda x: x})  # hidden wide, not 3 hidden
    with pytest.raises(ValueError, match="shared_input entry layers.0.attention.to_q: returned shape"):
        nnx.eval_shape(lambda m: m(*args, hooks=wrong), real)


def _run_benchmark(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "dit_forward_w4a4.py"), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


#: The fused-kernel variants of the benchmark run: their served layers on the jnp references (--reference-variants).
MGPU = ["w4a4_fp8_mgpu", "w4a4_fp8_mgpu_fused_qkv", "w4a4_fp8_mgpu_one_launch", "w4a4_fp8_mgpu_k2"]
#: Every variant of the benchmark run, in the order the benchmark runs them.
BENCHMARK_VARIANTS = ["bf16", "bf16_fused_qkv", "w4a4_dequant", "w4a4_fp8", *MGPU]


@pytest.fixture(scope="module")
def benchmark_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """``(process, saved JSON, folder)`` of one run of the H200 script on the tiny config (a subprocess), shared by
    the two tests below: one interpreter, one model and one set of quantized layers for every variant. On one of the
    2 blocks: bf16 and its fused q | k | v, the dequant and FP8 strategies on the interpreted transform + quantize
    kernel (with the --check simulation), and the fused-kernel variants on their jnp mirrors; --kernels profiles,
    --hlo-dir HLO."""
    folder = tmp_path_factory.mktemp("dit_forward")
    run = _run_benchmark("--preset", "tiny", "--interpret", "--variants", ",".join(BENCHMARK_VARIANTS),
                         "--reference-variants", ",".join(MGPU), "--blocks", "1", "--check", "--no-tune", "--kernels",
                         "--repeats", "1", "--inner", "1", "--budget-s", "3000",  # no stage skipped
                         "--hlo-dir", str(folder / "hlo"), "--out", str(folder / "forward.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((folder / "forward.json").read_text()), folder


def test_benchmark_fused_fp8_variants_and_kernel_profile(benchmark_run):
    """The fused-kernel variants (its jnp mirror off the GPU) with the activations' E4M3 made by XLA, by the one-launch
    quantizer writing E4M3 (another ``act_encode``), and the transforms as K2 instead of K1: the same bytes, so the same
    forward; --kernels records a profile per timed forward (time and launches per kernel name), --hlo-dir each
    forward's optimized HLO. The other act_encodes (the Pallas re-encode, the two-launch quantizer) take the same
    ``act_encode`` path of the benchmark; their bytes are checked on one layer in
    tests/test_fp8_gemm.py::test_quantizer_fp8_output_gives_the_same_layer_output."""
    run, saved, folder = benchmark_run
    assert saved["reference_variants"] == MGPU
    assert saved["errors"] == {} and saved["finite"] == dict.fromkeys([*BENCHMARK_VARIANTS, "simulate"], True)
    assert saved["checks"]["forward w4a4_fp8_mgpu_k2 vs w4a4_fp8_mgpu"] == 0.0
    assert saved["checks"]["forward w4a4_fp8_mgpu_one_launch vs w4a4_fp8_mgpu"] == 0.0
    with gzip.open(folder / "hlo" / "dit_forward_w4a4_fp8_mgpu_k2.hlo.txt.gz", "rt") as f:
        assert "HloModule" in f.read(200)
    assert 0 < saved["checks"]["forward w4a4_fp8_mgpu vs bf16"] < 0.5
    # q | k | v fused: the bf16 forward up to summation order; the W4A4 one with its own (shared) transform.
    assert saved["checks"]["forward bf16_fused_qkv vs bf16"] < 1e-2
    assert 0 < saved["checks"]["forward w4a4_fp8_mgpu_fused_qkv vs bf16_fused_qkv"] < 0.5
    assert saved["fastest_bf16"] in ("bf16", "bf16_fused_qkv")
    fastest_ms = saved["timings_ms"][saved["fastest_bf16"]]["median_ms"]
    assert saved["fastest_bf16_over"]["w4a4_fp8_mgpu"] == pytest.approx(
        fastest_ms / saved["timings_ms"]["w4a4_fp8_mgpu"]["median_ms"])
    assert set(saved["kernels"]) == set(BENCHMARK_VARIANTS)
    assert all(k["device_ms"] > 0 for k in saved["kernels"].values())
    assert all(set(k["launches"]) == set(k["top_ms"]) for k in saved["kernels"].values())
    assert "kernels of w4a4_fp8_mgpu:" in run.stdout


def test_benchmark_tiny_run(benchmark_run):
    """The H200 script end to end on the tiny config (a subprocess): the dequant forward on one of the 2 blocks, the
    transform + quantize kernel interpreted, with the --check simulation; the FP8 strategy's forward beside it."""
    run, saved, _ = benchmark_run
    assert saved["variants"] == BENCHMARK_VARIANTS and saved["impl"] == "interpret"
    assert set(saved["timings_ms"]) == set(BENCHMARK_VARIANTS)
    assert saved["blocks"] == 1 and saved["model_blocks"] == 2 and "ONLY 1 OF THE REAL 2" in saved["what"]
    assert "1 of the model's 2 (NOT the whole model" in run.stdout
    assert saved["tokens"] == 3 + 4 and saved["errors"] == {}
    assert {name: saved["finite"][name] for name in ("bf16", "w4a4_dequant", "w4a4_fp8", "simulate")} == {
        "bf16": True, "w4a4_dequant": True, "w4a4_fp8": True, "simulate": True}
    ratio = saved["timings_ms"]["bf16"]["median_ms"] / saved["timings_ms"]["w4a4_dequant"]["median_ms"]
    assert saved["bf16_over"]["w4a4_dequant"] == pytest.approx(ratio)
    layers = saved["checks"]["layers"]
    assert len(layers) == 6 and all(err < 5e-3 for err in layers.values())  # 3 layers vs reference and simulate
    # The W4A4 forward is closer to the simulated one than bf16 is (the quantization error), but not equal.
    assert 0 < saved["checks"]["forward w4a4_dequant vs simulate"] < saved["checks"]["forward bf16 vs simulate"]
    assert 0 < saved["checks"]["forward w4a4_fp8 vs simulate"] < saved["checks"]["forward bf16 vs simulate"]
    assert saved["checks"]["forward w4a4_fp8 vs w4a4_dequant"] < saved["checks"]["forward w4a4_fp8 vs bf16"]
    for argv, message in ((["--variants", "bf16,cublas"], "unknown variant"), (["--blocks", "3"], "has 2 blocks")):
        run = _run_benchmark("--preset", "tiny", *argv)
        assert run.returncode == 2 and message in run.stderr
