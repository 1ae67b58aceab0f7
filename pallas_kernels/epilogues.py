"""GEMM epilogue fusion: GEMM + RMSNorm over heads of 256 outputs, and GEMM + gated SiLU (SwiGLU).

The second seed's "Fusing the epilogue": the small op after a big GEMM is applied to the accumulator before the tile
leaves the chip, so the GEMM output never makes an HBM round trip. Both kernels run on 16-bit operands (bf16 ``A``,
``W``) or on the packed W4A4 operands of :mod:`pallas_kernels.w4a4_gemm` (same main loop,
:func:`~pallas_kernels.w4a4_gemm.accumulate_tiles`), Pallas with the Triton lowering, ``interpret=True`` on the CPU.

**RMSNorm over a head of 256** (Ideogram 4's q/k norm: ``y = x * rsqrt(mean(x**2) + eps) * weight`` per head). The
epilogue works in tiles of ``EPILOGUE_TILE = 128`` output columns, so one head spans two tiles. Each program owns one
row block and one head; its main loop accumulates the head's two 128-wide tiles, then the epilogue walks the seed's
three-touch schedule:

1. tile 0, pass 0: sum of squares of the first half (kept in registers, not normalised, not stored);
2. tile 1, pass 1: add the second half's sum of squares, ``rstd = rsqrt(ss / 256 + eps)``, normalise and store tile 1;
3. tile 0, pass 2 (revisit): scale the first half by the now-known ``rstd`` and store it.

``head_dim`` may be any multiple of 128 (128: one tile, the trivial case).

**SwiGLU** ``out = SiLU(C[:, :N/2]) * C[:, N/2:]`` with ``C = A W^T``, ``W = [W_gate; W_up]`` ``(N, K)``. The weight
rows (the output columns of ``C``) are permuted once at packing time (:func:`pack_swiglu_weight`) into gate/up pairs
``[g0, u0, g1, u1, ...]``, so each pair is adjacent in the accumulator tile: the epilogue splits the tile's even and
odd columns (a register-level split, no cross-tile traffic) and stores ``(block_m, block_n / 2)``. Output width N/2.
For packed weights the permutation acts on whole rows (codes, block scales), which commutes with the row-wise
quantization: ``permute(quantize(W)) == quantize(permute(W))`` (NVFP4's per-tensor scale is unchanged).

Optional in both: the low-rank branch ``h L^T`` of eq. 11 and a bias, added to the accumulator before the op (their
rows permuted the same way for SwiGLU), and NVFP4's per-tensor scales.

References (:func:`gemm_rmsnorm_reference`, :func:`gemm_swiglu_reference`): the unfused path, the GEMM output rounded
to the output dtype (as a separate kernel would store it), then the op in f32.

The served W4A4 layer that runs these kernels (``strategy="kernel"``) or the "dequantize + cuBLAS" GEMM (the
default) lives in :mod:`pallas_kernels.served`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.formats import QuantFormat, QuantizedArray, as_float32, check_format, dequantize
from pallas_kernels._compat import pl
from pallas_kernels.w4a4_gemm import (Compute, OperandSpec, accumulate_tiles, add_gemm_terms, check_operands,
                                      check_tile_sizes, gemm_inputs, launch_gemm, lowrank_reference, round_up,
                                      split_gemm_refs)

__all__ = [
    "EPILOGUE_TILE",
    "EpilogueBlockSizes",
    "default_block_sizes",
    "gemm",
    "gemm_reference",
    "gemm_rmsnorm",
    "gemm_rmsnorm_reference",
    "gemm_swiglu",
    "gemm_swiglu_reference",
    "operand_smem_bytes",
    "pack_swiglu_weight",
    "permute_rows",
    "rmsnorm_heads",
    "swiglu",
    "swiglu_permutation",
    "unpack_swiglu_weight",
]

#: Width of one epilogue tile (output columns), as in the seed's 128x128 epilogue subtiles.
EPILOGUE_TILE = 128

Epilogue = Literal["none", "rmsnorm", "swiglu"]


@dataclasses.dataclass(frozen=True)
class EpilogueBlockSizes:
    """Tiles of the epilogue kernels (powers of two).

    Attributes:
      block_m: rows per program.
      block_n: accumulator columns per program for SwiGLU / the plain GEMM (RMSNorm programs own one whole head).
      block_k: K elements per main-loop step.
      tile: epilogue tile width for RMSNorm (a head spans ``head_dim / tile`` tiles).
      num_warps, num_stages: Triton launch parameters.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    tile: int = EPILOGUE_TILE
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_tile_sizes(self, ("block_m", "block_n", "block_k", "tile"))


