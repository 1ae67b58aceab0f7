"""GPTQ weight rounding for the micro-scaled FP4 formats (MXFP4, NVFP4): second-order error feedback, group-aware.

Round-to-nearest (:func:`kroquant_jax.formats.fake_quant`) rounds every weight on its own. GPTQ (Frantar et al., 2022)
rounds the columns of ``W (o, d)`` one at a time and spreads each column's rounding error over the columns not yet
rounded, weighted by the inverse Hessian of the layer's output error ``||A W^T - A Q^T||^2``, ``H = A^T A (d, d)``
(``A (n, d)``: calibration activations), so that later columns compensate earlier errors.

The algorithm (``gptq_fake_quant`` / ``gptq_quantize``):

1. **Dampening**: ``H + damp * mean(diag H) * I``. A column whose activation is always zero (``H_ii == 0``) gets
   ``H_ii = 1`` first (its weight does not affect the output; it is rounded to nearest and kept, not zeroed).
2. ``U = cholesky(H^-1)``, upper triangular (``H^-1 = U^T U``): row ``i`` of ``U / U_ii`` is the update that column
   ``i``'s error applies to the columns after it (the sequential inverse-Hessian updates in closed form).
3. Columns in **lazy blocks** of ``block_size`` (a multiple of the group size, default the largest one ``<= 128``
   dividing ``d``): inside a block each column is rounded and its error applied to the rest of the block; the
   block's errors reach the columns after it in one matmul.
4. **Scale groups** (32 elements for MXFP4, 16 for NVFP4, along ``d``): with ``scales="dynamic"`` (default) a group's
   scales (one per output row) are chosen by ``fmt.quantize_blocks`` from the *current, error-updated* weights of
   that group when the pass reaches the group's first column; its columns are then rounded on those scales. This is
   the convention of GPTQ with groups (``groupsize`` in the reference implementation) and of MR-GPTQ
   (arXiv 2509.23202): the scale then fits the weights that are actually rounded (the error feedback of the earlier
   groups has already moved them), where scales fixed from the original ``W`` (``scales="static"``) can clip or
   waste range on weights the feedback has moved. Inside a group, the later columns are still updated after the
   scale is fixed; an update past the group's range saturates at ``+-6`` times the scale, as in the reference.
   NVFP4's per-tensor scale is ``fmt.tensor_scale`` of the original ``W`` (fixed before the pass).
5. **Act-order** (``act_order=True``): GPTQ's heuristic of rounding the columns with the largest ``diag(H)`` first.
   Permuting single columns would scatter a scale group over the pass; here whole groups are permuted (by the sum of
   their ``diag(H)``, descending) and columns inside a group by their ``diag(H)``, descending, so every group keeps
   its columns and its one scale, and the stored layout is unchanged (the permutation is undone on the result).

Every rounded value is ``fmt.dequantize_blocks`` of an E2M1 code on the group's chosen scales, so the result is
exactly representable: :func:`gptq_quantize` returns those codes and scales as a
:class:`~kroquant_jax.formats.QuantizedArray` with ``dequantize(q) == gptq_fake_quant(...)`` bit for bit.
``formats.quantize`` of the result re-derives the scales from each group's rounded maximum. For MXFP4 with the FLOOR
rule that gives back the same values (tested): a group whose largest code is 4 or 6 gets its scale back, one whose
largest code is smaller gets a smaller power of two on which every value is still representable. NVFP4's E4M3 scale
re-derived from a group whose largest code is below 6 can be a scale on which the values are not all representable,
so store :func:`gptq_quantize`'s array, not a re-quantization of the values.

Composition (the recipes' ``+gptq`` stage, :class:`GPTQConfig`, ``kroquant_jax.calibrate``): with an invertible
transform ``T`` the layer computes ``(A T)(W T^{-T})^T``; transform first, then GPTQ on ``W T^{-T}`` with
``H = (A T)^T (A T)`` of the calibration rows (:func:`hessian`). With a low-rank branch ``B`` (LoRaQ / SVDQuant),
``GPTQConfig.lowrank_order`` chooses the order: ``"branch_first"``: the recipe's own data-free fit of ``W T^{-T}``
(LoRaQ / SVDQuant), then GPTQ of the residual ``W T^{-T} - B`` against the branch *as stored* (quantized for LoRaQ),
so the error feedback also absorbs the branch's storage rounding;
``"gptq_first"``: GPTQ of ``W T^{-T}`` first (``Q``, stored as it is), the branch the rank-``r`` fit of that
rounding's error ``E`` in the ``H``-norm (:func:`whitened_low_rank`, minimising the calibration output error
``||A T (E - B)^T||``); the branch's own storage rounding (LoRaQ's MXFP4) is then not compensated. ``docs/calibration.md`` ("GPTQ in the recipes") has the measurement that chose the default.

Shapes: ``w (o, d)``, ``h (d, d)``; ``d`` a multiple of the group size. The core is pure and jits once per shape and
option set; it ``vmap``s over a stack of layers of one shape (``w (L, o, d)``, ``h (L, d, d)``) with
:func:`gptq_rounding` (the traceable function, no value checks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import formats, lowrank
from kroquant_jax.formats import QuantFormat, QuantizedArray
from kroquant_jax.layerset import RunConfig, engine_jit, group_by_shape, program_config, run_groups

__all__ = ["GPTQConfig", "GptqRounding", "default_block_size", "gptq_fake_quant", "gptq_layers", "gptq_quantize",
           "gptq_rounding", "hessian", "whitened_low_rank"]

ScalesMode = Literal["dynamic", "static"]
LowRankOrder = Literal["branch_first", "gptq_first"]
_HIGHEST = jax.lax.Precision.HIGHEST


class GptqRounding(NamedTuple):
    """The result of one GPTQ pass over ``w (o, d)`` (a pytree; stacked along a leading axis under ``vmap``).

    Attributes:
      values: ``float32 (o, d)`` the rounded weight, ``codes`` decoded on ``scales`` and ``tensor_scale``.
      codes: ``uint8 (o, d)`` E2M1 codes, one per element (unpacked).
      scales: ``(o, d // group)`` block scales of ``fmt.scale_dtype``.
      tensor_scale: ``float32 ()`` the per-tensor scale (``1.0`` for MXFP4).
    """

    values: jax.Array
    codes: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array


def default_block_size(d: int, group: int, target: int = 128) -> int:
    """The lazy-update block: the largest multiple of ``group`` that divides ``d`` and is ``<= max(target, group)``."""
    best = group
    for k in range(1, max(target, group) // group + 1):
        if d % (k * group) == 0:
            best = k * group
    return best


def _encode_on_scales(x: jax.Array, scales: jax.Array, tensor_scale: jax.Array, fmt: QuantFormat) -> tuple:
    """E2M1 codes and values of ``x (o, n)`` on given block scales ``(o,)`` (one scale per row): the element step of
    ``fmt.quantize_blocks`` (multiply by the reciprocal of the effective scale, flush, saturate at 6, encode) with the
    scale fixed, decoded by ``fmt.dequantize_blocks``."""
    if fmt.has_tensor_scale:  # NVFP4: (1 / tensor_scale) / block_scale, as nvfp4_quantize_blocks
        reciprocal = formats.divide_rn(formats.divide_rn(jnp.float32(1.0), tensor_scale), fmt.scale_factors(scales))
    else:  # MXFP4: 2**-e from the E8M0 byte, as mxfp4_quantize_blocks (byte 0, e = -127, included)
        reciprocal = formats.pow2(jnp.clip(127 - scales.astype(jnp.int32), -126, 127))
    v = formats.flush_subnormals(x * reciprocal[:, None])
    codes = formats.e2m1_encode(jnp.clip(v, -formats.E2M1_MAX, formats.E2M1_MAX))
    values = fmt.dequantize_blocks(codes[:, None, :], scales[:, None], tensor_scale)[:, 0, :]
    return codes, values


def _fix_zero_diagonal(h: jax.Array) -> jax.Array:
    """``H`` with ``H_ii = 1`` where ``H_ii == 0`` (a column whose activation is always zero)."""
    return h + jnp.diag(jnp.where(jnp.diagonal(h) == 0, jnp.float32(1.0), jnp.float32(0.0)))


def _add_damping(h: jax.Array, damp: float) -> jax.Array:
    """``H + damp * mean(diag H) * I``."""
    return h + jnp.eye(h.shape[0], dtype=jnp.float32) * (damp * jnp.mean(jnp.diagonal(h)))


def _group_permutation(h_diag: jax.Array, group: int) -> jax.Array:
    """Act-order in whole groups: groups by the sum of their ``diag(H)`` descending, columns inside a group by
    ``diag(H)`` descending. Returns the column permutation ``int32 (d,)``."""
    d = h_diag.shape[0]
    g = h_diag.reshape(d // group, group)
    group_order = jnp.argsort(-jnp.sum(g, axis=1), stable=True)  # (ng,)
    inner = jnp.argsort(-g, axis=1, stable=True)  # (ng, group)
    return (group_order[:, None] * group + inner[group_order]).reshape(d).astype(jnp.int32)


def gptq_rounding(w: jax.Array, h: jax.Array, fmt: QuantFormat, *, damp: float = 0.01,
                  block_size: Optional[int] = None, scales: ScalesMode = "dynamic",
                  act_order: bool = False) -> GptqRounding:
    """The traceable GPTQ pass (jit/vmap it; no value checks: a NaN ``h`` gives NaN values).

    Args:
      w: ``(o, d)`` weight (any float dtype; computed in f32).
      h: ``(d, d)`` Hessian ``A^T A`` of the layer's (transformed) input activations ``A (n, d)``.
      fmt: :class:`~kroquant_jax.formats.MXFP4` or :class:`~kroquant_jax.formats.NVFP4`; its ``block_size`` is the
        scale group.
      damp: dampening relative to ``mean(diag H)``.
      block_size: lazy-update block, a multiple of the group dividing ``d`` (default :func:`default_block_size`).
      scales: ``"dynamic"`` (each group's scales from its error-updated weights) or ``"static"`` (from the original
        ``w``).
      act_order: round groups (and columns inside them) in descending ``diag(H)`` order.

    Returns:
      :class:`GptqRounding` in the original column order.
    """
    o, d = w.shape
    group = fmt.block_size
    block = default_block_size(d, group) if block_size is None else block_size
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    ts = jnp.asarray(fmt.tensor_scale(w), jnp.float32)

    h = _fix_zero_diagonal(h)
    if act_order:
        perm = _group_permutation(jnp.diagonal(h), group)
        w, h = w[:, perm], h[perm][:, perm]
    lower = jnp.linalg.cholesky(_add_damping(h, damp))
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(d, dtype=jnp.float32))
    u = jnp.linalg.cholesky(h_inv).T  # upper: H^-1 = U^T U

    ng, gpb = d // group, block // group
    if scales == "static":
        _, static_scales = fmt.quantize_blocks(w.reshape(o, ng, group), ts)  # (o, ng)
    cols = jnp.arange(d)

    def column(i, carry):
        w_blk, u_blk, err_blk, codes_blk, scales_blk, start = carry
        gi = i // group
        if scales == "dynamic":
            grp = jax.lax.dynamic_slice_in_dim(w_blk, gi * group, group, axis=1)  # (o, group), current weights
            _, fresh = fmt.quantize_blocks(grp[:, None, :], ts)
            cur = jnp.where(i % group == 0, fresh[:, 0], scales_blk[gi])
            scales_blk = scales_blk.at[gi].set(cur)
        else:
            cur = jax.lax.dynamic_index_in_dim(static_scales, start // group + gi, axis=1, keepdims=False)
        x = jax.lax.dynamic_slice_in_dim(w_blk, i, 1, axis=1)  # (o, 1)
        code, val = _encode_on_scales(x, cur, ts, fmt)
        err = (x[:, 0] - val[:, 0]) / u_blk[i, i]
        w_blk = w_blk - err[:, None] * u_blk[i][None, :]  # U is upper: columns < i untouched
        w_blk = jax.lax.dynamic_update_slice_in_dim(w_blk, val, i, axis=1)
        err_blk = jax.lax.dynamic_update_slice_in_dim(err_blk, err[:, None], i, axis=1)
        codes_blk = jax.lax.dynamic_update_slice_in_dim(codes_blk, code, i, axis=1)
        return w_blk, u_blk, err_blk, codes_blk, scales_blk, start

    def block_step(b, carry):
        w_all, codes_all, scales_all = carry
        start = b * block
        w_blk = jax.lax.dynamic_slice_in_dim(w_all, start, block, axis=1)
        u_blk = jax.lax.dynamic_slice(u, (start, start), (block, block))
        init = (w_blk, u_blk, jnp.zeros((o, block), jnp.float32), jnp.zeros((o, block), jnp.uint8),
                jnp.zeros((gpb, o), fmt.scale_dtype), start)
        w_blk, _, err_blk, codes_blk, scales_blk, _ = jax.lax.fori_loop(0, block, column, init)
        # Lazy update of the columns after the block (U's rows of the block, masked to the later columns).
        u_rows = jax.lax.dynamic_slice_in_dim(u, start, block, axis=0)  # (block, d)
        u_rows = jnp.where(cols[None, :] >= start + block, u_rows, 0.0)
        w_all = w_all - jnp.matmul(err_blk, u_rows, precision=_HIGHEST)
        w_all = jax.lax.dynamic_update_slice_in_dim(w_all, w_blk, start, axis=1)
        codes_all = jax.lax.dynamic_update_slice_in_dim(codes_all, codes_blk, start, axis=1)
        if scales == "dynamic":
            scales_all = jax.lax.dynamic_update_slice_in_dim(scales_all, scales_blk.T, start // group, axis=1)
        return w_all, codes_all, scales_all

    init = (w, jnp.zeros((o, d), jnp.uint8), jnp.zeros((o, ng), fmt.scale_dtype))
    _, codes, scales_out = jax.lax.fori_loop(0, d // block, block_step, init)
    if scales == "static":
        scales_out = static_scales
    if act_order:
        inv = jnp.argsort(perm)
        codes = codes[:, inv]
        # A group's columns stay together: the permuted group k holds original group perm[k * group] // group.
        group_src = perm.reshape(ng, group)[:, 0] // group
        scales_out = scales_out[:, jnp.argsort(group_src)]
    # The values from the stored codes and scales: the pass's copy can differ in the sign of a zero (a later update
    # subtracts -0.0), and the result must be exactly what the codes say.
    values = fmt.dequantize_blocks(codes.reshape(o, ng, group), scales_out, ts).reshape(o, d)
    return GptqRounding(values=values, codes=codes, scales=scales_out, tensor_scale=ts)


def _validate(w, h, fmt, damp, block_size, scales) -> None:
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"gptq: fmt={fmt!r} must be MXFP4(...) or NVFP4(...)")
    for name, x in (("w", w), ("h", h)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"gptq: {name} must be a floating array, got dtype {x.dtype}")
    if w.ndim != 2:
        raise ValueError(f"gptq: w must be (o, d), got shape {tuple(w.shape)}")
    o, d = w.shape
    if h.shape != (d, d):
        raise ValueError(f"gptq: h must be (d, d) = ({d}, {d}) for w of shape {tuple(w.shape)}, got {tuple(h.shape)}")
    group = fmt.block_size
    if d % group:
        raise ValueError(f"gptq: w's d={d} must be a multiple of {fmt.name}'s group size {group}")
    if block_size is not None and (block_size <= 0 or block_size % group or d % block_size):
        raise ValueError(f"gptq: block_size={block_size} must be a positive multiple of the group size {group} that "
                         f"divides d={d}")
    if not (np.isfinite(damp) and damp >= 0):
        raise ValueError(f"gptq: damp={damp} must be a finite number >= 0")
    if scales not in ("dynamic", "static"):
        raise ValueError(f"gptq: scales={scales!r} must be 'dynamic' or 'static'")
    for name, x in (("w", w), ("h", h)):
        if _is_concrete(x):
            formats.check_finite(x, f"gptq: {name}")


def _is_concrete(x) -> bool:
    """Whether ``x`` holds values (not a tracer of an enclosing jit / vmap, where values cannot be checked)."""
    try:
        np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
    return True


_gptq_jit = jax.jit(gptq_rounding, static_argnames=("fmt", "damp", "block_size", "scales", "act_order"))


def _run(w, h, fmt, damp, block_size, scales, act_order) -> GptqRounding:
    w, h = jnp.asarray(w), jnp.asarray(h)
    _validate(w, h, fmt, damp, block_size, scales)
    out = _gptq_jit(w, h, fmt, damp=float(damp), block_size=block_size, scales=scales, act_order=bool(act_order))
    if _is_concrete(out.values) and not bool(jnp.all(jnp.isfinite(out.values))):
        raise ValueError(f"gptq: h is not positive definite after dampening (damp={damp}); pass a larger damp")
    return out


def gptq_fake_quant(w: jax.Array, h: jax.Array, fmt: QuantFormat = formats.MXFP4(), *, damp: float = 0.01,
                    block_size: Optional[int] = None, scales: ScalesMode = "dynamic",
                    act_order: bool = False) -> jax.Array:
    """GPTQ-rounded ``w (o, d)`` given ``h = A^T A (d, d)``: same shape and dtype as ``w`` (the layout of
    ``formats.fake_quant``'s output). Arguments as :func:`gptq_rounding`; raises ``ValueError``/``TypeError`` naming
    the argument for bad shapes, a width that is not a multiple of the group, non-finite ``w``/``h`` (when concrete)
    or an ``h`` that is not positive definite after dampening."""
    return _run(w, h, fmt, damp, block_size, scales, act_order).values.astype(w.dtype)


def gptq_quantize(w: jax.Array, h: jax.Array, fmt: QuantFormat = formats.MXFP4(), *, damp: float = 0.01,
                  block_size: Optional[int] = None, scales: ScalesMode = "dynamic",
                  act_order: bool = False) -> QuantizedArray:
    """GPTQ-rounded ``w`` as a :class:`~kroquant_jax.formats.QuantizedArray` (the pass's codes and scales), with
    ``dequantize(q, jnp.float32) == gptq_fake_quant(w, h, ...)`` bit for bit. Arguments as :func:`gptq_fake_quant`."""
    r = _run(w, h, fmt, damp, block_size, scales, act_order)
    return QuantizedArray(codes=formats.pack_nibbles(r.codes), scales=r.scales, tensor_scale=r.tensor_scale, fmt=fmt,
                          dtype=np.dtype(w.dtype))


# ---------------------------------------------------------------------------------------------------------------------
# The recipes' rounding stage: a frozen config, the Hessian, all layers of one shape in one vmapped program.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """GPTQ as the weight-rounding stage of a recipe (``Recipe.gptq``; ``None`` there rounds to nearest).

    Attributes:
      damp, block_size, scales, act_order: as :func:`gptq_rounding`.
      lowrank_order: with a low-rank branch, ``"branch_first"`` (the recipe's LoRaQ / SVDQuant fit of the transformed
        weight, then GPTQ of the residual) or ``"gptq_first"`` (GPTQ of the transformed weight, the branch fitted to
        its error in the ``H``-norm by :func:`whitened_low_rank`); see the module docstring. Ignored without a
        branch.
      max_layers_per_program: at most this many stacked layers per compiled program (memory bound).
    """

    damp: float = 0.01
    block_size: Optional[int] = None
    scales: ScalesMode = "dynamic"
    act_order: bool = False
    lowrank_order: LowRankOrder = "branch_first"
    max_layers_per_program: int = 64

    def __post_init__(self):
        if not (np.isfinite(self.damp) and self.damp >= 0):
            raise ValueError(f"GPTQConfig.damp={self.damp} must be a finite number >= 0")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"GPTQConfig.block_size={self.block_size} must be positive (or None)")
        if self.scales not in ("dynamic", "static"):
            raise ValueError(f"GPTQConfig.scales={self.scales!r} must be 'dynamic' or 'static'")
        if self.lowrank_order not in ("branch_first", "gptq_first"):
            raise ValueError(f"GPTQConfig.lowrank_order={self.lowrank_order!r} must be 'branch_first' or "
                             f"'gptq_first'")
        if self.max_layers_per_program < 1:
            raise ValueError(f"GPTQConfig.max_layers_per_program={self.max_layers_per_program} must be >= 1")


def hessian(a: jax.Array) -> jax.Array:
    """``A^T A (d, d)`` float32 of activation rows ``a (n, d)`` (the transformed calibration rows ``A T``)."""
    a = jnp.asarray(a, jnp.float32)
    return jnp.matmul(a.T, a, precision=_HIGHEST)


def whitened_low_rank(e: jax.Array, h: jax.Array, rank: int, damp: float = 0.01,
                      method: str = "randomized") -> tuple[jax.Array, jax.Array]:
    """The rank-``rank`` branch ``L (o, r)``, ``R (r, d)`` minimising ``tr((E - L R) H (E - L R)^T)``, i.e. the
    calibration output error ``||A (E - L R)^T||_F^2`` for ``H = A^T A`` (dampened as GPTQ dampens it).

    With ``C C^T = H`` (Cholesky): ``||(E - L R) C||_F`` is minimised by the truncated SVD of ``E C``
    (:func:`kroquant_jax.lowrank.low_rank_svd`, balanced factors ``L``, ``R'``), and ``R = R' C^{-1}``. Pure,
    ``vmap``-able; ``e (o, d)``, ``h (d, d)``.
    """
    e = e.astype(jnp.float32)
    c = jnp.linalg.cholesky(_add_damping(_fix_zero_diagonal(h.astype(jnp.float32)), damp))  # as GPTQ dampens H
    left, right_w = lowrank.low_rank_svd(jnp.matmul(e, c, precision=_HIGHEST), rank, method)
    right = jax.scipy.linalg.solve_triangular(c, right_w.T, trans="T", lower=True).T  # R' C^{-1}, (r, d)
    return left, right


@functools.partial(engine_jit, static_argnames="cfg")
def _gptq_program(w, h, cfg):
    fmt, cfg = cfg
    return jax.vmap(lambda x, y: gptq_rounding(x, y, fmt, damp=cfg.damp, block_size=cfg.block_size,
                                               scales=cfg.scales, act_order=cfg.act_order))(w, h)


def gptq_layers(weights: Mapping[str, np.ndarray], hessians: Mapping[str, np.ndarray],
                fmt: QuantFormat = formats.MXFP4(), cfg: GPTQConfig = GPTQConfig(), *, run: RunConfig = RunConfig(),
                pad_to: int = 1) -> dict[str, QuantizedArray]:
    """GPTQ of every weight ``{name: W (o, d)}`` with its ``{name: H (d, d)}``: layers of one shape stacked,
    ``vmap``-ed and sharded like the other stages (programs sized for at least ``min(pad_to,
    cfg.max_layers_per_program)`` layers). Returns ``{name: QuantizedArray}`` of ``fmt`` (host numpy leaves), whose
    ``dequantize`` is the rounded weight bit for bit.

    Raises ``ValueError`` naming the layer for a shape that does not fit, non-finite input, or an ``H`` that is not
    positive definite after dampening.
    """
    for name, w in weights.items():
        if name not in hessians:
            raise ValueError(f"gptq_layers: layer {name!r} has no Hessian")
        try:
            _validate(jnp.asarray(w), jnp.asarray(hessians[name]), fmt, cfg.damp, cfg.block_size, cfg.scales)
        except (ValueError, TypeError) as err:
            raise ValueError(f"layer {name!r}: {err}") from None

    def stack(names):
        return [np.stack([np.asarray(m[n], np.float32) for n in names]) for m in (weights, hessians)]

    res = run_groups(functools.partial(_gptq_program, cfg=(fmt, program_config(cfg))), group_by_shape(weights), stack,
                     max_per_program=cfg.max_layers_per_program, run=run, pad_to=pad_to, desc="GPTQ")
    out = {}
    for n in weights:
        r = res[n]
        if not np.all(np.isfinite(r.values)):
            raise ValueError(f"layer {n!r}: gptq: h is not positive definite after dampening (damp={cfg.damp}); "
                             f"pass a larger damp")
        out[n] = QuantizedArray(codes=np.asarray(formats.pack_nibbles(jnp.asarray(r.codes))), scales=r.scales,
                                tensor_scale=r.tensor_scale, fmt=fmt, dtype=np.dtype(np.float32))
    return {n: out[n] for n in weights}
