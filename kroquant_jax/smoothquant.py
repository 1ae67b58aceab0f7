"""SmoothQuant as the paper's baseline runs it (appendix D.2): a per-layer (α, β) grid search (docs/calibration.md,
"Choices where the papers are silent", 3).

For a layer with calibration rows ``X (m, d)`` and weight ``W (o, d)``::

    γ_i = max(max_j |X_{j,i}|, eps)^α / max(max_o |W_{o,i}|, eps)^β,      A -> A diag(γ)^{-1},  W -> W diag(γ)

(the diagonal transform ``T = diag(1/γ)``, :mod:`kroquant_jax.transforms.diagonal`). ``(α, β)`` are chosen per layer
from a grid to minimise the layer's output MSE on the calibration rows, with the weight quantized *with a rank-32
16-bit SVD branch* during the search (as the paper does: SmoothQuant serves SVDQuant and LoRaQ, which both add a
branch)::

    err(α, β) = mean (Q(A/γ) Q(Wγ - L R)^T + (A/γ)(L R)^T - A W^T)^2,    L R = SVD_32(W γ)

Set ``svd_rank=0`` to search with the plain 4-bit weight. The grid is evaluated sequentially (``lax.map``) inside
one program per group of equally-shaped layers, ``vmap``-ed and sharded across layers like the calibration engine
(and, with ``pad_to``, sized like the caller's other batches, so a smaller last batch reuses the program).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.formats import MXFP4, QuantFormat, fake_quant
from kroquant_jax.layerset import LayerData, RunConfig, as_layer_set, engine_jit, program_config, run_groups
from kroquant_jax.lowrank import SvdMethod, low_rank_svd, resolve_rank

__all__ = ["SmoothQuantConfig", "SmoothQuantResult", "smoothing_factors", "smoothquant_layers", "search_one"]

_GRID = tuple(round(0.1 * i, 1) for i in range(11))


@dataclasses.dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant search settings.

    Attributes:
      alphas, betas: the grids of migration strengths (default ``0, 0.1, ..., 1`` each: 121 candidates).
      svd_rank: rank of the 16-bit SVD branch used during the search (0: none): an ``int`` or a fraction of each
        layer's ``min(o, d)`` (:func:`kroquant_jax.lowrank.resolve_rank`).
      fmt: quantization format of both operands.
      eps: floor of the channel maxima (avoids 0 ** negative).
      svd_method: see :func:`kroquant_jax.lowrank.low_rank_svd`.
      max_layers_per_program: at most this many stacked layers per compiled program (memory bound).

    The rows (the calibration slice of the run's split), sharding and progress come from the run's
    :class:`kroquant_jax.layerset.RunConfig`, as for every stage.
    """

    alphas: tuple[float, ...] = _GRID
    betas: tuple[float, ...] = _GRID
    svd_rank: int | float = 32
    fmt: QuantFormat = MXFP4()
    eps: float = 1e-5
    svd_method: SvdMethod = "randomized"
    max_layers_per_program: int = 16


class SmoothQuantResult(NamedTuple):
    """Per-layer result: ``gamma (d,)``, the chosen ``alpha``, ``beta``, and the grid of errors ``(nα, nβ)``."""

    gamma: np.ndarray
    alpha: float
    beta: float
    errors: np.ndarray


def smoothing_factors(act_absmax: jax.Array, w_absmax: jax.Array, alpha, beta, eps: float = 1e-5) -> jax.Array:
    """``γ (d,) = max(act_absmax, eps)^α / max(w_absmax, eps)^β`` (per input channel)."""
    return jnp.maximum(act_absmax, eps) ** alpha / jnp.maximum(w_absmax, eps) ** beta


def _candidate_error(a, w, ref, gamma, cfg: SmoothQuantConfig):
    hi = jax.lax.Precision.HIGHEST
    a_s = a / gamma[None, :]
    w_s = w * gamma[None, :]
    out = jnp.zeros_like(ref)
    if cfg.svd_rank:
        left, right = low_rank_svd(w_s, resolve_rank(cfg.svd_rank, w.shape), cfg.svd_method)
        w_s = w_s - jnp.matmul(left, right, precision=hi)
        out = jnp.matmul(jnp.matmul(a_s, right.T, precision=hi), left.T, precision=hi)
    out = out + jnp.matmul(fake_quant(a_s, cfg.fmt), fake_quant(w_s, cfg.fmt).T, precision=hi)
    return jnp.mean(jnp.square(out - ref))