#: Shared memory a program's pipelined operand tiles may take. The H200 allows 227 KiB (232448 bytes) per block;
#: the rest is left for Triton's layout-conversion scratch in the epilogue.
SMEM_BUDGET_BYTES = 200 * 1024


def operand_smem_bytes(fmt: Optional[QuantFormat], block_m: int, cols: int, block_k: int, num_stages: int) -> int:
    """Shared memory of the software-pipelined A and W tiles: ``num_stages * (A tile + W tile)`` in bytes.

    ``fmt`` is the packed operands' :class:`~kroquant_jax.formats.QuantFormat` (``MXFP4()``, ``NVFP4()``), or
    ``None`` for bf16 operands: bf16 tiles take 2 bytes per element; packed FP4 tiles take half a byte per element
    plus one scale byte per block (32 for MXFP4, 16 for NVFP4). It matches what Triton requests:
    ``3 * (64*128*2 + 256*128*2) = 245760`` bytes for the bf16 RMSNorm kernel with 3 stages of 64-row, 128-deep tiles
    (docs/w4a4.md, "Results", 1. GPU correctness).
    """
    if fmt is None:
        per_elem = 2.0
    else:
        check_format(fmt, "operand_smem_bytes: fmt (None for bf16 operands)")
        per_elem = 0.5 + fmt.scale_dtype.itemsize / fmt.block_size
    return int(num_stages * (block_m + cols) * block_k * per_elem)


def default_block_sizes(m: int, k: int, *, fmt: Optional[QuantFormat] = None, cols: int = 128,
                        block_m: Optional[int] = None, budget: int = SMEM_BUDGET_BYTES) -> EpilogueBlockSizes:
    """Default tiles of an ``(m, k)`` x ``(n, k)`` epilogue GEMM on ``fmt`` operands (a
    :class:`~kroquant_jax.formats.QuantFormat`, ``None`` for bf16) with ``cols`` accumulator columns per program:
    ``block_m`` (128 for packed operands, 64 for bf16) shrinks for small m, ``block_k`` divides k, and the pipelined
    operand tiles fit ``budget`` bytes of shared memory (a smaller ``block_k`` first, down to 64, keeping 3 stages;
    then 2 stages; then ``block_k`` down to 32).

    Packed operands: 128-row tiles run the fused RMSNorm-256 and SwiGLU kernels about twice as fast as 64-row ones
    (64-row tiles decode every W tile twice as often; docs/w4a4.md, "Epilogue tiles, measured in the forward run",
    from ``benchmarks/results/dit_forward_w4a4.json``). bf16 operands keep 64 rows (the RMSNorm program owns a whole
    256-wide head); their 3-stage ``block_k = 64`` tiling is not measured against a 2-stage ``block_k = 128`` one.
    """
    if fmt is not None:
        check_format(fmt, "default_block_sizes: fmt (None for bf16 operands)")
    bm = block_m if block_m is not None else (64 if fmt is None else 128)
    while bm > 16 and bm // 2 >= m:
        bm //= 2
    bk = 128
    while bk > 32 and k % bk:
        bk //= 2
    stages = 3
    while operand_smem_bytes(fmt, bm, cols, bk, stages) > budget:
        if bk > 64:
            bk //= 2
        elif stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        else:
            kind = "bf16" if fmt is None else fmt.name
            raise ValueError(f"no tiling of {kind} operands with {cols=} fits {budget} bytes of shared memory")
    return EpilogueBlockSizes(block_m=bm, block_k=bk, num_stages=stages)


# ---------------------------------------------------------------------------------------------------------------------
# Weight packing for SwiGLU.
# ---------------------------------------------------------------------------------------------------------------------


