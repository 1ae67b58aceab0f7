"""The per-layer calibration objective of KroQuant (paper §3.3, eq. 7-10; docs/calibration.md) as pure functions.

For a linear layer ``O = A W^T`` with activation rows ``A (m, d)``, weight ``W (o, d)`` and an invertible block
transform ``T`` (``A T``, ``W T^{-T}``), with ``Q`` the fake quantizer (MXFP4 by default, STE backward):

* ``L_out(T) = ||Q(A T) Q(W T^{-T})^T - A W^T||_F^2 / (m o)``   (eq. 7, mean over the output entries)
* ``L_A(T)   = ||Q(A T) - A T||_F^2 / (m d)``                    (eq. 8, mean over the activation entries)
* ``L_W(T)   = ||Q(W T^{-T}) - W T^{-T}||_F^2 / (o d)``          (eq. 8, mean over the weight entries)
* ``L(T) = L_out + λ_A L_A + λ_W L_W`` (eq. 9; the gradient of ``L_A``, ``L_W`` holds ``Q(x)`` constant by default,
  ``ObjectiveConfig.regularizer_grad``) with ``λ_A = L_out(T_0) / L_A(T_0)``, ``λ_W = L_out(T_0) / L_W(T_0)``
  (eq. 10), computed **once** at the starting transform ``T_0`` (the Hadamard initialisation for KroQuant) and held
  constant during the optimisation (no gradient flows through λ). A zero denominator gives ``λ = 0``.

Everything here is a pure function of arrays (no Python side effects), so it can be ``jit``-ed and ``vmap``-ed across
stacked layers by :mod:`kroquant_jax.calibrate`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from kroquant_jax import transforms
from kroquant_jax.formats import MXFP4, QuantFormat, fake_quant

__all__ = ["ObjectiveConfig", "LossTerms", "Lambdas", "loss_terms", "auto_lambdas", "total_loss",
           "relative_output_error", "quantized_output", "reference_output"]

Precision = Literal["highest", "high", "default"]


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static settings of the objective.

    Attributes:
      fmt: fake-quantization format of both operands (paper: MXFP4 E2M1, E8M0 scales, blocks of 32).
      ste: straight-through rule of both quantizers (``"identity"`` or ``"clipped"``).
      precision: matmul precision of ``A T``, ``W T^{-T}`` and the output products (``"highest"`` = true f32;
        ``"default"`` lets a GPU use TF32/bf16 passes, faster and less exact).
      regularizer_grad: how gradients flow through ``Q`` inside ``L_A`` and ``L_W``. ``"detached"`` (default):
        ``Q(x)`` is held constant in the regularizers, so their gradient ``-2 (Q(x) - x)`` pulls the transformed
        operands towards the quantization grid (the paper says the regularizers give gradient signal; chosen on the
        testbed's layers, ``docs/calibration.md``). ``"ste"`` (the paper as written): the same STE as everywhere;
        with the identity STE ``d/dx (Q(x) - x)^2 = 0``, so the regularizers then shape λ but give no gradient (the
        clipped STE leaves one on saturated elements).
    """

    fmt: QuantFormat = MXFP4()
    ste: Literal["identity", "clipped"] = "identity"
    precision: Precision = "highest"
    regularizer_grad: Literal["ste", "detached"] = "detached"


class LossTerms(NamedTuple):
    """The three unweighted terms (f32 scalars, or stacked ``(L,)`` under ``vmap``)."""

    out: jax.Array
    act: jax.Array
    wgt: jax.Array


class Lambdas(NamedTuple):
    """Auto-scaled regularisation weights ``λ_A``, ``λ_W`` (eq. 10)."""

    act: jax.Array
    wgt: jax.Array


def _mm(x, y_t, precision):
    """``x @ y_t.T`` in f32 with the configured precision."""
    return jnp.einsum("...k,ok->...o", x.astype(jnp.float32), y_t.astype(jnp.float32), precision=precision)


def reference_output(a: jax.Array, w: jax.Array, cfg: ObjectiveConfig = ObjectiveConfig()) -> jax.Array:
    """``A W^T`` in f32: ``a (m, d)``, ``w (o, d)`` -> ``(m, o)``."""
    return _mm(a, w, cfg.precision)


