"""Fused online block transform + FP4 quantizer: one pass from a 16-bit ``A (m, d)`` to packed E2M1 codes and scales.

Kernels (paper §3.5, §4.4, appendices A and B; docs/kernels.md), selected by :class:`PreparedTransform` ``kind``:

=========  ============================================================================================================
``q4``     bare quantizer ``Q(A)`` (the lower bound).
``scale``  per-channel scale ``Q(A diag(s))`` (SmoothQuant's online cost; ``s = 1/γ``).
``k1``     precomputed dense ``(d/32, 32, 32)`` blocks: one ``(BR, 32) x (32, 32)`` tensor-core product per tile.
``k2``     blocks rebuilt on the fly from the 15 Kronecker-LU parameters per block (appendix B's streaming product).
``k2s``    smoothed KroQuant: ``k2`` with the 32 per-block scales ``1/γ`` folded into the block's rows in registers.
``fwht``   full-width normalised fast Walsh-Hadamard transform (``d`` a power of two), then quantize.
=========  ============================================================================================================

Every kernel reads ``A`` once and writes ``codes uint8 (m, d/2)`` (element ``2i`` in the low nibble) and the block
scales (MXFP4: E8M0 bytes ``(m, d/32)``; NVFP4: E4M3 ``(m, d/16)`` plus the fp32 tensor scale) once.

**FP8 output mode** (MXFP4, for the FP8 tensor-core GEMM: :func:`transform_quantize_fp8`): the kernel writes, in the
same quantizing pass, the E4M3 bytes of its MXFP4 result against each row's reference exponent (largest block at
offset +6, ``kroquant_jax.fp8_encoding``'s rule and per-element arithmetic ``e4m3_bits``) in the ``"even_odd"``
column order, optionally the packed codes and scales too; the rows' reference exponents come from a pre-pass of the
same kernel (``emit="max_byte"``). :func:`reencode_e4m3` is the two-phase alternative: packed MXFP4 re-encoded by one
Pallas kernel.

**Numerics (the "same math order" contract).** The reference is ``formats.quantize(apply_to_activations(A, blocks))``:
the transform in f32, the result rounded to ``A.dtype``, then quantized. The kernels do the same: ``y`` in f32, cast to
``A.dtype`` and back, then the per-tile quantizer of :mod:`pallas_kernels.fp4_tile` (``mx_quantize_tile``,
``mx_quantize_pair``, ``nv_quantize_tile``), built from :mod:`kroquant_jax.formats`' shared per-element functions
(``flush_subnormals``, ``mx_shared_exponent``, ``e2m1_encode``) and tested bit for bit against
``mxfp4_quantize_blocks`` / ``nvfp4_quantize_blocks``.
The only difference is inside the transform:

* ``q4``, ``scale``: none (one f32 multiply), so codes and scales are bit-exact.
* ``k1``/``k2``/``k2s``: the 32-term dot runs on tensor cores with the f32 block split into ``dot_passes`` parts of
  ``A.dtype`` (by default 3 for bf16: ``K = hi + mid + lo`` exactly; 2 for fp16: ~2^-22, as faithful as 3 in the
  measured mismatch rates), each product exact in the f32 accumulator; the accumulation order (and the hardware's accumulator alignment) differ from XLA's f32 einsum. Where
  every partial sum is exact (dyadic data, tested) the result is bit-exact; on general data ``y`` differs by a few f32
  ulps, which changes the value rounded to ``A.dtype`` rarely and a code or scale more rarely (bounded in the tests).
  ``dot_passes=1`` is the paper's numerics (block rounded to ``A.dtype``) and is faster but not faithful.
* ``fwht``: butterflies in f32 (log2 d stages) instead of the dense matrix; exact on dyadic data, bounded otherwise.

**Lowering.** The kernels use the Pallas Triton lowering (``compiler_params=pltriton.CompilerParams``), deprecated
from jax 0.11 but still shipped; see ``docs/kernels.md`` for why. Q4 and K1 also exist through Mosaic GPU
(:mod:`pallas_kernels.transform_quantize_mgpu`, sharing :mod:`pallas_kernels.fp4_tile`; not the default). On other backends
:func:`transform_quantize` runs the jnp reference; ``impl="interpret"`` runs the kernel bodies through
``pallas_call(interpret=True)`` (what CPU CI tests).

Public API: :class:`BlockSizes`, :class:`PreparedTransform` / :func:`prepare`, :func:`transform_quantize`,
:func:`transform_quantize_fp8`, :func:`reencode_e4m3`,
:func:`transform_fake_quant` (STE ``custom_vjp``), :func:`reference_transform_quantize`, :func:`reference_apply`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import formats as F
from kroquant_jax import fp8_encoding as FE
from kroquant_jax import transforms as T
from kroquant_jax.formats import MXFP4, QuantFormat, QuantizedArray
from kroquant_jax.transforms import kron_lu
from pallas_kernels import fp4_tile
from pallas_kernels._compat import on_gpu, pl, pltriton, triton_compiler_params

__all__ = [
    "BlockSizes",
    "KINDS",
    "PROFILE_STAGES",
    "default_block_sizes",
    "div_rn_ptx",
    "kernel_stage",
    "PreparedTransform",
    "prepare",
    "reencode_e4m3",
    "reference_apply",
    "split_block",
    "reference_transform_quantize",
    "transform_fake_quant",
    "transform_quantize",
    "transform_quantize_fp8",
]

KINDS = ("q4", "scale", "k1", "k2", "k2s", "fwht")
PROFILE_STAGES = ("transform", "copy")  # kernel_stage: the kernel stopped after its transform, or its tile copy
BLOCK = 32
_KPARAM_WIDTH = 16  # a(5), b(5), c(5), one pad: a power of two for the Triton lowering


# ---------------------------------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the kernels (static): only the fields that choose tiles and launch parameters.

    Attributes:
      block_rows: rows ``BR`` per program (a power of two >= 16, the tensor-core minimum).
      block_cols: the widest column tile ``BD`` (a power-of-two multiple of 32); the tile actually used is the largest
        ``32 * 2**k <= block_cols`` dividing ``d`` (so any ``d % 32 == 0`` works, ``d = 32 * odd`` with ``BD = 32``).
      num_warps, num_stages: Triton launch parameters.
      dot_passes: 1, 2 or 3 ``A.dtype`` parts of each f32 block in the K1/K2 tensor-core product (module docstring;
        :func:`default_block_sizes` uses 3 for bf16, 2 for fp16).
      fwht_rows, fwht_num_warps: tiling of the full-width FWHT (each program holds ``fwht_rows`` whole rows).

    How a tile is processed follows from the kind and the tile (the variants measured fastest,
    ``docs/kernels.md`` "Kernel variants"): q4/scale quantize the whole ``(BR, BD)`` tile at once; k1/k2/k2s compute
    one 32-column block product at a time (MXFP4: as even/odd column halves, quantized without a reshape), K1 with
    MXFP4 and ``BD >= 64`` two block products joined into one 64-column tile; a tile of several column chunks is
    walked by a ``lax.fori_loop`` (software-pipelined over ``num_stages``); fwht runs constant-geometry stages.
    """

    block_rows: int = 64
    block_cols: int = 128
    num_warps: int = 4
    num_stages: int = 1
    dot_passes: int = 3
    fwht_rows: int = 1
    fwht_num_warps: int = 8

    def __post_init__(self):
        for name in ("block_rows", "fwht_rows"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name}={v} must be a power of two")
        if self.block_rows < 16:
            raise ValueError(f"BlockSizes.block_rows={self.block_rows} must be >= 16 (tensor-core tile)")
        if self.block_cols < BLOCK or self.block_cols % BLOCK or (self.block_cols // BLOCK) & (
                self.block_cols // BLOCK - 1):
            raise ValueError(f"BlockSizes.block_cols={self.block_cols} must be 32 * a power of two")
        if self.dot_passes not in (1, 2, 3):
            raise ValueError(f"BlockSizes.dot_passes={self.dot_passes} must be 1, 2 or 3")
        for name in ("num_warps", "num_stages", "fwht_num_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be >= 1")

    def cols_for(self, d: int) -> int:
        """The column tile for width ``d``: the largest ``32 * 2**k <= block_cols`` that divides ``d``."""
        bd = BLOCK
        while bd * 2 <= self.block_cols and d % (bd * 2) == 0:
            bd *= 2
        return bd


def default_block_sizes(kind: str, m: int, d: int, dtype=None) -> BlockSizes:
    """The tiling :func:`transform_quantize` uses when none is given (from the sweeps in docs/kernels.md, "Tiling").

    K1/K2 split the f32 block into ``dot_passes`` parts of ``A.dtype``: 3 for bf16 (8 + 8 + 8 mantissa bits, an exact
    split), 2 for fp16 (11 + 11 bits; the third fp16 part is mostly below fp16's range anyway): fp16 with 2 parts is
    faster than 3 and differs from the f32 reference in as few codes, while bf16 with 2 parts would differ in many
    more (docs/kernels.md, "Tiling" and "Profile: where the K1/K2 time goes").
    """
    passes = 2 if (dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.float16)) else 3
    if kind == "q4":
        return BlockSizes(block_rows=32, block_cols=128, num_warps=4)
    if kind == "scale":
        return BlockSizes(block_rows=64, block_cols=128, num_warps=8)
    if kind == "fwht":
        return BlockSizes(fwht_rows=1 if d >= 8192 else 2, fwht_num_warps=16)
    if kind == "k1" and d % 256 == 0 and -(-m // 64) * (d // 256) >= 512:
        # 256-wide tiles walked by a pipelined loop; with fewer than ~512 such programs the grid is too small and
        # one block per program is faster (docs/kernels.md, Tiling).
        return BlockSizes(block_rows=64, block_cols=256, num_warps=4, num_stages=3, dot_passes=passes)
    return BlockSizes(block_rows=64, block_cols=32, num_warps=4, dot_passes=passes)


def default_block_sizes_one_launch(kind: str, m: int, d: int, dtype=None) -> BlockSizes:
    """The tiling of :func:`transform_quantize_fp8`'s one-launch form (programs of whole rows): 16 rows (the
    tensor-core minimum: the most programs), 4 warps, the chunk loop software-pipelined over 3 stages;
    ``dot_passes`` as :func:`default_block_sizes`. On the H200 sweep (docs/w4a4.md, "The one-launch quantizer") this
    is K1's fastest tiling within noise; K2 was faster with 32 rows, and either is slower than the two-launch form."""
    return dataclasses.replace(default_block_sizes(kind, m, d, dtype), block_rows=16, block_cols=BLOCK, num_warps=4,
                               num_stages=3)


# ---------------------------------------------------------------------------------------------------------------------
# The transform, prepared for the kernels (a pytree)
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("inv_scale", "blocks", "kparams"),
                   meta_fields=("kind", "d"))
