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

**One served layer** (:class:`ServedLinear`, :func:`serve_qlinear`, :func:`served_linear_forward`): a calibrated
``kroquant_jax.qlinear.QuantizedLinear`` prepared once for the GPU forward (paper eq. 11,
``Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b``): the fused transform + quantize kernel, ``h = x (R T^T)^T`` with ``T``
folded into ``R`` at preparation time (so the branch needs no ``x T``), and one W4A4 GEMM with the low-rank term (and,
optionally, the per-head RMSNorm or the SwiGLU) in its epilogue (``strategy="kernel"``), or, the default
(``strategy="dequant"``), both packed operands decoded to bf16 and one cuBLAS GEMM with the low-rank pair joined
along K (:func:`~pallas_kernels.w4a4_gemm.w4a4_matmul_dequant`), then the op as XLA ops on its bf16 output: on the
H200 that is 1.4-4.8x faster than the Triton W4A4 kernels at every measured shape (see :func:`served_linear_forward`).
What the quantized DiT forward runs (``benchmarks/dit_forward_w4a4.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax.formats import MXFP4, QuantFormat, QuantizedArray, dequantize
from pallas_kernels import transform_quantize as tq
from pallas_kernels._compat import on_gpu, pl, triton_compiler_params
from pallas_kernels.w4a4_gemm import (BlockSizes, Compute, OperandSpec, _kind_of, _round_up, accumulate_tiles,
                                      check_operands, even_odd_permutation, gemm_inputs, lowrank_reference,
                                      lowrank_term, w4a4_matmul, w4a4_matmul_dequant)

__all__ = [
    "DEFAULT_STRATEGY",
    "EPILOGUE_TILE",
    "EpilogueBlockSizes",
    "STRATEGIES",
    "ServedLinear",
    "check_strategy",
    "gemm",
    "gemm_reference",
    "gemm_rmsnorm",
    "gemm_rmsnorm_reference",
    "gemm_swiglu",
    "gemm_swiglu_reference",
    "pack_swiglu_weight",
    "permute_rows",
    "rmsnorm_heads",
    "serve_qlinear",
    "served_linear_forward",
    "served_linear_reference",
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
        for name in ("block_m", "block_n", "block_k", "tile"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"EpilogueBlockSizes.{name}={v} must be a power of two >= 16")


#: Shared memory a program's pipelined operand tiles may take. The H200 allows 227 KiB (232448 bytes) per block;
#: the rest is left for Triton's layout-conversion scratch in the epilogue.
SMEM_BUDGET_BYTES = 200 * 1024


def operand_smem_bytes(kind: str, block_m: int, cols: int, block_k: int, num_stages: int) -> int:
    """Shared memory of the software-pipelined A and W tiles: ``num_stages * (A tile + W tile)`` in bytes.

    ``kind`` is the operand kind of :func:`check_operands` ("bf16", "mxfp4", "nvfp4"): bf16 tiles take 2 bytes per
    element; packed FP4 tiles take half a byte per element plus one scale byte per block (32 for MXFP4, 16 for NVFP4).
    This is what Triton requested on the H200 (``3 * (64*128*2 + 256*128*2) = 245760`` for the bf16 RMSNorm kernel).
    """
    if kind == "bf16":
        per_elem = 2.0
    else:
        per_elem = 0.5 + 1.0 / (32 if kind == "mxfp4" else 16)
    return int(num_stages * (block_m + cols) * block_k * per_elem)


def _default_blocks(m: int, k: int, *, kind: str = "bf16", cols: int = 128, block_m: Optional[int] = None,
                    budget: int = SMEM_BUDGET_BYTES) -> EpilogueBlockSizes:
    """Default tiles: ``block_m`` (128 for packed operands, 64 for bf16) shrinks for small m, ``block_k`` divides k,
    and the pipelined operand tiles fit ``budget`` bytes of shared memory (a smaller ``block_k`` first, down to 64,
    keeping 3 stages; then 2 stages; then ``block_k`` down to 32).

    Packed operands: on the H200 (2026-11-30, m = 4224, MXFP4, ``benchmarks/results/dit_forward_w4a4.json``) 128-row
    tiles ran the RMSNorm-256 kernel in 1010 us instead of 2128 us and the SwiGLU kernel in 5266 us instead of
    12174 us (64-row tiles: every W tile is decoded twice as often). bf16 operands keep 64 rows (the RMSNorm program
    owns a whole 256-wide head); their 3-stage ``block_k = 64`` tiling was not measured against the 2-stage
    ``block_k = 128`` one it replaces.
    """
    bm = block_m if block_m is not None else (64 if kind == "bf16" else 128)
    while bm > 16 and bm // 2 >= m:
        bm //= 2
    bk = 128
    while bk > 32 and k % bk:
        bk //= 2
    stages = 3
    while operand_smem_bytes(kind, bm, cols, bk, stages) > budget:
        if bk > 64:
            bk //= 2
        elif stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        else:
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


def _dense(x) -> jax.Array:
    if isinstance(x, QuantizedArray):
        return dequantize(x, jnp.float32)
    return jnp.asarray(x).astype(jnp.float32)


def gemm_reference(a, w, *, lowrank=None, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """``A W^T [+ h L^T] [+ b]`` in f32 (operands dequantized if packed; 16-bit operands taken as bf16)."""
    if not isinstance(a, QuantizedArray):
        a, w = jnp.asarray(a).astype(jnp.bfloat16), jnp.asarray(w).astype(jnp.bfloat16)
    y = jnp.matmul(_dense(a), _dense(w).T, precision="highest")
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
                     lowrank_packed: bool, has_bias: bool, eps: float, has_alias: bool):
    refs = list(refs)
    n_op = 1 if spec.kind == "bf16" else 2
    a_refs, refs = refs[:n_op], refs[n_op:]
    w_refs, refs = refs[:n_op], refs[n_op:]
    ts_ref = refs.pop(0) if spec.has_tensor_scale else None
    h_ref = bias_ref = nw_ref = None
    l_refs = []
    if has_lowrank:
        h_ref = refs.pop(0)
        l_refs = [refs.pop(0) for _ in range(2 if lowrank_packed else 1)]
    if has_bias:
        bias_ref = refs.pop(0)
    if epilogue == "rmsnorm":
        nw_ref = refs.pop(0)
    if has_alias:
        refs.pop(0)
    (o_ref,) = refs

    accs = accumulate_tiles(a_refs, w_refs, spec=spec, k=k, block_n=tile, n_sub=n_sub)
    for j in range(n_sub):
        cols = pl.ds(j * tile, tile)
        if ts_ref is not None:
            accs[j] = accs[j] * ts_ref[...]  # (1, 1)
        if has_lowrank:
            accs[j] = accs[j] + lowrank_term(h_ref, l_refs, cols, packed=lowrank_packed)
        if has_bias:
            accs[j] = accs[j] + bias_ref[:, cols]  # (1, tile) f32

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
    kind, m, n, k = check_operands(a, w)
    bs = block_sizes or _default_blocks(m, k, kind=kind, cols=head_dim if epilogue == "rmsnorm" else EPILOGUE_TILE)
    spec = OperandSpec(kind=kind, compute=compute if kind != "bf16" else "bf16", block_k=bs.block_k)
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
    m_pad, k_pad = _round_up(m, bs.block_m), _round_up(k, bs.block_k)
    grid = (m_pad // bs.block_m, n // cols)
    args, in_specs, lowrank_packed = gemm_inputs(a, w, spec, m_pad=m_pad, n_pad=n, k_pad=k_pad, block_m=bs.block_m,
                                                 cols=cols, lowrank=lowrank, bias=bias)
    if epilogue == "rmsnorm":
        args.append(norm_weight.astype(jnp.float32).reshape(1, head_dim))
        in_specs.append(pl.BlockSpec((1, head_dim), lambda i, j: (0, 0)))
    aliases = {}
    if out is not None:
        if out.shape != (m, n_out):
            raise ValueError(f"out {out.shape} must be ({m}, {n_out})")
        aliases = {len(args): 0}
        args.append(jnp.pad(out.astype(out_dtype), [(0, m_pad - m), (0, 0)]))
        in_specs.append(pl.BlockSpec((bs.block_m, out_cols), lambda i, j: (i, j)))
    kernel = functools.partial(_epilogue_kernel, spec=spec, k=k_pad, epilogue=epilogue, tile=tile, n_sub=n_sub,
                               has_lowrank=lowrank is not None, lowrank_packed=lowrank_packed,
                               has_bias=bias is not None, eps=float(eps),
                               has_alias=out is not None)
    y = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bs.block_m, out_cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_out), out_dtype),
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(bs.num_warps, bs.num_stages),
        interpret=interpret,
        name=f"gemm_{epilogue}_{kind}",
    )(*args)
    return y[:m]


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


