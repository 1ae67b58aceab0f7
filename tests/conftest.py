"""Shared pytest setup: GPU-only tests (marker ``gpu``) are skipped unless JAX sees a GPU; one persistent JAX
compilation cache per test session."""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share one GPU: JAX's default preallocation (75% of the memory per process) makes all but
    # the first fail with CUDA_ERROR_OUT_OF_MEMORY (seen on the H200 with `-n 14`, 2026-11-30). Set before jax loads.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


# On a machine without a GPU, XLA:CPU compiles with LLVM's optimizer off and with its older loop emitters instead of
# the MLIR fusion emitters: the suite compiles hundreds of programs over tiny arrays, so compile time dominates, and
# both cut the suite's time (docs/architecture.md, "Tests and their time"). They change code generation only, not the
# HLO. Set here, before jax is imported, so the test processes and the scripts they start inherit them; a flag the
# caller set in XLA_FLAGS is kept, and KROQUANT_TESTS_XLA_OPT=1 keeps XLA's defaults.
_CPU_COMPILE_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
if shutil.which("nvidia-smi") is None and not os.environ.get("KROQUANT_TESTS_XLA_OPT"):
    for _flag, _value in _CPU_COMPILE_FLAGS.items():
        if _flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()

_CACHE_ENV = "KROQUANT_TESTS_JAX_CACHE"


def pytest_configure(config):
    # Many tests build the same tiny models and jit fresh closures over them: XLA would compile identical programs
    # again and again. One persistent cache for the run compiles each once. The first process (the only one, or the
    # xdist controller, configured before it starts its workers) makes the folder and hands it to the workers through
    # the environment; the setting itself is process-wide jax.config, so subprocesses that tests start keep JAX's
    # defaults. KROQUANT_TESTS_NO_JAX_CACHE=1 turns it off.
    if os.environ.get("KROQUANT_TESTS_NO_JAX_CACHE"):
        return
    if _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="kroquant-tests-jax-cache-")
        config._kroquant_owns_jax_cache = True
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


def pytest_unconfigure(config):
    if getattr(config, "_kroquant_owns_jax_cache", False):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def _has_gpu() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_quantized_pixart(tmp_path_factory):
    """``(teacher dir, quantized checkpoint dir, prompt file, config)``: a 1-block, 32-wide PixArt of the testbed's
    architecture saved as a diffusers folder; all its quantizable linears W4A4 (stand-in calibration, rank-32 branch)
    in a quantized checkpoint folder with a recorded sampler (flow Euler, 2 steps, CFG 3); 2 prompts in the emoji
    testbed's prompt-file layout. For the benchmarks that compare a quantized checkpoint with its 16-bit model."""
    import dataclasses

    import jax
    import numpy as np

    from kroquant_jax.qlinear import random_qlinear
    from models import families
    from models.layers import linears
    from models.quantized_checkpoint import save_quantized_checkpoint
    from models.testbed import model as testbed

    config = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_attention_heads=2, attention_head_dim=16,
                                 num_layers=1, cross_attention_dim=32, sample_size=8, caption_channels=32)
    root = tmp_path_factory.mktemp("tiny_quantized_pixart")
    model = families.PIXART.build(config, seed=3)
    families.PIXART.to_diffusers(model, root / "teacher")
    keys = iter(jax.random.split(jax.random.key(0), 64))
    qlayers = {name: random_qlinear(np.asarray(layer.kernel[...], np.float32).T, next(keys), 32)
               for name, layer in linears(model, quantizable_only=True).items()}
    save_quantized_checkpoint(root / "quantized", model, qlayers, recipe_name="stand-in", recipe={"rank": 32},
                              extra={"solver": "flow_euler", "steps": 2, "guidance": 3.0, "shift": 1.0})
    rng = np.random.default_rng(1)
    np.savez(root / "prompts.npz", context=rng.standard_normal((2, 4, 32)).astype(np.float32),
             context_mask=np.ones((2, 4), np.float32), null_context=np.zeros((4, 32), np.float32),
             null_mask=np.ones((4,), np.float32))
    return root / "teacher", root / "quantized", root / "prompts.npz", config