@dataclasses.dataclass(frozen=True)
class PreparedTransform:
    """What a kernel reads besides ``A``.

    Attributes:
      kind: one of :data:`KINDS`.
      d: the width.
      inv_scale: ``float32 (d,)``: the per-channel factor ``1/γ`` (``scale``, ``k2s``), else ``None``.
      blocks: ``float32 (d/32, 32, 32)`` dense blocks ``K_j`` (``k1``), else ``None``.
      kparams: ``float32 (d/32, 16)`` Kronecker-LU parameters ``[a_1..a_5, b_1..b_5, c_1..c_5, 0]`` (``k2``, ``k2s``).
    """

    inv_scale: Optional[jax.Array]
    blocks: Optional[jax.Array]
    kparams: Optional[jax.Array]
    kind: str
    d: int

    @staticmethod
    def identity(d: int) -> "PreparedTransform":
        return PreparedTransform(None, None, None, "q4", int(d))

    @staticmethod
    def from_inv_scale(inv_scale: jax.Array) -> "PreparedTransform":
        inv_scale = jnp.asarray(inv_scale, jnp.float32)
        return PreparedTransform(inv_scale, None, None, "scale", int(inv_scale.shape[-1]))

    @staticmethod
    def from_blocks(blocks: jax.Array) -> "PreparedTransform":
        blocks = jnp.asarray(blocks, jnp.float32)
        if blocks.ndim != 3 or blocks.shape[1:] != (BLOCK, BLOCK):
            raise ValueError(f"K1 needs blocks of shape (d/32, 32, 32), got {blocks.shape}")
        return PreparedTransform(None, blocks, None, "k1", int(blocks.shape[0] * BLOCK))

    @staticmethod
    def from_kron_params(params: dict, inv_scale: Optional[jax.Array] = None) -> "PreparedTransform":
        a, b, c = (jnp.asarray(params[k], jnp.float32) for k in ("a", "b", "c"))  # (nb, 5) each
        kp = jnp.concatenate([a, b, c, jnp.zeros((a.shape[0], 1), jnp.float32)], axis=-1)
        d = int(a.shape[0] * BLOCK)
        if inv_scale is None:
            return PreparedTransform(None, None, kp, "k2", d)
        return PreparedTransform(jnp.asarray(inv_scale, jnp.float32), None, kp, "k2s", d)

    @staticmethod
    def fwht(d: int) -> "PreparedTransform":
        if d <= 0 or d & (d - 1):
            raise ValueError(f"FWHT needs d a power of two, got {d=}")
        return PreparedTransform(None, None, None, "fwht", int(d))

    def kron_params(self) -> dict:
        """``{"a", "b", "c"}`` (each ``(d/32, 5)``) of a ``k2``/``k2s`` transform."""
        return {"a": self.kparams[:, 0:5], "b": self.kparams[:, 5:10], "c": self.kparams[:, 10:15]}

    def dense_blocks(self) -> jax.Array:
        """``(d/32, 32, 32)`` blocks of a ``k1``/``k2``/``k2s`` transform (what the reference multiplies by)."""
        if self.kind == "k1":
            return self.blocks
        if self.kind in ("k2", "k2s"):
            k = kron_lu.blocks(self.kron_params())  # (nb, 32, 32), the same f32 product order as the kernel
            if self.kind == "k2s":
                k = self.inv_scale.reshape(-1, BLOCK)[:, :, None] * k  # = smoothed_kron.blocks
            return k
        raise ValueError(f"{self.kind!r} has no 32x32 blocks")


def prepare(name: str, params: Any = None, *, d: Optional[int] = None, kernel: Optional[str] = None
            ) -> PreparedTransform:
    """The :class:`PreparedTransform` of a registered parameterization (``kroquant_jax.transforms``).

    Args:
      name: ``"identity"`` (Q4), ``"diagonal"`` (Scale), ``"kron_lu"`` (K2, or K1 with ``kernel="k1"``),
        ``"smoothed_kron"`` (K2 smoothed, or K1 with the diagonal folded into the blocks), ``"fwht"``, or any other
        registered parameterization with 32x32 blocks (``hadamard32``, ``dense32``, ``cayley32``, ... -> K1).
      params: the parameterization's parameters (``None`` for ``identity``/``fwht`` with ``d``).
      d: the width, where ``params`` does not carry it.
      kernel: force ``"k1"`` for Kronecker transforms (precomputed dense blocks).
    """
    if kernel not in (None, "k1", "k2"):
        raise ValueError(f"kernel={kernel!r} must be None, 'k1' or 'k2'")
    width = d if d is not None else getattr(params, "d", None)
    if name == "identity":
        if width is None:
            raise ValueError("prepare('identity') needs d (or WidthOnly params)")
        return PreparedTransform.identity(width)
    if name == "fwht":
        if width is None:
            raise ValueError("prepare('fwht') needs d (or WidthOnly params)")
        return PreparedTransform.fwht(width)
    if name == "diagonal":
        return PreparedTransform.from_inv_scale(jnp.exp(-params["log_gamma"]))
    if name == "kron_lu" and kernel != "k1":
        return PreparedTransform.from_kron_params(params)
    if name == "smoothed_kron" and kernel != "k1":
        return PreparedTransform.from_kron_params(params["kron"], jnp.exp(-params["log_gamma"]))
    blocks = T.get(name).blocks(params)
    if blocks.shape[1:] == (1, 1):
        return PreparedTransform.from_inv_scale(blocks[:, 0, 0])
    return PreparedTransform.from_blocks(blocks)


