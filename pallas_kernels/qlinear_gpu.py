"""Packed forward of :class:`kroquant_jax.qlinear.QuantizedLinear` (paper eq. 11) from the GPU kernels.

    y = Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b

* ``Q(x T)``: the fused transform + quantizer (:func:`pallas_kernels.transform_quantize.transform_quantize`), one
  pass over ``x``: K2 (Kronecker-LU parameters rebuilt in registers) when the layer kept its ``transform_params``,
  else K1 on the stored blocks (``n = 32``), Scale for a diagonal, Q4 for the identity, FWHT for ``"fwht"``.
* the W4A4 product and the low-rank epilogue: :func:`pallas_kernels.w4a4_gemm.w4a4_linear`.
* ``x T`` for the 16-bit low-rank branch (only if the layer has one): XLA (``reference_apply``), bf16.

Numerics follow ``qlinear_forward(path="packed")``: ``Q`` is applied to the f32 product ``x T`` (no rounding to
``x.dtype`` first, ``round_to_input=False``). Off the GPU, ``impl="reference"`` (the default there) runs the jnp
references of both kernels, ``impl="interpret"`` the kernel bodies in Pallas interpret mode.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import transform_quantize as tq
from pallas_kernels import w4a4_gemm
from pallas_kernels._compat import on_gpu

__all__ = ["prepare_layer_transform", "qlinear_forward_gpu"]


def prepare_layer_transform(layer, kernel: Optional[str] = None) -> tq.PreparedTransform:
    """The :class:`~pallas_kernels.transform_quantize.PreparedTransform` of a layer's online transform ``T``.

    ``kernel="k1"`` forces the dense-block kernel for Kronecker transforms even if the parameters are kept.
    """
    cfg = layer.config
    name, d = cfg.transform, cfg.in_features
    if name in ("identity", "fwht"):
        return tq.prepare(name, d=d)
    if layer.transform_params is not None:
        return tq.prepare(name, layer.transform_params, d=d, kernel=kernel)
    blocks = jnp.asarray(layer.blocks, jnp.float32)
    if blocks.shape[1:] == (1, 1):
        return tq.PreparedTransform.from_inv_scale(blocks[:, 0, 0])
    return tq.PreparedTransform.from_blocks(blocks)


def qlinear_forward_gpu(layer, x: jax.Array, *, impl: Optional[str] = None, kernel: Optional[str] = None,
                        lowrank_mode: str = "fused", compute: str = "bf16",
                        quant_block_sizes: Optional[tq.BlockSizes] = None) -> jax.Array:
    """Eq. 11 on packed operands with the Pallas kernels.

    Args:
      layer: a ``QuantizedLinear`` whose weight (and low-rank factors) are packed.
      x: ``(..., d)`` activations, bf16 or fp16 for the kernels.
      impl: ``None`` (kernels on a GPU, references elsewhere), ``"pallas"``, ``"interpret"`` or ``"reference"``.
      kernel: ``"k1"`` to force dense blocks for Kronecker transforms.
      lowrank_mode, compute: passed to :func:`pallas_kernels.w4a4_gemm.w4a4_linear`.
      quant_block_sizes: tiling of the transform+quantize kernel.

    Returns:
      ``(..., o)`` in ``x.dtype``.
    """
    cfg = layer.config
    if x.shape[-1] != cfg.in_features:
        raise ValueError(f"qlinear_forward_gpu: input of shape {x.shape} does not match in_features="
                         f"{cfg.in_features}")
    if impl is None:
        impl = "pallas" if on_gpu(x) else "reference"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cfg.in_features)
    if x2.dtype not in (jnp.bfloat16, jnp.float16):
        x2 = x2.astype(jnp.bfloat16)
    t = prepare_layer_transform(layer, kernel)
    x_q = tq.transform_quantize(x2, t, cfg.act_fmt, block_sizes=quant_block_sizes, impl=impl,
                                round_to_input=False)
    x_t = tq.reference_apply(x2, t) if layer.lowrank_left is not None else x2
    if impl == "reference":
        y = w4a4_gemm.w4a4_linear_reference(layer, x_t, x_q)
    else:
        y = w4a4_gemm.w4a4_linear(layer, x_t, x_q, lowrank_mode=lowrank_mode, compute=compute,
                                  out_dtype=jnp.float32, interpret=impl == "interpret")
    return y.reshape(*lead, cfg.out_features).astype(x.dtype)
