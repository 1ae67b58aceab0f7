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
zero, are encoded as zero. All-zero rows get ``e_ref = 0``. ``e_ref`` is clamped to ``[-126, 127]`` so that the row
scale ``2**e_ref`` is a normal f32 (this only lowers offsets, never clips).

**W4A8 activations** (:func:`per_token_e4m3`): no MXFP4 step; per row ``scale = amax / 448`` (f32, correctly rounded),
``values = e4m3(x * (448 / amax))`` (round to nearest even, saturated at 448). Rows holding NaN or Inf get a NaN scale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import formats as F
from kroquant_jax.formats import MXFP4, QuantizedArray

__all__ = [
    "E4M3_MIN_OFFSET",
    "E4M3_SPAN",
    "E4M3_TOP_OFFSET",
    "Fp8Rows",
    "block_exponents",
    "dequantize_rows",
    "mxfp4_to_e4m3",
    "per_token_e4m3",
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
_E2M1_FLOOR_LOG2 = np.array([127, -1, 0, 0, 1, 1, 2, 2], np.int32)  # magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scale", "inexact"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """FP8 rows with one f32 factor per row: ``x[..., j] = f32(values[..., j]) * scale[...]``.

    Attributes:
      values: ``float8_e4m3fn (..., d)``.
      scale: ``float32 (...)``: ``2**e_ref`` exactly for re-encoded MXFP4 rows (:func:`mxfp4_to_e4m3`), ``amax / 448``
        for per-token activations (:func:`per_token_e4m3`); NaN for rows that hold a non-finite value.
      inexact: ``int32 ()``: elements whose E4M3 value differs from the value they encode (MXFP4: 0 when every row's
        span is ``<= 14``; per-token: always 0, the rounding is the format's own).
    """

    values: jax.Array
    scale: jax.Array
    inexact: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Storage: one byte per element plus 4 per row (``inexact`` not counted)."""
        return int(self.values.size + self.scale.size * 4)


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


def row_reference_exponent(q: QuantizedArray) -> jax.Array:
    """``e_ref int32 (...)``: the largest live block exponent of each row minus 6, clamped to ``[-126, 127]``; 0 for a
    row with no live block."""
    e, live, _ = block_exponents(q)
    e_max = jnp.max(jnp.where(live, e, _NO_BLOCK), axis=-1)
    return jnp.where(e_max == _NO_BLOCK, 0, jnp.clip(e_max - E4M3_TOP_OFFSET, -126, 127)).astype(jnp.int32)


def row_spans(q: QuantizedArray) -> jax.Array:
    """``int32 (...)``: largest minus smallest live block exponent per row (0 for rows with at most one live block).
    A row is re-encoded exactly iff its span is ``<= E4M3_SPAN`` (14)."""
    e, live, _ = block_exponents(q)
    e_max = jnp.max(jnp.where(live, e, _NO_BLOCK), axis=-1)
    e_min = jnp.min(jnp.where(live, e, -_NO_BLOCK), axis=-1)
    return jnp.where(e_max == _NO_BLOCK, 0, e_max - e_min).astype(jnp.int32)


def _pow2(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` f32 from bits, ``e`` int32 in ``[-126, 127]``."""
    return jax.lax.bitcast_convert_type((e + 127).astype(jnp.int32) << 23, jnp.float32)


def mxfp4_to_e4m3(q: QuantizedArray) -> Fp8Rows:
    """Re-encode MXFP4 rows ``(..., d)`` as E4M3 bytes ``(..., d)`` and one power of two per row.

    ``value[..., j] = e2m1(code) * 2**(e_blk - e_ref)`` rounded to E4M3 (exact for block offsets in ``[-8, 6]``; the
    out-of-range policy of the module docstring otherwise), ``scale = 2**e_ref``; ``inexact`` counts the elements the
    rounding changed. Any MXFP4 block size; pure jnp (one XLA fusion per operand on a GPU).
    """
    _check_mxfp4(q, "mxfp4_to_e4m3")
    codes = _live_codes(q)  # (..., nb, block)
    e, live, nan_blk = block_exponents(q)
    e_ref = row_reference_exponent(q)  # (...)
    # Offsets below -30 round every E2M1 value to zero (6 * 2**-30 < 2**-10): clip so that 2**o is a normal f32.
    offset = jnp.clip(e - e_ref[..., None], -30, 127)  # (..., nb)
    exact_value = F.e2m1_decode(codes) * _pow2(offset)[..., None]  # exact f32 (<= 2 bits, exponent >= -31)
    exact_value = jnp.where(live[..., None], exact_value, jnp.zeros_like(exact_value))
    values = exact_value.astype(jnp.float8_e4m3fn)  # round to nearest even; exact where the offset is in range
    inexact = jnp.sum((values.astype(jnp.float32) != exact_value).astype(jnp.int32))
    nan_bits = jax.lax.bitcast_convert_type(jnp.full(values.shape, _NAN_BYTE, jnp.uint8), jnp.float8_e4m3fn)
    values = jnp.where(nan_blk[..., None], nan_bits, values)
    values = values.reshape(*values.shape[:-2], -1)
    scale = jnp.where(jnp.any(nan_blk, axis=-1), jnp.nan, _pow2(e_ref))
    return Fp8Rows(values=values, scale=scale, inexact=inexact)


def dequantize_rows(rows: Fp8Rows, dtype=jnp.float32) -> jax.Array:
    """``f32(values) * scale[..., None]`` in ``dtype`` (exact in f32 for re-encoded MXFP4 rows unless the product
    is an f32 subnormal)."""
    return (rows.values.astype(jnp.float32) * rows.scale[..., None]).astype(dtype)


def per_token_e4m3(x: jax.Array) -> Fp8Rows:
    """W4A8 activations: ``x (..., d)`` -> E4M3 ``(..., d)`` with ``scale = amax_row / 448`` (f32 ``(...)``).

    ``values = e4m3(clip(x * (448 / amax), +-448))``; all-zero rows get scale 1; rows with NaN/Inf a NaN scale (and
    their finite elements encoded against the finite amax), so the row is visibly NaN downstream.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"per_token_e4m3: expected a floating dtype (float32/bfloat16/float16), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"per_token_e4m3: empty last axis in shape {x.shape}")
    xf = x.astype(jnp.float32)
    finite = jnp.isfinite(xf)
    amax = jnp.max(jnp.abs(jnp.where(finite, xf, 0.0)), axis=-1)
    ok = amax > 0
    safe = jnp.where(ok, amax, 1.0)
    scale = jnp.where(ok, F.divide_rn(safe, F.E4M3_MAX), 1.0)
    inv = jnp.where(ok, F.divide_rn(jnp.float32(F.E4M3_MAX), safe), 1.0)
    v = jnp.clip(jnp.where(finite, xf, 0.0) * inv[..., None], -F.E4M3_MAX, F.E4M3_MAX)
    scale = jnp.where(jnp.all(finite, axis=-1), scale, jnp.nan)
    return Fp8Rows(values=v.astype(jnp.float8_e4m3fn), scale=scale, inexact=jnp.int32(0))


def span_stats(q: QuantizedArray) -> dict:
    """Host-side summary of a re-encoding: ``rows``, ``rows_in_range`` (span ``<= 14``), ``fraction_in_range``,
    ``max_span``, ``span_histogram`` (``{span: rows}``), ``inexact_elements``, ``elements``, ``nan_rows``."""
    spans = np.asarray(jax.device_get(row_spans(q))).reshape(-1)
    _, _, nan_blk = block_exponents(q)
    nan_rows = int(np.asarray(jnp.any(nan_blk, axis=-1)).sum())
    rows = int(spans.size)
    inside = int((spans <= E4M3_SPAN).sum())
    vals, counts = np.unique(spans, return_counts=True)
    return {"rows": rows, "rows_in_range": inside, "fraction_in_range": inside / max(rows, 1),
            "max_span": int(spans.max()) if rows else 0,
            "span_histogram": {int(v): int(c) for v, c in zip(vals, counts)},
            "inexact_elements": int(mxfp4_to_e4m3(q).inexact), "elements": int(np.prod(q.shape)),
            "nan_rows": nan_rows}