# ---------------------------------------------------------------------------------------------------------------------
# One served W4A4 layer (eq. 11), optionally with its epilogue op fused.
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("transform", "weight", "right", "left", "bias"),
                   meta_fields=("act_fmt", "swiglu_rows"))
@dataclasses.dataclass(frozen=True)
class ServedLinear:
    """A ``QuantizedLinear`` prepared once for the GPU forward (a pytree; stack it for ``lax.scan``).

    Attributes:
      transform: the online ``T`` for the fused transform + quantize kernel (``pallas_kernels.transform_quantize``).
      weight: ``Q(W~ - L R)`` ``(o, d)`` packed; rows in gate/up pairs (:func:`pack_swiglu_weight`) if ``swiglu_rows``.
      right: ``R T^T`` ``(r, d)`` bf16 (``T`` folded in: ``(x T) R^T = x (R T^T)^T``), rows in
        :func:`~pallas_kernels.w4a4_gemm.even_odd_permutation` order when ``left`` is packed; None without a branch.
      left: ``L`` ``(o, r)``: packed MXFP4 (decoded in the GEMM epilogue) or bf16; rows permuted like ``weight``.
      bias: ``(o,)`` f32 (permuted like ``weight``) or None.
      act_fmt: the activations' format (static).
      swiglu_rows: whether the rows are in gate/up pairs (static; only the SwiGLU epilogue takes such a layer).
    """

    transform: tq.PreparedTransform
    weight: QuantizedArray
    right: Optional[jax.Array]
    left: Optional[object]
    bias: Optional[jax.Array]
    act_fmt: QuantFormat = MXFP4()
    swiglu_rows: bool = False

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]


