"""Loads a script of ``benchmarks/`` (a folder of scripts, not a package) as a module, for the tests that run them."""

import importlib.util
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``load_benchmark("dit_forward_w4a4")`` -> the module of ``benchmarks/dit_forward_w4a4.py``."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