# ---------------------------------------------------------------------------------------------------------------------
# Transform math of the kernels (the FP4 tile math is pallas_kernels.fp4_tile)
# ---------------------------------------------------------------------------------------------------------------------


def div_rn_ptx(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded f32 ``x / y`` inside a Pallas Triton kernel on the GPU: ``div.rn.f32`` as inline PTX.

    Triton lowers an f32 ``arith.divf`` to ``div.full.f32`` (approximate, up to 2 ulp), which moves NVFP4 block scales
    that sit next to an E4M3 rounding midpoint; the reference divides exactly (``formats.divide_rn``).
    """
    x, y = jnp.broadcast_arrays(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    (q,) = pltriton.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return q


def split_block(k: jax.Array, dtype, passes: int) -> list[jax.Array]:
    """The f32 block ``k (..., 32, 32)`` as ``passes`` parts of ``dtype``, largest first: ``part_0 = dtype(k)``,
    ``part_i = dtype(k - sum of the previous parts)`` (3 bf16 parts sum to ``k`` exactly)."""
    parts = [k.astype(dtype)]
    rest = k
    for _ in range(passes - 1):
        rest = rest - parts[-1].astype(jnp.float32)
        parts.append(rest.astype(dtype))
    return parts


def _dot_split(x: jax.Array, k: jax.Array, passes: int) -> jax.Array:
    """``x (R, 32)`` (bf16/f16) times the f32 block ``k (32, 32)`` with ``k`` split into ``passes`` parts of x.dtype."""
    y = None
    for p in reversed(split_block(k, x.dtype, passes)):  # smallest part first
        t = jnp.dot(x, p, preferred_element_type=jnp.float32)
        y = t if y is None else y + t
    return y


def _join_pair(y0: jax.Array, y1: jax.Array) -> jax.Array:
    """Two ``(R, 32)`` block products -> ``(R, 64)`` with ``y0`` in columns ``0..31``, ``y1`` in ``32..63``.

    Built from the ops the Pallas Triton lowering has (a 2-way ``stack`` on a new last axis, ``transpose``,
    ``reshape``): no concatenate or slicing.
    """
    r = y0.shape[0]
    j = jnp.stack([y0, y1], axis=-1)  # (R, 32, 2): [..., c, g]
    return jnp.transpose(j, (0, 2, 1)).reshape(r, 2 * BLOCK)


def _kron_block(load_param, inv_col: Optional[jax.Array], col_parity: Optional[int] = None) -> jax.Array:
    """Appendix B: ``K[r, c] = prod_k G_k[bit_{5-k}(r), bit_{5-k}(c)]`` as a streaming product of five (32, 32) selects.

    ``load_param(i)`` returns parameter ``i`` of ``[a_1..a_5, b_1..b_5, c_1..c_5]`` (an f32 scalar). ``inv_col``
    ``(32, 1)`` scales row ``r`` by ``1/γ_r`` (smoothed variant). The f32 product order is ``((G_1 G_2) G_3) ...``, the
    order of ``kron_lu.kron_chain``. ``col_parity`` 0/1 builds only the even/odd columns ``(32, 16)``.
    """
    ncol = BLOCK if col_parity is None else BLOCK // 2
    row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, ncol), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, ncol), 1)
    if col_parity is not None:
        col = 2 * col + col_parity
    k = None
    for f in range(kron_lu.NUM_FACTORS):
        a, b, c = load_param(f), load_param(5 + f), load_param(10 + f)
        g00, g01, g10, g11 = a, b, c * a, c * b - 1.0 / a  # kron_lu.lu_factors
        shift = kron_lu.NUM_FACTORS - 1 - f
        rb = (row >> shift) & 1
        cb = (col >> shift) & 1
        g = jnp.where(rb == 0, jnp.where(cb == 0, g00, g01), jnp.where(cb == 0, g10, g11))
        k = g if k is None else k * g
    if inv_col is not None:
        k = inv_col * k
    return k


def _fwht_scale(d: int) -> float:
    """The f32 entry magnitude of ``normalized_hadamard(d)``: ``(1/√2)**log2(d)`` in the same float64 product order."""
    h, h2 = 1.0, 1.0 / np.sqrt(2.0)
    for _ in range(d.bit_length() - 1):
        h = h * h2
    return float(np.float32(h))


def _fwht_rows(y: jax.Array) -> jax.Array:
    """Unnormalised Walsh-Hadamard transform (Sylvester order) of each row of ``y float32 (R, d)``, the kernel's form.

    Constant geometry: each stage maps ``x`` to ``[x0+x1, x2+x3, ..., x0-x1, x2-x3, ...]``; ``log2 d`` stages give
    ``H_d``. Stage ``s`` adds and subtracts the same pairs as :func:`_fwht_rows_axis`'s stage ``s``, in permuted
    positions.
    """
    r, d = y.shape
    for _ in range(d.bit_length() - 1):
        a, b = jnp.unstack(y.reshape(r, d // 2, 2), axis=-1)
        y = jnp.swapaxes(jnp.stack([a + b, a - b], axis=-1), 1, 2).reshape(r, d)
    return y


def _fwht_rows_axis(y: jax.Array) -> jax.Array:
    """:func:`_fwht_rows` as one size-2 reduction per bit axis (no transposes): the jnp reference's form."""
    r, d = y.shape
    for s in range(d.bit_length() - 1):
        h = 1 << s
        z = y.reshape(r, d // (2 * h), 2, h)
        first = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == 0
        total = jnp.sum(z, axis=2, keepdims=True)
        diff = jnp.sum(jnp.where(first, z, -z), axis=2, keepdims=True)
        y = jnp.where(first, total, diff).reshape(r, d)
    return y



# ---------------------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------------------


def _kernel(*refs, kind, m, block_rows, chunk, n_chunks, fmt, passes, amax_only, n_poison, round_y,
            stage="quantize", interpret=False, emit="mxfp4", with_mxfp4=False):
    it = iter(refs)
    a_ref = next(it)
    inv_ref = next(it) if kind in ("scale", "k2s") else None
    k_ref = next(it) if kind == "k1" else None
    p_ref = next(it) if kind in ("k2", "k2s") else None
    ts_ref = next(it) if (fmt.has_tensor_scale and not amax_only) else None
    er_ref = next(it) if emit == "fp8" else None  # "fp8_rows" finds the rows' e_ref itself
    for _ in range(n_poison):
        next(it)  # aliased output buffers (poison), never read
    out_refs = list(it)
    dtype = a_ref.dtype

    ragged = m % block_rows != 0
    row_mask = None
    if ragged:
        rows = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        row_mask = rows < m

    def load(ref_view, width):
        if row_mask is None:
            return ref_view[...]
        return pltriton.load(ref_view, mask=jnp.broadcast_to(row_mask, (block_rows, width)), other=0)

    def store(ref_view, value):
        if row_mask is None:
            ref_view[...] = value
        else:
            pltriton.store(ref_view, value, mask=jnp.broadcast_to(row_mask, value.shape))

    tensor_scales = (ts_ref[0, 0], ts_ref[0, 1]) if ts_ref is not None else None
    exact_div = None if interpret else div_rn_ptx  # interpret mode: formats.divide_rn
    block = fmt.block_size
    blockwise = kind in ("k1", "k2", "k2s")
    # MXFP4 block products: K1 joins two into a 64-column tile when the chunk is 64 wide; otherwise each block is
    # computed as its even and odd column halves and quantized as a pair (no reshape after the product).
    use_join = blockwise and chunk == 2 * BLOCK and not amax_only
    use_pair = (blockwise and not fmt.has_tensor_scale and not amax_only and stage == "quantize" and not use_join)
    loaded_e_ref = load(er_ref, 1) if er_ref is not None else None  # (BR, 1) int32: the rows' reference exponents
    # the refs of the packed MXFP4 result beside the E4M3 bytes (with_mxfp4): after the bytes (and the row record)
    mx_refs = out_refs[2:] if emit == "fp8_rows" else out_refs[1:]

    def block_matrix(b, parity=None):
        """The f32 ``(32, 32)`` block ``b`` (k1: loaded; k2/k2s: rebuilt), or its even/odd columns ``(32, 16)``."""
        if kind == "k1":
            kb = k_ref[b]
            return kb if parity is None else jnp.unstack(kb.reshape(BLOCK, BLOCK // 2, 2), axis=-1)[parity]
        inv_col = inv_ref[pl.ds(b * BLOCK, BLOCK), :] if kind == "k2s" else None
        return _kron_block(lambda i: p_ref[b, i], inv_col, parity)

    def store_codes(t, packed, scale_bytes, refs=None):
        q_ref, s_ref = out_refs if refs is None else refs
        store(q_ref.at[:, pl.ds(t * (chunk // 2), chunk // 2)], packed)
        store(s_ref.at[:, pl.ds(t * (chunk // block), chunk // block)], scale_bytes)

    def store_fp8(t, lo, hi, packed, scale_bytes):
        """E4M3 bits of the chunk's even / odd elements into rows ``[:, 0]`` / ``[:, 1]`` of the ``(m, 2, d/2)``
        output (the "even_odd" column order once reshaped to ``(m, d)``), and the MXFP4 result when asked."""
        e8_ref = out_refs[0]
        store(e8_ref.at[:, jnp.int32(0), pl.ds(t * (chunk // 2), chunk // 2)], lo)
        store(e8_ref.at[:, jnp.int32(1), pl.ds(t * (chunk // 2), chunk // 2)], hi)
        if with_mxfp4:
            store_codes(t, packed, scale_bytes, refs=mx_refs)

    def emit_tile(t, y, mode, e_ref):
        """Quantize a ``(BR, chunk)`` tile of ``A T`` and store it in ``mode`` (``"mxfp4"``, ``"fp8"`` against
        ``e_ref``), or (``"max_byte"``) return its row maximum of live block bytes: the FP8 mode's pre-pass."""
        if mode == "max_byte":
            return fp4_tile.max_live_byte(fp4_tile.mx_block_bytes_tile(y, fmt.scale_mode))
        if mode == "fp8":
            store_fp8(t, *fp4_tile.mx_quantize_tile_fp8(y, e_ref, fmt.scale_mode))
            return None
        store_codes(t, *fp4_tile.mx_quantize_tile(y, fmt.scale_mode))
        return None

    def emit_pair(t, y_even, y_odd, mode, e_ref):
        if mode == "max_byte":
            return fp4_tile.max_live_byte(fp4_tile.mx_block_bytes_pair(y_even, y_odd, fmt.scale_mode))
        if mode == "fp8":
            store_fp8(t, *fp4_tile.mx_quantize_pair_fp8(y_even, y_odd, e_ref, fmt.scale_mode))
            return None
        store_codes(t, *fp4_tile.mx_quantize_pair(y_even, y_odd, fmt.scale_mode))
        return None

    def process(t, mode=emit, e_ref=loaded_e_ref):
        """Chunk ``t`` of the tile: transform, quantize, store in ``mode`` (or return the row maxima: ``amax_only``,
        ``mode="max_byte"``)."""
        if stage == "copy":  # profiling: the tile's load and store alone
            store(out_refs[0].at[:, pl.ds(t * chunk, chunk)], load(a_ref.at[:, pl.ds(t * chunk, chunk)], chunk))
            return None
        if use_join:  # chunk = 64 columns: one product per block, quantized as one tile
            ys = []
            for g in range(2):
                xb = load(a_ref.at[:, pl.ds(t * chunk + g * BLOCK, BLOCK)], BLOCK)
                yb = _dot_split(xb, block_matrix(t * 2 + g), passes)
                ys.append(yb.astype(dtype).astype(jnp.float32) if round_y else yb)
            y = _join_pair(*ys)
            if stage == "transform":
                store(out_refs[0].at[:, pl.ds(t * chunk, chunk)], y.astype(dtype))
                return None
            return emit_tile(t, y, mode, e_ref)
        x = load(a_ref.at[:, pl.ds(t * chunk, chunk)], chunk)
        if use_pair:
            y_even = _dot_split(x, block_matrix(t, 0), passes)
            y_odd = _dot_split(x, block_matrix(t, 1), passes)
            if round_y:
                y_even = y_even.astype(dtype).astype(jnp.float32)
                y_odd = y_odd.astype(dtype).astype(jnp.float32)
            return emit_pair(t, y_even, y_odd, mode, e_ref)
        if kind == "q4":
            y = x.astype(jnp.float32)
        elif kind == "scale":
            y = x.astype(jnp.float32) * inv_ref[:, pl.ds(t * chunk, chunk)]
        elif blockwise:
            y = _dot_split(x, block_matrix(t), passes)
        elif kind == "fwht":
            y = _fwht_rows(x.astype(jnp.float32)) * jnp.float32(_fwht_scale(chunk))
        else:  # pragma: no cover - validated by the wrapper
            raise ValueError(kind)
        if kind != "q4" and round_y:
            y = y.astype(dtype).astype(jnp.float32)  # the reference's rounding to A.dtype
        if stage == "transform":  # profiling: the transform alone, its result stored in A.dtype
            store(out_refs[0].at[:, pl.ds(t * chunk, chunk)], y.astype(dtype))
            return None
        if amax_only:
            yf = F.flush_subnormals(y)
            return jnp.max(jnp.abs(jnp.where(fp4_tile.is_nonfinite(yf), 0.0, yf)), axis=1, keepdims=True)
        if mode != "mxfp4":
            return emit_tile(t, y, mode, e_ref)
        store_codes(t, *fp4_tile.quantize_tile(fmt, y, tensor_scales, divide=exact_div))
        return None

    if emit == "fp8_rows":
        # One launch, whole rows per program: a first walk over the row's chunks finds its largest live block byte,
        # a second quantizes them again (the same traced code, so the same bytes) and writes E4M3 against that row's
        # e_ref. The second walk re-reads A from the L2 cache, where the first left it.
        record = jax.lax.fori_loop(0, n_chunks, lambda t, r: fp4_tile.combine_live_bytes(r, process(t, "max_byte")),
                                   jnp.zeros((block_rows, 1), jnp.int32))
        store(out_refs[1].at[...], record)
        e_ref = FE.reference_exponent(record & 255)  # (BR, 1)
        jax.lax.fori_loop(0, n_chunks, lambda t, carry: (process(t, "fp8", e_ref), carry)[1], jnp.int32(0))
        return
    reduce_rows = amax_only or emit == "max_byte"
    if not reduce_rows and n_chunks > 1:
        # A scf.for over the column chunks: Triton's software pipeliner can prefetch the next chunk's tile.
        jax.lax.fori_loop(0, n_chunks, lambda t, carry: (process(t), carry)[1], jnp.int32(0))
        return
    running_max = None
    for t in range(n_chunks):
        tile_max = process(t)
        if reduce_rows and running_max is None:
            running_max = tile_max
        elif amax_only:
            running_max = jnp.maximum(running_max, tile_max)
        elif reduce_rows:
            running_max = fp4_tile.combine_live_bytes(running_max, tile_max)
    if reduce_rows:
        store(out_refs[0].at[...], running_max)


def _check_kernel_inputs(a: jax.Array, t: PreparedTransform, fmt: QuantFormat) -> None:
    if a.ndim != 2:
        raise ValueError(f"the kernel takes A (m, d), got shape {a.shape}")
    if a.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the kernels read bfloat16 or float16 activations, got {a.dtype} (use impl='reference')")
    if t.kind not in KINDS:
        raise ValueError(f"unknown transform kind {t.kind!r}")
    m, d = a.shape
    if d != t.d:
        raise ValueError(f"activations of width {d} do not match a transform of width {t.d}")
    if d % BLOCK:
        raise ValueError(f"{d=} must be a multiple of {BLOCK}")
    if not fmt.is_standard:
        raise ValueError(f"the kernels write {fmt.name} with {fmt.standard_block_size}-element blocks, got {fmt}")
    if t.kind == "fwht" and (d & (d - 1)):
        raise ValueError(f"FWHT needs d a power of two, got {d=}")


def _pallas_call(a: jax.Array, t: PreparedTransform, fmt: QuantFormat, ts_pair: Optional[jax.Array],
                 bs: BlockSizes, interpret: bool, poison: Optional[tuple] = None,
                 amax_only: bool = False, round_y: bool = True, stage: str = "quantize", emit: str = "mxfp4",
                 e_ref: Optional[jax.Array] = None, with_mxfp4: bool = False):
    """The kernel on ``A (m, d)``: ``(codes (m, d/2), scale bytes (m, d/block))`` or, with ``amax_only``, the f32
    row maxima of ``|A T|`` per column tile ``(m, d/BD)`` (for NVFP4's tensor scale).

    ``stage``: ``"quantize"`` (the kernel) or one of :data:`PROFILE_STAGES` (see :func:`kernel_stage`), which
    return ``[out (m, d)]``. ``emit`` (MXFP4 only): ``"mxfp4"`` (the codes and scales above), ``"max_byte"``
    (``int32 (m, d/BD)``: per row and column tile, the largest non-NaN E8M0 byte the quantizer gives, plus 256 if a
    block is NaN; the FP8 mode's pre-pass), ``"fp8"`` (``uint8 (m, 2, d/2)``: the E4M3 bits of the even and odd
    elements against ``e_ref int32 (m, 1)``, then, with ``with_mxfp4``, the codes and scales) or ``"fp8_rows"``
    (one launch, programs of ``BR`` whole rows: the E4M3 bits against each row's own ``e_ref``, the rows'
    ``max_byte`` record ``int32 (m, 1)``, then, with ``with_mxfp4``, the codes and scales)."""
    if stage != "quantize" and stage not in PROFILE_STAGES:
        raise ValueError(f"stage={stage!r} must be 'quantize', 'transform' or 'copy'")
    if emit not in ("mxfp4", "max_byte", "fp8", "fp8_rows") or (emit != "mxfp4" and (
            fmt.has_tensor_scale or amax_only or stage != "quantize")):
        raise ValueError(f"emit={emit!r} must be 'mxfp4', or 'max_byte' / 'fp8' / 'fp8_rows' for an MXFP4 quantizing "
                         f"kernel")
    if (emit == "fp8") != (e_ref is not None):
        raise ValueError("emit='fp8' takes the rows' reference exponents e_ref (m, 1), and only it")
    m, d = a.shape
    kind = t.kind
    block = fmt.block_size
    if kind == "fwht":
        br, bd, chunk, warps = bs.fwht_rows, d, d, bs.fwht_num_warps
    else:
        br, bd, warps = bs.block_rows, (d if emit == "fp8_rows" else bs.cols_for(d)), bs.num_warps
        if kind in ("q4", "scale"):
            chunk = bs.cols_for(d) if emit == "fp8_rows" else bd  # the whole (power-of-two) tile quantized at once
        elif kind == "k1" and not fmt.has_tensor_scale and not amax_only and bd % (2 * BLOCK) == 0:
            chunk = 2 * BLOCK  # two block products joined into one tile
        else:
            chunk = BLOCK
    grid = (pl.cdiv(m, br), d // bd)

    args, in_specs = [a], [pl.BlockSpec((br, bd), lambda i, j: (i, j))]
    if kind == "scale":
        args.append(t.inv_scale.astype(jnp.float32).reshape(1, d))
        in_specs.append(pl.BlockSpec((1, bd), lambda i, j: (0, j)))
    if kind == "k2s":
        args.append(t.inv_scale.astype(jnp.float32).reshape(d, 1))
        in_specs.append(pl.BlockSpec((bd, 1), lambda i, j: (j, 0)))
    if kind == "k1":
        args.append(t.blocks.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((bd // BLOCK, BLOCK, BLOCK), lambda i, j: (j, 0, 0)))
    if kind in ("k2", "k2s"):
        args.append(t.kparams.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((bd // BLOCK, _KPARAM_WIDTH), lambda i, j: (j, 0)))
    if fmt.has_tensor_scale and not amax_only:
        args.append(ts_pair.astype(jnp.float32).reshape(1, 2))
        in_specs.append(pl.BlockSpec((1, 2), lambda i, j: (0, 0)))
    if emit == "fp8":
        args.append(e_ref.astype(jnp.int32).reshape(m, 1))
        in_specs.append(pl.BlockSpec((br, 1), lambda i, j: (i, 0)))
    codes_specs = [pl.BlockSpec((br, bd // 2), lambda i, j: (i, j)),
                   pl.BlockSpec((br, bd // block), lambda i, j: (i, j))]
    codes_shapes = [jax.ShapeDtypeStruct((m, d // 2), jnp.uint8), jax.ShapeDtypeStruct((m, d // block), jnp.uint8)]
    if emit == "max_byte":
        out_shape = [jax.ShapeDtypeStruct((m, grid[1]), jnp.int32)]
        out_specs = [pl.BlockSpec((br, 1), lambda i, j: (i, j))]
    elif emit == "fp8":
        out_shape = [jax.ShapeDtypeStruct((m, 2, d // 2), jnp.uint8)] + (codes_shapes if with_mxfp4 else [])
        out_specs = [pl.BlockSpec((br, 2, bd // 2), lambda i, j: (i, 0, j))] + (codes_specs if with_mxfp4 else [])
    elif emit == "fp8_rows":
        out_shape = ([jax.ShapeDtypeStruct((m, 2, d // 2), jnp.uint8), jax.ShapeDtypeStruct((m, 1), jnp.int32)]
                     + (codes_shapes if with_mxfp4 else []))
        out_specs = ([pl.BlockSpec((br, 2, bd // 2), lambda i, j: (i, 0, j)), pl.BlockSpec((br, 1), lambda i, j: (i, 0))]
                     + (codes_specs if with_mxfp4 else []))
    elif amax_only:
        out_shape = [jax.ShapeDtypeStruct((m, grid[1]), jnp.float32)]
        out_specs = [pl.BlockSpec((br, 1), lambda i, j: (i, j))]
    elif stage != "quantize":
        out_shape = [jax.ShapeDtypeStruct((m, d), a.dtype)]
        out_specs = [pl.BlockSpec((br, bd), lambda i, j: (i, j))]
    else:
        out_shape, out_specs = codes_shapes, codes_specs
    aliases = {}
    n_poison = 0
    if poison is not None and not amax_only and stage == "quantize" and emit != "max_byte":
        if len(poison) != len(out_shape):
            raise ValueError(f"poison_outputs: {len(poison)} arrays for the kernel's {len(out_shape)} outputs")
        n_poison = len(poison)
        aliases = {len(args) + k: k for k in range(n_poison)}
        args.extend(poison)
        in_specs.extend(out_specs)
    kernel = functools.partial(
        _kernel, kind=kind, m=m, block_rows=br, chunk=chunk, n_chunks=bd // chunk, fmt=fmt, passes=bs.dot_passes,
        amax_only=amax_only, n_poison=n_poison, round_y=round_y, stage=stage, interpret=interpret, emit=emit,
        with_mxfp4=with_mxfp4)
    call = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else triton_compiler_params(warps, bs.num_stages),
        name=f"tq_{kind}_{fmt.name}{'_amax' if amax_only else ''}{'' if stage == 'quantize' else '_' + stage}"
             f"{'' if emit == 'mxfp4' else '_' + emit}")
    return call(*args)


# ---------------------------------------------------------------------------------------------------------------------
# References (jnp) and the public ops
# ---------------------------------------------------------------------------------------------------------------------


def _fwht_jnp(x: jax.Array) -> jax.Array:
    """Normalised full-width Walsh-Hadamard of the last axis, f32 butterflies (any leading shape)."""
    lead, d = x.shape[:-1], x.shape[-1]
    y = _fwht_rows_axis(x.astype(jnp.float32).reshape(-1, d)) * jnp.float32(_fwht_scale(d))
    return y.reshape(*lead, d)


def reference_apply(a: jax.Array, t: PreparedTransform, *, dense_fwht: bool = False) -> jax.Array:
    """``A T`` in f32, returned in ``a.dtype`` (``transforms.apply_to_activations``'s contract).

    ``fwht`` uses f32 butterflies unless ``dense_fwht`` (the dense ``(d, d)`` normalised Hadamard, small d only).
    """
    if t.kind == "q4":
        return a
    if t.kind == "scale":
        return T.apply_to_activations(a, t.inv_scale[:, None, None])
    if t.kind in ("k1", "k2", "k2s"):
        return T.apply_to_activations(a, t.dense_blocks())
    if t.kind == "fwht":
        if dense_fwht:
            return T.apply_to_activations(a, T.FWHT.blocks(T.FWHT.init(t.d)))
        return _fwht_jnp(a).astype(a.dtype)
    raise ValueError(f"unknown transform kind {t.kind!r}")


def reference_transform_quantize(a: jax.Array, t: PreparedTransform, fmt=MXFP4(), *,
                                 tensor_scale: Optional[jax.Array] = None, dense_fwht: bool = False,
                                 round_to_input: bool = True) -> QuantizedArray:
    """The jnp reference: ``quantize(reference_apply(a, t), fmt)`` (NVFP4: tensor scale of ``A T`` unless given).

    ``round_to_input=False`` quantizes the f32 ``A T`` without rounding it to ``a.dtype`` first (the
    ``qlinear_forward(path="packed")`` convention), returning a QuantizedArray with ``dtype=a.dtype``.
    """
    if round_to_input or t.kind == "q4":
        y = reference_apply(a, t, dense_fwht=dense_fwht)
    else:
        y = (T.apply_to_activations(a.astype(jnp.float32), T.FWHT.blocks(T.FWHT.init(t.d)))
             if (t.kind == "fwht" and dense_fwht) else _apply_f32(a, t))
    q = F.quantize(y, fmt, tensor_scale=tensor_scale)
    return dataclasses.replace(q, dtype=np.dtype(a.dtype))


def _resolve_impl(a: jax.Array, impl: Optional[str]) -> str:
    if impl is None:
        return "pallas" if (on_gpu(a) and a.dtype in (jnp.bfloat16, jnp.float16)) else "reference"
    if impl not in ("pallas", "interpret", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas', 'interpret' or 'reference'")
    return impl


def transform_quantize(a: jax.Array, transform: PreparedTransform, fmt=MXFP4(), *,
                       tensor_scale: Optional[jax.Array] = None, block_sizes: Optional[BlockSizes] = None,
                       impl: Optional[str] = None, round_to_input: bool = True, poison_outputs: Optional[tuple] = None
                       ) -> QuantizedArray:
    """``quantize(A T)`` for ``A (..., d)``: the fused kernel on a GPU, the jnp reference elsewhere.

    Args:
      a: ``bfloat16 | float16 (..., d)`` activations (``float32`` runs the reference); an empty batch is valid.
      transform: a :class:`PreparedTransform` (see :func:`prepare`).
      fmt: ``MXFP4()`` (any scale mode) or ``NVFP4()``.
      tensor_scale: formats with a tensor scale (NVFP4) only: a fixed per-tensor scale; by default it is
        ``amax|A T| / (448 * 6)``, which costs the kernel path one extra read pass (an amax kernel with the same
        transform).
      block_sizes: kernel tiling (default :class:`BlockSizes`).
      impl: ``None`` (kernel on GPU for bf16/f16, else reference), ``"pallas"``, ``"interpret"`` or ``"reference"``.
      round_to_input: round ``A T`` to ``a.dtype`` before quantizing (the reference ``quantize(apply_to_activations(
        A, blocks))``); ``False`` quantizes the f32 product (``qlinear_forward(path="packed")``'s convention).
      poison_outputs: kernel paths only, a testing aid: ``(codes, scales)`` arrays of the output shapes that the
        kernel's output buffers start from, so a test can prove that every element was written.

    Returns:
      A :class:`~kroquant_jax.formats.QuantizedArray` (codes ``(..., d/2)``, scales ``(..., d/block)``); its gradient
      is zero (integer outputs; use :func:`transform_fake_quant` for the STE).
    """
    F._check_dtype(a, "transform_quantize")
    F.check_format(fmt, "transform_quantize")
    if tensor_scale is not None and not fmt.has_tensor_scale:
        raise ValueError(f"transform_quantize: {fmt.name} has no per-tensor scale; tensor_scale must be None")
    impl = _resolve_impl(a, impl)
    a = jax.lax.stop_gradient(a)
    if impl == "reference":
        return reference_transform_quantize(a, transform, fmt, tensor_scale=tensor_scale,
                                            round_to_input=round_to_input)
    lead, d = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, d)
    _check_kernel_inputs(a2, transform, fmt)
    if a2.shape[0] == 0:  # an empty batch: nothing to launch (the reference's empty result)
        return reference_transform_quantize(a, transform, fmt, tensor_scale=tensor_scale,
                                            round_to_input=round_to_input)
    bs = block_sizes or default_block_sizes(transform.kind, a2.shape[0], d, a2.dtype)
    interpret = impl == "interpret"
    ts_pair = None
    ts = jnp.float32(1.0)
    if fmt.has_tensor_scale:
        if tensor_scale is None:
            (row_max,) = _pallas_call(a2, transform, fmt, None, bs, interpret, amax_only=True,
                                      round_y=round_to_input)
            ts = F.nvfp4_tensor_scale_from_amax(jnp.max(row_max))
        else:
            ts = jnp.asarray(tensor_scale, jnp.float32)
        ts_pair = jnp.stack([ts, F.divide_rn(jnp.float32(1.0), ts)])
    codes, scales = _pallas_call(a2, transform, fmt, ts_pair, bs, interpret, poison=poison_outputs,
                                 round_y=round_to_input)
    codes = codes.reshape(*lead, d // 2)
    scales = scales.reshape(*lead, scales.shape[-1])
    if scales.dtype != fmt.scale_dtype:  # the kernel writes bytes
        scales = jax.lax.bitcast_convert_type(scales, fmt.scale_dtype)
    return QuantizedArray(codes=codes, scales=scales, tensor_scale=ts, fmt=fmt, dtype=np.dtype(a.dtype))


def transform_quantize_fp8(a: jax.Array, transform: PreparedTransform, fmt=MXFP4(), *, with_mxfp4: bool = False,
                           block_sizes: Optional[BlockSizes] = None, impl: Optional[str] = None,
                           round_to_input: bool = True, poison_outputs: Optional[tuple] = None,
                           one_launch: bool = False):
    """``quantize(A T)`` written as FP8 rows: the kernel's FP8 output mode (the quantizer emits E4M3).

    The result is bit for bit ``fp8_encoding.mxfp4_to_e4m3(transform_quantize(a, ...), order="even_odd",
    count_inexact=False)``: per row one power of two ``2**e_ref`` with the row's largest block at offset +6, and the
    E4M3 bytes of every MXFP4 value against it (``fp8_encoding.e4m3_bits``: exact where the row's block exponents span
    <= 14 binades, the out-of-range policy otherwise; NaN blocks as E4M3 NaN and a NaN row scale).

    ``e_ref`` needs the largest block of the whole row before the first byte is written, and a program of the kernel
    sees a ``(BR, BD)`` tile (the tilings measured fastest keep ``BD`` at 32-256 columns: full-row programs leave the
    GPU with ``m / BR`` programs, too few at m = 512). So it runs in two launches: a **pre-pass** (the same kernel
    and tiling with ``emit="max_byte"``: the same transform and block maxima, no codes, no stores but one int32 per
    row and tile) gives each row's largest block byte, ``fp8_encoding.reference_exponent`` turns it into ``e_ref``
    (an XLA reduction over ``(m, d/BD)``), and the quantizing pass writes the E4M3 bytes (and, with ``with_mxfp4``,
    the packed codes and scales) in one pass over ``A``. Both launches compute ``A T`` with the same traced code, so
    the pre-pass bytes are the quantizer's.

    ``one_launch=True`` runs it as **one launch** instead: each program owns ``block_rows`` whole rows (the grid is
    ``m / block_rows`` programs; ``block_cols`` is unused), walks the row's chunks once to find its largest block,
    then again to quantize and write the E4M3 bytes against that row's ``e_ref`` (the second walk reads ``A`` back
    from the L2 cache). The same traced per-chunk code in both walks and in both ways, so the same bytes; no
    ``(m, d/BD)`` record round trip through memory and no second launch, but fewer, longer programs.
    :func:`default_block_sizes_one_launch` gives its tiling.

    Args:
      a, transform, fmt, block_sizes, impl, round_to_input, poison_outputs: as :func:`transform_quantize` (``fmt``
        MXFP4 only; ``poison_outputs``: ``(e4m3 bytes uint8 (m, 2, d/2)[, codes, scales])``, kernel paths).
      with_mxfp4: also return the MXFP4 result.
      one_launch: the one-launch form above (``poison_outputs`` then also poisons its row record).

    Returns:
      ``fp8_encoding.Fp8Rows`` (values ``float8_e4m3fn (..., d)`` in ``"even_odd"`` column order, scale ``(...)``,
      ``inexact = -1``: not counted), and with ``with_mxfp4`` the ``QuantizedArray`` beside it.
    """
    F._check_dtype(a, "transform_quantize_fp8")
    if not isinstance(fmt, MXFP4):
        raise TypeError(f"transform_quantize_fp8: needs MXFP4, got {fmt!r} (NVFP4 values e2m1 * e4m3 are not exact "
                        f"in E4M3)")
    impl = _resolve_impl(a, impl)
    a = jax.lax.stop_gradient(a)
    lead, d = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, d)
    if impl == "reference" or a2.shape[0] == 0:
        q = reference_transform_quantize(a, transform, fmt, round_to_input=round_to_input)
        rows = FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
        return (rows, q) if with_mxfp4 else rows
    _check_kernel_inputs(a2, transform, fmt)
    m = a2.shape[0]
    interpret = impl == "interpret"
    if one_launch:
        bs = block_sizes or default_block_sizes_one_launch(transform.kind, m, d, a2.dtype)
        poison = None if poison_outputs is None else (
            poison_outputs[0], jnp.full((m, 1), -1, jnp.int32), *poison_outputs[1:])
        outs = _pallas_call(a2, transform, fmt, None, bs, interpret, poison=poison, round_y=round_to_input,
                            emit="fp8_rows", with_mxfp4=with_mxfp4)
        outs = list(outs)
        record = outs.pop(1)[:, 0]  # (m,) the row's largest live byte (+256 with a NaN block)
        e_ref, nan_row = FE.reference_exponent(record & 255), (record >> 8) > 0
    else:
        bs = block_sizes or default_block_sizes(transform.kind, m, d, a2.dtype)
        (tile_max,) = _pallas_call(a2, transform, fmt, None, bs, interpret, round_y=round_to_input, emit="max_byte")
        e_ref = FE.reference_exponent(jnp.max(tile_max & 255, axis=1))  # (m,) from the largest live byte of the row
        nan_row = jnp.max(tile_max >> 8, axis=1) > 0
        outs = _pallas_call(a2, transform, fmt, None, bs, interpret, poison=poison_outputs, round_y=round_to_input,
                            emit="fp8", e_ref=e_ref[:, None], with_mxfp4=with_mxfp4)
    values = jax.lax.bitcast_convert_type(outs[0].reshape(*lead, d), jnp.float8_e4m3fn)
    scale = jnp.where(nan_row, jnp.nan, F.pow2(e_ref)).reshape(lead)
    rows = FE.Fp8Rows(values=values, scale=scale, inexact=jnp.int32(-1), order="even_odd")
    if not with_mxfp4:
        return rows
    codes, scales = outs[1].reshape(*lead, d // 2), outs[2].reshape(*lead, d // fmt.block_size)
    if scales.dtype != fmt.scale_dtype:  # the kernel writes bytes
        scales = jax.lax.bitcast_convert_type(scales, fmt.scale_dtype)
    q = QuantizedArray(codes=codes, scales=scales, tensor_scale=jnp.float32(1.0), fmt=fmt, dtype=np.dtype(a.dtype))
    return rows, q


def _reencode_kernel(c_ref, s_ref, er_ref, o_ref, *, m, block_rows):
    """One ``(BR, BC)`` tile of packed codes (+ their ``BC/16`` E8M0 bytes, the rows' ``e_ref``) -> the E4M3 bits of
    its even / odd elements into ``o_ref[:, 0]`` / ``o_ref[:, 1]``."""
    width = c_ref.shape[1]
    row_mask = None
    if m % block_rows:
        rows = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        row_mask = rows < m

    def load(ref):
        if row_mask is None:
            return ref[...]
        return pltriton.load(ref, mask=jnp.broadcast_to(row_mask, ref.shape), other=0)

    def store(ref, value):
        if row_mask is None:
            ref[...] = value
        else:
            pltriton.store(ref, value, mask=jnp.broadcast_to(row_mask, value.shape))

    codes = load(c_ref).astype(jnp.int32)
    nb = width // (BLOCK // 2)
    byte = jnp.broadcast_to(load(s_ref).astype(jnp.int32)[:, :, None], (block_rows, nb, BLOCK // 2))
    byte = byte.reshape(block_rows, width)
    e_ref = load(er_ref)
    store(o_ref.at[:, jnp.int32(0), :], FE.e4m3_bits(codes & 15, byte, e_ref).astype(jnp.uint8))
    store(o_ref.at[:, jnp.int32(1), :], FE.e4m3_bits(codes >> 4, byte, e_ref).astype(jnp.uint8))


def reencode_e4m3(q: QuantizedArray, *, impl: Optional[str] = None, block_rows: int = 16,
                  block_cols: int = 512, num_warps: int = 4) -> "FE.Fp8Rows":
    """``fp8_encoding.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)`` as one Pallas kernel (the second
    phase of the two-phase FP8 activations: the quantizer writes packed MXFP4, this kernel its E4M3 bytes).

    ``e_ref`` and the NaN rows come from an XLA reduction over the scale bytes ``(m, d/32)``; the kernel reads each
    code byte once and writes its two E4M3 bytes (``fp8_encoding.e4m3_bits``) in the ``"even_odd"`` order.

    Args:
      q: MXFP4 ``QuantizedArray`` ``(..., d)`` (standard 32-element blocks).
      impl: ``None`` (the kernel on a GPU, ``mxfp4_to_e4m3`` elsewhere), ``"pallas"``, ``"interpret"``,
        ``"reference"``.
      block_rows, block_cols: the tile, in rows and code bytes (powers of two; ``block_cols`` is cut to the largest
        power of two >= 16 dividing ``d/2``). The default is the tiling of the H200 sweep that was fast at both of
        Ideogram 4's activation widths (docs/kernels.md, "The re-encode's tiling").
      num_warps: Triton launch parameter.

    Returns:
      ``Fp8Rows`` (values ``(..., d)`` in ``"even_odd"`` order, scale ``(...)``, ``inexact = -1``).
    """
    if not isinstance(q, QuantizedArray) or not isinstance(q.fmt, MXFP4) or q.fmt.block_size != BLOCK:
        raise TypeError(f"reencode_e4m3: needs an MXFP4 QuantizedArray with {BLOCK}-element blocks, got "
                        f"{getattr(q, 'fmt', type(q).__name__)!r}")
    for name, v, low in (("block_rows", block_rows, 1), ("block_cols", block_cols, 16), ("num_warps", num_warps, 1)):
        if v < low or v & (v - 1):
            raise ValueError(f"reencode_e4m3: {name}={v} must be a power of two >= {low}")
    if impl is None:
        impl = "pallas" if on_gpu(q.codes) else "reference"
    if impl not in ("pallas", "interpret", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas', 'interpret' or 'reference'")
    lead, half = q.codes.shape[:-1], q.codes.shape[-1]
    codes = q.codes.reshape(-1, half)
    m = codes.shape[0]
    if impl == "reference" or m == 0:
        return FE.mxfp4_to_e4m3(q, order="even_odd", count_inexact=False)
    scales = jax.lax.bitcast_convert_type(q.scales, jnp.uint8).reshape(m, -1)
    b = scales.astype(jnp.int32)
    e_ref = FE.reference_exponent(jnp.max(jnp.where(b == F.E8M0_NAN, 0, b), axis=1))
    nan_row = jnp.any(b == F.E8M0_NAN, axis=1)
    bc = 16
    while bc * 2 <= block_cols and half % (bc * 2) == 0:
        bc *= 2
    if half % bc:
        raise ValueError(f"reencode_e4m3: d/2 = {half} must be a multiple of 16")
    grid = (pl.cdiv(m, block_rows), half // bc)
    out = pl.pallas_call(
        functools.partial(_reencode_kernel, m=m, block_rows=block_rows),
        out_shape=jax.ShapeDtypeStruct((m, 2, half), jnp.uint8), grid=grid,
        in_specs=[pl.BlockSpec((block_rows, bc), lambda i, j: (i, j)),
                  pl.BlockSpec((block_rows, bc // (BLOCK // 2)), lambda i, j: (i, j)),
                  pl.BlockSpec((block_rows, 1), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((block_rows, 2, bc), lambda i, j: (i, 0, j)),
        interpret=impl == "interpret",
        compiler_params=None if impl == "interpret" else triton_compiler_params(num_warps, 1),
        name="reencode_mxfp4_e4m3")(codes, scales, e_ref[:, None])
    values = jax.lax.bitcast_convert_type(out.reshape(*lead, 2 * half), jnp.float8_e4m3fn)
    scale = jnp.where(nan_row, jnp.nan, F.pow2(e_ref)).reshape(lead)
    return FE.Fp8Rows(values=values, scale=scale, inexact=jnp.int32(-1), order="even_odd")


def kernel_stage(a: jax.Array, transform: PreparedTransform, fmt=MXFP4(), *, stage: str,
                 block_sizes: Optional[BlockSizes] = None, impl: str = "pallas") -> jax.Array:
    """The fused kernel of :func:`transform_quantize` stopped after one stage, for profiling where its time goes.

    ``stage="transform"``: the same tiles, block products and launch as the kernel, ``A T`` stored in ``a.dtype``
    instead of being quantized (equal to :func:`reference_apply` on exactly representable data);
    ``stage="copy"``: the same tiles loaded and stored back (no transform, no quantizer), which returns ``a``.
    ``fmt`` picks the tiling the quantizing kernel would use (K1 joins two block products for MXFP4).

    Args:
      a: ``bfloat16 | float16 (..., d)`` activations.
      transform: a :class:`PreparedTransform`.
      fmt: the format the full kernel would write.
      stage: one of :data:`PROFILE_STAGES`.
      block_sizes: kernel tiling (default :func:`default_block_sizes`).
      impl: ``"pallas"`` (the GPU kernel) or ``"interpret"`` (``pallas_call(interpret=True)``, any backend).

    Returns:
      ``(..., d)`` in ``a.dtype``.
    """
    if stage not in PROFILE_STAGES:
        raise ValueError(f"kernel_stage: stage={stage!r} must be one of {PROFILE_STAGES}")
    if impl not in ("pallas", "interpret"):
        raise ValueError(f"kernel_stage: impl={impl!r} must be 'pallas' or 'interpret' (a stage is a kernel variant)")
    F._check_dtype(a, "kernel_stage")
    F.check_format(fmt, "kernel_stage")
    lead, d = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, d)
    _check_kernel_inputs(a2, transform, fmt)
    if a2.shape[0] == 0:  # an empty batch: nothing to launch
        return a
    bs = block_sizes or default_block_sizes(transform.kind, a2.shape[0], d, a2.dtype)
    (y,) = _pallas_call(a2, transform, fmt, None, bs, impl == "interpret", stage=stage)
    return y.reshape(*lead, d)


def _apply_f32(a: jax.Array, t: PreparedTransform) -> jax.Array:
    """``A T`` in f32 (no rounding): the function whose VJP the STE backward uses."""
    if t.kind == "q4":
        return a.astype(jnp.float32)
    if t.kind == "scale":
        return a.astype(jnp.float32) * t.inv_scale
    if t.kind == "fwht":
        return _fwht_jnp(a)
    blocks = t.dense_blocks()
    xb = a.astype(jnp.float32).reshape(*a.shape[:-1], blocks.shape[0], BLOCK)
    return jnp.einsum("...bi,bij->...bj", xb, blocks, precision=jax.lax.Precision.HIGHEST).reshape(a.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fake_quant(a, t, tensor_scale, fmt, block_sizes, impl):
    q = transform_quantize(a, t, fmt, tensor_scale=tensor_scale, block_sizes=block_sizes, impl=impl)
    return F.dequantize(q, a.dtype)


def _fake_quant_fwd(a, t, tensor_scale, fmt, block_sizes, impl):
    return _fake_quant(a, t, tensor_scale, fmt, block_sizes, impl), (a, t, tensor_scale)


def _fake_quant_bwd(fmt, block_sizes, impl, res, g):
    a, t, tensor_scale = res
    _, vjp = jax.vjp(_apply_f32, a, t)
    ga, gt = vjp(g.astype(jnp.float32))
    gts = None if tensor_scale is None else jnp.zeros_like(tensor_scale)
    return ga.astype(a.dtype), gt, gts


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def transform_fake_quant(a: jax.Array, transform: PreparedTransform, fmt=MXFP4(), *,
                         tensor_scale: Optional[jax.Array] = None, block_sizes: Optional[BlockSizes] = None,
                         impl: Optional[str] = None) -> jax.Array:
    """``dequantize(transform_quantize(A))`` in ``a.dtype``, differentiable by the straight-through estimator.

    Backward: identity through the quantizer, the exact VJP of the f32 transform ``A -> A T`` (so gradients reach
    both ``A`` and the transform's arrays, e.g. ``kparams``/``blocks``/``inv_scale``).
    """
    return _fake_quant(a, transform, tensor_scale, fmt, block_sizes, impl)
