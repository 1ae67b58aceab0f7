"""Quantization-aware distillation (QAD) with classifier-free guidance folded into one branch (the second seed).

**Teacher**: the frozen 16-bit model, both CFG branches; its target is the guided velocity
``v_u + w(sigma) (v_c - v_u)`` with a :class:`GuidanceSchedule` ``w`` (stronger over the noisy and middle noise levels,
gentler near the clean end; a constant is one setting).

**Student**: the conditional branch only; every quantizable linear runs W4A4 fake quant (MXFP4 or NVFP4) in the
training form of eq. 11 of ``kroquant_jax.qlinear``::

    y = Q(x T) Q(W~)^T + (x T) (L R)^T + b        (Q: fake quant; W~: the residual master weight, trainable)

with the straight-through estimator (``ste="identity"`` plain, ``"clipped"`` zero where an element saturated) so the
gradient reaches ``W~`` and the layers before. What is trained, frozen or recomputed (:func:`student_from_qlinears`):

* ``W~`` (the residual, fp32 master copy), the bias, and every 16-bit parameter outside the quantized linears
  (embeddings, AdaLN, caption projection, ``proj_out``): **trained**;
* the low-rank branch ``L``, ``R``: **trained** (SVDQuant's 16-bit branch by the ordinary gradient, LoRaQ's MXFP4
  branch through its own fake quant and the STE);
* the online transform ``T`` (Hadamard / KroQuant blocks, SmoothQuant / SVDQuant diagonal): **frozen**. It was fitted
  to the captured activations, so it keeps flattening them; the weights after it are free to absorb any change, so
  training it adds little; and the served kernels take its blocks in the K1 form, which training would have to
  re-project onto;
* the block scales of ``Q(x T)`` and ``Q(W~)``: **recomputed** in every forward from the current values (absmax RTN,
  what ``kroquant_jax.formats.quantize`` does at export), never stored or trained.

**Naive distillation** (the seed's control): the same quantized student and loss, but "no gradient flowed through the
quantization - the student was frozen in its quantized state": ``naive=True`` gives the weight quantizers (and those
of a quantized low-rank branch) their true derivative, zero (a rounding function is flat almost everywhere), so the
quantized weights stay frozen at their rounded start. The activation quantizers keep the STE: they sit on the path
from the loss to every earlier layer, and a zero there would cut the chain rule at each linear's input, leaving the
16-bit parameters (biases, AdaLN, embeddings, ``proj_out``, the 16-bit low-rank branch) a partial gradient that is
not a descent direction of the loss (measured: the loss then rises, docs/qad.md). So the naive student trains exactly
the parameters QAD trains minus the quantized weights, with QAD's gradient for them.

**Loss**: ``mse(student, guided teacher) + fm_weight * mse(student, eps - x0)`` on the same noised real images
(the flow-matching loss of ``models.testbed``; the seed found distillation alone not enough).

**Inference**: the student alone, guidance 1, one forward per step (:func:`student_sample`); on the CPU through the
simulated (fake quant) path; :func:`export_qlinears` gives ``kroquant_jax.qlinear.QuantizedLinear`` layers (packed
codes) for ``models.quantize_model.qlinear_overrides`` or the GPU's served layers, and
:func:`export_student_checkpoint` writes the whole student (its trained 16-bit rest and those layers) as a
self-contained quantized checkpoint folder (``models.quantized_checkpoint``) that ``kroquant generate`` serves and
``kroquant dmd2 train --init-checkpoint`` starts from.

Training (:func:`train`): one jitted chunk of optimizer steps (optax AdamW, global-norm clipping), a tqdm bar, orbax
checkpoints of the whole state (parameters, optimizer, step, PRNG key), resumable with identical results, a
config-keyed run folder (a folder made with other settings is refused), and a non-finite loss or gradient stops
training with a :class:`NonFiniteError` naming the step, keeping the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kroquant_jax import formats, provenance, transforms
from kroquant_jax.fileio import (atomic_append_text, atomic_write_json, atomic_write_text, read_json_object,
                                 replace_folder)
from models.testbed import model as testbed
from models.layers import LinearHooks, linears

__all__ = ["BestIterate", "GuidanceSchedule", "QADConfig", "NonFiniteError", "student_from_model",
           "student_from_qlinears", "export_unquantized_student", "student_forward", "student_velocity",
           "teacher_target", "qad_loss",
           "noised_batch", "distillation_loss",
           "make_optimizer", "with_state_dtype", "cast_floating", "apply_gradients", "make_train_chunk", "init_state",
           "train", "guided_sample", "teacher_sampler", "student_sample", "export_qlinears", "check_export_dir",
           "export_student_checkpoint", "colour_correct", "record_noise",
           "save_checkpoint", "restore_checkpoint", "latest_checkpoint", "fingerprint",
           "check_run_folder"]

FORMATS = {"mxfp4": formats.MXFP4, "nvfp4": formats.NVFP4}
STE_MODES = ("identity", "clipped")


# --------------------------------------------------------------------------------------------------------------------
# Guidance schedule and configuration
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GuidanceSchedule:
    """``w(sigma)``: ``noisy`` for ``sigma >= sigma_noisy`` (noisy and middle levels), ``clean`` for
    ``sigma <= sigma_clean``, a smoothstep between. ``noisy == clean`` is a constant guidance.

    Noise level convention of ``models.testbed``: ``sigma = 1`` pure noise, ``sigma = 0`` the clean image.
    """

    noisy: float = 3.0
    clean: float = 3.0
    sigma_clean: float = 0.1
    sigma_noisy: float = 0.4

    def __post_init__(self):
        if not 0.0 <= self.sigma_clean < self.sigma_noisy <= 1.0:
            raise ValueError(f"GuidanceSchedule: need 0 <= sigma_clean < sigma_noisy <= 1, got "
                             f"{self.sigma_clean=}, {self.sigma_noisy=}")
        if self.noisy < 1.0 or self.clean < 1.0:
            raise ValueError(f"GuidanceSchedule: guidance below 1 ({self.noisy=}, {self.clean=}) extrapolates away "
                             "from the condition")

    @property
    def constant(self) -> bool:
        return self.noisy == self.clean

    def __call__(self, sigma: jax.Array) -> jax.Array:
        """``sigma (...)`` in [0, 1] -> guidance ``(...)`` float32."""
        sigma = jnp.asarray(sigma, jnp.float32)
        ramp = jnp.clip((sigma - self.sigma_clean) / (self.sigma_noisy - self.sigma_clean), 0.0, 1.0)
        smooth = ramp * ramp * (3.0 - 2.0 * ramp)
        return self.clean + (self.noisy - self.clean) * smooth

    def label(self) -> str:
        if self.constant:
            return f"CFG {self.noisy:g}"
        return f"CFG {self.noisy:g} (sigma >= {self.sigma_noisy:g}) -> {self.clean:g} (sigma <= {self.sigma_clean:g})"


@dataclasses.dataclass(frozen=True)
class QADConfig:
    """Settings of one QAD run (all but :data:`UNKEYED_CONFIG` enter the run folder's key).

    fmt: ``"mxfp4"`` or ``"nvfp4"`` (weights, activations and a quantized low-rank branch).
    ste: ``"identity"`` (plain STE) or ``"clipped"`` (zero gradient where saturated): the rule of the activation
        quantizers and, unless ``naive``, of the weight quantizers.
    naive: naive distillation: the weight quantizers (and a quantized low-rank branch's) get their true, zero
        derivative; the activations keep the ``ste`` rule, so the control differs from QAD in the weights alone.
    fm_weight: lambda of the flow-matching term. schedule: the teacher's guidance.
    lr, warmup, clip_norm, weight_decay: AdamW (linear warm-up over ``warmup`` steps, then constant; 0: constant
        from the first step). batch_size: images per step.
    steps: total optimizer steps. chunk: steps per jitted call (and the granularity of the NaN check).
    save_every: checkpoint every N steps (a multiple of ``chunk``). seed: data order, noise and sigmas.
    train_rest: also train the 16-bit parameters outside the quantized linears.
    """

    fmt: str = "mxfp4"
    ste: str = "identity"
    naive: bool = False
    fm_weight: float = 0.25
    schedule: GuidanceSchedule = GuidanceSchedule()
    lr: float = 5e-5
    warmup: int = 50
    clip_norm: float = 1.0
    weight_decay: float = 0.0
    batch_size: int = 64
    steps: int = 1000
    chunk: int = 10
    save_every: int = 100
    seed: int = 0
    train_rest: bool = True
    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"QADConfig.fmt={self.fmt!r} must be one of {sorted(FORMATS)}")
        if self.ste not in STE_MODES:
            raise ValueError(f"QADConfig.ste={self.ste!r} must be one of {STE_MODES}")
        if self.fm_weight < 0:
            raise ValueError(f"QADConfig.fm_weight={self.fm_weight} must be >= 0")
        if self.warmup < 0:
            raise ValueError(f"QADConfig.warmup={self.warmup} must be >= 0")
        for name in ("batch_size", "steps", "chunk", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"QADConfig.{name}={getattr(self, name)} must be >= 1")
        if self.save_every % self.chunk or self.steps % self.chunk:
            raise ValueError(f"QADConfig: steps={self.steps} and save_every={self.save_every} must be multiples of "
                             f"chunk={self.chunk}")

    @property
    def quant_format(self) -> formats.QuantFormat:
        return FORMATS[self.fmt]()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN/Inf loss or gradient; the run folder keeps the last good checkpoint."""


# --------------------------------------------------------------------------------------------------------------------
# The student: per-layer parameters and the W4A4 fake-quant forward with the STE
# --------------------------------------------------------------------------------------------------------------------


@jax.custom_vjp
def _grad_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x


def _grad_scale_fwd(x, scale):
    return x, scale


def _grad_scale_bwd(scale, g):
    return g * scale.astype(g.dtype), jnp.zeros_like(scale)


_grad_scale.defvjp(_grad_scale_fwd, _grad_scale_bwd)


def _quantize_ste(x: jax.Array, fmt: formats.QuantFormat, ste: str, through: jax.Array) -> jax.Array:
    """Fake quant of ``x (..., d)`` whose backward is the STE rule ``ste`` times ``through`` (1: STE, 0: naive)."""
    return formats.fake_quant(_grad_scale(x, through), fmt, ste=ste)


def student_linear(layer: Mapping[str, jax.Array], blocks: jax.Array, through: jax.Array, x: jax.Array, *,
                   fmt: formats.QuantFormat, ste: str, lowrank_quantized: bool) -> jax.Array:
    """Training form of eq. 11: ``Q(x T) Q(W~)^T + (x T)(L R)^T + b``.

    Args:
        layer: ``{"weight": W~ (o, d), "bias": (o,), "left": L (o, r), "right": R (r, d)}`` (``r`` may be 0).
        blocks: the frozen transform ``T`` as blocks ``(d / n, n, n)``.
        through: scalar, 1.0 lets the STE gradient through the weight quantizers, 0.0 blocks it (naive
            distillation: the quantized weights frozen); the activation quantizer always passes it.
        x: ``(..., d)``. fmt: the 4-bit format. ste: ``"identity"`` / ``"clipped"``.
        lowrank_quantized: the branch ``L``, ``R`` is fake-quantized too (LoRaQ) rather than 16-bit (SVDQuant).
    Returns:
        ``(..., o)`` in ``x.dtype``.
    """
    xt = transforms.apply_to_activations(x.astype(jnp.float32), blocks)  # (..., d)
    xq = formats.fake_quant(xt, fmt, ste=ste)  # (..., d): activations always pass the STE gradient (naive included)
    wq = _quantize_ste(layer["weight"].astype(jnp.float32), fmt, ste, through)  # (o, d)
    y = jnp.einsum("...d,od->...o", xq, wq)  # (..., o)
    left, right = layer["left"].astype(jnp.float32), layer["right"].astype(jnp.float32)  # (o, r), (r, d)
    if left.shape[1]:
        if lowrank_quantized:
            left, right = _quantize_ste(left, fmt, ste, through), _quantize_ste(right, fmt, ste, through)
        y = y + jnp.einsum("...r,or->...o", jnp.einsum("...d,rd->...r", xt, right), left)  # (..., o)
    return (y + layer["bias"]).astype(x.dtype)


def _zero_bias(o: int) -> np.ndarray:
    return np.zeros((o,), np.float32)


def student_from_model(model: nnx.Module, rank: int = 0, block: int = 1) -> tuple[dict, dict]:
    """The seed's initialisation: the 16-bit weights, no transform (identity blocks of ``block``), an all-zero branch
    of ``rank`` (it stays zero: both factors' gradients vanish at zero; a nonzero rank only gives this student the
    array shapes of a PTQ-initialised one, so both share one compiled step).

    Returns:
        ``(layers, blocks)``: ``{name: {"weight" (o, d), "bias" (o,), "left" (o, r), "right" (r, d)}}`` (trainable)
        and ``{name: (d / block, block, block)}`` (frozen), over the model's quantizable linears.
    """
    layers, blocks = {}, {}
    for name, linear in linears(model, quantizable_only=True).items():
        w = np.asarray(linear.kernel[...], np.float32).T  # (o, d)
        o, d = w.shape
        if d % block:
            raise ValueError(f"student_from_model: {name} has {d} inputs, not a multiple of block={block}")
        bias = _zero_bias(o) if linear.bias is None else np.asarray(linear.bias[...], np.float32)
        layers[name] = {"weight": w, "bias": bias, "left": np.zeros((o, rank), np.float32),
                        "right": np.zeros((rank, d), np.float32)}
        blocks[name] = np.broadcast_to(np.eye(block, dtype=np.float32), (d // block, block, block)).copy()
    return layers, blocks


def student_from_qlinears(model: nnx.Module, qlayers: Mapping[str, Any],
                          fmt: formats.QuantFormat | None = None) -> tuple[dict, dict, bool]:
    """Initialisation from a calibrated PTQ model (``{name: kroquant_jax.qlinear.QuantizedLinear}``, any recipe).

    The residual master weight is the stored residual, dequantized: the codes the recipe chose (GPTQ's
    error-compensating rounding included; re-rounding ``W T^{-T} - L R`` to nearest would drop it, and on the
    testbed's GPTQ store a quarter of the codes differ), so the student starts as the PTQ model itself. ``T``'s blocks
    are copied (frozen), the branch (dequantized when packed) and the bias are copied (trained).

    Args:
        model: the 16-bit model whose quantizable linears the layers replace.
        qlayers: ``{name: QuantizedLinear}``, one per quantizable linear.
        fmt: the student's W4A4 format (:attr:`QADConfig.quant_format`); ``None``: each layer's own.

    Raises:
        ValueError: naming the layer: its weights or activations are stored in another format than ``fmt``, or its
          residual is not a fixed point of ``fmt``'s fake quant (the student's forward would not reproduce the stored
          codes); or the PTQ layers do not match the model.

    Returns:
        ``(layers, blocks, lowrank_quantized)`` as :func:`student_from_model`, plus whether the branch is packed.
    """
    model_linears = linears(model, quantizable_only=True)
    missing = sorted(set(model_linears) - set(qlayers))
    extra = sorted(set(qlayers) - set(model_linears))
    if missing or extra:
        raise ValueError(f"student_from_qlinears: the PTQ layers do not cover the model's quantizable linears: "
                         f"missing {missing[:5]}, not in the model {extra[:5]}")
    kinds = {q.lowrank_quantized for q in qlayers.values() if q.lowrank_left is not None}
    if len(kinds) > 1:
        raise ValueError("student_from_qlinears: mixed packed and 16-bit low-rank branches")
    rank_set = {0 if q.lowrank_left is None else int(q.lowrank_left.shape[1]) if not q.lowrank_quantized
                else int(q.config.rank) for q in qlayers.values()}
    if len(rank_set) > 1:
        raise ValueError(f"student_from_qlinears: layers have different ranks {sorted(rank_set)}")
    layers, blocks = {}, {}
    for name, linear in model_linears.items():
        q = qlayers[name]
        d, o = linear.kernel.shape  # kernel (d, o)
        if (q.config.out_features, q.config.in_features) != (o, d):
            raise ValueError(f"student_from_qlinears: {name} is ({o}, {d}) in the model, "
                             f"({q.config.out_features}, {q.config.in_features}) in the PTQ layers")
        student_fmt = q.weight.fmt if fmt is None else fmt
        if q.weight.fmt != student_fmt or q.config.act_fmt != student_fmt:
            raise ValueError(f"student_from_qlinears: {name}: stored with {q.weight.fmt} weights and "
                             f"{q.config.act_fmt} activations, the student quantizes with {student_fmt}")
        residual = formats.dequantize(q.weight, jnp.float32)  # (o, d) the stored Q(W T^{-T} - L R)
        requantized = formats.fake_quant(residual, student_fmt)
        if not bool(jnp.array_equal(requantized, residual)):
            count = int(jnp.sum(requantized != residual))
            raise ValueError(f"student_from_qlinears: {name}: {count} of {o * d} stored {student_fmt.name} weight "
                             "values change when fake-quantized again, so the student would not start at the PTQ "
                             "model")
        if q.lowrank_left is None:
            left, right = jnp.zeros((o, 0)), jnp.zeros((0, d))
        else:
            # (o, r), (r, d), dequantized if packed
            left, right = formats.as_float32(q.lowrank_left), formats.as_float32(q.lowrank_right)
        bias = _zero_bias(o) if q.bias is None else np.asarray(q.bias, np.float32)
        layers[name] = {"weight": np.asarray(residual), "bias": bias, "left": np.asarray(left, np.float32),
                        "right": np.asarray(right, np.float32)}
        blocks[name] = np.asarray(q.blocks, np.float32)
    return layers, blocks, bool(kinds and kinds.pop())


def student_forward(config: QADConfig, lowrank_quantized: bool) -> tuple[Callable, jax.Array]:
    """``(forward, through)``: ``forward(layer, blocks, through, x)`` is :func:`student_linear` with the config's
    format and STE rule; ``through`` is the float32 scalar that lets the STE gradient through the weight quantizers
    (1.0) or gives them their true, zero derivative (0.0, ``config.naive``: naive distillation)."""
    forward = functools.partial(student_linear, fmt=config.quant_format, ste=config.ste,
                                lowrank_quantized=lowrank_quantized)
    return forward, jnp.float32(0.0 if config.naive else 1.0)


def student_velocity(graphdef: Any, trainable: Mapping[str, Any], blocks: Mapping[str, jax.Array],
                     config: QADConfig, lowrank_quantized: bool, x: jax.Array, timestep: jax.Array,
                     context: jax.Array, mask: jax.Array) -> jax.Array:
    """The student's velocity ``(b, c, s, s)`` (conditional branch; its quantized linears through the STE).

    ``trainable = {"model": nnx state (the 16-bit parameters), "layers": {name: layer dict}}``. The transformer
    blocks run as one ``lax.scan`` (``scan_blocks=True``): XLA compiles one block's fake quantizers and STEs, not
    one copy per block."""
    model = nnx.merge(graphdef, trainable["model"])
    forward, through = student_forward(config, lowrank_quantized)
    overrides = {name: jax.tree_util.Partial(forward, layer, blocks[name], through)
                 for name, layer in trainable["layers"].items()}
    return model(x, context, timestep, encoder_attention_mask=mask, hooks=LinearHooks(overrides), scan_blocks=True)


def teacher_target(teacher_velocity: testbed.VelocityFn, x: jax.Array, sigma: jax.Array, context: jax.Array,
                   mask: jax.Array, null_context: jax.Array, null_mask: jax.Array,
                   schedule: GuidanceSchedule) -> jax.Array:
    """The guided velocity ``v_u + w(sigma) (v_c - v_u)`` ``(b, c, s, s)`` of the frozen teacher (both branches in
    one batch; no gradient). ``sigma (b,)``; context ``(b, t, e)``, mask ``(b, t)``; null_context ``(t, e)``."""
    b = x.shape[0]
    both_context = jnp.concatenate([context, jnp.broadcast_to(null_context.astype(context.dtype), context.shape)], 0)
    both_mask = jnp.concatenate([mask, jnp.broadcast_to(null_mask.astype(mask.dtype), mask.shape)], 0)
    timestep = jnp.concatenate([sigma, sigma]) * testbed.TIMESTEP_SCALE  # (2b,)
    v = teacher_velocity(jnp.concatenate([x, x], 0), timestep, both_context, both_mask).astype(jnp.float32)
    conditional, unconditional = v[:b], v[b:]
    w = schedule(sigma)[:, None, None, None]  # (b, 1, 1, 1)
    return jax.lax.stop_gradient(unconditional + w * (conditional - unconditional))


def qad_loss(trainable: Mapping[str, Any], blocks: Mapping[str, jax.Array], student_graphdef: Any,
             teacher_velocity: testbed.VelocityFn, config: QADConfig, lowrank_quantized: bool, pixels: jax.Array,
             context: jax.Array, mask: jax.Array, null_context: jax.Array, null_mask: jax.Array,
             key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``distill + fm_weight * flow_matching`` on one batch of real images ``pixels (b, c, s, s)`` in [-1, 1].

    Both terms use the same noised input ``x_sigma = (1 - sigma) x0 + sigma eps`` (sigma logit-normal as in
    training); distill = MSE to :func:`teacher_target`, flow matching = MSE to ``eps - x0``.
    Returns ``(loss, {"distill", "flow_matching"})``."""
    sigma, noise, noisy = noised_batch(key, pixels, config)  # (b,), (b, c, s, s) x 2
    target = teacher_target(teacher_velocity, noisy, sigma, context, mask, null_context, null_mask, config.schedule)
    predicted = student_velocity(student_graphdef, trainable, blocks, config, lowrank_quantized, noisy,
                                 sigma * testbed.TIMESTEP_SCALE, context, mask).astype(jnp.float32)
    return distillation_loss(predicted, target, noise - pixels, config.fm_weight)


def noised_batch(key: jax.Array, clean: jax.Array, config: QADConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The noised inputs of both loss terms: ``sigma (b,)`` logit-normal (``config``'s mean and std, as in the
    testbed's training), ``noise`` standard normal like ``clean (b, ...)``, and ``x_sigma = (1 - sigma) x0 + sigma
    eps`` (float32; ``sigma = 1`` is pure noise)."""
    key_sigma, key_noise = jax.random.split(key)
    flow = testbed.FlowMatchingConfig(logit_normal_mean=config.logit_normal_mean,
                                      logit_normal_std=config.logit_normal_std, caption_dropout=0.0)
    sigma = testbed.sample_sigmas(key_sigma, clean.shape[0], flow)  # (b,)
    noise = jax.random.normal(key_noise, clean.shape, jnp.float32)  # (b, ...)
    s = sigma.reshape((-1,) + (1,) * (clean.ndim - 1))  # (b, 1, ...)
    return sigma, noise, (1.0 - s) * clean + s * noise


def distillation_loss(predicted: jax.Array, target: jax.Array, flow_target: jax.Array,
                      fm_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``mse(predicted, guided teacher target) + fm_weight * mse(predicted, flow-matching target)`` (float32 arrays of
    one shape). Returns ``(loss, {"distill", "flow_matching"})``."""
    distill = jnp.mean(jnp.square(predicted - target))
    flow_matching = jnp.mean(jnp.square(predicted - flow_target))
    return distill + fm_weight * flow_matching, {"distill": distill, "flow_matching": flow_matching}


# --------------------------------------------------------------------------------------------------------------------
# Training state, the jitted chunk, checkpoints
# --------------------------------------------------------------------------------------------------------------------


def cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating arrays cast to ``dtype`` (integer and key arrays as they are)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def with_state_dtype(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """``inner`` whose floating state (the AdamW moments) is stored in ``dtype`` and computed in float32: the update
    casts the state up, runs ``inner``, and stores the new state in ``dtype`` (bf16 moments halve their memory)."""

    def init(params):
        return cast_floating(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast_floating(state, jnp.float32), params)
        return updates, cast_floating(state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(config: QADConfig, state_dtype: Any = None) -> optax.GradientTransformation:
    """AdamW with a linear warm-up and global-norm clipping; ``state_dtype`` (None: the parameters' dtype, float32
    moments for float32 parameters) stores the moments in another dtype (:func:`with_state_dtype`)."""
    schedule = (optax.constant_schedule(config.lr) if config.warmup == 0
                else optax.linear_schedule(0.0, config.lr, config.warmup))
    optimizer = optax.chain(optax.clip_by_global_norm(config.clip_norm),
                            optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=config.weight_decay))
    return optimizer if state_dtype is None else with_state_dtype(optimizer, state_dtype)


def init_state(student_state: Any, layers: Mapping[str, Any], config: QADConfig, state_dtype: Any = None) -> dict:
    """The training state pytree: ``{"trainable", "opt_state", "step", "key"}`` (key as raw uint32 key data);
    ``state_dtype``: the optimizer moments' dtype (:func:`make_optimizer`)."""
    trainable = {"model": student_state, "layers": jax.tree.map(jnp.asarray, dict(layers))}
    return {"trainable": trainable, "opt_state": make_optimizer(config, state_dtype).init(trainable),
            "step": jnp.asarray(0, jnp.int32), "key": jax.random.key_data(jax.random.key(config.seed))}


def apply_gradients(state: dict, grads: Any, key: jax.Array, optimizer: optax.GradientTransformation,
                    config: QADConfig) -> tuple[dict, jax.Array]:
    """One optimizer step of :func:`init_state`'s ``state`` with ``grads`` (of ``state["trainable"]``); the
    model's 16-bit parameters get zero gradients when ``config.train_rest`` is False; ``key`` becomes the state's
    next PRNG key. Returns ``(new state, global gradient norm)``."""
    if not config.train_rest:
        grads = {**grads, "model": jax.tree.map(jnp.zeros_like, grads["model"])}
    grad_norm = optax.tree_utils.tree_norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["trainable"])
    trainable = optax.apply_updates(state["trainable"], updates)
    return {"trainable": trainable, "opt_state": opt_state, "step": state["step"] + 1,
            "key": jax.random.key_data(key)}, grad_norm


def make_train_chunk(student_graphdef: Any, teacher_graphdef: Any, teacher_state: Any, blocks: Mapping[str, Any],
                     config: QADConfig, lowrank_quantized: bool, data: Mapping[str, jax.Array]) -> Callable:
    """A jitted ``state -> (state, metrics)`` running ``config.chunk`` optimizer steps.

    ``data``: ``images (n, s, s, 3) uint8``, ``context (n, t, e)``, ``context_mask (n, t)``, ``null_context (t, e)``,
    ``null_mask (t,)`` (the training captions). ``metrics``: per step ``loss``, ``distill``, ``flow_matching``,
    ``grad_norm`` (each ``(chunk,)``). With ``config.train_rest=False`` the model's 16-bit parameters get no update.
    The data, teacher and transform arrays are arguments of one module-level jitted function (not constants folded
    into it), so students of the same config and shapes (e.g. 16-bit- and PTQ-initialised) share one compilation.
    """
    fixed = {"data": {k: jnp.asarray(v) for k, v in data.items()}, "teacher": teacher_state,
             "blocks": {k: jnp.asarray(v) for k, v in blocks.items()}}
    return functools.partial(_run_chunk, fixed, student_graphdef=student_graphdef,
                             teacher_graphdef=teacher_graphdef, config=config, lowrank_quantized=lowrank_quantized)


@functools.partial(jax.jit, static_argnames=("student_graphdef", "teacher_graphdef", "config", "lowrank_quantized"))
def _run_chunk(fixed: dict, state: dict, *, student_graphdef: Any, teacher_graphdef: Any, config: QADConfig,
               lowrank_quantized: bool) -> tuple[dict, dict]:
    optimizer = make_optimizer(config)
    data, blocks = fixed["data"], fixed["blocks"]
    num_examples = int(data["images"].shape[0])
    null_context = data["null_context"].astype(jnp.float32)
    null_mask = data["null_mask"].astype(jnp.float32)

    def teacher_velocity(x, timestep, context, mask):
        return nnx.merge(teacher_graphdef, fixed["teacher"])(x, context, timestep, encoder_attention_mask=mask)

    def one_step(state, _):
        key = jax.random.wrap_key_data(state["key"])
        key, key_batch, key_loss = jax.random.split(key, 3)
        index = jax.random.randint(key_batch, (config.batch_size,), 0, num_examples)  # (b,)
        pixels = testbed.images_to_pixels(data["images"][index])  # (b, 3, s, s)
        context = data["context"][index].astype(jnp.float32)  # (b, t, e)
        mask = data["context_mask"][index].astype(jnp.float32)  # (b, t)
        (loss, parts), grads = jax.value_and_grad(qad_loss, has_aux=True)(
            state["trainable"], blocks, student_graphdef, teacher_velocity, config, lowrank_quantized, pixels,
            context, mask, null_context, null_mask, key_loss)
        new, grad_norm = apply_gradients(state, grads, key, optimizer, config)
        return new, {"loss": loss, "grad_norm": grad_norm, **parts}

    return jax.lax.scan(one_step, state, None, length=config.chunk)


def _leaves(state: Any) -> tuple[list[tuple[str, Any]], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves], treedef


def save_checkpoint(folder: Path, state: Any) -> Path:
    """Save ``state`` with orbax to ``folder/step_<step>``, then delete older step folders. Leaves are stored as
    ``leaf_<i>`` in tree order; the tree paths go to ``paths.json``. The checkpoint is written complete into a hidden
    sibling and renamed into place (``fileio.replace_folder``), so a stop at any moment leaves a complete checkpoint,
    also when the same step is saved again (a resumed run that stops where it started)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    named, _ = _leaves(state)
    target = folder / f"step_{step:08d}"
    staging = folder / f".{target.name}.saving-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    # zero-size leaves (a rank-0 branch and its optimizer moments) cannot be stored by orbax: restored from shape
    flat = {f"leaf_{i:05d}": np.asarray(leaf) for i, (_, leaf) in enumerate(named) if np.size(leaf)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(staging.resolve(), flat)
    checkpointer.wait_until_finished()
    atomic_write_text(staging / "paths.json", json.dumps([name for name, _ in named]))
    replace_folder(staging, target)
    for old in [*folder.glob("step_*"), *folder.glob(".step_*.saving-*")]:  # older steps, a killed save's staging
        if old != target and old.is_dir():
            shutil.rmtree(old)
    return target


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete ``step_*`` folder (one with its ``paths.json``), or None."""
    done = sorted(p for p in Path(folder).glob("step_*") if (p / "paths.json").exists())
    return done[-1] if done else None


def restore_checkpoint(path: Path, template: Any) -> Any:
    """Read :func:`save_checkpoint`'s folder into the structure of ``template`` (paths, shapes and dtypes checked)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    named, treedef = _leaves(template)
    stored_paths = json.loads((Path(path) / "paths.json").read_text())
    if stored_paths != [name for name, _ in named]:
        diff = sorted(set(stored_paths) ^ {name for name, _ in named})[:5]
        raise ValueError(f"{path}: the checkpoint's state does not match this run's (differing paths {diff})")
    abstract = {f"leaf_{i:05d}": jax.ShapeDtypeStruct(np.shape(leaf), jnp.asarray(leaf).dtype)
                for i, (_, leaf) in enumerate(named) if np.size(leaf)}
    flat = ocp.StandardCheckpointer().restore(Path(path).resolve(), abstract)
    leaves = [jnp.asarray(flat[f"leaf_{i:05d}"]) if np.size(leaf) else jnp.zeros_like(leaf)
              for i, (_, leaf) in enumerate(named)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


class BestIterate:
    """The trainable parameters of a run's best-scoring iterate, kept in ``run_dir/best`` (one checkpoint and its
    ``best.json``: step, score, selection), so a resumed run selects among all of its iterates, not only those of the
    last call.

    ``selection`` says what the score measures (e.g. the validation captions, seed and sampler); a folder whose
    iterate was selected by another measure is refused. Higher scores are better; ties keep the earlier iterate.
    """

    def __init__(self, run_dir: str | Path, selection: str):
        self.folder = Path(run_dir) / "best"
        self.selection = selection
        self.step: int | None = None
        self.score = -np.inf
        self._trainable = None
        meta = self.folder / "best.json"
        if meta.exists():
            stored = read_json_object(meta)
            if stored.get("selection") != selection:
                raise ValueError(f"{self.folder}: its best iterate was selected by {stored.get('selection')!r}, this "
                                 f"run selects by {selection!r}; use another --out or delete that folder")
            try:
                self.step, self.score = int(stored["step"]), float(stored["score"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{meta}: no step and score of a best iterate; delete {self.folder} to select "
                                 "again") from None

    def offer(self, step: int, trainable: Any, score: float) -> bool:
        """Keep ``trainable`` (saved) if ``score`` is finite and beats the best so far; True when it was kept."""
        if not np.isfinite(score) or score <= self.score:
            return False
        save_checkpoint(self.folder, {"step": jnp.asarray(step, jnp.int32), "trainable": trainable})
        atomic_write_text(self.folder / "best.json",
                          json.dumps({"step": int(step), "score": float(score), "selection": self.selection}))
        self.step, self.score, self._trainable = int(step), float(score), trainable
        return True

    def trainable(self, template: Any) -> Any:
        """The best iterate's trainable parameters, in the structure of ``template``."""
        if self._trainable is not None:
            return self._trainable
        if self.step is None:
            raise ValueError(f"{self.folder}: no iterate was scored (nothing to select)")
        path = self.folder / f"step_{self.step:08d}"
        if not (path / "paths.json").exists():
            raise ValueError(f"{path}: the best iterate's checkpoint is missing (an interrupted save); delete "
                             f"{self.folder} to select again")
        restored = restore_checkpoint(path, {"step": jnp.asarray(0, jnp.int32), "trainable": template})
        self._trainable = restored["trainable"]
        return self._trainable


#: Raised whenever a change of the training numerics makes an earlier run folder's checkpoints mean something else
#: (2: the naive control keeps the activation STE), so such a folder is refused instead of resumed.
TRAINING_NUMERICS_VERSION = 2


#: The config fields that only schedule the work: a step's result does not depend on them (the PRNG key is carried
#: step by step in the state, the learning rate is warm-up then constant), so a rerun may train further or save and
#: compile in other chunks in the same run folder.
UNKEYED_CONFIG = ("steps", "chunk", "save_every")


def run_key(config: QADConfig, extra: Mapping[str, Any]) -> dict:
    """The settings a run folder is keyed by: the config less :data:`UNKEYED_CONFIG`, ``extra`` (initialisation,
    data, model fingerprints) and :data:`TRAINING_NUMERICS_VERSION`."""
    keyed = {k: v for k, v in config.to_json().items() if k not in UNKEYED_CONFIG}
    return {"config": keyed, "numerics_version": TRAINING_NUMERICS_VERSION, **{k: extra[k] for k in sorted(extra)}}


def _upgrade_run_record(path: Path) -> None:
    """A record written while :data:`UNKEYED_CONFIG` and the teacher folder's name (``checkpoint``, which the
    teacher's fingerprint covers) were keyed is rewritten without them, and one from before ``naive`` had a field of
    its own (``ste="none"`` then: naive, the identity STE on the activations) with it: the same run's key in today's
    form, so the check resumes it or names only the settings that decide results."""
    try:
        stored = read_json_object(path)
    except (FileNotFoundError, ValueError):
        return  # absent, or unreadable: the check refuses it
    current = {k: v for k, v in stored.items() if k != "checkpoint"}
    if isinstance(current.get("config"), dict):
        current["config"] = {k: v for k, v in current["config"].items() if k not in UNKEYED_CONFIG}
        if "naive" not in current["config"] and "ste" in current["config"]:  # before ``naive`` had its own field,
            naive = current["config"]["ste"] == "none"  # ste="none" meant: naive, with the identity STE elsewhere
            current["config"] = {**current["config"], "ste": "identity" if naive else current["config"]["ste"],
                                 "naive": naive}
    if current != stored:
        atomic_write_json(path, current)


def fingerprint(tree: Any) -> str:
    """SHA-1 of a pytree's leaves (shapes, dtypes and bytes), to key a run by its initial weights or data."""
    return provenance.named_arrays_digest(_leaves(tree)[0], algorithm="sha1")


def _check_run_key(run_dir: Path, key: dict) -> None:
    """``provenance.check_run_folder`` on ``run_dir/qad_run.json``: a folder with results (checkpoints, a best
    iterate, a log) of other settings is refused naming each setting's old -> new value."""
    has_results = any((run_dir / name).exists() for name in ("checkpoints", "best", "log.jsonl"))
    _upgrade_run_record(run_dir / "qad_run.json")
    provenance.check_run_folder(run_dir, "qad_run.json", key, has_results, flag="--out")


def check_run_folder(run_dir: str | Path, config: QADConfig, key_extra: Mapping[str, Any]) -> None:
    """What :func:`train` checks first, for a caller that writes into ``run_dir`` before training (e.g. a
    :class:`BestIterate` offered the initial iterate): a folder keyed by other settings raises ValueError naming each
    setting's old -> new value; a fresh folder gets the key."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_run_key(run_dir, run_key(config, key_extra))


def _drop_log_records_after(path: Path, step: int) -> None:
    """Rewrites the log ``path`` (JSON lines with a ``step``) without the records past ``step``, the checkpoint a
    run resumes from: chunks logged after the last save and lost by a kill are run again, and would be logged twice."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


def train(run_dir: str | Path, train_chunk: Callable, state: dict, config: QADConfig, key_extra: Mapping[str, Any],
          *, progress: bool = True, stop_after: int | None = None, time_budget: float | None = None,
          on_chunk: Callable[[int, dict, dict], None] | None = None) -> tuple[dict, list[dict]]:
    """Run (or resume) training in ``run_dir`` until ``config.steps``.

    Args:
        run_dir: the run folder (``qad_run.json`` key, ``checkpoints/``, ``log.jsonl``); a folder keyed by other
            settings is refused.
        train_chunk: from :func:`make_train_chunk`. state: from :func:`init_state` (replaced by the latest checkpoint
            when there is one).
        key_extra: what else keys the run (e.g. init and data fingerprints).
        stop_after: stop (as if killed) once this many total steps are done and saved, e.g. to test resumption.
        time_budget: stop (saved, resumable) after the first chunk that ends past this many seconds of this call.
        on_chunk: ``fn(step, state, record)`` after each good chunk (e.g. a held-out image metric into ``record``).
    Returns:
        ``(state, log records of this call)``.
    Raises:
        NonFiniteError: a non-finite loss or gradient norm; the checkpoint of the last good save stays.
    """
    import time  # noqa: PLC0415

    from tqdm import tqdm  # noqa: PLC0415

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_run_key(run_dir, run_key(config, key_extra))
    checkpoints = run_dir / "checkpoints"
    last = latest_checkpoint(checkpoints)
    if last is not None:
        state = restore_checkpoint(last, state)
    step = int(state["step"])
    _drop_log_records_after(run_dir / "log.jsonl", step)  # steps a kill lost are trained (and logged) again
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    records = []
    began = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True, desc="qad")
    try:
        while step < end:
            new_state, metrics = train_chunk(state)
            metrics = {k: np.asarray(v) for k, v in metrics.items()}
            bad = ~(np.isfinite(metrics["loss"]) & np.isfinite(metrics["grad_norm"]))
            if bad.any():
                first = step + int(np.argmax(bad)) + 1
                kept = latest_checkpoint(checkpoints)
                raise NonFiniteError(
                    f"QAD step {first}: loss {float(metrics['loss'][np.argmax(bad)])}, gradient norm "
                    f"{float(metrics['grad_norm'][np.argmax(bad)])} is not finite; training stopped; the last good "
                    f"checkpoint is {kept if kept is not None else '(none saved yet)'}")
            state, step = new_state, int(new_state["step"])
            record = {"step": step, **{k: float(v.mean()) for k, v in metrics.items()}}
            if on_chunk is not None:
                on_chunk(step, state, record)
            records.append(record)
            atomic_append_text(run_dir / "log.jsonl", json.dumps(record) + "\n")
            bar.update(config.chunk)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            out_of_time = time_budget is not None and time.perf_counter() - began > time_budget
            if step % config.save_every == 0 or step == end or out_of_time:
                save_checkpoint(checkpoints, state)
            if out_of_time:
                break
    finally:
        bar.close()
    return state, records


# --------------------------------------------------------------------------------------------------------------------
# Sampling, export, colour-correction control
# --------------------------------------------------------------------------------------------------------------------


def guided_sample(velocity_fn: testbed.VelocityFn, noise: jax.Array, context: jax.Array, mask: jax.Array,
                  null_context: jax.Array, null_mask: jax.Array, num_steps: int,
                  schedule: GuidanceSchedule) -> jax.Array:
    """Flow-matching Euler with CFG ``w(sigma)`` (two branches per step, one batch): ``models.testbed.euler_sample``
    with a scheduled guidance; equal to it for a constant schedule. noise ``(b, c, s, s)`` -> pixels, not clipped."""
    b = noise.shape[0]
    sigmas = jnp.linspace(1.0, 0.0, num_steps + 1, dtype=jnp.float32)
    both_context = jnp.concatenate([context, jnp.broadcast_to(null_context, context.shape)], 0)
    both_mask = jnp.concatenate([mask, jnp.broadcast_to(null_mask, mask.shape).astype(mask.dtype)], 0)

    def step(x, index):
        sigma, sigma_next = sigmas[index], sigmas[index + 1]
        timestep = jnp.full((2 * b,), sigma * testbed.TIMESTEP_SCALE)
        v = velocity_fn(jnp.concatenate([x, x], 0), timestep, both_context, both_mask).astype(jnp.float32)
        conditional, unconditional = v[:b], v[b:]
        velocity = unconditional + schedule(sigma) * (conditional - unconditional)
        return x + (sigma_next - sigma) * velocity, None

    pixels, _ = jax.lax.scan(step, noise.astype(jnp.float32), jnp.arange(num_steps))
    return pixels


def teacher_sampler(graphdef: Any, null_context: jax.Array, null_mask: jax.Array, num_steps: int,
                    schedule: GuidanceSchedule) -> Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]:
    """The 16-bit teacher's :func:`guided_sample`, jitted: ``(state, noise, context, mask) -> pixels``, ``state`` the
    teacher's nnx state. The weights are an argument: closed over, XLA would fold them into the program as constants
    (and compile it slowly)."""

    @jax.jit
    def teacher_sample(state, noise, context, mask):
        velocity_fn = testbed.pixart_velocity_fn(nnx.merge(graphdef, state))
        return guided_sample(velocity_fn, noise, context, mask, null_context, null_mask, num_steps, schedule)

    return teacher_sample


def student_sample(velocity_fn: testbed.VelocityFn, noise: jax.Array, context: jax.Array, mask: jax.Array,
                   num_steps: int) -> jax.Array:
    """The distilled student alone: Euler at guidance 1, one forward per step (no unconditional branch)."""
    empty = jnp.zeros(context.shape[1:], context.dtype)
    return testbed.euler_sample(velocity_fn, noise, context, mask, empty, jnp.zeros(mask.shape[1:], mask.dtype),
                                num_steps, 1.0)


def record_noise(seed: int, indices: np.ndarray, shape: tuple[int, ...]) -> jax.Array:
    """Start noise ``(n, *shape)``: record ``indices[k]`` gets ``normal(fold_in(key(seed), indices[k]))``, the
    convention of ``scripts/eval_testbed.py`` (so the same seed and record give the same image there and here)."""
    return jnp.stack([jax.random.normal(jax.random.fold_in(jax.random.key(seed), int(i)), shape, jnp.float32)
                      for i in indices])


def export_qlinears(layers: Mapping[str, Mapping[str, jax.Array]], blocks: Mapping[str, jax.Array],
                    config: QADConfig, lowrank_quantized: bool) -> dict[str, Any]:
    """Trained student layers -> ``{name: kroquant_jax.qlinear.QuantizedLinear}`` with packed codes (the weight and,
    for LoRaQ, the branch quantized in ``config.fmt``), for ``qlinear_overrides`` (CPU simulate / packed paths) or
    the GPU's served layers. Their forward equals :func:`student_linear`'s (tested)."""
    from kroquant_jax.qlinear import QLinearConfig, QuantizedLinear  # noqa: PLC0415

    fmt = config.quant_format
    out = {}
    for name, layer in layers.items():
        w = jnp.asarray(layer["weight"], jnp.float32)
        o, d = w.shape
        left, right = jnp.asarray(layer["left"], jnp.float32), jnp.asarray(layer["right"], jnp.float32)
        rank = int(left.shape[1])
        if rank and lowrank_quantized:
            left, right = formats.quantize(left, fmt), formats.quantize(right, fmt)
        cfg = QLinearConfig(in_features=d, out_features=o, transform="dense", act_fmt=fmt, rank=rank)
        out[name] = QuantizedLinear(blocks=jnp.asarray(blocks[name], jnp.float32), transform_params=None,
                                    weight=formats.quantize(w, fmt), lowrank_left=left if rank else None,
                                    lowrank_right=right if rank else None,
                                    bias=jnp.asarray(layer["bias"], jnp.float32), config=cfg)
    return out


def check_export_dir(directory: str | Path, overwrite: bool, flag: str = "--out",
                     overwrite_flag: str = "--overwrite") -> Path:
    """Refuse to export onto an existing non-empty folder unless ``overwrite`` (checked before any expensive work).

    Raises:
        ValueError: naming ``flag`` and the folder (a file there, or a non-empty folder without ``overwrite``).
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{flag} {directory}: exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise ValueError(f"{flag} {directory}: exists and is not empty; pass {overwrite_flag} to replace it")
    return directory


def export_unquantized_student(directory: str | Path, graphdef: Any, model_state: Any, *,
                               extra: Mapping[str, Any] | None = None, prompts: str | Path | None = None) -> Path:
    """Write the trained one-branch 16-bit student (``kroquant qad --variants distill_16bit``: CFG folded in, nothing
    quantized) as a diffusers PixArt folder, which every tool that reads a 16-bit checkpoint takes (``kroquant
    quantize-checkpoint``, ``kroquant qad --checkpoint``, ``benchmarks/generate_strategies.py --teacher``).

    Written in this order: ``distilled.json`` (``extra`` plus the sampler the student is meant for, unless given:
    ``guidance`` 1, one branch), ``prompts`` copied as ``testbed_prompts.npz`` when given (the testbed tools read
    their captions from the checkpoint folder), then the weights and ``config.json`` last
    (``models.convert.write_diffusers_dir``: a folder with a config is complete). Use :func:`check_export_dir` first
    to refuse a non-empty folder.

    Args:
        directory: the folder to write. graphdef: the student's (the teacher's) nnx graph definition.
        model_state: the trained nnx state (``init_state(...)["trainable"]["model"]``; no quantized layers).
    Returns:
        the folder.
    """
    from kroquant_jax.fileio import atomic_write_bytes, atomic_write_json  # noqa: PLC0415
    from models import families  # noqa: PLC0415

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").unlink(missing_ok=True)  # incomplete until the new config lands
    atomic_write_json(directory / "distilled.json",
                      {"solver": "flow_euler", "shift": 1.0, "guidance": 1.0, "branches": 1, **dict(extra or {})})
    if prompts is not None:
        atomic_write_bytes(directory / "testbed_prompts.npz", Path(prompts).read_bytes())
    else:
        (directory / "testbed_prompts.npz").unlink(missing_ok=True)  # not an earlier export's
    families.PIXART.to_diffusers(nnx.merge(graphdef, model_state), directory)
    return directory


def export_student_checkpoint(directory: str | Path, graphdef: Any, trainable: Mapping[str, Any],
                              blocks: Mapping[str, jax.Array], quant: QADConfig, lowrank_quantized: bool, *,
                              recipe_name: str, recipe: Any, extra: Mapping[str, Any] | None = None
                              ) -> dict[str, Any]:
    """Write a trained W4A4 student (QAD's, or DMD2's W4A4 generator) as a quantized checkpoint folder
    (``models.quantized_checkpoint.save_quantized_checkpoint``: atomic, a temporary folder renamed onto
    ``directory``, replacing an older one; use :func:`check_export_dir` first to refuse one).

    ``model.safetensors`` holds the student's trained 16-bit rest (``trainable["model"]`` merged into ``graphdef``,
    in its dtype: the fp32 masters), without the quantized linears' stored kernels and biases, which the student
    never uses; ``quantized.safetensors`` holds :func:`export_qlinears` of ``trainable["layers"]`` (packed in
    ``quant.fmt``; their forward is :func:`student_linear`'s, so the folder's simulate forward is the student's
    fake-quant velocity). The fp32 master ``W~`` is not stored, only its codes: the format holds what is served.

    Args:
        directory: the folder to write.
        graphdef: the student's (the teacher's) nnx graph definition.
        trainable: ``{"model": nnx state, "layers": {name: {"weight" (o, d), "bias" (o,), "left" (o, r),
            "right" (r, d)}}}`` (:func:`init_state`'s ``trainable``; DMD2's W4A4 generator parameters).
        blocks: ``{name: (d / n, n, n)}`` the frozen transforms. quant: the W4A4 format (``fmt``) of the layers.
        lowrank_quantized: the branch is packed (LoRaQ) rather than 16-bit (SVDQuant).
        recipe_name, recipe: the ``recipe`` name and the training config whose settings are recorded (the
            :class:`QADConfig` trained, or a ``models.dmd2.DMD2Config``).
        extra: notes stored under ``extra`` (e.g. the step, the initialisation and its SHA-256, the teacher); the
            sampler the student is meant for is added unless given: ``solver`` ``flow_euler``, ``shift`` 1,
            ``guidance`` 1 (one branch: CFG is folded into the student).
    Returns:
        the exported ``{name: kroquant_jax.qlinear.QuantizedLinear}``.
    Raises:
        ValueError: a layer that is not a quantizable linear of the model (named).
    """
    from models.quantized_checkpoint import save_quantized_checkpoint  # noqa: PLC0415

    model = nnx.merge(graphdef, trainable["model"])
    quantizable = linears(model, quantizable_only=True)
    foreign = sorted(set(trainable["layers"]) - set(quantizable))
    if foreign:
        raise ValueError(f"export_student_checkpoint: layer {foreign[0]!r} is not a quantizable linear of the model")
    qlayers = export_qlinears(trainable["layers"], blocks, quant, lowrank_quantized)
    left = {name: "not a layer of the student (ran 16-bit)" for name in quantizable if name not in qlayers}
    notes = {"solver": "flow_euler", "shift": 1.0, "guidance": 1.0,
             "student": {"fmt": quant.fmt, "ste": quant.ste, "lowrank_quantized": bool(lowrank_quantized)},
             **dict(extra or {})}
    save_quantized_checkpoint(directory, model, qlayers, recipe_name=recipe_name, recipe=recipe, left_16bit=left,
                              extra=notes)
    return qlayers


def _ycbcr(rgb: np.ndarray) -> np.ndarray:
    m = np.array([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])
    return rgb @ m.T


def _rgb(ycc: np.ndarray) -> np.ndarray:
    m = np.array([[1.0, 0.0, 1.402], [1.0, -0.344136, -0.714136], [1.0, 1.772, 0.0]])
    return ycc @ m.T


def colour_correct(images: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The seed's post-hoc control: luma and saturation rebalancing of ``images`` toward ``reference``'s statistics.

    In YCbCr (BT.601): luma is mapped affinely so the set's mean and standard deviation equal the reference set's;
    the chroma planes are scaled by one gain so the set's mean chroma magnitude equals the reference's (a saturation
    gain around grey). Set statistics, not per image: the reference images of the same captions are an oracle a
    real post-processor would not have, but even this favourable version only moves global colour statistics.

    Args: uint8 ``(n, s, s, 3)`` each. Returns: uint8 ``(n, s, s, 3)``.
    """
    x = _ycbcr(np.asarray(images, np.float64) / 255.0)
    ref = _ycbcr(np.asarray(reference, np.float64) / 255.0)
    luma = (x[..., 0] - x[..., 0].mean()) * (ref[..., 0].std() / max(x[..., 0].std(), 1e-9)) + ref[..., 0].mean()
    gain = np.hypot(ref[..., 1], ref[..., 2]).mean() / max(np.hypot(x[..., 1], x[..., 2]).mean(), 1e-9)
    out = _rgb(np.stack([luma, gain * x[..., 1], gain * x[..., 2]], axis=-1))
    return np.round(np.clip(out, 0.0, 1.0) * 255.0).astype(np.uint8)
