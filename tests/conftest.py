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
