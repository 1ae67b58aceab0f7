"""W4A4 GEMM: ``dequant(Qa) @ dequant(Qw)^T`` from packed MXFP4 / NVFP4 operands, on the Hopper tensor cores.

The H200 (sm_90) has no FP4 tensor cores. This kernel reads the packed operands (two E2M1 codes per byte plus block
scales), unpacks them in registers and runs bf16 (or, for MXFP4, FP8 E4M3) tensor-core dots with fp32 accumulation.
Pallas with the Triton lowering (``pallas_call`` + ``pltriton.CompilerParams``), the same path as
``pallas_kernels/transform_quantize.py``; ``interpret=True`` runs the same kernel body on the CPU.

Operands (``kroquant_jax.formats.QuantizedArray``, quantized along K, the last axis)::

    A: codes uint8 (m, k/2), scales (m, k/blk)      W: codes uint8 (n, k/2), scales (n, k/blk)
    out (m, n) = dequant(A) @ dequant(W)^T  [+ h @ L^T (low-rank branch)]  [+ bias]

Per-tile math (``pallas_kernels.fp4_tile``, shared with :func:`w4a4_matmul_tiled_reference`, the jnp mirror):

* **Unpacking without a table.** Byte ``i`` of a row holds elements ``2i`` (low nibble) and ``2i+1`` (high nibble).
  The kernel never interleaves them: a dot product is a sum over K, so it reorders K the same way in both operands
  and computes ``dot(A_lo, W_lo^T) + dot(A_hi, W_hi^T)``. The nibble ``c = s<<3 | e1 e0 m`` becomes the FP8 E4M3 bit
  pattern ``s<<7 | (e1 e0 m)<<2``, whose value is exactly ``e2m1(c) * 2**-6`` for all 16 codes (0.5 lands on the
  E4M3 subnormal 2**-7): a shift, a mask and a bitcast per element.
* **Scales.** A block of ``blk`` elements occupies ``blk/2`` consecutive bytes, and both nibbles of byte ``i`` belong
  to the same block, so the low and the high half share the block scale, broadcast over ``blk/2`` bytes.

Two compute modes (static ``compute``):

``"bf16"`` (MXFP4 and NVFP4, the default): each element becomes ``bf16(fp8_value * scale * 2**6)``. MXFP4:
  ``e2m1 * 2**e`` has 2 significant bits, NVFP4: ``e2m1 * e4m3`` at most 6; both are exact in bf16 (8 bits). Products
  of two such values have at most 12 significant bits and are exact in the fp32 accumulator. So the kernel computes
  **exactly** the f32 matrix product of the fake-quantized operands, up to the order of the fp32 additions.
``"fp8"`` (MXFP4 only): E2M1 codes go to the tensor cores as E4M3 (exact); one K=32 FP8 dot per MXFP4 block, whose
  partial sum (32 products of E2M1 values, multiples of 2**-2 below 1152: 13 significant bits) is exact; it is then
  multiplied by the power-of-two outer product ``2**(ea_i + ew_j)`` (exact) and added to the fp32 accumulator. Same
  exactness, provided the FP8 tensor-core accumulator keeps >= 13 significant bits (Hopper's does: about 14 are
  reported for its FP8 accumulation; the GPU test checks it). It costs one fp32 multiply-add per output per 32 K.

Bounds (tested in ``tests/test_w4a4_gemm.py``), with ``x_hat = fake_quant(x)`` in f32 and ``P = |A_hat| |W_hat|^T``:

* MXFP4: ``|out - A_hat W_hat^T| <= k * 2**-24 * P`` elementwise (the fp32 summation-order bound ``gamma_k``), for
  block scale bytes in ``[2, 248]`` (block amax in about ``[2**-123, 2**123]``); byte 0 blocks are exactly zero, the
  NaN byte 0xFF propagates NaN. Outside that range (f32 subnormals / overflow) the kernel may differ.
* NVFP4: the kernel applies the two per-tensor scales once to the accumulator; the reference rounds
  ``e2m1 * s_blk * tensor_scale`` to f32 per element. Bound: ``(k + 3) * 2**-24 * P``.
* Output in bf16: add the final rounding, ``2**-8 |out|``.

Low-rank branch (eq. 11, ``(A T)(L R)^T``): the caller computes ``h = (A T) R^T`` ``(m, r)`` (a small GEMM,
:func:`lowrank_input`; or ``h = A (R T^T)^T`` with ``T`` folded into ``R`` at packing time, which needs no ``A T``)
and the kernel adds ``h L^T`` in its epilogue (``lowrank=(h, L)``), one more K=r dot per output tile (fused), or
the served layer does it beside the kernel with XLA (``pallas_kernels.served``, ``lowrank="beside"``). ``L (n, r)``
is bf16 or stays packed in MXFP4 as LoRaQ stores it (decoded in the epilogue like a W tile: its low nibbles hold the even ``r``, its
high nibbles the odd ``r``, so ``h`` comes with its columns in :func:`even_odd_permutation` order, ``R``'s rows
permuted the same way).

The activation tensors keep their natural layout; ragged ``m`` (not a multiple of ``block_m``) and ``n``/``k`` that
are no multiple of the blocks are zero-padded by the wrapper (zero codes with scale byte 0 contribute exactly 0).

The served layer (``pallas_kernels.served``) runs this module's GEMMs as strategies: ``"kernel"``, the
Pallas-Triton GEMM with the decode in its main loop; ``"dequant"``, :func:`w4a4_matmul_dequant`: both operands decoded
to bf16 by memory-bound XLA fusions (the same per-tile math over whole rows, :func:`dequantize_bf16`), then one bf16
``jnp.dot`` that XLA sends to cuBLAS, the low-rank pair joined along K (one GEMM); ``"mgpu"``, the Mosaic GPU kernel of
``pallas_kernels/w4a4_gemm_mgpu.py`` (TMA + warp specialization + ``wgmma``, MXFP4). Same exactness contract.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.formats import MXFP4, QuantFormat, QuantizedArray, dequantize
from pallas_kernels._compat import pl, triton_compiler_params
from pallas_kernels.fp4_tile import FP8_DECODE_OFFSET, decode_tile_bf16, decode_tile_fp8

__all__ = [
    "BlockSizes",
    "Compute",
    "GemmRefs",
    "LOWRANK_DOTS",
    "OperandSpec",
    "accumulate_tiles",
    "add_gemm_terms",
    "check_operands",
    "check_tile_sizes",
    "choose_block_sizes",
    "dequantize_bf16",
    "even_odd_permutation",
    "keeps_lowrank_packed",
    "launch_gemm",
    "lowrank_h",
    "lowrank_input",
    "lowrank_reference",
    "operand_format",
    "round_up",
    "split_gemm_refs",
    "w4a4_matmul",
    "w4a4_matmul_dequant",
    "w4a4_matmul_reference",
    "w4a4_matmul_tiled_reference",
]

Compute = Literal["bf16", "fp8"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the W4A4 GEMM (all powers of two, as Triton requires).

    Attributes:
      block_m: rows of A per program.
      block_n: rows of W (output columns) per program.
      block_k: unpacked K elements per main-loop step (a multiple of the format's block size, >= 32).
      num_warps, num_stages: Triton launch parameters.
      n_sub: W tiles of ``block_n`` rows per program (the A tile is decoded once for all of them, so its unpacking
        cost is shared); a program computes ``block_m x (n_sub * block_n)`` outputs.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    n_sub: int = 1

    def __post_init__(self):
        check_tile_sizes(self, ("block_m", "block_n", "block_k"))
        if self.block_k < 32:
            raise ValueError(f"BlockSizes.block_k={self.block_k} must be >= 32 (one MXFP4 block)")


def check_tile_sizes(config, names: Sequence[str], minimum: int = 16) -> None:
    """Raises a ``ValueError`` naming ``config``'s class and field unless each field ``names`` of it is a power of
    two ``>= minimum`` (the tiles of a kernel: tensor-core shapes, ``pl.ds`` strides)."""
    for name in names:
        v = getattr(config, name)
        if v < minimum or v & (v - 1):
            raise ValueError(f"{type(config).__name__}.{name}={v} must be a power of two >= {minimum}")


def choose_block_sizes(m: int, n: int, k: int, *, max_block_m: int = 128, block_n: int = 128,
                       block_k: int = 128) -> BlockSizes:
    """Default tiles for a problem: ``block_m`` shrinks for small ``m``; n and k are padded to the blocks if needed."""
    bm = max_block_m
    while bm > 16 and bm // 2 >= m:
        bm //= 2
    bn = block_n
    while bn > 16 and n % bn and n % (bn // 2) == 0:
        bn //= 2
    bk = block_k
    while bk > 32 and k % bk:
        bk //= 2
    return BlockSizes(block_m=bm, block_n=bn, block_k=bk, num_warps=8 if bm * bn >= 128 * 128 else 4)


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """How a kernel reads its two GEMM operands (static).

    Attributes:
      fmt: the packed operands' :class:`~kroquant_jax.formats.QuantFormat` (standard block), or ``None`` for plain
        16-bit ``A``, ``W``.
      compute: tensor-core input type for packed operands (``"bf16"`` or, MXFP4 only, ``"fp8"``).
      block_k: unpacked K elements per main-loop step.
    """

    fmt: Optional[QuantFormat]
    compute: Compute = "bf16"
    block_k: int = 128

    @property
    def packed(self) -> bool:
        return self.fmt is not None

    @property
    def fmt_block(self) -> int:
        return self.fmt.block_size if self.packed else 1

    @property
    def has_tensor_scale(self) -> bool:
        return self.packed and self.fmt.has_tensor_scale


# ---------------------------------------------------------------------------------------------------------------------
# The per-tile decode is pallas_kernels.fp4_tile (shared with the tiled reference and the dequant strategy).
# ---------------------------------------------------------------------------------------------------------------------


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a (r, c) @ b (s, c)^T`` in f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------------------------
# The main loop, shared with pallas_kernels/epilogues.py.
# ---------------------------------------------------------------------------------------------------------------------


def accumulate_tiles(a_refs: Sequence, w_refs: Sequence, *, spec: OperandSpec, k: int, block_n: int,
                     n_sub: int) -> list[jax.Array]:
    """The K loop of one program: ``n_sub`` f32 accumulators ``(bm, block_n)`` for W row tiles ``j * block_n``.

    Args:
      a_refs: ``(a,)`` for bf16 operands (``(bm, k)`` block) or ``(codes (bm, k/2), scales (bm, k/blk))``.
      w_refs: the same for W, with ``n_sub * block_n`` rows.
      spec: operand description; ``k`` the (padded) reduction length, a multiple of ``spec.block_k``.
    """
    bk = spec.block_k
    n_k = k // bk
    bm = a_refs[0].shape[0]
    accs0 = [jnp.zeros((bm, block_n), jnp.float32) for _ in range(n_sub)]

    if not spec.packed:
        def body(kk, accs):
            a = a_refs[0][:, pl.ds(kk * bk, bk)]
            out = []
            for j, acc in enumerate(accs):
                w = w_refs[0][pl.ds(j * block_n, block_n), pl.ds(kk * bk, bk)]
                out.append(acc + _dot_nt(a, w))
            return out
    elif spec.compute == "bf16":
        hk, nsb = bk // 2, bk // spec.fmt_block

        def body(kk, accs):
            a_lo, a_hi = decode_tile_bf16(a_refs[0][:, pl.ds(kk * hk, hk)], a_refs[1][:, pl.ds(kk * nsb, nsb)],
                                          spec.fmt)
            out = []
            for j, acc in enumerate(accs):
                rows = pl.ds(j * block_n, block_n)
                w_lo, w_hi = decode_tile_bf16(w_refs[0][rows, pl.ds(kk * hk, hk)],
                                              w_refs[1][rows, pl.ds(kk * nsb, nsb)], spec.fmt)
                out.append(acc + _dot_nt(a_lo, w_lo) + _dot_nt(a_hi, w_hi))
            return out
    elif spec.compute == "fp8":
        if not isinstance(spec.fmt, MXFP4):
            raise ValueError("compute='fp8' supports MXFP4 only (an NVFP4 block of 16 is below the FP8 dot's K=32)")
        nsb = bk // 32

        def body(kk, accs):
            out = list(accs)
            for b in range(nsb):
                kb = kk * nsb + b
                a8 = decode_tile_fp8(a_refs[0][:, pl.ds(kb * 16, 16)])
                sa = spec.fmt.scale_factors(a_refs[1][:, pl.ds(kb, 1)], FP8_DECODE_OFFSET)  # (bm, 1)
                for j in range(n_sub):
                    rows = pl.ds(j * block_n, block_n)
                    w8 = decode_tile_fp8(w_refs[0][rows, pl.ds(kb * 16, 16)])
                    sw = spec.fmt.scale_factors(w_refs[1][rows, pl.ds(kb, 1)], FP8_DECODE_OFFSET).reshape(1, block_n)
                    out[j] = out[j] + _dot_nt(a8, w8) * (sa * sw)
            return out
    else:
        raise ValueError(f"unknown compute mode {spec.compute!r}")

    return list(jax.lax.fori_loop(0, n_k, body, accs0))


# ---------------------------------------------------------------------------------------------------------------------
# The low-rank branch (eq. 11's (A T)(L R)^T), shared with pallas_kernels/epilogues.py.
# ---------------------------------------------------------------------------------------------------------------------


def even_odd_permutation(r: int) -> np.ndarray:
    """``[0, 2, 4, ..., 1, 3, 5, ...]``: the order of ``h``'s columns when ``L`` is packed (see :func:`lowrank_input`)."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