def swiglu_permutation(n: int) -> np.ndarray:
    """Row order ``[g0, u0, g1, u1, ...]`` of a fused ``[W_gate; W_up]`` ``(n, K)``: ``perm[2i] = i``,
    ``perm[2i + 1] = n/2 + i``; ``W_perm = W[perm]``."""
    if n % 2:
        raise ValueError(f"SwiGLU needs an even number of fused output rows, got {n}")
    f = n // 2
    return np.stack([np.arange(f), np.arange(f, n)], axis=1).reshape(n)


def permute_rows(x, perm: np.ndarray):
    """Rows of a 2-D array, or of a :class:`QuantizedArray` (codes and block scales; tensor scale unchanged)."""
    perm = np.asarray(perm)
    if isinstance(x, QuantizedArray):
        return dataclasses.replace(x, codes=x.codes[perm], scales=x.scales[perm])
    return jnp.asarray(x)[perm]


def pack_swiglu_weight(w_fused, *, lowrank_left: Optional[jax.Array] = None, bias: Optional[jax.Array] = None):
    """Permutes a fused ``[W_gate; W_up]`` (array or ``QuantizedArray`` ``(N, K)``) once into gate/up pairs.

    Also permutes the rows of the low-rank factor ``L (N, r)`` and the bias ``(N,)`` when given. Returns
    ``w_perm`` or ``(w_perm, L_perm, bias_perm)`` when either extra is given.
    """
    n = w_fused.shape[0]
    perm = swiglu_permutation(n)
    w_perm = permute_rows(w_fused, perm)
    if lowrank_left is None and bias is None:
        return w_perm
    left = None if lowrank_left is None else permute_rows(lowrank_left, perm)
    b = None if bias is None else jnp.asarray(bias)[perm]
    return w_perm, left, b


def unpack_swiglu_weight(w_perm):
    """Inverse of :func:`pack_swiglu_weight`: gate/up pairs -> the fused ``[W_gate; W_up]``."""
    inv = np.argsort(swiglu_permutation(w_perm.shape[0]))
    return permute_rows(w_perm, inv)


# ---------------------------------------------------------------------------------------------------------------------
# Plain ops (jnp), for references and the unfused baselines.
# ---------------------------------------------------------------------------------------------------------------------


