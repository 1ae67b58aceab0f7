"""Ideogram 4 at serving scale: random full-size weights generated on the device, and the analytic FLOP count.

What the serving benchmarks (``benchmarks/ideogram4_serving.py``, ``benchmarks/dit_forward_w4a4.py``) build and count:

* :func:`random_states`: ``(graphdef, [state per seed], seconds)``: weights drawn on the default device by ONE jitted
  initialiser (compiled once, run per seed), so a 9.28 B-parameter model never crosses the host.
* :func:`forward_flops`: matmul FLOPs of one forward (2 per multiply-add; attention as dense ``4 L^2 hidden`` per
  layer), for rooflines.
"""

from __future__ import annotations

import time

import jax
from flax import nnx

from models import ideogram4 as ig

__all__ = ["forward_flops", "random_states"]


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
