"""The FP8 W4A4 GEMM with its epilogue fused, through Pallas **Mosaic GPU** (Hopper: TMA, warp specialization, FP8
``wgmma``).

``out (m, n) = (A8 W8^T) * sa[:, None] * sw[None, :] + bias + h L^T`` in one kernel, where ``A8 (m, k)`` and
``W8 (n, k)`` are the E4M3 re-encodings of MXFP4 rows (:class:`kroquant_jax.fp8_encoding.Fp8Rows`: bytes + one power of
two per row, ``sa``, ``sw``), ``h (m, r)`` / ``L (n, r)`` the bf16 low-rank branch and ``bias (n,)`` f32. It replaces
what XLA runs around its FP8 GEMM in :func:`pallas_kernels.fp8_gemm.fp8_matmul`: the f32 ``(m, n)`` GEMM output written
and read back, the low-rank GEMM's own f32 ``(m, n)`` output, and the epilogue fusion (18 bytes of HBM traffic per
output element instead of the 2 of a bf16 store; docs/w4a4.md, "What stands in the way").

**Structure** (after jax's ``jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py`` and
:mod:`pallas_kernels.w4a4_gemm_mgpu`): a persistent grid over output tiles; per CTA one memory warpgroup streams the
``A8 (tile_m, tile_k)`` and ``W8 (2 tile_n, tile_k)`` tiles through a ``max_concurrent_steps``-deep TMA pipeline, and
two compute warpgroups each own a ``tile_m x tile_n`` f32 accumulator (adjacent column tiles of the CTA). Per K step a
compute warpgroup issues one FP8 ``wgmma`` over the step (both operands in shared memory, K-major: FP8 ``wgmma`` takes
no transposed operand, and ``A`` and ``W`` are both stored row-major over K). While the K loop runs, the warpgroup's
own TMA copies bring its row scales, column scales, bias and the first chunk of the low-rank tiles into shared memory
(``lowrank_chunk`` rank columns: the whole rank of 128 would take 128 KiB of the 227 and leave one pipeline stage).
After the loop the row factors multiply the accumulator in the registers (``acc = (A8 W8^T) sa``, exact: powers
of two), and bf16 ``wgmma`` s, one per rank chunk (the next chunk fetched behind each), add the low-rank product to the
**same accumulator**, its weight side pre-scaled by the inverse column powers of two (``L' = L / sw``, made once at
load, :func:`prescale_left`), so that the column scaling that follows restores it:
``y = (A8 W8^T sa + h L'^T) * sw^T + bias``. One accumulator, so a 128 x 128 tile per warpgroup keeps its registers
(a second accumulator for ``h L^T`` would double them), the low-rank product never leaves the SM, and ``h`` goes in as
the layer computed it (no per-call XLA kernel dividing it by ``sa``). The result is
rounded once to the output dtype and stored through shared memory by TMA.

**Numerics.** The products of two E4M3 values of re-encoded MXFP4 rows have at most 4 significant bits, and the
powers of two are exact, so the kernel differs from the exact eq. 11 product of the MXFP4 values only by the order and
width of its additions: Hopper's FP8 ``wgmma`` accumulates in its own reduced-width adder (the accumulation XLA's
default FP8 GEMM uses on the H200, ``fp8_gemm``'s ``accumulation="default"`` / ``"fast"``), and the low-rank term sits
in that accumulator too. ``L'`` is exact while ``L / sw`` stays in bf16's normal range (bf16 has f32's exponent
range; the weight scales are those of trained rows). Scales that are not powers of two (W4A8's per-token
``amax / 448``) add one f32 rounding to ``A8 W8^T sa``. A zero scale (a per-token row of zeros) is replaced by 1 in
the epilogue (its bytes are zero, so any scale is exact there);
a NaN scale (a row with a non-finite input) gives a NaN row, as ``fp8_matmul``. The jnp mirror
:func:`fp8_matmul_mgpu_reference` runs the same steps in f32 at HIGHEST precision.

**Row-group scales.** Activations may carry one power of two per row and group of ``g`` K values instead of one
per row (``Fp8Rows.group``, :func:`kroquant_jax.fp8_encoding.mxfp4_to_e4m3` with ``group=``; DeepGEMM's 1 x 128
scales), with ``g`` a multiple of ``tile_k``. The kernel keeps its one accumulator in the units of the last live group
so far: before each K step a third pipeline input multiplies it per row by ``2**(e_prev - e_k)`` (1 inside a group,
:func:`_group_steps`, made by XLA from the scales), exact as the row factors are, and the epilogue applies the last
live group's factor where it applied ``sa``. It needs ``delay_release=0`` (the step's ``wgmma`` has finished when the
next step rescales). Such an operand needs no reduction over its whole row before the GEMM.

**Limits.** Both operands in the same K order (any: a GEMM sums over K); ``k`` a multiple of ``tile_k`` and ``n`` of
``2 tile_n`` (the weight is padded otherwise: a copy per call; :func:`default_config` picks a ``tile_n`` whose CTA
divides ``n`` where one of its widths does, :func:`choose_tile_n`), ragged ``m`` is
padded to ``tile_m`` (a copy of the activations and of the output, only when ragged). ``r`` a multiple of 16
(the bf16 ``wgmma`` K), at most 256. The SwiGLU runs in the epilogue when the weight's rows are in groups of ``tile_n``
(``swiglu_group``: the first half of each group gates, the second half the ups of the same features,
:func:`swiglu_halves_order`): each warpgroup's tile then holds both halves of its features, and the kernel writes
``(m, n/2)``. The q/k RMSNorm is not in the kernel: it writes the layer's output dtype (bf16 on the served
strategy) and the norm runs in XLA on it (:func:`pallas_kernels.fp8_gemm.fp8_linear_forward`, ``gemm="mgpu"``).

**CPU.** The kernel runs in jax's GPU interpret mode (``tests/test_fp8_gemm_mgpu.py`` through
``tests/mgpu_interpret.py``) and its Mosaic GPU lowering for a CUDA target runs on the CPU; PTX generation, register
allocation and timing need the GPU (``tests/gpu/test_fp8_gemm_mgpu_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import fp8_encoding as FE
from kroquant_jax.fp8_encoding import Fp8Rows
from pallas_kernels._compat import on_gpu, pl
from pallas_kernels.w4a4_gemm_mgpu import _num_sms, _plgpu, _round_up, _tile_order  # the shared Mosaic GPU set-up

__all__ = ["Fp8MgpuConfig", "choose_tile_n", "default_config", "fp8_matmul_mgpu", "fp8_matmul_mgpu_reference",
           "prescale_left", "supports", "swiglu_halves", "swiglu_halves_order"]

SMEM_LIMIT = 227 * 1024  # shared memory per CTA on Hopper (sm_90), bytes
SWIGLU_GROUP = 128  # rows per SwiGLU group (gates | ups) that a served layer is prepared in: the default tile_n
FP8_WGMMA_K = 32  # K of one FP8 wgmma instruction
BF16_WGMMA_K = 16


@dataclasses.dataclass(frozen=True)
class Fp8MgpuConfig:
    """Tiling of the fused FP8 GEMM (static).

    Attributes:
      tile_m: rows per compute warpgroup and CTA (multiple of 64, the ``wgmma`` M).
      tile_n: output columns per compute warpgroup (the CTA covers ``2 tile_n``), a multiple of ``epi_tile_n``, at most
        256.
      tile_k: K elements (bytes) per pipeline step, a multiple of 32 (one FP8 ``wgmma`` K); 128 gives the widest
        (128-byte) swizzle.
      max_concurrent_steps: TMA pipeline depth.
      grid_minor_dim, grid_tile_width: order of the persistent loop over output tiles (``plgpu.planar_snake`` when
        ``grid_tile_width > 1``, else row- or column-major).
      epi_tile_m, epi_tile_n: output store tiles (shared memory -> TMA), dividing ``tile_m``, ``tile_n``.
      epi_slots: output tiles in flight per warpgroup (1 or 2).
      num_ctas: CTAs of the persistent grid (default: the SM count, or the tile count if smaller).
      lowrank_chunk: rank columns of ``h`` / ``L`` held in shared memory at a time (a multiple of 16 dividing the
        rank; None: the whole rank). The first chunk is fetched while the K loop runs, the others one after another
        behind the low-rank ``wgmma`` of the previous chunk: smaller chunks free shared memory for pipeline stages
        at the price of one exposed copy latency per further chunk and output tile.
      delay_release: K steps whose FP8 ``wgmma`` may still run when the next one is issued (0 or 1): with 1, a step
        waits only for the previous step's ``wgmma`` and the pipeline keeps each stage's buffers one step longer
        (``BlockSpec(delay_release=1)``), so the tensor cores get the next ``wgmma`` without an idle gap; it must be
        below ``max_concurrent_steps``. With the default tilings' 3 stages it measured slower (one stage fewer for the
        copies; docs/w4a4.md, "Shared-input groups measured, and one wgmma in flight"), so the default is 0.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 2
    grid_minor_dim: Literal["m", "n"] = "n"
    grid_tile_width: int = 1
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    epi_slots: int = 1
    num_ctas: Optional[int] = None
    lowrank_chunk: Optional[int] = None
    delay_release: int = 0

    def __post_init__(self):
        if self.tile_m <= 0 or self.tile_m % 64:
            raise ValueError(f"Fp8MgpuConfig: tile_m={self.tile_m} must be a positive multiple of 64")
        if not 0 < self.tile_n <= 256 or self.epi_tile_n % 8 or self.tile_n % self.epi_tile_n:
            raise ValueError(f"Fp8MgpuConfig: tile_n={self.tile_n} must be in (0, 256] and a multiple of "
                             f"epi_tile_n={self.epi_tile_n} (itself a multiple of 8)")
        if self.epi_tile_m % 64 or self.tile_m % self.epi_tile_m:
            raise ValueError(f"Fp8MgpuConfig: epi_tile_m={self.epi_tile_m} must be a multiple of 64 dividing "
                             f"tile_m={self.tile_m}")
        if self.tile_k <= 0 or self.tile_k % FP8_WGMMA_K:
            raise ValueError(f"Fp8MgpuConfig: tile_k={self.tile_k} must be a positive multiple of {FP8_WGMMA_K}")
        if self.grid_minor_dim not in ("m", "n") or self.grid_tile_width < 1 or self.max_concurrent_steps < 1:
            raise ValueError(f"Fp8MgpuConfig: grid_minor_dim={self.grid_minor_dim!r} must be 'm' or 'n', "
                             f"grid_tile_width={self.grid_tile_width} and max_concurrent_steps="
                             f"{self.max_concurrent_steps} >= 1")
        if self.epi_slots not in (1, 2):
            raise ValueError(f"Fp8MgpuConfig: epi_slots={self.epi_slots} must be 1 or 2")
        if self.lowrank_chunk is not None and (self.lowrank_chunk <= 0 or self.lowrank_chunk % BF16_WGMMA_K):
            raise ValueError(f"Fp8MgpuConfig: lowrank_chunk={self.lowrank_chunk} must be a positive multiple of "
                             f"{BF16_WGMMA_K} (the bf16 wgmma K) or None")
        if self.delay_release not in (0, 1) or self.delay_release >= self.max_concurrent_steps:
            raise ValueError(f"Fp8MgpuConfig: delay_release={self.delay_release} must be 0 or 1 and below "
                             f"max_concurrent_steps={self.max_concurrent_steps}")

    def chunk(self, rank: int) -> int:
        """Rank columns per low-rank load at ``rank`` (0 without a low-rank branch)."""
        return min(rank, self.lowrank_chunk or rank)

    @property
    def cta_n(self) -> int:
        return 2 * self.tile_n

    def smem_bytes(self, rank: int = 0, out_bytes: int = 2, step_factors: bool = False) -> int:
        """Shared memory of the kernel's buffers: pipeline stages (with ``step_factors``, the row-group scales' f32
        factors too), the per-warpgroup low-rank tiles, output tiles, vectors, and 1 KiB for the barriers and
        alignment. Hopper gives a CTA at most 227 KiB."""
        stages = self.max_concurrent_steps * ((self.tile_m + self.cta_n) * self.tile_k + 4 * self.tile_m * step_factors)
        lowrank = 2 * (self.tile_m + self.tile_n) * self.chunk(rank) * 2
        out = 2 * self.epi_slots * self.epi_tile_m * self.epi_tile_n * out_bytes
        vectors = 2 * (self.tile_m + 2 * self.tile_n) * 4
        return stages + lowrank + out + vectors + 1024


