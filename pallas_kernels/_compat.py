"""Small jax-version shims for the Pallas kernels (CPU CI runs jax 0.10.x, the H200 machine jax 0.11.x).

Only public APIs are used. The Pallas Triton lowering (``jax.experimental.pallas.triton``) has the same surface in
both versions (``CompilerParams(num_warps, num_stages)``, ``load``/``store`` with ``mask``/``other``).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["pl", "pltriton", "triton_compiler_params", "on_gpu", "mgpu_load"]


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


def mgpu_load(ref, *, layout, optimized: bool = False):
    """``plgpu.load`` of the whole (already indexed) ``ref`` into registers of the given layout.

    jax 0.10 takes the index as a required second argument; jax 0.11 deprecates passing it (index the ref with
    ``ref.at[...]`` instead) and makes it optional.
    """
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx_param = inspect.signature(plgpu.load).parameters.get("idx")
    if idx_param is not None and idx_param.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)
