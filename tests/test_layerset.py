"""The stacked-stage driver of kroquant_jax/layerset.py: run_groups over shape groups (LoRaQ, SVDQuant, SmoothQuant)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kroquant_jax import layerset
from kroquant_jax.layerset import RunConfig


@pytest.mark.parametrize("max_per_program, pad_to, progress", [(1, 1, False), (8, 4, True)])
def test_run_groups_gives_each_name_its_own_outputs(max_per_program, pad_to, progress, capsys):
    arrays = {"a": np.ones((2, 3)), "b": np.full((4, 3), 2.0), "c": np.arange(6.0).reshape(2, 3)}
    calls = []

    def fn(x):  # (L, r, c) -> ((L,), (L, r, c))
        calls.append(x.shape)
        return x.sum(axis=(1, 2)), x * 2

    groups = layerset.group_by_shape(arrays)
    out = layerset.run_groups(jax.jit(fn), groups, lambda names: [np.stack([arrays[n] for n in names])],
                              max_per_program=max_per_program, run=RunConfig(shard=False, progress=progress),
                              pad_to=pad_to, desc="test stage")
    assert list(out) == ["a", "c", "b"]  # the order of the groups
    for name, x in arrays.items():
        total, doubled = out[name]
        assert isinstance(doubled, np.ndarray) and total == x.sum()
        np.testing.assert_array_equal(doubled, 2 * x)
    # every program (a trace of fn) is sized for min(pad_to, max_per_program) layers: padded up, or chunked
    assert {shape[0] for shape in calls} == {min(pad_to, max_per_program)}
    assert {shape[1:] for shape in calls} == {(2, 3), (4, 3)}
    assert ("test stage" in capsys.readouterr().err) == progress


def test_a_layer_alone_in_its_shape_runs_in_a_program_of_two():
    """A one-job program compiles to other float rounding than a batch (a LoRaQ fit came out other on XLA:CPU), so
    a job alone in its shape is padded to 2 (its result then equals the batched one); ``max_per_program=1`` (asked
    for explicitly, e.g. the one-layer-at-a-time speed baseline) keeps programs of one."""
    seen = []

    def fn(x):
        seen.append(x.shape[0])
        return x * 2

    out = layerset.run_stacked(jax.jit(fn), [np.ones((1, 3))], 1, max_per_program=64, shard=False)
    assert seen == [2] and np.asarray(out).shape == (1, 3)
    layerset.run_stacked(jax.jit(lambda x: x + 0), [np.ones((1, 3))], 1, max_per_program=1, shard=False)
    with pytest.raises(ValueError, match="needs at least 3 activation rows"):
        layerset.validate_layer("x", (np.ones((8, 32), np.float32), None, np.ones((2, 32), np.float32)))


@pytest.mark.parametrize("flags, kept", [
    ("", True),
    ("--xla_gpu_autotune_level=4", False),
    ("--xla_cpu_use_thunk_runtime=true  --xla_gpu_autotune_level 2", False),
    ("--xla_gpu_autotune_level_extra=1", True),  # another flag that only starts the same way
])
def test_engine_compiler_options_never_override_the_users_xla_flags(flags, kept, monkeypatch):
    monkeypatch.setattr(layerset, "ENGINE_XLA_OPTIONS", {"xla_gpu_autotune_level": 0,
                                                         "xla_gpu_enable_triton_gemm": False})
    opts = layerset.engine_compiler_options(flags)
    assert ("xla_gpu_autotune_level" in opts) == kept
    assert opts["xla_gpu_enable_triton_gemm"] is False  # not in the flags: kept
    assert layerset.engine_compiler_options("") == layerset.ENGINE_XLA_OPTIONS


_PROGRAMS_SCRIPT = r"""
import os, sys
import numpy as np
import kroquant_jax.layerset as ls
ls.ENGINE_XLA_OPTIONS["xla_no_such_option"] = 1  # before the engine's programs are made: every compile must see it
from kroquant_jax import calibrate, formats, gptq, lowrank, smoothquant, synthetic
run = ls.RunConfig(num_rows=48, num_validation=16, num_test=16, shard=False)
layers = synthetic.synthetic_layer_set({"x": (32, 64)}, n=80)
w = {"x": layers["x"].weight}
stages = {
    "calibration": lambda: calibrate.calibrate_layers(layers, calibrate.CalibrationConfig(steps=2), run=run),
    "loraq": lambda: lowrank.loraq_layers(w, lowrank.LoRaQConfig(rank=32, steps=1, rotation_steps=1), run=run),
    "svdquant": lambda: lowrank.svdquant_layers(w, None, lowrank.SVDQuantConfig(rank=4), run=run),
    "smoothquant": lambda: smoothquant.smoothquant_layers(layers, smoothquant.SmoothQuantConfig(alphas=(0.5,),
                                                                                               betas=(0.5,)), run=run),
    "gptq": lambda: gptq.gptq_layers(w, {"x": np.eye(64, dtype=np.float32)}, formats.MXFP4(), run=run),
}
for name, stage in stages.items():
    try:
        stage()
        print(name, "compiled without the option")
    except Exception as err:  # noqa: BLE001
        print(name, "refused" if "xla_no_such_option" in str(err) else f"other error: {err}")
"""


def test_every_engine_program_is_compiled_with_the_engine_options():
    """A made-up option added to ENGINE_XLA_OPTIONS makes XLA refuse every stacked program of the engine: the options
    reach each program's compilation (a program made with a plain jax.jit would compile)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _PROGRAMS_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines == {s: "refused" for s in ("calibration", "loraq", "svdquant", "smoothquant", "gptq")}, lines


def test_engine_options_leave_results_unchanged(monkeypatch):
    """The calibration program compiled by engine_jit (with GPU compile options such as the probe's variants) and
    under a plain jax.jit give the same results on the CPU, bit for bit (on the GPU other kernels round differently,
    docs/calibration.md "Where the GPU compile time goes")."""
    from kroquant_jax import calibrate, synthetic, transforms
    from kroquant_jax.layerset import program_config

    run = RunConfig(num_rows=48, num_validation=16, num_test=16, shard=False)
    layers = synthetic.synthetic_layer_set({"a": (32, 64), "b": (32, 64)}, n=80)
    rows = [calibrate.layer_rows(n, layers[n], run) for n in layers]
    param = transforms.get("kron_lu")
    args = [layerset.stack_trees([param.init(64)] * 2)] + [np.stack([r[i] for r in rows]) for i in range(3)]
    args.append(np.stack([layers[n].weight for n in layers]))
    static = dict(parameterization=param, cfg=program_config(calibrate.CalibrationConfig(steps=3)))
    monkeypatch.setattr(layerset, "ENGINE_XLA_OPTIONS", {"xla_gpu_autotune_level": 0,
                                                         "xla_gpu_enable_triton_gemm": False})
    names = ("parameterization", "cfg")
    with_options = layerset.engine_jit(calibrate.calibration_program.__wrapped__, static_argnames=names)
    plain = jax.jit(calibrate.calibration_program.__wrapped__, static_argnames=names)
    for x, y in zip(jax.tree.leaves(with_options(*args, **static)), jax.tree.leaves(plain(*args, **static))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