def transformed_operands(blocks: jax.Array, inverse_blocks: jax.Array, a: jax.Array, w: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """``(A T (m, d), W T^{-T} (o, d))`` from the blocks of ``T`` and ``T^{-1}`` (``(d/n, n, n)`` each)."""
    return transforms.apply_to_activations(a, blocks), transforms.apply_to_weights(w, inverse_blocks)


def quantized_output(a_t: jax.Array, w_t: jax.Array, cfg: ObjectiveConfig = ObjectiveConfig()) -> jax.Array:
    """``Q(A T) Q(W T^{-T})^T`` ``(m, o)`` with STE gradients into both operands."""
    qa = fake_quant(a_t, cfg.fmt, ste=cfg.ste)
    qw = fake_quant(w_t, cfg.fmt, ste=cfg.ste)
    return _mm(qa, qw, cfg.precision)


def loss_terms_transformed(a_t: jax.Array, w_t: jax.Array, ref: jax.Array,
                           cfg: ObjectiveConfig = ObjectiveConfig()) -> LossTerms:
    """The three terms from already transformed operands ``a_t (m, d)``, ``w_t (o, d)`` and ``ref = A W^T (m, o)``."""
    qa = fake_quant(a_t, cfg.fmt, ste=cfg.ste)
    qw = fake_quant(w_t, cfg.fmt, ste=cfg.ste)
    out = _mm(qa, qw, cfg.precision)
    l_out = jnp.mean(jnp.square(out - ref))
    if cfg.regularizer_grad == "detached":
        qa, qw = jax.lax.stop_gradient(qa), jax.lax.stop_gradient(qw)
    elif cfg.regularizer_grad != "ste":
        raise ValueError(f"ObjectiveConfig.regularizer_grad={cfg.regularizer_grad!r} must be 'ste' or 'detached'")
    l_act = jnp.mean(jnp.square(qa.astype(jnp.float32) - a_t.astype(jnp.float32)))
    l_wgt = jnp.mean(jnp.square(qw.astype(jnp.float32) - w_t.astype(jnp.float32)))
    return LossTerms(l_out, l_act, l_wgt)


def loss_terms(params, parameterization: transforms.Parameterization, a: jax.Array, w: jax.Array,
               ref: jax.Array | None = None, cfg: ObjectiveConfig = ObjectiveConfig()) -> LossTerms:
    """``(L_out, L_A, L_W)`` of a layer under the transform ``params`` of ``parameterization``.

    Args:
      params: the parameterization's parameters (a pytree).
      parameterization: e.g. ``transforms.get("kron_lu")``.
      a: activation rows ``(m, d)``.
      w: weight ``(o, d)``.
      ref: ``A W^T (m, o)`` if already computed (saves a matmul per step), else computed here.
      cfg: quantizer and precision.
    """
    if ref is None:
        ref = reference_output(a, w, cfg)
    a_t, w_t = transformed_operands(parameterization.blocks(params), parameterization.inverse_blocks(params), a, w)
    return loss_terms_transformed(a_t, w_t, ref, cfg)


def auto_lambdas(terms_at_init: LossTerms) -> Lambdas:
    """``λ_A = L_out(T_0) / L_A(T_0)``, ``λ_W = L_out(T_0) / L_W(T_0)`` (eq. 10); ``0`` where a denominator is ``0``.

    The result is wrapped in ``stop_gradient``: λ is a constant of the optimisation.
    """
    t = jax.tree.map(jax.lax.stop_gradient, terms_at_init)

    def ratio(num, den):
        safe = jnp.where(den > 0, den, 1.0)
        return jnp.where(den > 0, num / safe, 0.0)

    return Lambdas(ratio(t.out, t.act), ratio(t.out, t.wgt))


def combine(terms: LossTerms, lambdas: Lambdas) -> jax.Array:
    """``L = L_out + λ_A L_A + λ_W L_W`` (eq. 9)."""
    return terms.out + lambdas.act * terms.act + lambdas.wgt * terms.wgt


def total_loss(params, parameterization: transforms.Parameterization, a: jax.Array, w: jax.Array,
               lambdas: Lambdas, ref: jax.Array | None = None, cfg: ObjectiveConfig = ObjectiveConfig()
               ) -> jax.Array:
    """The full objective ``L(T)`` (eq. 9), differentiable in ``params`` through the STE."""
    return combine(loss_terms(params, parameterization, a, w, ref, cfg), lambdas)


def relative_output_error(params, parameterization: transforms.Parameterization, a: jax.Array, w: jax.Array,
                          cfg: ObjectiveConfig = ObjectiveConfig()) -> jax.Array:
    """``||Q(A T) Q(W T^{-T})^T - A W^T||_F / ||A W^T||_F`` (the reported metric; bias cancels)."""
    ref = reference_output(a, w, cfg)
    a_t, w_t = transformed_operands(parameterization.blocks(params), parameterization.inverse_blocks(params), a, w)
    out = quantized_output(a_t, w_t, cfg)
    return jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), jnp.finfo(jnp.float32).tiny)
