"""Fused transform + MXFP4 quantizer through Pallas **Mosaic GPU** (the supported Hopper path from jax 0.11).

The same contract as :mod:`pallas_kernels.transform_quantize` (the Pallas Triton kernels), for two kinds:

=========  ============================================================================================================
``q4``     bare quantizer ``Q(A)``.
``k1``     dense 32x32 blocks: per 32-column block one warpgroup MMA ``(BR, 32) x (32, 32)`` per split part of the
           f32 block (``dot_passes`` parts of ``A.dtype``, accumulated in f32 by the tensor cores), the block's
           columns reordered ``[even | odd]`` so that code pairs land in the same thread.
=========  ============================================================================================================

Both read ``A (m, d)`` (bf16/fp16) once and write packed codes ``uint8 (m, d/2)`` (element ``2i`` in the low nibble)
and E8M0 scale bytes ``uint8 (m, d/32)``; MXFP4 output, every :class:`~kroquant_jax.formats.ScaleMode`.

**Shared per-tile math.** The quantizer is ``fp4_tile.mx_quantize_pair_lastaxis``, built from the very functions the
Triton kernels use (``fp4_tile.mx_block_scale`` for the E8M0 byte and the ``2**-e`` multiplier,
``fp4_tile.e2m1_codes_fast`` for the codes): integer ops only (Hopper has no FP4/E8M0 conversion). It is pure jnp,
tested bit for bit against ``formats.mxfp4_quantize_blocks`` on CPU, and takes an optional ``hint`` that the kernels
use to pin register layouts (``plgpu.layout_cast``).

**Data layouts.**

* ``q4`` reads ``A`` as ``uint32`` pairs ``(m, d/32, 16)`` (a free bitcast: element ``2i`` in the low half, ``2i+1``
  in the high half), so each 32-block is 16 words and a code pair is one word: ``even = bits << 16`` and
  ``odd = bits & 0xFFFF0000`` are the two bf16 values as f32 (fp16 through an exact ``uint16 -> f16 -> f32`` cast).
  Registers use :data:`Q4_LAYOUT`: a warp holds one row of 8 blocks (512 contiguous bytes of shared memory), a lane
  four words of one block; the block max is a 4-element in-register max plus two lane shuffles.
* ``k1`` reads ``A`` as ``(BR, BD)`` tiles in 64-byte-swizzled shared memory (the warpgroup-MMA operand layout), and
  the prepared blocks ``(d/32, P, 32, 32)`` of ``A.dtype`` (see :func:`prepare_k1_blocks`). The accumulator
  ``(BR, 32)`` is in the WGMMA register layout, where columns ``c`` and ``c + 16`` of a row (the even and odd
  output columns ``2j``, ``2j+1``) sit in the same thread.
* Codes go back through shared memory and TMA (``(m, d/32, 16)`` view); scale bytes are stored from registers straight
  to global memory (a TMA box must be >= 16 bytes wide, a tile has only ``BD/32`` scale bytes per row).

**Numerics.** ``q4``: bit-exact (one f32 multiply per element, like the reference). ``k1``: the tensor-core product of
``A`` with the ``dot_passes`` parts of the f32 block (exact split for bf16 with 3 parts), f32 accumulation in the
tensor core, then the reference's rounding to ``A.dtype``; the same accumulation-order caveat as the Triton K1
(documented and bounded in ``docs/kernels.md``).

**Limits.** ``m % block_rows == 0`` and ``d % block_cols == 0`` (the wrapper raises ``ValueError`` naming the shape;
:func:`supports` says whether a shape runs here). Kernels need jax's Mosaic GPU (sm_90); there is no Mosaic GPU
interpreter on CPU in jax 0.10, so ``impl="interpret"`` runs the same kernel bodies through the generic Pallas
interpreter with the Mosaic-only parts (layout hints, TMA swizzle, warpgroup MMA) replaced by their plain equivalents.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import formats as F
from kroquant_jax.formats import MXFP4, QuantizedArray, ScaleMode
from pallas_kernels import fp4_tile
from pallas_kernels import transform_quantize as tq
from pallas_kernels._compat import mgpu_load, on_gpu, pl

__all__ = [
    "KINDS",
    "MgpuBlockSizes",
    "Q4_LAYOUT_ARGS",
    "pairs_from_u32",
    "prepare_k1_blocks",
    "supports",
    "transform_quantize_mgpu",
]

KINDS = ("q4", "k1")
BLOCK = tq.BLOCK
_HALF = BLOCK // 2  # 16 words (q4) or 16 even/odd columns (k1) per block

# Q4 register layout (plgpu.Layout.TILED arguments) of a (rows, blocks, 16) uint32 tile: tile (4 rows, 8 blocks, 16
# words), the 16 words split into 4 vectors of 4; warps over the 4 rows, lanes over (8 blocks, 4 vectors).
Q4_LAYOUT_ARGS = dict(tiles=((4, 8, _HALF), (4,)), warp_dims=(-4,), lane_dims=(-3, -2), vector_dim=-1)


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """Tiling of the Mosaic GPU kernels (static).

    Attributes:
      block_rows: rows per program (``q4``: multiple of 4; ``k1``: multiple of 64, the warpgroup-MMA M).
      block_cols: columns per program (multiple of 256: 8 blocks, the Q4 layout's block tile).
      row_chunk: ``q4`` processes its tile ``row_chunk`` rows at a time (register pressure).
      dot_passes: ``k1``: 1, 2 or 3 parts of ``A.dtype`` per f32 block (as ``transform_quantize.BlockSizes``).
      max_concurrent_steps: Pallas Mosaic GPU pipelining depth over the sequential grid axis (1: no pipeline).
      sequential_cols: make the column axis of the grid sequential (each program walks its row strip, the next
        column tile's TMA load in flight while it computes); else both grid axes are parallel.
    """

    block_rows: int = 64
    block_cols: int = 256
    row_chunk: int = 16
    dot_passes: int = 3
    max_concurrent_steps: int = 2
    sequential_cols: bool = False

    def __post_init__(self):
        if self.block_rows % 4 or self.block_rows <= 0:
            raise ValueError(f"MgpuBlockSizes.block_rows={self.block_rows} must be a positive multiple of 4")
        if self.block_cols % 256 or self.block_cols <= 0:
            raise ValueError(f"MgpuBlockSizes.block_cols={self.block_cols} must be a positive multiple of 256")
        if self.row_chunk % 4 or self.block_rows % self.row_chunk:
            raise ValueError(f"MgpuBlockSizes.row_chunk={self.row_chunk} must be a multiple of 4 dividing "
                             f"block_rows={self.block_rows}")
        if self.dot_passes not in (1, 2, 3):
            raise ValueError(f"MgpuBlockSizes.dot_passes={self.dot_passes} must be 1, 2 or 3")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"MgpuBlockSizes.max_concurrent_steps={self.max_concurrent_steps} must be >= 1")


def default_block_sizes(kind: str, dtype=None) -> MgpuBlockSizes:
    """The tiling :func:`transform_quantize_mgpu` uses when none is given (``dot_passes`` as the Triton K1: 3 parts
    for bf16, 2 for fp16, see ``transform_quantize.default_block_sizes``)."""
    if kind == "k1":
        passes = 2 if (dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.float16)) else 3
        return MgpuBlockSizes(block_rows=64, block_cols=256, dot_passes=passes)
    return MgpuBlockSizes(block_rows=64, block_cols=512)


def supports(kind: str, shape: tuple[int, ...], dtype, bs: Optional[MgpuBlockSizes] = None) -> bool:
    """Whether :func:`transform_quantize_mgpu` runs ``kind`` on activations of ``shape``/``dtype`` (2-D view)."""
    if kind not in KINDS or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    bs = bs or default_block_sizes(kind, dtype)
    d = shape[-1]
    m = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    rows = bs.block_rows if kind == "q4" else max(bs.block_rows, 64)
    return m % rows == 0 and d % bs.block_cols == 0


# ---------------------------------------------------------------------------------------------------------------------
# Input decode and K1 operand (the FP4 tile math is pallas_kernels.fp4_tile)
# ---------------------------------------------------------------------------------------------------------------------


def pairs_from_u32(words: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``uint32`` words holding two 16-bit values (element ``2i`` in the low half) -> their f32 values (exact).

    bf16: the f32 bit patterns are the halves shifted to the top. fp16: ``uint16 -> float16 -> float32``.
    """
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        lo = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
        hi = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
        return lo, hi
    lo = jax.lax.bitcast_convert_type((words & jnp.uint32(0xFFFF)).astype(jnp.uint16), jnp.float16)
    hi = jax.lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), jnp.float16)
    return lo.astype(jnp.float32), hi.astype(jnp.float32)


