"""Ideogram 4 at serving scale: random full-size weights generated on the device, and the analytic FLOP count.

What the serving benchmarks (``benchmarks/ideogram4_serving.py``, ``benchmarks/dit_forward_w4a4.py``) build and count:

* :func:`random_states`: ``(graphdef, [state per seed], seconds)``: weights drawn on the default device by ONE jitted
  initialiser (compiled once, run per seed), so a 9.28 B-parameter model never crosses the host.
* :func:`forward_flops`: matmul FLOPs of one forward (2 per multiply-add; attention as dense ``4 L^2 hidden`` per
  layer), for rooflines.
* The served W4A4 blocks of a ``scan_layers`` model (``benchmarks/dit_forward_w4a4.py``,
  ``benchmarks/ideogram4_stack.py``): :func:`build_block_qlinears` (the 7 quantizable linears of every block as 6
  stacked W4A4 layers, ``w1 | w3`` fused, built on the device from the model's kernels: the real layer math, stand-in
  calibration), :func:`serve_block_layers` (their served form on one strategy) and :func:`block_served_hooks` (the
  stacked hooks that run them: q / k with their per-head RMSNorm, ``w1 | w3`` with the SwiGLU, the rest plain).
  With ``fuse_qkv=True`` q, k and v, which read the same input, are one layer ``[W_q; W_k; W_v]`` under one transform
  and one low-rank branch (as ``w1 | w3`` always are): one quantizer call and one GEMM per block instead of three,
  the q / k norms on its slices. A calibrated checkpoint can be served that way only if its q, k, v were calibrated
  as one layer (one transform for the three).
* :func:`bf16_qkv_hooks`: the bf16 model with the same q | k | v fusion (one GEMM over the concatenated kernels), so
  that a fused W4A4 forward is compared with a bf16 forward fused alike.
"""

from __future__ import annotations

import time

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models import ideogram4 as ig
from models.layers import FusedLinearHooks
from models.quantize_model import build_stacked_qlinears, serve_stacked, served_hooks

__all__ = ["BLOCK_GATE", "BLOCK_NORMED", "BLOCK_PLAIN", "BLOCK_QKV", "BLOCK_QKV_MEMBERS", "BLOCK_UP",
           "bf16_qkv_hooks", "block_served_hooks", "build_block_qlinears", "forward_flops", "random_states",
           "serve_block_layers"]

#: The quantizable linears of the scanned model's one stacked block (paths with ``scan_layers=True``), by how the
#: served W4A4 forward runs them: plain; with the per-head RMSNorm after them; the gate and up projections, one fused
#: ``[w1; w3]`` layer (keyed by the gate) with the SwiGLU after it.
BLOCK_PLAIN = ("layers.attention.to_v", "layers.attention.to_out.0", "layers.feed_forward.w2")
BLOCK_NORMED = ("layers.attention.to_q", "layers.attention.to_k")
BLOCK_GATE, BLOCK_UP = "layers.feed_forward.w1", "layers.feed_forward.w3"
#: q | k | v as one layer (``fuse_qkv=True``), keyed by the joined member paths, members in output order.
BLOCK_QKV_MEMBERS = ("layers.attention.to_q", "layers.attention.to_k", "layers.attention.to_v")
BLOCK_QKV = "|".join(BLOCK_QKV_MEMBERS)


def forward_flops(cfg: ig.Ideogram4Config, tokens: int, text_projection_tokens: int) -> dict[str, float]:
    """Matmul FLOPs of one forward over ``tokens`` tokens (batch 1), the text projection (``llm_features_dim`` ->
    hidden) run over ``text_projection_tokens`` tokens (diffusers: all tokens; the cached sampler: none).
    Returns ``{linears, text_projection, attention, total}``."""
    hidden, inner, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    block_linear = 4 * hidden * hidden + 3 * hidden * inner  # q, k, v, out; w1, w2, w3
    linears = 2.0 * tokens * (layers * block_linear + 2 * cfg.in_channels * hidden)  # + input_proj, final linear
    text = 2.0 * text_projection_tokens * cfg.llm_features_dim * hidden
    attention = 4.0 * tokens * tokens * hidden * layers  # QK^T and PV, dense
    return {"linears": linears, "text_projection": text, "attention": attention,
            "total": linears + text + attention}