# Relative cost of one output column per CTA round at each warpgroup tile width, with the tilings default_config builds
# for them, read off the sweep of PixArt-Σ's ff.up at m = 4096, where all four widths kept the SMs equally busy
# (docs/w4a4.md, "Tile widths for the narrow models"). 128 runs 3 stages; the others fit 2.
TILE_N_COLUMN_COST = {128: 1.00, 192: 1.14, 96: 1.19, 64: 1.29}
# Where the tuned 128-wide tiling divides n, another width must be modelled this much faster to replace it: the model
# overrates narrow tiles at long K (it chose 96 for Ideogram 4's q at m = 512, where 128 measured faster), while
# FLUX.1's q at m = 512, where 64 measured faster, is modelled above this gain (same section of the docs).
MIN_MODELLED_GAIN = 0.25


def _modelled_time(m: int, n: int, tile_m: int, tile_n: int, num_sms: int) -> float:
    """Rounds of CTAs over the SMs x columns per CTA x the tile width's cost per column (arbitrary units)."""
    tiles = -(-m // tile_m) * -(-n // (2 * tile_n))
    return -(-tiles // num_sms) * 2 * tile_n * TILE_N_COLUMN_COST[tile_n]


def choose_tile_n(m: int, n: int, num_sms: int = 132) -> int:
    """The warpgroup tile width (CTA ``2 * tile_n`` columns) :func:`default_config` takes for ``(m, k) x (n, k)^T``:
    among the widths in ``TILE_N_COLUMN_COST`` whose CTA divides ``n`` (no per-call padding of the weight, its
    scales, bias and low-rank factor, no sliced output), the one of least :func:`_modelled_time` (ties go to the
    wider tile), but the tuned 128 wherever its CTA divides ``n`` and no width is modelled ``MIN_MODELLED_GAIN``
    faster; 128 when none divides ``n``. How it compares with the measured best at each swept shape: docs/w4a4.md,
    "Tile widths for the narrow models"."""
    tile_m = 64 if m <= 64 else 128
    fits = [t for t in sorted(TILE_N_COLUMN_COST, reverse=True) if n % (2 * t) == 0]
    if not fits:
        return 128
    best = min(fits, key=lambda t: _modelled_time(m, n, tile_m, t, num_sms))
    if 128 in fits and (_modelled_time(m, n, tile_m, best, num_sms)
                        > (1 - MIN_MODELLED_GAIN) * _modelled_time(m, n, tile_m, 128, num_sms)):
        return 128
    return best


def default_config(m: int, n: int, k: int, rank: int = 0, num_sms: int = 132, out_bytes: int = 2,
                   tile_n: Optional[int] = None, step_factors: bool = False) -> Fp8MgpuConfig:
    """The tiling chosen from the sweeps (``docs/w4a4.md``). ``tile_m`` 128 (64 only when ``m <= 64``, where 128
    rows would be half padding); ``tile_n`` from :func:`choose_tile_n` unless given (the SwiGLU epilogue's group);
    ``tile_k`` 128 halved until it divides ``k``.

    With ``tile_n`` 128 (the H200 sweeps of the Ideogram 4 shapes): output tiles walked in a planar snake of width 4,
    then the first pipeline depth that shared memory holds beside the low-rank tiles and ``out_bytes``-wide output
    tiles, in the order 3, 4, 2, 1 stages with a low-rank branch (3 stages with rank chunks of 64 beat 4 with chunks
    of 16 and the whole rank with fewer stages) and 4, 3, 2, 1 without; for each depth the whole rank, then chunks
    of 64, 32, 16, and output tiles 64, 32, 16 columns wide. With the narrower or wider tiles of narrow models (the
    H100 sweep of PixArt-Σ and FLUX.1): a row-major walk, 2 stages, and for each output-tile width (64, 32, 16, those
    dividing ``tile_n``) the whole rank, then chunks of 64, 32, 16. Smaller tiles when even one stage does not fit.
    ``step_factors``: count the row-group scales' per-stage factors in shared memory (``Fp8Rows.group`` activations)."""
    tk = 128
    while tk > FP8_WGMMA_K and k % tk:
        tk //= 2
    tm = 64 if m <= 64 else 128
    chosen = tile_n is None
    tile_n = choose_tile_n(m, n, num_sms) if chosen else tile_n
    chunks = [None] + [c for c in (64, 32, 16) if rank > c and rank % c == 0]
    if tile_n == 128:
        depths = (3, 4, 2, 1) if rank else (4, 3, 2, 1)
        order = [(s, c, e) for s in depths for c in chunks for e in (64, 32, 16)]
        shapes = [(tm, 128, tk, 4), (64, 128, tk, 4)] + ([(64, 64, min(tk, 64), 4)] if chosen else [])
    else:
        epis = [e for e in (64, 32, 16) if tile_n % e == 0] or [8]
        order = [(s, c, e) for s in (2, 1) for e in epis for c in chunks]
        shapes = [(tm, tile_n, tk, 1), (64, tile_n, tk, 1), (64, tile_n, min(tk, 64), 1)]
    for tile_m, tn, tile_k, width in shapes:
        for steps, chunk, epi_n in order:
            cfg = Fp8MgpuConfig(tile_m=tile_m, tile_n=tn, tile_k=tile_k, max_concurrent_steps=steps,
                                grid_tile_width=width, epi_tile_n=epi_n, lowrank_chunk=chunk)
            if cfg.smem_bytes(rank, out_bytes, step_factors) <= SMEM_LIMIT:
                return cfg
    return cfg  # nothing fits: fp8_matmul_mgpu names the shortfall


def supports(m: int, n: int, k: int, cfg: Optional[Fp8MgpuConfig] = None) -> bool:
    """Whether :func:`fp8_matmul_mgpu` runs ``(m, k) x (n, k)^T`` without padding an operand."""
    cfg = cfg or default_config(m, n, k)
    return m % cfg.tile_m == 0 and n % cfg.cta_n == 0 and k % cfg.tile_k == 0


def _swizzled(plgpu, row_elems: int, itemsize: int):
    swizzle = plgpu.find_swizzle(row_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _call(a8, sa, w8, sw, bias, h, left, *, cfg: Fp8MgpuConfig, out_dtype, interpret: Any, epilogue: str = "none",
          step_ratio=None, steps_per_group: int = 1):
    """``a8 e4m3 (m, k)``, ``sa f32 (m,)``, ``w8 e4m3 (n, k)``, ``sw f32 (n,)``, ``bias f32 (n,) | None``,
    ``h bf16 (m, r) | None``, ``left bf16 (n, r) | None`` -> ``(m, n)`` (``(m, n/2)`` with ``epilogue="swiglu"``);
    ``m``, ``n``, ``k`` multiples of the tiles. ``step_ratio f32 (k / tile_k, m) | None``: the factor each row's
    accumulator is multiplied by before K step ``s``'s ``wgmma`` (row-group scales, :func:`_group_steps`), on the
    first step of each group of ``steps_per_group`` (the others' factors are 1 and are not applied)."""
    plgpu = _plgpu()
    m, k = a8.shape
    n = w8.shape[0]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    m_iters, n_iters, k_iters = m // tm, n // cfg.cta_n, k // tk
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    out_bytes = jnp.dtype(out_dtype).itemsize
    in_transforms = _swizzled(plgpu, tk, 1)
    out_transforms = _swizzled(plgpu, epi_n, out_bytes)
    has_bias, has_lowrank = bias is not None, h is not None
    swiglu = epilogue == "swiglu"
    out_tn = tn // 2 if swiglu else tn  # output columns per warpgroup tile
    rank = h.shape[1] if has_lowrank else 0
    rc = cfg.chunk(rank)  # rank columns per low-rank load
    n_chunks = rank // rc if rank else 0
    # one barrier per copy and warpgroup: row scales, column scales, bias, h, L
    vec_names = ["sa", "sw"] + (["bias"] if has_bias else []) + (["h", "left"] if has_lowrank else [])
    n_vec = len(vec_names)

    grouped = step_ratio is not None

    def fp8_gemm_fused(a_gmem, sa_gmem, w_gmem, sw_gmem, *rest):  # the name profilers show
        rest = list(rest)
        out_gmem = rest.pop()
        ratio_gmem = rest.pop() if grouped else None
        bias_gmem = rest.pop(0) if has_bias else None
        h_gmem, left_gmem = (rest[0], rest[1]) if has_lowrank else (None, None)

        def get_pipeline(body, compute_context):
            release = {"delay_release": cfg.delay_release} if cfg.delay_release else {}
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=in_transforms,
                                    memory_space=plgpu.SMEM, **release),
                    plgpu.BlockSpec((cfg.cta_n, tk), lambda kk: (0, kk), transforms=in_transforms,
                                    memory_space=plgpu.SMEM, **release),
                ] + ([plgpu.BlockSpec((1, tm), lambda kk: (kk, 0), memory_space=plgpu.SMEM, **release)]
                     if grouped else []),
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.max_concurrent_steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not influence the allocations
        scoped = dict(
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
                a_gmem, w_gmem, *([ratio_gmem] if grouped else [])),
            out_smem=plgpu.SMEM((2, cfg.epi_slots, epi_m, epi_n), out_dtype, transforms=out_transforms),
            sa_smem=plgpu.SMEM((2, tm), jnp.float32),
            sw_smem=plgpu.SMEM((2, tn), jnp.float32),
            barriers=plgpu.Barrier(num_barriers=2 * n_vec),
        )
        if has_bias:
            scoped["bias_smem"] = plgpu.SMEM((2, tn), jnp.float32)
        if has_lowrank:
            lr_transforms = _swizzled(plgpu, rc, 2)
            scoped["h_smem"] = plgpu.SMEM((2, tm, rc), jnp.bfloat16, transforms=lr_transforms)
            scoped["left_smem"] = plgpu.SMEM((2, tn, rc), jnp.bfloat16, transforms=lr_transforms)

        @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
        def _scope(pipeline_allocs, out_smem, sa_smem, sw_smem, barriers, bias_smem=None, h_smem=None,
                   left_smem=None):
            wg = jax.lax.axis_index("wg")

            def barrier(name):
                return barriers.at[wg * n_vec + vec_names.index(name)]

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _mn_loop(loop_info):
                (lin,) = loop_info.index
                m_idx, n_idx = _tile_order(plgpu, lin, m_iters, n_iters, cfg)
                rows = pl.ds(m_idx * tm, tm)
                cols = pl.ds(n_idx * cfg.cta_n + wg * tn, tn)  # this warpgroup's output columns
                w_rows = pl.ds(wg * tn, tn)  # ... and its rows of the CTA's W tile

                def lowrank_copy(c):  # rank columns [c rc, (c + 1) rc) of this tile's h and L
                    plgpu.copy_gmem_to_smem(h_gmem.at[rows, pl.ds(c * rc, rc)], h_smem.at[wg], barrier("h"))
                    plgpu.copy_gmem_to_smem(left_gmem.at[cols, pl.ds(c * rc, rc)], left_smem.at[wg], barrier("left"))

                def compute_context(eval_pipeline):
                    # The epilogue's operands (and the first low-rank chunk), fetched while the K loop runs.
                    plgpu.copy_gmem_to_smem(sa_gmem.at[rows], sa_smem.at[wg], barrier("sa"))
                    plgpu.copy_gmem_to_smem(sw_gmem.at[cols], sw_smem.at[wg], barrier("sw"))
                    if has_bias:
                        plgpu.copy_gmem_to_smem(bias_gmem.at[cols], bias_smem.at[wg], barrier("bias"))
                    if has_lowrank:
                        lowrank_copy(0)

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def y(acc_ref):
                        eval_pipeline(acc_ref)  # acc = A8 W8^T
                        if cfg.delay_release:
                            plgpu.wgmma_wait(0)  # the last step's wgmma
                        plgpu.barrier_wait(barrier("sa"))
                        # zero factors replaced here, not by an XLA kernel per call
                        sa = jax.lax.broadcast_in_dim(_nonzero(sa_smem[wg]), (tm, tn), (0,))
                        if n_chunks:
                            # acc = acc sa + h (L / sw)^T: the row factors applied in the registers, then bf16 wgmmas
                            # into the same accumulator, one per rank chunk (h as the layer computed it)
                            acc_ref[...] = acc_ref[...] * sa
                            for c in range(n_chunks):
                                plgpu.barrier_wait(barrier("h"))
                                plgpu.barrier_wait(barrier("left"))
                                plgpu.wgmma(acc_ref, h_smem.at[wg], left_smem.at[wg].transpose((1, 0)))
                                if c + 1 < n_chunks:  # the buffers are free once the wgmma has read them
                                    plgpu.wgmma_wait(0)
                                    lowrank_copy(c + 1)
                        plgpu.barrier_wait(barrier("sw"))
                        sw = jax.lax.broadcast_in_dim(_nonzero(sw_smem[wg]), (tm, tn), (1,))
                        y = acc_ref[...] * sw if n_chunks else acc_ref[...] * sa * sw
                        if has_bias:
                            plgpu.barrier_wait(barrier("bias"))
                            y = y + jax.lax.broadcast_in_dim(bias_smem[wg], (tm, tn), (1,))
                        return y

                    out_cols = cols
                    if swiglu:  # the tile's rows are [gates | ups] of tn / 2 features: SiLU(g) u, f32 math
                        g, u = y[:, :out_tn], y[:, out_tn:]
                        y = g / (1.0 + jnp.exp(-g)) * u
                        out_cols = pl.ds(n_idx * tn + wg * out_tn, out_tn)
                    y = y.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for ei in range(tm // epi_m):
                        for ej in range(out_tn // epi_n):
                            slot = (ei * (out_tn // epi_n) + ej) % cfg.epi_slots
                            plgpu.wait_smem_to_gmem(cfg.epi_slots - 1, wait_read_only=True)
                            out_smem[wg, slot] = y[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                out_gmem.at[rows, out_cols].at[pl.ds(ei * epi_m, epi_m), pl.ds(ej * epi_n, epi_n)])

                def mma_body(idxs, a_smem, w_smem, *rest):
                    *ratio_smem, acc_ref = rest
                    if grouped:  # the accumulator into this step's units (a power of two per row: exact)
                        def rescale():
                            acc_ref[...] = acc_ref[...] * jax.lax.broadcast_in_dim(ratio_smem[0][0], (tm, tn), (0,))

                        if steps_per_group == 1:
                            rescale()
                        else:  # a group's later steps multiply by 1
                            pl.when(idxs[0] % steps_per_group == 0)(rescale)
                    plgpu.wgmma(acc_ref, a_smem, w_smem.at[w_rows].transpose((1, 0)))
                    plgpu.wgmma_wait(cfg.delay_release)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    a_gmem.at[rows, :], w_gmem.at[pl.ds(n_idx * cfg.cta_n, cfg.cta_n), :],
                    *([ratio_gmem.at[:, rows]] if grouped else []), allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    tiles = m_iters * n_iters
    num_ctas = min(cfg.num_ctas or _num_sms(), tiles)
    f = plgpu.kernel(
        fp8_gemm_fused,
        out_type=jax.ShapeDtypeStruct((m, n // 2 if swiglu else n), out_dtype),
        grid=(num_ctas,),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({} if interpret is None else {"interpret": interpret}),
    )
    args = [a8, sa, w8, sw] + ([bias] if has_bias else []) + ([h, left] if has_lowrank else [])
    return f(*args, *([step_ratio] if grouped else []))


def _check(a: Fp8Rows, w: Fp8Rows, lowrank, bias) -> tuple[int, int, int, int]:
    for x, what in ((a, "a"), (w, "w")):
        if not isinstance(x, Fp8Rows) or x.values.ndim != 2:
            raise TypeError(f"fp8_matmul_mgpu: {what} must be 2-D Fp8Rows (fp8_encoding.mxfp4_to_e4m3 / "
                            f"fp8_gemm.prepare_weight), got {type(x).__name__} of shape {getattr(x, 'shape', None)}")
    (m, k), (n, k_w) = a.shape, w.shape
    if k != k_w:
        raise ValueError(f"fp8_matmul_mgpu: reduction lengths differ: a {a.shape}, w {w.shape}")
    if a.order != w.order:
        raise ValueError(f"fp8_matmul_mgpu: a is in column order {a.order!r}, w in {w.order!r}; both operands of the "
                         f"GEMM must share one K order")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_matmul_mgpu: bias {bias.shape} must be ({n},)")
    if w.group is not None:
        raise ValueError(f"fp8_matmul_mgpu: w has scales per group of {w.group} values; the weight takes one per row")
    if a.group is not None and (a.scale.shape != (m, k // a.group) or k % a.group):
        raise ValueError(f"fp8_matmul_mgpu: a's row-group scales {a.scale.shape} do not tile its {a.shape} values")
    r = 0
    if lowrank is not None:
        h, left = lowrank
        if h.ndim != 2 or left.ndim != 2 or h.shape[0] != m or left.shape[0] != n or h.shape[1] != left.shape[1]:
            raise ValueError(f"fp8_matmul_mgpu: lowrank=(h {h.shape}, L {left.shape}) must be (m={m}, r), (n={n}, r)")
        r = h.shape[1]
        if r % BF16_WGMMA_K or not 0 < r <= 256:
            raise ValueError(f"fp8_matmul_mgpu: rank {r=} must be a multiple of {BF16_WGMMA_K} in (0, 256]")
    return m, n, k, r


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "impl", "interpret", "left_prescaled",
                                             "swiglu_group"))
def fp8_matmul_mgpu(a: Fp8Rows, w: Fp8Rows, *, lowrank: Optional[tuple] = None, bias: Optional[jax.Array] = None,
                    out_dtype=jnp.bfloat16, config: Optional[Fp8MgpuConfig] = None, impl: Optional[str] = None,
                    interpret: Any = None, left_prescaled: bool = False,
                    swiglu_group: Optional[int] = None) -> jax.Array:
    """``(A8 W8^T) * sa sw^T + bias + h L^T`` in one Mosaic GPU kernel (then, with ``swiglu_group``, the SwiGLU).

    Args:
      a: activations ``(m, k)`` as :class:`Fp8Rows` (``values`` E4M3, ``scale (m,)``, or ``(m, k / g)`` per row group
        with ``g`` a multiple of the tiling's ``tile_k``: module docstring).
      w: weights ``(n, k)`` as :class:`Fp8Rows`, in the same K order as ``a``.
      lowrank: ``(h (m, r), L (n, r))`` (cast to bf16) or None.
      bias: ``(n,)`` or None (f32 in the epilogue).
      out_dtype: bf16 (default) or f32.
      config: :class:`Fp8MgpuConfig` (default :func:`default_config`).
      impl: ``None`` (the kernel on a GPU, the jnp mirror elsewhere), ``"pallas"`` (the kernel; with ``interpret``,
        GPU interpret mode on the CPU) or ``"reference"``.
      interpret: passed to ``plgpu.kernel(interpret=...)`` (tests only).
      left_prescaled: ``lowrank``'s ``L`` is already :func:`prescale_left`'s ``L / sw`` (made once at load).
      swiglu_group: the rows of ``w`` (and of ``bias``, ``L``) come in groups of this many, the first half gates and
        the second half ups of the same features (:func:`swiglu_halves_order`); the epilogue applies
        ``SiLU(gate) * up`` in f32 and writes ``(m, n/2)`` in feature order. Needs ``config.tile_n == swiglu_group``
        (the default config takes it) and ``n`` a multiple of ``2 * swiglu_group``.

    Returns:
      ``(m, n)`` (``(m, n/2)`` with ``swiglu_group``) in ``out_dtype``.
    """
    m, n, k, r = _check(a, w, lowrank, bias)
    if swiglu_group is not None and (swiglu_group <= 0 or swiglu_group % 2 or n % (2 * swiglu_group)):
        raise ValueError(f"fp8_matmul_mgpu: {swiglu_group=} must be even and 2 * swiglu_group must divide n={n}")
    if lowrank is not None and not left_prescaled:  # L / sw made here: an all-zero weight row's factor must be 0
        w = w.with_zero_row_factors()  # (prepare_weight does it once for a prepared layer)
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"fp8_matmul_mgpu: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if impl is None:
        impl = "pallas" if (interpret is not None or on_gpu()) else "reference"
    if impl not in ("pallas", "reference"):
        raise ValueError(f"fp8_matmul_mgpu: impl={impl!r} must be None, 'pallas' or 'reference'")
    if impl == "reference":
        return fp8_matmul_mgpu_reference(a, w, lowrank=lowrank, bias=bias, out_dtype=out_dtype,
                                         left_prescaled=left_prescaled, swiglu_group=swiglu_group)
    grouped = a.group is not None  # row-group scales: one more f32 (tile_m,) buffer per pipeline stage
    cfg = config or default_config(m, n, k, r, _num_sms(), jnp.dtype(out_dtype).itemsize, tile_n=swiglu_group,
                                   step_factors=grouped)
    if r and r % cfg.chunk(r):
        raise ValueError(f"fp8_matmul_mgpu: rank {r=} must be a multiple of lowrank_chunk={cfg.lowrank_chunk}")
    if swiglu_group is not None and (cfg.tile_n != swiglu_group or (swiglu_group // 2) % cfg.epi_tile_n):
        raise ValueError(f"fp8_matmul_mgpu: {swiglu_group=} needs tile_n == swiglu_group and epi_tile_n dividing "
                         f"swiglu_group / 2, got tile_n={cfg.tile_n}, epi_tile_n={cfg.epi_tile_n}")
    smem = cfg.smem_bytes(r, jnp.dtype(out_dtype).itemsize, grouped)
    if smem > SMEM_LIMIT:
        raise ValueError(f"fp8_matmul_mgpu: {cfg} needs {smem} bytes of shared memory at rank {r}, Hopper gives a "
                         f"CTA {SMEM_LIMIT}: fewer max_concurrent_steps, a smaller tile_k or tile_m")
    mp, np_, kp = _round_up(m, cfg.tile_m), _round_up(n, cfg.cta_n), _round_up(k, cfg.tile_k)

    def pad(x, rows, cols=None):  # zero rows (and columns) at the end
        widths = [(0, rows - x.shape[0])] + [(0, 0 if cols is None else cols - x.shape[1])] * (x.ndim - 1)
        return x if all(wd == (0, 0) for wd in widths) else jnp.pad(x, widths)

    a8, w8 = pad(a.values, mp, kp), pad(w.values, np_, kp)  # zero bytes contribute exactly 0
    step_ratio = None
    if a.group is not None:
        if a.group % cfg.tile_k or cfg.delay_release:
            raise ValueError(f"fp8_matmul_mgpu: a's scales per group of {a.group} values need a tile_k dividing it "
                             f"and delay_release=0, got {cfg}")
        step_ratio, row_scale = _group_steps(a.scale.astype(jnp.float32), a.group // cfg.tile_k)
        step_ratio = pad(step_ratio.T, k // cfg.tile_k, mp)  # (k / tile_k, m): one row of factors per K step
    else:
        row_scale = a.scale.astype(jnp.float32)
    # the raw factors: the kernel replaces a zero by 1 itself (_nonzero), so no select runs as its own XLA kernel
    sa, sw = pad(row_scale, mp), pad(w.scale.astype(jnp.float32), np_)
    b = None if bias is None else pad(bias.astype(jnp.float32), np_)
    h = left = None
    if lowrank is not None:
        h, left = _lowrank_operands(lowrank, w, left_prescaled)
        h, left = pad(h, mp), pad(left, np_)
    y = _call(a8, sa, w8, sw, b, h, left, cfg=cfg, out_dtype=jnp.dtype(out_dtype), interpret=interpret,
              epilogue="none" if swiglu_group is None else "swiglu", step_ratio=step_ratio,
              steps_per_group=1 if a.group is None else a.group // cfg.tile_k)
    n_out = n if swiglu_group is None else n // 2  # padded n is a multiple of cta_n: whole groups
    return y if y.shape == (m, n_out) else y[:m, :n_out]


def swiglu_halves_order(n: int, group: int) -> np.ndarray:
    """The row order that :func:`fp8_matmul_mgpu`'s ``swiglu_group`` reads, from gate/up pairs: ``order[j]`` is the
    pair-order row (gate of feature ``f`` at ``2f``, its up at ``2f + 1``) that goes to row ``j``; row ``j`` of group
    ``t`` holds the gate (first half) or the up (second half) of feature ``t * group / 2 + j % (group / 2)``."""
    if group <= 0 or group % 2 or n % group:
        raise ValueError(f"swiglu_halves_order: {group=} must be even and divide {n=}")
    j = np.arange(n)
    t, within = j // group, j % group
    half = group // 2
    return 2 * (t * half + within % half) + (within >= half)


def swiglu_halves(y: jax.Array, group: int) -> jax.Array:
    """``SiLU(gate) * up`` in f32 on ``y (m, n)`` whose columns are in :func:`swiglu_halves_order` ``group`` order,
    returned in ``y.dtype``: ``(m, n/2)`` in feature order (the kernel's epilogue, as jnp)."""
    m, n = y.shape
    parts = y.astype(jnp.float32).reshape(m, n // group, 2, group // 2)
    g, u = parts[:, :, 0], parts[:, :, 1]
    return (g / (1.0 + jnp.exp(-g)) * u).reshape(m, n // 2).astype(y.dtype)


def _group_steps(scale: jax.Array, steps_per_group: int) -> tuple[jax.Array, jax.Array]:
    """Row-group scales ``(m, G)`` (powers of two, 0 for a group without a live element, NaN) -> the kernel's
    ``(m, G * steps_per_group)`` factors and ``(m,)`` row factors. The accumulator is kept in the units of the last
    live group so far: before the first step of live group ``k`` it is multiplied by ``2**(u - e_k)`` (``u`` the
    previous live group's exponent; 1 before any), exact, and after the loop the row factor ``2**u`` of the last live
    group (0 without one; NaN for a row with a NaN group) scales it as a row scale would. Exponents come from the bits,
    so no division rounds; a factor below ``2**-126`` is taken as ``2**-126`` (the earlier sum it scales is then below
    f32's resolution at the new units anyway)."""
    m, g = scale.shape
    live = (scale != 0) & ~jnp.isnan(scale)
    e = ((jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 255) - 127  # 2**e, a normal f32
    last = jax.lax.cummax(jnp.where(live, jnp.arange(g, dtype=jnp.int32), -1), axis=1)  # last live group <= k
    units = jnp.take_along_axis(e, jnp.maximum(last, 0), axis=1)  # (m, G): the exponent after group k
    before = jnp.concatenate([jnp.full((m, 1), -1, jnp.int32), last[:, :-1]], axis=1)
    u_prev = jnp.concatenate([jnp.zeros((m, 1), jnp.int32), units[:, :-1]], axis=1)
    pow2 = lambda x: FE.pow2(jnp.clip(x, -126, 127))  # noqa: E731
    ratio = jnp.where(live & (before >= 0), pow2(u_prev - e), 1.0)  # (m, G)
    steps = jnp.zeros((m, g, steps_per_group), jnp.float32).at[:, :, 0].set(ratio).at[:, :, 1:].set(1.0)
    row = jnp.where(last[:, -1] >= 0, pow2(units[:, -1]), 0.0)
    row = jnp.where(jnp.any(jnp.isnan(scale), axis=1), jnp.nan, row)
    return steps.reshape(m, g * steps_per_group), row


def _nonzero(scale: jax.Array) -> jax.Array:
    """A zero factor (an all-zero row: any factor is exact there; ``Fp8Rows.with_zero_row_factors`` gives a weight's
    such rows 0, ``pallas_kernels.fp8_gemm.prepare_weight`` does it) replaced by 1; the kernel's epilogue runs it on
    the factors it loads."""
    return jnp.where(scale == 0, jnp.ones_like(scale), scale)


def _kernel_scale(scale: jax.Array) -> jax.Array:
    """The rows' factors as the kernel uses them: f32, :func:`_nonzero`."""
    return _nonzero(scale.astype(jnp.float32))


def _over_rows(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x (rows, r) / scale (rows,)`` in bf16 (``x`` rounded to bf16 first)."""
    return (jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32) / scale[:, None]).astype(jnp.bfloat16)


def prescale_left(left: jax.Array, w: Fp8Rows) -> jax.Array:
    """``L / sw`` ``(n, r)`` bf16: the kernel's weight-side low-rank operand, made once when a layer is prepared
    (pass it as ``lowrank=(h, L')`` with ``left_prescaled=True``) instead of in every call."""
    return _over_rows(left, _kernel_scale(w.scale))


def _lowrank_operands(lowrank: tuple, w: Fp8Rows, left_prescaled: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(h, L / sw)`` in bf16: the low-rank operands the kernel adds to the row-scaled accumulator ``A8 W8^T sa``
    (``L`` as given when ``left_prescaled``)."""
    h, left = lowrank
    left = jnp.asarray(left).astype(jnp.bfloat16) if left_prescaled else prescale_left(left, w)
    return jnp.asarray(h).astype(jnp.bfloat16), left


def fp8_matmul_mgpu_reference(a: Fp8Rows, w: Fp8Rows, *, lowrank: Optional[tuple] = None,
                              bias: Optional[jax.Array] = None, out_dtype=jnp.float32,
                              left_prescaled: bool = False, swiglu_group: Optional[int] = None) -> jax.Array:
    """jnp mirror of the kernel, in f32 at HIGHEST precision: ``(A8 W8^T sa + h L'^T) sw^T + bias`` with the
    kernel's pre-scaled bf16 ``L' = L / sw`` (given, with ``left_prescaled``), ``(A8 W8^T) sa sw^T + bias`` without
    the low-rank term, then with ``swiglu_group`` :func:`swiglu_halves`; one rounding to ``out_dtype``."""
    _check(a, w, lowrank, bias)
    sw = _kernel_scale(w.scale)
    if a.group is None:
        acc = (jnp.matmul(a.values.astype(jnp.float32), w.values.astype(jnp.float32).T, precision="highest")
               * _kernel_scale(a.scale)[:, None])
    else:  # each group's exact values (E4M3 times a power of two), summed over K in f32
        a_exact = a.values.astype(jnp.float32) * jnp.repeat(a.scale.astype(jnp.float32), a.group, axis=1)
        acc = jnp.matmul(a_exact, w.values.astype(jnp.float32).T, precision="highest")
    if lowrank is not None:
        h, left = _lowrank_operands(lowrank, w, left_prescaled)
        acc = acc + jnp.matmul(h.astype(jnp.float32), left.astype(jnp.float32).T, precision="highest")
    y = acc * sw[None, :]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if swiglu_group is not None:
        y = swiglu_halves(y, swiglu_group)
    return y.astype(out_dtype)
