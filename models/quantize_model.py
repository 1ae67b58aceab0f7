"""W4A4 assembly: run a converted model with some of its linears replaced by quantized (or any other) layers.

Nothing in the model is mutated. A replacement is an **override** ``{dotted path: fn(x (..., d)) -> y (..., o)}``
routed by :class:`~models.layers.LinearHooks`; the samplers take it as ``params["overrides"]``, so the 16-bit and
the W4A4 model are the same graph and the same jitted sampler, on the same seeds.

* :func:`qlinear_overrides`: calibrated ``kroquant_jax.qlinear.QuantizedLinear`` layers -> overrides
  (``jax.tree_util.Partial`` of the layer forward: the quantized weights are traced arguments of the jitted sampler,
  not constants baked into it). ``forward`` picks the implementation: the simulation forward (eq. 11, fake quant,
  any device) by default, or e.g. ``pallas_kernels``' packed GPU forward.
* :func:`fake_quant_overrides`: weight+activation fake quantization (RTN, no transform) of every quantizable
  linear, straight from the model (a baseline, and the tests' proof that the path works without calibration).
* :func:`check_overrides`: every override names a linear of the model and returns its shape.
* :class:`FusedLinearHooks`: :class:`~models.layers.LinearHooks` plus **fused sites**, where one function replaces
  a linear together with the small op after it (the GPU's fused GEMM epilogues): ``projection_norm`` (a projection +
  RMSNorm over each head, e.g. Ideogram 4's ``to_q`` + ``norm_q``) and ``swiglu`` (the gate and up projections +
  ``SiLU(gate) * up``, e.g. Ideogram 4's ``w1``, ``w3``). Models that have such sites consume them (Ideogram 4); a
  fused entry that names no site of the model raises. ``stacked=True`` hooks carry a leading layer axis on every
  array of a block linear's entry, for models run with ``lax.scan`` over stacked blocks (``scan_layers=True``).
* :func:`served_hooks`: ``pallas_kernels.served.ServedLinear`` layers (packed W4A4 on the GPU) ->
  :class:`FusedLinearHooks`, all run with one ``served.ServeOptions`` (default strategy ``"dequant"``: decode + one
  cuBLAS GEMM, the q/k norm and SwiGLU as XLA ops after it; ``"kernel"``: the Pallas-Triton W4A4 kernels, the ops in
  their epilogues or, ``fused=False``, after them).
* :func:`split_qlinear_overrides`: one ``QuantizedLinear`` of several stacked linears (e.g. ``[W1; W3]`` sharing their
  input and transform) as per-linear overrides, each taking its rows of the fused output, in a
  :class:`~models.layers.SharedOverrides` (a mapping whose pytree holds each layer once, so that a jitted sampler
  given it as an argument runs the fused layer once, not once per member); :func:`whole_layer_overrides` for a plain
  layer, to merge with them.
* :func:`build_stacked_qlinears`, :func:`serve_stacked`, :func:`layer_at`: stacked (one per block) W4A4 layers of a
  scanned model built on the device from its Linear kernels (``kroquant_jax.qlinear.random_qlinear``: the real layer
  math with stand-in calibration), their served form, and one layer of a stack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import FusedLinearHooks, LinearHooks, SharedOverrides, check_fused_sites, linears

__all__ = ["FusedLinearHooks", "SharedOverrides", "build_stacked_qlinears", "check_fused_sites", "check_overrides",
           "fake_quant_overrides", "layer_at", "qlinear_overrides", "run_with_overrides", "serve_stacked",
           "served_hooks", "split_qlinear_overrides", "whole_layer_overrides"]


@jax.jit
def _qlinear_simulate(layer: Any, x: jax.Array) -> jax.Array:
    """The simulated W4A4 forward of one layer, compiled as a unit (a model's calls of one shape trace it once)."""
    from kroquant_jax.qlinear import qlinear_forward

    return qlinear_forward(layer, x, "simulate")  # (..., o)


def _default_forward(forward: Callable[[Any, jax.Array], jax.Array] | None, layer: Any) -> tuple[Callable, Any]:
    """``(forward, layer)``; no ``forward``: the simulated W4A4 forward on ``kroquant_jax.qlinear.forward_form(layer)``
    (the same output; recipes of equal shapes then share one compiled program that takes the overrides)."""
    if forward is not None:
        return forward, layer
    from kroquant_jax.qlinear import forward_form

    return _qlinear_simulate, forward_form(layer)


def qlinear_overrides(qlayers: Mapping[str, Any], forward: Callable[[Any, jax.Array], jax.Array] | None = None
                      ) -> dict[str, jax.tree_util.Partial]:
    """``{path: QuantizedLinear}`` -> ``{path: Partial(forward, layer)}``; forward(layer, x (..., d)) -> (..., o)
    (default: the simulated W4A4 forward, on the layer's ``forward_form``)."""
    return {name: jax.tree_util.Partial(*_default_forward(forward, layer)) for name, layer in qlayers.items()}


def split_qlinear_overrides(layer: Any, paths: list[str], forward: Callable[[Any, jax.Array], jax.Array] | None = None,
                            widths: list[int] | None = None, name: str | None = None) -> SharedOverrides:
    """One ``QuantizedLinear`` (or ``ServedLinear`` with a matching ``forward``) of ``len(paths)`` linears stacked
    along the outputs (``[W_1; W_2; ...]``, one shared input and transform) -> per-linear overrides
    ``{paths[i]: x -> forward(layer, x)[..., rows of W_i]}`` as a :class:`SharedOverrides` holding the layer once
    (under ``name``, default the paths joined by ``|``).

    ``widths``: each linear's output width, in ``paths`` order (e.g. FLUX.1's ``q | k | v | proj_mlp``); None: equal
    shares. Raises ValueError when they do not add up to the layer's outputs (or the outputs do not divide equally).
    XLA merges the members' identical calls, so the members cost one forward of the layer, also when the overrides
    are an argument of the jitted program."""
    forward, layer = _default_forward(forward, layer)
    out_features = layer.config.out_features if hasattr(layer, "config") else layer.out_features
    if widths is None:
        if out_features % len(paths):
            raise ValueError(f"split_qlinear_overrides: out_features={out_features} is not a multiple of {len(paths)} "
                             f"linears {paths} (pass their widths)")
        widths = [out_features // len(paths)] * len(paths)
    if len(widths) != len(paths) or sum(widths) != out_features or min(widths) < 1:
        raise ValueError(f"split_qlinear_overrides: widths {list(widths)} of {paths} do not split "
                         f"out_features={out_features}")
    from kroquant_jax.shared_inputs import fused_name

    return SharedOverrides.split(fused_name(paths) if name is None else name, layer, forward, paths, widths)


def whole_layer_overrides(layer: Any, path: str, forward: Callable[[Any, jax.Array], jax.Array] | None = None
                          ) -> SharedOverrides:
    """The override of one linear ``path`` by a whole layer (:func:`qlinear_overrides` of one layer) as a
    :class:`SharedOverrides`, to merge with fused layers' (:meth:`SharedOverrides.merged`)."""
    forward, layer = _default_forward(forward, layer)
    return SharedOverrides({path: layer}, {path: (path, forward, None)})


def _fake_quant_linear(kernel: jax.Array, bias: jax.Array | None, x: jax.Array, *, fmt: Any) -> jax.Array:
    from kroquant_jax.formats import fake_quant

    w = fake_quant(kernel.astype(jnp.float32).T, fmt)  # (o, d)
    xq = fake_quant(x.astype(jnp.float32), fmt)  # (..., d)
    y = jnp.einsum("...d,od->...o", xq, w)  # (..., o)
    return (y if bias is None else y + bias).astype(x.dtype)


def fake_quant_overrides(model: nnx.Module, fmt: Any = None, names: list[str] | None = None
                         ) -> dict[str, jax.tree_util.Partial]:
    """RTN W4A4 of the model's quantizable linears (or ``names``): ``fake_quant(x) fake_quant(W)^T + b`` with the
    ``kroquant_jax.formats`` format ``fmt`` (default MXFP4)."""
    from kroquant_jax import formats

    fmt = formats.MXFP4() if fmt is None else fmt
    forward = functools.partial(_fake_quant_linear, fmt=fmt)
    layers = linears(model, quantizable_only=True)
    names = list(layers) if names is None else names
    missing = [n for n in names if n not in layers]
    if missing:
        raise ValueError(f"fake_quant_overrides: not quantizable linears of the model: {missing}")
    return {n: jax.tree_util.Partial(forward, layers[n].kernel[...],
                                     None if layers[n].bias is None else layers[n].bias[...]) for n in names}


def check_overrides(model: nnx.Module, overrides: Mapping[str, Callable[[jax.Array], jax.Array]]) -> None:
    """Raise a ValueError naming every override whose path is not a linear of ``model`` or whose output shape is
    wrong (checked abstractly with ``jax.eval_shape``: nothing runs)."""
    layers = linears(model)
    problems = []
    for name, fn in overrides.items():
        if name not in layers:
            problems.append(f"{name}: no such Linear in the model")
            continue
        layer = layers[name]
        probe = jax.ShapeDtypeStruct((2, layer.in_features), layer.kernel[...].dtype)
        try:
            out = jax.eval_shape(fn, probe)
        except Exception as err:  # noqa: BLE001 - reported with the layer name
            problems.append(f"{name}: override fails on input (2, {layer.in_features}): {err}")
            continue
        if tuple(out.shape) != (2, layer.out_features):
            problems.append(f"{name}: override returns {tuple(out.shape)} for input (2, {layer.in_features}), "
                            f"expected (2, {layer.out_features})")
    if problems:
        raise ValueError("bad linear overrides:\n  " + "\n  ".join(problems))


def run_with_overrides(model: nnx.Module, overrides: Mapping[str, Callable], *args, **kwargs):
    """Call ``model(*args, **kwargs)`` with the overrides in place (eager convenience; samplers take
    ``params["overrides"]`` instead)."""
    return model(*args, hooks=LinearHooks(overrides), **kwargs)


def _served(layer: Any, x: jax.Array, *, options: Any) -> jax.Array:
    from pallas_kernels import served

    return served.forward(layer, x, options=options)


def _served_norm(layer: Any, x: jax.Array, scale: jax.Array, eps: float, *, options: Any) -> jax.Array:
    from pallas_kernels import served

    return served.forward(layer, x, op="rmsnorm", norm_weight=scale, head_dim=scale.shape[-1], eps=eps,
                          options=options)


def _served_swiglu(layer: Any, x: jax.Array, *, options: Any) -> jax.Array:
    from pallas_kernels import served

    return served.forward(layer, x, op="swiglu", options=options)


def served_hooks(linears: Mapping[str, Any] | None = None, projection_norm: Mapping[str, Any] | None = None,
                 swiglu: Mapping[str, Any] | None = None, *, shared_input: Mapping[str, Any] | None = None,
                 options: Any = None, stacked: bool = False) -> FusedLinearHooks:
    """Hooks running ``pallas_kernels.served.ServedLinear`` layers (packed W4A4 on the GPU).

    Args:
        linears: ``{linear path: ServedLinear}``: plain per-linear overrides (transform+quantize, W4A4 GEMM, low-rank).
        projection_norm: ``{projection path: ServedLinear}``: the projection + per-head RMSNorm (the model passes the
            norm weight and eps at the call).
        swiglu: ``{gate path: ServedLinear}``: the fused ``[W_gate; W_up]`` layer, prepared with
            ``served.serve(layer, swiglu=True)``.
        shared_input: ``{first member path: ServedLinear}``: linears that read the same input as one layer of their
            stacked weights (e.g. ``[W_q; W_k; W_v]`` under one transform), its output split among them by the model.
        options: one ``pallas_kernels.served.ServeOptions`` for every entry (``None``: the defaults, strategy
            ``"dequant"``); it validates itself, so a bad combination raises here, not at the first call.
        stacked: the layers carry a leading layer axis (scanned blocks).
    """
    from pallas_kernels import served

    options = served.ServeOptions() if options is None else options
    if not isinstance(options, served.ServeOptions):
        raise TypeError(f"served_hooks: options must be a pallas_kernels.served.ServeOptions, got {options!r}")
    partial = jax.tree_util.Partial

    def entries(fn, table):
        return {p: partial(functools.partial(fn, options=options), layer) for p, layer in (table or {}).items()}

    return FusedLinearHooks(entries(_served, linears), projection_norm=entries(_served_norm, projection_norm),
                            swiglu=entries(_served_swiglu, swiglu), shared_input=entries(_served, shared_input),
                            stacked=stacked)


# ---------------------------------------------------------------------------------------------------------------------
# Stacked (per-block) W4A4 layers for scanned models.
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="rank")
def build_stacked_qlinears(kernels: tuple[jax.Array, ...], key: jax.Array, rank: int) -> Any:
    """Stacked W4A4 layers (``kroquant_jax.qlinear.random_qlinear``: real layer math, stand-in calibration) from
    stacked Linear kernels ``(layers, d, o_i)``: ``W = [k_1^T; k_2^T; ...]`` ``(sum o_i, d)`` per layer (one kernel:
    the linear itself; ``(w1, w3)``: the fused gate/up layer). One layer at a time (``lax.map``), on the device."""
    from kroquant_jax.qlinear import random_qlinear

    keys = jax.random.split(key, kernels[0].shape[0])

    def one(args):
        ks, k = args
        w = jnp.concatenate([kk.T.astype(jnp.float32) for kk in ks], axis=0)  # (o, d)
        return random_qlinear(w, k, rank)

    return jax.lax.map(one, (kernels, keys))


@functools.partial(jax.jit, static_argnames=("swiglu", "strategy", "transform_kernel"))
def serve_stacked(layers: Any, swiglu: bool = False, strategy: str = "dequant",
                  transform_kernel: str | None = None) -> Any:
    """``pallas_kernels.served.serve`` of every layer of a stacked ``QuantizedLinear`` (leading layer axis) ->
    the stacked prepared layer of ``strategy`` (a ``ServedLinear``, or e.g. the FP8 strategy's ``Fp8Linear``);
    ``transform_kernel`` as ``serve``'s (None: the strategy's choice)."""
    from pallas_kernels import served

    return jax.vmap(lambda layer: served.serve(layer, swiglu=swiglu, strategy=strategy,
                                               transform_kernel=transform_kernel))(layers)


def layer_at(tree: Any, i: int) -> Any:
    """Layer ``i`` of a stacked pytree (every leaf indexed along its leading axis)."""
    return jax.tree_util.tree_map(lambda a: a[i], tree)