def random_states(cfg: ig.Ideogram4Config, seeds: tuple[int, ...]) -> tuple[nnx.GraphDef, list[nnx.State], float]:
    """``(graphdef, [state per seed], seconds)``: random weights of ``cfg`` generated on the default device by one
    jitted initialiser (compiled once, run per seed); nothing is transferred from the host."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(0))))
    init = jax.jit(lambda key: nnx.state(ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(params=key))))
    start = time.perf_counter()
    states = []
    for seed in seeds:
        states.append(init(jax.random.key(seed)))
        jax.block_until_ready(states[-1])
    return graphdef, states, time.perf_counter() - start


def build_block_qlinears(model: ig.Ideogram4Transformer, key: jax.Array, rank: int,
                         fuse_qkv: bool = False) -> dict[str, Any]:
    """Stacked W4A4 layers (``kroquant_jax.qlinear.QuantizedLinear`` with a leading ``num_layers`` axis) of every
    block's quantizable linears, built on the device from the model's bf16 kernels (``build_stacked_qlinears``: the
    real layer math, a random KroQuant transform and randomized low-rank factors of ``rank`` as the calibration).

    Returns ``{path: layer}`` for :data:`BLOCK_NORMED` and :data:`BLOCK_PLAIN` (``(o, d)`` each) and
    :data:`BLOCK_GATE` (the fused ``[w1; w3]`` ``(2 intermediate, hidden)``); layer ``i`` of those paths draws its
    key from ``fold_in(key, i)``, the fused one from ``fold_in(key, 99)``. With ``fuse_qkv`` the three attention
    projections are instead one layer :data:`BLOCK_QKV` ``(3 hidden, hidden)`` (key ``fold_in(key, 98)``), and
    ``to_q``, ``to_k``, ``to_v`` are not among the keys.
    """
    if not model.config.scan_layers:
        raise ValueError("build_block_qlinears needs the stacked blocks of a scan_layers=True model, got "
                         f"scan_layers={model.config.scan_layers}")
    blocks = model.layers
    kernels = {"layers.attention.to_q": blocks.attention.to_q, "layers.attention.to_k": blocks.attention.to_k,
               "layers.attention.to_v": blocks.attention.to_v, "layers.attention.to_out.0": blocks.attention.to_out[0],
               "layers.feed_forward.w2": blocks.feed_forward.w2}
    separate = [p for p in (*BLOCK_NORMED, *BLOCK_PLAIN) if not (fuse_qkv and p in BLOCK_QKV_MEMBERS)]
    layers = {path: build_stacked_qlinears((kernels[path].kernel[...],), jax.random.fold_in(key, i), rank)
              for i, path in enumerate((*BLOCK_NORMED, *BLOCK_PLAIN)) if path in separate}
    if fuse_qkv:
        qkv = tuple(kernels[p].kernel[...] for p in BLOCK_QKV_MEMBERS)
        layers[BLOCK_QKV] = build_stacked_qlinears(qkv, jax.random.fold_in(key, 98), rank)
    gate_up = (blocks.feed_forward.w1.kernel[...], blocks.feed_forward.w3.kernel[...])
    layers[BLOCK_GATE] = build_stacked_qlinears(gate_up, jax.random.fold_in(key, 99), rank)
    return layers


def serve_block_layers(layers: dict[str, Any], strategy: str = "dequant",
                       transform_kernel: Optional[str] = None) -> dict[str, Any]:
    """The served form of :func:`build_block_qlinears`' layers on ``strategy`` (``pallas_kernels.served``: e.g.
    ``"dequant"``, ``"kernel"`` or ``"fp8"``), same keys and leading layer axis; :data:`BLOCK_GATE` prepared for the
    SwiGLU (gate/up row pairs); ``transform_kernel`` (``"k1"`` / ``"k2"``; None: the strategy's choice) as
    ``served.serve``'s."""
    return {path: serve_stacked(layer, swiglu=path == BLOCK_GATE, strategy=strategy, transform_kernel=transform_kernel)
            for path, layer in layers.items()}


def block_served_hooks(served: dict[str, Any], options: Any = None) -> FusedLinearHooks:
    """Stacked hooks (``FusedLinearHooks(stacked=True)``) running :func:`serve_block_layers`' layers with one
    ``pallas_kernels.served.ServeOptions`` (``None``: the default strategy; it must be the one they were served
    for): :data:`BLOCK_PLAIN` plain, :data:`BLOCK_NORMED` with the model's per-head RMSNorm, :data:`BLOCK_GATE` with
    the SwiGLU (replacing ``w1`` and ``w3``); with a :data:`BLOCK_QKV` layer (``fuse_qkv=True``) that one replaces
    q, k and v (the model applies the q / k norms to its slices). Pass ``.entries()`` through jit and rebuild with
    ``FusedLinearHooks.from_entries(entries, stacked=True)`` inside."""
    fused_qkv = BLOCK_QKV in served
    plain = [p for p in BLOCK_PLAIN if not (fused_qkv and p in BLOCK_QKV_MEMBERS)]
    normed = [] if fused_qkv else list(BLOCK_NORMED)
    wanted = {*plain, *normed, BLOCK_GATE, *((BLOCK_QKV,) if fused_qkv else ())}
    missing = sorted(wanted - set(served))
    if missing:
        raise ValueError(f"block_served_hooks: no served layer for {missing} (have {sorted(served)})")
    unused = sorted(set(served) - wanted)
    if unused:
        raise ValueError(f"block_served_hooks: {unused} would not run: {BLOCK_QKV!r} replaces q, k and v")
    return served_hooks({p: served[p] for p in plain}, {p: served[p] for p in normed},
                        {BLOCK_GATE: served[BLOCK_GATE]},
                        shared_input={BLOCK_QKV_MEMBERS[0]: served[BLOCK_QKV]} if fused_qkv else None,
                        options=options, stacked=True)


def _dense(kernel: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.matmul(x.astype(kernel.dtype), kernel)  # (..., d) @ (d, o), as Linear.dense


def bf16_qkv_hooks(model: ig.Ideogram4Transformer) -> FusedLinearHooks:
    """Stacked hooks running the scanned model's q, k, v as one GEMM ``x [K_q | K_k | K_v]`` in the model's own
    weights (``(num_layers, hidden, 3 hidden)``, concatenated once here), every other linear as it is: the bf16
    counterpart of ``fuse_qkv=True``. The outputs equal the separate projections' up to the GEMM's summation order."""
    if not model.config.scan_layers:
        raise ValueError("bf16_qkv_hooks needs the stacked blocks of a scan_layers=True model, got "
                         f"scan_layers={model.config.scan_layers}")
    attention = model.layers.attention
    kernel = jnp.concatenate([attention.to_q.kernel[...], attention.to_k.kernel[...], attention.to_v.kernel[...]],
                             axis=-1)  # (num_layers, hidden, 3 hidden)
    return FusedLinearHooks(shared_input={BLOCK_QKV_MEMBERS[0]: jax.tree_util.Partial(_dense, kernel)}, stacked=True)
