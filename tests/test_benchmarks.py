"""Smoke runs of the benchmark mains on their tiny presets, as subprocesses (tests never import a benchmark module):
each must finish, write its JSON, and record what it claims to (methods, finite outputs, flop counts). The forward
benchmark of the quantized DiT has its own run in tests/test_fused_hooks.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_w4a4_bench_cupti_timer_records_method_and_breakdown(tmp_path):
    """``--timer cupti`` through kroquant_jax.timing.device_time: on the CPU the profiler sees no GPU kernels, so
    every record falls back to wall clock, with an empty per-kernel breakdown."""
    out = tmp_path / "w4a4.json"
    _run("w4a4_bench.py", "--tiny", "--interpret", "--no-sweep", "--no-epilogues", "--no-layer", "--variants",
         "bf16_xla", "--timer", "cupti", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["timer"] == "cupti" and "CUPTI" in result["method"]
    records = [v for c in result["cases"] for v in c["variants"]]
    assert len(records) == 4  # 2 tiny shapes x m in (40, 16)
    for rec in records:
        assert "error" not in rec, rec
        assert rec["timing"] == "wallclock" and rec["kernels_us"] == {}  # no GPU here
        assert rec["us"] > 0 and rec["rel_err"] < 1e-2


def test_ideogram4_serving_tiny_run(tmp_path):
    out = tmp_path / "bench.json"
    _run("ideogram4_serving.py", "--preset", "tiny", "--layouts", "packed", "--steps", "2", "--repeats", "1",
         "--inner", "1", "--out", str(out))
    saved = json.loads(out.read_text())
    packed = saved["layouts"]["packed"]
    assert packed["errors"] == {} and packed["tokens"] == 6 + 16
    assert set(packed["timings"]) == {"forward", "cfg_step", "loop"} and packed["timings"]["loop"]["finite"]
    assert packed["timings"]["forward"]["median_ms"] > 0 and packed["flops"]["forward"]["total"] > 0


def test_ideogram4_serving_torch_baseline_times_diffusers_model(tmp_path):
    """``--torch-baseline`` builds diffusers' own Ideogram4Transformer2DModel (tiny config) and times it."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    out = tmp_path / "torch.json"
    _run("ideogram4_serving.py", "--preset", "tiny", "--torch-baseline", "--repeats", "1", "--inner", "1",
         "--out", str(out))
    saved = json.loads(out.read_text())
    assert saved["model"] == "diffusers.Ideogram4Transformer2DModel" and saved["errors"] == {}
    assert set(saved["timings_ms"]) == {"eager/padded", "eager/packed"}
    assert all(t["median_ms"] > 0 for t in saved["timings_ms"].values())
