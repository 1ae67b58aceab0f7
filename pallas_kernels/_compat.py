"""Small jax-version shims for the Pallas kernels (CPU CI runs jax 0.10.x, the H200 machine jax 0.11.x).

Only public APIs are used. The Pallas Triton lowering (``jax.experimental.pallas.triton``) has the same surface in
both versions (``CompilerParams(num_warps, num_stages)``, ``load``/``store`` with ``mask``/``other``).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["pl", "pltriton", "triton_compiler_params", "on_gpu"]


def triton_compiler_params(num_warps: int, num_stages: int):
    """``CompilerParams`` of the Pallas Triton lowering (selects that lowering on GPU)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def on_gpu(x=None) -> bool:
    """Whether ``x`` (or, without ``x``, the default backend) lives on a CUDA GPU."""
    if x is not None:
        try:
            devices = x.devices()
        except Exception:  # noqa: BLE001 - tracers and abstract values have no devices
            devices = None  # a tracer: fall back to the default backend
        if devices:
            return all(d.platform == "gpu" for d in devices)
    return jax.default_backend() == "gpu"