def rmsnorm_heads(x: jax.Array, weight: jax.Array, *, head_dim: int = 256, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over each head of ``head_dim`` consecutive columns of ``x (m, n)``, in f32, returned in ``x.dtype``."""
    m, n = x.shape
    xf = x.astype(jnp.float32).reshape(m, n // head_dim, head_dim)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * rstd * weight.astype(jnp.float32)).reshape(m, n).astype(x.dtype)


def swiglu(c: jax.Array) -> jax.Array:
    """``SiLU(c[:, :N/2]) * c[:, N/2:]`` in f32, returned in ``c.dtype``."""
    f = c.shape[-1] // 2
    g, u = c[:, :f].astype(jnp.float32), c[:, f:].astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * u).astype(c.dtype)


def gemm_reference(a, w, *, lowrank=None, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """``A W^T [+ h L^T] [+ b]`` in f32 (operands dequantized if packed; 16-bit operands taken as bf16)."""
    if not isinstance(a, QuantizedArray):
        a, w = jnp.asarray(a).astype(jnp.bfloat16), jnp.asarray(w).astype(jnp.bfloat16)
    y = jnp.matmul(as_float32(a), as_float32(w).T, precision="highest")
    if lowrank is not None:
        y = y + lowrank_reference(*lowrank)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32)
    return y.astype(out_dtype)


def gemm_rmsnorm_reference(a, w, norm_weight, *, head_dim: int = 256, eps: float = 1e-6, lowrank=None, bias=None,
                           out_dtype=jnp.bfloat16) -> jax.Array:
    """Unfused: the GEMM output stored in ``out_dtype``, then RMSNorm per head (f32 math)."""
    c = gemm_reference(a, w, lowrank=lowrank, bias=bias, out_dtype=out_dtype)
    return rmsnorm_heads(c, norm_weight, head_dim=head_dim, eps=eps)


def gemm_swiglu_reference(a, w_fused, *, lowrank=None, bias=None, out_dtype=jnp.bfloat16) -> jax.Array:
    """Unfused, on the *unpermuted* fused weight ``[W_gate; W_up]``: GEMM stored in ``out_dtype``, then SwiGLU."""
    return swiglu(gemm_reference(a, w_fused, lowrank=lowrank, bias=bias, out_dtype=out_dtype))


# ---------------------------------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------------------------------


def _epilogue_kernel(*refs, spec: OperandSpec, k: int, epilogue: str, tile: int, n_sub: int, has_lowrank: bool,
                     lowrank_packed: bool, has_bias: bool, eps: float):
    g, extra, o_ref = split_gemm_refs(refs, spec, has_lowrank=has_lowrank, lowrank_packed=lowrank_packed,
                                      has_bias=has_bias)
    nw_ref = extra[0] if epilogue == "rmsnorm" else None  # (1, head_dim) f32

    accs = accumulate_tiles(g.a, g.w, spec=spec, k=k, block_n=tile, n_sub=n_sub)
    for j in range(n_sub):
        accs[j] = add_gemm_terms(accs[j], g, pl.ds(j * tile, tile), lowrank_packed=lowrank_packed)

    if epilogue == "none":
        for j in range(n_sub):
            o_ref[:, pl.ds(j * tile, tile)] = accs[j].astype(o_ref.dtype)
    elif epilogue == "rmsnorm":
        head_dim = n_sub * tile
        # Touch 0 .. n_sub-2: carry the sum of squares over the first tiles of the head (not stored yet).
        ss = jnp.sum(accs[0] * accs[0], axis=1)
        for j in range(1, n_sub - 1):
            ss = ss + jnp.sum(accs[j] * accs[j], axis=1)
        # Last tile: complete the reduction, normalise it and store it.
        last = n_sub - 1
        if last > 0:
            ss = ss + jnp.sum(accs[last] * accs[last], axis=1)
        rstd = jax.lax.rsqrt(ss * jnp.float32(1.0 / head_dim) + jnp.float32(eps)).reshape(-1, 1)
        order = [last] + list(range(last))  # then revisit the first tiles with the known rstd
        for j in order:
            cols = pl.ds(j * tile, tile)
            wj = nw_ref[:, cols]  # (1, tile) f32
            o_ref[:, cols] = (accs[j] * rstd * wj).astype(o_ref.dtype)
    elif epilogue == "swiglu":
        (acc,) = accs
        bm = acc.shape[0]
        gate, up = jax.lax.unstack(acc.reshape(bm, tile // 2, 2), axis=2)  # adjacent gate/up pairs
        o_ref[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(o_ref.dtype)
    else:
        raise ValueError(f"unknown epilogue {epilogue!r}")


def _fused_call(a, w, *, epilogue: Epilogue, head_dim: int, norm_weight, eps: float, lowrank, bias,
                block_sizes: Optional[EpilogueBlockSizes], compute: Compute, out_dtype, out, interpret: bool):
    fmt, m, n, k = check_operands(a, w)
    kind = "bf16" if fmt is None else fmt.name  # the operand kind (kernel name, fp8 check)
    bs = block_sizes or default_block_sizes(m, k, fmt=fmt, cols=head_dim if epilogue == "rmsnorm" else EPILOGUE_TILE)
    spec = OperandSpec(fmt=fmt, compute=compute if fmt is not None else "bf16", block_k=bs.block_k)
    if compute == "fp8" and kind != "mxfp4":
        raise ValueError("compute='fp8' supports MXFP4 only")
    if epilogue == "rmsnorm":
        if head_dim % bs.tile or n % head_dim:
            raise ValueError(f"rmsnorm: head_dim={head_dim} must be a multiple of the tile {bs.tile} and divide n={n}")
        if norm_weight is None or norm_weight.shape != (head_dim,):
            raise ValueError(f"rmsnorm: norm_weight must have shape ({head_dim},)")
        tile, n_sub, cols = bs.tile, head_dim // bs.tile, head_dim
    else:
        tile, n_sub, cols = bs.block_n, 1, bs.block_n
        if n % cols:
            raise ValueError(f"{epilogue}: n={n} must be a multiple of block_n={cols}")
    out_cols = cols // 2 if epilogue == "swiglu" else cols
    n_out = n // 2 if epilogue == "swiglu" else n
    m_pad, k_pad = round_up(m, bs.block_m), round_up(k, bs.block_k)
    args, in_specs, lowrank_packed = gemm_inputs(a, w, spec, m_pad=m_pad, n_pad=n, k_pad=k_pad, block_m=bs.block_m,
                                                 cols=cols, lowrank=lowrank, bias=bias)
    if epilogue == "rmsnorm":
        args.append(norm_weight.astype(jnp.float32).reshape(1, head_dim))
        in_specs.append(pl.BlockSpec((1, head_dim), lambda i, j: (0, 0)))
    kernel = functools.partial(_epilogue_kernel, spec=spec, k=k_pad, epilogue=epilogue, tile=tile, n_sub=n_sub,
                               has_lowrank=lowrank is not None, lowrank_packed=lowrank_packed,
                               has_bias=bias is not None, eps=float(eps))
    return launch_gemm(kernel, args, in_specs, block=(bs.block_m, out_cols), shape=(m, n_out),
                       padded=(m_pad, n_out), out=out, out_dtype=out_dtype, num_warps=bs.num_warps,
                       num_stages=bs.num_stages, interpret=interpret, name=f"gemm_{epilogue}_{kind}")


_STATIC = ("block_sizes", "compute", "out_dtype", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemm(a, w, *, lowrank=None, bias=None, block_sizes: Optional[EpilogueBlockSizes] = None, compute: Compute = "bf16",
         out_dtype=jnp.bfloat16, out=None, interpret: bool = False) -> jax.Array:
    """The same kernel with no epilogue op: ``A W^T [+ h L^T] [+ b]`` (bf16 or packed operands); the unfused
    baseline's GEMM."""
    return _fused_call(a, w, epilogue="none", head_dim=0, norm_weight=None, eps=0.0, lowrank=lowrank, bias=bias,
                       block_sizes=block_sizes, compute=compute, out_dtype=out_dtype, out=out, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC + ("head_dim", "eps"))
def gemm_rmsnorm(a, w, norm_weight, *, head_dim: int = 256, eps: float = 1e-6, lowrank=None, bias=None,
                 block_sizes: Optional[EpilogueBlockSizes] = None, compute: Compute = "bf16", out_dtype=jnp.bfloat16,
                 out=None, interpret: bool = False) -> jax.Array:
    """``RMSNorm_per_head(A W^T [+ h L^T] [+ b]) * norm_weight``, fused (three-touch epilogue).

    Args:
      a: ``(m, k)`` bf16 array or packed ``QuantizedArray``.
      w: ``(n, k)`` likewise (same kind), ``n`` a multiple of ``head_dim``.
      norm_weight: ``(head_dim,)``, shared by all heads.
      head_dim: a multiple of the epilogue tile (128); 256 for Ideogram 4.
    """
    return _fused_call(a, w, epilogue="rmsnorm", head_dim=head_dim, norm_weight=norm_weight, eps=eps, lowrank=lowrank,
                       bias=bias, block_sizes=block_sizes, compute=compute, out_dtype=out_dtype, out=out,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemm_swiglu(a, w_perm, *, lowrank=None, bias=None, block_sizes: Optional[EpilogueBlockSizes] = None,
                compute: Compute = "bf16", out_dtype=jnp.bfloat16, out=None, interpret: bool = False) -> jax.Array:
    """``SiLU(C[:, 0::2]) * C[:, 1::2]`` with ``C = A W_perm^T [+ h L_perm^T] [+ b_perm]``: output ``(m, N/2)``.

    ``w_perm`` (and ``L``, ``bias``) must come from :func:`pack_swiglu_weight` (gate/up pairs); the result equals
    ``SiLU(C'[:, :N/2]) * C'[:, N/2:]`` for the unpermuted fused weight.
    """
    return _fused_call(a, w_perm, epilogue="swiglu", head_dim=0, norm_weight=None, eps=0.0, lowrank=lowrank, bias=bias,
                       block_sizes=block_sizes, compute=compute, out_dtype=out_dtype, out=out, interpret=interpret)
