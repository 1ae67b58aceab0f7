"""Per-tile FP4 math of the GPU kernels: one home, shared by the Triton and Mosaic GPU kernels and their jnp mirrors.

Pure jnp on 2-D (or, for the ``lastaxis`` forms, any-rank) tiles, written with the ops both Pallas lowerings have:
integer bit manipulation instead of FP4/E8M0 conversions (Hopper has none), no ``jnp.any``, no slicing.
:mod:`kroquant_jax.formats` is the reference; its per-element functions (``flush_subnormals``,
``mx_shared_exponent``, ``e2m1_encode``, ``pow2``, ``divide_rn``) and the formats' own methods
(``scale_factors``) are used here unchanged, and every function below is tested bit for bit against
``formats.mxfp4_quantize_blocks`` / ``nvfp4_quantize_blocks`` / ``dequantize`` (encode:
``tests/test_transform_quantize.py::TestTileFunctions`` and ``tests/test_transform_quantize_mgpu.py``; decode:
``tests/test_w4a4_gemm.py::TestTileMath`` and ``tests/test_w4a4_gemm_mgpu.py``).

Encode (``A T`` in f32 -> packed codes + scale bytes):

* :func:`mx_quantize_tile` ``(R, w)`` -> ``(R, w/2)`` codes + ``(R, w/32)`` E8M0 bytes (the Triton q4/scale/fwht
  and joined K1 tiles); :func:`mx_quantize_pair` the same for one 32-block given as its even and odd columns
  ``(R, 16)`` each (the Triton K1/K2 split product); :func:`mx_quantize_pair_lastaxis` the any-rank form with a
  layout ``hint`` (the Mosaic GPU kernels).
* :func:`nv_quantize_tile` ``(R, w)`` -> codes + E4M3 bytes ``(R, w/16)``, given the tensor scale.
* The pieces: :func:`mx_block_scale` (E8M0 byte and ``2**-e`` multiplier from the block's integer max),
  :func:`e2m1_codes_fast` (E2M1 codes in ~16 integer ops), ``formats.e4m3_round`` (E4M3 on the integer bits),
  :func:`pack_pairs`, :func:`is_nonfinite`.

Decode (packed operand tiles -> tensor-core inputs):

* :func:`decode_tile_bf16` ``(r, bk/2)`` codes + block scales -> the low and high nibbles' exact bf16 values (the
  Triton W4A4 GEMM, the dequant strategy); :func:`decode_tile_fp8` one MXFP4 block as E4M3 (``compute="fp8"``);
  :func:`mx_decode_pair` one MXFP4 block per row through f16 bit patterns (the Mosaic GPU W4A4 GEMM).
* A code decoded as ``e2m1 * 2**-offset`` (:data:`FP8_DECODE_OFFSET` for E4M3, :data:`F16_DECODE_OFFSET` for f16
  bit patterns) times ``fmt.scale_factors(scales, offset)`` is the dequantized value (NVFP4: before its tensor
  scale, which the GEMMs apply to the accumulator).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kroquant_jax import formats as F
from kroquant_jax import fp8_encoding as FE
from kroquant_jax.formats import MXFP4, NVFP4, QuantFormat, ScaleMode

__all__ = [
    "F16_DECODE_OFFSET",
    "FP8_DECODE_OFFSET",
    "decode_tile_bf16",
    "decode_tile_fp8",
    "e2m1_codes_fast",
    "e2m1_to_e4m3_bits",
    "combine_live_bytes",
    "is_nonfinite",
    "max_live_byte",
    "mx_block_bytes_pair",
    "mx_block_bytes_tile",
    "mx_block_scale",
    "mx_decode_pair",
    "mx_quantize_pair",
    "mx_quantize_pair_lastaxis",
    "mx_quantize_tile",
    "mx_quantize_tile_fp8",
    "mx_quantize_pair_fp8",
    "nv_quantize_tile",
    "pack_pairs",
    "quantize_tile",
    "unpack_tile_fp8",
]

MX_BLOCK = MXFP4.standard_block_size
NV_BLOCK = NVFP4.standard_block_size
#: ``e2m1_to_e4m3_bits(c)`` has the value ``e2m1(c) * 2**-6``; the f16 pattern of :func:`mx_decode_pair` ``2**-14``.
FP8_DECODE_OFFSET = 6
F16_DECODE_OFFSET = 14

_EXP_MASK = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_E4M3_NAN = 0x7F
# Integer forms of the E2M1 thresholds (non-negative f32 order like their bit patterns).
_F32_ONE_BITS = 0x3F800000
_F32_SIX_BITS = 0x40C00000
_F32_QUARTER_BITS = 0x3E800000
_F32_THREE_QUARTERS_BITS = 0x3F400000
_F32_MIN_NORMAL_BITS = 0x00800000


def _identity(x):
    return x


# ---------------------------------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------------------------------


def is_nonfinite(x: jax.Array) -> jax.Array:
    """``|x|`` is Inf or NaN, from the exponent bits (f32 in, bool out, same shape)."""
    return (jax.lax.bitcast_convert_type(x, jnp.int32) & _EXP_MASK) == _EXP_MASK


def pack_pairs(codes: jax.Array) -> jax.Array:
    """``(R, w)`` codes (any int dtype, values < 16) -> ``uint8 (R, w/2)``, element ``2i`` in the low nibble."""
    r, w = codes.shape
    lo, hi = jnp.unstack(codes.astype(jnp.int32).reshape(r, w // 2, 2), axis=-1)
    return (lo | (hi << 4)).astype(jnp.uint8)


def mx_block_scale(abs_bits_max: jax.Array, mode: ScaleMode) -> tuple[jax.Array, jax.Array]:
    """Per block: from the integer max of ``|x|`` bits (int32, any shape) -> (f32 ``2**-e`` multiplier, E8M0 byte
    int32).

    A block holding Inf/NaN (max bits >= 0x7F800000) gets the NaN byte and a zero multiplier (the callers zero its
    codes); a block whose max is subnormal flushes to ``amax = 0``.
    """
    nonfinite = abs_bits_max >= _EXP_MASK
    amax_bits = jnp.where(abs_bits_max < _F32_MIN_NORMAL_BITS, 0, abs_bits_max)  # flush_subnormals(amax)
    amax = jax.lax.bitcast_convert_type(jnp.where(nonfinite, 0, amax_bits), jnp.float32)
    e = F.mx_shared_exponent(amax, mode)
    inv_scale = jnp.where(nonfinite, 0.0, F.pow2(jnp.clip(-e, -126, 127)))
    scale_byte = jnp.where(nonfinite, F.E8M0_NAN, e + F.E8M0_BIAS)
    return inv_scale, scale_byte


def e2m1_codes_fast(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """E2M1 codes (int32) of ``x * inv_scale`` with ``formats.e2m1_encode``'s rounding, in ~16 integer ops.

    Equal to ``e2m1_encode(flush_subnormals(flush_subnormals(x) * inv_scale))`` for finite ``x`` and a power-of-two
    ``inv_scale`` (tested exhaustively over the rounding boundaries): magnitudes >= 1 are rounded to one mantissa bit
    on the f32 bits (round to nearest even, carry into the exponent), magnitudes < 1 by two compares (0.25 down,
    0.75 up), saturation at 6 by an integer min. Subnormal ``x`` give magnitude 0 (the flush); the sign bit is kept.
    """
    xb = jax.lax.bitcast_convert_type(x, jnp.int32)
    v = x * inv_scale
    vb = jax.lax.bitcast_convert_type(v, jnp.int32)
    mag = jnp.minimum(vb & _ABS_MASK, _F32_SIX_BITS)
    mag = jnp.where((xb & _ABS_MASK) < _F32_MIN_NORMAL_BITS, 0, mag)
    hi = ((mag + 0x1FFFFF + ((mag >> 22) & 1)) >> 22) - 252  # 1.0 -> 2, 1.5 -> 3, ..., 6.0 -> 7
    lo = (mag > _F32_QUARTER_BITS).astype(jnp.int32) + (mag >= _F32_THREE_QUARTERS_BITS).astype(jnp.int32)
    idx = jnp.where(mag >= _F32_ONE_BITS, hi, lo)
    return idx | ((vb >> 28) & 8)


def _mx_tile_codes(y: jax.Array, mode: ScaleMode) -> tuple[jax.Array, jax.Array]:
    """``y float32 (R, w)`` -> (codes int32 ``(R, w)``, NaN blocks' codes zeroed; E8M0 bytes int32 ``(R, w/32)``)."""
    r, w = y.shape
    x = y.astype(jnp.float32).reshape(r, w // MX_BLOCK, MX_BLOCK)
    abs_bits = jax.lax.bitcast_convert_type(x, jnp.int32) & _ABS_MASK
    inv_scale, scale_byte = mx_block_scale(jnp.max(abs_bits, axis=-1), mode)  # (R, nb)
    codes = e2m1_codes_fast(x, inv_scale[..., None])
    codes = jnp.where((scale_byte == F.E8M0_NAN)[..., None], 0, codes)
    return codes.reshape(r, w), scale_byte


def mx_quantize_tile(y: jax.Array, mode: ScaleMode = ScaleMode.FLOOR) -> tuple[jax.Array, jax.Array]:
    """MXFP4 of a tile: ``y float32 (R, w)`` (``w % 32 == 0``) -> ``(packed uint8 (R, w/2), E8M0 uint8 (R, w/32))``.

    Bit-identical to ``pack_nibbles(mxfp4_quantize_blocks(y))`` (tested), with the per-element work cut to ~20
    integer/f32 ops (the kernels are ALU-bound otherwise): the block max on the integer bits (non-finite blocks
    detected on the block, not per element), and :func:`e2m1_codes_fast`.
    """
    codes, scale_byte = _mx_tile_codes(y, mode)
    return pack_pairs(codes), scale_byte.astype(jnp.uint8)


def _pair_codes(y_even: jax.Array, y_odd: jax.Array, mode: ScaleMode) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One 32-block per row as even/odd columns ``(R, 16)`` -> (even codes, odd codes int32 ``(R, 16)``, E8M0 byte
    int32 ``(R, 1)``)."""
    be = jax.lax.bitcast_convert_type(y_even, jnp.int32) & _ABS_MASK
    bo = jax.lax.bitcast_convert_type(y_odd, jnp.int32) & _ABS_MASK
    row_max = jnp.maximum(jnp.max(be, axis=1, keepdims=True), jnp.max(bo, axis=1, keepdims=True))  # (R, 1)
    inv_scale, scale_byte = mx_block_scale(row_max, mode)
    nan_block = scale_byte == F.E8M0_NAN
    ce = jnp.where(nan_block, 0, e2m1_codes_fast(y_even, inv_scale))
    co = jnp.where(nan_block, 0, e2m1_codes_fast(y_odd, inv_scale))
    return ce, co, scale_byte


def mx_quantize_pair(y_even: jax.Array, y_odd: jax.Array, mode: ScaleMode = ScaleMode.FLOOR
                     ) -> tuple[jax.Array, jax.Array]:
    """MXFP4 of one 32-wide block per row given as its even and odd columns ``(R, 16)`` each.

    Returns ``(packed uint8 (R, 16), E8M0 uint8 (R, 1))``; no reshape, so it runs in whatever register layout the
    tensor-core product left ``y_even``/``y_odd`` in (the Triton K1/K2 kernels' split product).
    """
    ce, co, scale_byte = _pair_codes(y_even, y_odd, mode)
    return (ce | (co << 4)).astype(jnp.uint8), scale_byte.astype(jnp.uint8)


# FP8 output mode: the E4M3 re-encoding of the MXFP4 result against the row's reference exponent
# (kroquant_jax.fp8_encoding: e4m3_bits, reference_exponent), written in the "even_odd" column order.


def _block_bytes(abs_bits_max: jax.Array, mode: ScaleMode) -> jax.Array:
    return mx_block_scale(abs_bits_max, mode)[1]


def mx_block_bytes_tile(y: jax.Array, mode: ScaleMode = ScaleMode.FLOOR) -> jax.Array:
    """The E8M0 bytes ``int32 (R, w/32)`` :func:`mx_quantize_tile` gives ``y float32 (R, w)`` (no codes)."""
    r, w = y.shape
    x = y.astype(jnp.float32).reshape(r, w // MX_BLOCK, MX_BLOCK)
    return _block_bytes(jnp.max(jax.lax.bitcast_convert_type(x, jnp.int32) & _ABS_MASK, axis=-1), mode)


def mx_block_bytes_pair(y_even: jax.Array, y_odd: jax.Array, mode: ScaleMode = ScaleMode.FLOOR) -> jax.Array:
    """The E8M0 byte ``int32 (R, 1)`` :func:`mx_quantize_pair` gives one block (no codes)."""
    be = jax.lax.bitcast_convert_type(y_even, jnp.int32) & _ABS_MASK
    bo = jax.lax.bitcast_convert_type(y_odd, jnp.int32) & _ABS_MASK
    return _block_bytes(jnp.maximum(jnp.max(be, axis=1, keepdims=True), jnp.max(bo, axis=1, keepdims=True)), mode)


def max_live_byte(scale_bytes: jax.Array) -> jax.Array:
    """``int32 (R, 1)`` from E8M0 bytes ``(R, nb)``: the largest non-NaN byte, plus 256 if a block is NaN (what the
    FP8 output mode's pre-pass records per row and column tile: the row's ``e_ref`` is
    ``fp8_encoding.reference_exponent`` of the maximum over its tiles of the low 8 bits, its scale NaN if a tile has
    bit 8 set)."""
    b = scale_bytes.astype(jnp.int32)
    nan = b == F.E8M0_NAN
    live = jnp.max(jnp.where(nan, 0, b), axis=1, keepdims=True)
    return live + 256 * jnp.max(nan.astype(jnp.int32), axis=1, keepdims=True)


def combine_live_bytes(a: jax.Array, b: jax.Array) -> jax.Array:
    """The :func:`max_live_byte` record of two column ranges of the same rows (``int32 (R, 1)`` each): the larger live
    byte, NaN if either is (a plain maximum would let a NaN flag hide a larger byte)."""
    return jnp.maximum(a & 255, b & 255) | (jnp.maximum(a >> 8, b >> 8) << 8)


def _split_even_odd(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    r, w = v.shape
    return jnp.unstack(v.reshape(r, w // 2, 2), axis=-1)


def mx_quantize_tile_fp8(y: jax.Array, e_ref: jax.Array, mode: ScaleMode = ScaleMode.FLOOR
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`mx_quantize_tile` plus the E4M3 re-encoding: ``y float32 (R, w)``, ``e_ref int32 (R, 1)`` ->
    ``(E4M3 bits of the even elements uint8 (R, w/2), of the odd elements uint8 (R, w/2), packed codes uint8
    (R, w/2), E8M0 bytes uint8 (R, w/32))``; the bits are ``fp8_encoding.e4m3_bits`` of the codes."""
    r, w = y.shape
    codes, scale_byte = _mx_tile_codes(y, mode)
    per_elem = jnp.broadcast_to(scale_byte[:, :, None], (r, w // MX_BLOCK, MX_BLOCK)).reshape(r, w)
    ce, co = _split_even_odd(codes)
    be, _ = _split_even_odd(per_elem)
    lo = FE.e4m3_bits(ce, be, e_ref).astype(jnp.uint8)
    hi = FE.e4m3_bits(co, be, e_ref).astype(jnp.uint8)
    return lo, hi, (ce | (co << 4)).astype(jnp.uint8), scale_byte.astype(jnp.uint8)


def mx_quantize_pair_fp8(y_even: jax.Array, y_odd: jax.Array, e_ref: jax.Array, mode: ScaleMode = ScaleMode.FLOOR
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`mx_quantize_pair` plus the E4M3 re-encoding: ``e_ref int32 (R, 1)`` -> ``(E4M3 bits of the even
    elements uint8 (R, 16), of the odd ones uint8 (R, 16), packed codes uint8 (R, 16), E8M0 byte uint8 (R, 1))``."""
    ce, co, scale_byte = _pair_codes(y_even, y_odd, mode)
    lo = FE.e4m3_bits(ce, scale_byte, e_ref).astype(jnp.uint8)
    hi = FE.e4m3_bits(co, scale_byte, e_ref).astype(jnp.uint8)
    return lo, hi, (ce | (co << 4)).astype(jnp.uint8), scale_byte.astype(jnp.uint8)


def mx_quantize_pair_lastaxis(y_even: jax.Array, y_odd: jax.Array, mode: ScaleMode = ScaleMode.FLOOR, *,
                              hint: Callable[[jax.Array], jax.Array] = _identity) -> tuple[jax.Array, jax.Array]:
    """MXFP4 of 32-element blocks given as their even and odd elements ``(..., 16)`` each (f32).

    Returns ``(packed uint8 (..., 16), E8M0 bytes uint8 (...))``: ``packed[..., j] = code(2j) | code(2j+1) << 4``,
    bit-identical to ``pack_nibbles(mxfp4_quantize_blocks(...))`` (tested). :func:`mx_quantize_pair`'s math with
    the reduction over the last axis without ``keepdims`` and the broadcasts back as explicit ``broadcast_in_dim``
    calls whose results pass through ``hint`` (the Mosaic GPU kernels pin their register layout there).
    """
    be = jax.lax.bitcast_convert_type(y_even, jnp.int32) & _ABS_MASK
    bo = jax.lax.bitcast_convert_type(y_odd, jnp.int32) & _ABS_MASK
    row_max = jnp.maximum(jnp.max(be, axis=-1), jnp.max(bo, axis=-1))  # (...)
    inv_scale, scale_byte = mx_block_scale(row_max, mode)
    shape, dims = y_even.shape, tuple(range(y_even.ndim - 1))
    inv_b = hint(jax.lax.broadcast_in_dim(inv_scale, shape, dims))
    nan_b = hint(jax.lax.broadcast_in_dim(scale_byte == F.E8M0_NAN, shape, dims))
    ce = jnp.where(nan_b, 0, e2m1_codes_fast(y_even, inv_b))
    co = jnp.where(nan_b, 0, e2m1_codes_fast(y_odd, inv_b))
    return (ce | (co << 4)).astype(jnp.uint8), scale_byte.astype(jnp.uint8)


def nv_quantize_tile(y: jax.Array, tensor_scale: jax.Array, inv_tensor_scale: jax.Array, *,
                     divide: Optional[Callable] = None) -> tuple[jax.Array, jax.Array]:
    """NVFP4 of a tile: ``y float32 (R, w)`` (``w % 16 == 0``) -> ``(packed uint8 (R, w/2), E4M3 bytes uint8 (R, w/16))``.

    ``inv_tensor_scale`` must be ``float32(1) / tensor_scale`` (as ``nvfp4_quantize_blocks`` computes it). Bit-identical
    to ``nvfp4_quantize_blocks`` (tested); the E4M3 rounding is done on the integer bits. The three f32 divisions
    (``amax / 6``, ``/ tensor_scale``, ``inv_tensor_scale / s``) go through ``divide(x, y)``, which must round
    correctly: ``formats.divide_rn`` by default (integer arithmetic: XLA:GPU's f32 division is approximate and XLA
    rewrites divisions by scalars); the Triton kernel passes ``div.rn.f32`` as inline PTX.
    """
    r, w = y.shape
    x = F.flush_subnormals(y.astype(jnp.float32)).reshape(r, w // NV_BLOCK, NV_BLOCK)
    nf = is_nonfinite(x)
    nonfinite = jnp.max(nf.astype(jnp.int32), axis=-1) > 0
    amax = jnp.max(jnp.abs(jnp.where(nf, 0.0, x)), axis=-1)
    div = F.divide_rn if divide is None else divide
    # Two roundings, as formats.nvfp4_quantize_blocks (and torchao): (amax / 6) / ts, each division correctly rounded
    # (neither divide_rn's integer ops nor the kernel's inline PTX can be fused into one division by XLA).
    s = jnp.clip(div(div(amax, jnp.float32(F.E2M1_MAX)), tensor_scale), F.E4M3_TINY, F.E4M3_MAX)
    s, byte = F.e4m3_round(s)
    reciprocal = div(inv_tensor_scale, s)
    v = F.flush_subnormals(x * reciprocal[..., None])
    codes = F.e2m1_encode(jnp.clip(v, -F.E2M1_MAX, F.E2M1_MAX)).astype(jnp.int32)
    codes = jnp.where(nonfinite[..., None], 0, codes)
    scale_bytes = jnp.where(nonfinite, _E4M3_NAN, byte).astype(jnp.uint8)
    return pack_pairs(codes.reshape(r, w)), scale_bytes


def _quantize_tile_mx(fmt: MXFP4, y, tensor_scales, divide):
    return mx_quantize_tile(y, fmt.scale_mode)


def _quantize_tile_nv(fmt: NVFP4, y, tensor_scales, divide):
    ts, inv_ts = tensor_scales
    return nv_quantize_tile(y, ts, inv_ts, divide=divide)


_QUANTIZE_TILE = {MXFP4: _quantize_tile_mx, NVFP4: _quantize_tile_nv}


def quantize_tile(fmt: QuantFormat, y: jax.Array, tensor_scales: Optional[tuple] = None, *,
                  divide: Optional[Callable] = None) -> tuple[jax.Array, jax.Array]:
    """The tile quantizer of ``fmt`` (standard block): :func:`mx_quantize_tile` or :func:`nv_quantize_tile`.

    ``y float32 (R, w)`` -> ``(packed uint8 (R, w/2), scale bytes uint8 (R, w/block))``; ``tensor_scales`` is
    ``(tensor_scale, 1 / tensor_scale)`` for a format with a tensor scale (else unused), ``divide`` as for
    :func:`nv_quantize_tile`.
    """
    fn = _QUANTIZE_TILE.get(type(fmt))
    if fn is None or not fmt.is_standard:
        raise ValueError(f"no tile quantizer for {fmt!r} (the kernels write MXFP4 block 32 and NVFP4 block 16)")
    return fn(fmt, y, tensor_scales, divide)


# ---------------------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------------------


def e2m1_to_e4m3_bits(nibbles: jax.Array) -> jax.Array:
    """E2M1 codes (int32, low 4 bits) -> E4M3 bit patterns (int32 in [0, 255]) of value ``e2m1(code) * 2**-6``."""
    return ((nibbles & 7) << 2) | ((nibbles & 8) << 4)


def _bits_to_fp8(bits_i32: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits_i32.astype(jnp.uint8), jnp.float8_e4m3fn)


def unpack_tile_fp8(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``uint8 (r, c)`` packed codes -> ``(lo, hi)`` ``float8_e4m3fn (r, c)``: elements ``2i`` and ``2i+1``, each
    holding ``e2m1 * 2**-6`` exactly."""
    c = codes.astype(jnp.int32)
    return _bits_to_fp8(e2m1_to_e4m3_bits(c & 15)), _bits_to_fp8(e2m1_to_e4m3_bits(c >> 4))


def _expand_scales(mult: jax.Array, bytes_per_block: int) -> jax.Array:
    """``(r, nb)`` per-block factors -> ``(r, nb * bytes_per_block)`` per-byte factors (broadcast, no gather)."""
    r, nb = mult.shape
    return jnp.broadcast_to(mult[:, :, None], (r, nb, bytes_per_block)).reshape(r, nb * bytes_per_block)


def decode_tile_bf16(codes: jax.Array, scales: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """Packed tile ``uint8 (r, bk/2)`` + block-scale bytes ``uint8 (r, bk/blk)`` -> ``(lo, hi)`` ``bfloat16 (r, bk/2)``.

    ``lo[:, i]`` is element ``2i`` of the tile, ``hi[:, i]`` element ``2i + 1``, both dequantized exactly (MXFP4:
    for scale bytes in ``[2, 248]``; NVFP4: without the per-tensor scale, applied to the accumulator).
    """
    lo8, hi8 = unpack_tile_fp8(codes)
    mult = _expand_scales(fmt.scale_factors(scales, FP8_DECODE_OFFSET), fmt.block_size // 2)
    lo = (lo8.astype(jnp.float32) * mult).astype(jnp.bfloat16)
    hi = (hi8.astype(jnp.float32) * mult).astype(jnp.bfloat16)
    return lo, hi


def decode_tile_fp8(codes16: jax.Array) -> jax.Array:
    """One MXFP4 block of a tile, ``uint8 (r, 16)`` -> ``float8_e4m3fn (r, 32)`` in natural element order,
    values ``e2m1 * 2**-6`` (the nibbles are interleaved as integer bit patterns, then bitcast once)."""
    c = codes16.astype(jnp.int32)
    r, w = codes16.shape
    bits = jax.lax.stack([e2m1_to_e4m3_bits(c & 15), e2m1_to_e4m3_bits(c >> 4)], axis=2).reshape(r, 2 * w)
    return _bits_to_fp8(bits)


def mx_decode_pair(codes: jax.Array, mult: jax.Array, *,
                   hint: Callable[[jax.Array], jax.Array] = _identity) -> tuple[jax.Array, jax.Array]:
    """One MXFP4 block per row: code bytes ``uint8 (r, 16)`` + per-row factors ``f32 (r,)``
    (``MXFP4().scale_factors(bytes, F16_DECODE_OFFSET)``) -> ``(lo, hi)`` ``bfloat16 (r, 16)``: the block's elements
    ``2j`` and ``2j + 1``, exactly dequantized (scale bytes in ``[2, 240]``: above, ``2**(e - 113)`` is clamped).

    The nibble ``s e1 e0 m`` becomes the f16 bit pattern ``s<<15 | (e1 e0 m)<<9`` of value ``e2m1 * 2**-14``. Works on
    any ``(r, c)`` tile whose rows share one scale. The broadcast of ``mult`` goes through ``hint`` (the Mosaic GPU
    kernel pins the ``wgmma`` register layout there; identity elsewhere).
    """
    c = codes.astype(jnp.uint16)
    lo_bits = ((c & 0x07) << 9) | ((c & 0x08) << 12)  # low nibble  s e1 e0 m -> f16 s<<15 | e1 e0 m<<9
    hi_bits = ((c & 0x70) << 5) | ((c & 0x80) << 8)  # high nibble
    mult_b = hint(jax.lax.broadcast_in_dim(mult, codes.shape, (0,)))

    def value(bits):
        return (jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * mult_b).astype(jnp.bfloat16)

    return value(lo_bits), value(hi_bits)
