"""The calibrated W4A4 linear layer: a pytree, its forward pass (paper eq. 11) and atomic, resumable storage.

A :class:`QuantizedLinear` holds, for ``y = x W^T + b`` with ``x (..., d)`` and ``W (o, d)``:

* ``blocks (d/n, n, n)``: the blocks of the online transform ``T`` (K1 form; ``n = 1`` for a diagonal, 32 for
  KroQuant / Hadamard-32), and optionally ``transform_params`` (the parameterization's parameters, for the K2 kernel
  that rebuilds the blocks on the fly);
* ``weight``: the packed residual ``Q(W~ - L R)`` with ``W~ = W T^{-T}``, a :class:`~kroquant_jax.formats.QuantizedArray`
  ``(o, d)`` (codes ``uint8 (o, d/2)`` + block scales);
* ``lowrank_left (o, r)``, ``lowrank_right (r, d)``: the low-rank branch ``L``, ``R``, either packed
  (``QuantizedArray``, quantized along their last axis, as LoRaQ stores them in MXFP4) or 16/32-bit arrays
  (SVDQuant), or ``None`` (no branch);
* ``bias (o,)`` or ``None``; and a static :class:`QLinearConfig`.

Forward (eq. 11)::

    y = Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b

The activations entering the low-rank branch stay unquantized. ``path="simulate"`` fake-quantizes ``x T`` with the
STE (differentiable, any device); ``path="packed"`` quantizes ``x T`` to codes + scales and multiplies the dequantized
codes of both operands (the reference of the GPU kernels, which plug in from ``pallas_kernels``). Both agree.

Storage: :class:`QLinearStore` keeps one ``.safetensors`` file per layer in a folder, each written atomically (temp
file + rename) with the fingerprint of its inputs, so a calibration interrupted midway restarts from the layers
already stored, and a stored layer computed from other inputs is refused instead of reused.
:func:`save_orbax` / :func:`restore_orbax` save a whole ``{name: QuantizedLinear}`` with orbax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Literal, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import transforms
from kroquant_jax.formats import (MXFP4, QuantFormat, QuantizedArray, as_float32, check_finite, dequantize,
                                  fake_quant, quantize)
from kroquant_jax.fileio import atomic_write_bytes

__all__ = ["QLinearConfig", "QuantizedLinear", "QLinearStore", "build_qlinear", "effective_weight", "forward_form",
           "load_qlinear",
           "lowrank_factors", "pad_to_block", "qlinear_forward", "qlinear_from_factors", "random_kron_params",
           "random_qlinear", "residual_weight", "restore_orbax", "save_orbax", "save_qlinear", "with_input_pad"]

Path = Literal["simulate", "packed"]


@dataclasses.dataclass(frozen=True)
class QLinearConfig:
    """Static description of a :class:`QuantizedLinear`.

    Attributes:
      in_features: ``d``.
      out_features: ``o``.
      transform: parameterization name of ``T`` (``transforms.REGISTRY``).
      act_fmt: format of the activations ``Q(x T)`` (the weight's format is in ``weight.fmt``).
      rank: low-rank branch rank ``r`` (0: no branch).
      ste: STE rule of the simulated activation quantizer.
      input_pad: zero columns appended to the input before the transform: the layer stands for a linear of input
        width ``in_features - input_pad`` (not a multiple of the block) padded to ``in_features`` (see
        :func:`pad_to_block`, :func:`with_input_pad`); ``0`` for an aligned linear.
    """

    in_features: int
    out_features: int
    transform: str = "identity"
    act_fmt: QuantFormat = MXFP4()
    rank: int = 0
    ste: str = "identity"
    input_pad: int = 0

    @property
    def input_width(self) -> int:
        """The width of the inputs the layer takes (``in_features - input_pad``)."""
        return self.in_features - self.input_pad


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("blocks", "transform_params", "weight", "lowrank_left", "lowrank_right", "bias"),
                   meta_fields=("config",))
@dataclasses.dataclass(frozen=True)
class QuantizedLinear:
    """One calibrated W4A4 linear layer (see the module docstring for the fields and eq. 11)."""

    blocks: jax.Array
    transform_params: Any
    weight: QuantizedArray
    lowrank_left: Union[QuantizedArray, jax.Array, None]
    lowrank_right: Union[QuantizedArray, jax.Array, None]
    bias: Optional[jax.Array]
    config: QLinearConfig

    @property
    def lowrank_quantized(self) -> bool:
        return isinstance(self.lowrank_left, QuantizedArray)


def build_qlinear(weight, bias=None, *, transform: str = "identity", transform_params=None,
                  lowrank: Optional[tuple] = None, lowrank_quantized: bool = True,
                  weight_fmt: QuantFormat = MXFP4(), act_fmt: QuantFormat = MXFP4(), lowrank_fmt: QuantFormat = MXFP4(),
                  keep_params: bool = True, quantized_weight: Optional[QuantizedArray] = None,
                  name: str = "layer") -> QuantizedLinear:
    """Builds a :class:`QuantizedLinear` from a 16-bit layer and its calibration results.

    Args:
      weight: ``W (o, d)`` (original, untransformed).
      bias: ``(o,)`` or ``None``.
      transform: parameterization name; ``transform_params`` its parameters (default ``init(d)``).
      lowrank: ``(L (o, r), R (r, d))`` fitted to the *transformed* weight ``W~ = W T^{-T}``, or ``None``.
      lowrank_quantized: store ``L``, ``R`` packed in ``lowrank_fmt`` (LoRaQ) instead of f32 (SVDQuant). The residual
        is computed against the branch as stored, so it absorbs the branch's own quantization error.
      weight_fmt, act_fmt: formats of the residual weight and of the activations.
      keep_params: also keep ``transform_params`` (for the K2 kernel); else only the blocks.
      quantized_weight: the stored 4-bit weight when the caller rounded it, a ``QuantizedArray (o, d)`` of
        ``weight_fmt``: GPTQ of :func:`residual_weight` (``kroquant_jax.gptq.gptq_layers``), or a rounding of
        ``W~`` that the branch was then fitted to (``GPTQConfig.lowrank_order="gptq_first"``). Default ``None``:
        the residual ``W~ - B`` rounded to nearest (``formats.quantize``).
      name: layer name for error messages.
    """
    w = jnp.asarray(weight, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"layer {name!r}: weight must be (o, d), got {w.shape}")
    o, d = w.shape
    p = transforms.get(transform)
    params = p.init(d) if transform_params is None else transform_params
    blocks = _blocks(params, transform=transform)
    if blocks.shape[0] * blocks.shape[1] != d:
        raise ValueError(f"layer {name!r}: transform {transform!r} has width {blocks.shape[0] * blocks.shape[1]}, "
                         f"weight {w.shape}")
    left = right = None
    rank = 0
    if lowrank is not None:
        left, right = (jnp.asarray(x, jnp.float32) for x in lowrank)
        rank = left.shape[1]
        if left.shape != (o, rank) or right.shape != (rank, d):
            raise ValueError(f"layer {name!r}: low-rank factors {left.shape}, {right.shape} do not fit weight "
                             f"{w.shape} (expected (o, r), (r, d))")
    w_t, left, right = _residual(w, params, left, right, transform=transform,
                                 lowrank_fmt=lowrank_fmt if lowrank_quantized else None)
    check_finite(w_t, f"layer {name!r} residual weight")
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    if b is not None and b.shape != (o,):
        raise ValueError(f"layer {name!r}: bias {b.shape} does not match weight {w.shape}")
    cfg = QLinearConfig(in_features=d, out_features=o, transform=transform, act_fmt=act_fmt, rank=rank)
    if quantized_weight is None:
        quantized_weight = jax.jit(quantize, static_argnums=1)(w_t, weight_fmt)
    elif not isinstance(quantized_weight, QuantizedArray) or quantized_weight.fmt != weight_fmt or \
            quantized_weight.shape != (o, d):
        got = (f"{quantized_weight.fmt.name} {quantized_weight.shape}" if isinstance(quantized_weight, QuantizedArray)
               else type(quantized_weight).__name__)
        raise ValueError(f"layer {name!r}: quantized_weight must be a QuantizedArray of {weight_fmt.name} ({o}, {d}), "
                         f"got {got}")
    return QuantizedLinear(blocks=blocks, transform_params=params if keep_params else None, weight=quantized_weight,
                           lowrank_left=left, lowrank_right=right, bias=b, config=cfg)


def residual_weight(weight, *, transform: str = "identity", transform_params=None, lowrank: Optional[tuple] = None,
                    lowrank_quantized: bool = True, lowrank_fmt: QuantFormat = MXFP4()) -> jax.Array:
    """The residual ``W T^{-T} - B (o, d)`` f32 that :func:`build_qlinear` rounds for the same arguments (``B`` the
    branch as stored: ``Q(L) Q(R)`` when ``lowrank_quantized``, else ``L R``; ``0`` without a branch), for a caller
    that rounds it itself (``quantized_weight``)."""
    w = jnp.asarray(weight, jnp.float32)
    params = transforms.get(transform).init(w.shape[1]) if transform_params is None else transform_params
    left = right = None
    if lowrank is not None:
        left, right = (jnp.asarray(x, jnp.float32) for x in lowrank)
    w_t, _, _ = _residual(w, params, left, right, transform=transform,
                          lowrank_fmt=lowrank_fmt if lowrank_quantized else None)
    return w_t


@functools.partial(jax.jit, static_argnames="transform")
def _blocks(params, *, transform):
    """The ``(d / n, n, n)`` blocks of ``T``, one compiled program (eagerly, a Kronecker chain is a dozen small ones)."""
    return transforms.get(transform).blocks(params)


@functools.partial(jax.jit, static_argnames=("transform", "lowrank_fmt"))
def _residual(w, params, left, right, *, transform, lowrank_fmt):
    """``(W T^{-T} - B, L, R)`` with ``B`` the branch as stored (``L``, ``R`` quantized when ``lowrank_fmt``)."""
    w_t = transforms.apply_to_weights(w, transforms.get(transform).inverse_blocks(params))
    if left is not None:
        if lowrank_fmt is not None:
            left, right = quantize(left, lowrank_fmt), quantize(right, lowrank_fmt)
        w_t = w_t - jnp.matmul(as_float32(left), as_float32(right), precision="highest")
    return w_t, left, right


def effective_weight(layer: QuantizedLinear) -> jax.Array:
    """The transformed weight the layer represents, ``Q(W~ - L R) + L R`` ``(o, d)`` (f32)."""
    w = dequantize(layer.weight, jnp.float32)
    if layer.lowrank_left is not None:
        w = w + jnp.matmul(as_float32(layer.lowrank_left), as_float32(layer.lowrank_right), precision="highest")
    return w


def qlinear_forward(layer: QuantizedLinear, x: jax.Array, path: Path = "simulate") -> jax.Array:
    """Eq. 11: ``y = Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b``.

    Args:
      layer: the calibrated layer.
      x: ``(..., d)`` activations (f32/bf16/f16) with ``d = in_features - input_pad`` (zero-padded to
        ``in_features`` first when the layer is padded); the result has ``x.dtype``, computed in f32.
      path: ``"simulate"`` (fake quant with STE, differentiable in ``x``) or ``"packed"`` (codes + scales).

    Returns:
      ``(..., o)``.
    """
    cfg = layer.config
    if x.shape[-1] != cfg.input_width:
        padded = f", zero-padded by input_pad={cfg.input_pad}" if cfg.input_pad else ""
        raise ValueError(f"qlinear_forward: input of shape {x.shape} does not match the layer's in_features="
                         f"{cfg.in_features}{padded} (out_features={cfg.out_features}, transform {cfg.transform!r})")
    if path not in ("simulate", "packed"):
        raise ValueError(f"qlinear_forward: path={path!r} must be 'simulate' or 'packed'")
    return _forward(layer, x, path)


@functools.partial(jax.jit, static_argnames="path")
def _forward(layer: QuantizedLinear, x: jax.Array, path: Path) -> jax.Array:
    cfg = layer.config
    x32 = x.astype(jnp.float32)
    if cfg.input_pad:
        x32 = jnp.pad(x32, [(0, 0)] * (x.ndim - 1) + [(0, cfg.input_pad)])  # (..., in_features)
    xt = transforms.apply_to_activations(x32, layer.blocks)  # (..., d)
    if path == "simulate":
        xq = fake_quant(xt, cfg.act_fmt, ste=cfg.ste)
    elif path == "packed":
        xq = dequantize(quantize(xt, cfg.act_fmt), jnp.float32)
    else:  # pragma: no cover - checked by qlinear_forward
        raise ValueError(path)
    w = dequantize(layer.weight, jnp.float32)  # (o, d)
    y = jnp.einsum("...d,od->...o", xq, w, precision="highest")
    if layer.lowrank_left is not None:
        h = jnp.einsum("...d,rd->...r", xt, as_float32(layer.lowrank_right), precision="highest")  # 16-bit branch input
        y = y + jnp.einsum("...r,or->...o", h, as_float32(layer.lowrank_left), precision="highest")
    if layer.bias is not None:
        y = y + layer.bias
    return y.astype(x.dtype)


#: The parameterization that describes given blocks of each shape (``(n, 32, 32)``: dense 32x32 blocks; ``(d, 1, 1)``:
#: a diagonal), for :func:`forward_form`.
_BLOCKS_ONLY_TRANSFORM = {(transforms.BLOCK, transforms.BLOCK): "dense32", (1, 1): "diagonal"}


def forward_form(layer: QuantizedLinear) -> QuantizedLinear:
    """``layer`` reduced to what :func:`qlinear_forward` reads: the same ``blocks``, weight, branch and bias, without
    ``transform_params`` and described as the parameterization of its block shape (``"dense32"`` for 32x32 blocks,
    ``"diagonal"`` for ``(d, 1, 1)``; others unchanged). The forward is bit for bit the same; what changes is the
    pytree structure, which no longer names the recipe, so layers of different recipes with the same shapes and
    branch kind (e.g. Hadamard-32, KroQuant and smoothed KroQuant; RTN and SmoothQuant) share one compiled program
    that takes them as arguments (a sampler run once per recipe compiles once). Not for the K2 kernel, which needs
    ``transform_params``."""
    name = _BLOCKS_ONLY_TRANSFORM.get(tuple(layer.blocks.shape[1:]), layer.config.transform)
    return dataclasses.replace(layer, transform_params=None, config=dataclasses.replace(layer.config, transform=name))


def pad_to_block(weight: np.ndarray, activations: Optional[np.ndarray], block: int
                 ) -> tuple[np.ndarray, Optional[np.ndarray], int]:
    """A linear whose input width ``d`` is not a multiple of ``block``, zero-padded to the next multiple ``d'``.

    Zero weight columns met by zero input columns leave ``x W^T`` unchanged, so the padded layer computes the same
    linear map; the transform and the FP4 blocks then see whole blocks.

    Args:
      weight: ``W (o, d)``.
      activations: ``(n, d)`` input rows, or None.
      block: the format's block.

    Returns:
      ``(W (o, d'), activations (n, d') or None, d' - d)`` (float32).
    """
    w = np.asarray(weight, np.float32)
    pad = -w.shape[1] % block
    a = None if activations is None else np.asarray(activations, np.float32)
    if a is not None and a.shape[-1] != w.shape[1]:
        raise ValueError(f"pad_to_block: activations {a.shape} and weight {w.shape} disagree on d")
    if pad == 0:
        return w, a, 0
    return (np.pad(w, [(0, 0), (0, pad)]), None if a is None else np.pad(a, [(0, 0), (0, pad)]), pad)


def with_input_pad(layer: QuantizedLinear, pad: int) -> QuantizedLinear:
    """``layer`` (calibrated on inputs zero-padded by ``pad`` columns, :func:`pad_to_block`) taking the unpadded
    inputs: its forward pads them (``QLinearConfig.input_pad``)."""
    if not 0 <= pad < layer.config.in_features:
        raise ValueError(f"with_input_pad: pad={pad} must be in [0, in_features={layer.config.in_features})")
    return dataclasses.replace(layer, config=dataclasses.replace(layer.config, input_pad=pad))


# ---------------------------------------------------------------------------------------------------------------------
# Traceable layers from given factors (device-side stand-ins for calibrated layers: benchmarks, tests).
# ---------------------------------------------------------------------------------------------------------------------


def random_kron_params(key: jax.Array, d: int, spread: float = 0.1) -> dict:
    """Kronecker-LU parameters near the Hadamard init (``a = b = 1/sqrt 2``, ``c = 1``), each scaled by
    ``1 + spread * N(0, 1)``: an invertible, non-orthogonal KroQuant transform of ``d`` channels (a stand-in for a
    calibrated one)."""
    base = transforms.get("kron_lu").init(d)
    keys = jax.random.split(key, 3)
    return {name: base[name] * (1.0 + spread * _standard_normal_flat(k, base[name].shape))
            for name, k in zip(("a", "b", "c"), keys)}


def _standard_normal_flat(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.normal(key, shape)`` f32 (the same values: a draw is row-major), drawn as one row and reshaped.

    XLA compiles a threefry + normal program per call site, and on the CPU a small 2-D one such as ``(d / 32, 5)``
    compiles several times more slowly than the same elements drawn as one row."""
    return jax.random.normal(key, (int(np.prod(shape)),), jnp.float32).reshape(shape)


def lowrank_factors(w_tilde: jax.Array, key: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    """``(L (o, r), R (r, d))`` from a one-pass randomized range finder of ``w_tilde (o, d)``: ``L = Q``, ``R = Q^T W~``
    with ``Q`` an orthonormal basis of ``W~ Omega`` (LoRaQ's factors come from calibration; this is a stand-in)."""
    omega = jax.random.normal(key, (w_tilde.shape[1], rank), jnp.float32)  # (d, r)
    basis, _ = jnp.linalg.qr(jnp.matmul(w_tilde, omega, precision="highest"))  # (o, r)
    return basis, jnp.matmul(basis.T, w_tilde, precision="highest")


def qlinear_from_factors(w: jax.Array, params: dict, left: jax.Array, right: jax.Array) -> QuantizedLinear:
    """``build_qlinear(w, transform="kron_lu", transform_params=params, lowrank=(left, right))`` (LoRaQ: factors
    stored in MXFP4, the residual computed against the stored branch), bit for bit, but traceable (no host-side
    checks), so it runs under ``jit`` / ``lax.map`` on the device. ``w (o, d)``, ``left (o, r)``, ``right (r, d)``."""
    p = transforms.get("kron_lu")
    fmt = MXFP4()
    o, d = w.shape
    left_q, right_q = _quantize_blocks_together((left, right), fmt)
    w_t = transforms.apply_to_weights(jnp.asarray(w, jnp.float32), p.inverse_blocks(params))
    w_t = w_t - jnp.matmul(dequantize(left_q, jnp.float32), dequantize(right_q, jnp.float32), precision="highest")
    cfg = QLinearConfig(in_features=d, out_features=o, transform="kron_lu", act_fmt=fmt, rank=left.shape[1])
    return QuantizedLinear(blocks=p.blocks(params), transform_params=params, weight=quantize(w_t, fmt),
                           lowrank_left=left_q, lowrank_right=right_q, bias=None, config=cfg)


def _quantize_blocks_together(arrays: tuple[jax.Array, ...], fmt: QuantFormat) -> list[QuantizedArray]:
    """``[quantize(a, fmt) for a in arrays]`` (each ``(..., d_i)``, ``d_i`` a multiple of the block), bit for bit, as
    one quantization of all their blocks ``(sum of blocks, block)``: without a per-tensor scale each block is scaled
    on its own, so one quantizer program serves all the arrays. Arrays of mixed dtypes or of a last axis that is not
    a multiple of the block (``quantize`` raises for them), or a format with a per-tensor scale (which spans the
    whole array), are quantized one by one."""
    block = fmt.block_size
    if fmt.has_tensor_scale or len({np.dtype(a.dtype) for a in arrays}) > 1 or any(a.shape[-1] % block
                                                                                    for a in arrays):
        return [quantize(a, fmt) for a in arrays]
    blocks = [a.reshape(-1, block) for a in arrays]  # (blocks of a, block) each
    joint = quantize(jnp.concatenate(blocks, axis=0), fmt)  # codes (total, block / 2), scales (total, 1)
    starts = np.cumsum([0] + [b.shape[0] for b in blocks]).tolist()
    return [QuantizedArray(codes=joint.codes[lo:hi].reshape(*a.shape[:-1], a.shape[-1] // 2),
                           scales=joint.scales[lo:hi].reshape(*a.shape[:-1], a.shape[-1] // block),
                           tensor_scale=joint.tensor_scale, fmt=fmt, dtype=joint.dtype)
            for a, lo, hi in zip(arrays, starts[:-1], starts[1:])]


def random_qlinear(w: jax.Array, key: jax.Array, rank: int) -> QuantizedLinear:
    """A W4A4 layer of ``w (o, d)`` with the real layer math and stand-in calibration (traceable): a random KroQuant
    transform (:func:`random_kron_params`), rank-``rank`` factors of ``W~ = W T^{-T}`` (:func:`lowrank_factors`),
    :func:`qlinear_from_factors`."""
    k_t, k_lr = jax.random.split(key)
    params = random_kron_params(k_t, w.shape[1])
    w_tilde = transforms.apply_to_weights(w, transforms.get("kron_lu").inverse_blocks(params))
    left, right = lowrank_factors(w_tilde, k_lr, rank)
    return qlinear_from_factors(w, params, left, right)


# ---------------------------------------------------------------------------------------------------------------------
# Serialisation: a flat {key: numpy array} state plus a JSON description.
# ---------------------------------------------------------------------------------------------------------------------


def _qa_state(prefix: str, q: QuantizedArray, state: dict) -> dict:
    state[f"{prefix}.codes"] = np.asarray(q.codes)
    scales = np.asarray(q.scales)
    state[f"{prefix}.scales"] = scales.view(np.uint8) if scales.dtype != np.uint8 else scales
    state[f"{prefix}.tensor_scale"] = np.asarray(q.tensor_scale, np.float32).reshape(1)
    return {"fmt": q.fmt.to_json(), "dtype": np.dtype(q.dtype).name, "scales_dtype": scales.dtype.name}


def _qa_from_state(prefix: str, meta: dict, state: Mapping[str, np.ndarray]) -> QuantizedArray:
    import ml_dtypes  # noqa: F401 - registers float8 dtype names with numpy

    scales = np.asarray(state[f"{prefix}.scales"])
    if meta["scales_dtype"] != "uint8":
        scales = scales.view(np.dtype(getattr(ml_dtypes, meta["scales_dtype"])))
    return QuantizedArray(codes=jnp.asarray(state[f"{prefix}.codes"]), scales=jnp.asarray(scales),
                          tensor_scale=jnp.asarray(np.asarray(state[f"{prefix}.tensor_scale"]).reshape(()),
                                                   jnp.float32),
                          fmt=QuantFormat.from_json(meta["fmt"]), dtype=np.dtype(meta["dtype"]))


def to_state(layer: QuantizedLinear) -> tuple[dict, dict]:
    """``(arrays {key: np.ndarray}, metadata dict (JSON-able))`` describing ``layer`` completely."""
    cfg = layer.config
    state = {"blocks": np.asarray(layer.blocks, np.float32)}
    meta = {"config": {"in_features": cfg.in_features, "out_features": cfg.out_features, "transform": cfg.transform,
                       "act_fmt": cfg.act_fmt.to_json(), "rank": cfg.rank, "ste": cfg.ste,
                       "input_pad": cfg.input_pad},
            "weight": _qa_state("weight", layer.weight, state), "has_params": layer.transform_params is not None,
            "has_bias": layer.bias is not None, "lowrank": None}
    if layer.transform_params is not None:
        for i, leaf in enumerate(jax.tree.leaves(layer.transform_params)):
            state[f"transform_params.{i}"] = np.asarray(leaf)
    if layer.bias is not None:
        state["bias"] = np.asarray(layer.bias, np.float32)
    if layer.lowrank_left is not None:
        if layer.lowrank_quantized:
            meta["lowrank"] = {"quantized": True, "left": _qa_state("lowrank_left", layer.lowrank_left, state),
                               "right": _qa_state("lowrank_right", layer.lowrank_right, state)}
        else:
            meta["lowrank"] = {"quantized": False}
            state["lowrank_left"] = np.asarray(layer.lowrank_left, np.float32)
            state["lowrank_right"] = np.asarray(layer.lowrank_right, np.float32)
    return state, meta


def state_keys(meta: dict) -> set[str]:
    """The array keys :func:`to_state` writes for a layer of metadata ``meta`` (what :func:`from_state` reads)."""
    def qa(prefix):
        return {f"{prefix}.codes", f"{prefix}.scales", f"{prefix}.tensor_scale"}

    keys = {"blocks"} | qa("weight")
    if meta["has_params"]:
        template = transforms.get(meta["config"]["transform"]).init(meta["config"]["in_features"])
        keys |= {f"transform_params.{i}" for i in range(len(jax.tree.leaves(template)))}
    if meta["has_bias"]:
        keys.add("bias")
    lr = meta["lowrank"]
    if lr is not None:
        keys |= (qa("lowrank_left") | qa("lowrank_right")) if lr["quantized"] else {"lowrank_left", "lowrank_right"}
    return keys


def _check_state(state: Mapping[str, np.ndarray], meta: dict) -> None:
    """Raises ValueError naming the key when ``state`` is not what :func:`to_state` writes for ``meta``: a missing or
    unknown key, or a packed array whose shape or dtype disagrees with the layer's width and format."""
    expected = state_keys(meta)
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise ValueError(f"layer arrays: missing {missing}, unknown {unknown}")
    o, d = meta["config"]["out_features"], meta["config"]["in_features"]

    def packed(prefix, array_meta, rows=None, cols=None):
        codes, scales = np.asarray(state[f"{prefix}.codes"]), np.asarray(state[f"{prefix}.scales"])
        block = QuantFormat.from_json(array_meta["fmt"]).block_size
        if codes.dtype != np.uint8 or codes.ndim != 2 or scales.ndim != 2:
            raise ValueError(f"{prefix}.codes: expected uint8 (rows, cols/2) with 2-D scales, got {codes.dtype} "
                             f"{codes.shape} and scales {scales.shape}")
        want = (codes.shape[0] if rows is None else rows, codes.shape[1] if cols is None else cols // 2)
        if codes.shape != want or scales.shape != (want[0], want[1] * 2 // block):
            raise ValueError(f"{prefix}: codes {codes.shape} and scales {scales.shape}, expected {want} and "
                             f"{(want[0], want[1] * 2 // block)} (out_features={o}, in_features={d})")

    packed("weight", meta["weight"], o, d)
    blocks = np.asarray(state["blocks"])
    if blocks.ndim != 3 or blocks.shape[1] != blocks.shape[2] or blocks.shape[0] * blocks.shape[1] != d:
        raise ValueError(f"blocks: shape {blocks.shape}, expected (d/n, n, n) with d = in_features = {d}")
    if meta["has_bias"] and np.asarray(state["bias"]).shape != (o,):
        raise ValueError(f"bias: shape {np.asarray(state['bias']).shape}, expected ({o},)")
    lr = meta["lowrank"]
    if lr is not None and lr["quantized"]:
        packed("lowrank_left", lr["left"], o)
        packed("lowrank_right", lr["right"], None, d)


def from_state(state: Mapping[str, np.ndarray], meta: dict) -> QuantizedLinear:
    """Inverse of :func:`to_state`; a state that is not what :func:`to_state` writes for ``meta`` (missing or unknown
    keys, packed arrays of another shape or dtype) raises ValueError naming the key."""
    _check_state(state, meta)
    c = meta["config"]
    cfg = QLinearConfig(in_features=c["in_features"], out_features=c["out_features"], transform=c["transform"],
                        act_fmt=QuantFormat.from_json(c["act_fmt"]), rank=c["rank"], ste=c["ste"],
                        input_pad=c.get("input_pad", 0))
    params = None
    if meta["has_params"]:
        template = transforms.get(cfg.transform).init(cfg.in_features)
        leaves, treedef = jax.tree.flatten(template)
        params = jax.tree.unflatten(treedef, [jnp.asarray(state[f"transform_params.{i}"])
                                              for i in range(len(leaves))])
    left = right = None
    lr = meta["lowrank"]
    if lr is not None:
        if lr["quantized"]:
            left = _qa_from_state("lowrank_left", lr["left"], state)
            right = _qa_from_state("lowrank_right", lr["right"], state)
        else:
            left, right = jnp.asarray(state["lowrank_left"]), jnp.asarray(state["lowrank_right"])
    return QuantizedLinear(blocks=jnp.asarray(state["blocks"]), transform_params=params,
                           weight=_qa_from_state("weight", meta["weight"], state), lowrank_left=left,
                           lowrank_right=right, bias=jnp.asarray(state["bias"]) if meta["has_bias"] else None,
                           config=cfg)


def save_qlinear(path: str, layer: QuantizedLinear, extra_metadata: Optional[dict] = None) -> None:
    """Writes one layer to a ``.safetensors`` file atomically (temp file + rename)."""
    from safetensors.numpy import save

    state, meta = to_state(layer)
    if extra_metadata:
        meta["extra"] = extra_metadata
    data = save({k: np.ascontiguousarray(v) for k, v in state.items()}, metadata={"qlinear": json.dumps(meta)})
    atomic_write_bytes(path, data)


def load_qlinear(path: str) -> tuple[QuantizedLinear, dict]:
    """Reads a layer written by :func:`save_qlinear`; returns ``(layer, extra_metadata)``; a truncated or foreign
    file raises ValueError naming it."""
    from safetensors import SafetensorError

    with _open_stored_layer(path) as f:
        meta = _layer_metadata(f, path)
        try:
            state = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as err:
            raise _unreadable_layer(path, err) from None
    return from_state(state, meta), meta.get("extra", {})


def _unreadable_layer(path: str, err: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable stored layer ({err}); delete it to recompute that layer")


def _open_stored_layer(path: str):
    """``safe_open(path)``, a truncated or foreign file refused naming it (safetensors' own error names none)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as err:
        raise _unreadable_layer(path, err) from None


def _layer_metadata(f, path: str) -> dict:
    """The ``qlinear`` metadata of an open stored layer, or ValueError naming ``path``."""
    try:
        meta = json.loads((f.metadata() or {})["qlinear"])
    except (KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a layer written by save_qlinear (no readable 'qlinear' metadata: "
                         f"{type(err).__name__})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a layer written by save_qlinear ('qlinear' metadata is not an object)")
    return meta


def _file_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return f"{safe}-{abs(hash_name(name)):08x}.safetensors"


def hash_name(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode("utf-8"))


class QLinearStore:
    """A folder of calibrated layers, one atomic ``.safetensors`` file each, each with the fingerprint of its inputs.

    Resuming (skip the layers already stored) is only safe when a stored layer was computed from the same inputs:
    :meth:`save` stores a fingerprint (:func:`kroquant_jax.provenance.layer_fingerprint`: hashes of the weight, bias,
    activation rows, the recipe's settings, the numerics version) beside the layer and :meth:`load` / :meth:`verify`
    refuse a stored layer whose fingerprint differs from the current one with a
    :class:`~kroquant_jax.provenance.StaleResultError` that names the layer and what changed.

    >>> store = QLinearStore("runs/pixart_kroquant")
    >>> fp = provenance.layer_fingerprint(w, b, a, recipe)
    >>> store.save(name, layer, {"heldout_error": 0.12}, fingerprint=fp)
    >>> layer, extra = store.load(name, fingerprint=fp)   # raises StaleResultError if the inputs changed
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, _file_name(name))

    def __contains__(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def save(self, name: str, layer: QuantizedLinear, extra_metadata: Optional[dict] = None,
             fingerprint: Optional[dict] = None) -> None:
        """Stores ``layer`` (replacing a stored one) with ``extra_metadata`` and its inputs' ``fingerprint``."""
        extra = {"name": name, **(extra_metadata or {})}
        if fingerprint is not None:
            extra["fingerprint"] = fingerprint
        save_qlinear(self.path(name), layer, extra)

    def changes(self, name: str, fingerprint: Mapping[str, Any]) -> list[str]:
        """What differs between the stored layer's fingerprint and ``fingerprint`` (only the keys it has; a partial
        fingerprint without ``activations`` checks the weight and recipe before a capture); ``[]`` if they match."""
        from kroquant_jax import provenance

        with _open_stored_layer(self.path(name)) as f:
            extra = _layer_metadata(f, self.path(name)).get("extra", {})
        return provenance.describe_changes(extra.get("fingerprint"), fingerprint)

    def verify(self, fingerprints: Mapping[str, Mapping[str, Any]]) -> int:
        """Checks every stored layer named in ``fingerprints``; returns how many are stored (and match).

        Raises:
          StaleResultError: for the first stored layer whose fingerprint differs (the message counts the others).
        """
        from kroquant_jax import provenance

        stale, stored = [], 0
        for name, fingerprint in fingerprints.items():
            if name in self:
                stored += 1
                changes = self.changes(name, fingerprint)
                if changes:
                    stale.append((name, changes))
        if stale:
            name, changes = stale[0]
            others = f"; {len(stale) - 1} more stored layer(s) differ too" if len(stale) > 1 else ""
            raise provenance.StaleResultError(name, [", ".join(changes) + others], self.directory)
        return stored

    def load(self, name: str, fingerprint: Optional[Mapping[str, Any]] = None) -> tuple[QuantizedLinear, dict]:
        """The stored layer and its extra metadata; with ``fingerprint``, refuses a layer computed from other inputs.

        Raises:
          KeyError: ``name`` is not stored.
          StaleResultError: its stored fingerprint differs from ``fingerprint``.
        """
        if name not in self:
            raise KeyError(f"layer {name!r} is not in the store {self.directory!r}")
        if fingerprint is not None:
            self.verify({name: fingerprint})
        return load_qlinear(self.path(name))

    def names(self) -> list[str]:
        out = []
        for f in sorted(os.listdir(self.directory)):
            if f.endswith(".safetensors") and not f.startswith(".tmp-") and not f.startswith("."):
                _, extra = load_qlinear(os.path.join(self.directory, f))
                out.append(extra["name"])
        return out

    def load_all(self) -> dict[str, QuantizedLinear]:
        return {n: self.load(n)[0] for n in self.names()}


def save_orbax(path: str, layers: Mapping[str, QuantizedLinear]) -> None:
    """Saves ``{name: QuantizedLinear}`` as one orbax checkpoint at ``path`` (orbax writes to a temporary folder and
    renames it when complete, so a crash never leaves a half checkpoint under ``path``)."""
    import orbax.checkpoint as ocp

    tree, metas = {}, {}
    for i, (name, layer) in enumerate(layers.items()):
        state, meta = to_state(layer)
        tree[f"layer{i}"] = state
        metas[f"layer{i}"] = {"name": name, "meta": meta}
    tree["meta_json"] = np.frombuffer(json.dumps(metas).encode("utf-8"), np.uint8).copy()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), tree)
        ckptr.wait_until_finished()


def restore_orbax(path: str) -> dict[str, QuantizedLinear]:
    """Restores what :func:`save_orbax` wrote."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.abspath(path))
    metas = json.loads(np.asarray(tree["meta_json"]).tobytes().decode("utf-8"))
    return {m["name"]: from_state({k: np.asarray(v) for k, v in tree[key].items()}, m["meta"])
            for key, m in metas.items()}