def serve_qlinear(layer, *, swiglu: bool = False, kernel: Optional[str] = None) -> ServedLinear:
    """Prepare a ``kroquant_jax.qlinear.QuantizedLinear`` ``(o, d)`` for :func:`served_linear_forward`.

    Args:
      layer: the calibrated layer (packed weight; low-rank factors packed, 16/32-bit or absent).
      swiglu: the layer is a fused ``[W_gate; W_up]`` ``(2f, d)``: permute its rows (and ``L``'s, the bias's) once into
        gate/up pairs for :func:`gemm_swiglu`.
      kernel: ``"k1"`` to run a Kronecker transform with dense blocks instead of K2.
    """
    from pallas_kernels.qlinear_gpu import prepare_layer_transform

    cfg = layer.config
    if swiglu and cfg.out_features % 2:
        raise ValueError(f"serve_qlinear(swiglu=True): out_features={cfg.out_features} must be even (gate; up)")
    wfmt = getattr(layer.weight, "fmt", None)
    if type(cfg.act_fmt) is not type(wfmt) or cfg.act_fmt.block_size != wfmt.block_size:
        raise ValueError(f"serve_qlinear: activations {cfg.act_fmt!r} and weight {wfmt!r} of layer "
                         f"({cfg.out_features}, {cfg.in_features}) must share one FP4 format (the W4A4 GEMM takes "
                         f"both operands packed alike)")
    transform = prepare_layer_transform(layer, kernel)
    left = right = None
    if layer.lowrank_left is not None:
        left = layer.lowrank_left
        packed = isinstance(left, QuantizedArray) and _kind_of(left) == "mxfp4" and left.shape[1] >= 32
        if not packed:
            left = (dequantize(left, jnp.float32) if isinstance(left, QuantizedArray) else jnp.asarray(left))
            left = left.astype(jnp.bfloat16)
        r_dense = _dense(layer.lowrank_right)  # (r, d) f32
        blocks = jnp.asarray(layer.blocks, jnp.float32)  # (d/n, n, n): (x T)_b = x_b K_b
        nb, n, _ = blocks.shape
        rank = r_dense.shape[0]
        # (x T) R^T = x (R T^T)^T with (R T^T)[r, b, i] = sum_j K_b[i, j] R[r, b, j]
        right = jnp.einsum("bij,rbj->rbi", blocks, r_dense.reshape(rank, nb, n),
                           precision=jax.lax.Precision.HIGHEST).reshape(rank, nb * n)
        if packed:
            right = right[even_odd_permutation(rank)]
        right = right.astype(jnp.bfloat16)
    weight, bias = layer.weight, (None if layer.bias is None else jnp.asarray(layer.bias, jnp.float32))
    if swiglu:
        perm = swiglu_permutation(cfg.out_features)
        weight = permute_rows(weight, perm)
        left = None if left is None else permute_rows(left, perm)
        bias = None if bias is None else bias[perm]
    return ServedLinear(transform=transform, weight=weight, right=right, left=left, bias=bias, act_fmt=cfg.act_fmt,
                        swiglu_rows=swiglu)