def prepare_k1_blocks(blocks: jax.Array, dtype, passes: int = 3) -> jax.Array:
    """Dense f32 blocks ``(nb, 32, 32)`` -> the K1 kernel's operand ``(nb, passes, 32, 32)`` of ``dtype``.

    Part ``p`` is ``transform_quantize.split_block``'s part ``passes - 1 - p`` (smallest first, the accumulation order of
    the Triton kernel); the columns of each part are reordered ``[0, 2, ..., 30, 1, 3, ..., 31]`` so the product's
    columns ``j`` and ``16 + j`` are the output columns ``2j`` and ``2j + 1``. Computed once per transform (like the
    dense blocks themselves), not per call.
    """
    parts = tq.split_block(jnp.asarray(blocks, jnp.float32), dtype, passes)
    stacked = jnp.stack(parts[::-1], axis=1)  # (nb, P, 32, 32), smallest part first
    return jnp.concatenate([stacked[..., 0::2], stacked[..., 1::2]], axis=-1)


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 - GPU-only module, imported lazily

    return plgpu


def _q4_tile(x_ref, q_ref, s_gmem, row0, col0, *, dtype, mode, bs, mosaic):
    """``x_ref (BR, NB, 16) uint32`` -> ``q_ref (BR, NB, 16) uint8``; scale bytes to ``s_gmem[row0:, col0:]``."""
    br, nb, _ = x_ref.shape
    if mosaic:
        plgpu = _plgpu()
        layout = plgpu.Layout.TILED(plgpu.Tiling(Q4_LAYOUT_ARGS["tiles"]), warp_dims=Q4_LAYOUT_ARGS["warp_dims"],
                                    lane_dims=Q4_LAYOUT_ARGS["lane_dims"], vector_dim=Q4_LAYOUT_ARGS["vector_dim"])
        load = functools.partial(mgpu_load, layout=layout, optimized=False)
        hint = functools.partial(plgpu.layout_cast, new_layout=layout)
    else:
        def load(ref):
            return ref[...]
        def hint(x):
            return x
    rc = bs.row_chunk
    for r in range(br // rc):  # (rc, NB, 16) at a time: 32 registers of input per thread
        rows = pl.ds(r * rc, rc)
        words = load(x_ref.at[rows])
        y_even, y_odd = pairs_from_u32(words, dtype)
        packed, scale_bytes = fp4_tile.mx_quantize_pair_lastaxis(y_even, y_odd, mode, hint=hint)
        q_ref[rows] = packed
        s_gmem[pl.ds(row0 + r * rc, rc), pl.ds(col0, nb)] = scale_bytes


def _k1_tile(a_ref, k_ref, q_ref, s_gmem, row0, col0, *, dtype, mode, bs, mosaic, round_y):
    """``a_ref (BR, BD)``, ``k_ref (NB, P, 32, 32)`` -> ``q_ref (BR, NB, 16) uint8``; scales to ``s_gmem``."""
    del bs
    nb, passes = k_ref.shape[0], k_ref.shape[1]
    br = a_ref.shape[0]
    for t in range(nb):
        cols = pl.ds(t * BLOCK, BLOCK)
        if mosaic:
            plgpu = _plgpu()

            def mma(acc_ref, t=t, cols=cols):
                for p in range(passes):
                    plgpu.wgmma(acc_ref, a_ref.at[:, cols], k_ref.at[t, p])
                return acc_ref[...]

            y = pl.run_scoped(mma, plgpu.ACC((br, BLOCK), jnp.float32))  # (BR, 32) f32, WGMMA layout
        else:
            x = a_ref[:, cols]
            y = None
            for p in range(passes):
                z = jnp.dot(x, k_ref[t, p], preferred_element_type=jnp.float32)
                y = z if y is None else y + z
        if round_y:
            y = y.astype(dtype).astype(jnp.float32)
        packed, scale_bytes = fp4_tile.mx_quantize_pair_lastaxis(y[:, :_HALF], y[:, _HALF:], mode)
        q_ref[:, t, :] = packed
        s_gmem[pl.ds(row0, br), col0 + t] = scale_bytes


def _call(a: jax.Array, kind: str, kparts: Optional[jax.Array], mode: ScaleMode, bs: MgpuBlockSizes,
          interpret: bool, round_y: bool, poison: Optional[tuple[jax.Array, jax.Array]] = None
          ) -> tuple[jax.Array, jax.Array]:
    """Launch: ``plgpu.kernel`` over a grid of row (and column) tiles, each program running ``plgpu.emit_pipeline``
    (TMA loads of the input tiles and TMA stores of the code tiles, ``max_concurrent_steps`` deep over the sequential
    column axis when ``sequential_cols``); ``interpret``: ``pl.pallas_call(interpret=True)`` of the same tile
    functions. ``poison`` (tests): the outputs start as these arrays (mutable refs written in place)."""
    m, d = a.shape
    br, bd = bs.block_rows, bs.block_cols
    nb = bd // BLOCK
    grid = (m // br, d // bd)
    q_shape = jax.ShapeDtypeStruct((m, d // BLOCK, _HALF), jnp.uint8)
    s_shape = jax.ShapeDtypeStruct((m, d // BLOCK), jnp.uint8)
    if kind == "q4":
        args = [jax.lax.bitcast_convert_type(a.reshape(m, d // BLOCK, _HALF, 2), jnp.uint32)]  # (m, d/32, 16)
        blocks = [((br, nb, _HALF), lambda i, j: (i, j, 0))]
        tile = functools.partial(_q4_tile, dtype=a.dtype, mode=mode, bs=bs, mosaic=not interpret)
    else:
        passes = kparts.shape[1]
        args = [a, kparts]
        blocks = [((br, bd), lambda i, j: (i, j)), ((nb, passes, BLOCK, BLOCK), lambda i, j: (j, 0, 0, 0))]
        tile = functools.partial(_k1_tile, dtype=a.dtype, mode=mode, bs=bs, mosaic=not interpret, round_y=round_y)
    q_block = ((br, nb, _HALF), lambda i, j: (i, j, 0))

    if interpret:
        def kernel(*refs):
            *in_refs, q_ref, s_ref = refs[:len(args)] + refs[-2:]
            tile(*in_refs, q_ref, s_ref, pl.program_id(0) * br, pl.program_id(1) * nb)

        aliases, extra = {}, []
        if poison is not None:
            aliases = {len(args): 0, len(args) + 1: 1}
            extra = [poison[0].reshape(q_shape.shape), poison[1]]
        anyspec = pl.BlockSpec(memory_space=pl.ANY)
        codes, scales = pl.pallas_call(
            kernel, out_shape=[q_shape, s_shape], grid=grid,
            in_specs=[pl.BlockSpec(*b) for b in blocks] + [anyspec] * len(extra),
            out_specs=[pl.BlockSpec(*q_block), anyspec], input_output_aliases=aliases, interpret=True)(*args, *extra)
        return codes.reshape(m, d // 2), scales

    plgpu = _plgpu()
    swz = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK * 2))  # 64-byte rows (wgmma operands)
    transforms = [()] if kind == "q4" else [swz, swz]
    par_grid, par_names = ((grid[0],), ("rows",)) if bs.sequential_cols else (grid, ("rows", "cols"))
    seq_grid = (grid[1],) if bs.sequential_cols else ()

    def body(*refs):
        in_gmem, (q_gmem, s_gmem) = refs[:len(args)], refs[len(args):len(args) + 2]
        i = jax.lax.axis_index("rows")
        j_par = None if bs.sequential_cols else jax.lax.axis_index("cols")

        def col(seq_idx):
            return seq_idx[0] if bs.sequential_cols else j_par

        def spec(block, tfs=()):
            shape, index_map = block
            return plgpu.BlockSpec(shape, lambda *seq_idx: index_map(i, col(seq_idx)), transforms=tfs)

        def step(seq_idx, *smem):
            tile(*smem, s_gmem, i * br, col(seq_idx) * nb)

        plgpu.emit_pipeline(step, grid=seq_grid, in_specs=[spec(b, tf) for b, tf in zip(blocks, transforms)],
                            out_specs=[spec(q_block)], max_concurrent_steps=bs.max_concurrent_steps)(*in_gmem, q_gmem)

    launch = functools.partial(plgpu.kernel, grid=par_grid, grid_names=par_names,
                               compiler_params=plgpu.CompilerParams())
    if poison is None:
        codes, scales = launch(body, out_type=(q_shape, s_shape))(*args)
    else:  # tests: outputs as mutable GMEM refs pre-filled with the poison, written in place (pl.core_map)
        @jax.jit  # refs with a memory space exist only under jit
        def run_in_place(args, q_poison, s_poison):
            refs = [jax.new_ref(x, memory_space=plgpu.GMEM) for x in (*args, q_poison, s_poison)]

            @pl.core_map(plgpu.Mesh(grid=par_grid, grid_names=par_names), compiler_params=plgpu.CompilerParams())
            def _():
                body(*refs)

            return jax.freeze(refs[-2]), jax.freeze(refs[-1])

        codes, scales = run_in_place(args, poison[0].reshape(q_shape.shape), poison[1])
    return codes.reshape(m, d // 2), scales


def transform_quantize_mgpu(a: jax.Array, transform: tq.PreparedTransform, fmt=MXFP4(), *,
                            block_sizes: Optional[MgpuBlockSizes] = None, impl: Optional[str] = None,
                            round_to_input: bool = True, k1_parts: Optional[jax.Array] = None,
                            poison_outputs: Optional[tuple[jax.Array, jax.Array]] = None) -> QuantizedArray:
    """``quantize(A T)`` for ``A (..., d)`` through the Mosaic GPU kernels (``q4``, ``k1``; MXFP4 output).

    Args:
      a: ``bfloat16 | float16 (..., d)`` activations.
      transform: a ``q4`` or ``k1`` :class:`~pallas_kernels.transform_quantize.PreparedTransform`.
      fmt: ``MXFP4()`` with any scale mode.
      block_sizes: :class:`MgpuBlockSizes` (default :func:`default_block_sizes`).
      impl: ``None`` (Mosaic GPU on a GPU, the jnp reference elsewhere), ``"pallas"``, ``"interpret"`` (the kernel
        bodies through the generic Pallas interpreter, CPU) or ``"reference"``.
      round_to_input: as :func:`pallas_kernels.transform_quantize.transform_quantize`.
      k1_parts: ``k1``: the prepared blocks of :func:`prepare_k1_blocks` (computed here when not given).
      poison_outputs: as :func:`pallas_kernels.transform_quantize.transform_quantize` (a testing aid).

    Returns:
      A :class:`~kroquant_jax.formats.QuantizedArray`: codes ``(..., d/2)``, E8M0 scales ``(..., d/32)``.
    """
    if not (isinstance(fmt, MXFP4) and fmt.is_standard):
        raise ValueError(f"the Mosaic GPU kernels write MXFP4 with 32-element blocks, got {fmt!r}")
    if transform.kind not in KINDS:
        raise ValueError(f"the Mosaic GPU kernels implement {KINDS}, got transform kind {transform.kind!r}")
    if impl is None:
        impl = "pallas" if (on_gpu(a) and a.dtype in (jnp.bfloat16, jnp.float16)) else "reference"
    if impl not in ("pallas", "interpret", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas', 'interpret' or 'reference'")
    a = jax.lax.stop_gradient(a)
    if impl == "reference":
        return tq.reference_transform_quantize(a, transform, fmt, round_to_input=round_to_input)
    lead, d = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, d)
    if a2.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the kernels read bfloat16 or float16 activations, got {a2.dtype}")
    if d != transform.d:
        raise ValueError(f"activations of width {d} do not match a transform of width {transform.d}")
    bs = block_sizes or default_block_sizes(transform.kind, a2.dtype)
    if transform.kind == "k1" and bs.block_rows % 64:
        raise ValueError(f"k1 needs block_rows a multiple of 64 (warpgroup MMA), got {bs.block_rows}")
    if not supports(transform.kind, a2.shape, a2.dtype, bs):
        raise ValueError(f"the Mosaic GPU {transform.kind} kernel needs m % {bs.block_rows} == 0 and "
                         f"d % {bs.block_cols} == 0, got A of shape {a2.shape} (use transform_quantize.py's kernels)")
    kparts = None
    if transform.kind == "k1":
        kparts = k1_parts if k1_parts is not None else prepare_k1_blocks(transform.blocks, a2.dtype, bs.dot_passes)
        if kparts.shape != (d // BLOCK, bs.dot_passes, BLOCK, BLOCK) or kparts.dtype != a2.dtype:
            raise ValueError(f"k1_parts must be {(d // BLOCK, bs.dot_passes, BLOCK, BLOCK)} of {a2.dtype}, "
                             f"got {kparts.shape} of {kparts.dtype}")
    codes, scales = _call(a2, transform.kind, kparts, fmt.scale_mode, bs, impl == "interpret",
                          round_y=round_to_input, poison=poison_outputs)
    return QuantizedArray(codes=codes.reshape(*lead, d // 2), scales=scales.reshape(*lead, d // BLOCK),
                          tensor_scale=jnp.float32(1.0), fmt=fmt, dtype=np.dtype(a.dtype))
