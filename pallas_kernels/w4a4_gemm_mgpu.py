"""W4A4 GEMM through Pallas **Mosaic GPU** (Hopper: TMA, warp specialization, ``wgmma``) on packed MXFP4 operands.

``out (m, n) = dequant(A) @ dequant(W)^T [+ bias]`` from MXFP4 codes (two E2M1 codes per byte, element ``2i`` in the
low nibble) and E8M0 block scales (one byte per 32 elements), fp32 accumulation on the bf16 tensor cores, bf16 (or f32)
output. Written after jax's ``jax/experimental/pallas/ops/gpu/hopper_mixed_type_matmul_mgpu.py`` (int8 x bf16: the
narrow operand dequantized in registers and fed to ``wgmma`` as its register operand) and ``hopper_matmul_mgpu.py``
(persistent grid, ``emit_pipeline_warp_specialized``, tiled epilogue), launched through ``plgpu.kernel`` (jax 0.11.2
lowers no ``pl.pallas_call`` for Mosaic GPU).

**Structure.** A CTA runs three warpgroups: one memory warpgroup that streams, per K step of ``tile_k`` elements, the
packed code tiles ``A (cta_m, tile_k/2)``, ``W (cta_n, tile_k/2)`` and the block-scale tiles through a
``max_concurrent_steps``-deep TMA pipeline into shared memory, and two compute warpgroups, each owning a
``tile_m x tile_n`` accumulator (the two split the CTA tile along ``wg_dimension``). Each K step, a compute warpgroup

1. decodes its ``W`` rows to bf16 into its own shared-memory buffer (the ``wgmma`` B operand, K-major, 32-byte
   swizzle), then ``commit_smem`` (async-proxy fence + warpgroup barrier);
2. per 32-element block ``b`` of the step decodes its ``A`` rows to bf16 **in registers** and issues two ``wgmma``
   with the register operand: ``acc += A_lo,b @ W_lo,b^T + A_hi,b @ W_hi,b^T``.

**No nibble interleave.** A dot product is a sum over K, so both operands reorder K the same way: ``lo`` holds the
block's elements ``2j`` (low nibbles), ``hi`` the elements ``2j + 1`` (high nibbles), 16 each, i.e. one K=16 ``wgmma``
each. A block is exactly one such pair, so its scale is one value per row: a row broadcast in the ``wgmma`` register
layout, no gather and no reshape.

**Decode** (``fp4_tile.mx_decode_pair``, shared with the jnp reference, tested on all 256 code bytes x all scale bytes):
the nibble ``s e1 e0 m`` becomes the f16 bit pattern ``s<<15 | (e1 e0 m)<<9``, whose value is exactly
``e2m1 * 2**-14`` (the E2M1 subnormal 0.5 lands on the f16 subnormal ``2**-15``), then ``f32(f16) * 2**(e - 113)``
with the E8M0 byte ``e`` (one multiplier per row and block, ``MXFP4.scale_factors(e, 14)``, built from bits), then bf16 (exact). Integer and float ops
only (Hopper Mosaic GPU has no FP4/E8M0 conversions): per element 3-5 integer operations, one f16 -> f32 convert, one
multiply and half a bf16 pack.

**Scales transposed.** The block scales travel as ``(k/32, rows)`` (``MgpuOperand.scales_t``): a TMA box must be at
least 16 bytes wide, a K step has only ``tile_k/32`` scale bytes per row, and a row of the transposed tile is the
contiguous per-row vector the decode broadcasts. :func:`prepare_operand` builds it (once for weights, per call for
activations: an XLA transpose of ``m * k / 32`` bytes).

**Exactness.** As the Triton kernel's bf16 mode: every decoded value is exact in bf16, every product of two is exact
in f32, so ``|out - fake_quant(A) fake_quant(W)^T| <= k * 2**-24 * |A_hat| |W_hat|^T`` (fp32 summation order), plus
the output rounding. Valid for scale bytes in ``[2, 240]`` (block amax below about ``2**116``; the Triton kernel's
range ends at 248 because its E4M3 intermediate has a wider exponent, here the multiplier ``2**(e - 113)`` would
overflow f32 above 240 and is clamped to ``2**127``); byte 0 gives exactly 0, byte 255 NaN, as the reference.

**Limits.** MXFP4 (block 32) only: an NVFP4 block of 16 is half a K=16 ``wgmma`` pair (its scale would change inside
one register operand). ``k`` a multiple of ``tile_k``, ``n`` of the CTA's column tile (``W`` is padded otherwise, a
copy of the packed weight per call: prepare it once with :func:`prepare_operand`); ragged ``m`` is padded to the CTA's
row tile (a copy of the packed activations and of the output, only when ragged). No low-rank epilogue (eq. 11's
``h L^T`` runs beside it in XLA: :func:`pallas_kernels.w4a4_gemm.w4a4_linear` ``strategy="mgpu"``).

**CPU.** jax 0.10.2 has Mosaic GPU's *GPU interpret mode* (``plgpu.kernel(..., interpret=InterpretGPUParams())``,
a private class; ``tests/test_w4a4_gemm_mgpu.py`` passes it through ``interpret=``): the kernel itself, with its TMA
copies, barriers, warpgroups and ``wgmma`` (executed synchronously), runs on the CPU, with a shared-memory race
detector. The Mosaic GPU lowering (layout inference, the ``mosaic_gpu`` dialect lowering) also runs on the CPU for a
CUDA target. Not covered on the CPU: PTX generation, register allocation, shared-memory limits, timing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal, Optional, Union

import jax
import jax.numpy as jnp

from kroquant_jax.formats import MXFP4, QuantizedArray
from pallas_kernels._compat import mgpu_load, on_gpu, pl
from pallas_kernels.fp4_tile import F16_DECODE_OFFSET, mx_decode_pair

__all__ = [
    "MgpuGemmConfig",
    "MgpuOperand",
    "default_config",
    "prepare_operand",
    "supports",
    "w4a4_matmul_mgpu",
    "w4a4_matmul_mgpu_reference",
]

_MX = MXFP4()
BLOCK = _MX.block_size  # MXFP4 block: 16 code bytes, one E8M0 scale byte
_HALF = BLOCK // 2
SMEM_LIMIT = 227 * 1024  # shared memory per CTA on Hopper (sm_90), bytes


@dataclasses.dataclass(frozen=True)
class MgpuGemmConfig:
    """Tiling of the Mosaic GPU W4A4 GEMM (static).

    Attributes:
      tile_m: rows of ``A`` per compute warpgroup (multiple of 64, the ``wgmma`` M).
      tile_n: rows of ``W`` (output columns) per compute warpgroup (multiple of ``epi_tile_n``, at most 256).
      tile_k: K elements per pipeline step (multiple of 32; ``tile_k / 2`` code bytes per row >= 16 for TMA).
      max_concurrent_steps: TMA pipeline depth (shared-memory stages).
      wg_dimension: ``"n"``: the two compute warpgroups own adjacent column tiles (CTA ``tile_m x 2 tile_n``, each
        decodes the same ``A`` rows); ``"m"``: adjacent row tiles (CTA ``2 tile_m x tile_n``, each decodes the same
        ``W`` rows into its own buffer).
      wdec_slots: decoded-``W`` buffers per warpgroup: 1 (a step waits for its ``wgmma`` before returning) or 2 (the
        next step decodes into the other buffer while this step's ``wgmma`` run; a step waits for the previous one's).
      grid_minor_dim, grid_tile_width: order of the persistent loop over output tiles (``plgpu.planar_snake``).
      epi_tile_m, epi_tile_n: epilogue tiles (shared memory -> TMA store), at most ``tile_m``, ``tile_n``.
      num_ctas: CTAs of the persistent grid (default: the device's SM count, or the number of output tiles if
        smaller).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    wg_dimension: Literal["m", "n"] = "n"
    wdec_slots: int = 2
    grid_minor_dim: Literal["m", "n"] = "n"
    grid_tile_width: int = 1
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    num_ctas: Optional[int] = None

    def __post_init__(self):
        if self.tile_m <= 0 or self.tile_m % 64:
            raise ValueError(f"MgpuGemmConfig.tile_m={self.tile_m} must be a positive multiple of 64")
        if not 0 < self.tile_n <= 256 or self.tile_n % self.epi_tile_n or self.epi_tile_n % 8:
            raise ValueError(f"MgpuGemmConfig.tile_n={self.tile_n} must be in (0, 256] and a multiple of "
                             f"epi_tile_n={self.epi_tile_n} (itself a multiple of 8)")
        if self.tile_m % self.epi_tile_m or self.epi_tile_m % 64:
            raise ValueError(f"MgpuGemmConfig.epi_tile_m={self.epi_tile_m} must be a multiple of 64 dividing "
                             f"tile_m={self.tile_m}")
        if self.tile_k <= 0 or self.tile_k % BLOCK:
            raise ValueError(f"MgpuGemmConfig.tile_k={self.tile_k} must be a positive multiple of {BLOCK}")
        if self.wg_dimension not in ("m", "n") or self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"wg_dimension={self.wg_dimension!r} and grid_minor_dim={self.grid_minor_dim!r} must "
                             "be 'm' or 'n'")
        if self.wdec_slots not in (1, 2):
            raise ValueError(f"MgpuGemmConfig.wdec_slots={self.wdec_slots} must be 1 or 2")
        if self.max_concurrent_steps < 1 or self.grid_tile_width < 1:
            raise ValueError("max_concurrent_steps and grid_tile_width must be >= 1")

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wg_dimension == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.wg_dimension == "n" else 1)

    def smem_bytes(self, out_bytes: int = 2) -> int:
        """Shared memory of the buffers the kernel allocates (pipeline stages + decoded-``W`` buffers + epilogue
        tiles + the bias tiles; barriers not counted). Hopper gives a CTA at most 227 KiB."""
        stage = (self.cta_m + self.cta_n) * (self.tile_k // 2 + self.tile_k // BLOCK)
        wdec = 2 * self.wdec_slots * (self.tile_k // _HALF) * self.tile_n * _HALF * 2
        epi = 2 * min(2, (self.tile_m * self.tile_n) // (self.epi_tile_m * self.epi_tile_n)) * \
            self.epi_tile_m * self.epi_tile_n * out_bytes
        return stage * self.max_concurrent_steps + wdec + epi + 2 * self.tile_n * 4


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> MgpuGemmConfig:
    """The tiling :func:`w4a4_matmul_mgpu` uses when none is given: 128 x 128 per warpgroup (CTA 128 x 256), or
    64-row warpgroup tiles when the 128-row CTA tiles would leave SMs idle (m = 512 at n = 4608: 72 tiles for 132
    SMs); ``tile_k`` 64, halved until it divides ``k``. A heuristic, not tuned on the device yet."""
    tk = 64
    while tk > BLOCK and k % tk:
        tk //= 2
    tm = 128
    if -(-m // 128) * -(-n // 256) < num_sms:
        tm = 64
    return MgpuGemmConfig(tile_m=tm, tile_k=tk)


def supports(m: int, n: int, k: int, cfg: Optional[MgpuGemmConfig] = None) -> bool:
    """Whether :func:`w4a4_matmul_mgpu` runs ``(m, k) x (n, k)^T`` without padding any operand."""
    cfg = cfg or default_config(m, n, k)
    return m % cfg.cta_m == 0 and n % cfg.cta_n == 0 and k % cfg.tile_k == 0


# ---------------------------------------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales_t"], meta_fields=["shape"])
@dataclasses.dataclass(frozen=True)
class MgpuOperand:
    """A packed MXFP4 operand in the kernel's layout (a pytree; ``shape`` static): ``codes uint8 (rows, k/2)``
    (zero-padded rows/K allowed) and ``scales_t uint8 (k/32, rows)`` (the E8M0 bytes transposed; padding byte 0).
    ``shape`` is the logical ``(rows, k)`` before padding."""

    codes: jax.Array
    scales_t: jax.Array
    shape: tuple[int, int]


def _round_up(x: int, b: int) -> int:
    return -(-x // b) * b


def _check_mx(q, what: str) -> None:
    if not isinstance(q, QuantizedArray) or not (isinstance(q.fmt, MXFP4) and q.fmt.is_standard):
        fmt = getattr(q, "fmt", type(q).__name__)
        raise ValueError(f"{what}: the Mosaic GPU W4A4 GEMM takes MXFP4 (block 32) QuantizedArrays, got {fmt!r}")
    if len(q.shape) != 2:
        raise ValueError(f"{what}: expected a 2-D operand, got shape {q.shape}")


def prepare_operand(q: Union[QuantizedArray, MgpuOperand], *, rows_multiple: int = 1, k_multiple: int = BLOCK,
                    what: str = "operand") -> MgpuOperand:
    """``QuantizedArray (rows, k)`` (MXFP4) -> :class:`MgpuOperand`, rows padded to ``rows_multiple`` and K to
    ``k_multiple`` with zero codes and scale byte 0 (they contribute exactly 0). An ``MgpuOperand`` passes through
    (padded further if needed). Do it once for a weight."""
    if isinstance(q, MgpuOperand):
        codes, scales_t, shape = q.codes, q.scales_t, q.shape
    else:
        _check_mx(q, what)
        codes, scales_t, shape = q.codes, q.scales.T, tuple(q.shape)
    rows, k = codes.shape[0], 2 * codes.shape[1]
    rp, kp = _round_up(rows, rows_multiple), _round_up(k, k_multiple)
    if (rp, kp) != (rows, k):
        codes = jnp.pad(codes, [(0, rp - rows), (0, (kp - k) // 2)])
        scales_t = jnp.pad(scales_t, [(0, (kp - k) // BLOCK), (0, rp - rows)])
    return MgpuOperand(codes, scales_t, shape)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------------


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 - GPU-only module, imported lazily

    return plgpu


def _num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def _tile_order(plgpu, lin, m_iters: int, n_iters: int, cfg: MgpuGemmConfig):
    """Linear output-tile index -> ``(m_idx, n_idx)``: ``plgpu.planar_snake`` for ``grid_tile_width > 1``, else plain
    row-major (``grid_minor_dim="n"``) or column-major order. (``planar_snake`` evaluates a remainder by
    ``minor_size % tile_width``, zero here, in a discarded select branch: harmless on the GPU, a division by zero when
    XLA:CPU constant-folds it in GPU interpret mode.)"""
    if cfg.grid_tile_width > 1:
        return plgpu.planar_snake(lin, (m_iters, n_iters), 0 if cfg.grid_minor_dim == "m" else 1,
                                  cfg.grid_tile_width)
    if cfg.grid_minor_dim == "n":
        return jax.lax.div(lin, jnp.int32(n_iters)), jax.lax.rem(lin, jnp.int32(n_iters))
    return jax.lax.rem(lin, jnp.int32(m_iters)), jax.lax.div(lin, jnp.int32(m_iters))


def _call(ac, as_t, wc, ws_t, bias, *, cfg: MgpuGemmConfig, out_dtype, interpret: Any):
    """``ac (m, k/2)``, ``as_t (k/32, m)``, ``wc (n, k/2)``, ``ws_t (k/32, n)``, ``bias f32 (n,) | None`` ->
    ``(m, n)``; ``m``, ``n``, ``k`` multiples of the CTA tile and ``tile_k``."""
    plgpu = _plgpu()
    m, n, k = ac.shape[0], wc.shape[0], 2 * ac.shape[1]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    nb = tk // BLOCK  # MXFP4 blocks per K step
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    m_iters, n_iters, k_iters = m // cta_m, n // cta_n, k // tk
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    out_bytes = jnp.dtype(out_dtype).itemsize
    out_swizzle = plgpu.find_swizzle(epi_n * out_bytes * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_bytes)), plgpu.SwizzleTransform(out_swizzle))
    # Decoded W: K-major (tile_n, 16) bf16 tiles, one per (lo|hi, block): 32-byte rows, 32-byte swizzle.
    wdec_transforms = (plgpu.TilingTransform((8, _HALF)), plgpu.SwizzleTransform(2 * _HALF))
    num_out_slots = min(2, (tm * tn) // (epi_m * epi_n))
    wg_m_rows = tm if cfg.wg_dimension == "m" else 0
    wg_n_rows = tn if cfg.wg_dimension == "n" else 0
    has_bias = bias is not None
    wgmma_groups = 2 * nb  # plgpu.wgmma calls (commit groups) per step

    def load_codes(ref):
        """A ``(rows, 16)`` column block of a code tile (64-byte rows when ``tile_k = 128``: no bank-conflict-free
        transfer plan exists, so the plain one is requested). GPU interpret mode has no ``plgpu.load``: same values
        through ``ref[...]``."""
        if interpret is not None:
            return ref[...]
        return mgpu_load(ref, layout=None, optimized=False)

    def kernel(ac_gmem, as_gmem, wc_gmem, ws_gmem, *rest):
        bias_gmem = rest[0] if has_bias else None
        out_gmem = rest[-1]

        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((cta_m, tk // 2), lambda kk: (0, kk), memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((nb, cta_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((cta_n, tk // 2), lambda kk: (0, kk), memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((nb, cta_n), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.max_concurrent_steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not influence the allocations
        scoped = dict(
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(ac_gmem, as_gmem, wc_gmem, ws_gmem),
            out_smem=plgpu.SMEM((2, num_out_slots, epi_m, epi_n), out_dtype, transforms=out_transforms),
            wdec=plgpu.SMEM((2, cfg.wdec_slots, 2 * nb, tn, _HALF), jnp.bfloat16, transforms=wdec_transforms),
        )
        if has_bias:
            scoped.update(bias_smem=plgpu.SMEM((2, tn), jnp.float32), bias_barrier=plgpu.Barrier(num_barriers=2))

        @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
        def _scope(pipeline_allocs, out_smem, wdec, bias_smem=None, bias_barrier=None):
            wg = jax.lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _mn_loop(loop_info):
                (lin,) = loop_info.index
                m_idx, n_idx = _tile_order(plgpu, lin, m_iters, n_iters, cfg)
                cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
                cta_n_slice = pl.ds(n_idx * cta_n, cta_n)
                a_rows = pl.ds(wg * wg_m_rows, tm)  # this warpgroup's rows inside the CTA's A / W tiles
                w_rows = pl.ds(wg * wg_n_rows, tn)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc_scope(acc_ref):
                        if has_bias:  # the bias tile, fetched while the main loop runs
                            plgpu.copy_gmem_to_smem(bias_gmem.at[cta_n_slice].at[w_rows], bias_smem.at[wg],
                                                    bias_barrier.at[wg])
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]  # (tm, tn) f32, wgmma layout
                        if has_bias:
                            plgpu.barrier_wait(bias_barrier.at[wg])
                            acc = acc + jax.lax.broadcast_in_dim(bias_smem[wg], (tm, tn), (1,))
                        acc = acc.astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for ei in range(tm // epi_m):
                            for ej in range(tn // epi_n):
                                slot = (ei * (tn // epi_n) + ej) % num_out_slots
                                plgpu.wait_smem_to_gmem(num_out_slots - 1, wait_read_only=True)
                                out_smem[wg, slot] = acc[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem.at[cta_m_slice, cta_n_slice].at[a_rows, w_rows]
                                    .at[pl.ds(ei * epi_m, epi_m), pl.ds(ej * epi_n, epi_n)])

                def mma_body(idxs, ac_smem, as_smem, wc_smem, ws_smem, acc_ref):
                    (kk,) = idxs
                    slot = kk % cfg.wdec_slots if cfg.wdec_slots > 1 else 0
                    # 1. W: this warpgroup's rows, every block of the step, decoded to bf16 in shared memory.
                    for b in range(nb):
                        w_mult = _MX.scale_factors(ws_smem[b, w_rows], F16_DECODE_OFFSET)  # (tn,) f32
                        lo, hi = mx_decode_pair(load_codes(wc_smem.at[w_rows, pl.ds(b * _HALF, _HALF)]), w_mult)
                        wdec[wg, slot, 2 * b] = lo
                        wdec[wg, slot, 2 * b + 1] = hi
                    plgpu.commit_smem()  # async-proxy fence + warpgroup barrier: visible to wgmma
                    # 2. A: per block, decoded in registers, two K=16 wgmma with the register operand.
                    for b in range(nb):
                        a_mult = _MX.scale_factors(as_smem[b, a_rows], F16_DECODE_OFFSET)  # (tm,) f32
                        lo, hi = mx_decode_pair(load_codes(ac_smem.at[a_rows, pl.ds(b * _HALF, _HALF)]), a_mult)
                        plgpu.wgmma(acc_ref, lo, wdec.at[wg, slot, 2 * b].transpose((1, 0)))
                        plgpu.wgmma(acc_ref, hi, wdec.at[wg, slot, 2 * b + 1].transpose((1, 0)))
                    # One buffer: this step's wgmma must finish before the next step overwrites it. Two: the previous
                    # step's must finish before the next step overwrites *its* buffer.
                    plgpu.wgmma_wait(0 if cfg.wdec_slots == 1 else wgmma_groups)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    ac_gmem.at[cta_m_slice, :], as_gmem.at[:, cta_m_slice],
                    wc_gmem.at[cta_n_slice, :], ws_gmem.at[:, cta_n_slice],
                    allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    tiles = m_iters * n_iters
    num_ctas = min(cfg.num_ctas or _num_sms(), tiles)
    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_ctas,),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({} if interpret is None else {"interpret": interpret}),
    )
    args = (ac, as_t, wc, ws_t) + ((bias,) if has_bias else ())
    return f(*args)


# ---------------------------------------------------------------------------------------------------------------------
# Wrapper and reference
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "impl", "interpret"))
def w4a4_matmul_mgpu(a: Union[QuantizedArray, MgpuOperand], w: Union[QuantizedArray, MgpuOperand], *,
                     bias: Optional[jax.Array] = None, config: Optional[MgpuGemmConfig] = None,
                     out_dtype=jnp.bfloat16, impl: Optional[str] = None, interpret: Any = None) -> jax.Array:
    """``dequant(a) @ dequant(w)^T [+ bias]`` with the Mosaic GPU kernel.

    Args:
      a: activations ``(m, k)``, MXFP4 ``QuantizedArray`` (or a prepared :class:`MgpuOperand`).
      w: weights ``(n, k)``, the same (prepare once with :func:`prepare_operand` to skip the per-call transpose of
        its scales and any padding).
      bias: ``(n,)`` or ``None`` (added in f32 in the epilogue).
      config: :class:`MgpuGemmConfig` (default :func:`default_config`).
      out_dtype: ``bfloat16`` (default) or ``float32``.
      impl: ``None`` (the kernel on a GPU, the jnp reference elsewhere), ``"pallas"`` (the kernel; with
        ``interpret`` set, GPU interpret mode on the CPU) or ``"reference"``.
      interpret: passed to ``plgpu.kernel(interpret=...)`` (an ``InterpretGPUParams``; tests only).

    Returns:
      ``(m, n)`` in ``out_dtype``.
    """
    for q, what in ((a, "a"), (w, "w")):
        if not isinstance(q, MgpuOperand):
            _check_mx(q, what)
    a_shape, w_shape = tuple(a.shape), tuple(w.shape)
    (m, k), (n, k_w) = a_shape, w_shape
    if k != k_w:
        raise ValueError(f"reduction lengths differ: a {a_shape}, w {w_shape}")
    if k % BLOCK:
        raise ValueError(f"k={k} must be a multiple of {BLOCK}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {bias.shape} must be ({n},)")
    if impl is None:
        impl = "pallas" if (interpret is not None or on_gpu()) else "reference"
    if impl not in ("pallas", "reference"):
        raise ValueError(f"impl={impl!r} must be None, 'pallas' or 'reference'")
    cfg = config or default_config(m, n, k, _num_sms())
    if impl == "reference":
        return w4a4_matmul_mgpu_reference(a, w, bias=bias, out_dtype=out_dtype)
    smem = cfg.smem_bytes(jnp.dtype(out_dtype).itemsize)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {smem} bytes of shared memory for out_dtype={jnp.dtype(out_dtype).name}, "
                         f"Hopper gives a CTA {SMEM_LIMIT}: fewer max_concurrent_steps, wdec_slots or a smaller tile")
    ap = prepare_operand(a, rows_multiple=cfg.cta_m, k_multiple=cfg.tile_k, what="a")
    wp = prepare_operand(w, rows_multiple=cfg.cta_n, k_multiple=cfg.tile_k, what="w")
    if ap.codes.shape[1] != wp.codes.shape[1]:
        raise ValueError(f"padded K differ: a {ap.codes.shape}, w {wp.codes.shape}")
    b = None
    if bias is not None:
        b = jnp.pad(bias.astype(jnp.float32), (0, wp.codes.shape[0] - n))
    y = _call(ap.codes, ap.scales_t, wp.codes, wp.scales_t, b, cfg=cfg, out_dtype=jnp.dtype(out_dtype),
              interpret=interpret)
    return y if y.shape == (m, n) else y[:m, :n]


def _operand_f32_blocks(q: Union[QuantizedArray, MgpuOperand]) -> jax.Array:
    """Exact f32 values through ``fp4_tile.mx_decode_pair``, as ``(rows, k/32, 32)`` in the kernel's per-block K order
    ``[lo 0..15 | hi 0..15]``."""
    op = prepare_operand(q)
    rows, k = op.codes.shape[0], 2 * op.codes.shape[1]
    codes = op.codes.reshape(rows * (k // BLOCK), _HALF)
    mult = _MX.scale_factors(op.scales_t.T.reshape(-1), F16_DECODE_OFFSET)
    lo, hi = mx_decode_pair(codes, mult)
    return jnp.concatenate([lo, hi], axis=1).astype(jnp.float32).reshape(rows, k // BLOCK, BLOCK)


def w4a4_matmul_mgpu_reference(a, w, *, bias: Optional[jax.Array] = None, out_dtype=jnp.float32) -> jax.Array:
    """jnp mirror of the kernel (the same decode, K in the kernel's per-block ``lo | hi`` order), f32 accumulation."""
    m, n = a.shape[0], w.shape[0]
    av, wv = _operand_f32_blocks(a), _operand_f32_blocks(w)
    y = jnp.einsum("mbk,nbk->mn", av, wv, precision="highest", preferred_element_type=jnp.float32)[:m, :n]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)