LOWRANK_DOTS = ("f32", "bf16")


def lowrank_h(x2: jax.Array, right: jax.Array, *, dot_output: str = "bf16") -> jax.Array:
    """``h = x2 right^T`` ``(m, r)`` bf16 from ``x2 (m, d)`` and ``right (r, d)``: the low-rank branch's input, with
    f32 accumulation and one rounding to bf16 (the one home of this product for every served strategy).

    ``dot_output`` says where that rounding happens: ``"bf16"`` (the default), the dot writes bf16 itself (XLA's GEMMs
    accumulate bf16 products in f32, and a split-K reduction rounds once at its end); ``"f32"``, the dot writes f32
    and a convert rounds it, which XLA may run as a kernel of its own. The default is the one measured never slower
    and bit-identical on the GPU (docs/w4a4.md, section "FLUX.1 with its groups fused, XLA's command buffers, the
    low-rank input in one rounding"); on the CPU XLA may sum the two programs in different orders, so a few elements
    can differ by one bf16 ulp.
    """
    if dot_output == "f32":
        return jnp.matmul(x2, right.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    if dot_output == "bf16":
        return jnp.matmul(x2, right.T, preferred_element_type=jnp.bfloat16)
    raise ValueError(f"lowrank_h: dot_output={dot_output!r} must be one of {LOWRANK_DOTS}")


def lowrank_input(x_t: jax.Array, right, *, packed_left: bool) -> jax.Array:
    """``h = (x T) R^T`` ``(m, r)`` bf16 for the fused low-rank epilogue.

    With a packed ``L`` the kernel decodes ``L``'s low nibbles (even ``r``) and high nibbles (odd ``r``) separately,
    so ``h`` is returned with its columns in :func:`even_odd_permutation` order (``R``'s rows permuted; for a packed
    ``R`` that is a free row permutation of its codes, done here on the dequantized copy).
    """
    if isinstance(right, QuantizedArray):
        right = dequantize(right, jnp.float32)
    right = jnp.asarray(right).astype(jnp.bfloat16)
    if packed_left:
        right = right[even_odd_permutation(right.shape[0])]
    return lowrank_h(x_t.astype(jnp.bfloat16), right)


def lowrank_arrays(h: jax.Array, left, m_pad: int, rows_pad: Optional[int], block_m: int, rows_block: int, a_map,
                   w_map) -> tuple[list, list, bool]:
    """Arrays and BlockSpecs of the fused low-rank epilogue; ``left`` bf16 ``(n, r)`` or packed MXFP4."""
    m = h.shape[0]
    r = h.shape[-1]
    packed = isinstance(left, QuantizedArray)
    n = left.shape[0]
    if left.shape != (n, r) or r < 16 or r & (r - 1) or h.ndim != 2:
        raise ValueError(f"lowrank=(h {h.shape}, L {left.shape}) must be (m, r), (n, r) with r a power of two >= 16")
    rows = n if rows_pad is None else rows_pad
    args = [_pad_rows(h.astype(jnp.bfloat16), m_pad)]
    specs = [pl.BlockSpec((block_m, r), a_map)]
    if packed:
        if not isinstance(operand_format(left), MXFP4) or r < 32:
            raise ValueError("a packed low-rank factor L must be MXFP4 (block 32) with r >= 32")
        args += _operand_arrays(left, rows, r)
        specs += _operand_specs(left.fmt, rows_block, r, w_map)
    else:
        args.append(_pad_rows(jnp.asarray(left).astype(jnp.bfloat16), rows))
        specs.append(pl.BlockSpec((rows_block, r), w_map))
    del m
    return args, specs, packed


def gemm_inputs(a, w, spec: OperandSpec, *, m_pad: int, n_pad: int, k_pad: int, block_m: int, cols: int, lowrank,
                bias) -> tuple[list, list, bool]:
    """Arrays and BlockSpecs of a GEMM on a ``(m_pad / block_m, n_pad / cols)`` grid, in the order the kernels unpack
    them: ``A`` and ``W`` (codes + scales, or bf16), the product of the NVFP4 tensor scales, the low-rank pair
    ``(h (m, r), L (n, r))`` and the bias ``(n,)`` (zero-padded to ``n_pad``). Returns ``(args, in_specs,
    lowrank_packed)``; shared by :func:`w4a4_matmul` and ``pallas_kernels.epilogues``."""
    _, m, n, _ = check_operands(a, w)
    a_map = lambda i, j: (i, 0)  # noqa: E731
    w_map = lambda i, j: (j, 0)  # noqa: E731
    args = _operand_arrays(a, m_pad, k_pad) + _operand_arrays(w, n_pad, k_pad)
    in_specs = (_operand_specs(spec.fmt, block_m, k_pad, a_map) + _operand_specs(spec.fmt, cols, k_pad, w_map))
    if spec.has_tensor_scale:
        args.append((a.tensor_scale * w.tensor_scale).astype(jnp.float32).reshape(1, 1))
        in_specs.append(pl.BlockSpec((1, 1), lambda i, j: (0, 0)))
    lowrank_packed = False
    if lowrank is not None:
        h, left = lowrank
        if h.shape[0] != m or left.shape[0] != n:
            raise ValueError(f"lowrank=(h {h.shape}, L {left.shape}) must be (m, r), (n, r)")
        lr_args, lr_specs, lowrank_packed = lowrank_arrays(h, left, m_pad, n_pad, block_m, cols, a_map, w_map)
        args += lr_args
        in_specs += lr_specs
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias {bias.shape} must be ({n},)")
        args.append(jnp.pad(bias.astype(jnp.float32), (0, n_pad - n)).reshape(1, n_pad))
        in_specs.append(pl.BlockSpec((1, cols), lambda i, j: (0, j)))
    return args, in_specs, lowrank_packed


class GemmRefs(NamedTuple):
    """The kernel refs of :func:`gemm_inputs`' arrays: ``a``, ``w`` (codes + scales, or one bf16 ref each), the
    NVFP4 tensor-scale product, ``h`` and ``L`` (one ref, or codes + scales when packed), the bias (``None`` /
    ``[]`` where absent)."""

    a: list
    w: list
    tensor_scale: Any
    h: Any
    left: list
    bias: Any


def split_gemm_refs(refs, spec: OperandSpec, *, has_lowrank: bool, lowrank_packed: bool, has_bias: bool
                    ) -> tuple[GemmRefs, list, Any]:
    """A GEMM kernel's refs -> ``(GemmRefs, extra, o_ref)``: the refs of :func:`gemm_inputs`' arrays, the inputs
    after them (a kernel's own, then the aliased output buffer of :func:`launch_gemm` if any, never read) and the
    output ref."""
    refs = list(refs)
    n_op = 2 if spec.packed else 1
    a_refs, refs = refs[:n_op], refs[n_op:]
    w_refs, refs = refs[:n_op], refs[n_op:]
    ts_ref = refs.pop(0) if spec.has_tensor_scale else None
    h_ref = bias_ref = None
    l_refs = []
    if has_lowrank:
        h_ref = refs.pop(0)
        l_refs = [refs.pop(0) for _ in range(2 if lowrank_packed else 1)]
    if has_bias:
        bias_ref = refs.pop(0)
    return GemmRefs(a_refs, w_refs, ts_ref, h_ref, l_refs, bias_ref), refs[:-1], refs[-1]


def add_gemm_terms(acc: jax.Array, g: GemmRefs, cols, *, lowrank_packed: bool) -> jax.Array:
    """The terms after the main loop of the output columns ``cols`` (a ``pl.ds``): f32 ``acc (bm, len(cols))``
    times the tensor-scale product, plus ``h L^T`` and the bias, where present."""
    if g.tensor_scale is not None:
        acc = acc * g.tensor_scale[...]  # (1, 1)
    if g.h is not None:
        acc = acc + lowrank_term(g.h, g.left, cols, packed=lowrank_packed)
    if g.bias is not None:
        acc = acc + g.bias[:, cols]  # (1, len(cols)) f32
    return acc


def launch_gemm(kernel, args: list, in_specs: list, *, block: tuple[int, int], shape: tuple[int, int],
                padded: tuple[int, int], out, out_dtype, num_warps: int, num_stages: int, interpret: bool,
                name: str) -> jax.Array:
    """Runs a GEMM kernel (Triton lowering) on the grid of ``block`` output tiles of the ``padded`` result and
    returns its ``shape`` ``(m, n)`` part. ``out``: an optional ``(m, n)`` buffer, padded and aliased to the
    output (the kernel's last input; tests poison it to check that every element is written)."""
    (m, n), (m_pad, n_pad) = shape, padded
    aliases = {}
    if out is not None:
        if out.shape != (m, n):
            raise ValueError(f"out {out.shape} must be ({m}, {n})")
        aliases = {len(args): 0}
        args = [*args, jnp.pad(out.astype(out_dtype), [(0, m_pad - m), (0, n_pad - n)])]
        in_specs = [*in_specs, pl.BlockSpec(block, lambda i, j: (i, j))]
    y = pl.pallas_call(
        kernel,
        grid=(m_pad // block[0], n_pad // block[1]),
        in_specs=in_specs,
        out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct(padded, out_dtype),
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    return y[:m, :n]


def lowrank_term(h_ref, l_refs, rows, *, packed: bool) -> jax.Array:
    """``h L^T`` for the rows ``rows`` of ``L`` (f32 ``(bm, len(rows))``), ``L`` bf16 or packed (decoded here)."""
    if not packed:
        return _dot_nt(h_ref[...], l_refs[0][rows, :])
    r = h_ref.shape[-1]
    l_lo, l_hi = decode_tile_bf16(l_refs[0][rows, :], l_refs[1][rows, :], MXFP4())
    return _dot_nt(h_ref[:, pl.ds(0, r // 2)], l_lo) + _dot_nt(h_ref[:, pl.ds(r // 2, r // 2)], l_hi)



# ---------------------------------------------------------------------------------------------------------------------
# Kernel and wrapper.
# ---------------------------------------------------------------------------------------------------------------------


def _gemm_kernel(*refs, spec: OperandSpec, k: int, block_n: int, n_sub: int, has_lowrank: bool,
                 lowrank_packed: bool, has_bias: bool):
    g, _, o_ref = split_gemm_refs(refs, spec, has_lowrank=has_lowrank, lowrank_packed=lowrank_packed,
                                  has_bias=has_bias)
    accs = accumulate_tiles(g.a, g.w, spec=spec, k=k, block_n=block_n, n_sub=n_sub)
    for j, acc in enumerate(accs):
        cols = pl.ds(j * block_n, block_n)
        o_ref[:, cols] = add_gemm_terms(acc, g, cols, lowrank_packed=lowrank_packed).astype(o_ref.dtype)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _pad_cols(x: jax.Array, cols: int) -> jax.Array:
    return x if x.shape[1] == cols else jnp.pad(x, [(0, 0), (0, cols - x.shape[1])])


def round_up(x: int, b: int) -> int:
    return -(-x // b) * b


def _operand_arrays(q, rows: int, k_pad: int) -> list[jax.Array]:
    """The arrays a kernel reads for one operand, zero-padded to ``rows`` x ``k_pad``."""
    if not isinstance(q, QuantizedArray):
        return [_pad_cols(_pad_rows(jnp.asarray(q, jnp.bfloat16), rows), k_pad)]
    blk = q.fmt.block_size
    scales = q.scales
    if scales.dtype != jnp.uint8:
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    codes = _pad_cols(_pad_rows(q.codes, rows), k_pad // 2)
    # Padding scale byte 0: MXFP4 -> exactly 0; NVFP4 -> E4M3 +0. With zero codes either way the padding adds 0.
    return [codes, _pad_cols(_pad_rows(scales, rows), k_pad // blk)]


def _operand_specs(fmt: Optional[QuantFormat], rows_block: int, k_pad: int, index_map) -> list:
    if fmt is None:
        return [pl.BlockSpec((rows_block, k_pad), index_map)]
    return [pl.BlockSpec((rows_block, k_pad // 2), index_map),
            pl.BlockSpec((rows_block, k_pad // fmt.block_size), index_map)]


def operand_format(q) -> Optional[QuantFormat]:
    """The format of a packed operand (a ``QuantizedArray`` in a standard-block format), ``None`` for a 16-bit one."""
    if not isinstance(q, QuantizedArray):
        return None
    if not q.fmt.is_standard:
        raise ValueError(f"the W4A4 kernels support {q.fmt.name} with block_size={q.fmt.standard_block_size}, "
                         f"got {q.fmt}")
    return q.fmt


def keeps_lowrank_packed(left) -> bool:
    """Whether a low-rank factor ``L (n, r)`` stays packed for the GEMMs (decoded in the epilogue): MXFP4 (block 32)
    with ``r >= 32``; other factors are decoded to bf16 once."""
    return isinstance(left, QuantizedArray) and isinstance(operand_format(left), MXFP4) and left.shape[1] >= 32


def check_operands(a, w) -> tuple[Optional[QuantFormat], int, int, int]:
    """Validates ``a (m, k)``, ``w (n, k)`` (both packed in one format, or both 16-bit); returns ``(fmt, m, n, k)``
    with ``fmt`` the packed operands' format, ``None`` for 16-bit ones."""
    fmt, w_fmt = operand_format(a), operand_format(w)
    if (fmt is None) != (w_fmt is None) or (fmt is not None and type(fmt) is not type(w_fmt)):
        names = [f.name if f is not None else "16-bit" for f in (fmt, w_fmt)]
        raise TypeError(f"operands must be both packed in one format or both 16-bit, got {names[0]} and {names[1]}")
    if len(a.shape) != 2 or len(w.shape) != 2:
        raise ValueError(f"expected 2-D operands a (m, k), w (n, k); got {a.shape} and {w.shape}")
    (m, k), (n, k_w) = a.shape, w.shape
    if k != k_w:
        raise ValueError(f"reduction lengths differ: a {a.shape}, w {w.shape}")
    return fmt, m, n, k


@functools.partial(jax.jit, static_argnames=("block_sizes", "compute", "out_dtype", "interpret"))
def w4a4_matmul(a: QuantizedArray, w: QuantizedArray, *, lowrank: Optional[tuple] = None,
                bias: Optional[jax.Array] = None, block_sizes: Optional[BlockSizes] = None, compute: Compute = "bf16",
                out_dtype=jnp.bfloat16, out: Optional[jax.Array] = None, interpret: bool = False) -> jax.Array:
    """``dequant(a) @ dequant(w)^T [+ h @ L^T] [+ bias]`` with the Pallas kernel.

    Args:
      a: packed activations ``(m, k)`` (``QuantizedArray``, MXFP4 or NVFP4).
      w: packed weights ``(n, k)``, same format.
      lowrank: ``(h (m, r), L (n, r))``: fused low-rank epilogue ``h @ L^T`` (``h = (A T) R^T``); ``r`` a power of
        two >= 16. ``L`` bf16, or packed MXFP4 (``QuantizedArray``, decoded in the kernel; then ``h``'s columns must
        be in :func:`even_odd_permutation` order, as :func:`lowrank_input` returns them).
      bias: ``(n,)`` or ``None``.
      block_sizes: tiles (default :func:`choose_block_sizes`).
      compute: ``"bf16"`` or ``"fp8"`` (MXFP4 only), see the module docstring.
      out_dtype: output dtype (bf16 by default; f32 for exactness checks).
      out: optional ``(m, n)`` buffer the kernel writes into (aliased; tests poison it to check every element).
      interpret: run the kernel body with the Pallas interpreter (CPU).

    Returns:
      ``(m, n)`` in ``out_dtype``.
    """
    fmt, m, n, k = check_operands(a, w)
    if fmt is None:
        raise TypeError("w4a4_matmul takes packed operands; use a @ w.T for 16-bit ones")
    bs = block_sizes or choose_block_sizes(m, n, k)
    spec = OperandSpec(fmt=fmt, compute=compute, block_k=bs.block_k)
    if compute == "fp8" and not isinstance(fmt, MXFP4):
        raise ValueError("compute='fp8' supports MXFP4 only")
    cols = bs.block_n * bs.n_sub
    m_pad, n_pad, k_pad = round_up(m, bs.block_m), round_up(n, cols), round_up(k, bs.block_k)
    args, in_specs, lowrank_packed = gemm_inputs(a, w, spec, m_pad=m_pad, n_pad=n_pad, k_pad=k_pad,
                                                 block_m=bs.block_m, cols=cols, lowrank=lowrank, bias=bias)
    kernel = functools.partial(_gemm_kernel, spec=spec, k=k_pad, block_n=bs.block_n, n_sub=bs.n_sub,
                               has_lowrank=lowrank is not None, lowrank_packed=lowrank_packed, has_bias=bias is not None)
    return launch_gemm(kernel, args, in_specs, block=(bs.block_m, cols), shape=(m, n), padded=(m_pad, n_pad),
                       out=out, out_dtype=out_dtype, num_warps=bs.num_warps, num_stages=bs.num_stages,
                       interpret=interpret, name=f"w4a4_gemm_{fmt.name}_{compute}")


# ---------------------------------------------------------------------------------------------------------------------
# The "dequantize + cuBLAS" strategy: decode both operands to bf16 in memory-bound XLA fusions, one bf16 GEMM.
# ---------------------------------------------------------------------------------------------------------------------


def dequantize_bf16(q: QuantizedArray, *, order: Literal["natural", "even_odd"] = "natural") -> jax.Array:
    """Packed ``(r, k)`` operand -> its exact bf16 values ``(r, k)`` (NVFP4: without the per-tensor scale).

    The same per-tile math as the kernel (``fp4_tile.decode_tile_bf16`` over whole rows), so MXFP4 gives
    ``dequantize(q, bfloat16)`` bit for bit (every scaled E2M1 value is a bf16 value for scale bytes in ``[2, 248]``)
    and NVFP4 gives ``e2m1 * s_blk`` (at most 6 significant bits, exact in bf16; ``tensor_scale`` is applied to the
    GEMM's f32 result). ``order="even_odd"`` returns the columns as ``[0, 2, 4, ..., 1, 3, ...]``
    (:func:`even_odd_permutation`): the low nibbles then the high nibbles, no interleave.
    """
    if operand_format(q) is None or len(q.shape) != 2:
        raise TypeError(f"dequantize_bf16 takes a packed 2-D QuantizedArray, got {type(q).__name__} {q.shape}")
    codes, scales = _operand_arrays(q, q.shape[0], q.shape[1])
    lo, hi = decode_tile_bf16(codes, scales, q.fmt)  # (r, k/2) each: elements 2i and 2i + 1
    if order == "even_odd":
        return jnp.concatenate([lo, hi], axis=1)
    if order != "natural":
        raise ValueError(f"order={order!r} must be 'natural' or 'even_odd'")
    return jax.lax.stack([lo, hi], axis=2).reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("out_dtype", "materialize"))
def w4a4_matmul_dequant(a: QuantizedArray, w: QuantizedArray, *, lowrank: Optional[tuple] = None,
                        bias: Optional[jax.Array] = None, out_dtype=jnp.bfloat16,
                        materialize: bool = True) -> jax.Array:
    """``dequant(a) @ dequant(w)^T [+ h @ L^T] [+ bias]`` as "dequantize + cuBLAS": no Pallas kernel.

    Both packed operands are decoded to bf16 by :func:`dequantize_bf16` (XLA loop fusions, memory-bound: per element
    0.53 bytes read, 2 written), then one ``jnp.dot(..., preferred_element_type=float32)`` on bf16 operands, which XLA
    sends to cuBLAS like the bf16 baseline ``A W^T``.

    Args:
      a: packed activations ``(m, k)``; w: packed weights ``(n, k)``; both MXFP4 or both NVFP4.
      lowrank: ``(h (m, r), L (n, r))`` as for :func:`w4a4_matmul` (``L`` bf16, or packed MXFP4 with ``h``'s columns
        in :func:`even_odd_permutation` order). MXFP4: joined to the GEMM along K (``[A | h] @ [W | L]^T``, one GEMM
        with ``K = k + r``; the decode fusions write ``h`` and ``L`` beside the decoded operands). NVFP4: a second GEMM
        (the per-tensor scales apply to the main product only).
      bias: ``(n,)`` or ``None``, added in f32.
      out_dtype: output dtype (bf16 default; f32 for exactness checks).
      materialize: put the decoded operands behind an ``optimization_barrier`` so that XLA cannot fuse the decode
        into its own GEMM emitter: the strategy as defined (decode, then the library GEMM). ``False`` lets XLA choose
        (it may fuse the decode into a Triton GEMM; a benchmark variant).

    Exactness: the products of the decoded values are exact in f32, so against ``fake_quant(A) fake_quant(W)^T``
    (``+ h L^T``) the result differs only by the order of the fp32 additions: ``<= (k + r) * 2**-24 * P`` with
    ``P = |A_hat| |W_hat|^T (+ |h| |L|^T)`` (NVFP4: ``k + 3``, the per-tensor scales applied once), plus the final
    rounding to ``out_dtype``; the GEMM library's accumulation is fp32 (``preferred_element_type``).
    """
    fmt, m, n, k = check_operands(a, w)
    if fmt is None:
        raise TypeError("w4a4_matmul_dequant takes packed operands; use a @ w.T for 16-bit ones")
    a_bf, w_bf = dequantize_bf16(a), dequantize_bf16(w)
    h = left = None
    if lowrank is not None:
        h, left = lowrank
        if h.ndim != 2 or h.shape[0] != m or left.shape[0] != n or h.shape[1] != left.shape[1]:
            raise ValueError(f"lowrank=(h {h.shape}, L {left.shape}) must be (m={m}, r), (n={n}, r)")
        if isinstance(left, QuantizedArray):
            if not isinstance(operand_format(left), MXFP4):
                raise ValueError(f"a packed low-rank factor L must be MXFP4, got {left.fmt!r}")
            left = dequantize_bf16(left, order="even_odd")  # h comes in even/odd column order
        h, left = h.astype(jnp.bfloat16), jnp.asarray(left).astype(jnp.bfloat16)
        if not fmt.has_tensor_scale:  # one GEMM over K = k + r
            a_bf, w_bf = jnp.concatenate([a_bf, h], axis=1), jnp.concatenate([w_bf, left], axis=1)
            h = left = None
    if materialize:
        a_bf, w_bf = jax.lax.optimization_barrier((a_bf, w_bf))
    y = jnp.dot(a_bf, w_bf.T, preferred_element_type=jnp.float32)  # (m, n) f32
    if fmt.has_tensor_scale:
        y = y * (a.tensor_scale * w.tensor_scale).astype(jnp.float32)
    if h is not None:
        y = y + jnp.dot(h, left.T, preferred_element_type=jnp.float32)
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias {bias.shape} must be ({n},)")
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------------------------------
# References.
# ---------------------------------------------------------------------------------------------------------------------


def w4a4_matmul_reference(a: QuantizedArray, w: QuantizedArray, *, lowrank: Optional[tuple] = None,
                          bias: Optional[jax.Array] = None, out_dtype=jnp.float32) -> jax.Array:
    """The library's fake-quant product in f32: ``dequantize(a) @ dequantize(w)^T [+ h L^T] [+ b]``.

    Equal to ``fake_quant(A) @ fake_quant(W).T`` (``dequantize(quantize(x)) == fake_quant(x)`` bit for bit).
    """
    y = jnp.matmul(dequantize(a, jnp.float32), dequantize(w, jnp.float32).T, precision="highest")
    if lowrank is not None:
        y = y + lowrank_reference(*lowrank)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def lowrank_reference(h: jax.Array, left) -> jax.Array:
    """``h L^T`` in f32 (``h`` in even/odd column order when ``L`` is packed, as the kernel expects it)."""
    hf = jnp.asarray(h).astype(jnp.bfloat16).astype(jnp.float32)
    if isinstance(left, QuantizedArray):
        lf = dequantize(left, jnp.float32)[:, even_odd_permutation(left.shape[1])]
    else:
        lf = jnp.asarray(left).astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.matmul(hf, lf.T, precision="highest")


def w4a4_matmul_tiled_reference(a: QuantizedArray, w: QuantizedArray, *, block_k: int = 128,
                                compute: Compute = "bf16") -> jax.Array:
    """jnp mirror of the kernel's main loop (same per-tile functions, whole rows at once), f32 ``(m, n)``."""
    fmt, m, n, k = check_operands(a, w)
    k_pad = round_up(k, block_k)
    (ca, sa), (cw, sw) = _operand_arrays(a, m, k_pad), _operand_arrays(w, n, k_pad)
    acc = jnp.zeros((m, n), jnp.float32)
    if compute == "bf16":
        hk, nsb = block_k // 2, block_k // fmt.block_size
        for kk in range(k_pad // block_k):
            a_lo, a_hi = decode_tile_bf16(ca[:, kk * hk:(kk + 1) * hk], sa[:, kk * nsb:(kk + 1) * nsb], fmt)
            w_lo, w_hi = decode_tile_bf16(cw[:, kk * hk:(kk + 1) * hk], sw[:, kk * nsb:(kk + 1) * nsb], fmt)
            acc = acc + _dot_nt(a_lo, w_lo) + _dot_nt(a_hi, w_hi)
    else:
        for kb in range(k_pad // 32):
            a8, w8 = decode_tile_fp8(ca[:, kb * 16:(kb + 1) * 16]), decode_tile_fp8(cw[:, kb * 16:(kb + 1) * 16])
            s = (fmt.scale_factors(sa[:, kb:kb + 1], FP8_DECODE_OFFSET)
                 * fmt.scale_factors(sw[:, kb:kb + 1], FP8_DECODE_OFFSET).T)
            acc = acc + _dot_nt(a8.astype(jnp.float32), w8.astype(jnp.float32)) * s
    if fmt.has_tensor_scale:
        acc = acc * (a.tensor_scale * w.tensor_scale)
    return acc
