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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import LinearHooks, linears

__all__ = ["check_overrides", "fake_quant_overrides", "qlinear_overrides", "run_with_overrides"]


def _qlinear_simulate(layer: Any, x: jax.Array) -> jax.Array:
    from kroquant_jax.qlinear import qlinear_forward

    return qlinear_forward(layer, x, "simulate")  # (..., o)


def qlinear_overrides(qlayers: Mapping[str, Any], forward: Callable[[Any, jax.Array], jax.Array] | None = None
                      ) -> dict[str, jax.tree_util.Partial]:
    """``{path: QuantizedLinear}`` -> ``{path: Partial(forward, layer)}``; forward(layer, x (..., d)) -> (..., o)."""
    forward = _qlinear_simulate if forward is None else forward
    return {name: jax.tree_util.Partial(forward, layer) for name, layer in qlayers.items()}


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