Op = Literal["none", "rmsnorm", "swiglu"]
Strategy = Literal["dequant", "kernel"]

#: How a served layer runs its GEMM (:func:`served_linear_forward`).
STRATEGIES = ("dequant", "kernel")
#: The default: "dequantize + cuBLAS", the faster strategy at every shape measured on the H200 (jax 0.11.2,
#: 2026-11-30): the W4A4 layer 1.6-4.8x faster than on the Pallas-Triton kernels (0.43-0.84x bf16 against 0.12-0.30x
#: at m = 4096; FLUX.1, PixArt-Sigma, SANA, Ideogram 4 w2, ``benchmarks/results/w4a4_models.json``), the GEMM alone
#: 1.4-3.0x (CUPTI, Ideogram 4 q and w1|w3 at m = 4096 / 512, ``w4a4_device.json``: q at m = 4096 330 us vs 881 us,
#: w1|w3 1474 us vs 4393 us, w1|w3 at m = 512 446 us vs 615 us).
DEFAULT_STRATEGY: Strategy = "dequant"


def check_strategy(strategy: str, *, where: str = "served_linear_forward", **kernel_options) -> None:
    """Raise a ValueError if ``strategy`` is unknown, or if an option of the Pallas-Triton kernels (``kernel_options``
    such as ``fused=True``, ``gemm_blocks=...``, ``epilogue_blocks=...``; None or False count as not given) comes
    with ``strategy="dequant"``, which would ignore it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy={strategy!r} must be 'dequant' (the default: decode + one cuBLAS GEMM) "
                         f"or 'kernel' (the Pallas-Triton W4A4 kernels)")
    given = [name + ("=True" if value is True else "") for name, value in kernel_options.items()
             if value is not None and value is not False]
    if strategy == "dequant" and given:
        raise ValueError(f"{where}: {', '.join(given)} apply to strategy='kernel' only (the Pallas-Triton kernels and "
                         f"their fused epilogues); strategy='dequant' runs one cuBLAS GEMM and the op in XLA. Pass "
                         f"strategy='kernel' to use them")


def _served_inputs(layer: ServedLinear, x: jax.Array, impl: str):
    """``x (..., d)`` -> ``(x2 (m, d) bf16, Q(x T), lowrank (h, L) or None)``."""
    d = layer.in_features
    if x.shape[-1] != d:
        raise ValueError(f"served linear ({layer.out_features}, {d}): input of shape {x.shape} has {x.shape[-1]} "
                         f"features")
    x2 = x.reshape(-1, d)
    if x2.dtype not in (jnp.bfloat16, jnp.float16):
        x2 = x2.astype(jnp.bfloat16)
    x_q = tq.transform_quantize(x2, layer.transform, layer.act_fmt, impl=impl, round_to_input=False)
    lowrank = None
    if layer.left is not None:
        h = jnp.matmul(x2, layer.right.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # (m, r)
        lowrank = (h, layer.left)
    return x2, x_q, lowrank


def _check_op(layer: ServedLinear, op: str, norm_weight, head_dim: Optional[int]) -> None:
    if op not in ("none", "rmsnorm", "swiglu"):
        raise ValueError(f"op={op!r} must be 'none', 'rmsnorm' or 'swiglu'")
    if (op == "swiglu") != layer.swiglu_rows:
        raise ValueError(f"op={op!r} on a layer with swiglu_rows={layer.swiglu_rows}: only the SwiGLU op takes (and "
                         f"needs) a layer prepared with serve_qlinear(swiglu=True)")
    if op == "rmsnorm" and (norm_weight is None or head_dim is None or norm_weight.shape != (head_dim,)
                            or layer.out_features % head_dim):
        raise ValueError(f"rmsnorm: norm_weight {None if norm_weight is None else norm_weight.shape} must be "
                         f"(head_dim,) = ({head_dim},), and head_dim must divide out_features={layer.out_features}")


def _apply_op(y: jax.Array, op: str, norm_weight, head_dim: Optional[int], eps: float) -> jax.Array:
    """The op on a GEMM output ``y (m, o)`` (f32 math, ``y.dtype`` out): per-head RMSNorm, or SwiGLU on gate/up
    pairs (the rows of a ``swiglu_rows`` layer are in :func:`pack_swiglu_weight`'s order, so its columns are)."""
    if op == "rmsnorm":
        return rmsnorm_heads(y, norm_weight, head_dim=head_dim, eps=eps)
    if op == "swiglu":
        return _swiglu_pairs(y)
    return y


def served_linear_forward(layer: ServedLinear, x: jax.Array, *, op: Op = "none", norm_weight=None,
                          head_dim: Optional[int] = None, eps: float = 1e-6, strategy: Strategy = DEFAULT_STRATEGY,
                          fused: Optional[bool] = None, impl: Optional[str] = None,
                          gemm_blocks: Optional[BlockSizes] = None,
                          epilogue_blocks: Optional[EpilogueBlockSizes] = None, out_dtype=None) -> jax.Array:
    """Eq. 11 on the packed operands, then ``op``: ``(..., d)`` -> ``(..., o)`` (``(..., o/2)`` for SwiGLU).

    Both strategies start with the fused transform + quantize kernel (``Q(x T)``) and ``h = x (R T^T)^T``, and work
    on the same :class:`ServedLinear` (packed weight, packed or bf16 ``L``, SwiGLU rows in gate/up pairs):

    * ``strategy="dequant"`` (the default): "dequantize + cuBLAS",
      :func:`~pallas_kernels.w4a4_gemm.w4a4_matmul_dequant`: ``Q(x T)`` and the weight decoded to bf16 by XLA
      fusions (exact), one bf16 GEMM with the low-rank pair joined along K (``[A | h] [W | L]^T``, ``K = d + r``;
      NVFP4: a second GEMM for ``h L^T``, the per-tensor scales apply to the main product only), bias in f32, the
      output stored in bf16, then the op as XLA ops (f32 math). The default because it is the faster path at every
      shape measured on the H200 (jax 0.11.2, 2026-11-30, ``benchmarks/results/w4a4_models.json``,
      ``w4a4_device.json``): the W4A4 layer at 0.43-0.84x bf16 at m = 4096 against 0.12-0.30x on the Triton kernels
      (1.6-4.8x faster; the GEMM alone 1.4-3.0x); the whole Ideogram 4 forward (17 of its 34 blocks, 4224 tokens,
      ``benchmarks/results/dit_forward_w4a4_dequant.json``) at 0.87x bf16 against 0.34x. The fused epilogues it
      gives up save one HBM round trip of the output, about 2% of a Triton W4A4 GEMM (and measured 1.4-3% *slower*
      than that GEMM + the XLA op), far less than the decode in the Triton main loop costs.
    * ``strategy="kernel"``: the Pallas-Triton W4A4 GEMM (:func:`~pallas_kernels.w4a4_gemm.w4a4_matmul`) with the
      low-rank term (packed ``L`` decoded) in its epilogue, and with ``fused`` (default True) the RMSNorm or SwiGLU
      in that epilogue too (:func:`gemm_rmsnorm` / :func:`gemm_swiglu`).

    Both equal :func:`served_linear_reference` up to the order of the fp32 additions and the bf16 output rounding
    (the unfused ones: plus the rounding of the GEMM output before the op).

    Args:
      layer: from :func:`serve_qlinear`.
      x: activations, bf16 or fp16 (others are cast to bf16).
      op: ``"none"``, ``"rmsnorm"`` (per head of ``head_dim`` outputs, weight ``norm_weight (head_dim,)``, ``eps``)
        or ``"swiglu"`` (a layer prepared with ``swiglu=True``).
      strategy: ``"dequant"`` or ``"kernel"`` (above). An unknown name, or kernel-only options with ``"dequant"``,
        raise a ValueError (never silently ignored).
      fused: ``strategy="kernel"`` only: the op in the GEMM's epilogue (``None`` / ``True``), or ``False``: the plain
        W4A4 GEMM (``w4a4_matmul``, bf16 output) then the op in XLA (the unfused baseline). ``"dequant"`` accepts
        ``None`` or ``False`` (its op always runs after the GEMM).
      impl: ``None`` (kernels on a GPU, else the references), ``"pallas"``, ``"interpret"`` (the Pallas kernels in
        interpret mode: the transform + quantize kernel, and for ``"kernel"`` the GEMMs; the ``"dequant"`` GEMM is
        XLA on every backend) or ``"reference"`` (:func:`served_linear_reference`, either strategy).
      gemm_blocks: tiles of ``w4a4_matmul`` (``op="none"`` or unfused); epilogue_blocks: of the fused kernels
        (``strategy="kernel"`` only).
      out_dtype: default ``x.dtype``.
    """
    check_strategy(strategy, fused=fused, gemm_blocks=gemm_blocks, epilogue_blocks=epilogue_blocks)
    _check_op(layer, op, norm_weight, head_dim)
    if impl is None:
        impl = "pallas" if on_gpu(x) else "reference"
    if impl not in ("pallas", "interpret", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas', 'interpret' or 'reference'")
    if impl == "reference":
        return served_linear_reference(layer, x, op=op, norm_weight=norm_weight, head_dim=head_dim, eps=eps,
                                       out_dtype=out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    _, x_q, lowrank = _served_inputs(layer, x, impl)
    interpret = impl == "interpret"
    if strategy == "dequant":
        y = w4a4_matmul_dequant(x_q, layer.weight, lowrank=lowrank, bias=layer.bias)  # (m, o) bf16
        y = _apply_op(y, op, norm_weight, head_dim, eps)
    elif op == "none" or fused is False:
        y = w4a4_matmul(x_q, layer.weight, lowrank=lowrank, bias=layer.bias, block_sizes=gemm_blocks,
                        interpret=interpret)  # (m, o) bf16, as a separate kernel stores it
        y = _apply_op(y, op, norm_weight, head_dim, eps)
    elif op == "rmsnorm":
        y = gemm_rmsnorm(x_q, layer.weight, norm_weight, head_dim=head_dim, eps=eps, lowrank=lowrank, bias=layer.bias,
                         block_sizes=epilogue_blocks, interpret=interpret)
    else:
        y = gemm_swiglu(x_q, layer.weight, lowrank=lowrank, bias=layer.bias, block_sizes=epilogue_blocks,
                        interpret=interpret)
    return y.reshape(*lead, y.shape[-1]).astype(out_dtype)


def _swiglu_pairs(c: jax.Array) -> jax.Array:
    """``SiLU(c[:, 0::2]) * c[:, 1::2]`` in f32 (gate/up pairs adjacent), returned in ``c.dtype``."""
    cf = c.astype(jnp.float32).reshape(c.shape[0], -1, 2)
    return (jax.nn.silu(cf[..., 0]) * cf[..., 1]).astype(c.dtype)


def served_linear_reference(layer: ServedLinear, x: jax.Array, *, op: Op = "none", norm_weight=None,
                            head_dim: Optional[int] = None, eps: float = 1e-6, out_dtype=None) -> jax.Array:
    """The jnp reference of :func:`served_linear_forward` (fused semantics: the op on the f32 GEMM output):
    the transform + quantizer reference, the dequantized product in f32, ``h L^T``, bias, op."""
    _check_op(layer, op, norm_weight, head_dim)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    _, x_q, lowrank = _served_inputs(layer, x, "reference")
    y = gemm_reference(x_q, layer.weight, lowrank=lowrank, bias=layer.bias)  # (m, o) f32
    y = _apply_op(y, op, norm_weight, head_dim, eps)
    return y.reshape(*lead, y.shape[-1]).astype(out_dtype)
