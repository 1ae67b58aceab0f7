"""Mosaic GPU kernels on the CPU: jax's GPU interpret mode, with ``wgmma`` extended to the operand forms it lacks.

jax 0.10.2 ships a GPU interpret mode for ``plgpu.kernel`` (``interpret=InterpretGPUParams(...)``; the class is not
public, hence the private imports here, in tests only). It simulates the CTAs, warpgroup threads, shared memory, TMA
copies and barriers on the CPU, with a shared-memory race detector, and executes ``wgmma`` synchronously. Its
``wgmma`` reads both operands from shared memory through index transforms only, so a kernel whose ``A`` operand is a
register array (jax's mixed-type Hopper kernel and ``pallas_kernels/w4a4_gemm_mgpu.py``) or whose ``B`` operand is a
transposed view (``ref.transpose((1, 0))``) fails there. Nor does it interpret a store into a ``wgmma`` accumulator
(``acc_ref[...] = v``, which ``pallas_kernels/fp8_gemm_mgpu.py`` uses to scale its accumulator between ``wgmma`` s).
:func:`gpu_interpret` installs, for the duration of a ``with`` block, a ``wgmma`` with the same semantics
(``acc += a @ b`` in the accumulator's dtype) that also takes those two forms, and the accumulator store; it
compiles each simulated thread's program once per kernel call instead of once per thread and CTA; and it hands the
interpreter's host callbacks (one per memory access, barrier and allocation of every simulated thread) their arguments
as numpy copies instead of jax Arrays (one ``device_put`` each).

``available()`` says whether this jax has the pieces (else the tests that need them skip, naming the reason).
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import jax
import numpy as np
from jax.experimental import io_callback

try:  # private, version-specific: tests only
    from jax._src import callback as _jcallback
    from jax._src import core as _jcore
    from jax._src.pallas.mosaic.interpret import thread_map as _tmap
    from jax._src.pallas.mosaic.interpret import utils as _iutils
    from jax._src.pallas.mosaic_gpu import primitives as _gprim
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as _gcb
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _ipc
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as _jinterp
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    _WGMMA_PARAMS = set(inspect.signature(_gcb.wgmma).parameters)
    _REASON = None
    if not {"device_id", "thread_id", "a_allocation_key_as_array", "b_transforms"} <= _WGMMA_PARAMS:
        _REASON = f"GPU interpret mode's wgmma callback has an unknown signature in jax {jax.__version__}"
    elif not hasattr(_gprim, "wgmma_accumulator_store_p"):
        _REASON = f"jax {jax.__version__} has no wgmma accumulator store"
    elif list(inspect.signature(_tmap._run_jaxpr).parameters) != ["jaxpr", "consts", "args"]:
        _REASON = f"GPU interpret mode's thread runner has an unknown signature in jax {jax.__version__}"
except ImportError as e:  # pragma: no cover - other jax versions
    InterpretGPUParams = None
    _REASON = f"jax {jax.__version__} has no GPU interpret mode for Mosaic GPU ({e})"


def available() -> tuple[bool, str]:
    return _REASON is None, _REASON or ""


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
           acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
           source_info=None):
    """``acc += a @ b`` like ``gpu_callbacks.wgmma``, where ``a`` may be a register array and ``b`` a transposed
    shared-memory view (a trailing ``TransposeTransform`` after the index transforms)."""
    device_id, thread_id = int(device_id), int(thread_id)
    shared_memory = _gcb._get_shared_memory()
    gtid = shared_memory.get_global_thread_id(device_id, thread_id)
    info = _iutils.GPULoggingInfo(device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                  thread_id=thread_id, source_info=source_info)

    def read(key, transforms):
        transforms = jax.tree.map(int, _gcb._remove_noop_transforms(transforms))
        perm = None
        if transforms and type(transforms[-1]).__name__ == "TransposeTransform":
            perm, transforms = tuple(transforms[-1].permutation), transforms[:-1]
        x, _, _ = shared_memory.get_buffer_content(_gcb.HostAllocationKey.from_array(key),
                                                   _iutils.to_range(transforms), gtid, logging_info=info)
        assert x is not None
        return x if perm is None else np.transpose(x, perm)

    a_raw = np.asarray(a_allocation_key_as_array)
    if np.issubdtype(a_raw.dtype, np.integer) and a_raw.shape == (5,):  # an allocation key: shared memory
        a = read(a_allocation_key_as_array, a_transforms)
    else:  # a register operand (its value)
        a = a_raw
    b = read(b_allocation_key_as_array, b_transforms)
    acc_range = _iutils.to_range(jax.tree.map(int, _gcb._remove_noop_transforms(acc_transforms)))
    acc_key = _gcb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, gtid, logging_info=info)
    shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), gtid,
                                       logging_info=info)
    return token


def _accumulator_store(value, *, device_id, thread_id, acc_allocation_key_as_array):
    """``acc_ref[...] = value``: the accumulator (an allocation of the interpreter's shared memory) overwritten."""
    shared_memory = _gcb._get_shared_memory()
    gtid = shared_memory.get_global_thread_id(int(device_id), int(thread_id))
    key = _gcb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    shared_memory.store_buffer_content(key, (), np.asarray(value), gtid)
    return np.asarray(value)


_COMPILED: dict = {}
_COMPILE_LOCK = threading.Lock()


def _run_jaxpr_compiled_once(jaxpr, consts, *args):
    """``thread_map._run_jaxpr``: runs a simulated thread's program, compiled once per program and argument types.
    jax's own lowers and compiles it again for every thread of every CTA (an AOT ``.lower().compile()`` skips the
    in-memory cache), though the threads differ only in their arguments (thread id, grid point); the programs and
    what they compute are the same."""
    leaves = jax.tree.leaves((consts, args))
    key = (jaxpr, jax.tree.structure((consts, args)), tuple((np.shape(x), np.result_type(x)) for x in leaves))
    with _COMPILE_LOCK:  # the other threads of the CTA wait for the one compile
        compiled = _COMPILED.get(key)
        if compiled is None:
            def run(jaxpr, consts, *args):
                _jcore.eval_jaxpr(jaxpr, consts, *args)

            compiled = _COMPILED[key] = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
    compiled(consts, *args)


def _io_callback_on_host(*args, result_avals, callback, sharding, ordered):
    """``callback.io_callback_impl`` with the host arguments as numpy copies (jax's copies each into a jax Array
    first); the results as there, numpy arrays."""
    del result_avals, sharding, ordered
    return jax.tree.map(np.asarray, callback(*(np.array(a) for a in args)))


# the implementation this replaces, if it has the expected signature (else jax's own stays)
_IO_CALLBACK_IMPL = ["args", "result_avals", "callback", "sharding", "ordered"]


def _arithmetic_or_accumulator_store(orig):
    def interpret(self, eqn, get_invals):
        if eqn.primitive is not _gprim.wgmma_accumulator_store_p:
            return orig(self, eqn, get_invals)
        acc, value = get_invals()
        return io_callback(
            _accumulator_store, jax.ShapeDtypeStruct(value.shape, value.dtype), value, ordered=True,
            device_id=self.device_info.device_id, thread_id=self.thread_id, acc_allocation_key_as_array=acc)
    return interpret


@contextlib.contextmanager
def gpu_interpret(detect_races: bool = True):
    """Yields the ``InterpretGPUParams`` to pass as ``interpret=``, with the extended ``wgmma`` installed; on exit the
    original callback is restored and the interpreter's state reset. ``races_found()`` after a run says whether the
    race detector fired."""
    ok, reason = available()
    if not ok:
        raise RuntimeError(reason)
    orig, orig_arith, orig_run = _gcb.wgmma, _jinterp.JaxprInterpreter._interpret_arithmetic_primitive, _tmap._run_jaxpr
    orig_io = _jcallback.io_callback_impl
    _gcb.wgmma = _wgmma
    _jinterp.JaxprInterpreter._interpret_arithmetic_primitive = _arithmetic_or_accumulator_store(orig_arith)
    _tmap._run_jaxpr = _run_jaxpr_compiled_once
    if list(inspect.signature(orig_io).parameters) == _IO_CALLBACK_IMPL:
        _jcallback.io_callback_impl = _io_callback_on_host
    try:
        yield InterpretGPUParams(detect_races=detect_races)
    finally:
        _gcb.wgmma = orig
        _jinterp.JaxprInterpreter._interpret_arithmetic_primitive = orig_arith
        _tmap._run_jaxpr = orig_run
        _jcallback.io_callback_impl = orig_io
        _COMPILED.clear()
        _ipc.reset_gpu_interpret_mode_state()


def races_found() -> bool:
    return bool(_ipc.get_races().races_found)


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess runner. The interpreter runs each simulated thread as its own XLA:CPU program; XLA:CPU's
# concurrency-optimized thunk scheduler can then deadlock them (seen here on 2 cores: a warp-specialized pipeline
# with two scratch buffers hung with 1-2 CPU seconds used; --xla_cpu_enable_concurrency_optimized_scheduler=false
# fixes it). XLA flags are read once per process, so the kernel tests run in a subprocess with that flag, under a
# timeout.
# ---------------------------------------------------------------------------------------------------------------------

XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def run_in_subprocess(cases: list[dict], timeout_s: float = 600.0) -> list[dict]:
    """Runs each case in a fresh interpreter process (:func:`_run_fp8_case` for ``kind="fp8"``, else
    :func:`_run_w4a4_case`); returns their result dicts."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_FLAG).strip()
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != len(cases):
        raise RuntimeError(f"interpret subprocess failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return [json.loads(ln[len("RESULT "):]) for ln in lines]


# The cases' inputs: drawn with numpy's generator (jax.random's threefry, compiled per shape, took about a second of
# each case) and encoded by one jitted program per operand shape, shared by the cases of that shape.
_PROGRAMS: dict = {}


def _program(name: str):
    """The jitted input programs, made on first use (this module loads in the test process too)."""
    if not _PROGRAMS:
        import jax.numpy as jnp

        from kroquant_jax import fp8_encoding as FE
        from kroquant_jax.formats import MXFP4, dequantize, quantize

        def w4a4_reference(qa, qw, bias):  # the exact product of the fake-quantized operands, and of their magnitudes
            ah, wh = dequantize(qa, jnp.float32), dequantize(qw, jnp.float32)
            ref = jnp.matmul(ah, wh.T, precision="highest")
            p = jnp.matmul(jnp.abs(ah), jnp.abs(wh).T, precision="highest")
            return (ref, p) if bias is None else (ref + bias, p + jnp.abs(bias))

        _PROGRAMS.update(
            quantize=jax.jit(lambda x: quantize(x, MXFP4())),
            e4m3=jax.jit(lambda x, group: FE.mxfp4_to_e4m3(quantize(x, MXFP4()), order="even_odd", group=group),
                         static_argnums=1),
            w4a4_reference=jax.jit(w4a4_reference))
    return _PROGRAMS[name]


def _normal(rng, shape, scale):
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def _run_w4a4_case(case: dict) -> dict:
    """One ``w4a4_matmul_mgpu`` run in GPU interpret mode against the exact product of the fake-quantized operands:
    the largest difference relative to the tested bound (<= 1 passes), NaN/Inf count, race detector."""
    import jax.numpy as jnp

    from pallas_kernels import w4a4_gemm_mgpu as M

    m, n, k = case["m"], case["n"], case["k"]
    rng = np.random.default_rng(case.get("seed", 0))
    a = _normal(rng, (m, k), 2.0)
    a[:, 5] *= 80.0  # outliers, a huge value, a zero block
    a[1, 40] = -3.0e3
    a[0, 0:32] = 0.0
    a[min(2, m - 1), 32:64] *= np.float32(1e-20)  # a tiny block
    w = _normal(rng, (n, k), 0.05)
    bias = jnp.asarray(_normal(rng, (n,), 1.0)) if case.get("bias") else None
    qa, qw = _program("quantize")(a), _program("quantize")(w)
    cfg = M.MgpuGemmConfig(**case["config"])
    ref, p = _program("w4a4_reference")(qa, qw, bias)
    w_in = M.prepare_operand(qw, rows_multiple=cfg.cta_n) if case.get("prepared") else qw
    with gpu_interpret() as params:
        out = M.w4a4_matmul_mgpu(qa, w_in, bias=bias, config=cfg, impl="pallas", interpret=params,
                                 out_dtype=jnp.float32)
        out = np.asarray(jax.block_until_ready(out))
        races = races_found()
    bound = np.asarray(2 * (k + 1) * 2.0**-24 * np.asarray(p) + 1e-30)
    err = np.abs(out - np.asarray(ref))
    return {"shape": list(out.shape), "max_err_over_bound": float(np.max(err / bound)),
            "max_abs_err": float(np.max(err)), "nonfinite": int(np.sum(~np.isfinite(out))), "races": races}


def _run_fp8_case(case: dict) -> dict:
    """One ``fp8_matmul_mgpu`` run (the fused FP8 GEMM: row/column powers of two, bias, low-rank ``h L^T``) in GPU
    interpret mode against the float64 eq. 11 product of the same operands (``fp8_gemm.fp8_matmul_reference``): the
    largest difference relative to the f32-summation bound (<= 1 passes), NaN/Inf count, race detector."""
    import jax.numpy as jnp

    from kroquant_jax import fp8_encoding as FE
    from pallas_kernels import fp8_gemm as G
    from pallas_kernels import fp8_gemm_mgpu as F

    m, n, k, r = case["m"], case["n"], case["k"], case.get("rank", 0)
    rng = np.random.default_rng(case.get("seed", 0))
    a = _normal(rng, (m, k), 2.0)
    a[:, 5] *= 80.0  # outliers, a huge value, a zero block
    a[1, 40] = -3.0e3
    a[0, 0:32] = 0.0
    a[min(2, m - 1), 32:64] *= np.float32(1e-3)  # a small block (inside the 14-binade span)
    w = _normal(rng, (n, k), 0.05)
    if case.get("zero_scale_rows"):  # all-zero rows whose factor a caller's encoder left at 0 (the kernel takes 1),
        # and one with the smallest factor 2**-126 beside a non-zero h (h / sa would overflow; the kernel never forms
        # it)
        a[m - 2:] = 0.0
        w[n - 1] = 0.0
    if case.get("row_group"):  # scales per group of K values: blocks far apart in one row, a group of zeros
        a[min(3, m - 1), : k // 4] *= np.float32(2.0**-30)
        a[min(4, m - 1), k // 2:] = 0.0
    a8 = _program("e4m3")(a, case.get("row_group"))
    w8 = _program("e4m3")(w, None)
    if case.get("zero_scale_rows"):  # the last row's factor 0
        a8, w8 = (FE.Fp8Rows(x8.values, jnp.asarray(np.concatenate([np.asarray(x8.scale)[:-1], [0.0]]), jnp.float32),
                             x8.inexact, x8.order) for x8 in (a8, w8))
    bias = jnp.asarray(_normal(rng, (n,), 1.0)) if case.get("bias") else None
    lowrank = None
    if r:
        lowrank = (jnp.asarray(_normal(rng, (m, r), 0.5).astype(jnp.bfloat16)),
                   jnp.asarray(_normal(rng, (n, r), 0.1).astype(jnp.bfloat16)))
    cfg = F.Fp8MgpuConfig(**case["config"])
    group = case.get("swiglu_group")
    with gpu_interpret() as params:
        out = F.fp8_matmul_mgpu(a8, w8, lowrank=lowrank, bias=bias, config=cfg, impl="pallas", interpret=params,
                                out_dtype=jnp.float32, swiglu_group=group)
        out = np.asarray(jax.block_until_ready(out))
        races = races_found()
    ref = G.fp8_matmul_reference(a8, w8, lowrank=lowrank, bias=bias)  # float64
    # the same product of the magnitudes (the bound's scale); |E4M3| and |bf16| values are exact in their types
    absolute = lambda x: None if x is None else np.abs(np.asarray(x, np.float32))  # noqa: E731
    magnitudes = lambda x8: FE.Fp8Rows(np.abs(np.asarray(x8.values)), x8.scale, x8.inexact, x8.order)  # noqa: E731
    p = G.fp8_matmul_reference(magnitudes(a8), magnitudes(w8),
                               lowrank=None if lowrank is None else (absolute(lowrank[0]), absolute(lowrank[1])),
                               bias=absolute(bias))
    bound = 2 * (k + r + 2) * 2.0**-24 * p + 1e-30
    if group is not None:  # SiLU(g) u in float64 on the halves; the GEMM's bound carried through it, plus its rounding
        split = lambda x: np.asarray(x, np.float64).reshape(m, n // group, 2, group // 2)  # noqa: E731
        (g, u), (bg, bu) = (np.moveaxis(split(x), 2, 0) for x in (ref, bound))
        silu = g / (1.0 + np.exp(-g))
        ref = (silu * u).reshape(m, n // 2)
        bound = (1.1 * np.abs(u) * bg + np.abs(silu) * bu + 8 * 2.0**-24 * np.abs(ref.reshape(g.shape))
                 ).reshape(m, n // 2) + 1e-30
    err = np.abs(out - ref)
    return {"shape": list(out.shape), "max_err_over_bound": float(np.max(err / bound)),
            "max_abs_err": float(np.max(err)), "nonfinite": int(np.sum(~np.isfinite(out))), "races": races}


if __name__ == "__main__":
    import json
    import sys

    for c in json.loads(sys.argv[1]):
        run = _run_fp8_case if c.get("kind") == "fp8" else _run_w4a4_case
        print("RESULT " + json.dumps(run(c)), flush=True)
