"""MXFP4 rows re-encoded exactly as FP8 E4M3 bytes plus one power of two per row; FP8 per-token activations.

Hopper has FP8 tensor cores but no FP4 ones. An MXFP4 value is ``e2m1 * 2**e_blk`` (``e_blk`` the block's E8M0
exponent). Against one reference exponent ``e_ref`` per row, ``e2m1 * 2**(e_blk - e_ref)`` is exactly a
``float8_e4m3fn`` value whenever the block offset ``o = e_blk - e_ref`` lies in ``[-8, 6]``:

* E2M1 magnitudes are ``{0.5, 1, 1.5, 2, 3, 4, 6} = {1, 2, 3, 4, 6, 8, 12} * 2**-1``: at most 2 significant bits;
* E4M3 holds every value with at most 4 significant bits and exponent in ``[-6, 8]`` (normals, up to 448), and every
  multiple of ``2**-9`` below ``2**-6`` (subnormals);
* the largest, ``6 * 2**6 = 384``, is ``<= 448``; the smallest, ``0.5 * 2**-8 = 2**-9``, is the smallest subnormal,
  and ``1.5 * 2**-8 = 3 * 2**-9`` is a subnormal too. So every code at every offset in ``[-8, 6]`` is exact (tested
  for all 16 codes x all 15 offsets).

``e_ref`` is chosen per row so that the row's largest nonzero block sits at offset ``+6``: large values are never
clipped, and blocks down to 14 binades below the largest are exact. A row fits iff its **span** (largest minus
smallest block exponent over its nonzero blocks) is ``<= 14``.

**Out-of-range policy** (a nonzero block at offset ``< -8``): its elements are rounded to the nearest E4M3 value
(ties to even; below ``2**-10`` to zero). The absolute error of an element is at most ``2**-10 * 2**e_ref``
(half the subnormal spacing), i.e. ``<= 2**-16 * 2**e_max`` with ``e_max`` the row's largest block exponent; since the
row's largest element is at least ``0.5 * 2**e_max`` (``4 * 2**e_max`` for blocks quantized with the FLOOR / EVEN
scale rules, whose amax code is 4 or 6), the error is ``<= 2**-15`` (FLOOR / EVEN: ``<= 2**-18``) of the row's largest
magnitude. It is never silent: :class:`Fp8Rows` carries ``inexact``, the number of elements whose E4M3 value differs
from their MXFP4 value, and :func:`row_spans` gives each row's span.

**Special values** (consistent with :mod:`kroquant_jax.formats`): a NaN block (E8M0 byte ``0xFF``) becomes E4M3 NaN
bytes and makes its row's scale NaN, so the row dequantizes to NaN and every GEMM output it touches is NaN (as the
dequantized product's is); it does not count towards the span or ``inexact``. Elements whose MXFP4 value is an f32
subnormal (scale byte 0: codes 0.5, 1, 1.5; byte 1: code 0.5), which :func:`~kroquant_jax.formats.dequantize` flushes to
zero, are encoded as zero. ``e_ref`` is taken from the E8M0 bytes alone (the largest non-NaN byte; an all-zero block has
byte 0) and clamped to ``[-126, 127]`` so that the row scale ``2**e_ref`` is a normal f32 (this only lowers offsets,
never clips).

**W4A8 activations** (:func:`per_token_e4m3`): no MXFP4 step; per row ``scale = amax / 448`` (f32, correctly rounded),
``values = e4m3(x * (448 / amax))`` (round to nearest even, saturated at 448). Rows holding NaN or Inf get a NaN scale.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import formats as F
from kroquant_jax.formats import MXFP4, QuantizedArray

__all__ = [
    "E4M3_MIN_OFFSET",
    "E4M3_SPAN",
    "ARITHMETICS",
    "E4M3_TOP_OFFSET",
    "Fp8Rows",
    "GROUP_GAP",
    "block_exponents",
    "dequantize_rows",
    "e4m3_bits",
    "even_odd_columns",
    "mxfp4_to_e4m3",
    "natural_columns",
    "per_token_e4m3",
    "pow2",
    "reference_exponent",
    "row_reference_exponent",
    "row_spans",
    "span_stats",
]

#: The offset of the row's largest block: ``6 * 2**6 = 384 <= 448``.
E4M3_TOP_OFFSET = 6
#: The smallest offset at which every E2M1 code is exact: ``0.5 * 2**-8 = 2**-9``, E4M3's smallest subnormal.
E4M3_MIN_OFFSET = -8
#: Largest span (in binades) of block exponents a row may have and still be re-encoded exactly.
E4M3_SPAN = E4M3_TOP_OFFSET - E4M3_MIN_OFFSET
_NO_BLOCK = -(2**20)  # "no nonzero block" sentinel for the max/min reductions
_NAN_BYTE = 0x7F  # float8_e4m3fn NaN
_F32_HALF_BITS = 0x3F000000  # 0.5
_F32_2P14_BITS = 0x46800000  # 2**14
_F32_2PM6_BITS = 0x3C800000  # 2**-6, E4M3's smallest normal
_E2M1_FLOOR_LOG2 = np.array([127, -1, 0, 0, 1, 1, 2, 2], np.int32)  # magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scale", "inexact"),
                   meta_fields=("order",))
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """FP8 rows with one f32 factor per row, or per group of ``g`` consecutive values of a row:
    ``x[..., j] = f32(values[..., j]) * scale[...]`` (``scale (...)``), or ``* scale[..., j // g]``
    (``scale (..., d/g)``, :attr:`group` ``= g``; ``j`` counts in the values' own column order).

    Attributes:
      values: ``float8_e4m3fn (..., d)``.
      scale: ``float32 (...)`` or ``(..., d/g)``: ``2**e_ref`` exactly for re-encoded MXFP4 rows or row groups
        (:func:`mxfp4_to_e4m3`; 0 for a group without a live element), ``amax / 448`` for per-token activations
        (:func:`per_token_e4m3`); NaN for rows (groups) that hold a non-finite value.
      inexact: ``int32 ()``: elements whose E4M3 value differs from the value they encode (MXFP4: 0 when every row's
        span is ``<= 14``; per-token: always 0, the rounding is the format's own); -1 when not counted.
      order: the column order of ``values`` (static): ``"natural"``, or ``"even_odd"``: the even elements
        ``0, 2, 4, ...`` then the odd ones (the low nibbles of the packed codes, then the high ones: no interleave).
        A GEMM sums over K, so operands in the same order give the same product.
    """

    values: jax.Array
    scale: jax.Array
    inexact: jax.Array
    order: str = "natural"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def group(self) -> Optional[int]:
        """Values per scale (``g``) when the scales are per row group, None when there is one per row."""
        if self.scale.ndim < self.values.ndim:
            return None
        return self.values.shape[-1] // self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        """Storage: one byte per element plus 4 per row or row group (``inexact`` not counted)."""
        return int(self.values.size + self.scale.size * 4)

    def with_zero_row_factors(self) -> "Fp8Rows":
        """The same rows with factor 0 for each row whose values are all zero (one factor per row only).

        :func:`mxfp4_to_e4m3` gives such a row the clamped ``2**-126`` (any factor is exact for it). A consumer that
        divides by the factor (the fused FP8 kernel's low-rank operand ``L / sw``, ``pallas_kernels.fp8_gemm_mgpu``)
        would scale that row's branch by ``2**126`` and overflow; it replaces a zero factor by 1 instead. Reads every
        value: for a weight, once, when it is prepared."""
        if self.group is not None:
            raise ValueError(f"with_zero_row_factors: rows with one factor per group of {self.group} already give an "
                             "empty group factor 0")
        empty = jnp.all(self.values.astype(jnp.float32) == 0, axis=-1)  # (...)
        return dataclasses.replace(self, scale=jnp.where(empty, jnp.zeros_like(self.scale), self.scale))


def _check_mxfp4(q: QuantizedArray, what: str) -> None:
    if not isinstance(q, QuantizedArray) or not isinstance(q.fmt, MXFP4):
        fmt = getattr(q, "fmt", type(q).__name__)
        raise TypeError(f"{what}: needs an MXFP4 QuantizedArray, got {fmt!r} (NVFP4 values e2m1 * e4m3 are not exact "
                        f"in E4M3; use the dequant strategy for NVFP4)")
    if len(q.shape) < 1 or q.shape[-1] == 0:
        raise ValueError(f"{what}: empty last axis in shape {q.shape}")


def _codes_blocks(q: QuantizedArray) -> jax.Array:
    """``uint8 (..., nb, block)`` unpacked codes."""
    codes = F.unpack_nibbles(q.codes)
    return codes.reshape(*codes.shape[:-1], q.scales.shape[-1], q.fmt.block_size)


def _live_codes(q: QuantizedArray) -> jax.Array:
    """Unpacked codes ``(..., nb, block)`` with the elements that ``formats.dequantize`` flushes to zero (f32
    subnormal values: scale byte 0; code 0.5 of byte 1) and NaN blocks set to code 0."""
    codes = _codes_blocks(q)
    b = q.scales.astype(jnp.int32)[..., None]
    # floor(log2 |e2m1|) per magnitude index (index 0 = zero: never flushed); the value is an f32 subnormal iff
    # floor(log2 |e2m1|) + e_blk < -126
    floor_log2 = jnp.asarray(_E2M1_FLOOR_LOG2)[(codes & 7).astype(jnp.int32)]
    flushed = (floor_log2 + b - F.E8M0_BIAS < -126) | (b == F.E8M0_NAN)
    return jnp.where(flushed, jnp.uint8(0), codes)


def block_exponents(q: QuantizedArray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(e_blk int32 (..., nb), live bool (..., nb), nan bool (..., nb))``: each block's unbiased E8M0 exponent, whether
    it holds a nonzero (unflushed) element, whether it is a NaN block."""
    _check_mxfp4(q, "block_exponents")
    live = jnp.any((_live_codes(q) & 7) != 0, axis=-1)
    return q.scales.astype(jnp.int32) - F.E8M0_BIAS, live, q.scales == F.E8M0_NAN


def _max_exponent(q: QuantizedArray) -> jax.Array:
    """Largest block exponent of each row over its non-NaN blocks (``int32 (...)``; -127 for all-zero rows), from the
    E8M0 bytes alone. An all-zero block has byte 0, the smallest, and a block of quantized data with a larger byte
    holds a nonzero code (FLOOR/EVEN: its amax code is 4 or 6), so this is the largest live block of quantizer output;
    for other arrays a larger all-zero block only lowers the others' offsets (counted by the policy, never silent)."""
    b = q.scales.astype(jnp.int32)
    return jnp.max(jnp.where(b == F.E8M0_NAN, 0, b), axis=-1) - F.E8M0_BIAS


def reference_exponent(max_byte: jax.Array) -> jax.Array:
    """``e_ref int32`` from a row's largest non-NaN E8M0 byte (``int32``; 0 for a row without blocks above zero):
    ``max_byte - 127 - 6`` clamped to ``[-126, 127]``. The one rule, shared by :func:`row_reference_exponent` and the
    quantizer kernels' FP8 output mode (which take ``max_byte`` from their own block scales)."""
    return jnp.clip(max_byte.astype(jnp.int32) - F.E8M0_BIAS - E4M3_TOP_OFFSET, -126, 127).astype(jnp.int32)


def row_reference_exponent(q: QuantizedArray) -> jax.Array:
    """``e_ref int32 (...)``: each row's largest non-NaN block exponent minus 6, clamped to ``[-126, 127]`` (so an
    all-zero row gets -126)."""
    _check_mxfp4(q, "row_reference_exponent")
    return reference_exponent(_max_exponent(q) + F.E8M0_BIAS)


def row_spans(q: QuantizedArray) -> jax.Array:
    """``int32 (...)``: the row's largest block exponent (:func:`row_reference_exponent`'s) minus its smallest live
    block exponent (0 for rows without live blocks). A row is re-encoded exactly iff its span is ``<= E4M3_SPAN``
    (14)."""
    e, live, _ = block_exponents(q)
    e_max = _max_exponent(q)
    e_min = jnp.min(jnp.where(live, e, -_NO_BLOCK), axis=-1)
    return jnp.where(jnp.any(live, axis=-1), e_max - e_min, 0).astype(jnp.int32)


def pow2(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` f32 from bits, ``e`` int32 in ``[-126, 127]``."""
    return jax.lax.bitcast_convert_type((e + 127).astype(jnp.int32) << 23, jnp.float32)


ORDERS = ("natural", "even_odd")


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order={order!r} must be one of {ORDERS}")


#: How :func:`e4m3_bits` computes the pattern: ``"integer"`` (integer ops and one f32 add: any backend and the
#: Pallas kernels) or ``"convert"`` (the exact f32 value from bits, then one f32 -> E4M3 conversion, round to nearest
#: even: Hopper's ``cvt`` instruction under XLA). The same bits either way (tested for every code, byte and offset).
ARITHMETICS = ("integer", "convert")


def e4m3_bits(nibbles: jax.Array, scale_byte: jax.Array, e_ref: jax.Array, *, arithmetic: str = "integer"
              ) -> jax.Array:
    """The E4M3 bit pattern of one MXFP4 element against its row's reference exponent (:data:`ARITHMETICS`).

    Args (broadcast together, any shape, integer dtypes): ``nibbles``: the E2M1 code (low 4 bits); ``scale_byte``: its
    block's E8M0 byte; ``e_ref``: the row's reference exponent (:func:`reference_exponent`), with
    ``scale_byte - 127 - e_ref <= 6`` for every non-NaN block (true for the row's own ``e_ref``).

    Returns ``int32`` in ``[0, 255]``: ``e4m3(e2m1(code) * 2**(e_blk - e_ref))``, exact for offsets in ``[-8, 6]``,
    rounded to the nearest subnormal (ties to even; below ``2**-10`` to a signed zero) below (the out-of-range policy);
    ``0`` for elements that ``formats.dequantize`` flushes (f32 subnormal values), ``0x7F`` (NaN) for NaN blocks.
    The one home of the re-encoding's arithmetic: :func:`mxfp4_to_e4m3` and the quantizer kernels' FP8 output mode
    (``pallas_kernels.transform_quantize``) call it, so both write the same bytes.
    """
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"e4m3_bits: arithmetic={arithmetic!r} must be one of {ARITHMETICS}")
    nib = jnp.asarray(nibbles).astype(jnp.int32)
    byte = jnp.asarray(scale_byte).astype(jnp.int32)
    mag_idx = nib & 7
    # |e2m1| as f32 bits: 0, 0.5 (index 1), then (index << 22) + bits(0.5) = 1, 1.5, 2, 3, 4, 6
    mag_bits = jnp.where(mag_idx < 2, mag_idx * _F32_HALF_BITS, (mag_idx << 22) + _F32_HALF_BITS)
    # |e2m1| * 2**offset, a normal f32: offsets below -30 round every value to zero anyway (6 * 2**-30 < 2**-10)
    offset = jnp.clip(byte - F.E8M0_BIAS - jnp.asarray(e_ref).astype(jnp.int32), -30, E4M3_TOP_OFFSET + 1)
    v_bits = mag_bits + (offset << 23)
    # formats.dequantize flushes values below 2**-126 (floor(log2 |e2m1|) + e_blk < -126) to +0
    flushed = (mag_idx != 0) & ((mag_bits >> 23) + byte < 2 * F.E8M0_BIAS - 126)
    if arithmetic == "convert":
        signed = jnp.where(mag_idx == 0, 0, v_bits) | ((nib & 8) << 28)  # the exact value, its sign
        value = jax.lax.bitcast_convert_type(signed, jnp.float32).astype(jnp.float8_e4m3fn)
        bits = jnp.where(flushed, 0, jax.lax.bitcast_convert_type(value, jnp.uint8).astype(jnp.int32))
        return jnp.where(byte == F.E8M0_NAN, _NAN_BYTE, bits)
    normal = (v_bits >> 20) - (120 << 3)  # E4M3 exponent field = f32's - 120; <= 2 significant bits: no rounding
    # below 2**-6 (E4M3 subnormals): adding 2**14, whose f32 ulp is 2**-9, rounds to a multiple of 2**-9 (nearest,
    # ties to even); the bits above 2**14's are that multiple
    sub = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(v_bits, jnp.float32) + jnp.float32(2.0**14),
                                       jnp.int32) - _F32_2P14_BITS
    mag = jnp.where(mag_idx == 0, 0, jnp.where(v_bits >= _F32_2PM6_BITS, normal, sub))
    bits = jnp.where(flushed, 0, mag | ((nib & 8) << 4))
    return jnp.where(byte == F.E8M0_NAN, _NAN_BYTE, bits)


def _bits_to_e4m3(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn)


def _exact_values(nib: jax.Array, byte: jax.Array, offset: jax.Array) -> jax.Array:
    """Per element, the f32 value that :func:`e4m3_bits` encodes, in units of ``2**e_ref`` (0 for flushed elements
    and NaN blocks): what the ``inexact`` count compares against."""
    floor_log2 = jnp.asarray(_E2M1_FLOOR_LOG2)[nib & 7]
    dead = (floor_log2 + byte - F.E8M0_BIAS < -126) | (byte == F.E8M0_NAN)
    return jnp.where(dead, 0.0, F.e2m1_decode(nib) * pow2(offset))  # <= 2 significant bits, exponent >= -31: exact


#: Binades by which a row group's reference exponent may lie below the previous live group's (``group=``): a GEMM
#: that keeps its accumulator in the units of the current group rescales it by at most ``2**GROUP_GAP`` per step,
#: far inside f32's range for any sum of E4M3 products.
GROUP_GAP = 64


def _group_reference_exponents(q: QuantizedArray, order: str, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(e_ref int32 (..., G), live bool (..., G), nan bool (..., G))`` per group of ``group`` values in ``order``,
    ``G = d / group``: each group's largest non-NaN block exponent minus 6, raised to at least
    ``max_{j<k}(e_j - GROUP_GAP (k - j))`` over the row's earlier live groups (a scan in the values' order)."""
    bs = q.fmt.block_size
    d = q.shape[-1]
    span = group if order == "natural" else 2 * group  # original columns per group
    if group <= 0 or span % bs or (d if order == "natural" else d // 2) % group:
        raise ValueError(f"mxfp4_to_e4m3: {group=} must be a multiple of {bs if order == 'natural' else bs // 2} "
                         f"dividing {'d' if order == 'natural' else 'd/2'} ({d=}, {order=}, block size {bs})")
    _, live_b, nan_b = block_exponents(q)  # (..., nb)
    b = q.scales.astype(jnp.int32)
    per = span // bs
    shape = (*b.shape[:-1], b.shape[-1] // per, per)
    max_byte = jnp.max(jnp.where(nan_b | ~live_b, 0, b).reshape(shape), axis=-1)  # (..., G0)
    live = jnp.any(live_b.reshape(shape), axis=-1)
    nan = jnp.any(nan_b.reshape(shape), axis=-1)
    if order == "even_odd":  # the odd half's groups read the same blocks as the even half's
        max_byte, live, nan = (jnp.concatenate([x, x], axis=-1) for x in (max_byte, live, nan))
    e = reference_exponent(max_byte)
    k = jnp.arange(e.shape[-1], dtype=jnp.int32)
    lifted = jax.lax.cummax(jnp.where(live, e + GROUP_GAP * k, _NO_BLOCK), axis=e.ndim - 1) - GROUP_GAP * k
    return jnp.where(live, jnp.maximum(e, lifted), e).astype(jnp.int32), live, nan


def mxfp4_to_e4m3(q: QuantizedArray, *, order: str = "natural", count_inexact: bool = True,
                  arithmetic: str = "integer", group: Optional[int] = None) -> Fp8Rows:
    """Re-encode MXFP4 rows ``(..., d)`` as E4M3 bytes ``(..., d)`` and one power of two per row (or per ``group``).

    ``value[..., j] = e2m1(code) * 2**(e_blk - e_ref)`` rounded to E4M3 (exact for block offsets in ``[-8, 6]``; the
    out-of-range policy of the module docstring otherwise; :func:`e4m3_bits`), ``scale = 2**e_ref``.
    ``order="even_odd"`` writes the low nibbles then the high nibbles (no interleave; see :class:`Fp8Rows`).
    ``group``: one reference exponent per ``group`` consecutive values in ``order`` instead of per row (scales
    ``(..., d/group)``; DeepGEMM's 1 x 128 activation scales): each group's own largest block at +6, so a group is
    exact whenever its own blocks span at most 14 binades, and no reduction over the whole row is needed. A group
    without a live element gets scale 0 (its bytes are 0), a group with a NaN block NaN, and a group's exponent is
    raised to at most :data:`GROUP_GAP` binades below the row's earlier live groups (what it flushes is counted).
    ``count_inexact``: count the elements the rounding changed (one more reduction over the row; ``inexact = -1``
    without). ``arithmetic``: :data:`ARITHMETICS` (the same bytes). Any MXFP4 block size; pure jnp (elementwise over
    the packed bytes plus a reduction over the row's scale bytes).
    """
    _check_mxfp4(q, "mxfp4_to_e4m3")
    _check_order(order)
    per_block = q.fmt.block_size // 2  # bytes per block
    b = q.scales.astype(jnp.int32)  # (..., nb)
    byte_b = jnp.repeat(b, per_block, axis=-1)  # (..., d/2)
    if group is None:
        e_ref = row_reference_exponent(q)  # (...)
        e_lo = e_hi = e_ref[..., None]
    else:
        e_ref, g_live, g_nan = _group_reference_exponents(q, order, group)  # (..., G)
        if order == "natural":  # element 2i + p sits at column 2i + p: pairs never straddle groups (group even)
            e_lo = e_hi = jnp.repeat(e_ref, group // 2, axis=-1)
        else:
            e_lo, e_hi = (jnp.repeat(half, group, axis=-1) for half in jnp.split(e_ref, 2, axis=-1))
    codes = q.codes.astype(jnp.int32)
    lo_nib, hi_nib = codes & 15, codes >> 4  # elements 2i, 2i + 1
    lo = _bits_to_e4m3(e4m3_bits(lo_nib, byte_b, e_lo, arithmetic=arithmetic))
    hi = _bits_to_e4m3(e4m3_bits(hi_nib, byte_b, e_hi, arithmetic=arithmetic))
    if order == "even_odd":
        values = jnp.concatenate([lo, hi], axis=-1)
    else:
        values = jax.lax.stack([lo, hi], axis=lo.ndim).reshape(*lo.shape[:-1], -1) if lo.ndim else lo
    inexact = jnp.int32(-1)
    if count_inexact:
        # Offsets below -30 round every E2M1 value to zero (6 * 2**-30 < 2**-10): clip so that 2**o is a normal f32.
        nan_byte = byte_b == F.E8M0_NAN
        inexact = sum(jnp.sum(((v.astype(jnp.float32)
                                != _exact_values(nib, byte_b, jnp.clip(byte_b - F.E8M0_BIAS - e, -30, 127)))
                               & ~nan_byte).astype(jnp.int32))
                      for v, nib, e in ((lo, lo_nib, e_lo), (hi, hi_nib, e_hi)))
    if group is None:
        scale = jnp.where(jnp.any(b == F.E8M0_NAN, axis=-1), jnp.nan, pow2(e_ref))
    else:
        scale = jnp.where(g_nan, jnp.nan, jnp.where(g_live, pow2(e_ref), 0.0))
    return Fp8Rows(values=values, scale=scale, inexact=inexact, order=order)


def natural_columns(values: jax.Array, order: str) -> jax.Array:
    """``values (..., d)`` in ``order`` -> natural column order."""
    _check_order(order)
    if order == "natural":
        return values
    half = values.shape[-1] // 2
    return jax.lax.stack([values[..., :half], values[..., half:]], axis=values.ndim).reshape(values.shape)


def even_odd_columns(x: jax.Array) -> jax.Array:
    """``x (..., d)`` -> ``[x[..., 0::2] | x[..., 1::2]]`` (the ``"even_odd"`` order)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def dequantize_rows(rows: Fp8Rows, dtype=jnp.float32) -> jax.Array:
    """``f32(values) * scale`` (per row, or per row group: :class:`Fp8Rows`) in ``dtype``, columns in natural order
    (exact in f32 for re-encoded MXFP4 rows unless the product is an f32 subnormal)."""
    factor = rows.scale[..., None] if rows.group is None else jnp.repeat(rows.scale, rows.group, axis=-1)
    values = rows.values.astype(jnp.float32) * factor
    return natural_columns(values, rows.order).astype(dtype)


def per_token_e4m3(x: jax.Array, *, order: str = "natural") -> Fp8Rows:
    """W4A8 activations: ``x (..., d)`` -> E4M3 ``(..., d)`` with ``scale = amax_row / 448`` (f32 ``(...)``).

    ``values = e4m3(clip(x * (448 / amax), +-448))``; all-zero rows get scale 1; rows with NaN/Inf a NaN scale (and
    their finite elements encoded against the finite amax), so the row is visibly NaN downstream. ``order``: the
    column order of the values (see :class:`Fp8Rows`).
    """
    _check_order(order)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"per_token_e4m3: expected a floating dtype (float32/bfloat16/float16), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"per_token_e4m3: empty last axis in shape {x.shape}")
    xf = x.astype(jnp.float32)
    finite = jnp.isfinite(xf)
    amax = jnp.max(jnp.abs(jnp.where(finite, xf, 0.0)), axis=-1)
    ok = amax > 0
    # at least 448 * 2**-126: below it 448 / amax overflows f32 (a row of tiny normal values came back as +-448 and
    # its zeros as NaN) and amax / 448 is subnormal; such rows get scale 2**-126 and their values below 448
    safe = jnp.where(ok, jnp.maximum(amax, jnp.float32(F.E4M3_MAX * 2.0**-126)), 1.0)
    scale = jnp.where(ok, F.divide_rn(safe, F.E4M3_MAX), 1.0)
    inv = jnp.where(ok, F.divide_rn(jnp.float32(F.E4M3_MAX), safe), 1.0)
    v = jnp.clip(jnp.where(finite, xf, 0.0) * inv[..., None], -F.E4M3_MAX, F.E4M3_MAX)
    scale = jnp.where(jnp.all(finite, axis=-1), scale, jnp.nan)
    if order == "even_odd":
        v = even_odd_columns(v)
    return Fp8Rows(values=v.astype(jnp.float8_e4m3fn), scale=scale, inexact=jnp.int32(0), order=order)


@jax.jit
def _span_arrays(q: QuantizedArray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`span_stats`' device work as one compiled program per shape: (row spans, NaN rows, inexact elements)."""
    _, _, nan_blk = block_exponents(q)
    return row_spans(q), jnp.sum(jnp.any(nan_blk, axis=-1)), mxfp4_to_e4m3(q).inexact


def span_stats(q: QuantizedArray) -> dict:
    """Host-side summary of a re-encoding: ``rows``, ``rows_in_range`` (span ``<= 14``), ``fraction_in_range``,
    ``max_span``, ``span_histogram`` (``{span: rows}``), ``inexact_elements``, ``elements``, ``nan_rows``."""
    spans, nan_rows, inexact = jax.device_get(_span_arrays(q))
    spans, nan_rows = np.asarray(spans).reshape(-1), int(nan_rows)
    rows = int(spans.size)
    inside = int((spans <= E4M3_SPAN).sum())
    vals, counts = np.unique(spans, return_counts=True)
    return {"rows": rows, "rows_in_range": inside, "fraction_in_range": inside / max(rows, 1),
            "max_span": int(spans.max()) if rows else 0,
            "span_histogram": {int(v): int(c) for v, c in zip(vals, counts)},
            "inexact_elements": int(inexact), "elements": int(np.prod(q.shape)),
            "nan_rows": nan_rows}
