"""Shared pytest setup: GPU-only tests (marker ``gpu``) are skipped unless JAX sees a GPU."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share one GPU: JAX's default preallocation (75% of the memory per process) makes all but
    # the first fail with CUDA_ERROR_OUT_OF_MEMORY (seen on the H200 with `-n 14`, 2026-11-30). Set before jax loads.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
