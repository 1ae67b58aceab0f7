"""MXFP4 and NVFP4 block formats: quantize, dequantize and fake-quantize with a straight-through estimator.

Both formats quantize along the **last axis** in blocks of consecutive elements and store:

* ``codes``: FP4 E2M1 codes packed two per ``uint8`` (element ``2i`` in the low nibble, ``2i+1`` in the high nibble),
  shape ``(..., d // 2)``. A code is ``sign << 3 | magnitude_index`` with magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
* ``scales``: one per block, shape ``(..., d // block_size)``.

  - MXFP4 (OCP Microscaling v1.0): E8M0 bytes, ``scale = 2 ** (byte - 127)``; the byte ``0xFF`` is NaN.
  - NVFP4: ``float8_e4m3fn`` block scales times one fp32 per-tensor scale ``amax(|x|) / (448 * 6)``.

The reconstruction invariant (see :class:`QuantizedArray`)::

    dequantize(quantize(x, fmt)) == fake_quant(x, fmt)             # bit for bit
    MXFP4:  x_hat[..., j] = e2m1(code[..., j]) * 2 ** (scale_byte[..., j // 32] - 127)
    NVFP4:  x_hat[..., j] = e2m1(code[..., j]) * f32(scale_e4m3[..., j // 16]) * tensor_scale

Numerical policies (one documented choice each, tested in ``tests/test_formats.py``):

* **Rounding**: round to nearest, ties to even (on the E2M1 grid), saturating at +-6; the E2M1 code is built from
  integer comparisons (:func:`e2m1_encode`), the same per-element function the GPU kernels use.
* **MXFP4 shared exponent** (``ScaleMode``), with ``amax`` the block's largest magnitude:
  ``FLOOR`` (OCP default) ``e = floor(log2 amax) - 2``; ``CEIL`` ``e = ceil(log2 amax) - 2``;
  ``EVEN`` rounds ``amax`` to 2 significant bits (round half up) before ``FLOOR``; ``RCEIL`` ``e = ceil(log2(amax/6))``.
  ``e`` is clamped to ``[-127, 127]``; an all-zero block gets ``e = -127`` and all-zero codes.
  These match torchao's ``ScaleCalculationMode`` (``FLOOR``/``CEIL``/``EVEN``/``RCEIL``).
* **Non-finite input**: a block that contains NaN or +-Inf gets the E8M0 NaN scale byte ``0xFF`` (MXFP4) or a NaN
  block scale (NVFP4) and zero codes, so the whole block dequantizes to NaN: the error is visible, never silently
  clipped. Host-side entry points that take user data call :func:`check_finite` to raise early with the name of the
  offending tensor.
* **Subnormals**: f32 subnormal values (``|x| < 2**-126``) are flushed to signed zero on input and on output. XLA:CPU
  does this in hardware (DAZ/FTZ); doing it explicitly makes every backend (CPU, GPU, the numpy reference) agree bit
  for bit. It only affects blocks whose ``amax < 2**-124``. NVFP4's tensor scale is floored at
  :data:`NVFP4_MIN_TENSOR_SCALE` so that the quantizer's reciprocal stays finite for tensors of tiny (normal) values.
* **Shapes**: ``d`` must be a multiple of the block size, or ``pad=True`` pads with zeros to the next multiple (and
  :func:`dequantize` returns the padded width, sliced back by ``fake_quant``).
  Empty arrays (``(0, d)``, an empty batch) are valid: they round-trip through :func:`quantize` /
  :func:`dequantize` / :func:`fake_quant` (and its gradient) to the same empty shape; NVFP4's tensor scale of an
  empty array is ``1.0``, as for an all-zero one.

The straight-through estimator: :func:`fake_quant` has a ``custom_vjp`` whose backward pass is the identity
(``ste="identity"``) or the identity masked to zero where the element saturated (``ste="clipped"``: where the
quantizer clipped it, ``|x| > 6 * s`` for the element's effective block scale ``s``, decided on the quantizer's own
scaled value: :meth:`QuantFormat.saturated`).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
from typing import ClassVar, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "MXFP4",
    "NVFP4",
    "QuantFormat",
    "QuantizedArray",
    "ScaleMode",
    "as_float32",
    "check_finite",
    "check_format",
    "dequantize",
    "divide_rn",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_round",
    "fake_quant",
    "flush_subnormals",
    "mx_shared_exponent",
    "mxfp4_quantize_blocks",
    "nvfp4_quantize_blocks",
    "nvfp4_tensor_scale",
    "nvfp4_block_reciprocal",
    "nvfp4_tensor_scale_from_amax",
    "pack_nibbles",
    "pow2",
    "quantize",
    "unpack_nibbles",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # smallest normal float8_e4m3fn
E8M0_BIAS = 127
E8M0_NAN = 0xFF
#: The 16 E2M1 values indexed by code (bit 3 = sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
# Rounding thresholds between adjacent magnitudes. A tie rounds to the magnitude with an even index (mantissa bit 0):
# ">" where the lower neighbour is even, ">=" where the upper neighbour is even.
_E2M1_THRESHOLDS_UP = (0.25, 1.25, 2.5, 5.0)  # tie goes down: count v > t
_E2M1_THRESHOLDS_UP_INCLUSIVE = (0.75, 1.75, 3.5)  # tie goes up: count v >= t

_F32_EXP_MASK = 0x7F800000
_F32_SIGN_MASK = np.int32(-(2**31))


class ScaleMode(str, enum.Enum):
    """How the MXFP4 shared exponent is derived from the block's absolute maximum (torchao's names)."""

    FLOOR = "floor"
    CEIL = "ceil"
    EVEN = "even"
    RCEIL = "rceil"


class QuantFormat(abc.ABC):
    """An FP4 block format: E2M1 codes in blocks of ``block_size`` along the last axis, one scale per block.

    The two formats (:class:`MXFP4`, :class:`NVFP4`) are frozen dataclasses that carry everything format-specific, so
    callers never branch on the format's type:

    * ``name`` (``"mxfp4"`` / ``"nvfp4"``), ``standard_block_size`` (32 / 16, the only block the GPU kernels write),
      ``has_tensor_scale`` (NVFP4's per-tensor fp32 scale), ``scale_dtype`` (``uint8`` E8M0 bytes /
      ``float8_e4m3fn``);
    * :meth:`tensor_scale`, :meth:`quantize_blocks`, :meth:`dequantize_blocks`, :meth:`saturated`,
      :meth:`scale_factors` (the per-block math, shared by the reference path and the GPU kernels);
    * :meth:`to_json` / :meth:`from_json` (the checkpoint description).
    """

    name: ClassVar[str]
    standard_block_size: ClassVar[int]
    has_tensor_scale: ClassVar[bool]
    scale_dtype: ClassVar[np.dtype]
    block_size: int

    def __post_init__(self):
        if self.block_size % 2 or self.block_size <= 0:
            raise ValueError(f"{type(self).__name__} block_size={self.block_size} must be a positive even number")

    @property
    def is_standard(self) -> bool:
        """Whether the block is the format's standard one (what the GPU kernels read and write)."""
        return self.block_size == self.standard_block_size

    @abc.abstractmethod
    def tensor_scale(self, x: jax.Array) -> jax.Array:
        """The per-tensor scale of ``x (..., d)``: ``float32 ()`` (``1.0`` where the format has none)."""

    @abc.abstractmethod
    def quantize_blocks(self, blocks: jax.Array, tensor_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(..., nb, block)`` values and the tensor scale -> ``codes uint8 (..., nb, block)`` (one per element) and
        ``scales (..., nb)`` of :attr:`scale_dtype`."""

    @abc.abstractmethod
    def dequantize_blocks(self, codes: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        """Inverse of :meth:`quantize_blocks`: f32 ``(..., nb, block)`` (exact, subnormal results flushed)."""

    @abc.abstractmethod
    def scale_factors(self, scales: jax.Array, exponent_offset: int = 0) -> jax.Array:
        """f32 ``block_scale * 2**exponent_offset`` of each block from its stored scales (``scale_dtype`` or their
        ``uint8`` bytes), the factor that turns a code decoded as ``e2m1 * 2**-exponent_offset`` into its value (the
        tensor scale not included). A NaN scale gives NaN."""

    @abc.abstractmethod
    def saturated(self, x_blocks: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        """bool ``(..., nb, block)``: where the quantizer that made ``scales`` clipped ``x_blocks`` to ``+-6`` units
        (the clipped STE's mask), decided on the quantizer's own scaled value; never in a NaN block."""

    def to_json(self) -> dict:
        """``{"name": ..., <field>: <value>}`` (enums by value): the description :meth:`from_json` reads back."""
        out = {"name": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out

    @staticmethod
    def from_json(d: dict) -> "QuantFormat":
        """The format described by :meth:`to_json`'s dict; ``ValueError`` naming an unknown format or key."""
        cls = _FORMATS.get(d.get("name")) if isinstance(d, dict) else None
        if cls is None:
            raise ValueError(f"unknown quantization format {d!r} (known: {sorted(_FORMATS)})")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields - {"name"}
        if unknown:
            raise ValueError(f"quantization format {d!r}: unknown keys {sorted(unknown)} for {cls.__name__}")
        return cls(**{k: v for k, v in d.items() if k != "name"})


def _scale_bytes(scales: jax.Array) -> jax.Array:
    """The stored scales as ``int32`` bytes (``float8_e4m3fn`` scales by their bit pattern)."""
    if scales.dtype != jnp.uint8:
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    return scales.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class MXFP4(QuantFormat):
    """OCP MXFP4: E2M1 elements, one E8M0 (power-of-two) scale per ``block_size`` elements."""

    name: ClassVar[str] = "mxfp4"
    standard_block_size: ClassVar[int] = 32
    has_tensor_scale: ClassVar[bool] = False
    scale_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)
    block_size: int = 32
    scale_mode: ScaleMode = ScaleMode.FLOOR

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "scale_mode", ScaleMode(self.scale_mode))

    def tensor_scale(self, x: jax.Array) -> jax.Array:
        return jnp.float32(1.0)

    def quantize_blocks(self, blocks: jax.Array, tensor_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        return mxfp4_quantize_blocks(blocks, self.scale_mode)

    def dequantize_blocks(self, codes: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        """Products with the E8M0 scale are exact power-of-two shifts; byte 0 (``2**-127``, a subnormal float) is
        applied to the bits, as an exponent decrement of the values ``|v| >= 2`` whose results are normal floats
        (the others are subnormal and flush to a signed zero), so no subnormal constant meets XLA's flush-to-zero and
        compiled and eager results agree."""
        values = e2m1_decode(codes)
        b = scales.astype(jnp.int32)[..., None]
        scale_hi = jax.lax.bitcast_convert_type(jnp.clip(b, 1, 254) << 23, jnp.float32)
        times_2_to_minus_127 = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(values, jnp.int32) - (127 << 23), jnp.float32)
        tiny = jnp.where(jnp.abs(values) >= 2.0, times_2_to_minus_127, jnp.copysign(jnp.float32(0.0), values))
        out = jnp.where(b == 0, tiny, values * scale_hi)
        out = jnp.where(b == E8M0_NAN, jnp.nan, out)
        return flush_subnormals(out)

    def scale_factors(self, scales: jax.Array, exponent_offset: int = 0) -> jax.Array:
        """``2**(byte - 127 + exponent_offset)`` built from bits: exact for bytes in ``[1, 254 - exponent_offset]``,
        clamped to ``2**127`` above; byte 0 gives 0 (below the GPU kernels' exact range of bytes ``[2, 248]``; the
        reference keeps such a block's normal results); byte 0xFF gives NaN. ``exponent_offset >= 0``."""
        if exponent_offset < 0:
            raise ValueError(f"{exponent_offset=} must be >= 0 (the factor of a small byte would not be built exactly)")
        s = _scale_bytes(scales)
        mult = jax.lax.bitcast_convert_type(jnp.minimum(s + exponent_offset, 254) << 23, jnp.float32)
        mult = jnp.where(s == 0, jnp.float32(0.0), mult)
        return jnp.where(s == E8M0_NAN, jnp.float32(jnp.nan), mult)

    def saturated(self, x_blocks: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        # |x| > 6 * 2**e, the limit an exact power-of-two product: 1.5 * 2**(e + 2), built from bits so that
        # e = -127 does not underflow; a NaN scale never saturates.
        e_plus_2 = scales.astype(jnp.int32) - E8M0_BIAS + 2
        limit = jnp.where(e_plus_2 > 127, jnp.inf, 1.5 * pow2(jnp.clip(e_plus_2, -126, 127)))
        limit = jnp.where(scales == E8M0_NAN, jnp.nan, limit)
        return jnp.abs(x_blocks.astype(jnp.float32)) > limit[..., None]


@dataclasses.dataclass(frozen=True)
class NVFP4(QuantFormat):
    """NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one fp32 per-tensor scale."""

    name: ClassVar[str] = "nvfp4"
    standard_block_size: ClassVar[int] = 16
    has_tensor_scale: ClassVar[bool] = True
    scale_dtype: ClassVar[np.dtype] = np.dtype(jnp.float8_e4m3fn)
    block_size: int = 16

    def tensor_scale(self, x: jax.Array) -> jax.Array:
        return nvfp4_tensor_scale(x)

    def quantize_blocks(self, blocks: jax.Array, tensor_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        return nvfp4_quantize_blocks(blocks, tensor_scale)

    def dequantize_blocks(self, codes: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        return flush_subnormals(e2m1_decode(codes) * scales.astype(jnp.float32)[..., None] * tensor_scale)

    def scale_factors(self, scales: jax.Array, exponent_offset: int = 0) -> jax.Array:
        """``f32(e4m3 scale) * 2**exponent_offset`` (exact for the offsets the kernels use)."""
        s8 = jax.lax.bitcast_convert_type(_scale_bytes(scales).astype(jnp.uint8), jnp.float8_e4m3fn)
        return s8.astype(jnp.float32) * jnp.float32(2.0**exponent_offset)

    def saturated(self, x_blocks: jax.Array, scales: jax.Array, tensor_scale: jax.Array) -> jax.Array:
        # the quantizer's own value x * ((1 / tensor_scale) / s), not |x| > 6 s ts: that product rounds on its own
        # and disagrees at the boundary (a block's largest element, reproduced exactly, was called clipped)
        x = flush_subnormals(x_blocks.astype(jnp.float32))
        reciprocal = nvfp4_block_reciprocal(tensor_scale, scales.astype(jnp.float32))  # (..., nb)
        return jnp.abs(flush_subnormals(x * reciprocal[..., None])) > E2M1_MAX


_FORMATS = {cls.name: cls for cls in (MXFP4, NVFP4)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=("codes", "scales", "tensor_scale"),
                   meta_fields=("fmt", "dtype"))
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-quantized array: packed E2M1 codes and block scales are leaves, the format is static.

    Attributes:
      codes: ``uint8 (..., d // 2)``; element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.
      scales: MXFP4: ``uint8 (..., d // block)`` E8M0 bytes. NVFP4: ``float8_e4m3fn (..., d // block)``.
      tensor_scale: ``float32 ()``: NVFP4's per-tensor scale (over the whole array; stack and ``vmap`` for one scale
        per slice); ``1.0`` for MXFP4.
      fmt: the :data:`QuantFormat` (static).
      dtype: the dtype of the quantized input, used by :func:`dequantize` by default (static).

    Invariant: ``dequantize(quantize(x, fmt)) == fake_quant(x, fmt)`` bit for bit, where for element ``j``
    ``x_hat[..., j] = E2M1_VALUES[code_j] * block_scale[..., j // block] * tensor_scale``.
    """

    codes: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array
    fmt: QuantFormat
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dequantized array ``(..., d)``."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        """Storage in bytes (codes + scales + tensor scale)."""
        return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize + 4)


# ---------------------------------------------------------------------------------------------------------------------
# Per-element / per-block math, shared by the reference path and the GPU kernels (pure jnp, integer-built codes).
# ---------------------------------------------------------------------------------------------------------------------


def flush_subnormals(x_f32: jax.Array) -> jax.Array:
    """Replaces f32 subnormals by signed zeros (integer test on the bit pattern, so it is exact under DAZ)."""
    bits = jax.lax.bitcast_convert_type(x_f32, jnp.int32)
    is_sub = (bits & _F32_EXP_MASK) == 0
    return jnp.where(is_sub, jax.lax.bitcast_convert_type(bits & _F32_SIGN_MASK, jnp.float32), x_f32)


def pow2(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` as f32 built from bits; ``exponent`` int32 in ``[-126, 127]`` (normal range)."""
    return jax.lax.bitcast_convert_type((exponent + 127).astype(jnp.int32) << 23, jnp.float32)


def e2m1_encode(v: jax.Array) -> jax.Array:
    """E2M1 code of already-scaled f32 values: round to nearest, ties to even, saturate at +-6.

    Args:
      v: ``float32 (...)`` values in units of the block scale (subnormals already flushed).

    Returns:
      ``uint8 (...)`` codes in ``[0, 15]`` (bit 3 = sign bit of ``v``, so ``-0.0`` and tiny negatives give ``8``,
      as ml_dtypes' ``float4_e2m1fn`` does).
    """
    mag = jnp.abs(v)
    idx = jnp.zeros(v.shape, jnp.int32)
    for t in _E2M1_THRESHOLDS_UP:
        idx = idx + (mag > t).astype(jnp.int32)
    for t in _E2M1_THRESHOLDS_UP_INCLUSIVE:
        idx = idx + (mag >= t).astype(jnp.int32)
    sign = (jax.lax.bitcast_convert_type(v, jnp.uint32) >> 31).astype(jnp.int32)
    return (sign << 3 | idx).astype(jnp.uint8)


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """Values ``float32 (...)`` of E2M1 codes ``uint8 (...)`` (low 4 bits used)."""
    return jnp.asarray(E2M1_VALUES)[(codes & 0xF).astype(jnp.int32)]


def mx_shared_exponent(amax: jax.Array, mode: ScaleMode) -> jax.Array:
    """Unbiased E8M0 exponent ``int32`` of each block from its ``float32`` absolute maximum ``amax``.

    ``amax`` must be finite and flushed (non-finite blocks are handled by the caller). Returns values in
    ``[-127, 127]``; in practice ``<= 126`` since ``amax < 2**128``.
    """
    mode = ScaleMode(mode)
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    if mode == ScaleMode.EVEN:
        # Round the mantissa to E2M1's 1 bit (half up), carrying into the exponent, then take the floor.
        bits = (bits + (1 << 21)) & _F32_EXP_MASK
    exp_field = (bits >> 23) & 0xFF
    floor_log2 = exp_field - 127
    if mode in (ScaleMode.FLOOR, ScaleMode.EVEN):
        e = floor_log2 - 2
    elif mode == ScaleMode.CEIL:
        e = floor_log2 + ((bits & 0x7FFFFF) > 0).astype(jnp.int32) - 2
    elif mode == ScaleMode.RCEIL:
        # ceil(log2(amax / 6)): the smallest e with amax <= 6 * 2**e. Exact: compare amax with 6 * 2**e_floor.
        # With amax in [2**f, 2**(f+1)): e = f - 2 if amax <= 6 * 2**(f-2) = 1.5 * 2**f, else f - 1 (exact compare).
        e_floor = floor_log2 - 2
        threshold = 1.5 * pow2(jnp.clip(floor_log2, -126, 127))
        e = jnp.where(amax > threshold, e_floor + 1, e_floor)
        e = jnp.where(exp_field == 0, -127, e)
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"unknown scale mode {mode!r}")
    return jnp.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(jnp.int32)


def mxfp4_quantize_blocks(x_blocks: jax.Array, mode: ScaleMode = ScaleMode.FLOOR) -> tuple[jax.Array, jax.Array]:
    """MXFP4-quantizes blocks. The per-tile function of the reference and of the fused GPU kernels.

    Args:
      x_blocks: ``(..., block)`` values (any float dtype; computed in f32).
      mode: shared-exponent rule.

    Returns:
      ``codes uint8 (..., block)`` (unpacked, one code per element) and ``scale_bytes uint8 (...)`` (E8M0).
    """
    x = flush_subnormals(x_blocks.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    nonfinite = jnp.any((bits & _F32_EXP_MASK) == _F32_EXP_MASK, axis=-1)
    amax = jnp.max(jnp.abs(jnp.where((bits & _F32_EXP_MASK) == _F32_EXP_MASK, 0.0, x)), axis=-1)
    e = mx_shared_exponent(amax, mode)
    inv_scale = pow2(jnp.clip(-e, -126, 127))  # 2**-e; e <= 126 for finite f32 input
    codes = e2m1_encode(flush_subnormals(x * inv_scale[..., None]))
    codes = jnp.where(nonfinite[..., None], jnp.uint8(0), codes)
    scale_bytes = jnp.where(nonfinite, jnp.uint8(E8M0_NAN), (e + E8M0_BIAS).astype(jnp.uint8))
    return codes, scale_bytes


def e4m3_round(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Positive normal f32 ``s`` in ``[E4M3_TINY, E4M3_MAX]`` rounded to E4M3 (nearest, ties to even) on its integer
    bits -> ``(value float32, byte int32)``, both of ``s``'s shape; ``value`` is exactly the E4M3 number of ``byte``.

    Why not ``s.astype(float8_e4m3fn).astype(float32)``: inside one compiled program XLA:GPU replaces a chain of float
    conversions ``f32 -> f8 -> f32`` by its input (the ``simplify-fp-conversions`` pass, on while excess precision is
    allowed, its default), so a jitted consumer of the rounded scale would get ``s`` unrounded. Integer operations
    are never removed, so every backend, jitted or not, gives the same bits. The Pallas kernels use this function too.
    """
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & jnp.int32(-0x100000)  # keep 3 fraction bits, ties to even
    byte = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # E4M3: exponent bias 7 (f32's is 127)
    return jax.lax.bitcast_convert_type(bits, jnp.float32), byte


def divide_rn(x: jax.Array, y) -> jax.Array:
    """Correctly rounded IEEE f32 ``x / y`` (round to nearest even) on every backend, under jit and vmap.

    ``x``, ``y``: float32 arrays (or scalars) that broadcast together; returns float32 of the broadcast shape, bit for
    bit ``numpy.float32(x) / numpy.float32(y)``, subnormal inputs and results included (no flush), signed zeros,
    infinities and NaN as IEEE 754 defines them.

    Why not ``x / y``: XLA:GPU's f32 division is not correctly rounded (many random quotients one ulp off, the same
    results as Triton's ``div.full.f32``; docs/kernels.md, "NVFP4 divisions"), and XLA rewrites a division by a
    broadcast scalar into a multiplication by its reciprocal on every backend. NVFP4's block scales sit next to E4M3
    rounding midpoints, so one ulp changes a scale byte. This is an integer restoring division of the 24-bit
    significands (25 quotient bits, a sticky bit, then the rounding), so XLA cannot rewrite it and every backend gives
    the same bits. Cost: about 25 x 5 integer operations per element; NVFP4 uses it per block of 16, not per element.
    """
    x, y = jnp.broadcast_arrays(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    bx = jax.lax.bitcast_convert_type(x, jnp.int32)
    by = jax.lax.bitcast_convert_type(y, jnp.int32)
    sign = (bx ^ by) & jnp.int32(-(2**31))  # the sign bit of the quotient
    ax, ay = bx & 0x7FFFFFFF, by & 0x7FFFFFFF  # |x|, |y| bits

    def significand(a):
        """(significand in [2^23, 2^24), biased exponent; subnormals normalised to an exponent below 1)."""
        exp_field, frac = a >> 23, a & 0x7FFFFF
        shift = jnp.maximum(jax.lax.clz(frac) - 8, 0)  # subnormal: bring the leading 1 to bit 23
        sub = exp_field == 0
        return (jnp.where(sub, frac << shift, frac | 0x800000),
                jnp.where(sub, 1 - shift, exp_field))

    x_zero, y_zero = ax == 0, ay == 0
    x_inf, y_inf = ax == 0x7F800000, ay == 0x7F800000
    nan = (ax > 0x7F800000) | (ay > 0x7F800000) | (x_zero & y_zero) | (x_inf & y_inf)
    regular = ~(nan | x_zero | y_zero | x_inf | y_inf)
    one = jnp.int32(0x800000)
    mx, ex = significand(jnp.where(regular, ax, one))
    my, ey = significand(jnp.where(regular, ay, one))
    low = mx < my
    rem = jnp.where(low, mx << 1, mx)  # rem / my in [1, 2)
    exp = ex - ey + 127 - low.astype(jnp.int32)  # biased exponent of the quotient
    q = jnp.zeros_like(rem)
    for _ in range(25):  # 24 significand bits + the rounding bit; rem < 2 my < 2^25 throughout
        bit = rem >= my
        q = (q << 1) | bit.astype(jnp.int32)
        rem = jnp.where(bit, rem - my, rem) << 1
    sticky = rem != 0
    # Normal results drop 1 bit of q; subnormal ones (exp <= 0) drop 2 - exp bits (value = q 2^(exp - 151)).
    drop = jnp.where(exp >= 1, 1, jnp.minimum(2 - exp, 26))
    kept = q >> drop
    dropped = q & ((jnp.int32(1) << drop) - 1)
    half = jnp.int32(1) << (drop - 1)
    round_up = (dropped > half) | ((dropped == half) & (sticky | ((kept & 1) == 1)))
    kept = kept + round_up.astype(jnp.int32)
    # Normal: (exp - 1) << 23 plus the 24-bit significand (its implicit bit carries into the exponent, also when the
    # rounding overflows the significand); subnormal: the significand is the bit pattern. Overflow saturates to inf.
    magnitude = jnp.where(exp >= 1, ((exp - 1) << 23) + kept, kept)
    magnitude = jnp.minimum(jnp.where(exp >= 255, 0x7F800000, magnitude), 0x7F800000)
    magnitude = jnp.where(x_inf | y_zero, 0x7F800000, jnp.where(x_zero | y_inf, 0, magnitude))
    bits = jnp.where(nan, 0x7FC00000, sign | magnitude)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


#: The smallest NVFP4 tensor scale: below it ``(1 / ts) / s`` overflows f32 for small block scales (an all-zero block
#: came back as -0, and a tensor of maximum below ~3e-35 quantized to +-6 everywhere and dequantized to 0). At this
#: floor ``(1 / ts) / E4M3_TINY = 2**126``; only tensors with ``amax < 448 * 6 * 2**-120`` (~2e-33) reach it, and
#: their block scales then sit below 448 instead of at it.
NVFP4_MIN_TENSOR_SCALE = 2.0**-120


def nvfp4_tensor_scale_from_amax(amax: jax.Array) -> jax.Array:
    """NVFP4 per-tensor scale from the tensor's largest finite ``|x|``: ``amax / (448 * 6)`` (correctly rounded), at
    least :data:`NVFP4_MIN_TENSOR_SCALE`; ``1.0`` for ``amax = 0`` (one home for the reference and the kernels)."""
    amax = jnp.asarray(amax, jnp.float32)
    scale = jnp.maximum(divide_rn(amax, E4M3_MAX * E2M1_MAX), jnp.float32(NVFP4_MIN_TENSOR_SCALE))
    return jnp.where(amax > 0, scale, jnp.float32(1.0))


def nvfp4_tensor_scale(x: jax.Array) -> jax.Array:
    """NVFP4 per-tensor scale ``amax(|x|) / (448 * 6)`` (f32 ``()``, :func:`nvfp4_tensor_scale_from_amax`); ``1.0``
    for an all-zero (or non-finite) tensor."""
    xf = flush_subnormals(x.astype(jnp.float32))
    # initial=0: an empty array has amax 0 (scale 1.0); |x| >= 0, so non-empty results are unchanged. Non-finite
    # blocks become NaN on their own.
    amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(xf), xf, 0.0)), initial=0.0)
    return nvfp4_tensor_scale_from_amax(amax)


def nvfp4_block_reciprocal(tensor_scale: jax.Array, block_scale: jax.Array) -> jax.Array:
    """``(1 / tensor_scale) / block_scale`` (f32, each division correctly rounded): what NVFP4 multiplies an element
    by before encoding it (the quantizer and its clipped-STE mask share it)."""
    return divide_rn(divide_rn(jnp.float32(1.0), tensor_scale), block_scale)


def nvfp4_quantize_blocks(x_blocks: jax.Array, tensor_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4-quantizes blocks given the per-tensor scale. Shared per-tile function.

    Args:
      x_blocks: ``(..., block)`` values.
      tensor_scale: ``float32 ()`` per-tensor scale (see :func:`nvfp4_tensor_scale`).

    Returns:
      ``codes uint8 (..., block)`` and ``block_scales float8_e4m3fn (...)``;
      ``q = e2m1(clip(x * ((1 / tensor_scale) / s_blk), +-6))`` with
      ``s_blk = e4m3(clamp(amax / 6 / tensor_scale, tiny, 448))`` (torchao's numerics: one f32 multiply per element).
    """
    x = flush_subnormals(x_blocks.astype(jnp.float32))
    nonfinite = jnp.any(~jnp.isfinite(x), axis=-1)
    amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0.0)), axis=-1)
    # torchao's two roundings, (amax / 6) / tensor_scale, each correctly rounded (divide_rn: XLA:GPU's own f32
    # division is not, and XLA rewrites divisions by scalars), so jit == eager == numpy on every backend (tested).
    block_over_max = divide_rn(amax, E2M1_MAX)  # (...)
    # The rounded scale as an f32 value from integer ops (e4m3_round: XLA:GPU would drop an f32 -> f8 -> f32 round trip
    # inside this program and divide by the unrounded scale); its f8 form is exact.
    s_value, _ = e4m3_round(jnp.clip(divide_rn(block_over_max, tensor_scale), E4M3_TINY, E4M3_MAX))  # (...)
    s_blk = s_value.astype(jnp.float8_e4m3fn)
    # One multiply per element by the reciprocal of the combined scale, the numerics of torchao's nvfp4_quantize.
    reciprocal = nvfp4_block_reciprocal(tensor_scale, s_value)  # (...)
    v = flush_subnormals(x * reciprocal[..., None])
    codes = e2m1_encode(jnp.clip(v, -E2M1_MAX, E2M1_MAX))
    codes = jnp.where(nonfinite[..., None], jnp.uint8(0), codes)
    s_blk = jnp.where(nonfinite, jnp.array(jnp.nan, jnp.float8_e4m3fn), s_blk)
    return codes, s_blk


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """``uint8 (..., d)`` 4-bit codes -> ``uint8 (..., d // 2)``: element ``2i`` low nibble, ``2i+1`` high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last axis, got shape {codes.shape}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: ``uint8 (..., d // 2)`` -> ``uint8 (..., d)``."""
    low = packed & 0xF
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------------


def _check_width(x_shape: tuple[int, ...], fmt: QuantFormat, pad: bool, what: str) -> int:
    """Returns the number of zero columns to pad (0 unless ``pad``); raises on a bad last axis."""
    if len(x_shape) == 0:
        raise ValueError(f"{what}: cannot quantize a scalar; expected shape (..., d)")
    d, block = x_shape[-1], fmt.block_size
    if d % block == 0:
        return 0
    if not pad:
        raise ValueError(
            f"{what}: {d=} must be a multiple of {block=} for {fmt.name} (shape {tuple(x_shape)}); pass pad=True to "
            "zero-pad the last axis")
    return block - d % block


def _check_dtype(x: jax.Array, what: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{what}: expected a floating dtype (float32/bfloat16/float16), got {x.dtype}")


def check_format(fmt, what: str) -> None:
    """Raises a ``TypeError`` naming ``what`` (the function and argument) unless ``fmt`` is a :class:`QuantFormat`
    (a format name such as ``"mxfp4"`` is not one: pass ``MXFP4()``)."""
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{what}: unknown quantization format {fmt!r} (expected MXFP4(...) or NVFP4(...))")


def quantize(x: jax.Array, fmt: QuantFormat = MXFP4(), *, pad: bool = False,
             tensor_scale: Optional[jax.Array] = None) -> QuantizedArray:
    """Block-quantizes ``x (..., d)`` along its last axis.

    Args:
      x: ``float32 | bfloat16 | float16 (..., d)``; empty arrays (e.g. ``(0, d)``) are valid.
      fmt: :class:`MXFP4` or :class:`NVFP4`.
      pad: zero-pad ``d`` to a multiple of the block size instead of raising.
      tensor_scale: formats with a per-tensor scale (NVFP4) only: use this ``float32 ()`` instead of
        ``fmt.tensor_scale(x)``.

    Returns:
      A :class:`QuantizedArray` with ``codes (..., d' // 2)`` and ``scales (..., d' // block)`` (``d'`` = padded d).
    """
    _check_dtype(x, "quantize")
    check_format(fmt, "quantize")
    n_pad = _check_width(x.shape, fmt, pad, "quantize")
    if tensor_scale is not None and not fmt.has_tensor_scale:
        raise ValueError(f"quantize: {fmt.name} has no per-tensor scale; tensor_scale must be None")
    packed, scales, ts = _quantize_arrays(x, None if tensor_scale is None else jnp.asarray(tensor_scale, jnp.float32),
                                          fmt, n_pad)
    return QuantizedArray(codes=packed, scales=scales, tensor_scale=ts, fmt=fmt, dtype=np.dtype(x.dtype))


# The arithmetic of quantize / dequantize / fake_quant as one jitted program each (per shape, dtype and format):
# called outside jit (calibration reports, checkpoint export, tests), the dozens of small ops would otherwise each be
# compiled and dispatched on their own; inside a jitted caller the nested jit is inlined.
@functools.partial(jax.jit, static_argnames=("fmt", "n_pad"))
def _quantize_arrays(x: jax.Array, tensor_scale: Optional[jax.Array], fmt: QuantFormat,
                     n_pad: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(packed codes (..., d' // 2), scales (..., d' // block), tensor scale float32 ())`` of ``x (..., d)``."""
    if n_pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_pad)])
    block = fmt.block_size
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    ts = fmt.tensor_scale(x) if tensor_scale is None else tensor_scale
    codes, scales = fmt.quantize_blocks(blocks, ts)
    return pack_nibbles(codes.reshape(x.shape)), scales, jnp.asarray(ts, jnp.float32)


def dequantize(q: QuantizedArray, dtype=None) -> jax.Array:
    """Reconstructs ``(..., d)`` values from a :class:`QuantizedArray` (in ``dtype``, default the input's dtype).

    The f32 reconstruction is exact (E2M1 value times a power of two / an E4M3 value); casting to bf16/f16 is exact
    too unless the value falls outside that dtype's range.
    """
    return _dequantize_values(q, np.dtype(q.dtype if dtype is None else dtype))


def as_float32(x: QuantizedArray | jax.Array | np.ndarray) -> jax.Array:
    """``x`` as float32 values of its shape: a :class:`QuantizedArray` dequantized, a dense array cast. For the
    parts of a layer that are packed or dense depending on the recipe (e.g. a LoRaQ vs an SVDQuant low-rank branch)."""
    if isinstance(x, QuantizedArray):
        return dequantize(x, jnp.float32)
    return jnp.asarray(x).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_values(q: QuantizedArray, dtype: np.dtype) -> jax.Array:
    block = q.fmt.block_size
    codes = unpack_nibbles(q.codes)
    codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // block, block)
    values = q.fmt.dequantize_blocks(codes, q.scales, q.tensor_scale)
    return values.reshape(q.shape).astype(dtype)


SteMode = Literal["identity", "clipped"]


def _fake_quant_forward(x: jax.Array, fmt: QuantFormat, pad: bool) -> tuple[jax.Array, jax.Array]:
    """Returns (fake-quantized x in x.dtype, saturation mask (bool, same shape))."""
    q = quantize(x, fmt, pad=pad)
    d = x.shape[-1]
    x_hat = dequantize(q, jnp.float32)[..., :d]
    padded = q.scales.shape[-1] * fmt.block_size
    xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, padded - d)])
    blocks = xf.reshape(*x.shape[:-1], q.scales.shape[-1], fmt.block_size)
    saturated = fmt.saturated(blocks, q.scales, q.tensor_scale).reshape(*x.shape[:-1], padded)[..., :d]
    return x_hat.astype(x.dtype), saturated


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fake_quant_ste(x, fmt, ste, pad):
    return _fake_quant_forward(x, fmt, pad)[0]


def _fake_quant_ste_fwd(x, fmt, ste, pad):
    x_hat, saturated = _fake_quant_forward(x, fmt, pad)
    return x_hat, (saturated if ste == "clipped" else None)


def _fake_quant_ste_bwd(fmt, ste, pad, saturated, g):
    if ste == "clipped":
        g = jnp.where(saturated, jnp.zeros_like(g), g)
    return (g,)


_fake_quant_ste.defvjp(_fake_quant_ste_fwd, _fake_quant_ste_bwd)
_fake_quant_jit = jax.jit(_fake_quant_ste, static_argnums=(1, 2, 3))


def fake_quant(x: jax.Array, fmt: QuantFormat = MXFP4(), *, ste: SteMode = "identity", pad: bool = False) -> jax.Array:
    """Quantize-then-dequantize ``x (..., d)`` (the paper's ``Q_b``), same shape and dtype, differentiable by STE.

    Args:
      x: ``float32 | bfloat16 | float16 (..., d)``.
      fmt: :class:`MXFP4` or :class:`NVFP4`.
      ste: backward rule: ``"identity"`` (plain straight-through) or ``"clipped"`` (zero gradient where the quantizer
        clipped the element, i.e. ``|x| > 6 * block_scale``: :meth:`QuantFormat.saturated`).
      pad: zero-pad the last axis to a block multiple internally (output keeps ``d`` columns).

    The result is in ``x.dtype``: with MXFP4's CEIL / EVEN / RCEIL scale modes a finite value within a block exponent
    of the dtype's largest (f32 near ``2**128``, f16 near 65504) can round up to ``inf``, as the exact (float64)
    quantizer and torchao's do; FLOOR, the default, never rounds up past the block's largest value.
    """
    _check_dtype(x, "fake_quant")
    check_format(fmt, "fake_quant")
    _check_width(x.shape, fmt, pad, "fake_quant")
    if ste not in ("identity", "clipped"):
        raise ValueError(f"ste={ste!r} must be 'identity' or 'clipped'")
    return _fake_quant_jit(x, fmt, ste, pad)


def check_finite(x, name: str) -> None:
    """Raises ``ValueError`` naming ``name`` if ``x`` (host or device array) holds NaN or Inf.

    For host-side entry points (calibration data, checkpoint loading); inside jitted code the NaN scale policy applies.
    """
    arr = np.asarray(jax.device_get(x))
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.kind != "V":
        arr = arr.astype(np.float32)
    bad = ~np.isfinite(arr.astype(np.float32))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}: {int(bad.sum())} non-finite value(s) (NaN/Inf) in array of shape {arr.shape}, first at index "
            f"{first}")
