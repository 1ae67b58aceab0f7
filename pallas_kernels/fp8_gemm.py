"""The W4A4 layer on Hopper's FP8 tensor cores: MXFP4 operands re-encoded exactly as E4M3, one XLA FP8 GEMM.

An MXFP4 row (activations or weights) is E4M3 bytes times one power of two per row, bit for bit, whenever its block
exponents span at most 14 binades (:mod:`kroquant_jax.fp8_encoding`). Then

    Q(x T) Q(W~)^T = diag(2**e_a) (A8 W8^T) diag(2**e_w)

with ``A8 (m, d)``, ``W8 (o, d)`` E4M3: one FP8 ``dot_general`` (``preferred_element_type=float32``; XLA lowers it to a
cuBLASLt FP8 GEMM on Hopper) and an epilogue fusion that applies the outer product of the two power-of-two vectors,
adds the low-rank branch ``h L^T`` (``h = x (R T^T)^T``, bf16, a small GEMM) and the bias, and rounds to the output
dtype. The products of two E4M3 values of re-encoded MXFP4 rows have at most 4 significant bits and are exact in
f32, so with an f32 accumulator the result equals the exact eq. 11 product of the MXFP4 values up to the order of the
fp32 additions (``<= (d + r) 2**-24 P``, ``P = |A| |W|^T + |h| |L|^T``) and the output rounding, as the dequant
strategy's. Hopper's FP8 MMA accumulator keeps fewer bits than fp32; ``accumulation`` selects XLA's precise (partial
sums promoted to fp32 by the GEMM library) or fast mode, and ``k_split`` sums K chunks in f32 outside the GEMM.

Weights are re-encoded once, at preparation (:func:`prepare_weight`): E4M3 bytes + one f32 per output row, ``o (d + 4)``
bytes, against MXFP4's packed ``o d (1/2 + 1/32)`` (``weight_storage="mxfp4"`` keeps that and re-encodes per call, an
XLA fusion). Activations: the fused transform + MXFP4 quantize kernel in its FP8 output mode
(``transform_quantize.transform_quantize_fp8``: the quantizer writes the E4M3 bytes and the row powers of two itself,
in two launches, ``act_encode="kernel"``, or in one, ``"one_launch"``), or the kernel's packed MXFP4 output
re-encoded by one Pallas kernel
(``act_encode="two_phase"``) or by an XLA fusion (``act_encode="xla"``); every way gives the GEMM the same bytes.
W4A8 (``act="fp8"``): ``x T`` in f32 (XLA) and per-token E4M3 (``amax / 448``), no MXFP4 step.

Out-of-range rows (span > 14 binades) are rounded to the nearest E4M3 value with a stated bound (see
``fp8_encoding``); ``return_inexact=True`` returns the number of affected elements beside the output.
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType
from typing import Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import fp8_encoding as FE
from kroquant_jax.formats import MXFP4, QuantizedArray, dequantize
from kroquant_jax.fp8_encoding import Fp8Rows
from pallas_kernels import served
from pallas_kernels import fp8_gemm_mgpu as MG
from pallas_kernels.fp8_gemm_mgpu import fp8_matmul_mgpu, prescale_left
from pallas_kernels import transform_quantize as tq
from pallas_kernels.epilogues import rmsnorm_heads
from pallas_kernels.w4a4_gemm import dequantize_bf16, lowrank_h

__all__ = [
    "ACCUMULATIONS",
    "ACTIVATIONS",
    "ACT_ENCODES",
    "DEFAULT_ACT_ENCODE",
    "GEMMS",
    "Fp8Linear",
    "Fp8MgpuStrategy",
    "Fp8Strategy",
    "Fp8W4A8Strategy",
    "fp8_linear_forward",
    "fp8_linear_reference",
    "fp8_matmul",
    "fp8_matmul_reference",
    "operand_order",
    "prepare_fp8_layer",
    "prepare_weight",
    "weight_nbytes",
]

Accumulation = Literal["default", "precise", "fast"]
#: ``"default"``: no algorithm requested (XLA's choice; the only one XLA:CPU accepts); ``"precise"``: the
#: ``ANY_F8_ANY_F8_F32`` preset (fp32 accumulation, the GEMM library promotes partial sums); ``"fast"``:
#: ``ANY_F8_ANY_F8_F32_FAST_ACCUM`` (Hopper's FP8 accumulator throughout).
ACCUMULATIONS = ("default", "precise", "fast")
#: ``"mxfp4"``: W4A4 (MXFP4 activations re-encoded in E4M3); ``"fp8"``: W4A8 (per-token E4M3 activations).
ACTIVATIONS = ("mxfp4", "fp8")
#: How W4A4 activations reach the FP8 GEMM: ``"kernel"``: the quantizer's FP8 output mode writes E4M3 + row powers of
#: two (a pre-pass for the rows' reference exponents, then one quantizing pass); ``"one_launch"``: the same in one
#: launch of whole-row programs (``transform_quantize_fp8(..., one_launch=True)``); ``"two_phase"``: the quantizer writes
#: packed MXFP4, one Pallas kernel re-encodes it (``transform_quantize.reencode_e4m3``); ``"xla"``: the same re-encode
#: as an XLA fusion (``fp8_encoding.mxfp4_to_e4m3``). The same bytes every way. The default is the way measured
#: fastest (docs/w4a4.md, "The quantizer emits FP8"); the others are opt-in.
ACT_ENCODES = ("kernel", "one_launch", "two_phase", "xla")
DEFAULT_ACT_ENCODE = "xla"
#: The GEMM of a layer: ``"xla"``: XLA's FP8 ``dot_general`` (cuBLASLt) with the epilogue and the low-rank GEMM as XLA
#: ops; ``"mgpu"``: one Mosaic GPU kernel with the powers of two, the bias and ``h L^T`` in its epilogue
#: (:mod:`pallas_kernels.fp8_gemm_mgpu`; its jnp mirror off the GPU).
GEMMS = ("xla", "mgpu")
Operand = Union[QuantizedArray, Fp8Rows]


def _algorithm(accumulation: str):
    if accumulation == "default":
        return None
    if accumulation == "precise":
        return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    if accumulation == "fast":
        return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
    raise ValueError(f"accumulation={accumulation!r} must be one of {ACCUMULATIONS}")


def _as_rows(x: Operand, what: str, order: str, count: bool) -> Fp8Rows:
    if isinstance(x, Fp8Rows):
        if x.order != order:
            raise ValueError(f"fp8_matmul: {what} is in column order {x.order!r}, the other operand in {order!r}; both "
                             f"operands of the GEMM must share one K order")
        return x
    if isinstance(x, QuantizedArray):
        return FE.mxfp4_to_e4m3(x, order=order, count_inexact=count)  # raises for NVFP4
    raise TypeError(f"fp8_matmul: {what} must be an MXFP4 QuantizedArray or Fp8Rows, got {type(x).__name__}")


def operand_order(w: Operand) -> str:
    """The K order a GEMM with weight ``w`` runs in: a re-encoded weight's own, ``"even_odd"`` for a packed one (the
    cheaper re-encode: no nibble interleave)."""
    return w.order if isinstance(w, Fp8Rows) else "even_odd"


def prepare_weight(w: QuantizedArray, *, storage: Literal["e4m3", "mxfp4"] = "e4m3",
                   order: str = "even_odd") -> Operand:
    """A packed MXFP4 weight ``(o, d)`` for :func:`fp8_matmul`: re-encoded once (``"e4m3"``: :class:`Fp8Rows`,
    ``o (d + 4)`` bytes, in K order ``order``) or kept packed (``"mxfp4"``: ``o d (1/2 + 1/32)`` bytes, re-encoded in
    every call)."""
    if not isinstance(w, QuantizedArray) or not isinstance(w.fmt, MXFP4) or len(w.shape) != 2:
        raise TypeError(f"prepare_weight: needs a 2-D MXFP4 QuantizedArray, got {getattr(w, 'fmt', type(w).__name__)!r}"
                        f" of shape {getattr(w, 'shape', None)}")
    if storage == "e4m3":  # an all-zero row's factor 0, so the fused kernel's L / sw stays finite there
        return FE.mxfp4_to_e4m3(w, order=order).with_zero_row_factors()
    if storage == "mxfp4":
        return w
    raise ValueError(f"storage={storage!r} must be 'e4m3' or 'mxfp4'")


def weight_nbytes(w: Operand) -> int:
    """Bytes a prepared weight occupies (E4M3: 1 per element + 4 per row; MXFP4: codes + E8M0 scales + 4)."""
    return int(w.nbytes)


def _dot_nt(a: jax.Array, w: jax.Array, accumulation: str, gemm_dtype) -> jax.Array:
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=_algorithm(accumulation),
                               preferred_element_type=gemm_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "accumulation", "gemm_dtype", "k_split", "return_inexact"))
def fp8_matmul(a: Operand, w: Operand, *, lowrank: Optional[tuple] = None, bias: Optional[jax.Array] = None,
               out_dtype=jnp.bfloat16, accumulation: Accumulation = "default", gemm_dtype=jnp.float32,
               k_split: Optional[int] = None, return_inexact: bool = False):
    """``A W^T [+ h L^T] [+ bias]`` for MXFP4 (or already re-encoded) operands on the FP8 tensor cores.

    Args:
      a: activations ``(m, d)``: a packed MXFP4 ``QuantizedArray`` (re-encoded here) or :class:`Fp8Rows` (e.g.
        :func:`~kroquant_jax.fp8_encoding.per_token_e4m3` for W4A8).
      w: weights ``(n, d)``: from :func:`prepare_weight` (or a packed MXFP4 ``QuantizedArray``).
      lowrank: ``(h (m, r), L (n, r))``, ``L`` bf16/f32 or packed MXFP4 with ``h``'s columns in
        :func:`~pallas_kernels.w4a4_gemm.even_odd_permutation` order (the served layer's convention); a bf16 GEMM
        added in the epilogue.
      bias: ``(n,)``, added in f32.
      out_dtype: bf16 (default) or f32.
      accumulation: see :data:`ACCUMULATIONS` (``"precise"`` / ``"fast"`` are GPU-only: XLA:CPU rejects them).
      gemm_dtype: the FP8 GEMM's output dtype: f32 (default: one rounding, the exactness contract above) or bf16
        (the GEMM writes half the bytes; one more rounding before the epilogue: ``2**-9 |out|``).
      k_split: sum ``d / k_split`` chunks of K in f32 outside the GEMM (promotes partial sums); ``d % k_split == 0``.
      return_inexact: also return the number of operand elements the out-of-range policy rounded (``int32 ()``; -1
        if an operand came re-encoded without its count). Without it the activations' count is not computed.

    Returns:
      ``(m, n)`` in ``out_dtype`` (and the count).
    """
    order = operand_order(w) if not isinstance(w, QuantizedArray) or not isinstance(a, Fp8Rows) else a.order
    ar, wr = _as_rows(a, "a", order, return_inexact), _as_rows(w, "w", order, return_inexact)
    if ar.group is not None or wr.group is not None:
        raise ValueError("fp8_matmul: operands with scales per row group are taken by "
                         "fp8_gemm_mgpu.fp8_matmul_mgpu only; re-encode with one scale per row (group=None)")
    if ar.values.ndim != 2 or wr.values.ndim != 2 or ar.shape[1] != wr.shape[1]:
        raise ValueError(f"fp8_matmul: a {ar.shape} and w {wr.shape} must be (m, d) and (n, d)")
    (m, d), n = ar.shape, wr.shape[0]
    if gemm_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"gemm_dtype={gemm_dtype!r} must be float32 or bfloat16")
    if k_split is None:
        acc = _dot_nt(ar.values, wr.values, accumulation, gemm_dtype).astype(jnp.float32)
    else:
        if k_split <= 0 or d % k_split:
            raise ValueError(f"k_split={k_split} must be a positive divisor of d={d}")
        s = d // k_split
        parts = jax.lax.dot_general(ar.values.reshape(m, s, k_split), wr.values.reshape(n, s, k_split),
                                    (((2,), (2,)), ((1,), (1,))), precision=_algorithm(accumulation),
                                    preferred_element_type=gemm_dtype)  # (s, m, n)
        acc = jnp.sum(parts.astype(jnp.float32), axis=0)
    y = acc * ar.scale[:, None] * wr.scale[None, :]  # powers of two for MXFP4 rows: exact
    if lowrank is not None:
        h, left = lowrank
        if h.ndim != 2 or h.shape[0] != m or left.shape[0] != n or h.shape[1] != left.shape[1]:
            raise ValueError(f"fp8_matmul: lowrank=(h {h.shape}, L {left.shape}) must be (m={m}, r), (n={n}, r)")
        if isinstance(left, QuantizedArray):
            left = dequantize_bf16(left, order="even_odd")
        y = y + jnp.dot(h.astype(jnp.bfloat16), jnp.asarray(left).astype(jnp.bfloat16).T,
                        preferred_element_type=jnp.float32)
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"fp8_matmul: bias {bias.shape} must be ({n},)")
        y = y + bias.astype(jnp.float32)
    y = y.astype(out_dtype)
    if return_inexact:
        counted = (ar.inexact >= 0) & (wr.inexact >= 0)
        return y, jnp.where(counted, ar.inexact + wr.inexact, -1)
    return y


def fp8_matmul_reference(a: Operand, w: Operand, *, lowrank: Optional[tuple] = None,
                         bias: Optional[jax.Array] = None) -> np.ndarray:
    """Eq. 11 exactly, in float64 on the host: the operands' values (MXFP4: ``formats.dequantize``; :class:`Fp8Rows`:
    ``values * scale``) multiplied and summed in float64, ``+ h L^T + bias``. ``(m, n)`` float64."""
    def dense(x):
        if isinstance(x, Fp8Rows):  # values times their row's (row group's) factor, in natural column order
            scale = jnp.asarray(x.scale, jnp.float32)
            factor = scale[..., None] if x.group is None else FE.natural_columns(
                jnp.repeat(scale, x.group, axis=-1), x.order)
            return (np.asarray(FE.natural_columns(x.values, x.order).astype(jnp.float32), np.float64)
                    * np.asarray(factor, np.float64))
        if isinstance(x, QuantizedArray):
            return np.asarray(dequantize(x, jnp.float32), np.float64)
        return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)

    y = dense(a) @ dense(w).T
    if lowrank is not None:
        h, left = lowrank
        left = dequantize_bf16(left, order="even_odd") if isinstance(left, QuantizedArray) else left
        y = y + dense(jnp.asarray(h).astype(jnp.bfloat16)) @ dense(jnp.asarray(left).astype(jnp.bfloat16)).T
    if bias is not None:
        y = y + dense(bias)[None, :]
    return y


# ---------------------------------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("transform", "weight", "right", "left", "bias", "left_over_scale"),
                   meta_fields=("act", "swiglu_rows", "act_encode", "swiglu_group"))
@dataclasses.dataclass(frozen=True)
class Fp8Linear:
    """A served W4A4 layer prepared for the FP8 GEMM (a pytree; stack it for ``lax.scan``).

    Attributes:
      transform: the online ``T`` (``transform_quantize.PreparedTransform``).
      weight: ``Q(W~ - L R)`` ``(o, d)``: :class:`Fp8Rows` (re-encoded once) or packed MXFP4 (re-encoded per call).
      right: ``R T^T`` ``(r, d)`` bf16 or None (as the served layer holds it).
      left: ``L`` ``(o, r)`` bf16 (decoded once; columns in the order of ``right``'s rows) or None.
      bias: ``(o,)`` f32 or None.
      act: ``"mxfp4"`` (W4A4) or ``"fp8"`` (W4A8) (static).
      swiglu_rows: rows in gate/up pairs (static).
      act_encode: W4A4 only, one of :data:`ACT_ENCODES` (static).
      left_over_scale: ``L / sw`` ``(o, r)`` bf16, the fused kernel's low-rank operand
        (``fp8_gemm_mgpu.prescale_left``), made once by the ``"fp8_mgpu"`` strategy's preparation (``o r`` bf16 more
        memory, one elementwise pass less per call); None elsewhere.
      swiglu_group: 0 (a ``swiglu_rows`` layer's rows in gate/up pairs) or G: rows in groups of G, gates then ups
        (``fp8_gemm_mgpu.swiglu_halves_order``), the order the fused kernel's SwiGLU epilogue reads (static; set by
        the ``"fp8_mgpu"`` strategy's preparation, runs only with ``gemm="mgpu"``).
    """

    transform: tq.PreparedTransform
    weight: Operand
    right: Optional[jax.Array]
    left: Optional[jax.Array]
    bias: Optional[jax.Array]
    act: str = "mxfp4"
    swiglu_rows: bool = False
    act_encode: str = DEFAULT_ACT_ENCODE
    left_over_scale: Optional[jax.Array] = None
    swiglu_group: int = 0

    def __post_init__(self):
        if self.act_encode not in ACT_ENCODES:
            raise ValueError(f"Fp8Linear: act_encode={self.act_encode!r} must be one of {ACT_ENCODES}")

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]


def prepare_fp8_layer(served, *, act: Literal["mxfp4", "fp8"] = "mxfp4",
                      weight_storage: Literal["e4m3", "mxfp4"] = "e4m3",
                      act_encode: str = DEFAULT_ACT_ENCODE) -> Fp8Linear:
    """An :class:`Fp8Linear` from a served layer (``pallas_kernels.served.serve``'s result: ``transform``,
    ``weight`` packed MXFP4, ``right``, ``left``, ``bias``, ``act_fmt``, ``swiglu_rows``), once, at load time.
    ``act_encode``: see :data:`ACT_ENCODES`."""
    if act not in ACTIVATIONS:
        raise ValueError(f"prepare_fp8_layer: act={act!r} must be one of {ACTIVATIONS}")
    if act_encode not in ACT_ENCODES:
        raise ValueError(f"prepare_fp8_layer: act_encode={act_encode!r} must be one of {ACT_ENCODES}")
    wfmt = getattr(served.weight, "fmt", None)
    if not isinstance(wfmt, MXFP4) or (act == "mxfp4" and not isinstance(served.act_fmt, MXFP4)):
        raise TypeError(f"prepare_fp8_layer: layer ({served.out_features}, {served.in_features}) has weight format "
                        f"{wfmt!r} / activation format {served.act_fmt!r}; the FP8 strategy needs MXFP4 (NVFP4 values "
                        f"e2m1 * e4m3 are not exact in E4M3: use the dequant strategy)")
    left = served.left
    if isinstance(left, QuantizedArray):
        left = dequantize_bf16(left, order="even_odd")  # matches right's even/odd row order
    elif left is not None:
        left = jnp.asarray(left).astype(jnp.bfloat16)
    return Fp8Linear(transform=served.transform, weight=prepare_weight(served.weight, storage=weight_storage),
                     right=served.right, left=left, bias=served.bias, act=act, swiglu_rows=bool(served.swiglu_rows),
                     act_encode=act_encode)


def _check_op(layer: Fp8Linear, op: str, norm_weight, head_dim) -> None:
    if op not in ("none", "rmsnorm", "swiglu"):
        raise ValueError(f"op={op!r} must be 'none', 'rmsnorm' or 'swiglu'")
    if (op == "swiglu") != layer.swiglu_rows:
        raise ValueError(f"op={op!r} on a layer with swiglu_rows={layer.swiglu_rows}: only the SwiGLU op takes (and "
                         f"needs) a layer prepared with serve_qlinear(swiglu=True)")
    if op == "rmsnorm" and (norm_weight is None or head_dim is None or norm_weight.shape != (head_dim,)
                            or layer.out_features % head_dim):
        raise ValueError(f"rmsnorm: norm_weight {None if norm_weight is None else norm_weight.shape} must be "
                         f"(head_dim,) = ({head_dim},), and head_dim must divide out_features={layer.out_features}")


def _activations(layer: Fp8Linear, x2: jax.Array, impl: str, quant_blocks=None, count: bool = False) -> Operand:
    """The GEMM's activation operand: per-token E4M3 (W4A8), the quantizer's FP8 rows (``act_encode="kernel"`` /
    ``"one_launch"``), its
    MXFP4 re-encoded by the Pallas kernel (``"two_phase"``), or its packed MXFP4 (``"xla"``: ``fp8_matmul``
    re-encodes). ``count``: the FP8 rows carry the out-of-range count (from the MXFP4 result)."""
    if layer.act == "fp8":
        xt = tq.reference_apply(x2.astype(jnp.float32), layer.transform)  # (m, d) f32, XLA
        return FE.per_token_e4m3(xt, order=operand_order(layer.weight))
    if layer.act_encode != "xla" and operand_order(layer.weight) != "even_odd":
        raise ValueError(f"fp8 linear ({layer.out_features}, {layer.in_features}): act_encode={layer.act_encode!r} "
                         f"writes the activations in 'even_odd' K order, the weight is in "
                         f"{operand_order(layer.weight)!r}; prepare the weight with order='even_odd' or use "
                         f"act_encode='xla'")
    if layer.act_encode in ("kernel", "one_launch"):
        out = tq.transform_quantize_fp8(x2, layer.transform, MXFP4(), with_mxfp4=count, block_sizes=quant_blocks,
                                        impl=impl, round_to_input=False, one_launch=layer.act_encode == "one_launch")
        if not count:
            return out
        rows, q = out
        return dataclasses.replace(rows, inexact=FE.mxfp4_to_e4m3(q, count_inexact=True).inexact)
    if layer.act_encode == "two_phase":
        q = tq.transform_quantize(x2, layer.transform, MXFP4(), block_sizes=quant_blocks, impl=impl,
                                  round_to_input=False)
        rows = tq.reencode_e4m3(q, impl=impl)
        if not count:
            return rows
        return dataclasses.replace(rows, inexact=FE.mxfp4_to_e4m3(q, count_inexact=True).inexact)
    return tq.transform_quantize(x2, layer.transform, MXFP4(), block_sizes=quant_blocks, impl=impl,
                                 round_to_input=False)


def fp8_linear_forward(layer: Fp8Linear, x: jax.Array, *, op: str = "none", norm_weight=None,
                       head_dim: Optional[int] = None, eps: float = 1e-6, impl: Optional[str] = None,
                       accumulation: Accumulation = "default", gemm_dtype=jnp.float32, k_split: Optional[int] = None,
                       out_dtype=None, return_inexact: bool = False, quant_blocks=None, gemm: str = "xla"):
    """Eq. 11 on the FP8 tensor cores, then ``op``: ``x (..., d)`` -> ``(..., o)`` (``(..., o/2)`` for SwiGLU).

    W4A4: the fused transform + MXFP4 quantize kernel (``impl``: ``None`` = the kernel on a GPU, the reference
    elsewhere; ``"pallas"``, ``"interpret"``, ``"reference"``) writing E4M3 itself or followed by the XLA re-encode
    (``layer.act_encode``), ``h = x (R T^T)^T`` (bf16), the FP8
    GEMM with the epilogue of :func:`fp8_matmul` and the op as XLA ops on its f32 result (f32 math, one rounding to
    ``out_dtype`` at the end; the dequant strategy rounds its GEMM output to bf16 before the op). W4A8: ``x T`` in f32 and per-token E4M3 instead of the quantizer (``impl`` unused).

    ``gemm``: one of :data:`GEMMS`. ``"mgpu"`` runs the GEMM, the powers of two, the bias and ``h L^T`` as one Mosaic
    GPU kernel (on a GPU; its jnp mirror elsewhere), writing ``out_dtype`` directly; an op then runs in XLA in f32 on
    that output and rounds to ``out_dtype`` again (with bf16, the roundings of a bf16 linear followed by its norm or
    SwiGLU); it takes the default accumulation only (``accumulation``, ``gemm_dtype``, ``k_split`` are the XLA GEMM's
    settings).

    Returns ``(..., o)`` in ``out_dtype`` (default ``x.dtype``), and with ``return_inexact`` the count of elements the
    out-of-range policy rounded (activations of this call + the weight's, counted at preparation).
    """
    _check_op(layer, op, norm_weight, head_dim)
    d = layer.in_features
    if x.shape[-1] != d:
        raise ValueError(f"fp8 linear ({layer.out_features}, {d}): input of shape {x.shape} has {x.shape[-1]} features")
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} must be one of {GEMMS}")
    if gemm == "mgpu" and (accumulation != "default" or gemm_dtype != jnp.float32 or k_split is not None):
        raise ValueError(f"gemm='mgpu' takes the FP8 wgmma's accumulation only, got accumulation={accumulation!r}, "
                         f"gemm_dtype={jnp.dtype(gemm_dtype).name}, k_split={k_split} (settings of gemm='xla')")
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl not in ("pallas", "interpret", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas', 'interpret' or 'reference'")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d)
    if layer.swiglu_group and gemm != "mgpu":
        raise ValueError(f"fp8 linear ({layer.out_features}, {d}): rows in the fused kernel's SwiGLU order "
                         f"(swiglu_group={layer.swiglu_group}) run with gemm='mgpu' only, got gemm={gemm!r}")
    if x2.dtype not in (jnp.bfloat16, jnp.float16):
        x2 = x2.astype(jnp.bfloat16)
    a = _activations(layer, x2, impl, quant_blocks, count=return_inexact)
    lowrank = None
    if layer.left is not None:
        h = lowrank_h(x2, layer.right)  # (m, r)
        lowrank = (h, layer.left)
    fused_swiglu = op == "swiglu" and layer.swiglu_group > 0
    if gemm == "mgpu":  # one kernel writing out_dtype (the SwiGLU in it, for a swiglu_group layer); an op reads that
        order = operand_order(layer.weight)
        ar, wr = _as_rows(a, "a", order, return_inexact), _as_rows(layer.weight, "w", order, return_inexact)
        prescaled = lowrank is not None and layer.left_over_scale is not None
        if prescaled:
            lowrank = (lowrank[0], layer.left_over_scale)
        y = fp8_matmul_mgpu(ar, wr, lowrank=lowrank, bias=layer.bias, out_dtype=jnp.dtype(out_dtype),
                            left_prescaled=prescaled, swiglu_group=layer.swiglu_group if fused_swiglu else None)
        inexact = None
        if return_inexact:
            counted = (ar.inexact >= 0) & (wr.inexact >= 0)
            inexact = jnp.where(counted, ar.inexact + wr.inexact, -1)
    else:  # f32 through the epilogue and the op (XLA fuses them), one rounding to out_dtype at the end
        y = fp8_matmul(a, layer.weight, lowrank=lowrank, bias=layer.bias, out_dtype=jnp.float32,
                       accumulation=accumulation, gemm_dtype=gemm_dtype, k_split=k_split,
                       return_inexact=return_inexact)
        y, inexact = y if return_inexact else (y, None)
    if op == "rmsnorm":
        y = rmsnorm_heads(y, norm_weight, head_dim=head_dim, eps=eps)
    elif op == "swiglu" and not fused_swiglu:
        y = served.swiglu_pairs(y)
    y = y.reshape(*lead, y.shape[-1]).astype(out_dtype)
    return (y, inexact) if return_inexact else y


def _swiglu_rows(y, layer: Fp8Linear):
    """The SwiGLU on a GEMM output whose columns are in ``layer``'s row order (pairs or the kernel's groups)."""
    return MG.swiglu_halves(y, layer.swiglu_group) if layer.swiglu_group else served.swiglu_pairs(y)


def with_kernel_swiglu_rows(layer: Fp8Linear, group: int = MG.SWIGLU_GROUP) -> Fp8Linear:
    """A ``swiglu_rows`` layer (gate/up pairs, re-encoded weight) with its rows (weight, bias, ``L``, ``L / sw``) in
    the fused kernel's SwiGLU order (``fp8_gemm_mgpu.swiglu_halves_order``), ``swiglu_group=group``: the kernel then
    applies the SwiGLU in its epilogue and writes half the columns. Other layers, and those whose ``out_features``
    is not a multiple of ``2 group`` (whole groups per CTA tile), are returned unchanged: their SwiGLU runs in XLA on
    the pairs."""
    if (not layer.swiglu_rows or layer.swiglu_group or not isinstance(layer.weight, Fp8Rows)
            or layer.out_features % (2 * group)):
        return layer
    order = jnp.asarray(MG.swiglu_halves_order(layer.out_features, group))
    take = lambda x: None if x is None else x[order]  # noqa: E731
    weight = dataclasses.replace(layer.weight, values=layer.weight.values[order], scale=layer.weight.scale[order])
    return dataclasses.replace(layer, weight=weight, bias=take(layer.bias), left=take(layer.left),
                               left_over_scale=take(layer.left_over_scale), swiglu_group=group)


def fp8_linear_reference(layer: Fp8Linear, x: jax.Array, *, op: str = "none", norm_weight=None,
                         head_dim: Optional[int] = None, eps: float = 1e-6) -> np.ndarray:
    """float64 reference of :func:`fp8_linear_forward` (``op="none"``: eq. 11 exactly on the same quantized
    activations; with an op, the op applied in f32 to the float64 product rounded to f32). ``(m, o)`` (host)."""
    _check_op(layer, op, norm_weight, head_dim)
    d = layer.in_features
    x2 = x.reshape(-1, d)
    if x2.dtype not in (jnp.bfloat16, jnp.float16):
        x2 = x2.astype(jnp.bfloat16)
    a = _activations(layer, x2, "reference")
    lowrank = None
    if layer.left is not None:
        h = lowrank_h(x2, layer.right)
        lowrank = (h, layer.left)
    y = fp8_matmul_reference(a, layer.weight, lowrank=lowrank, bias=layer.bias)
    if op == "rmsnorm":
        y = np.asarray(rmsnorm_heads(jnp.asarray(y, jnp.float32), norm_weight, head_dim=head_dim, eps=eps), np.float64)
    elif op == "swiglu":
        y = np.asarray(_swiglu_rows(jnp.asarray(y, jnp.float32), layer), np.float64)
    return y


# ---------------------------------------------------------------------------------------------------------------------
# The served-layer strategies ("fp8": W4A4, "fp8_w4a8", "fp8_mgpu": W4A4 with the fused kernel), registered on import.
# ---------------------------------------------------------------------------------------------------------------------


class Fp8Strategy(served.Strategy):
    """W4A4 on the FP8 tensor cores: ``served.serve(layer, strategy="fp8")`` prepares an :class:`Fp8Linear` (weight
    re-encoded once), ``served.forward(..., options=ServeOptions(strategy="fp8"))`` runs :func:`fp8_linear_forward`
    (the op as XLA ops on its f32 result). MXFP4 layers only (NVFP4 raises at preparation)."""

    name = "fp8"
    options = frozenset()
    act = "mxfp4"

    def unsupported(self, layer) -> Optional[str]:
        """MXFP4 weights (and activations, W4A4) only: NVFP4 values are not exact in E4M3."""
        wfmt = getattr(layer.weight, "fmt", None)
        if not isinstance(wfmt, MXFP4) or (self.act == "mxfp4" and not isinstance(layer.config.act_fmt, MXFP4)):
            return (f"weight format {wfmt!r} / activation format {layer.config.act_fmt!r}, the {self.name!r} "
                    f"strategy needs MXFP4")
        return None

    def prepare(self, layer, *, swiglu: bool = False, transform_kernel: Optional[str] = None) -> Fp8Linear:
        """Refuses a layer :meth:`unsupported` names (before any work), then :func:`prepare_fp8_layer`."""
        why = self.unsupported(layer)
        if why is not None:
            raise ValueError(f"layer ({layer.config.out_features}, {layer.config.in_features}): {why}")
        return prepare_fp8_layer(served.serve_layer(layer, swiglu=swiglu, transform_kernel=transform_kernel),
                                 act=self.act)

    def forward(self, layer, x2, op, options, impl):
        return fp8_linear_forward(layer, x2, op=op.name, norm_weight=op.norm_weight, head_dim=op.head_dim, eps=op.eps,
                                  impl=impl, quant_blocks=options.quant_blocks, out_dtype=jnp.float32)

    def reference(self, layer, x2, op):
        """jnp: the reference quantizer, the operands' exact values in f32, the product at HIGHEST precision."""
        a = _activations(layer, x2, "reference")
        a = FE.dequantize_rows(a) if isinstance(a, Fp8Rows) else dequantize(a, jnp.float32)
        w = layer.weight
        w = FE.dequantize_rows(w) if isinstance(w, Fp8Rows) else dequantize(w, jnp.float32)
        y = jnp.matmul(a, w.T, precision="highest")
        if layer.left is not None:
            h = lowrank_h(x2, layer.right)
            y = y + jnp.matmul(h.astype(jnp.float32), layer.left.astype(jnp.float32).T, precision="highest")
        if layer.bias is not None:
            y = y + layer.bias.astype(jnp.float32)
        return _swiglu_rows(y, layer) if op.name == "swiglu" else served.apply_op(y, op)


class Fp8W4A8Strategy(Fp8Strategy):
    """W4A8: MXFP4 weights re-encoded in E4M3, per-token E4M3 activations (``x T`` in f32, no MXFP4 step)."""

    name = "fp8_w4a8"
    act = "fp8"


class Fp8MgpuStrategy(Fp8Strategy):
    """W4A4 on the FP8 tensor cores with the epilogue fused: the ``"fp8"`` strategy's layer, its GEMM, powers of two,
    bias and low-rank term as one Mosaic GPU kernel (``fp8_linear_forward(..., gemm="mgpu")``). The kernel writes
    bf16 for bf16 activations (half the bytes of f32: the point of fusing), f32 otherwise; the q/k norm then runs in
    XLA (f32 math) on that output, as it does after a bf16 linear. A SwiGLU layer is prepared in the kernel's row
    order (:func:`with_kernel_swiglu_rows`) and its SwiGLU runs in the kernel's epilogue (half the output bytes).
    A Kronecker transform runs as K1 unless ``transform_kernel="k2"`` is asked for (:meth:`prepare`)."""

    name = "fp8_mgpu"
    # XLA's command buffers (CUDA graphs) off for the sampler that serves these layers: on PixArt-Σ and FLUX.1 at
    # their real sizes the W4A4 step ran faster and steadier without them (the first timed steps after compiling
    # much slower with them), bf16 the same either way (docs/w4a4.md, "XLA's command buffers off for fp8_mgpu").
    program_xla_options = MappingProxyType({"xla_gpu_enable_command_buffer": ""})

    def unsupported(self, layer) -> Optional[str]:
        """The ``"fp8"`` strategy's formats, and a low-rank branch of a rank the kernel's bf16 ``wgmma`` takes."""
        why = super().unsupported(layer)
        rank = layer.config.rank
        if why is None and rank and (rank % MG.BF16_WGMMA_K or rank > 256):
            why = f"low-rank rank {rank}, the fused kernel needs a multiple of {MG.BF16_WGMMA_K} up to 256"
        return why

    def prepare(self, layer, *, swiglu: bool = False, transform_kernel: Optional[str] = None) -> Fp8Linear:
        """The ``"fp8"`` layer plus the kernel's ``L / sw``, made once here; a SwiGLU layer's rows in the order of
        the kernel's SwiGLU epilogue (:func:`with_kernel_swiglu_rows`). ``transform_kernel=None`` prepares a
        Kronecker transform as K1 (its dense blocks, made once here in the kernel's f32 product order: the same
        bytes as K2, a faster quantizer in the Ideogram 4 forward, docs/w4a4.md), ``"k2"`` keeps K2."""
        transform_kernel = "k1" if transform_kernel is None else transform_kernel
        fp8 = super().prepare(layer, swiglu=swiglu, transform_kernel=transform_kernel)
        if fp8.left is not None and isinstance(fp8.weight, Fp8Rows):
            fp8 = dataclasses.replace(fp8, left_over_scale=prescale_left(fp8.left, fp8.weight))
        return with_kernel_swiglu_rows(fp8)

    def forward(self, layer, x2, op, options, impl):
        out_dtype = jnp.bfloat16 if x2.dtype == jnp.bfloat16 else jnp.float32
        return fp8_linear_forward(layer, x2, op=op.name, norm_weight=op.norm_weight, head_dim=op.head_dim, eps=op.eps,
                                  impl=impl, quant_blocks=options.quant_blocks, out_dtype=out_dtype, gemm="mgpu")


for _strategy in (Fp8Strategy(), Fp8W4A8Strategy(), Fp8MgpuStrategy()):
    if _strategy.name not in served.strategy_names():
        served.register_strategy(_strategy)