def search_one(a: jax.Array, w: jax.Array, cfg: SmoothQuantConfig = SmoothQuantConfig()):
    """Grid search for one layer (pure): ``a (m, d)`` calibration rows, ``w (o, d)``.

    Returns:
      ``(gamma (d,), index of the best (α, β) in the flattened grid, errors (nα * nβ,))``.
    """
    a = a.astype(jnp.float32)
    w = w.astype(jnp.float32)
    ref = jnp.matmul(a, w.T, precision=jax.lax.Precision.HIGHEST)
    act_max = jnp.max(jnp.abs(a), axis=0)
    w_max = jnp.max(jnp.abs(w), axis=0)
    grid = jnp.asarray([(al, be) for al in cfg.alphas for be in cfg.betas], jnp.float32)  # (K, 2)

    def err(ab):
        gamma = smoothing_factors(act_max, w_max, ab[0], ab[1], cfg.eps)
        return _candidate_error(a, w, ref, gamma, cfg)

    errors = jax.lax.map(err, grid)
    errors = jnp.where(jnp.isfinite(errors), errors, jnp.inf)
    best = jnp.argmin(errors)
    gamma = smoothing_factors(act_max, w_max, grid[best, 0], grid[best, 1], cfg.eps)
    return gamma, best, errors


@functools.partial(engine_jit, static_argnames="cfg")
def _search_stacked(a, w, cfg):
    return jax.vmap(lambda x, y: search_one(x, y, cfg))(a, w)


def smoothquant_layers(layer_set: Mapping[str, LayerData], cfg: SmoothQuantConfig = SmoothQuantConfig(), *,
                       run: RunConfig = RunConfig(), pad_to: int = 1) -> dict[str, SmoothQuantResult]:
    """Runs the (α, β) search for every layer; layers of one shape are stacked and ``vmap``-ed.

    Args:
      layer_set: ``{name: (W, bias, A_rows)}`` (validated).
      cfg: :class:`SmoothQuantConfig`; its driver-only field ``max_layers_per_program`` is not part of the
        compiled program (:func:`kroquant_jax.layerset.program_config`).
      run: the run's rows (the search uses the calibration slice), sharding and progress.
      pad_to: size every program for at least ``min(pad_to, cfg.max_layers_per_program)`` layers
        (:func:`kroquant_jax.layerset.run_stacked_padded`): a caller running several batches of one shape
        (``calibrate.quantize_layer_set``) passes its batch size, so that a smaller last batch reuses the compiled
        program (padding layers are computed and dropped).

    Returns:
      ``{name: SmoothQuantResult}`` in input order.
    """
    layers = as_layer_set(layer_set)
    rows = {}
    groups: dict[tuple, list[str]] = {}
    for name, layer in layers.items():
        rows[name] = layer.activations[run.split(name, layer.activations.shape[0]).calibration]
        if resolve_rank(cfg.svd_rank, layer.weight.shape, None, name) > min(layer.weight.shape):
            raise ValueError(f"layer {name!r}: svd_rank={cfg.svd_rank} exceeds min(o, d) of weight "
                             f"{layer.weight.shape}")
        groups.setdefault((layer.weight.shape, rows[name].shape), []).append(name)
    out = run_groups(functools.partial(_search_stacked, cfg=program_config(cfg)), groups,
                     lambda names: [np.stack([rows[n] for n in names]), np.stack([layers[n].weight for n in names])],
                     max_per_program=cfg.max_layers_per_program, run=run, pad_to=pad_to, desc="SmoothQuant search")
    n_beta = len(cfg.betas)
    results = {}
    for n in layers:
        gamma, best, errors = out[n]
        b = int(best)
        results[n] = SmoothQuantResult(gamma=gamma, alpha=float(cfg.alphas[b // n_beta]),
                                       beta=float(cfg.betas[b % n_beta]),
                                       errors=errors.reshape(len(cfg.alphas), n_beta))
    return results
